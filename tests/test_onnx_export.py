"""ONNX export: ONNX Runtime and TVM Relax run the exported model and get PyTorch's numbers."""

import dataclasses
import functools
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from souffle import models
from souffle.errors import SouffleError
from souffle.graph import GraphBuilder
from souffle.onnx_export import ExportError, to_onnx
from souffle.ops import REGISTRY, export_rule


@functools.cache
def _exported(name):
    """(graph, ONNX model, inputs, PyTorch outputs) of a tiny model, shared by the tests below."""
    graph = models.build(name, "tiny")
    inputs = models.make_inputs(name, "tiny")
    return graph, to_onnx(graph), inputs, models.reference(name, "tiny", graph.weights)(inputs)


def _ort_run(model, inputs):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


def _assert_close(graph, got, expected, tolerance):
    assert len(got) == len(expected) == len(graph.outputs)
    rtol, atol = tolerance
    for name, value, want in zip(graph.outputs, got, expected):
        assert value.shape == want.shape, name
        np.testing.assert_allclose(value, want, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("name", models.MODELS)
def test_onnx_runtime_matches_torch(name):
    graph, model, inputs, expected = _exported(name)
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == [s.name for s in graph.inputs]
    assert [o.name for o in model.graph.output] == list(graph.outputs)
    for value, spec in zip([*model.graph.input, *model.graph.output], [*graph.inputs, *graph.output_specs()]):
        dims = tuple(d.dim_value for d in value.type.tensor_type.shape.dim)
        elem = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        assert (dims, str(elem)) == (spec.shape, spec.dtype)
    _assert_close(graph, _ort_run(model, inputs), expected, models.tolerance(name, "tiny"))


@pytest.mark.parametrize("name", models.MODELS)
def test_tvm_relax_matches_torch(name):
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    graph, model, inputs, expected = _exported(name)
    executable = tvm.compile(from_onnx(model, keep_params_in_input=False), target="llvm")
    vm = relax.VirtualMachine(executable, tvm.cpu())
    out = vm["main"](*(tvm.runtime.tensor(inputs[spec.name]) for spec in graph.inputs))
    got = [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]
    _assert_close(graph, got, expected, models.tolerance(name, "tiny"))


def _lstm(layers, steps):
    module = models.get("lstm")
    cfg = {**models.config("lstm", "tiny"), "num_layers": layers, "steps": steps}
    return module.build_graph(cfg, module.init_weights(cfg, 0))


@pytest.mark.parametrize(("layers", "steps"), [(1, 1), (3, 5), (4, 7)])
def test_lstm_is_unrolled_cell_by_cell(layers, steps):
    graph = _lstm(layers, steps)
    model = to_onnx(graph)
    kinds = [node.op_type for node in model.graph.node]
    assert not {"Scan", "Loop", "If"} & set(kinds)
    cells = layers * steps
    # Per cell, the cell's 18 ops: 2 MatMul, 4 Add (2 of them biases), 4 Slice, 3 Sigmoid, 2 Tanh, 3 Mul;
    # and one Slice per step to take the first layer's input.
    assert {k: kinds.count(k) for k in ("MatMul", "Add", "Slice", "Sigmoid", "Tanh", "Mul")} == {
        "MatMul": 2 * cells, "Add": 4 * cells, "Slice": 4 * cells + steps, "Sigmoid": 3 * cells, "Tanh": 2 * cells,
        "Mul": 3 * cells,
    }
    # Each layer's two weight matrices are transposed once, not once per step.
    assert kinds.count("Transpose") == 2 * layers
    # Besides the cells, only per step (the input's Slice, Squeeze and bounds, the output's stacking)
    # and per layer (the transposes, a zero state, the final h and c stacked): the stacks between
    # layers are not gathered from again but read value by value, and then dropped.
    cell_nodes = 18 * cells
    assert cell_nodes < len(kinds) <= cell_nodes + 4 * steps + 6 * layers + 15
    inputs = {"x": np.random.default_rng(0).standard_normal((steps, 1, 12)).astype(np.float32)}
    cfg = {**models.config("lstm", "tiny"), "num_layers": layers, "steps": steps}
    expected = models.get("lstm").torch_reference(cfg, graph.weights)(inputs)
    _assert_close(graph, _ort_run(model, inputs), expected, models.tolerance("lstm", "tiny"))


@pytest.mark.parametrize("name", models.MODELS)
def test_each_weight_is_one_initializer(name):
    graph, model, _, _ = _exported(name)
    names = [t.name for t in model.graph.initializer]
    assert len(names) == len(set(names)) == len(graph.weights)
    assert set(names) == set(graph.weights)
    for tensor in model.graph.initializer:
        assert np.array_equal(onnx.numpy_helper.to_array(tensor), graph.weights[tensor.name])


def test_unrolled_lstm_layers_read_their_own_weights():
    graph, model, _, _ = _exported("lstm")
    weight_of = {name: name for name in graph.weights}
    readers = {}
    for node in model.graph.node:
        if node.op_type == "Transpose" and node.input[0] in weight_of:
            weight_of[node.output[0]] = weight_of[node.input[0]]  # the weight's one shared transpose
            continue
        for name in node.input:
            if name in weight_of:
                readers.setdefault(weight_of[name], set()).add(node.name.split("/")[0])
    # weight_ih_l2 is bound to iteration 1 of the layer scan, and read by all of its 5 steps only.
    assert readers["weight_ih_l2"] == {"layers.1"}
    assert readers["weight_ih_l0"] == {"layer0.0", "layer0.1", "layer0.2", "layer0.3", "layer0.4"}


def _one_op_graph(kind, arrays, attrs, weights=()):
    """A graph applying ``kind`` to ``arrays``: those at the indices in ``weights`` are parameters."""
    b = GraphBuilder(kind)
    names = [
        b.param(f"w{i}", a) if i in weights else b.input(f"in{i}", a.shape, str(a.dtype))
        for i, a in enumerate(arrays)
    ]
    out = b.op(kind, *names, **attrs)
    return b.build(*(out if isinstance(out, tuple) else (out,)))


_rng = np.random.default_rng(0)


def _f32(*shape):
    return _rng.standard_normal(shape).astype(np.float32)


OP_CASES = [
    ("sub", [_f32(2, 3), _f32(3)], {}),
    ("div", [_f32(2, 3), _f32(2, 1) + 4], {}),
    ("silu", [_f32(2, 5)], {}),
    ("gelu", [_f32(3, 4) * 3], {}),
    ("copy", [_f32(4)], {}),
    ("scale", [_f32(2, 2)], {"factor": -0.25}),
    ("dense", [_f32(2, 3, 5), _f32(4, 5)], {}),
    ("dense", [_f32(5), _f32(4, 5), _f32(4)], {}),
    ("matmul", [_f32(2, 1, 3, 4), _f32(3, 5, 4)], {"transpose_b": True}),
    ("matmul", [_f32(2, 3, 4), _f32(4, 6)], {}),
    ("batch_matmul", [_f32(2, 4, 3), _f32(2, 5, 4)], {"transpose_a": True, "transpose_b": True}),
    ("conv2d", [_f32(1, 4, 9, 9), _f32(6, 2, 3, 3), _f32(6)], {"stride": 2, "padding": (1, 2), "dilation": 2, "groups": 2}),
    ("conv2d", [_f32(1, 3, 6, 6), _f32(6, 1, 3, 3)], {"padding": 1, "groups": 3}),
    ("max_pool2d", [_f32(1, 2, 7, 8)], {"kernel": 3, "stride": 2, "padding": 1, "ceil_mode": True}),
    ("max_pool2d", [_f32(1, 2, 9, 9)], {"kernel": 2, "stride": 2, "dilation": 2}),
    ("avg_pool2d", [_f32(1, 2, 7, 8)], {"kernel": 3, "stride": 2, "padding": 1, "ceil_mode": True}),
    ("avg_pool2d", [_f32(1, 2, 7, 8)], {"kernel": 3, "stride": 2, "padding": 1, "ceil_mode": True,
                                         "count_include_pad": False}),
    ("avg_pool2d", [_f32(1, 2, 6, 6)], {"kernel": 2}),
    ("global_avg_pool2d", [_f32(1, 3, 5, 4)], {}),
    ("mean", [_f32(2, 3, 4)], {"axes": (0, -1), "keepdims": True}),
    ("mean", [_f32(2, 3, 4)], {}),
    ("layer_norm", [_f32(2, 6), _f32(6), _f32(6)], {"eps": 1e-3}),
    ("batch_norm", [_f32(2, 3, 4), _f32(3), _f32(3), _f32(3), np.abs(_f32(3)) + 0.5], {"eps": 1e-3}),
    ("softmax", [_f32(3, 4)], {"axis": 0}),
    ("embedding", [_f32(5, 3), np.array([[0, 4, -2], [7, 1, 2]], dtype=np.int64)], {}),
    ("embedding", [_f32(5, 3), np.array([3, 9, -1], dtype=np.int32)], {}),
    ("slice", [_f32(4, 10)], {"begin": (-3, 1), "end": (100, -1), "axis": (0, 1), "strides": (1, 3)}),
    ("split", [_f32(6, 2)], {"sections": 3}),
    ("split", [_f32(2, 7)], {"sizes": (2, 5), "axis": -1}),
    ("concat", [_f32(2, 3), _f32(2, 1)], {"axis": -1}),
    ("transpose", [_f32(2, 3, 4)], {"axes": None}),
    ("reshape", [_f32(2, 3, 4)], {"shape": (4, -1)}),
    ("flatten", [_f32(2, 3, 4, 5)], {"start_dim": 1, "end_dim": 2}),
    ("full", [], {"shape": (2, 3), "value": 7, "dtype": "int32"}),
    ("eq", [np.array([[1, 2, np.nan], [0, -1, 3]], np.float32), np.array([1, 5, np.nan], np.float32)], {}),
    ("ne", [np.array([[1, 2, np.nan], [0, -1, 3]], np.float32), np.array([1, 5, np.nan], np.float32)], {}),
    *((kind, [np.array([[1, 2, 3], [4, 5, 6]], np.int64), np.array([[2], [5]], np.int64)], {})
      for kind in ("lt", "le", "gt", "ge")),
    ("logical_and", [np.array([[0, 1, 2]], np.int32), np.array([[1], [0]], np.int32)], {}),
    ("logical_or", [np.array([0.0, 0.5, np.nan], np.float32), np.array([0.0, 0.0, 0.0], np.float32)], {}),
    ("logical_not", [np.array([0, 3, -1], np.int64)], {}),
    ("where", [np.array([[1], [0]], np.int32), _f32(2, 3), _f32(3)], {}),
    ("pad", [_f32(2, 3, 4)], {"before": (0, 1, 2), "after": (1, 0, 3), "value": -2.0}),
    ("roll", [_f32(2, 5, 4)], {"shifts": (-2, 3), "axes": (1, 2)}),
    ("roll", [_f32(3, 2)], {"shifts": 3, "axes": 0}),
    ("take", [_f32(5, 3), np.array([[0, 4], [-2, 9]], dtype=np.int64)], {"axis": 0}),
    ("take", [_f32(2, 6, 3), np.array([5, -1, 0, 2], dtype=np.int32)], {"axis": 1}),
]


@pytest.mark.parametrize(("kind", "arrays", "attrs"), OP_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(OP_CASES)])
def test_op_matches_its_te_lowering(run_op, kind, arrays, attrs):
    """Each rule against the op's TE lowering, the ground truth of its semantics."""
    graph = _one_op_graph(kind, arrays, attrs)
    model = to_onnx(graph)
    onnx.checker.check_model(model, full_check=True)
    want = run_op(kind, arrays, **attrs)
    want = want if isinstance(want, list) else [want]
    got = _ort_run(model, {f"in{i}": a for i, a in enumerate(arrays)})
    _assert_close(graph, got, want, (1e-5, 1e-6))


@pytest.mark.parametrize("opset", [18, 21])
def test_newer_opsets(run_op, opset):
    """ReduceMean's axes move from an attribute to an input at opset 18."""
    x = _f32(2, 3, 4)
    graph = _one_op_graph("mean", [x], {"axes": 1})
    model = to_onnx(graph, opset=opset)
    assert model.opset_import[0].version == opset
    _assert_close(graph, _ort_run(model, {"in0": x}), [run_op("mean", [x], axes=1)], (1e-6, 1e-6))


def test_weights_of_a_one_op_graph_become_initializers():
    x, w, bias = _f32(3, 5), _f32(4, 5), _f32(4)
    graph = _one_op_graph("dense", [x, w, bias], {}, weights=(1, 2))
    model = to_onnx(graph)
    assert [t.name for t in model.graph.initializer] == ["w1", "w2"]
    assert [i.name for i in model.graph.input] == ["in0"]
    np.testing.assert_allclose(_ort_run(model, {"in0": x})[0], x @ w.T + bias, rtol=1e-5, atol=1e-6)


def test_packed_op_is_refused_by_name():
    b = GraphBuilder("packed")
    x = b.input("x", (2, 8))
    w = b.param("w", np.ones((2, 8, 4), np.float32))
    b.op("dense_packed", x, w, name="y")
    graph = b.build("y")
    with pytest.raises(ExportError, match=r"op 'dense_packed' \(output 'y'\) has no ONNX export rule; rules exist for: .*dense"):
        to_onnx(graph)


def _without_export_rule(monkeypatch, kind):
    monkeypatch.setitem(REGISTRY, kind, dataclasses.replace(REGISTRY[kind], export=None))


def test_op_without_a_rule_inside_a_scan_is_refused_by_name(monkeypatch):
    _without_export_rule(monkeypatch, "tanh")
    with pytest.raises(ExportError, match=r"op 'tanh' \(output 'layer0/tanh_\d+'\) has no ONNX export rule") as err:
        to_onnx(models.build("lstm", "tiny"))
    assert "tanh" not in str(err.value).split("rules exist for: ")[1].split(", ")
    assert isinstance(err.value, SouffleError)


def test_graph_without_weights_is_refused():
    with pytest.raises(ExportError, match=r"graph 'mmoe' has no weights"):
        to_onnx(models.structure("mmoe", "tiny"))


def test_unsupported_opset_is_refused():
    with pytest.raises(ExportError, match=r"opset 16 is not supported; use 17 to \d+"):
        to_onnx(models.build("mmoe", "tiny"), opset=16)


def test_rule_registry_refuses_unknown_and_duplicate_kinds():
    with pytest.raises(ValueError, match="op 'no_such_op' is not registered"):
        export_rule("no_such_op")
    with pytest.raises(ValueError, match="op 'relu' has two ONNX export rules"):
        export_rule("relu")(lambda e, inputs, outputs, attrs: None)


def test_a_new_rule_is_one_decorated_function(monkeypatch):
    _without_export_rule(monkeypatch, "relu")

    @export_rule("relu")
    def relu_as_max(e, inputs, outputs, attrs):
        e.node("Max", [inputs[0], e.scalar(0.0, inputs[0])], outputs)

    x = _f32(3, 4)
    model = to_onnx(_one_op_graph("relu", [x], {}))
    assert [n.op_type for n in model.graph.node] == ["Constant", "Max"]
    np.testing.assert_array_equal(_ort_run(model, {"in0": x})[0], np.maximum(x, 0))


def test_every_op_but_the_packed_ones_has_an_export_rule():
    """The packed ops exist only after a CPU transformation; every op a model is built from exports."""
    assert {kind for kind, rule in REGISTRY.items() if rule.export is None} == {"dense_packed", "conv2d_packed"}


def test_the_ops_and_their_export_rules_import_no_onnx():
    """onnx is a dev extra: the rules beside the lowerings only call the Emitter's methods."""
    script = "import sys, souffle.ops; assert not [m for m in sys.modules if m.split('.')[0] == 'onnx']"
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", script], cwd=root, check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
