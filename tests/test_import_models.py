"""The paper's models from their public definitions, imported through from_torch at a small
configuration: equal to PyTorch at fp32, and the transforms fire as on the hand-built models
(horizontal fusion of BERT's Q/K/V, the LSTM wavefront), with the same kernel counts."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import souffle  # noqa: E402
from souffle import models  # noqa: E402
from souffle.errors import UnsupportedOpError  # noqa: E402

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
    fused = [line for line in imported.transforms if line.startswith("horizontal:") and "query" in line]
    assert len(fused) == cfg["layers"] and all("(3 x [32, 32])" in line for line in fused), imported.transforms
    hand_built = souffle.compile(models.build("bert"), target="llvm-persistent")
    assert imported.report().kernels == hand_built.report().kernels == 1


def test_hugging_face_bert_attention_mask_is_refused_at_its_source_line():
    """Hugging Face builds the padding mask as a bool tensor, a dtype souffle does not compute yet."""
    bert, cfg = _hugging_face_bert()
    ids = torch.zeros((1, cfg["seq"]), dtype=torch.int64)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    with pytest.raises(UnsupportedOpError, match=r"aten\._to_copy\.default.*modeling_bert\.py.*dtype 'bool'"):
        souffle.from_torch(bert, inputs)


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
