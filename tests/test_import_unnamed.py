"""Hugging Face encoders that souffle was never written for, imported by from_torch with no
code change: DistilBERT, ELECTRA (a factorized embedding projected up to the hidden size) and
ALBERT (one layer's weights shared by every layer, and a pooler), each with a padded batch's
attention_mask. They are built only from ops the importer covers, so they must compile to one
function and equal PyTorch; RoBERTa computes its position ids with ``cumsum``, which the
importer does not cover, and must be refused with that op and the line of transformers that
calls it.

(torchvision's classifiers are the other public family the issue names; its wheels on the
registry are built against the CUDA torch and fail to load with the CPU torch 2.13 here:
"operator torchvision::nms does not exist".)"""

import numpy as np
import pytest
from model_checks import run_poisoned

import souffle
from souffle.errors import UnsupportedOpError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RTOL = ATOL = 1e-4
SMALL = dict(vocab_size=100, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64)

ENCODERS = {
    "distilbert": ("DistilBertModel", "DistilBertConfig",
                   dict(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64)),
    "electra": ("ElectraModel", "ElectraConfig", dict(SMALL, embedding_size=16, hidden_size=32, intermediate_size=64)),
    "albert": ("AlbertModel", "AlbertConfig", dict(SMALL, embedding_size=16, hidden_size=32, intermediate_size=64)),
}


def _encoder(model_class: str, config_class: str, config: dict):
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**config, attn_implementation="eager")
    return getattr(transformers, model_class)(config).eval()


def _padded_batch():
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 10:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name", list(ENCODERS))
@pytest.mark.parametrize("target", ["llvm", "llvm-persistent"])
def test_an_unnamed_hugging_face_encoder_imports_and_matches(name, target):
    module = _encoder(*ENCODERS[name])
    inputs = _padded_batch()
    graph = souffle.from_torch(module, inputs)
    assert [spec.name for spec in graph.inputs] == ["input_ids", "attention_mask"]
    compiled = souffle.compile(graph, target=target)
    assert compiled.kernel_count == 1
    got = run_poisoned(compiled, {k: v.numpy() for k, v in inputs.items()})
    with torch.no_grad():
        result = module(**inputs)
    want = [result.last_hidden_state] + ([result.pooler_output] if "pooler_output" in result else [])
    assert len(got) == len(want)
    for value, expected in zip(got, want):
        np.testing.assert_allclose(value, expected.numpy(), rtol=RTOL, atol=ATOL)


def test_an_encoder_with_an_uncovered_op_is_refused_with_the_op_and_its_source_line():
    module = _encoder("RobertaModel", "RobertaConfig", dict(SMALL, hidden_size=32, intermediate_size=64))
    with pytest.raises(UnsupportedOpError) as refused:
        souffle.from_torch(module, _padded_batch())
    message = str(refused.value)
    assert "aten.cumsum" in message
    assert "modeling_roberta.py" in message and "create_position_ids_from_input_ids" in message
