"""BERT encoder with Hugging Face ``BertModel`` semantics and state_dict names.

The encoder's identical layers are ONE scan over layers (carry: the hidden
states), so the paper config's 12 layers are lowered and compiled once.

As in the paper, the named configs take ``input_ids`` only (token types all zero, no padding).
``{"token_type_ids": True}`` adds that input, and ``{"attention_mask": "int64"}`` (or
``"float32"``) a (batch, seq) mask of 1s (attend) and 0s (padding): Hugging Face's eager
attention adds 0 where it is nonzero and float32's lowest value elsewhere to every head's
scores, and so does the graph, so a padded batch matches BertModel at every position.
"""

from __future__ import annotations

import math

import numpy as np

from souffle.errors import ConfigError
from souffle.graph import Graph, GraphBuilder
from souffle.models.torch_interop import load_weights

_OPTIONS = {"batch": 1, "attention_mask": None, "token_type_ids": False, "pooler": True, "layer_norm_eps": 1e-12}

CONFIGS = {
    "tiny": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "seq": 8, "vocab": 100, "max_positions": 16,
             "type_vocab": 2, **_OPTIONS},
    "paper": {"layers": 12, "hidden": 768, "heads": 12, "ffn": 3072, "seq": 384, "vocab": 30522,
              "max_positions": 512, "type_vocab": 2, **_OPTIONS},
}

MASK_DTYPES = ("int64", "float32")

# Buffers some BertModel versions keep in the state_dict; they are not weights.
IGNORED_SUFFIXES = ("position_ids", "token_type_ids")

TOLERANCE = {"tiny": (1e-4, 1e-4), "paper": (1e-3, 1e-3)}

# Hugging Face's additive mask value where attention_mask is 0: torch.finfo(torch.float32).min.
MASKED_SCORE = float(np.finfo(np.float32).min)


def check_config(cfg):
    """Refuse what the graph cannot build: heads that do not divide the hidden size, a sequence
    longer than the position table, a mask dtype other than int64 or float32."""
    if cfg["hidden"] % cfg["heads"]:
        raise ConfigError(f"bert: hidden {cfg['hidden']} is not divisible by heads {cfg['heads']}")
    if cfg["seq"] > cfg["max_positions"]:
        raise ConfigError(f"bert: seq {cfg['seq']} is longer than max_positions {cfg['max_positions']}")
    if cfg["attention_mask"] is not None and cfg["attention_mask"] not in MASK_DTYPES:
        raise ConfigError(f"bert: attention_mask must be None (no mask input) or the mask's dtype "
                          f"{' or '.join(MASK_DTYPES)}, got {cfg['attention_mask']!r}")
    eps = cfg["layer_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ConfigError(f"bert: layer_norm_eps must be a small positive number, got {eps!r}")


def config_from_object(obj):
    """The config of a Hugging Face ``BertConfig`` (None for another object). seq and batch are
    not part of it and keep tiny's values (override them with a dict); settings the graph does not
    compute (an activation other than exact GELU, relative positions, a decoder) are refused."""
    if type(obj).__name__ != "BertConfig" or not hasattr(obj, "hidden_size"):
        return None
    unsupported = {
        "hidden_act": ("gelu", getattr(obj, "hidden_act", "gelu")),
        "position_embedding_type": ("absolute", getattr(obj, "position_embedding_type", "absolute")),
        "is_decoder": (False, getattr(obj, "is_decoder", False)),
        "add_cross_attention": (False, getattr(obj, "add_cross_attention", False)),
    }
    for key, (supported, value) in unsupported.items():
        if value != supported:
            raise ConfigError(f"bert: BertConfig.{key}={value!r} is not implemented (souffle's BERT computes "
                              f"{key}={supported!r}); building it would silently compute another model")
    return {"layers": obj.num_hidden_layers, "hidden": obj.hidden_size, "heads": obj.num_attention_heads,
            "ffn": obj.intermediate_size, "vocab": obj.vocab_size, "max_positions": obj.max_position_embeddings,
            "type_vocab": obj.type_vocab_size, "layer_norm_eps": float(obj.layer_norm_eps)}


def adapt_weights(weights: dict, cfg: dict) -> tuple[dict, dict, list[str]]:
    """A state_dict of a model that wraps BertModel under ``bert.`` (BertForMaskedLM,
    BertForSequenceClassification) as BertModel's names: (weights, config changes, notes).
    The head's keys are dropped, and a wrapper without a pooler builds a graph without one."""
    if any(key.startswith("embeddings.") for key in weights) or not any(key.startswith("bert.") for key in weights):
        return weights, {}, []
    inner = {key.removeprefix("bert."): value for key, value in weights.items() if key.startswith("bert.")}
    head = sorted(key for key in weights if not key.startswith("bert."))
    notes = ["'bert.' prefix stripped from the keys (a model wrapping BertModel)"]
    if head:
        shown = ", ".join(head[:3]) + (f", ... ({len(head) - 3} more)" if len(head) > 3 else "")
        notes.append(f"{len(head)} keys of the head outside BertModel ignored: {shown}")
    changes = {}
    if cfg["pooler"] and not any(key.startswith("pooler.") for key in inner):
        changes["pooler"] = False
        notes.append("no pooler weights: the graph outputs last_hidden_state only")
    return inner, changes, notes


def _layer_param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """One encoder layer's parameters, named as under ``encoder.layer.{i}.``."""
    h, f = cfg["hidden"], cfg["ffn"]
    shapes = {}
    for proj in ("query", "key", "value"):
        shapes[f"attention.self.{proj}.weight"] = (h, h)
        shapes[f"attention.self.{proj}.bias"] = (h,)
    shapes.update({
        "attention.output.dense.weight": (h, h),
        "attention.output.dense.bias": (h,),
        "attention.output.LayerNorm.weight": (h,),
        "attention.output.LayerNorm.bias": (h,),
        "intermediate.dense.weight": (f, h),
        "intermediate.dense.bias": (f,),
        "output.dense.weight": (h, f),
        "output.dense.bias": (h,),
        "output.LayerNorm.weight": (h,),
        "output.LayerNorm.bias": (h,),
    })
    return shapes


def _param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    h = cfg["hidden"]
    shapes = {
        "embeddings.word_embeddings.weight": (cfg["vocab"], h),
        "embeddings.position_embeddings.weight": (cfg["max_positions"], h),
        "embeddings.token_type_embeddings.weight": (cfg["type_vocab"], h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for i in range(cfg["layers"]):
        for name, shape in _layer_param_shapes(cfg).items():
            shapes[f"encoder.layer.{i}.{name}"] = shape
    if cfg["pooler"]:
        shapes["pooler.dense.weight"] = (h, h)
        shapes["pooler.dense.bias"] = (h,)
    return shapes


def init_weights(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights that keep activations O(1): Linear ~ N(0, 1/fan_in), so that
    attention scores are not all equal (HF's std 0.02 would make softmax nearly uniform)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in _param_shapes(cfg).items():
        if "LayerNorm" in name:
            base = 1.0 if name.endswith("weight") else 0.0
            value = base + 0.1 * rng.standard_normal(shape)
        elif "embeddings" in name:
            value = rng.standard_normal(shape)
        elif name.endswith("weight"):
            value = rng.standard_normal(shape) / math.sqrt(shape[1])
        else:
            value = 0.1 * rng.standard_normal(shape)
        weights[name] = value.astype(np.float32)
    return weights


def _encoder_layer(cfg) -> Graph:
    """One BertLayer: self-attention + FFN, each with a residual and post-LayerNorm. With a mask,
    the layer reads ``attention_bias`` (batch * heads, 1, S), added to the scaled scores."""
    batch, s, h, heads = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["heads"]
    head_dim, eps = h // heads, cfg["layer_norm_eps"]
    b = GraphBuilder("bert_layer")
    p = {name: b.param(name, shape) for name, shape in _layer_param_shapes(cfg).items()}
    x = b.input("hidden_states", (batch, s, h))
    bias = b.input("attention_bias", (batch * heads, 1, s)) if cfg["attention_mask"] else None

    def heads_first(t):
        """(B, S, H) -> (B * heads, S, head_dim)."""
        if batch == 1:
            return b.op("transpose", b.op("reshape", t, shape=(s, heads, head_dim)), axes=(1, 0, 2))
        split = b.op("transpose", b.op("reshape", t, shape=(batch, s, heads, head_dim)), axes=(0, 2, 1, 3))
        return b.op("reshape", split, shape=(batch * heads, s, head_dim))

    def heads_merged(t):
        """(B * heads, S, head_dim) -> (B, S, H)."""
        if batch == 1:
            return b.op("reshape", b.op("transpose", t, axes=(1, 0, 2)), shape=(1, s, h))
        split = b.op("reshape", t, shape=(batch, heads, s, head_dim))
        return b.op("reshape", b.op("transpose", split, axes=(0, 2, 1, 3)), shape=(batch, s, h))

    q, k, v = (
        heads_first(b.op("dense", x, p[f"attention.self.{proj}.weight"], p[f"attention.self.{proj}.bias"]))
        for proj in ("query", "key", "value")
    )
    scores = b.op("scale", b.op("batch_matmul", q, k, transpose_b=True), factor=1.0 / math.sqrt(head_dim))
    if bias is not None:
        scores = b.op("add", scores, bias)
    probs = b.op("softmax", scores, axis=-1)
    merged = heads_merged(b.op("batch_matmul", probs, v))
    attn = b.op("dense", merged, p["attention.output.dense.weight"], p["attention.output.dense.bias"])
    x = b.op("layer_norm", b.op("add", attn, x), p["attention.output.LayerNorm.weight"],
             p["attention.output.LayerNorm.bias"], eps=eps)
    inner = b.op("gelu", b.op("dense", x, p["intermediate.dense.weight"], p["intermediate.dense.bias"]))
    ffn = b.op("dense", inner, p["output.dense.weight"], p["output.dense.bias"])
    out = b.op("layer_norm", b.op("add", ffn, x), p["output.LayerNorm.weight"], p["output.LayerNorm.bias"],
               eps=eps, name="layer_output")
    return b.build(out)


def _attention_bias(b: GraphBuilder, cfg, mask: str) -> str:
    """Hugging Face's additive mask, 0 where ``mask`` (B, S) is nonzero and float32's lowest value
    elsewhere, repeated for each head as (B * heads, 1, S)."""
    batch, s, heads = cfg["batch"], cfg["seq"], cfg["heads"]
    zero = b.op("full", shape=(1,), value=0, dtype=cfg["attention_mask"], name="mask_zero")
    attend = b.op("ne", mask, zero, name="attend")
    keep = b.op("full", shape=(1,), value=0.0, dtype="float32", name="mask_keep")
    drop = b.op("full", shape=(1,), value=MASKED_SCORE, dtype="float32", name="mask_drop")
    bias = b.op("reshape", b.op("where", attend, keep, drop), shape=(batch, 1, 1, s))
    per_head = b.op("expand", bias, shape=(batch, heads, 1, s))
    return b.op("reshape", per_head, shape=(batch * heads, 1, s), name="attention_bias")


def build_graph(cfg, weights) -> Graph:
    """input_ids (B, S) int64 [, attention_mask (B, S), token_type_ids (B, S) int64] ->
    last_hidden_state (B, S, H) [, pooler_output (B, H)]."""
    batch, s, h = cfg["batch"], cfg["seq"], cfg["hidden"]
    eps = cfg["layer_norm_eps"]
    b = GraphBuilder("bert")
    p = {name: b.param(name, shape) for name, shape in _param_shapes(cfg).items()}
    ids = b.input("input_ids", (batch, s), "int64")
    mask = b.input("attention_mask", (batch, s), cfg["attention_mask"]) if cfg["attention_mask"] else None

    words = b.op("embedding", p["embeddings.word_embeddings.weight"], ids)
    positions = b.op("slice", p["embeddings.position_embeddings.weight"], begin=0, end=s, axis=0)
    if cfg["token_type_ids"]:
        token_types = b.op("embedding", p["embeddings.token_type_embeddings.weight"],
                           b.input("token_type_ids", (batch, s), "int64"))
    else:
        token_types = b.op("slice", p["embeddings.token_type_embeddings.weight"], begin=0, end=1, axis=0)
    embedded = b.op("add", b.op("add", words, positions), token_types)
    hidden = b.op("layer_norm", embedded, p["embeddings.LayerNorm.weight"], p["embeddings.LayerNorm.bias"], eps=eps)

    layer = _encoder_layer(cfg)
    (last_hidden,), _ = b.scan(
        layer, cfg["layers"], name="encoder",
        carry=[("hidden_states", "layer_output", hidden)],
        params={name: [f"encoder.layer.{i}.{name}" for i in range(cfg["layers"])] for name in layer.params},
        invariants=[("attention_bias", _attention_bias(b, cfg, mask))] if mask else [],
    )
    if not cfg["pooler"]:
        return b.build(last_hidden).with_weights(weights)
    first_token = b.op("reshape", b.op("slice", last_hidden, begin=0, end=1, axis=1), shape=(batch, h))
    pooled = b.op("tanh", b.op("dense", first_token, p["pooler.dense.weight"], p["pooler.dense.bias"]),
                  name="pooler_output")
    return b.build(last_hidden, pooled).with_weights(weights)


def make_inputs(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    """Random ids; a mask that pads the tail of every sequence but the first (sequence r keeps
    seq - r * seq // (2 * batch) tokens), token types 0 for the first half and 1 after."""
    batch, s = cfg["batch"], cfg["seq"]
    rng = np.random.default_rng(seed)
    inputs = {"input_ids": rng.integers(0, cfg["vocab"], size=(batch, s), dtype=np.int64)}
    if cfg["attention_mask"]:
        lengths = [s - r * (s // (2 * batch)) for r in range(batch)]
        inputs["attention_mask"] = np.array([[1] * n + [0] * (s - n) for n in lengths], dtype=cfg["attention_mask"])
    if cfg["token_type_ids"]:
        inputs["token_type_ids"] = np.array([[0] * (s // 2) + [1] * (s - s // 2)] * batch, dtype=np.int64)
    return inputs


def torch_module(cfg, weights=None):
    """A torch BertModel look-alike (same attribute paths as Hugging Face) in eval mode;
    loads ``weights`` strictly when given, else keeps torch's own initialization."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    h, heads = cfg["hidden"], cfg["heads"]

    class Embeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.word_embeddings = nn.Embedding(cfg["vocab"], h)
            self.position_embeddings = nn.Embedding(cfg["max_positions"], h)
            self.token_type_embeddings = nn.Embedding(cfg["type_vocab"], h)
            self.LayerNorm = nn.LayerNorm(h, eps=cfg["layer_norm_eps"])
            self.register_buffer("position_ids", torch.arange(cfg["max_positions"]).unsqueeze(0))

        def forward(self, input_ids, token_type_ids=None):
            seq = input_ids.shape[1]
            token_types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = (self.word_embeddings(input_ids) + self.position_embeddings(self.position_ids[:, :seq])
                 + self.token_type_embeddings(token_types))
            return self.LayerNorm(x)

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)

        def forward(self, x, bias):
            batch, seq, _ = x.shape

            def split(t):
                return t.view(batch, seq, heads, h // heads).transpose(1, 2)

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            scores = q @ k.transpose(-1, -2) / math.sqrt(h // heads)
            if bias is not None:
                scores = scores + bias
            context = torch.softmax(scores, dim=-1) @ v
            return context.transpose(1, 2).reshape(batch, seq, h)

    class DenseLayerNorm(nn.Module):
        """BertSelfOutput / BertOutput: dense, residual add, LayerNorm."""

        def __init__(self, features):
            super().__init__()
            self.dense = nn.Linear(features, h)
            self.LayerNorm = nn.LayerNorm(h, eps=cfg["layer_norm_eps"])

        def forward(self, x, residual):
            return self.LayerNorm(self.dense(x) + residual)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.self = SelfAttention()
            self.output = DenseLayerNorm(h)

        def forward(self, x, bias):
            return self.output(self.self(x, bias), x)

    class Intermediate(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(h, cfg["ffn"])

        def forward(self, x):
            return F.gelu(self.dense(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = Attention()
            self.intermediate = Intermediate()
            self.output = DenseLayerNorm(cfg["ffn"])

        def forward(self, x, bias):
            x = self.attention(x, bias)
            return self.output(self.intermediate(x), x)

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.ModuleList(Layer() for _ in range(cfg["layers"]))

        def forward(self, x, bias):
            for layer in self.layer:
                x = layer(x, bias)
            return x

    class Pooler(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(h, h)

        def forward(self, x):
            return torch.tanh(self.dense(x[:, 0]))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.embeddings = Embeddings()
            self.encoder = Encoder()
            if cfg["pooler"]:
                self.pooler = Pooler()

        def forward(self, input_ids, attention_mask=None, token_type_ids=None):
            bias = None
            if attention_mask is not None:  # Hugging Face's eager attention mask
                attend = attention_mask.bool()[:, None, None, :]
                bias = torch.where(attend, 0.0, torch.finfo(torch.float32).min)
            hidden = self.encoder(self.embeddings(input_ids, token_type_ids), bias)
            return (hidden, self.pooler(hidden)) if cfg["pooler"] else (hidden,)

    model = Bert().eval()
    return model if weights is None else load_weights(model, weights, IGNORED_SUFFIXES)


def torch_reference(cfg, weights):
    """inputs -> [last_hidden_state, pooler_output] (the pooler's when the config has one)
    computed by the torch module."""
    import torch

    model = torch_module(cfg, weights)

    def run(inputs):
        with torch.no_grad():
            outputs = model(**{name: torch.from_numpy(value) for name, value in inputs.items()})
        return [output.float().numpy() for output in outputs]

    return run
