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


def test_weights_must_be_a_mapping_of_arrays():
    g = _mlp()
    with pytest.raises(WeightError, match=re.escape(
            "weights for 'mlp' must be a mapping from parameter name to array (a dict or a PyTorch state_dict), not a list")):
        g.with_weights(list(g.weights.values()))
    with pytest.raises(WeightError, match=re.escape(
            "weight 'fc.bias' of 'mlp' is a list: a weight must be a numpy array or a torch tensor")):
        g.with_weights({**g.weights, "fc.bias": [0.0, 1.0, 2.0]})


def _int_param_graph():
    b = GraphBuilder("ints")
    x = b.input("x", (3,), "int32")
    return b.build(b.op("add", x, b.param("w", np.zeros(3, "int32"))))


def test_a_weight_converts_only_if_every_value_survives():
    g = _mlp()
    with pytest.raises(WeightError, match=re.escape(
            "weight 'fc.bias' of 'mlp': 1 int64 values cannot be held exactly by float32 (the first: 16777217)")):
        g.with_weights({**g.weights, "fc.bias": np.array([1, 2**24 + 1, 3])})
    with pytest.raises(WeightError, match=re.escape(
            "weight 'fc.bias' of 'mlp': 2 float64 values overflow float32, whose largest is 3.40282e+38 (the first: 1e+300)")):
        g.with_weights({**g.weights, "fc.bias": np.array([0.5, 1e300, -1e300])})
    exact = g.with_weights({**g.weights, "fc.bias": np.array([1, -2, 2**24])})
    assert exact.weights["fc.bias"].tolist() == [1.0, -2.0, 2.0**24]
    rounded = g.with_weights({**g.weights, "fc.bias": np.array([0.1, np.inf, np.nan])})  # float64 rounds to float32
    assert rounded.weights["fc.bias"][0] == np.float32(0.1) and np.isinf(rounded.weights["fc.bias"][1])
    ints = _int_param_graph()
    assert ints.with_weights({"w": np.array([1.0, -2.0, 3.0])}).weights["w"].tolist() == [1, -2, 3]
    for given, first in ((np.array([1.0, 1.5, 3.0]), "float64 values cannot be held exactly by int32 (the first: 1.5)"),
                         (np.array([1, 2**32, 3]), "int64 values cannot be held exactly by int32 (the first: 4294967296)"),
                         (np.array([1, 2**32 - 1, 3], np.uint32),  # would wrap to -1
                          "uint32 values cannot be held exactly by int32 (the first: 4294967295)")):
        with pytest.raises(WeightError, match=re.escape(f"weight 'w' of 'ints': 1 {first}")):
            ints.with_weights({"w": given})


def test_half_precision_torch_weights_convert_only_exactly():
    torch = pytest.importorskip("torch")
    b = GraphBuilder("half")
    x = b.input("x", (3,), "float16")
    g = b.build(b.op("add", x, b.param("w", np.zeros(3, "float16"))))
    exact = torch.tensor([0.5, -2.0, 1024.0], dtype=torch.bfloat16)
    assert g.with_weights({"w": exact}).weights["w"].tolist() == [0.5, -2.0, 1024.0]
    refused = re.escape("weight 'w' of 'half': 1 bfloat16 values cannot be held exactly by float16")
    with pytest.raises(WeightError, match=refused):
        g.with_weights({"w": torch.tensor([0.5, 1e5, 1.0], dtype=torch.bfloat16)})  # past float16's 65504
    with pytest.raises(WeightError, match=refused):
        g.with_weights({"w": torch.tensor([0.5, 1e-6, 1.0], dtype=torch.bfloat16)})  # float16 subnormal: rounds


def test_the_graph_owns_read_only_copies_of_its_weights():
    weight = np.ones((3, 4), "float32")
    b = GraphBuilder("mlp")
    y = b.op("dense", b.input("x", (2, 4)), b.param("fc.weight", weight))
    g = b.build(y)
    weight[:] = 7  # the caller's array, edited after build
    assert (g.weights["fc.weight"] == 1).all()
    with pytest.raises(ValueError, match="read-only"):
        g.weights["fc.weight"][0, 0] = 5
    bias_free = {"fc.weight": np.full((3, 4), 2, "float32")}
    h = g.with_weights(bias_free)
    bias_free["fc.weight"] += 1
    assert (h.weights["fc.weight"] == 2).all()
    assert g.with_weights(g.weights).weights["fc.weight"] is g.weights["fc.weight"]  # already owned: shared
