"""souffle.from_onnx: small torch modules exported to ONNX (torch.onnx.export, and souffle's own
exporter) and imported back, compiled and compared with PyTorch; the CLI on an ONNX file; errors."""

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

import souffle  # noqa: E402
from souffle.cli import main  # noqa: E402
from souffle.errors import ModelImportError, UnsupportedOpError  # noqa: E402
from test_import_torch import MLP, Attention, ConvNet, _randomized_batch_norms  # noqa: E402

RTOL = ATOL = 1e-4


def _exported(module, inputs, opset, **options) -> "onnx.ModelProto":
    buffer = io.BytesIO()
    torch.onnx.export(module.eval(), inputs, buffer, dynamo=False, opset_version=opset, **options)
    return onnx.load_from_string(buffer.getvalue())


def _check(graph, module, inputs, target="llvm", opt_level=None):
    compiled = souffle.compile(graph, target=target, opt_level=opt_level)
    got = compiled.run({spec.name: x.numpy() for spec, x in zip(graph.inputs, inputs)})
    with torch.no_grad():
        want = [t.numpy() for t in torch.utils._pytree.tree_leaves(module(*inputs))]
    assert len(got) == len(want)
    for name, value, expected in zip(graph.outputs, got, want):
        np.testing.assert_allclose(value, expected, rtol=RTOL, atol=ATOL, err_msg=name)
    return compiled


@pytest.mark.parametrize("opset", [13, 17, 20])
@pytest.mark.parametrize("make, shape", [(MLP, (2, 12)), (Attention, (1, 6, 16)), (ConvNet, (1, 3, 8, 8))])
def test_torch_onnx_export_imports_back(make, shape, opset):
    torch.manual_seed(0)
    module = _randomized_batch_norms(make())
    inputs = (torch.randn(*shape),)
    graph = souffle.from_onnx(_exported(module, inputs, opset))
    _check(graph, module, inputs)


def test_initializers_keep_their_names():
    torch.manual_seed(0)
    module = _randomized_batch_norms(ConvNet())
    graph = souffle.from_onnx(_exported(module, (torch.randn(1, 3, 8, 8),), 17, input_names=["image"]))
    assert [spec.name for spec in graph.inputs] == ["image"]
    assert {"head.weight", "head.bias"} <= set(graph.params)


def test_lstm_imports_as_time_scans_and_gets_the_wavefront():
    torch.manual_seed(0)
    lstm, inputs = torch.nn.LSTM(6, 8, num_layers=2), (torch.randn(4, 1, 6),)
    graph = souffle.from_onnx(_exported(lstm, inputs, 17))
    _check(graph, lstm, inputs)
    compiled = _check(graph, lstm, inputs, "llvm-persistent", 4)
    assert any("2 layers x 4 steps -> one wavefront scan" in line for line in compiled.transforms), compiled.transforms


def test_souffles_own_export_imports_back(tmp_path):
    from souffle.onnx_export import to_onnx

    torch.manual_seed(0)
    module, inputs = Attention(), (torch.randn(1, 6, 16),)
    graph = souffle.from_torch(module, inputs)
    path = tmp_path / "attention.onnx"
    onnx.save(to_onnx(graph), str(path))
    _check(souffle.from_onnx(path), module.eval(), inputs)


def test_symbolic_input_needs_a_shape():
    torch.manual_seed(0)
    module, inputs = MLP(), (torch.randn(2, 12),)
    model = _exported(module, inputs, 17, input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    with pytest.raises(ModelImportError, match=r"input 'x' has a symbolic dimension 0 \('batch'\).*input_shapes"):
        souffle.from_onnx(model)
    _check(souffle.from_onnx(model, input_shapes={"x": (2, 12)}), module, inputs)


def _one_node_model(op_type: str, opset: int = 17):
    node = helper.make_node(op_type, ["x"], ["y"], name="the_node", axis=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_unsupported_op_is_named_with_its_node():
    with pytest.raises(UnsupportedOpError, match=r"unsupported ONNX op 'LpNormalization' \(node 'the_node', output 'y'\)"):
        souffle.from_onnx(_one_node_model("LpNormalization"))


def test_opsets_outside_13_to_21_are_refused():
    with pytest.raises(ModelImportError, match="opset 12 is not supported; souffle imports opsets 13 to 21"):
        souffle.from_onnx(_one_node_model("Softmax", opset=12))


def test_cli_compiles_and_checks_an_onnx_file(tmp_path, capsys):
    torch.manual_seed(0)
    path = tmp_path / "mlp.onnx"
    onnx.save(_exported(MLP(), (torch.randn(2, 12),), 17, input_names=["x"], dynamic_axes={"x": {0: "batch"}}),
              str(path))
    assert main(["compile", str(path), "--input-shape", "x=3,12", "--check", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "check          PASS" in out and "vs ONNX Runtime" in out
    assert main(["compile", str(path), "--input-shape", "x=3,a"]) == 2
    assert "expected NAME=D1,D2,... with integer sizes" in capsys.readouterr().err


class PadRollGather(torch.nn.Module):
    """F.pad (ONNX Pad), torch.roll (Slice and Concat), a gather by scattered constant indices and
    one by an index input on axis 1 (ONNX Gather, as take)."""

    def forward(self, x, rows):
        y = torch.nn.functional.pad(x, (1, 2, 0, 1), value=-0.5)
        y = torch.roll(y, shifts=(-1, 2), dims=(1, 2))
        return y[:, :, [4, 0, 2]], torch.index_select(y, 1, rows)


@pytest.mark.parametrize("opset", [13, 18])
def test_pad_roll_and_gathers(opset):
    module, inputs = PadRollGather(), (torch.randn(2, 3, 4), torch.tensor([3, 0, 3]))
    graph = souffle.from_onnx(_exported(module, inputs, opset))
    assert {"pad", "take"} <= {op.kind for op in graph.ops}
    _check(graph, module, inputs)


def test_reflect_padding_is_refused():
    class Reflect(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.pad(x, (1, 1), mode="reflect")

    with pytest.raises(UnsupportedOpError, match=r"ONNX Pad .*only constant padding"):
        souffle.from_onnx(_exported(Reflect(), (torch.randn(1, 2, 4),), 17))


class PositionsAndProjections(torch.nn.Module):
    """A transformer's first steps: position embeddings gathered by a constant buffer, and two
    torch.nn.Linear on the 3-D activation (exported as MatMul by the transposed weight, then Add)."""

    def __init__(self):
        super().__init__()
        self.query, self.key = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.positions = torch.nn.Embedding(10, 8)
        self.register_buffer("position_ids", torch.arange(10).unsqueeze(0), persistent=False)

    def forward(self, x):
        x = x + self.positions(self.position_ids[:, :x.shape[1]])
        return self.query(x) * self.key(x)


def test_linear_on_3d_inputs_is_one_dense_with_its_bias_and_constant_rows_a_slice():
    """As from_torch imports them: a dense per Linear (horizontal fusion then merges the two),
    and the position rows a slice of the table (a gather would be read as the whole table)."""
    torch.manual_seed(0)
    module, inputs = PositionsAndProjections(), (torch.randn(1, 6, 8),)
    graph = souffle.from_onnx(_exported(module, inputs, 17))
    dense = [op for op in graph.ops if op.kind == "dense"]
    assert len(dense) == 2 and all(len(op.inputs) == 3 for op in dense), str(graph)
    assert {"matmul", "embedding", "take"}.isdisjoint(op.kind for op in graph.ops)
    assert "positions.weight" in graph.params  # the table, sliced, not a copy of its rows
    compiled = _check(graph, module, inputs, "llvm-persistent", 4)
    assert any(line.startswith("horizontal:") for line in compiled.transforms), compiled.transforms


def test_gather_elements_of_constants_along_a_long_axis_is_computed_at_import():
    """Hugging Face BERT gathers its 512 token types by its position ids: onnx's reference
    evaluator (np.choose) takes at most 64 choices along the axis."""
    table = np.arange(100, dtype=np.float32).reshape(1, 100) / 10
    picks = np.arange(70, dtype=np.int64)[::-1].reshape(1, 70).copy()
    picks[0, 0] = -1  # counts from the end
    nodes = [helper.make_node("GatherElements", ["table", "picks"], ["gathered"], axis=1),
             helper.make_node("Add", ["x", "gathered"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 70])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 70])],
                              [onnx.numpy_helper.from_array(table, "table"), onnx.numpy_helper.from_array(picks, "picks")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(0).standard_normal((1, 70)).astype(np.float32)
    got = souffle.compile(souffle.from_onnx(model)).run({"x": x})[0]
    np.testing.assert_allclose(got, x + np.take_along_axis(table, picks % 100, axis=1), rtol=1e-6)


def test_gather_elements_of_a_run_time_tensor_is_refused():
    nodes = [helper.make_node("GatherElements", ["x", "picks"], ["y"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                              [onnx.numpy_helper.from_array(np.array([2, 0], np.int64), "picks")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedOpError, match="GatherElements .*the data must be known at import time"):
        souffle.from_onnx(model)
