"""BERT: graph structure, torch-reference agreement, and state_dict round trip."""

import re

import numpy as np
import pytest
from model_checks import (
    check_against_torch,
    check_init_weights_match_torch,
    run_poisoned,
    torch_state_dict_weights,
)

import souffle
from souffle import models
from souffle.errors import ConfigError
from souffle.graph import Scan
from souffle.models import bert


def test_tiny_graph_is_one_scan_over_layers():
    cfg = bert.CONFIGS["tiny"]
    graph = bert.build_graph(cfg, bert.init_weights(cfg, seed=0))
    scans = [op for op in graph.ops if isinstance(op, Scan)]
    assert len(scans) == 1 and scans[0].length == cfg["layers"]
    bound = dict(scans[0].params)["attention.self.query.weight"]
    assert bound == tuple(f"encoder.layer.{i}.attention.self.query.weight" for i in range(cfg["layers"]))
    assert [(s.name, s.shape, s.dtype) for s in graph.inputs] == [("input_ids", (1, cfg["seq"]), "int64")]
    assert [s.shape for s in graph.output_specs()] == [(1, cfg["seq"], cfg["hidden"]), (1, cfg["hidden"])]


def test_init_weights_match_torch_state_dict_and_are_deterministic():
    check_init_weights_match_torch(bert, bert.CONFIGS["tiny"])


def test_tiny_matches_torch():
    cfg = bert.CONFIGS["tiny"]
    check_against_torch(bert, cfg, bert.TOLERANCE["tiny"], bert.init_weights(cfg, seed=0))


def test_tiny_torch_state_dict_round_trip():
    cfg = bert.CONFIGS["tiny"]
    check_against_torch(bert, cfg, bert.TOLERANCE["tiny"], torch_state_dict_weights(bert, cfg))


@pytest.mark.slow
def test_paper_matches_torch_and_compiles_fast():
    cfg = bert.CONFIGS["paper"]
    compile_s = check_against_torch(bert, cfg, bert.TOLERANCE["paper"], bert.init_weights(cfg, seed=0))
    assert compile_s < 120, f"paper BERT took {compile_s:.1f} s to compile"


@pytest.mark.slow
def test_paper_torch_state_dict_round_trip():
    cfg = bert.CONFIGS["paper"]
    check_against_torch(bert, cfg, bert.TOLERANCE["paper"], torch_state_dict_weights(bert, cfg))


PADDED = {"batch": 2, "attention_mask": "int64", "token_type_ids": True}


def _hugging_face(cfg):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], intermediate_size=cfg["ffn"], max_position_embeddings=cfg["max_positions"],
        type_vocab_size=cfg["type_vocab"], attn_implementation="eager")
    return config


@pytest.mark.parametrize("mask_dtype", ["int64", "float32"])
def test_padded_batch_with_mask_and_token_types_matches_torch(mask_dtype):
    cfg = models.config("bert", {**PADDED, "attention_mask": mask_dtype})
    graph = models.build("bert", cfg)
    assert [(s.name, s.shape, s.dtype) for s in graph.inputs] == [
        ("input_ids", (2, 8), "int64"), ("attention_mask", (2, 8), mask_dtype), ("token_type_ids", (2, 8), "int64")]
    inputs = models.make_inputs("bert", cfg, seed=1)
    assert inputs["attention_mask"].tolist() == [[1] * 8, [1] * 6 + [0] * 2]  # the second sequence padded
    want = models.reference("bert", cfg, graph.weights)(inputs)
    for target in ("llvm", "llvm-persistent"):
        got = run_poisoned(souffle.compile(graph, target=target), inputs)
        for name, value, expected in zip(graph.outputs, got, want):
            np.testing.assert_allclose(value, expected, rtol=1e-4, atol=1e-4, err_msg=f"{target} {name}")


def test_the_mask_changes_the_unpadded_sequence_as_padding_must_not():
    """Padding the second sequence leaves the first one's outputs as they were and changes the
    second's: the mask is read, per sequence."""
    graph = souffle.compile(models.build("bert", PADDED), target="llvm")
    inputs = models.make_inputs("bert", PADDED, seed=1)
    padded = graph.run(inputs)[0]
    unmasked = graph.run({**inputs, "attention_mask": np.ones_like(inputs["attention_mask"])})[0]
    np.testing.assert_array_equal(padded[0], unmasked[0])
    assert np.abs(padded[1] - unmasked[1]).max() > 1e-2


def test_hugging_face_bert_model_weights_and_padded_batch_match_it():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_config = _hugging_face(models.config("bert"))
    torch.manual_seed(0)
    reference = transformers.BertModel(hf_config).eval()
    cfg = {**models.config("bert", hf_config), **PADDED}
    graph = models.build("bert", cfg, weights=reference.state_dict())
    inputs = models.make_inputs("bert", cfg, seed=2)
    got = run_poisoned(souffle.compile(graph, target="llvm"), inputs)
    with torch.no_grad():
        result = reference(**{name: torch.from_numpy(value) for name, value in inputs.items()})
    for value, expected in zip(got, [result.last_hidden_state, result.pooler_output]):
        np.testing.assert_allclose(value, expected.numpy(), rtol=1e-4, atol=1e-4)


def test_a_hugging_face_config_becomes_the_same_sizes():
    cfg = models.config("bert", _hugging_face(models.config("bert", "paper")))
    paper = models.config("bert", "paper")
    assert {k: cfg[k] for k in ("layers", "hidden", "heads", "ffn", "vocab", "max_positions", "type_vocab")} == \
        {k: paper[k] for k in ("layers", "hidden", "heads", "ffn", "vocab", "max_positions", "type_vocab")}
    assert cfg["seq"] == models.config("bert")["seq"] and cfg["layer_norm_eps"] == 1e-12


@pytest.mark.parametrize("setting, value", [("hidden_act", "relu"), ("hidden_act", "gelu_new"),
                                            ("position_embedding_type", "relative_key"), ("is_decoder", True)])
def test_a_hugging_face_setting_the_graph_does_not_compute_is_refused(setting, value):
    hf_config = _hugging_face(models.config("bert"))
    setattr(hf_config, setting, value)
    with pytest.raises(ConfigError, match=rf"BertConfig\.{setting}={value!r} is not implemented"):
        models.build("bert", hf_config)


@pytest.mark.parametrize("config, message", [
    ({"hidden": 30, "heads": 4}, "hidden 30 is not divisible by heads 4"),
    ({"seq": 32}, "seq 32 is longer than max_positions 16"),
    ({"attention_mask": "bool"}, "attention_mask must be None .* int64 or float32, got 'bool'"),
    ({"layer_norm_eps": -1.0}, "layer_norm_eps must be a small positive number"),
])
def test_a_config_the_graph_cannot_build_is_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        models.build("bert", config)


def test_masked_lm_weights_load_without_their_prefix_and_head_with_notes_in_the_report():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    mlm = transformers.BertForMaskedLM(_hugging_face(models.config("bert"))).eval()
    graph = models.build("bert", PADDED, weights=mlm.state_dict())
    assert graph.outputs == ("encoder.hidden_states",)  # BertForMaskedLM's BertModel has no pooler
    compiled = souffle.compile(graph, target="llvm")
    inputs = models.make_inputs("bert", PADDED, seed=3)
    with torch.no_grad():
        expected = mlm.bert(**{name: torch.from_numpy(value) for name, value in inputs.items()}).last_hidden_state
    np.testing.assert_allclose(run_poisoned(compiled, inputs)[0], expected.numpy(), rtol=1e-4, atol=1e-4)
    report = str(compiled.report())
    assert "weights note 1 'bert.' prefix stripped" in report
    assert re.search(r"weights note 2 \d+ keys of the head outside BertModel ignored: cls\.predictions", report)
    assert "weights note 3 no pooler weights: the graph outputs last_hidden_state only" in report


@pytest.mark.parametrize("dtype, note", [
    ("bfloat16", "39 tensors converted bfloat16 -> float32"),
    ("float16", "39 tensors converted float16 -> float32"),
    ("float64", "39 tensors converted float64 -> float32 (rounded to nearest)"),
])
def test_weights_of_another_float_dtype_are_converted_with_a_note(dtype, note):
    torch = pytest.importorskip("torch")
    weights = {k: torch.from_numpy(v.copy()).to(getattr(torch, dtype)) for k, v in models.build("bert").weights.items()}
    graph = models.build("bert", weights=weights)
    assert len(weights) == 39 and graph.weight_notes == (note,)
    assert all(graph.weights[k].dtype == np.float32 for k in weights)
    assert f"weights note 1 {note}" in str(souffle.compile(graph, target="llvm").report())
    numpy_weights = {k: v.float().numpy().astype(dtype if dtype != "bfloat16" else "float32") for k, v in weights.items()}
    if dtype != "bfloat16":
        assert models.build("bert", weights=numpy_weights).weight_notes == (note,)


def test_float32_weights_get_no_note():
    assert models.build("bert", weights=models.build("bert").weights).weight_notes == ()
