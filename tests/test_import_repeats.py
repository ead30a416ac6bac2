"""fold_repeated_blocks: runs of identical consecutive blocks of an imported graph become one scan
(souffle.importers.repeats); blocks that differ in an attribute or a shape stay as they are."""

import numpy as np
import pytest

import souffle
from souffle.graph import GraphBuilder, Scan
from souffle.importers.repeats import fold_repeated_blocks

RTOL = ATOL = 1e-5


def _conv_relu_chain(strides=(1, 1, 1), channels=(4, 4, 4), invariant=False):
    """x -> (conv3x3 + relu) per block, the weights named as nn.Sequential names them
    (``blocks.{i}.weight``); with ``invariant``, every block also adds the graph input ``bias``."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("chain")
    x = b.input("x", (1, 4, 8, 8))
    bias = b.input("bias", (1, 4, 1, 1)) if invariant else None
    in_channels = 4
    for i, (stride, out_channels) in enumerate(zip(strides, channels)):
        shape = (out_channels, in_channels, 3, 3)
        weight = b.param(f"blocks.{i}.weight", rng.standard_normal(shape).astype("float32") / 6)
        x = b.op("relu", b.op("conv2d", x, weight, stride=stride, padding=1))
        if invariant:
            x = b.op("add", x, bias)
        in_channels = out_channels
    return b.build(b.op("scale", x, factor=2.0))


def _inputs(graph):
    rng = np.random.default_rng(1)
    return {spec.name: rng.standard_normal(spec.shape).astype("float32") for spec in graph.inputs}


def _scans(graph) -> list[Scan]:
    return [op for op in graph.ops if isinstance(op, Scan)]


@pytest.mark.parametrize("invariant", [False, True], ids=["carry only", "with an invariant input"])
def test_three_identical_blocks_become_one_scan_of_three(invariant):
    graph = _conv_relu_chain(invariant=invariant)
    folded = fold_repeated_blocks(graph)
    (scan,) = _scans(folded)
    assert scan.length == 3 and scan.name == "blocks"
    assert scan.params == (("weight", ("blocks.0.weight", "blocks.1.weight", "blocks.2.weight")),)
    assert [v[1] for v in scan.invariants] == (["bias"] if invariant else [])
    assert set(folded.params) == set(graph.params)  # the state_dict's names load as before
    inputs = _inputs(graph)
    want = souffle.compile(graph).run(inputs)[0]
    for target in ("llvm", "llvm-persistent"):
        np.testing.assert_allclose(souffle.compile(folded, target=target).run(inputs)[0], want,
                                   rtol=RTOL, atol=ATOL, err_msg=target)


@pytest.mark.parametrize("strides, channels", [((1, 2, 1), (4, 4, 4)), ((1, 1, 1), (4, 8, 4))],
                         ids=["a stride differs", "a shape differs"])
def test_blocks_that_differ_are_not_folded(strides, channels):
    """The middle block differs, so no two consecutive blocks are the same computation."""
    graph = _conv_relu_chain(strides, channels)
    assert fold_repeated_blocks(graph) is graph


def test_a_run_starts_where_the_repeated_blocks_do():
    """A first block that differs (a stride, as a stage's first Bottleneck) stays outside, the two
    blocks after it are one scan, and the op after the run reads the scan's final carry."""
    folded = fold_repeated_blocks(_conv_relu_chain(strides=(2, 1, 1)))
    (scan,) = _scans(folded)
    assert scan.length == 2 and scan.params[0][1] == ("blocks.1.weight", "blocks.2.weight")
    assert folded.ops.index(scan) == 2  # after the first block's conv and relu
    assert folded.ops[-1].inputs == (scan.outputs[0],)


def test_blocks_without_weights_or_of_one_op_are_not_folded():
    """Identical parameter-free stretches (relu, scale) and a single op repeated (a sum of
    embeddings, each added to the one before) are no layers to loop over."""
    b = GraphBuilder("no_weights")
    x = b.input("x", (2, 3))
    for _ in range(3):
        x = b.op("scale", b.op("relu", x), factor=0.5)
    graph = b.build(x)
    assert fold_repeated_blocks(graph) is graph
    b = GraphBuilder("sum_of_embeddings")
    x = b.input("x", (2, 3))
    for i in range(3):
        x = b.op("add", x, b.param(f"table.{i}", np.ones((2, 3), "float32")))
    graph = b.build(x)
    assert fold_repeated_blocks(graph) is graph


def test_blocks_whose_inner_tensor_is_read_later_are_not_folded():
    """Each block's conv output is also a graph output: it is no block of which only the carry
    is read afterwards."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("leaky")
    x = b.input("x", (1, 4, 4, 4))
    inner = []
    for i in range(3):
        conv = b.op("conv2d", x, b.param(f"c.{i}.weight", rng.standard_normal((4, 4, 1, 1)).astype("float32")))
        inner.append(conv)
        x = b.op("relu", conv)
    graph = b.build(x, *inner)
    assert fold_repeated_blocks(graph) is graph


def test_from_torch_folds_a_sequential_of_identical_blocks():
    torch = pytest.importorskip("torch")
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

        def forward(self, x):
            return self.norm(x + torch.relu(self.fc(x)))

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), *(Block() for _ in range(4)), nn.Linear(16, 2)).eval()
    x = torch.randn(3, 8)
    graph = souffle.from_torch(module, (x,))
    (scan,) = _scans(graph)
    assert scan.length == 4 and scan.name == "blocks"  # nn.Sequential's keys have no name before the index
    assert dict(scan.params)["fc.weight"] == tuple(f"{i}.fc.weight" for i in range(1, 5))
    with torch.no_grad():
        want = module(x).numpy()
    np.testing.assert_allclose(souffle.compile(graph).run({"input": x.numpy()})[0], want, rtol=1e-4, atol=1e-4)
