"""Reductions over the last axis and over all axes on the persistent kernel's stages (issue 14).

The CPU run of the staged program (``llvm-persistent``) runs the stages, tiles and barriers the
CUDA kernel runs, with scratch poisoned: a tile that computes more than its own elements, or a
reduction that covers less than its terms, shows up as a wrong number or a NaN. The CUDA kernel
built from the same stages cannot run here; its stages are checked for what the CPU cannot show
(lanes of a warp reducing together).
"""

import numpy as np
import pytest
import torch
from model_checks import run_poisoned

import souffle
from souffle.graph import GraphBuilder


def _param(b, rng, name, shape):
    return b.param(name, rng.standard_normal(shape).astype("float32"))


def _single(kind: str, shape):
    """One reduction op ``kind`` on an input of ``shape``, followed by an element-wise op with a
    parameter; returns the graph and its PyTorch reference."""
    rng = np.random.default_rng(0)
    b = GraphBuilder(kind)
    x = b.input("x", shape)
    n = shape[-1]
    if kind == "softmax":
        y = b.op("mul", b.op("softmax", x), _param(b, rng, "w", (n,)))
    elif kind == "layer_norm":
        y = b.op("add", b.op("layer_norm", x, _param(b, rng, "g", (n,)), _param(b, rng, "beta", (n,))),
                 _param(b, rng, "w", (n,)))
    elif kind == "global_avg_pool2d":
        y = b.op("mul", b.op("global_avg_pool2d", x), _param(b, rng, "w", (16,)))
    else:
        y = b.op("mean", x)
    graph = b.build(y)
    w = {k: torch.from_numpy(v) for k, v in graph.weights.items()}

    def reference(t):
        if kind == "softmax":
            return torch.softmax(t, -1) * w["w"]
        if kind == "layer_norm":
            return torch.nn.functional.layer_norm(t, (n,), w["g"], w["beta"]) + w["w"]
        if kind == "global_avg_pool2d":
            return t.mean((2, 3), keepdim=True) * w["w"]
        return t.mean()

    return graph, reference


def _check(graph, reference, shape, levels):
    x = np.random.default_rng(1).standard_normal(shape).astype("float32")
    expected = reference(torch.from_numpy(x))
    expected = [e.numpy() for e in (expected if isinstance(expected, list) else [expected])]
    for level in levels:
        model = souffle.compile(graph, target="llvm-persistent", opt_level=level)
        got = run_poisoned(model, {"x": x})
        for name, value, want in zip(graph.outputs, got, expected):
            np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-5, err_msg=f"O{level} {name}")


@pytest.mark.parametrize("kind,shape", [("mean", (64, 64)), ("softmax", (17,))], ids=str)
def test_a_reduction_to_one_value_covers_all_its_terms(kind, shape):
    """Issue 14: a rank-0 result's tile loop was put inside its reduction loops, so the stage
    reduced one tile's worth of terms (the mean of ones(64, 64) was 0.0078; a softmax of 17
    values summed to 15.8) at every level."""
    graph, reference = _single(kind, shape)
    _check(graph, reference, shape, levels=(0, 4))


# -- the CUDA kernel built from the same stages (compiled, not run) ---------------------------
def _cuda(kind, shape, level):
    graph, _ = _single(kind, shape)
    return souffle.compile(graph, target="cuda", opt_level=level)


@pytest.mark.parametrize("level", [0])
def test_cuda_warp_reductions_combine_their_lanes(level):
    """Each warp_reduce stage ends in a warp all-reduce (shuffles, then the result broadcast to
    the warp). Under the persistent tile loop, a stage whose rows fuse several dimensions lost
    it: its 32 lanes added into one element at once."""
    model = _cuda("softmax", (3, 10, 64), level)
    warp_stages = [s for s in model.plan.stages() if s.schedule.template == "warp_reduce"]
    assert len(warp_stages) == 2
    assert model.source.count("= __shfl_sync(") == len(warp_stages)
