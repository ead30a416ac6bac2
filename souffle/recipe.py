"""Weight recipes: how a compiled kernel's weight is made from the model's own weights.

The compiler derives weights at compile time (a scan's per-layer weights stacked, GEMM
weights concatenated by the horizontal transformation, the LSTM wavefront's padded and
permuted stacks). A recipe says how, in JSON-able lists, so a kernel artifact can carry
recipes instead of arrays and a machine with numpy but no TVM rebuilds the weights from the
model's seeded initialisation:

    ["model", name]                   the model weight ``name``
    ["stack", [r, ...]]               np.stack along a new axis 0
    ["concat", axis, [r, ...]]        np.concatenate
    ["pad", [[lo, hi], ...], r]       zero padding
    ["take", axis, [i, ...], r]       np.take (a permutation or a selection)
    ["add", [r, ...]]                 element-wise sum
    ["const", dtype, shape, [v, ...]] a constant (small: masks)
    ["cast", dtype, r]                converted to dtype (float16 and bfloat16 weights, rounded to
                                      nearest even; bfloat16 as its bits where ml_dtypes is missing)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from souffle.errors import SouffleError
from souffle.tensor import converted


def model(name: str) -> list:
    return ["model", name]


def stack(parts: list) -> list:
    return ["stack", list(parts)]


def concat(parts: list, axis: int = 0) -> list:
    return ["concat", int(axis), list(parts)]


def pad(part: list, widths) -> list:
    return ["pad", [[int(lo), int(hi)] for lo, hi in widths], part]


def take(part: list, indices, axis: int = 0) -> list:
    return ["take", int(axis), [int(i) for i in indices], part]


def add(parts: list) -> list:
    return ["add", list(parts)]


def const(value: np.ndarray) -> list:
    value = np.asarray(value)
    return ["const", str(value.dtype), list(value.shape), value.reshape(-1).tolist()]


def cast(part: list, dtype: str) -> list:
    return ["cast", str(dtype), part]


def evaluate(recipe: list, weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """The array ``recipe`` describes, from the model's ``weights``."""
    kind = recipe[0]
    if kind == "model":
        if recipe[1] not in weights:
            raise SouffleError(f"weight recipe needs model weight {recipe[1]!r}, which is not given")
        return np.asarray(weights[recipe[1]])
    if kind == "stack":
        return np.stack([evaluate(r, weights) for r in recipe[1]])
    if kind == "concat":
        return np.concatenate([evaluate(r, weights) for r in recipe[2]], axis=recipe[1])
    if kind == "pad":
        return np.pad(evaluate(recipe[2], weights), recipe[1])
    if kind == "take":
        return np.take(evaluate(recipe[3], weights), recipe[2], axis=recipe[1])
    if kind == "add":
        parts = [evaluate(r, weights) for r in recipe[1]]
        return sum(parts[1:], parts[0])
    if kind == "const":
        return np.asarray(recipe[3], dtype=recipe[1]).reshape(recipe[2])
    if kind == "cast":
        return converted(evaluate(recipe[2], weights), recipe[1])
    raise SouffleError(f"unknown weight recipe {kind!r}")


def with_constants(recipe: list, constants: Mapping[str, np.ndarray]) -> list:
    """``recipe`` with each model weight named in ``constants`` replaced by its value."""
    kind = recipe[0]
    if kind == "model":
        return const(constants[recipe[1]]) if recipe[1] in constants else recipe
    if kind == "const":
        return recipe
    if kind in ("stack", "add"):
        return [kind, [with_constants(r, constants) for r in recipe[1]]]
    if kind == "concat":
        return [kind, recipe[1], [with_constants(r, constants) for r in recipe[2]]]
    return [*recipe[:-1], with_constants(recipe[-1], constants)]  # pad, take, cast: the part is last


def sources(recipe: list) -> set[str]:
    """The model weights a recipe reads."""
    if recipe[0] == "model":
        return {recipe[1]}
    if recipe[0] == "const":
        return set()
    parts = recipe[-1] if recipe[0] in ("stack", "concat", "add") else [recipe[-1]]
    return set().union(*(sources(r) for r in parts))
