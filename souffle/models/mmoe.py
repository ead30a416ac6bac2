"""Multi-gate Mixture-of-Experts (Ma et al., KDD'18), the paper's MMoE: 8 experts, 2 tasks.

Each expert is its own dense op, as a model written op by op has it: merging the experts
into one wider op is the horizontal-fusion pass's job, not the model's.
"""

from __future__ import annotations

import numpy as np

from souffle.graph import Graph, GraphBuilder
from souffle.models.torch_interop import load_weights

CONFIGS = {
    "tiny": {"input_size": 10, "expert_units": 4, "experts": 3, "tasks": 2, "tower_units": 8, "batch": 1},
    "paper": {"input_size": 100, "expert_units": 16, "experts": 8, "tasks": 2, "tower_units": 8, "batch": 1},
}

IGNORED_SUFFIXES = ()

TOLERANCE = {"tiny": (1e-5, 1e-6), "paper": (1e-5, 1e-6)}


def _linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every nn.Linear, keyed by its state_dict prefix."""
    units, tower = cfg["expert_units"], cfg["tower_units"]
    shapes = {f"experts.{e}": (units, cfg["input_size"]) for e in range(cfg["experts"])}
    shapes.update({f"gates.{t}": (cfg["experts"], cfg["input_size"]) for t in range(cfg["tasks"])})
    for t in range(cfg["tasks"]):
        shapes[f"towers.{t}.0"] = (tower, units)
        shapes[f"towers.{t}.2"] = (1, tower)
    return shapes


def init_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Uniform(-1/sqrt(in), 1/sqrt(in)) like torch.nn.Linear, so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for prefix, (out_features, in_features) in _linear_shapes(cfg).items():
        bound = 1.0 / np.sqrt(in_features)
        weights[f"{prefix}.weight"] = rng.uniform(-bound, bound, (out_features, in_features)).astype(np.float32)
        weights[f"{prefix}.bias"] = rng.uniform(-bound, bound, (out_features,)).astype(np.float32)
    return weights


def make_inputs(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((cfg["batch"], cfg["input_size"])).astype(np.float32)}


def build_graph(cfg: dict, weights: dict[str, np.ndarray]) -> Graph:
    """One (batch, 1) sigmoid output per task, from input ``x`` (batch, input_size)."""
    b = GraphBuilder("mmoe")
    x = b.input("x", (cfg["batch"], cfg["input_size"]))
    for prefix, (out_features, in_features) in _linear_shapes(cfg).items():
        b.param(f"{prefix}.weight", (out_features, in_features))
        b.param(f"{prefix}.bias", (out_features,))

    def linear(prefix: str, value: str) -> str:
        return b.op("dense", value, f"{prefix}.weight", f"{prefix}.bias", name=prefix)

    experts = [b.op("relu", linear(f"experts.{e}", x), name=f"expert_{e}") for e in range(cfg["experts"])]
    outputs = []
    for t in range(cfg["tasks"]):
        gate = b.op("softmax", linear(f"gates.{t}", x), axis=1, name=f"gate_{t}")
        mixture = None
        for e, expert in enumerate(experts):
            weight = b.op("slice", gate, begin=e, end=e + 1, axis=1, name=f"gate_{t}.{e}")
            term = b.op("mul", weight, expert, name=f"task_{t}.expert_{e}")
            mixture = term if mixture is None else b.op("add", mixture, term, name=f"task_{t}.mix_{e}")
        hidden = b.op("relu", linear(f"towers.{t}.0", mixture), name=f"tower_{t}.hidden")
        outputs.append(b.op("sigmoid", linear(f"towers.{t}.2", hidden), name=f"task_{t}"))
    return b.build(*outputs).with_weights(weights)


def torch_module(cfg: dict, weights: dict[str, np.ndarray]):
    """The same model as a torch.nn.Module whose state_dict names match: x -> task outputs."""
    import torch
    from torch import nn

    class MMoE(nn.Module):
        def __init__(self):
            super().__init__()
            units, tower = cfg["expert_units"], cfg["tower_units"]
            self.experts = nn.ModuleList(nn.Linear(cfg["input_size"], units) for _ in range(cfg["experts"]))
            self.gates = nn.ModuleList(nn.Linear(cfg["input_size"], cfg["experts"]) for _ in range(cfg["tasks"]))
            self.towers = nn.ModuleList(
                nn.Sequential(nn.Linear(units, tower), nn.ReLU(), nn.Linear(tower, 1), nn.Sigmoid())
                for _ in range(cfg["tasks"])
            )

        def forward(self, x):
            experts = torch.stack([torch.relu(expert(x)) for expert in self.experts], dim=1)
            outputs = []
            for gate, tower in zip(self.gates, self.towers):
                weights = torch.softmax(gate(x), dim=1)
                outputs.append(tower((weights.unsqueeze(2) * experts).sum(dim=1)))
            return outputs

    return load_weights(MMoE(), weights)


def torch_reference(cfg: dict, weights: dict[str, np.ndarray]):
    """inputs -> task outputs, computed by ``torch_module``."""
    import torch

    model = torch_module(cfg, weights)

    def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            return [y.float().numpy() for y in model(torch.from_numpy(np.asarray(inputs["x"], dtype=np.float32)))]

    return run
