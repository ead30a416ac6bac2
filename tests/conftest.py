"""Shared test helpers: run one registered op end to end on the CPU; the default suite's budget."""

import sys
from pathlib import Path

import numpy as np
import pytest

from souffle.graph import TensorSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # gpu_variants, for register_pipeline


def run_op(kind, arrays, **attrs):
    """Lower ``kind`` on placeholders shaped like ``arrays``, compile for LLVM and run it.

    Returns the output array (a list of arrays for several outputs). The lowered tensors
    must have exactly the shapes and dtypes the op's infer rule promised.
    """
    import tvm  # here, not at the top: a GPU machine runs the gpu tests without TVM
    from tvm import te

    from souffle.ops import infer_outputs, lower_op

    arrays = [np.ascontiguousarray(a) for a in arrays]
    specs = [TensorSpec(f"in{i}", a.shape, str(a.dtype)) for i, a in enumerate(arrays)]
    expected = infer_outputs(kind, specs, attrs, kind)
    placeholders = [te.placeholder(a.shape, str(a.dtype), name=f"in{i}") for i, a in enumerate(arrays)]
    outputs = lower_op(kind, placeholders, attrs)
    assert [(tuple(int(d) for d in t.shape), t.dtype) for t in outputs] == expected
    module = tvm.IRModule({"main": te.create_prim_func(placeholders + outputs)})
    executable = tvm.compile(module, target="llvm")
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    args += [tvm.runtime.tensor(np.empty(shape, dtype), dev) for shape, dtype in expected]
    executable["main"](*args)
    results = [arg.numpy() for arg in args[len(arrays):]]
    return results[0] if len(results) == 1 else results


@pytest.fixture(name="run_op")
def run_op_fixture():
    return run_op


@pytest.fixture
def tensor_cores_wherever_they_apply(monkeypatch):
    """Pin the choice to tensor cores (the first tile that fits) on GEMMs small enough to emulate,
    where the latency model would pick another template (``codegen.stage``)."""
    monkeypatch.setattr("codegen.stage.stage_seconds",
                        lambda stage, device, traffic: stage.schedule.template != "tensor_core")


@pytest.fixture
def register_pipeline():
    """The wide tensor-core tiles (16-bit and TF32) pipelined through registers, one chunk ahead
    (the ``register-pipeline`` variant of benchmarks/gpu_variants.py), not by a ring of cp.async copies."""
    import gpu_variants

    with gpu_variants.applied("register-pipeline"):
        yield


@pytest.fixture
def pair_epilogues():
    """Softmax and LayerNorm statistics as stages of their own, then a shared-memory epilogue pair
    (the ``no-row-resident`` variant of benchmarks/gpu_variants.py), not one row-resident stage."""
    import gpu_variants

    with gpu_variants.applied("no-row-resident"):
        yield


@pytest.fixture
def rng():
    """Seeded per test, so every test's inputs are reproducible on their own."""
    return np.random.default_rng(0)



# EfficientNet and Swin are imported from their torch definitions (Swin-B: 514 TEs, its repeated
# blocks folded into scans; 1,608 unrolled). Their own test files check them in
# the default suite (both importers, llvm, llvm-persistent, cuda with the validator); in the
# tests every model shares, their paper cases and the every-opt-level sweeps run with -m slow,
# so the default suite stays within CI's budget.
IMPORTED_MODELS = ("efficientnet", "swin")
SWEEPS = ("test_every_level_matches_pytorch_on_the_cpu", "test_every_opt_level_builds_for_sm80_and_sm90",
          "test_tiny_models")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or item.path.name in ("test_efficientnet.py", "test_swin.py") or item.get_closest_marker("gpu"):
            continue  # -m gpu selects the GPU tests; -m slow stays the CPU's paper checks
        values = [str(value) for value in callspec.params.values()]
        if not any(model in values for model in IMPORTED_MODELS):
            continue
        if "paper" in values or "paper" in item.originalname or item.originalname in SWEEPS:
            item.add_marker(pytest.mark.slow)
