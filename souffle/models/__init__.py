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
- ``TOLERANCE``: ``{config: (rtol, atol)}`` for comparing the two;

and optionally:

- ``NARROW_TOLERANCE``: ``{config: {precision: (rtol, atol)}}`` where a config's float16 or
  bfloat16 noise floor is above ``NARROW_TOLERANCES`` (a deep model whose roundings compound):
  sized from PyTorch's own departure from float32 at that precision, both sides rounding
  independently, and checked to still fail a known defect (see ``tolerance``);
- ``check_config(cfg)``: refuse (``ConfigError``) a configuration the graph cannot build or
  would build as a different model than asked (e.g. BERT's hidden size not divisible by heads);
- ``config_from_object(obj)``: a configuration dict from another library's description of the
  model (Hugging Face ``BertConfig``, a ``torch.nn.LSTM``), refusing settings not implemented;
- ``adapt_weights(weights, cfg)``: ``(weights, config changes, notes)`` for a state_dict named
  as a model that wraps this one (``BertForMaskedLM``'s ``bert.`` keys); the notes reach the
  graph's ``weight_notes`` and so the compile report.

A configuration is given (``build``, ``make_inputs``, ``reference``, ``tolerance``) as a name
(``"tiny"``, ``"paper"``), as a dict of **overrides of "tiny"** (``{"layers": 4}``; start from
the paper's sizes with ``{**config(name, "paper"), "layers": 4}``), or as an object the model's
``config_from_object`` takes. Keys that are not in the model's configs are refused, naming the
allowed ones, and so are values of another type than the default's (a number for a number).

Modules are imported lazily, so building one model never imports another's dependencies.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import ModuleType

import numpy as np

from souffle.errors import ConfigError, InputError, SouffleError, UnknownModelError, WeightError
from souffle.graph import Graph
from souffle.precision import PRECISIONS, check_precision

MODELS = ("lstm", "bert", "resnext", "mmoe", "efficientnet", "swin")

__all__ = ["MODELS", "build", "config", "get", "make_inputs", "reference", "structure", "tolerance"]


def get(name: str) -> ModuleType:
    """The module that defines model ``name``."""
    if name not in MODELS:
        raise UnknownModelError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    return importlib.import_module(f"souffle.models.{name}")


Config = str | Mapping[str, object] | object  # a config name, overrides of "tiny" or a config object


def config(name: str, config: Config = "tiny") -> dict:
    """The configuration dict of model ``name`` (a copy: editing it changes nothing here)."""
    return _config(name, config)


def build(name: str, config: Config = "tiny", seed: int = 0, weights: Mapping[str, object] | None = None) -> Graph:
    """Model ``name`` as a Graph with random weights from ``seed``, or with ``weights``.

    ``config`` is a config name, a dict of overrides of "tiny" or a config object (see the module
    docstring). ``weights`` maps names to numpy arrays or torch tensors, e.g. a PyTorch
    ``state_dict``; keys ending in the model's ``IGNORED_SUFFIXES`` are dropped, everything else
    must match exactly (``Graph.with_weights`` says how the arrays may convert to the
    parameters' dtypes).
    """
    module = get(name)
    cfg = _config(name, config)
    if weights is None:
        return module.build_graph(cfg, module.init_weights(cfg, _checked_seed(seed)))
    weights, cfg, notes = _parameters(module, weights, cfg)
    graph = module.build_graph(cfg, weights)
    graph.weight_notes = (*notes, *graph.weight_notes)
    return graph


def structure(name: str, config: Config = "tiny") -> Graph:
    """Model ``name``'s graph with parameter shapes but no weight arrays: all the analysis needs."""
    return get(name).build_graph(_config(name, config), None)


def make_inputs(name: str, config: Config = "tiny", seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for model ``name``, keyed by the graph's input names."""
    return get(name).make_inputs(_config(name, config), _checked_seed(seed))


def reference(name: str, config: Config, weights: Mapping[str, object],
              precision: str = "fp32") -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
    """A function computing model ``name``'s outputs with PyTorch, in graph output order, as
    float32 arrays. At ``precision="fp16"`` or ``"bf16"`` PyTorch runs under ``torch.autocast``
    in that dtype (narrow GEMMs and convolutions, float32 norms and softmax: the mixed precision
    ``souffle.precision`` compiles), except where autocast has no such CPU kernel
    (``torch.nn.LSTM``: oneDNN has none), which computes in float32 from the weights rounded to it."""
    try:
        import torch
    except ImportError:
        raise SouffleError(
            "the PyTorch reference needs torch; install it with `pip install torch==2.13.0`"
        ) from None
    check_precision(precision)
    module = get(name)
    weights, cfg, _ = _parameters(module, weights, _config(name, config))
    # the weights the compiled model would get: checked and converted as the graph converts them
    checked = module.build_graph(cfg, weights).weights
    if PRECISIONS[precision] == "float32":  # fp32, and tf32: PyTorch has no TF32 on the CPU
        return module.torch_reference(cfg, checked)
    narrow = PRECISIONS[precision]
    if not getattr(module, "AUTOCAST", True):
        rounded = {k: v.astype(narrow).astype(np.float32) if v.dtype == np.float32 else v for k, v in checked.items()}
        return module.torch_reference(cfg, rounded)
    run = module.torch_reference(cfg, checked)

    def autocast(inputs):
        with torch.autocast("cpu", dtype=getattr(torch, narrow)):
            return [np.asarray(output, dtype=np.float32) for output in run(inputs)]

    return autocast


FP16_TOLERANCE = (1e-2, 1e-2)  # float16's 11-bit significand: each of both sides rounds at about 5e-4 of a value
BF16_TOLERANCE = (5e-2, 5e-2)  # bfloat16's 8-bit significand: each rounding at about 4e-3 of a value
# TF32 rounds the GEMMs' operands as float16 does, the rest float32; the CPU reference is float32
TF32_TOLERANCE = FP16_TOLERANCE
NARROW_TOLERANCES = {"tf32": TF32_TOLERANCE, "fp16": FP16_TOLERANCE, "bf16": BF16_TOLERANCE}


def tolerance(name: str, config: Config = "tiny", precision: str = "fp32") -> tuple[float, float]:
    """(rtol, atol) within which Souffle's outputs must match the PyTorch reference; a config
    given as a dict or an object gets the loosest of the named configs' (it may be as large as
    the largest of them). At fp16 and bf16 both sides round differently: ``NARROW_TOLERANCES``,
    or the model's ``NARROW_TOLERANCE`` for a config whose own rounding noise is larger.

    The rule for a model's narrow tolerance: PyTorch's autocast and Souffle each depart from the
    float32 answer by about PyTorch's own measured departure, independently, so they may differ
    by up to twice it; the figure must still fail a known precision defect on the same inputs."""
    _config(name, config)
    module = get(name)
    if check_precision(precision) in NARROW_TOLERANCES:
        own = getattr(module, "NARROW_TOLERANCE", {})
        tolerances = {c: own.get(c, {}).get(precision, NARROW_TOLERANCES[precision]) for c in module.CONFIGS}
    else:
        tolerances = module.TOLERANCE
    if isinstance(config, str):
        return tuple(tolerances[config])
    return tuple(max(t[k] for t in tolerances.values()) for k in range(2))


def _config(name: str, config) -> dict:
    """The full configuration dict for ``config`` (a name, overrides of "tiny", or an object)."""
    module = get(name)
    configs = module.CONFIGS
    if isinstance(config, str):
        if config not in configs:
            raise UnknownModelError(
                f"unknown config {config!r} for model {name!r}; available: {', '.join(configs)}"
            )
        return dict(configs[config])
    if not isinstance(config, Mapping):
        from_object = getattr(module, "config_from_object", None)
        converted = None if from_object is None else from_object(config)
        if converted is None:
            raise ConfigError(
                f"config for model {name!r} must be a name ({', '.join(configs)}), a dict of overrides "
                f"of 'tiny' or a config object the model takes, not a {type(config).__name__}"
            )
        config = converted
    cfg = dict(configs["tiny"])
    for key, value in config.items():
        if key not in cfg:
            raise ConfigError(
                f"unknown config key {key!r} for model {name!r}; allowed keys: {', '.join(sorted(cfg))}"
            )
        _check_value(name, key, value, cfg[key])
        cfg[key] = value
    check = getattr(module, "check_config", None)
    if check is not None:
        check(cfg)
    return cfg


def _check_value(name: str, key: str, value, default):
    """A value of the default's kind (``_fits``); anything finer is the model's ``check_config``."""
    if not _fits(value, default):
        wanted = ("True or False" if isinstance(default, bool) else "a positive integer" if isinstance(default, int)
                  else f"a list like {list(default)!r}")
        raise ConfigError(f"config key {key!r} of model {name!r} must be {wanted}, got {value!r}")


def _fits(value, default) -> bool:
    """True or False for a bool, a positive int for an int, a list of such for a list (its items
    like the default's first); a value of any other default (a float, a name, None) passes."""
    if isinstance(default, bool):
        return isinstance(value, (bool, np.bool_))
    if isinstance(default, int):
        return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value > 0
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple)) and (not default or all(_fits(v, default[0]) for v in value))
    return True


def _checked_seed(seed) -> int:
    """``seed`` if numpy's random generator takes it: a non-negative integer."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"seed must be a non-negative integer (numpy's random generator takes no other), got {seed!r}")
    return int(seed)


def _parameters(module: ModuleType, weights: Mapping[str, object], cfg: dict) -> tuple[dict, dict, list[str]]:
    """The given weights without the keys the model ignores (buffers), renamed by the model's
    ``adapt_weights`` where it has one; the config it implies and notes on what was done."""
    if not isinstance(weights, Mapping):
        raise WeightError(
            f"weights must be a mapping from parameter name to array (a dict or a PyTorch state_dict), "
            f"not a {type(weights).__name__}"
        )
    ignored = tuple(module.IGNORED_SUFFIXES)
    kept = {key: value for key, value in weights.items() if not (ignored and key.endswith(ignored))}
    adapt = getattr(module, "adapt_weights", None)
    if adapt is None:
        return kept, cfg, []
    kept, changes, notes = adapt(kept, cfg)
    return kept, {**cfg, **changes}, notes
