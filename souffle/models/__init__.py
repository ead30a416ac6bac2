"""The model zoo: each paper model as a Graph with PyTorch-named weights and a PyTorch reference.

Every model module (``souffle.models.<name>``) offers the same interface:

- ``CONFIGS``: ``{"tiny": {...}, "paper": {...}}``, the tiny one fast enough for the default tests;
- ``IGNORED_SUFFIXES``: state_dict keys that are buffers, not parameters (e.g. BatchNorm's
  ``num_batches_tracked``), dropped from given weights so a real state_dict loads as it is;
- ``init_weights(cfg, seed)``: deterministic float32 weights keyed by state_dict name;
- ``build_graph(cfg, weights)``: the Graph; parameters are declared by shape and ``weights``
  attached with ``Graph.with_weights``, so missing, extra or mis-shaped weights raise WeightError;
- ``make_inputs(cfg, seed)``: inputs keyed by the graph's input names;
- ``torch_reference(cfg, weights)``: ``inputs -> outputs`` in graph output order, by PyTorch;
- ``TOLERANCE``: ``{config: (rtol, atol)}`` for comparing the two.

Modules are imported lazily, so building one model never imports another's dependencies.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import ModuleType

import numpy as np

from souffle.errors import InputError, SouffleError, UnknownModelError, WeightError
from souffle.graph import Graph

MODELS = ("lstm", "bert", "resnext", "mmoe", "swin")

__all__ = ["MODELS", "build", "config", "get", "make_inputs", "reference", "structure", "tolerance"]


def get(name: str) -> ModuleType:
    """The module that defines model ``name``."""
    if name not in MODELS:
        raise UnknownModelError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    return importlib.import_module(f"souffle.models.{name}")


def config(name: str, config: str = "tiny") -> dict:
    """The configuration dict of model ``name`` (a copy: editing it changes nothing here)."""
    return _config(name, config)


def build(name: str, config: str = "tiny", seed: int = 0, weights: Mapping[str, object] | None = None) -> Graph:
    """Model ``name`` as a Graph with random weights from ``seed``, or with ``weights``.

    ``weights`` maps names to numpy arrays or torch tensors, e.g. a PyTorch ``state_dict``; keys
    ending in the model's ``IGNORED_SUFFIXES`` are dropped, everything else must match exactly
    (``Graph.with_weights`` says how the arrays may convert to the parameters' dtypes).
    """
    module = get(name)
    cfg = _config(name, config)
    if weights is None:
        weights = module.init_weights(cfg, _checked_seed(seed))
    else:
        weights = _parameters(module, weights)
    return module.build_graph(cfg, weights)


def structure(name: str, config: str = "tiny") -> Graph:
    """Model ``name``'s graph with parameter shapes but no weight arrays: all the analysis needs."""
    return get(name).build_graph(_config(name, config), None)


def make_inputs(name: str, config: str = "tiny", seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for model ``name``, keyed by the graph's input names."""
    return get(name).make_inputs(_config(name, config), _checked_seed(seed))


def reference(name: str, config: str, weights: Mapping[str, object]) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
    """A function computing model ``name``'s outputs with PyTorch, in graph output order."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SouffleError(
            "the PyTorch reference needs torch; install it with `pip install torch==2.13.0`"
        ) from None
    module = get(name)
    cfg = _config(name, config)
    # the weights the compiled model would get: checked and converted as the graph converts them
    checked = module.build_graph(cfg, _parameters(module, weights)).weights
    return module.torch_reference(cfg, checked)


def tolerance(name: str, config: str = "tiny") -> tuple[float, float]:
    """(rtol, atol) within which Souffle's outputs must match the PyTorch reference."""
    _config(name, config)
    return tuple(get(name).TOLERANCE[config])


def _config(name: str, config: str) -> dict:
    configs = get(name).CONFIGS
    if config not in configs:
        raise UnknownModelError(
            f"unknown config {config!r} for model {name!r}; available: {', '.join(configs)}"
        )
    return dict(configs[config])


def _checked_seed(seed) -> int:
    """``seed`` if numpy's random generator takes it: a non-negative integer."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"seed must be a non-negative integer (numpy's random generator takes no other), got {seed!r}")
    return int(seed)


def _parameters(module: ModuleType, weights: Mapping[str, object]) -> dict[str, object]:
    """The given weights without the keys the model ignores (buffers)."""
    if not isinstance(weights, Mapping):
        raise WeightError(
            f"weights must be a mapping from parameter name to array (a dict or a PyTorch state_dict), "
            f"not a {type(weights).__name__}"
        )
    ignored = tuple(module.IGNORED_SUFFIXES)
    return {key: value for key, value in weights.items() if not (ignored and key.endswith(ignored))}
