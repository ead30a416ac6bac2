"""The ``commute_rolls`` pass (codegen.commute_rolls): a shifted Swin block's rolls moved to where
a row-wise stage reads through them.

Checked on the graph (what moves, and what must not: a roll of the normalized axis, a
LayerNorm's output read twice, a sum no LayerNorm reads), and on a shifted-window block as a
PyTorch user writes it (LayerNorm, roll, windows, a projection, the windows back, the roll back,
the residual sum, a LayerNorm and an MLP's residual): the first LayerNorm and the roll are one
row-resident stage, the residual sum is the projection's epilogue, and the kernel matches
PyTorch on emulated threads at fp32 and fp16, scratch poisoned.
"""

import numpy as np
import pytest
import torch

import souffle
from codegen.commute_rolls import commute_rolls
from codegen.vertical import pads, rolls
from souffle.graph import GraphBuilder
from souffle.importers.torch_export import from_torch

C, SIDE, WINDOW, SHIFT = 32, 8, 4, 2


def _normed_roll(axes=(1, 2), read_twice=False):
    rng = np.random.default_rng(0)
    b = GraphBuilder("rolled")
    x = b.input("x", (1, SIDE, SIDE, C))
    normed = b.op("layer_norm", x, b.param("g", rng.standard_normal(C).astype("float32")),
                  b.param("beta", rng.standard_normal(C).astype("float32")), name="normed")
    rolled = b.op("roll", normed, shifts=[-SHIFT] * len(axes), axes=list(axes), name="rolled")
    return b.build(rolled, normed) if read_twice else b.build(rolled)


def test_a_roll_of_a_layer_norm_rolls_its_input():
    moved, notes = commute_rolls(_normed_roll())
    assert [str(op) for op in moved.ops] == [
        "rolled_input = roll(x; shifts=[-2, -2], axes=[1, 2])",
        "rolled = layer_norm(rolled_input, g, beta)"]
    assert notes == ["rolled/rolled: the roll of normed (axes [1, 2]) applied to the LayerNorm's input, x"]


@pytest.mark.parametrize("graph", [_normed_roll(axes=(3,)), _normed_roll(axes=(1, -1)), _normed_roll(read_twice=True)],
                         ids=["the normalized axis", "the normalized axis, counted from the end", "read twice"])
def test_a_roll_that_does_not_commute_or_is_not_alone_stays(graph):
    assert commute_rolls(graph) == (graph, [])


def _rolled_sum(normed=True):
    b = GraphBuilder("summed")
    x, y = (b.input(name, (1, SIDE, SIDE, C)) for name in ("x", "y"))
    total = b.op("add", x, b.op("roll", y, shifts=[SHIFT, SHIFT], axes=[1, 2], name="rolled"), name="total")
    if not normed:
        return b.build(total)
    g, beta = (b.param(name, np.ones(C, "float32")) for name in ("g", "beta"))
    return b.build(b.op("layer_norm", total, g, beta, name="out"), total)


def test_a_sum_with_a_roll_that_a_layer_norm_reads_is_the_roll_of_a_sum():
    moved, notes = commute_rolls(_rolled_sum())
    assert [str(op) for op in moved.ops[:3]] == [
        "total_unrolled_term = roll(x; shifts=[-2, -2], axes=[1, 2])",
        "total_unrolled = add(total_unrolled_term, y)",
        "total = roll(total_unrolled; shifts=[2, 2], axes=[1, 2])"]
    assert notes == ["summed/total: the sum of x and the roll of y taken as the roll of their sum, x rolled back "
                     "(axes [1, 2])"]
    unnormed = _rolled_sum(normed=False)
    assert commute_rolls(unnormed) == (unnormed, [])
    rng = np.random.default_rng(1)
    inputs = {name: rng.standard_normal((1, SIDE, SIDE, C)).astype("float32") for name in ("x", "y")}
    total = inputs["x"] + np.roll(inputs["y"], (SHIFT, SHIFT), axis=(1, 2))
    mean, var = total.mean(-1, keepdims=True), total.var(-1, keepdims=True)
    for level in (0, 2):  # without the pass and with it, on the CPU's staged program
        out, summed = souffle.compile(_rolled_sum(), "llvm-persistent", opt_level=level).run(inputs)
        np.testing.assert_allclose(summed, total, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out, (total - mean) / np.sqrt(var + 1e-5) + 1, rtol=1e-4, atol=1e-4)  # g, beta: 1


def test_a_roll_is_one_tensor_at_places_chosen_by_index():
    """``codegen.vertical`` reads a LayerNorm's rows through a roll (one tensor, several places,
    conditions on indices), not through a concatenation (two tensors) or a ReLU (a value's
    condition); a padding is one place."""
    from tvm import te, tirx

    x, y = te.placeholder((4, 8), name="x"), te.placeholder((4, 8), name="y")
    rolled = te.compute((4, 8), lambda i, j: tirx.if_then_else(j >= 2, x[i, j - 2], x[i, j + 6]), name="rolled")
    padded = te.compute((4, 9), lambda i, j: tirx.if_then_else(j >= 1, x[i, j - 1], 0.0), name="padded")
    joined = te.compute((4, 16), lambda i, j: tirx.if_then_else(j < 8, x[i, j], y[i, j - 8]), name="joined")
    relu = te.compute((4, 8), lambda i, j: tirx.Select(x[i, j] > 0.0, x[i, j], x[i, j] * 0.1), name="relu")
    assert rolls(rolled.op.body[0]) and not pads(rolled.op.body[0])
    assert not any(rolls(t.op.body[0]) for t in (padded, joined, relu))


class _ShiftedBlock(torch.nn.Module):
    """A shifted-window block's rolls and residuals (torchvision's order), a projection for the
    attention."""

    def __init__(self, channels=C, side=SIDE, window=WINDOW, shift=SHIFT):
        super().__init__()
        self.channels, self.side, self.window, self.shift = channels, side, window, shift
        self.norm1, self.norm2 = torch.nn.LayerNorm(channels), torch.nn.LayerNorm(channels)
        self.proj, self.fc = torch.nn.Linear(channels, channels), torch.nn.Linear(channels, channels)

    def forward(self, x):
        c, side, w, s = self.channels, self.side, self.window, self.shift
        r = side // w
        y = torch.roll(self.norm1(x), shifts=(-s, -s), dims=(1, 2))
        y = y.view(1, r, w, r, w, c).permute(0, 1, 3, 2, 4, 5).reshape(r * r, w * w, c)
        y = self.proj(y).view(1, r, r, w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(1, side, side, c)
        x = x + torch.roll(y, shifts=(s, s), dims=(1, 2))
        return x + self.fc(self.norm2(x))


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    module = _ShiftedBlock().eval()
    with torch.no_grad():
        for norm in (module.norm1, module.norm2):
            norm.weight.normal_()
            norm.bias.normal_()
    x = torch.randn(1, SIDE, SIDE, C)
    return module, x, from_torch(module, (x,))


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("fp16", 3e-2)])
def test_a_shifted_block_s_rolls_are_read_through_and_it_matches_torch(block, precision, tolerance):
    module, x, graph = block
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    stages = [stage.name.split("/")[-1] for stage in model.plan.stages()]
    assert stages == ["layer_norm_sum+layer_norm_moments+roll", "T_matmul_NT+T_add",
                      "layer_norm_sum+layer_norm_moments+layer_norm_1", "T_matmul_NT+add_1"]
    with torch.no_grad():
        expected = module(x).numpy()
    for order in ("ascending", "descending"):
        (got,) = model.schedule(order).run({graph.inputs[0].name: x.numpy()})
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


def test_a_block_of_paper_swin_s_second_stage_is_accepted_by_the_validator():
    """28 x 28 tokens of 256 channels, windows of 7, shifted by 3: the rows (1, 28, 28) are not
    flattened where the LayerNorm reads through the roll (``codegen.row_resident._flatten_rows``),
    where TVM rewrote the window reverse of the roll's first branch 39 rows off; the validator
    checks every thread's loads."""
    from souffle.compiler import run_passes

    graph = from_torch(_ShiftedBlock(256, 28, 7, 3).eval(), (torch.randn(1, 28, 28, 256),))
    source = run_passes(graph, "cuda", stop="validate_threads", opt_level=4, device="h100").ir
    assert "main_kernel(" in source.text  # validated: run_passes raises where a thread reads out of bounds
