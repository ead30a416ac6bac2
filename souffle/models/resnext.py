"""ResNeXt with torchvision ``resnext101_64x4d`` semantics and state_dict names.

Each stage's first Bottleneck changes the shape (stride, downsample); the blocks
after it are identical in shape, so they are ONE scan per stage: layer3's 22
repeated blocks of the paper config are lowered and compiled once.
"""

from __future__ import annotations

import math

import numpy as np

from souffle.graph import Graph, GraphBuilder
from souffle.models.torch_interop import load_weights

CONFIGS = {
    "tiny": {"blocks": [1, 2, 3, 1], "planes": [8, 16, 32, 64], "stem": 8, "groups": 4,
             "width_per_group": 16, "image": 32, "classes": 10},
    "paper": {"blocks": [3, 4, 23, 3], "planes": [64, 128, 256, 512], "stem": 64, "groups": 64,
              "width_per_group": 4, "image": 224, "classes": 1000},
}

IGNORED_SUFFIXES = ("num_batches_tracked",)

TOLERANCE = {"tiny": (1e-4, 1e-4), "paper": (1e-3, 1e-3)}

EXPANSION = 4
BN_EPS = 1e-5
BN_SUFFIXES = ("weight", "bias", "running_mean", "running_var")


def _width(cfg, planes: int) -> int:
    """Channels of a Bottleneck's grouped 3x3 conv, as torchvision computes them."""
    return int(planes * (cfg["width_per_group"] / 64.0)) * cfg["groups"]


def _stage_stride(stage: int) -> int:
    return 1 if stage == 0 else 2


def _block_param_shapes(cfg, in_channels: int, planes: int, downsample: bool) -> dict[str, tuple[int, ...]]:
    """One Bottleneck's parameters, named as under ``layer{k}.{j}.``."""
    width, out = _width(cfg, planes), planes * EXPANSION
    convs = {
        "conv1": (width, in_channels, 1, 1),
        "conv2": (width, width // cfg["groups"], 3, 3),
        "conv3": (out, width, 1, 1),
    }
    shapes = {}
    for i, (conv, shape) in enumerate(convs.items(), start=1):
        shapes[f"{conv}.weight"] = shape
        for suffix in BN_SUFFIXES:
            shapes[f"bn{i}.{suffix}"] = (shape[0],)
    if downsample:
        shapes["downsample.0.weight"] = (out, in_channels, 1, 1)
        for suffix in BN_SUFFIXES:
            shapes[f"downsample.1.{suffix}"] = (out,)
    return shapes


def _stage_in_channels(cfg, stage: int) -> int:
    return cfg["stem"] if stage == 0 else cfg["planes"][stage - 1] * EXPANSION


def _param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    shapes = {"conv1.weight": (cfg["stem"], 3, 7, 7)}
    shapes.update({f"bn1.{suffix}": (cfg["stem"],) for suffix in BN_SUFFIXES})
    for stage, (blocks, planes) in enumerate(zip(cfg["blocks"], cfg["planes"])):
        out = planes * EXPANSION
        for j in range(blocks):
            in_channels = _stage_in_channels(cfg, stage) if j == 0 else out
            for name, shape in _block_param_shapes(cfg, in_channels, planes, downsample=j == 0).items():
                shapes[f"layer{stage + 1}.{j}.{name}"] = shape
    final = cfg["planes"][-1] * EXPANSION
    shapes["fc.weight"] = (cfg["classes"], final)
    shapes["fc.bias"] = (cfg["classes"],)
    return shapes


def init_weights(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights that keep activations O(1) through 33 residual blocks: He-scaled
    convs, positive BN running variances, and small last-BN scales on each residual
    branch (so the residual sum grows slowly, as with torchvision's zero_init_residual)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in _param_shapes(cfg).items():
        if name.endswith("running_var"):
            value = rng.uniform(0.5, 1.5, shape)
        elif name.endswith(("running_mean", "bias")):
            value = 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1 and name.endswith("weight"):
            residual_end = name.endswith("bn3.weight") or name.endswith("downsample.1.weight")
            value = rng.uniform(0.1, 0.3, shape) if residual_end else rng.uniform(0.8, 1.2, shape)
        elif name.startswith("fc."):
            value = rng.standard_normal(shape) / math.sqrt(shape[-1])
        else:
            fan_in = int(np.prod(shape[1:]))
            value = rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)
        weights[name] = value.astype(np.float32)
    return weights


def _conv_bn(b: GraphBuilder, x: str, p: dict[str, str], conv: str, bn: str, *, stride=1, padding=0, groups=1,
             relu=True) -> str:
    y = b.op("conv2d", x, p[f"{conv}.weight"], stride=stride, padding=padding, groups=groups)
    y = b.op("batch_norm", y, *(p[f"{bn}.{suffix}"] for suffix in BN_SUFFIXES), eps=BN_EPS)
    return b.op("relu", y) if relu else y


def _bottleneck(b: GraphBuilder, x: str, p: dict[str, str], cfg, stride: int, downsample: bool) -> str:
    """conv1x1-bn-relu, grouped conv3x3(stride)-bn-relu, conv1x1-bn, + shortcut, relu."""
    y = _conv_bn(b, x, p, "conv1", "bn1")
    y = _conv_bn(b, y, p, "conv2", "bn2", stride=stride, padding=1, groups=cfg["groups"])
    y = _conv_bn(b, y, p, "conv3", "bn3", relu=False)
    shortcut = _conv_bn(b, x, p, "downsample.0", "downsample.1", stride=stride, relu=False) if downsample else x
    return b.op("relu", b.op("add", y, shortcut))


def _repeated_block(cfg, planes: int, channels: int, size: int) -> Graph:
    """The body of a stage's scan: a Bottleneck without downsample on (1, C, size, size)."""
    b = GraphBuilder(f"bottleneck_{planes}")
    p = {name: b.param(name, shape) for name, shape in _block_param_shapes(cfg, channels, planes, False).items()}
    x = b.input("x", (1, channels, size, size))
    return b.build(_bottleneck(b, x, p, cfg, 1, False))


def build_graph(cfg, weights) -> Graph:
    """x (1, 3, H, W) float32 -> logits (1, classes)."""
    b = GraphBuilder("resnext")
    p = {name: b.param(name, shape) for name, shape in _param_shapes(cfg).items()}
    x = b.input("x", (1, 3, cfg["image"], cfg["image"]))

    x = _conv_bn(b, x, p, "conv1", "bn1", stride=2, padding=3)
    x = b.op("max_pool2d", x, kernel=3, stride=2, padding=1)
    for stage, (blocks, planes) in enumerate(zip(cfg["blocks"], cfg["planes"])):
        prefix = f"layer{stage + 1}"
        first = {name: p[f"{prefix}.0.{name}"] for name in
                 _block_param_shapes(cfg, _stage_in_channels(cfg, stage), planes, True)}
        x = _bottleneck(b, x, first, cfg, _stage_stride(stage), downsample=True)
        if blocks > 1:
            _, channels, size, _ = b.spec(x).shape
            body = _repeated_block(cfg, planes, channels, size)
            (x,), _ = b.scan(
                body, blocks - 1, name=prefix,
                carry=[("x", body.outputs[0], x)],
                params={name: [f"{prefix}.{j}.{name}" for j in range(1, blocks)] for name in body.params},
            )
    pooled = b.op("flatten", b.op("global_avg_pool2d", x), start_dim=1)
    logits = b.op("dense", pooled, p["fc.weight"], p["fc.bias"], name="logits")
    return b.build(logits).with_weights(weights)


def make_inputs(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, 3, cfg["image"], cfg["image"])).astype(np.float32)}


def torch_module(cfg, weights=None):
    """A torchvision-style ResNeXt (same attribute paths) in eval mode; loads ``weights``
    strictly when given, else keeps torch's own initialization."""
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, in_channels, planes, stride, downsample):
            super().__init__()
            width, out = _width(cfg, planes), planes * EXPANSION
            self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=cfg["groups"], bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, out, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(out)
            self.relu = nn.ReLU()
            self.downsample = (
                nn.Sequential(nn.Conv2d(in_channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
                if downsample else None
            )

        def forward(self, x):
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return self.relu(y + (self.downsample(x) if self.downsample is not None else x))

    class ResNeXt(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, cfg["stem"], 7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(cfg["stem"])
            self.relu = nn.ReLU()
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
            for stage, (blocks, planes) in enumerate(zip(cfg["blocks"], cfg["planes"])):
                in_channels = _stage_in_channels(cfg, stage)
                layer = [Bottleneck(in_channels, planes, _stage_stride(stage), True)]
                layer += [Bottleneck(planes * EXPANSION, planes, 1, False) for _ in range(1, blocks)]
                setattr(self, f"layer{stage + 1}", nn.Sequential(*layer))
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(cfg["planes"][-1] * EXPANSION, cfg["classes"])

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    model = ResNeXt().eval()
    return model if weights is None else load_weights(model, weights, IGNORED_SUFFIXES)


def torch_reference(cfg, weights):
    """inputs -> [logits] computed by the torch module."""
    import torch

    model = torch_module(cfg, weights)

    def run(inputs):
        with torch.no_grad():
            return [model(torch.from_numpy(inputs["x"])).float().numpy()]

    return run
