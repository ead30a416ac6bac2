"""Swin Transformer (Liu et al., ICCV'21) with torchvision ``swin_b`` semantics and state_dict names.

The reference is a torch module that follows torchvision's public architecture (v1: shifted
windows, a relative position bias gathered from a learned table by the constant
``relative_position_index`` buffer, PatchMerging, stochastic depth the identity in eval mode)
with exactly its state_dict keys, so ``torchvision.models.swin_b().state_dict()`` loads into it
and into the graph. The graph is not written op by op: it is that module imported through
``souffle.from_torch``, so what is compiled is what torch.export sees of the public model.
"""

from __future__ import annotations

import functools

import numpy as np

from souffle.errors import ConfigError
from souffle.graph import Graph
from souffle.models.torch_interop import load_weights

CONFIGS = {
    # 16x16 tokens in 4x4 windows, then 8x8 and 4x4: both shifted and unshifted windows, a
    # shift that torchvision turns off (the window covers the whole 4x4 map), two merges
    "tiny": {"patch": 2, "embed": 16, "depths": [2, 2, 1], "heads": [2, 2, 4], "window": 4, "image": 32,
             "classes": 10, "mlp_ratio": 4.0},
    "paper": {"patch": 4, "embed": 128, "depths": [2, 2, 18, 2], "heads": [4, 8, 16, 32], "window": 7,
              "image": 224, "classes": 1000, "mlp_ratio": 4.0},
}

IGNORED_SUFFIXES = ()

TOLERANCE = {"tiny": (1e-4, 1e-4), "paper": (1e-4, 1e-4)}

LAYER_NORM_EPS = 1e-5


def check_config(cfg):
    """Refuse a configuration that is not a Swin Transformer: a stage without its head count, a
    stage width (embed * 2^stage) that its heads do not divide, an image smaller than a patch."""
    if len(cfg["depths"]) != len(cfg["heads"]):
        raise ConfigError(f"swin: depths {cfg['depths']} and heads {cfg['heads']} must give one entry per stage")
    for stage, (depth, heads) in enumerate(zip(cfg["depths"], cfg["heads"])):
        width = cfg["embed"] * 2 ** stage
        if depth < 1 or heads < 1 or width % heads:
            raise ConfigError(f"swin: stage {stage} has {depth} blocks and {heads} heads for width {width}; "
                              f"blocks and heads must be positive and the heads must divide the width")
    if cfg["image"] < cfg["patch"]:
        raise ConfigError(f"swin: the image ({cfg['image']}) must hold at least one patch ({cfg['patch']})")


def torch_module(cfg, weights=None):
    """A torchvision-style SwinTransformer (same attribute paths) in eval mode; loads ``weights``
    strictly when given, else keeps torch's own initialization."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    window = [cfg["window"], cfg["window"]]

    class ShiftedWindowAttention(nn.Module):
        """Multi-head self-attention inside (shifted) windows, with a relative position bias."""

        def __init__(self, dim: int, heads: int, shift: int):
            super().__init__()
            self.heads = heads
            self.shift = shift
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.relative_position_bias_table = nn.Parameter(
                torch.zeros((2 * window[0] - 1) * (2 * window[1] - 1), heads))
            self.register_buffer("relative_position_index", _relative_position_index(window))

        def relative_position_bias(self):
            tokens = window[0] * window[1]
            bias = self.relative_position_bias_table[self.relative_position_index]
            return bias.view(tokens, tokens, -1).permute(2, 0, 1).contiguous().unsqueeze(0)

        def forward(self, x):
            batch, height, width, channels = x.shape
            pad_right = (window[1] - width % window[1]) % window[1]
            pad_bottom = (window[0] - height % window[0]) % window[0]
            x = F.pad(x, (0, 0, 0, pad_right, 0, pad_bottom))
            _, padded_h, padded_w, _ = x.shape
            # a window as large as the map has nothing to shift across (torchvision's rule)
            shift = [0 if window[0] >= padded_h else self.shift, 0 if window[1] >= padded_w else self.shift]
            if sum(shift) > 0:
                x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))

            rows, cols = padded_h // window[0], padded_w // window[1]
            windows = rows * cols
            tokens = window[0] * window[1]
            x = x.view(batch, rows, window[0], cols, window[1], channels)
            x = x.permute(0, 1, 3, 2, 4, 5).reshape(batch * windows, tokens, channels)

            qkv = self.qkv(x).reshape(x.size(0), tokens, 3, self.heads, channels // self.heads).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            q = q * (channels // self.heads) ** -0.5
            attn = q.matmul(k.transpose(-2, -1)) + self.relative_position_bias()
            if sum(shift) > 0:
                mask = _shift_mask(padded_h, padded_w, shift, x.dtype, x.device)
                attn = attn.view(batch, windows, self.heads, tokens, tokens) + mask.unsqueeze(1).unsqueeze(0)
                attn = attn.view(-1, self.heads, tokens, tokens)
            attn = F.softmax(attn, dim=-1)

            x = attn.matmul(v).transpose(1, 2).reshape(x.size(0), tokens, channels)
            x = self.proj(x)
            x = x.view(batch, rows, cols, window[0], window[1], channels)
            x = x.permute(0, 1, 3, 2, 4, 5).reshape(batch, padded_h, padded_w, channels)
            if sum(shift) > 0:
                x = torch.roll(x, shifts=(shift[0], shift[1]), dims=(1, 2))
            return x[:, :height, :width, :].contiguous()

    def _shift_mask(padded_h: int, padded_w: int, shift: list[int], dtype, device):
        """-100 where two tokens of a shifted window came from different regions of the map
        (torchvision's mask): built from constants only, so the importer folds it; on the
        activations' device, so the module runs on a GPU too."""
        regions = torch.zeros((padded_h, padded_w), dtype=dtype, device=device)
        h_bands = ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None))
        w_bands = ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None))
        label = 0
        for h0, h1 in h_bands:
            for w0, w1 in w_bands:
                regions[h0:h1, w0:w1] = label
                label += 1
        rows, cols = padded_h // window[0], padded_w // window[1]
        regions = regions.view(rows, window[0], cols, window[1]).permute(0, 2, 1, 3)
        regions = regions.reshape(rows * cols, window[0] * window[1])
        differ = regions.unsqueeze(1) - regions.unsqueeze(2)
        return differ.masked_fill(differ != 0, -100.0).masked_fill(differ == 0, 0.0)

    class SwinTransformerBlock(nn.Module):
        def __init__(self, dim: int, heads: int, shift: int):
            super().__init__()
            hidden = int(dim * cfg["mlp_ratio"])
            self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
            self.attn = ShiftedWindowAttention(dim, heads, shift)
            self.norm2 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
            # torchvision's MLP: Linear, GELU, Dropout, Linear, Dropout (keys mlp.0 and mlp.3)
            self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(0.0), nn.Linear(hidden, dim),
                                     nn.Dropout(0.0))

        def forward(self, x):
            # stochastic depth is the identity in eval mode
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class PatchMerging(nn.Module):
        """2x2 neighbouring tokens concatenated (4C), normalized, projected to 2C."""

        def __init__(self, dim: int):
            super().__init__()
            self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
            self.norm = nn.LayerNorm(4 * dim, eps=LAYER_NORM_EPS)

        def forward(self, x):
            height, width = x.shape[-3:-1]
            x = F.pad(x, (0, 0, 0, width % 2, 0, height % 2))
            x = torch.cat([x[..., 0::2, 0::2, :], x[..., 1::2, 0::2, :], x[..., 0::2, 1::2, :],
                           x[..., 1::2, 1::2, :]], -1)
            return self.reduction(self.norm(x))

    class Permute(nn.Module):
        def __init__(self, dims):
            super().__init__()
            self.dims = dims

        def forward(self, x):
            return x.permute(*self.dims)

    class SwinTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            patch, embed = cfg["patch"], cfg["embed"]
            layers = [nn.Sequential(nn.Conv2d(3, embed, kernel_size=patch, stride=patch), Permute([0, 2, 3, 1]),
                                    nn.LayerNorm(embed, eps=LAYER_NORM_EPS))]
            for stage, (depth, heads) in enumerate(zip(cfg["depths"], cfg["heads"])):
                dim = embed * 2 ** stage
                layers.append(nn.Sequential(*(
                    SwinTransformerBlock(dim, heads, 0 if i % 2 == 0 else cfg["window"] // 2) for i in range(depth))))
                if stage < len(cfg["depths"]) - 1:
                    layers.append(PatchMerging(dim))
            self.features = nn.Sequential(*layers)
            features = embed * 2 ** (len(cfg["depths"]) - 1)
            self.norm = nn.LayerNorm(features, eps=LAYER_NORM_EPS)
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.head = nn.Linear(features, cfg["classes"])

        def forward(self, x):
            x = self.norm(self.features(x)).permute(0, 3, 1, 2)
            return self.head(torch.flatten(self.avgpool(x), 1))

    model = SwinTransformer().eval()
    return model if weights is None else load_weights(model, weights, IGNORED_SUFFIXES)


def _relative_position_index(window):
    """For each pair of tokens of a window, the row of the bias table that holds their relative
    offset (dy, dx), as torchvision computes it (int64, Wh*Ww*Wh*Ww entries)."""
    import torch

    coords = torch.stack(torch.meshgrid(torch.arange(window[0]), torch.arange(window[1]), indexing="ij")).flatten(1)
    relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    relative[:, :, 0] += window[0] - 1
    relative[:, :, 1] += window[1] - 1
    relative[:, :, 0] *= 2 * window[1] - 1
    return relative.sum(-1).flatten()


def _param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every state_dict entry's shape, in the module's order."""
    return _state_shapes(_config_key(cfg))


@functools.lru_cache(maxsize=2)
def _state_shapes(key: tuple) -> dict[str, tuple[int, ...]]:
    return {name: tuple(value.shape) for name, value in torch_module(_config(key)).state_dict().items()}


def init_weights(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic weights keyed by state_dict name: fan-in-scaled projections with non-zero
    biases, layer norms near identity, a bias table large enough that a wrong gather shows,
    and each attention's ``relative_position_index`` buffer as torchvision computes it."""
    rng = np.random.default_rng(seed)
    index = _relative_position_index([cfg["window"]] * 2).numpy()
    weights = {}
    for name, shape in _param_shapes(cfg).items():
        if name.endswith("relative_position_index"):
            weights[name] = index.copy()
            continue
        if name.endswith("relative_position_bias_table"):
            value = 0.5 * rng.standard_normal(shape)
        elif len(shape) == 1 and name.endswith("weight"):  # layer norm scales
            value = rng.uniform(0.8, 1.2, shape)
        elif len(shape) == 1:
            value = 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        weights[name] = value.astype(np.float32)
    return weights


def make_inputs(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, 3, cfg["image"], cfg["image"])).astype(np.float32)}


def build_graph(cfg, weights) -> Graph:
    """x (1, 3, H, W) float32 -> logits (1, classes): the torch module imported by from_torch.

    Besides the state_dict's weights the graph has the constants the import folded (the
    shifted windows' masks, named after the node that made them); they come with the import,
    so ``weights`` needs only the state_dict's entries (the constants may be given too). Without
    weights it is the structure alone, as ``souffle.models.structure`` promises."""
    structure, constants = _imported(_config_key(cfg))
    return structure if weights is None else structure.with_weights({**constants, **weights})


def _config_key(cfg) -> tuple:
    """A configuration as a hashable key (its lists as tuples), to cache what it builds."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in cfg.items()))


def _config(key: tuple) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in key}


@functools.lru_cache(maxsize=2)
def _imported(key: tuple) -> tuple[Graph, dict[str, np.ndarray]]:
    """The module of one configuration imported once (``--check`` builds the graph twice, and
    swin_b's import takes half a minute): the graph without weights, and the folded constants.
    The importer needs TVM, so it is imported here: a GPU machine rebuilds the weights without it."""
    import torch

    from souffle.importers.torch_export import from_torch

    cfg = _config(key)
    module = torch_module(cfg, init_weights(cfg, seed=0))
    example = torch.from_numpy(make_inputs(cfg, seed=0)["x"])
    graph = from_torch(module, (example,))
    state = _param_shapes(cfg)
    constants = {name: value for name, value in graph.weights.items() if name not in state}
    return Graph("swin", graph.inputs, graph.params.values(), graph.ops, graph.outputs), constants


def torch_reference(cfg, weights):
    """inputs -> [logits] computed by the torch module (the graph's folded constants left out)."""
    import torch

    shapes = _param_shapes(cfg)
    model = torch_module(cfg, {name: value for name, value in weights.items() if name in shapes})

    def run(inputs):
        with torch.no_grad():
            return [model(torch.from_numpy(inputs["x"])).float().numpy()]

    return run
