"""The registry's contract: unknown ops, arity and attributes are refused with clear
messages, and an infer rule's refusal reaches the user as a GraphError naming the op."""

import ast
from pathlib import Path

import numpy as np
import pytest

import souffle.ops

from souffle.errors import GraphError, UnknownOpError
from souffle.graph import GraphBuilder
from souffle.ops import REGISTRY, get_rule, infer_outputs, register_op

REQUIRED_OPS = {
    "relu", "gelu", "sigmoid", "tanh", "silu", "add", "sub", "mul", "div", "scale", "copy", "full",
    "dense", "matmul", "batch_matmul", "conv2d", "batch_norm", "softmax", "layer_norm",
    "max_pool2d", "avg_pool2d", "global_avg_pool2d", "mean", "embedding",
    "reshape", "transpose", "concat", "slice", "split", "flatten",
}


def test_every_model_op_is_registered():
    assert REQUIRED_OPS <= set(REGISTRY)


def test_unknown_op_lists_the_known_ones():
    b = GraphBuilder("g")
    x = b.input("x", (2, 3))
    with pytest.raises(UnknownOpError) as err:
        b.op("swish", x)
    message = str(err.value)
    assert "unknown op 'swish'" in message
    for kind in ("conv2d", "relu", "softmax", "split"):
        assert kind in message


def test_get_rule_unknown_is_a_graph_error():
    with pytest.raises(GraphError, match="unknown op 'nope'"):
        get_rule("nope")


@pytest.mark.parametrize(
    "kind, n_given, expected",
    [("add", 1, "takes 2 inputs, got 1"), ("relu", 2, "takes 1 inputs, got 2"), ("dense", 1, "takes 2 to 3 inputs, got 1"),
     ("concat", 0, "takes 1 to inf inputs, got 0")],
)
def test_wrong_number_of_inputs(kind, n_given, expected):
    b = GraphBuilder("g")
    names = [b.input(f"x{i}", (2, 3)) for i in range(n_given)]
    with pytest.raises(GraphError, match=expected):
        b.op(kind, *names)


def test_unknown_attribute_lists_the_accepted_ones():
    b = GraphBuilder("g")
    x = b.input("x", (2, 3))
    with pytest.raises(GraphError, match=r"unknown attribute\(s\) \['dim'\] for softmax \(accepted: axis\)"):
        b.op("softmax", x, dim=1)
    with pytest.raises(GraphError, match=r"\['alpha'\] for relu \(accepted: none\)"):
        b.op("relu", x, alpha=0.1)


def test_shape_error_names_op_reason_and_inputs():
    b = GraphBuilder("g")
    x = b.input("x", (2, 3))
    w = b.param("fc.weight", np.zeros((4, 5), "float32"))
    with pytest.raises(GraphError) as err:
        b.op("dense", x, w, name="fc")
    message = str(err.value)
    assert message.startswith("op 'fc' (dense): input features")
    assert "x: float32[2, 3]" in message and "fc.weight: float32[4, 5]" in message


def test_a_refused_op_is_not_added():
    b = GraphBuilder("g")
    x = b.input("x", (2, 3))
    with pytest.raises(GraphError):
        b.op("softmax", x, axis=2)
    y = b.op("softmax", x, axis=1)
    assert b.build(y).op_count() == 1


def test_builder_names_multiple_outputs_and_graph_revalidates():
    b = GraphBuilder("g")
    x = b.input("x", (2, 6))
    parts = b.op("split", x, sections=3, axis=1, name="parts")
    assert parts == ("parts.0", "parts.1", "parts.2")
    y = b.op("concat", *reversed(parts), axis=-1)
    g = b.build(y)
    assert g.tensors[y].shape == (2, 6)
    assert g.tensors["parts.1"].shape == (2, 2)


def test_n_outputs_mismatch_is_refused():
    b = GraphBuilder("g")
    x = b.input("x", (2, 6))
    with pytest.raises(GraphError, match="produces 2 outputs, not 3"):
        b.op("split", x, sections=2, axis=1, n_outputs=3)


def test_infer_outputs_fills_defaults():
    from souffle.graph import TensorSpec

    spec = TensorSpec("x", (1, 3, 8, 8))
    assert infer_outputs("max_pool2d", [spec], {"kernel": 2}, "pool") == [((1, 3, 4, 4), "float32")]


def test_registering_a_kind_twice_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        register_op("relu", infer=lambda specs, attrs: [], n_inputs=1)(lambda inputs: None)


def test_ops_do_not_import_the_graph():
    """The graph calls the ops' rules to validate itself; the ops see only souffle.tensor's TensorSpec."""
    for path in Path(souffle.ops.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            assert "souffle.graph" not in modules, f"{path.name} imports souffle.graph"
