"""The paper's models from their public definitions, imported through from_torch (and ONNX) at a
small configuration: equal to PyTorch at fp32, and the transforms fire as on the hand-built models
(repeated layers folded into scans, horizontal fusion of BERT's Q/K/V, the LSTM wavefront), with
the same kernel counts, stages and static bytes."""

import io

import numpy as np
import pytest
from model_checks import run_poisoned

from codegen.traffic import memory_traffic
from souffle.compiler import run_passes

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import souffle  # noqa: E402
from souffle import models  # noqa: E402
from souffle.errors import ModelImportError  # noqa: E402

RTOL = ATOL = 1e-4


def _compare(graph, module, inputs: dict, target="llvm"):
    compiled = souffle.compile(graph, target=target)
    got = compiled.run({k: v.numpy() for k, v in inputs.items()})
    with torch.no_grad():
        result = module(**inputs)
    want = [result.last_hidden_state, result.pooler_output] if hasattr(result, "last_hidden_state") else \
        torch.utils._pytree.tree_leaves(result)
    assert len(got) == len(want)
    for name, value, expected in zip(graph.outputs, got, want):
        np.testing.assert_allclose(value, expected.numpy(), rtol=RTOL, atol=ATOL, err_msg=name)
    return compiled


def _hugging_face_bert():
    transformers = pytest.importorskip("transformers")
    cfg = models.config("bert", "tiny")
    config = transformers.BertConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], intermediate_size=cfg["ffn"], max_position_embeddings=cfg["max_positions"],
        type_vocab_size=cfg["type_vocab"], attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BertModel(config).eval(), cfg


def test_hugging_face_bert_with_token_types_fuses_q_k_v_like_the_hand_built_one():
    bert, cfg = _hugging_face_bert()
    generator = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=generator),
              "token_type_ids": torch.tensor([[0] * (cfg["seq"] // 2) + [1] * (cfg["seq"] - cfg["seq"] // 2)])}
    graph = souffle.from_torch(bert, inputs)
    assert [spec.name for spec in graph.inputs] == ["input_ids", "token_type_ids"]
    _compare(graph, bert, inputs)
    imported = _compare(graph, bert, inputs, "llvm-persistent")
    hand_built = souffle.compile(models.build("bert"), target="llvm-persistent")
    for model in (imported, hand_built):  # once, in the body of the scan over the encoder's layers
        fused = [line for line in model.transforms if line.startswith("horizontal:") and "query" in line]
        assert len(fused) == 1 and "(3 x [32, 32])" in fused[0], model.transforms
    assert imported.report().kernels == hand_built.report().kernels == 1


def _padded_batch(cfg):
    """Two sequences, the second padded after 5 tokens, with token types 0 then 1."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg["vocab"], (2, cfg["seq"]), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    token_types = torch.zeros_like(ids)
    token_types[:, cfg["seq"] // 2:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": token_types}


def _compare_poisoned(graph, reference, inputs: dict, target):
    compiled = souffle.compile(graph, target=target)
    got = run_poisoned(compiled, {k: v.numpy() for k, v in inputs.items()})
    with torch.no_grad():
        result = reference(**inputs)
    want = [result.last_hidden_state, result.pooler_output]
    assert len(got) == len(want)
    for name, value, expected in zip(graph.outputs, got, want):
        np.testing.assert_allclose(value, expected.numpy(), rtol=RTOL, atol=ATOL, err_msg=f"{target} {name}")
    return got


def test_hugging_face_bert_padded_batch_with_attention_mask_matches_at_every_position():
    """Hugging Face builds the padding mask from bool tensors (a cast, an index by aranges, and,
    where); they import as int32 masks, and a padded batch equals BertModel at padded positions
    and the others."""
    bert, cfg = _hugging_face_bert()
    inputs = _padded_batch(cfg)
    graph = souffle.from_torch(bert, inputs)
    assert [(s.name, s.dtype) for s in graph.inputs] == [
        ("input_ids", "int64"), ("attention_mask", "int64"), ("token_type_ids", "int64")]
    kinds = {op.kind for op in graph.ops}
    assert {"ne", "where"} <= kinds
    for target in ("llvm", "llvm-persistent"):
        padded = _compare_poisoned(graph, bert, inputs, target)[0]
    unmasked = souffle.compile(graph, target="llvm").run(
        {**{k: v.numpy() for k, v in inputs.items()}, "attention_mask": np.ones((2, cfg["seq"]), np.int64)})[0]
    assert np.abs(padded[1] - unmasked[1]).max() > 1e-2  # the mask is read


def test_hugging_face_bert_with_attention_mask_through_onnx_matches():
    onnx = pytest.importorskip("onnx")
    bert, cfg = _hugging_face_bert()
    inputs = _padded_batch(cfg)

    class Outputs(nn.Module):
        """BertModel's two outputs as a tuple, positional inputs: what the TorchScript exporter takes."""

        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            result = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return result.last_hidden_state, result.pooler_output

    buffer = io.BytesIO()
    torch.onnx.export(Outputs().eval(), tuple(inputs.values()), buffer, dynamo=False, opset_version=17,
                      input_names=list(inputs), output_names=["last_hidden_state", "pooler_output"])
    model = onnx.load_from_string(buffer.getvalue())
    assert {"Cast", "Where", "Equal"} <= {node.op_type for node in model.graph.node}
    graph = souffle.from_onnx(model)
    assert [s.name for s in graph.inputs] == list(inputs)
    _compare_poisoned(graph, bert, inputs, "llvm")


class LSTMWithState(nn.Module):
    """An nn.LSTM called with an initial state, as a user passes h0 and c0."""

    def __init__(self, bias):
        super().__init__()
        self.lstm = nn.LSTM(12, 16, 3, bias=bias)

    def forward(self, x, h0, c0):
        return self.lstm(x, (h0, c0))


@pytest.mark.parametrize("bias", [True, False])
def test_lstm_with_h0_c0_and_without_biases_matches(bias):
    torch.manual_seed(0)
    module = LSTMWithState(bias).eval()
    generator = torch.Generator().manual_seed(3)
    x, h0, c0 = (torch.randn(shape, generator=generator) for shape in ((5, 2, 12), (3, 2, 16), (3, 2, 16)))
    graph = souffle.from_torch(module, (x, h0, c0))
    assert [s.name for s in graph.inputs] == ["x", "h0", "c0"]
    assert any(name.startswith("lstm.bias") for name in graph.params) == bias
    for target in ("llvm", "llvm-persistent"):
        got = run_poisoned(souffle.compile(graph, target=target), {"x": x.numpy(), "h0": h0.numpy(), "c0": c0.numpy()})
        with torch.no_grad():
            output, (h_n, c_n) = module(x, h0, c0)
        for value, expected in zip(got, [output, h_n, c_n]):
            np.testing.assert_allclose(value, expected.numpy(), rtol=RTOL, atol=ATOL, err_msg=target)


def test_lstm_without_biases_keeps_the_wavefront():
    lstm = nn.LSTM(12, 16, 3, bias=False).eval()
    x = torch.randn(5, 1, 12)
    imported = _compare(souffle.from_torch(lstm, (x,)), lstm, {"input": x}, "llvm-persistent")
    assert any(line.startswith("wavefront:") for line in imported.transforms)


def test_lstm_kernels_equal_the_hand_built_model():
    cfg = models.config("lstm", "tiny")
    weights = models.get("lstm").init_weights(cfg, seed=0)
    lstm = nn.LSTM(cfg["input_size"], cfg["hidden_size"], cfg["num_layers"])
    lstm.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    x = torch.from_numpy(models.make_inputs("lstm", "tiny", seed=1)["x"])
    graph = souffle.from_torch(lstm, (x,))
    imported = _compare(graph, lstm.eval(), {"input": x}, "llvm-persistent")
    hand_built = souffle.compile(models.build("lstm"), target="llvm-persistent")
    assert any(line.startswith("wavefront:") for line in imported.transforms)
    assert imported.report().kernels == hand_built.report().kernels


class MMoE(nn.Module):
    """Multi-gate mixture of experts (Ma et al., KDD'18) as a torch user writes it."""

    def __init__(self, inputs, units, experts, tasks, tower):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(inputs, units) for _ in range(experts))
        self.gates = nn.ModuleList(nn.Linear(inputs, experts) for _ in range(tasks))
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(units, tower), nn.ReLU(), nn.Linear(tower, 1), nn.Sigmoid())
                                    for _ in range(tasks))

    def forward(self, x):
        experts = torch.stack([torch.relu(expert(x)) for expert in self.experts], dim=1)
        return [tower((torch.softmax(gate(x), dim=1).unsqueeze(2) * experts).sum(dim=1))
                for gate, tower in zip(self.gates, self.towers)]


def test_mmoe_module_matches_the_hand_built_weights_and_outputs():
    cfg = models.config("mmoe", "tiny")
    module = MMoE(cfg["input_size"], cfg["expert_units"], cfg["experts"], cfg["tasks"], cfg["tower_units"]).eval()
    hand_built = models.build("mmoe")
    module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in hand_built.weights.items()})
    x = torch.from_numpy(models.make_inputs("mmoe", "tiny", seed=1)["x"])
    graph = souffle.from_torch(module, (x,))
    assert set(graph.params) == set(hand_built.params)
    imported = _compare(graph, module, {"x": x}, "llvm-persistent")
    np.testing.assert_allclose(imported.run({"x": x.numpy()})[0],
                               souffle.compile(hand_built).run({"x": x.numpy()})[0], rtol=RTOL, atol=ATOL)


def test_resnext_module_with_torchvision_names_imports_and_matches():
    cfg = models.config("resnext", "tiny")
    module = models.get("resnext").torch_module(cfg, models.build("resnext").weights)
    image = torch.from_numpy(models.make_inputs("resnext", "tiny", seed=1)["x"])
    graph = souffle.from_torch(module, (image,))
    _compare(graph, module, {"x": image})


def test_a_bool_input_is_refused_with_what_to_pass_instead():
    class Masked(nn.Module):
        def forward(self, x, mask):
            return x.masked_fill(~mask, 0.0)

    x = torch.randn(2, 3)
    with pytest.raises(ModelImportError, match="input 'mask' is bool; .* pass the mask as int64 0s and 1s"):
        souffle.from_torch(Masked(), (x, torch.ones(2, 3, dtype=torch.bool)))


def test_masked_fill_by_a_mask_made_from_an_int_input_matches():
    class Masked(nn.Module):
        def forward(self, x, mask):
            return x.masked_fill(~mask.bool(), float("-inf")).softmax(-1) * (mask > 0)

    x = torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]])
    graph = souffle.from_torch(Masked(), (x, mask))
    got = run_poisoned(souffle.compile(graph, target="llvm"), {"x": x.numpy(), "mask": mask.numpy()})[0]
    np.testing.assert_allclose(got, Masked()(x, mask).numpy(), rtol=RTOL, atol=ATOL)


def test_indexing_by_constant_indices_gathers_and_bool_where_branches_stay_masks():
    class Picked(nn.Module):
        def forward(self, x, mask):
            keep = torch.where(mask > 1, mask > 0, mask < 0)  # bool branches
            order = torch.arange(4).flip(0) % 3  # [0, 2, 1, 0]: indices computed from constants
            return x[:, order] * keep[:, :4]

    x = torch.randn(2, 5)
    mask = torch.tensor([[2, 1, 0, 2, 1], [0, 2, 2, 1, 0]])
    graph = souffle.from_torch(Picked(), (x, mask))
    assert "embedding" in {op.kind for op in graph.ops}  # a gather: the indices are no mere layout
    got = run_poisoned(souffle.compile(graph, target="llvm"), {"x": x.numpy(), "mask": mask.numpy()})[0]
    np.testing.assert_allclose(got, Picked()(x, mask).numpy(), rtol=RTOL, atol=ATOL)


def test_hugging_face_bert_without_token_types_folds_its_transient_buffer():
    """Called without token_type_ids, Hugging Face gathers its non-persistent token_type_ids
    buffer by the position ids: a buffer outside the state_dict is a constant, folded at import,
    not a weight (which made aten.gather unsupported)."""
    bert, cfg = _hugging_face_bert()
    ids = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=torch.Generator().manual_seed(1))
    graph = souffle.from_torch(bert, {"input_ids": ids})
    assert [spec.name for spec in graph.inputs] == ["input_ids"]
    assert "embeddings.token_type_ids" not in graph.params  # folded: the gathered rows are a constant
    _compare(graph, bert, {"input_ids": ids})


class TupleOutputs(nn.Module):
    """A module whose outputs are a tuple, with positional inputs: what the TorchScript ONNX
    exporter takes (Hugging Face's BertModel returns an output object)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *inputs):
        result = self.module(*inputs)
        return (result.last_hidden_state, result.pooler_output) if hasattr(result, "last_hidden_state") else result


def _with_weights(module, weights):
    """``module`` with the hand-built model's weights (buffers the graph has no weight for kept)."""
    missing, unexpected = module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()},
                                                 strict=False)
    assert not unexpected and all(k.endswith(("position_ids", "token_type_ids", "num_batches_tracked"))
                                  for k in missing), (missing, unexpected)
    return module.eval()


def _paper_model(name, config):
    """The hand-built model at ``config`` and its public torch definition with the same weights,
    with the inputs to export it for: nn.LSTM, Hugging Face's BertModel, the torchvision-style
    ResNeXt, the MMoE module above."""
    hand_built = models.build(name, config)
    cfg = models.config(name, config)
    inputs = {k: torch.from_numpy(v) for k, v in models.make_inputs(name, config, seed=1).items()}
    if name == "lstm":
        module = nn.LSTM(cfg["input_size"], cfg["hidden_size"], cfg["num_layers"])
    elif name == "bert":
        module = _hugging_face_bert()[0]
    elif name == "resnext":
        module = models.get("resnext").torch_module(cfg)
    else:
        module = MMoE(cfg["input_size"], cfg["expert_units"], cfg["experts"], cfg["tasks"], cfg["tower_units"])
    return hand_built, _with_weights(module, hand_built.weights), inputs


def _static(graph) -> tuple[int, int, int]:
    """Kernels, stages executed and static bytes moved per inference, at llvm-persistent O4."""
    staged = run_passes(graph, "llvm-persistent", stop="plan_arena", opt_level=4).ir
    traffic = memory_traffic(staged)
    return staged.kernel_count(), traffic.stages_executed, traffic.total_bytes


# ResNeXt's tiny stages have 1, 2, 3 and 1 Bottlenecks: the hand-built model loops a stage's
# repeated blocks even when there is one (a scan of one iteration), which the importers cannot
# know of (a run needs two blocks), and that loop keeps the block's output stored: unrolled, the
# vertical pass inlines the first block's output, a relu of the sum of two batch-normed
# convolutions, into both its readers and stores both convolutions instead (797,040 B imported,
# 755,056 B hand-built at tiny). With 3 Bottlenecks in the second stage both loop it; the
# paper's stages have 3, 4, 23 and 3.
PARITY_CONFIGS = {"lstm": "tiny", "bert": "tiny", "resnext": {"blocks": [1, 3, 3, 1]}, "mmoe": "tiny"}


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_imported_models_have_the_hand_built_kernels_stages_and_bytes(name):
    """from_torch and from_onnx of each paper model's public definition compile, at
    llvm-persistent O4, to the hand-built model's kernels, stages and static bytes: their repeated
    layers fold into the same scans, and the same transforms fire (the LSTM wavefront, BERT's
    Q/K/V and MMoE's experts and towers fused horizontally, vertical fusion) on the same ops.

    ONNX is exported without the exporter's constant folding, which folds every BatchNorm into its
    convolution (ResNeXt then moves fewer bytes than the hand-built model: its state_dict keeps
    the BatchNorms). One difference remains, in the imported model's favour: ONNX MMoE's towers
    end in a Linear(8, 1) whose bias, a single number, the importer makes a constant (as any
    initializer whose elements are all equal); horizontal fusion stacks weights only, so the two
    towers' last layers stay two products, each with its sigmoid in registers. Each reads its
    tower's hidden layer once, so the vertical pass computes that layer's bias and ReLU inside the
    product instead of storing them (the hand-built model's stacked input reads them from the
    batched product: there they are its epilogue): 2 stages and 152 B fewer than the hand-built
    model's stacked input, batched product and two sigmoids (1,648 B against 1,800 B)."""
    onnx = pytest.importorskip("onnx")
    hand_built, module, inputs = _paper_model(name, PARITY_CONFIGS[name])
    exported = TupleOutputs(module).eval()  # the exporter restores the mode it found, recursively
    from_torch = souffle.from_torch(module, tuple(inputs.values()))
    buffer = io.BytesIO()
    torch.onnx.export(exported, tuple(inputs.values()), buffer, dynamo=False, opset_version=17,
                      input_names=list(inputs), do_constant_folding=False)
    from_onnx = souffle.from_onnx(onnx.load_from_string(buffer.getvalue()))
    expected = _static(hand_built)
    assert _static(from_torch) == expected
    if name == "mmoe":
        assert _static(from_onnx) == (expected[0], expected[1] - 2, expected[2] - 152)
    else:
        assert _static(from_onnx) == expected
    with torch.no_grad():
        want = torch.utils._pytree.tree_leaves(exported(*inputs.values()))
    for graph in (from_torch, from_onnx):
        got = souffle.compile(graph).run({spec.name: x.numpy() for spec, x in zip(graph.inputs, inputs.values())})
        assert len(got) == len(want)
        for value, expected_value in zip(got, want):
            np.testing.assert_allclose(value, expected_value.numpy(), rtol=RTOL, atol=ATOL, err_msg=graph.name)
