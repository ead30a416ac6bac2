import re

import numpy as np
import pytest

from souffle.errors import GraphError, UnknownOpError, WeightError
from souffle.graph import Graph, GraphBuilder, Op, TensorSpec


def _mlp(rng=np.random.default_rng(0)):
    b = GraphBuilder("mlp")
    x = b.input("x", (2, 4))
    w = b.param("fc.weight", rng.standard_normal((3, 4)).astype("float32"))
    bias = b.param("fc.bias", rng.standard_normal(3).astype("float32"))
    y = b.op("dense", x, w, bias, name="y")
    return b.build(b.op("relu", y, name="out"))


def _layer_body():
    body = GraphBuilder("layer")
    h = body.input("h", (1, 4))
    w = body.param("w", (4, 4))
    return body.build(body.op("relu", body.op("dense", h, w), name="h_next"))


def test_builder_infers_shapes_and_prints():
    g = _mlp()
    assert g.tensors["y"] == TensorSpec("y", (2, 3), "float32")
    assert g.output_specs() == [TensorSpec("out", (2, 3), "float32")]
    assert [op.kind for op in g.ops] == ["dense", "relu"]
    assert str(g).splitlines()[-1] == "  return out"


def test_dangling_tensor_is_refused():
    x = TensorSpec("x", (2, 4))
    with pytest.raises(GraphError, match="reads tensor 'ghost'"):
        Graph("g", [x], [], [Op("relu", ("ghost",), ("y",))], ["y"])


def test_unknown_output_and_duplicate_names_are_refused():
    x = TensorSpec("x", (2, 4))
    with pytest.raises(GraphError, match="'nothing'"):
        Graph("g", [x], [], [Op("relu", ("x",), ("y",))], ["nothing"])
    with pytest.raises(GraphError, match="defined twice"):
        Graph("g", [x], [], [Op("relu", ("x",), ("x",))], ["x"])


def test_unknown_op_names_the_op():
    b = GraphBuilder("g")
    x = b.input("x", (2,))
    with pytest.raises(UnknownOpError, match="unknown op 'frobnicate'"):
        b.op("frobnicate", x)


def test_shape_and_dtype_mismatch():
    b = GraphBuilder("g")
    x = b.input("x", (2, 4))
    w = b.param("w", np.zeros((3, 5), "float32"))
    with pytest.raises(GraphError, match="do not match weight in_features 5"):
        b.op("dense", x, w)
    i = b.input("i", (2, 4), "int32")
    with pytest.raises(GraphError, match="share one dtype, got float32, int32"):
        b.op("add", x, i)
    with pytest.raises(GraphError, match="do not broadcast"):
        b.op("add", x, b.input("z", (3,)))


def test_bad_tensor_specs():
    with pytest.raises(GraphError, match="dtype 'float7'"):
        TensorSpec("x", (2,), "float7")
    with pytest.raises(GraphError, match="non-positive"):
        TensorSpec("x", (2, 0))
    with pytest.raises(GraphError, match=r"tensor 'x': shape \(2, 'a'\) is not a sequence of ints"):
        TensorSpec("x", (2, "a"))
    with pytest.raises(GraphError, match=r"tensor 'x': shape \(2, None\) is not a sequence of ints"):
        TensorSpec("x", (2, None))


def test_builder_refuses_a_shape_that_is_not_a_sequence_of_ints():
    b = GraphBuilder("g")
    with pytest.raises(GraphError, match="tensor 'x': shape 5 is not a sequence of ints"):
        b.input("x", 5)
    with pytest.raises(GraphError, match="tensor 'w': shape None is not a sequence of ints"):
        b.param("w", None)


def test_weights_are_validated_by_name_and_shape():
    g = _mlp()
    good = dict(g.weights)
    with pytest.raises(WeightError, match="missing 1: 'fc.bias'"):
        g.with_weights({"fc.weight": good["fc.weight"]})
    with pytest.raises(WeightError, match="unexpected 1: 'fc.extra'"):
        g.with_weights({**good, "fc.extra": np.zeros(1)})
    with pytest.raises(WeightError, match=r"'fc.weight' of 'mlp' has shape \(4, 3\), expected \(3, 4\)"):
        g.with_weights({**good, "fc.weight": np.zeros((4, 3))})
    converted = g.with_weights({k: v.astype("float64") for k, v in good.items()})
    assert converted.weights["fc.weight"].dtype == np.float32


def test_scan_outputs_and_op_counts():
    b = GraphBuilder("deep")
    x = b.input("x", (1, 4))
    ws = [b.param(f"layer.{i}.w", np.eye(4, dtype="float32")) for i in range(3)]
    (final,), (seq,) = b.scan(_layer_body(), 3, name="layers", carry=[("h", "h_next", x)], ys=["h_next"], params={"w": ws})
    g = b.build(final, seq)
    assert g.tensors[final].shape == (1, 4)
    assert g.tensors[seq].shape == (3, 1, 4)
    assert g.op_count() == 2 and g.op_count(executed=True) == 6


def test_scan_binding_errors():
    b = GraphBuilder("deep")
    x = b.input("x", (1, 4))
    ws = [b.param(f"layer.{i}.w", np.eye(4, dtype="float32")) for i in range(3)]
    with pytest.raises(GraphError, match="bound to 2 weights, expected 3"):
        b.scan(_layer_body(), 3, carry=[("h", "h_next", x)], params={"w": ws[:2]})
    with pytest.raises(GraphError, match="must each be bound"):
        b.scan(_layer_body(), 3, params={"w": ws})
    wrong = b.input("wrong", (1, 5))
    with pytest.raises(GraphError, match="initial carry 'wrong'"):
        b.scan(_layer_body(), 3, carry=[("h", "h_next", wrong)], params={"w": ws})


@pytest.mark.parametrize("shape, message", [
    ((2, 1.5), "1.5 is a float, not an integer"),
    ((2.0, 3), "2.0 is a float, not an integer"),
    ((2, True), "True is a bool, not an integer"),
    ((np.bool_(True),), "np.True_ is a bool, not an integer"),
    ((2, "3"), "'3' is a str, not an integer"),
])
def test_a_dimension_must_be_an_integer(shape, message):
    with pytest.raises(GraphError, match=re.escape(f"tensor 'x': shape {shape!r} is not a sequence of ints: {message}")):
        TensorSpec("x", shape)
    b = GraphBuilder("g")
    with pytest.raises(GraphError, match=re.escape(message)):
        b.input("x", shape)
    with pytest.raises(GraphError, match=re.escape(message)):
        b.param("w", shape)


def test_numpy_integer_dimensions_are_plain_ints():
    spec = TensorSpec("x", (np.int64(2), np.int32(3), np.uint8(4)))
    assert spec.shape == (2, 3, 4) and all(type(d) is int for d in spec.shape)


def test_a_scan_length_must_be_an_integer():
    b = GraphBuilder("deep")
    x = b.input("x", (1, 4))
    w = b.param("w", np.eye(4, dtype="float32"))
    with pytest.raises(GraphError, match="scan 'layers': length: 2.5 is a float, not an integer"):
        b.scan(_layer_body(), 2.5, name="layers", carry=[("h", "h_next", x)], params={"w": [w, w]})
    (final,), _ = b.scan(_layer_body(), np.int64(2), name="layers", carry=[("h", "h_next", x)], params={"w": [w, w]})
    assert b.build(final).ops[0].length == 2


def test_the_largest_indexable_tensor_is_accepted():
    assert TensorSpec("x", (2**31 - 1,)).size == 2**31 - 1  # a spec allocates nothing


def test_a_tensor_past_32_bit_indexing_is_refused_when_declared():
    limit = "more than the 2147483647 (2**31 - 1) the generated code can index"
    with pytest.raises(GraphError, match=re.escape(f"tensor 'x': shape (65536, 32768) has 2147483648 elements, {limit}")):
        TensorSpec("x", (2**16, 2**15))
    b = GraphBuilder("g")
    with pytest.raises(GraphError, match=re.escape(f"tensor 'x': shape (1000000, 1000000) has 1000000000000 elements, {limit}")):
        b.input("x", (10**6, 10**6))
    x = b.input("x", (2**16, 2**14))
    with pytest.raises(GraphError, match=re.escape(f"tensor 'wide': shape (65536, 32768) has 2147483648 elements, {limit}")):
        b.op("concat", x, x, axis=1, name="wide")


def test_per_iteration_weights_stacked_past_32_bit_indexing_are_refused():
    body = GraphBuilder("layer")
    h = body.input("h", (1, 2**15))
    body_graph = body.build(body.op("dense", h, body.param("w", (2**15, 2**15)), name="h_next"))
    b = GraphBuilder("deep")  # parameters by shape only: nothing is allocated
    x = b.input("x", (1, 2**15))
    ws = [b.param(f"layer.{i}.w", (2**15, 2**15)) for i in range(2)]
    with pytest.raises(GraphError, match=re.escape("tensor 'layers/w': shape (2, 32768, 32768) has 2147483648 elements")):
        b.scan(body_graph, 2, name="layers", carry=[("h", "h_next", x)], params={"w": ws})
    b.scan(body_graph, 2, name="layers", carry=[("h", "h_next", x)], params={"w": [ws[0], ws[0]]})  # one weight: no stack
