"""A differential fuzzer for ``souffle.compile``.

From a seed, ``generate`` makes a random valid graph (a ``Case``: its ops, shapes and attributes,
and how its weights and inputs are drawn); ``check_config`` compiles it for one target and opt
level, runs it with NaN in every buffer it should write, and compares every output with a float64
PyTorch reference written op by op from the TE lowerings (``REFERENCE``). Compiling and running
happen in worker processes (``WorkerPool``), so a crash (a heap corruption aborts the process) is
one more failure. ``minimize`` shrinks a failing case to a small one that fails the same way, and
``repro`` prints it as runnable GraphBuilder code.

    with WorkerPool(check_config) as pool:
        result = fuzz(range(100), configs(), pool)
        for finding in minimize_failures(result, pool):
            print(finding.describe())

``tests/test_fuzz.py`` runs a fixed range of seeds; ``scripts/fuzz.py`` runs fresh ones for a while.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

import souffle
from souffle.errors import GraphError
from souffle.graph import Graph, GraphBuilder, Op
from souffle.ops import REGISTRY

# -- values ------------------------------------------------------------------------------------
# Inputs ~ N(0, 0.5^2) and weights scaled by 1/sqrt(fan-in) keep every tensor of a graph of order
# one, where float32 rounding stays far below the tolerance (see RTOL).
INPUT_SCALE = 0.5
SPECIAL_VALUES = (math.nan, math.inf, -math.inf)


@dataclass(frozen=True)
class Source:
    """A graph input or parameter and how its values are drawn: from its shape, so a shrunk
    graph draws new values of the new shape.

    draw: "normal" (N(0, scale^2)), "positive" (uniform in [0.5, 2), for a divisor or a
    variance) or "ids" (ints in [-2, high + 2): the embedding's out-of-range ids included).
    specials: (flat index, NaN or an infinity) written over the drawn values of an input.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    draw: str = "normal"
    scale: float = INPUT_SCALE
    high: int = 0
    specials: tuple[tuple[int, float], ...] = ()


def draw(source: Source, rng: np.random.Generator) -> np.ndarray:
    """The source's values; ``draw_code`` is the same draw as Python source, for repros."""
    if source.draw == "normal":
        values = np.asarray(rng.standard_normal(source.shape) * source.scale, source.dtype)
    elif source.draw == "positive":
        values = np.asarray(rng.uniform(0.5, 2.0, source.shape), source.dtype)
    else:
        values = np.asarray(rng.integers(-2, source.high + 2, source.shape), source.dtype)
    for index, value in source.specials:
        values.flat[index] = value
    return values


def draw_code(source: Source) -> str:
    """``draw(source, rng)`` as an expression (specials excepted: ``repro`` writes them)."""
    shape, dtype = repr(source.shape), repr(source.dtype)
    if source.draw == "normal":
        return f"np.asarray(rng.standard_normal({shape}) * {source.scale!r}, {dtype})"
    if source.draw == "positive":
        return f"np.asarray(rng.uniform(0.5, 2.0, {shape}), {dtype})"
    return f"np.asarray(rng.integers(-2, {source.high + 2}, {shape}), {dtype})"


# -- cases -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """A graph as data: what ``materialize`` builds, ``minimize`` edits and ``repro`` prints.
    Its values are drawn from ``seed``, parameters first, then inputs, each in order."""

    seed: int
    inputs: tuple[Source, ...]
    params: tuple[Source, ...]
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"fuzz{self.seed}"


def _op_name(op: Op) -> str:
    """The name GraphBuilder.op was given: the output, or the stem of several ("t3" of "t3.0")."""
    return op.outputs[0] if len(op.outputs) == 1 else op.outputs[0].rsplit(".", 1)[0]


def _add_ops(builder: GraphBuilder, case: Case) -> None:
    for source in case.inputs:
        builder.input(source.name, source.shape, source.dtype)
    for op in case.ops:
        builder.op(op.kind, *op.inputs, name=_op_name(op), n_outputs=len(op.outputs), **op.attrs)


def structure(case: Case) -> Graph:
    """The case's graph with parameters as shapes only: GraphBuilder's validation, without
    drawing values. Raises GraphError for an invalid case (the builder is the validity oracle)."""
    builder = GraphBuilder(case.name)
    for source in case.params:
        builder.param(source.name, source.shape, source.dtype)
    _add_ops(builder, case)
    return builder.build(*case.outputs)


def materialize(case: Case) -> tuple[Graph, dict[str, np.ndarray]]:
    """The case's graph with its weights, and its inputs."""
    rng = np.random.default_rng(case.seed)
    builder = GraphBuilder(case.name)
    for source in case.params:
        builder.param(source.name, draw(source, rng))
    _add_ops(builder, case)
    inputs = {source.name: draw(source, rng) for source in case.inputs}
    return builder.build(*case.outputs), inputs


def _is_float(dtype: str) -> bool:
    return dtype.startswith("float")


# -- the generator -----------------------------------------------------------------------------
# Sizes include primes and sizes that tile unevenly (rows not a multiple of 32 or 256).
DIMS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 32, 33, 64, 65, 100, 257)
MAX_INPUT_ELEMENTS = 4096
MIN_OPS, MAX_OPS = 3, 10
MAX_ELEMENTS = 8192  # per tensor: keeps a graph's compile and run at about a second per target
INPUT_RANKS = (1, 2, 3, 4)
INPUT_RANK_ODDS = (0.15, 0.3, 0.25, 0.3)
SPECIALS_ODDS = 0.1  # graphs whose first input holds a NaN or an infinity
CHAIN_ODDS = 0.6  # an op reads the newest tensor (a chain) rather than any earlier one (a DAG)
EXTRA_OUTPUT_ODDS = 0.3  # an intermediate tensor is also an output
RANK0_PARTNER_ODDS = 0.1  # a second operand is a scalar (rank 0)


def _pick(rng: np.random.Generator, options: Sequence):
    """One of ``options`` as it is (rng.choice would turn tuples and None into arrays)."""
    return options[int(rng.integers(len(options)))]


def _plain(value):
    """Attribute values as plain Python (numpy ints print as np.int64(3) in a repro)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


class Proposal:
    """One op to add to a case, with the inputs, parameters and helper ops it needs; the
    generator keeps it only if the builder accepts the whole extended graph."""

    def __init__(self, case: Case, graph: Graph, rng: np.random.Generator):
        self.case, self.graph, self.rng = case, graph, rng
        self.inputs: list[Source] = []
        self.params: list[Source] = []
        self.ops: list[Op] = []

    def coin(self, odds: float = 0.5) -> bool:
        return bool(self.rng.random() < odds)

    def dim(self) -> int:
        return int(_pick(self.rng, DIMS))

    def param(self, shape, draw: str = "normal", scale: float = INPUT_SCALE) -> str:
        name = f"w{len(self.case.params) + len(self.params)}"
        self.params.append(Source(name, tuple(int(d) for d in shape), draw=draw, scale=scale))
        return name

    def input(self, shape, dtype: str = "float32", draw: str = "normal", scale: float = INPUT_SCALE,
              high: int = 0) -> str:
        name = f"x{len(self.case.inputs) + len(self.inputs)}"
        self.inputs.append(Source(name, tuple(int(d) for d in shape), dtype, draw, scale, high))
        return name

    def source(self, shape, draw: str = "normal", scale: float = INPUT_SCALE) -> str:
        """A fresh parameter, or now and then an input: the CPU pipeline packs only weights."""
        return self.input(shape, draw=draw, scale=scale) if self.coin(0.25) else self.param(shape, draw, scale)

    def existing(self) -> str:
        """Any float input or op output so far (not a weight)."""
        names = [n for n, s in self.graph.tensors.items() if n not in self.graph.params and _is_float(s.dtype)]
        return _pick(self.rng, names)

    def operand(self, shape: tuple[int, ...]) -> str:
        """A second operand for ``shape``: an existing tensor (the builder decides whether it
        broadcasts), or a fresh source or constant of a shape that broadcasts."""
        choice = int(self.rng.integers(4))
        if choice == 0:
            return self.existing()
        partner = _broadcast_partner(self.rng, shape)
        if choice == 1:
            return self.op("full", [], shape=list(partner), value=float(_pick(self.rng, (-1.5, 0.0, 0.5, 2.0))))[0]
        return self.source(partner)

    def op(self, kind: str, inputs: Sequence[str], n_outputs: int = 1, **attrs) -> tuple[str, ...]:
        """Add an op named t<n>; attributes equal to the op's defaults are left out (shorter repros)."""
        name = f"t{len(self.case.ops) + len(self.ops)}"
        defaults = REGISTRY[kind].attrs
        given = {k: _plain(v) for k, v in attrs.items() if k not in defaults or v != defaults[k]}
        outputs = (name,) if n_outputs == 1 else tuple(f"{name}.{i}" for i in range(n_outputs))
        self.ops.append(Op(kind, tuple(inputs), outputs, given))
        return outputs


def _broadcast_partner(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts with ``shape``: a suffix of it (rank 0 included) with some sizes
    set to 1, or now and then ``shape`` under a new leading size (``shape`` then broadcasts)."""
    if len(shape) < 4 and rng.random() < 0.2:
        return (int(_pick(rng, (2, 3, 5))),) + shape
    if not shape or rng.random() < RANK0_PARTNER_ODDS:
        return ()
    keep = int(rng.integers(1, len(shape) + 1))
    return tuple(1 if rng.random() < 0.3 else d for d in shape[len(shape) - keep:])


def _axis(p: Proposal, rank: int) -> int:
    """An axis in [-rank, rank): negative axes count from the end, as torch's."""
    return int(p.rng.integers(-rank, rank))


def _unary(kind: str):
    def make(p: Proposal, x):
        p.op(kind, [x.name])

    make.__doc__ = f"{kind}(x)."
    return make


def _binary(kind: str):
    def make(p: Proposal, x):
        other = p.operand(x.shape)
        p.op(kind, [x.name, other] if p.coin() else [other, x.name])

    make.__doc__ = f"{kind}(x, y) or {kind}(y, x), y broadcasting with x."
    return make


def _div(p: Proposal, x):
    """x / y with y positive (a fresh source), so no quotient blows up."""
    p.op("div", [x.name, p.source(_broadcast_partner(p.rng, x.shape), draw="positive")])


def _scale(p: Proposal, x):
    p.op("scale", [x.name], factor=_pick(p.rng, (-1.5, 0.125, 0.5, 3.0)))


def _full(p: Proposal, x):
    """A constant shaped like x or like something that broadcasts with it, for later ops."""
    shape = x.shape if p.coin() else _broadcast_partner(p.rng, x.shape)
    p.op("full", [], shape=list(shape), value=_pick(p.rng, (-1.5, 0.0, 0.5, 2.0)))


def _dense(p: Proposal, x):
    k, n = x.shape[-1], p.dim()
    inputs = [x.name, p.source((n, k), scale=1 / math.sqrt(k))]
    if p.coin():
        inputs.append(p.param((n,)))
    p.op("dense", inputs)


def _matmul(p: Proposal, x):
    """x @ y or y @ x, y with or without (broadcast) batch dimensions, maybe stored transposed."""
    transpose_b = p.coin()
    batch = () if p.coin() else _broadcast_partner(p.rng, x.shape[:-2])
    if p.coin():
        k = x.shape[-1]
        y = p.source(batch + ((p.dim(), k) if transpose_b else (k, p.dim())), scale=1 / math.sqrt(k))
        p.op("matmul", [x.name, y], transpose_b=transpose_b)
    else:
        k = x.shape[-1] if transpose_b else x.shape[-2]
        y = p.source(batch + (p.dim(), k), scale=1 / math.sqrt(k))
        p.op("matmul", [y, x.name], transpose_b=transpose_b)


def _batch_matmul(p: Proposal, x):
    """x @ y on (B, M, K) batches, either side stored transposed; y may be x itself (x @ x^T)."""
    transpose_a = p.coin()
    batch, k = x.shape[0], x.shape[1] if transpose_a else x.shape[2]
    if p.coin(0.25):
        p.op("batch_matmul", [x.name, x.name], transpose_a=transpose_a, transpose_b=not transpose_a)
        return
    transpose_b = p.coin()
    n = p.dim()
    y = p.source((batch, n, k) if transpose_b else (batch, k, n), scale=1 / math.sqrt(k))
    p.op("batch_matmul", [x.name, y], transpose_a=transpose_a, transpose_b=transpose_b)


def _int_or_pair(p: Proposal, low: int, high: int):
    """One int or an (h, w) pair, as the window attributes accept both."""
    if p.coin():
        return int(p.rng.integers(low, high + 1))
    return [int(p.rng.integers(low, high + 1)) for _ in range(2)]


def _pair(value) -> tuple[int, int]:
    return tuple(value) if isinstance(value, list) else (value, value)


def _conv2d(p: Proposal, x):
    """Plain, grouped or depthwise, with random kernel, stride, padding and dilation."""
    channels = x.shape[1]
    divisors = [d for d in range(1, channels + 1) if channels % d == 0]
    groups = int(_pick(p.rng, (1, 1, channels, _pick(p.rng, divisors))))
    out_channels = p.dim() if groups == 1 else groups * int(_pick(p.rng, (1, 2, 3)))
    if groups == 1 and p.coin():
        out_channels = 8 * int(_pick(p.rng, (1, 2)))  # whole blocks of 8 or 16 rows, as weight packing needs
    kernel = [int(_pick(p.rng, (1, 2, 3))) for _ in range(2)]
    fan_in = channels // groups * kernel[0] * kernel[1]
    inputs = [x.name, p.source((out_channels, channels // groups, *kernel), scale=1 / math.sqrt(fan_in))]
    if p.coin():
        inputs.append(p.param((out_channels,)))
    p.op("conv2d", inputs, stride=_int_or_pair(p, 1, 2), padding=_int_or_pair(p, 0, 2),
         dilation=_int_or_pair(p, 1, 2), groups=groups)


def _pool_window(p: Proposal, dilated: bool) -> dict:
    """kernel, stride (None: the kernel's), padding and ceil_mode. The padding is at most half the
    kernel, as torch requires; souffle also accepts half the dilated window, which torch refuses."""
    kernel = _int_or_pair(p, 1, 3)
    padding = [int(p.rng.integers(0, k // 2 + 1)) for k in _pair(kernel)]
    window = {"kernel": kernel, "stride": None if p.coin() else _int_or_pair(p, 1, 3),
              "padding": padding if p.coin() else min(padding), "ceil_mode": p.coin()}
    return {**window, "dilation": _int_or_pair(p, 1, 2)} if dilated else window


def _max_pool2d(p: Proposal, x):
    p.op("max_pool2d", [x.name], **_pool_window(p, dilated=True))


def _avg_pool2d(p: Proposal, x):
    p.op("avg_pool2d", [x.name], **_pool_window(p, dilated=False), count_include_pad=p.coin())


def _global_avg_pool2d(p: Proposal, x):
    p.op("global_avg_pool2d", [x.name])


def _batch_norm(p: Proposal, x):
    """Running statistics as weights; the variance positive."""
    channels = (x.shape[1],)
    p.op("batch_norm", [x.name, p.param(channels), p.param(channels), p.param(channels),
                        p.param(channels, draw="positive")], eps=_pick(p.rng, (1e-5, 1e-3)))


def _layer_norm(p: Proposal, x):
    features = x.shape[-1:]
    p.op("layer_norm", [x.name, p.param(features), p.param(features)], eps=_pick(p.rng, (1e-5, 1e-3)))


def _softmax(p: Proposal, x):
    """Over any axis: rows that do not line up with the leading dimensions included."""
    p.op("softmax", [x.name], axis=_axis(p, len(x.shape)))


def _mean(p: Proposal, x):
    """Over all axes (axes=None: a rank-0 result without keepdims), one axis, or several."""
    rank = len(x.shape)
    if p.coin(0.3):
        axes = None
    elif p.coin():
        axes = _axis(p, rank)
    else:
        count = int(p.rng.integers(1, rank + 1))
        axes = [int(a) - rank * int(p.coin(0.3)) for a in sorted(p.rng.choice(rank, count, replace=False))]
    p.op("mean", [x.name], axes=axes, keepdims=p.coin())


def _sum(p: Proposal, x):
    """Over all axes, or one, kept or not."""
    axes = None if p.coin(0.3) else _axis(p, len(x.shape))
    p.op("sum", [x.name], axes=axes, keepdims=p.coin())


def _bounded(kind: str):
    """kind(tanh(x)): exp and powers of an operand in [-1, 1] stay far from float32's overflow,
    which the float64 reference would not share."""

    def make(p: Proposal, x):
        (bounded,) = p.op("tanh", [x.name])
        attrs = {"exponent": _pick(p.rng, (2.0, 3.0))} if kind == "pow" else {}
        p.op(kind, [bounded], **attrs)

    make.__doc__ = f"{kind}(tanh(x))."
    return make


def _positive(kind: str):
    """kind(|x| + y) with y in [0.5, 2]: logarithms and roots of positive numbers only."""

    def make(p: Proposal, x):
        (magnitude,) = p.op("abs", [x.name])
        (shifted,) = p.op("add", [magnitude, p.source(_broadcast_partner(p.rng, x.shape), draw="positive")])
        p.op(kind, [shifted])

    make.__doc__ = f"{kind}(|x| + y), y positive."
    return make


def _clamp(p: Proposal, x):
    low, high = _pick(p.rng, (-1.5, -0.5, None)), _pick(p.rng, (0.5, 2.0))
    p.op("clamp", [x.name], min=low, max=high)


def _cast(p: Proposal, x):
    """To float32, the dtype every float the generator makes has: the fuzzer compares in float64,
    so a cast to float16 would differ by its rounding, not by a defect."""
    p.op("cast", [x.name], dtype="float32")


def _expand(p: Proposal, x):
    """Size-1 axes stretched, and a new leading axis while the rank allows one."""
    shape = [p.dim() if d == 1 else d for d in x.shape]
    if len(shape) < 4 and p.coin():
        shape.insert(0, p.dim())
    p.op("expand", [x.name], shape=shape)


def _masked(kind: str):
    """where(kind(x, y), x, y): a comparison's mask (1 where true) picks between its operands."""

    def make(p: Proposal, x):
        other = p.operand(x.shape)
        (mask,) = p.op(kind, [x.name, other])
        p.op("where", [mask, x.name, other])

    make.__doc__ = f"where({kind}(x, y), x, y), y broadcasting with x."
    return make


def _logical(kind: str):
    """where(kind(x > y, x <= z), x, y): masks combined, then picking between x and y."""

    def make(p: Proposal, x):
        other = p.operand(x.shape)
        masks = p.op("gt", [x.name, other])
        if kind != "logical_not":
            masks += p.op("le", [x.name, p.operand(x.shape)])
        (mask,) = p.op(kind, list(masks))
        p.op("where", [mask, x.name, other])

    make.__doc__ = f"where({kind}(x > y[, x <= z]), x, y)."
    return make


def _where(p: Proposal, x):
    """where(x, y, x): a float condition is true where it is nonzero."""
    p.op("where", [x.name, p.operand(x.shape), x.name])


def _embedding(p: Proposal, x):
    """Rows of a weight table, or of x itself when it is 2-D, picked by int32 or int64 ids."""
    if len(x.shape) == 2 and p.coin():
        table, rows = x.name, x.shape[0]
    else:
        rows = p.dim()
        table = p.param((rows, p.dim()))
    ids_shape = tuple(int(_pick(p.rng, (1, 2, 3, 5, 7))) for _ in range(int(p.rng.integers(1, 3))))
    ids = p.input(ids_shape, dtype=_pick(p.rng, ("int32", "int64")), draw="ids", high=rows)
    p.op("embedding", [table, ids])


def _factors(rng: np.random.Generator, size: int, rank: int) -> list[int]:
    """``size`` as a product of ``rank`` random factors."""
    dims = []
    for _ in range(rank - 1):
        dims.append(int(_pick(rng, [d for d in range(1, size + 1) if size % d == 0])))
        size //= dims[-1]
    return dims + [size]


def _reshape(p: Proposal, x):
    """To a random factorization of x's size, maybe with one size left as -1."""
    dims = _factors(p.rng, int(np.prod(x.shape, dtype=np.int64)), int(p.rng.integers(1, 5)))
    if p.coin(0.3):
        dims[int(p.rng.integers(len(dims)))] = -1
    p.op("reshape", [x.name], shape=dims)


def _transpose(p: Proposal, x):
    """A random permutation (some axes negative), or None (axes reversed)."""
    rank = len(x.shape)
    axes = None if p.coin(0.3) else [int(a) - rank * int(p.coin(0.2)) for a in p.rng.permutation(rank)]
    p.op("transpose", [x.name], axes=axes)


def _concat(p: Proposal, x):
    """x with itself or with sources that differ from it only along the axis, in any order."""
    axis = _axis(p, len(x.shape))
    parts = [x.name]
    for _ in range(int(p.rng.integers(1, 3))):
        if p.coin(0.3):
            parts.append(x.name)
        else:
            shape = list(x.shape)
            shape[axis] = int(_pick(p.rng, (1, 2, 3, 7, 16)))
            parts.append(p.source(shape))
    p.op("concat", [parts[i] for i in p.rng.permutation(len(parts))], axis=axis)


def _slice(p: Proposal, x):
    """Some axes sliced with negative or out-of-range bounds and strides up to 3."""
    rank = len(x.shape)
    count = int(p.rng.integers(1, rank + 1))
    leading = p.coin(0.3)
    axes = list(range(count)) if leading else sorted(int(a) for a in p.rng.choice(rank, count, replace=False))
    begins, ends, strides = [], [], []
    for a in axes:
        size = x.shape[a]
        begins.append(int(p.rng.integers(-size, size)))
        ends.append(size + 3 if p.coin(0.3) else int(p.rng.integers(-size, size + 1)))
        strides.append(int(_pick(p.rng, (1, 1, 2, 3))))
    axis = None if leading else [a - rank * int(p.coin(0.3)) for a in axes]
    p.op("slice", [x.name], begin=begins, end=ends, axis=axis, strides=None if set(strides) == {1} else strides)


def _split(p: Proposal, x):
    """Into equal sections or into given sizes; several outputs."""
    axis = _axis(p, len(x.shape))
    size = x.shape[axis]
    if p.coin() or size < 2:
        sections = int(_pick(p.rng, [d for d in range(1, min(size, 4) + 1) if size % d == 0]))
        p.op("split", [x.name], n_outputs=sections, sections=sections, axis=axis)
    else:
        count = min(size - 1, int(p.rng.integers(1, 3)))
        cut = sorted(int(c) for c in p.rng.choice(range(1, size), count, replace=False))
        sizes = [b - a for a, b in zip([0] + cut, cut + [size])]
        p.op("split", [x.name], n_outputs=len(sizes), sizes=sizes, axis=axis)


def _flatten(p: Proposal, x):
    rank = len(x.shape)
    p.op("flatten", [x.name], start_dim=_axis(p, rank), end_dim=_axis(p, rank))


def _pad(p: Proposal, x):
    """Up to two elements of zero or another constant on either side of each axis."""
    rank = len(x.shape)
    before = [int(_pick(p.rng, (0, 0, 1, 2))) for _ in range(rank)]
    after = [int(_pick(p.rng, (0, 0, 1, 2))) for _ in range(rank)]
    p.op("pad", [x.name], before=before, after=after, value=float(_pick(p.rng, (0.0, -1.5))))


def _roll(p: Proposal, x):
    """One or two axes rolled by shifts of either sign, some longer than the axis."""
    rank = len(x.shape)
    axes = [int(a) for a in p.rng.choice(rank, int(p.rng.integers(1, min(rank, 2) + 1)), replace=False)]
    shifts = [int(p.rng.integers(-2 * x.shape[a], 2 * x.shape[a] + 1)) for a in axes]
    p.op("roll", [x.name], shifts=shifts, axes=[a - rank * int(p.coin(0.3)) for a in axes])


def _take(p: Proposal, x):
    """Elements along one axis picked by int32 or int64 indices of one or two dimensions."""
    axis = _axis(p, len(x.shape))
    ids_shape = tuple(int(_pick(p.rng, (1, 2, 3, 5))) for _ in range(int(p.rng.integers(1, 3))))
    ids = p.input(ids_shape, dtype=_pick(p.rng, ("int32", "int64")), draw="ids", high=x.shape[axis])
    p.op("take", [x.name, ids], axis=axis)


MAKERS: dict[str, Callable[[Proposal, object], None]] = {
    **{kind: _unary(kind) for kind in ("relu", "sigmoid", "tanh", "gelu", "silu", "copy")},
    **{kind: _binary(kind) for kind in ("add", "sub", "mul")},
    "div": _div, "scale": _scale, "full": _full,
    "dense": _dense, "matmul": _matmul, "batch_matmul": _batch_matmul, "conv2d": _conv2d,
    "batch_norm": _batch_norm, "layer_norm": _layer_norm, "softmax": _softmax,
    "max_pool2d": _max_pool2d, "avg_pool2d": _avg_pool2d, "global_avg_pool2d": _global_avg_pool2d,
    "mean": _mean, "embedding": _embedding,
    "reshape": _reshape, "transpose": _transpose, "concat": _concat, "slice": _slice, "split": _split,
    "flatten": _flatten,
    **{kind: _unary(kind) for kind in ("neg", "abs", "erf", "hardsigmoid", "hardswish", "gelu_tanh")},
    **{kind: _bounded(kind) for kind in ("exp", "pow")},
    **{kind: _positive(kind) for kind in ("log", "sqrt", "rsqrt")},
    "clamp": _clamp, "cast": _cast, "expand": _expand, "sum": _sum,
    **{kind: _masked(kind) for kind in ("eq", "ne", "lt", "le", "gt", "ge")},
    **{kind: _logical(kind) for kind in ("logical_and", "logical_or", "logical_not")},
    "where": _where, "pad": _pad, "roll": _roll, "take": _take,
}
# The ranks of the tensor a maker reads, where it needs some: the generator picks its operand
# among the tensors of those ranks.
RANKS = {
    "dense": (1, 2, 3, 4), "layer_norm": (1, 2, 3, 4), "softmax": (1, 2, 3, 4), "mean": (1, 2, 3, 4),
    "sum": (1, 2, 3, 4), "expand": (1, 2, 3, 4),
    "concat": (1, 2, 3, 4), "slice": (1, 2, 3, 4), "split": (1, 2, 3, 4), "flatten": (1, 2, 3, 4),
    "roll": (1, 2, 3, 4), "take": (1, 2, 3, 4),
    "matmul": (2, 3, 4), "batch_norm": (2, 3, 4), "batch_matmul": (3,),
    "conv2d": (4,), "max_pool2d": (4,), "avg_pool2d": (4,), "global_avg_pool2d": (4,),
}
# Made by the CPU pipeline's pack_weights pass from dense and conv2d (weights of 8 or 16k rows),
# so the generator covers them through those.
PACKED_KINDS = {"dense_packed": "dense", "conv2d_packed": "conv2d"}


def _input_shape(rng: np.random.Generator) -> tuple[int, ...]:
    rank = int(rng.choice(INPUT_RANKS, p=INPUT_RANK_ODDS))
    while True:
        shape = tuple(int(_pick(rng, DIMS)) for _ in range(rank))
        if np.prod(shape) <= MAX_INPUT_ELEMENTS:
            return shape


def _extended(case: Case, proposal: Proposal, size: int) -> tuple[Case, Graph] | None:
    """The case with the proposal's ops, if the builder accepts them, they make at most ``size``
    ops and no tensor is too large."""
    ops = case.ops + tuple(proposal.ops)
    if len(ops) > size:
        return None
    extended = replace(case, inputs=case.inputs + tuple(proposal.inputs), params=case.params + tuple(proposal.params),
                       ops=ops, outputs=(ops[-1].outputs[0],))
    try:
        graph = structure(extended)
    except GraphError:
        return None
    if any(spec.size > MAX_ELEMENTS for spec in graph.tensors.values()):
        return None
    return extended, graph


def _operand(rng: np.random.Generator, graph: Graph, kind: str):
    """The newest float tensor of a rank ``kind`` takes (a chain), or any earlier float input or
    op output of such a rank (a DAG); None if there is none."""
    ranks = RANKS.get(kind)
    names = [n for n, s in graph.tensors.items()
             if n not in graph.params and _is_float(s.dtype) and (ranks is None or len(s.shape) in ranks)]
    if not names:
        return None
    return graph.tensors[names[-1] if rng.random() < CHAIN_ODDS else _pick(rng, names)]


def _outputs(rng: np.random.Generator, case: Case) -> tuple[str, ...]:
    """Every op output nothing reads (so no op is dead), and maybe one intermediate too."""
    read = {n for op in case.ops for n in op.inputs}
    produced = [n for op in case.ops for n in op.outputs]
    outputs = {n for n in produced if n not in read}
    intermediate = [n for n in produced if n in read]
    if intermediate and rng.random() < EXTRA_OUTPUT_ODDS:
        outputs.add(_pick(rng, intermediate))
    return tuple(n for n in produced if n in outputs)


def _with_specials(rng: np.random.Generator, case: Case) -> Case:
    """Now and then a NaN or an infinity in the first input: they must propagate as in PyTorch."""
    first = case.inputs[0]
    if rng.random() >= SPECIALS_ODDS:
        return case
    size = int(np.prod(first.shape, dtype=np.int64))
    count = int(rng.integers(1, 3))
    specials = tuple((int(rng.integers(size)), float(_pick(rng, SPECIAL_VALUES))) for _ in range(count))
    return replace(case, inputs=(replace(first, specials=specials),) + case.inputs[1:])


def generate(seed: int, attempts: int = 200) -> Case:
    """A random valid graph of 3 to 10 ops (fewer if the attempts run out): each a random kind on
    the newest tensor or an earlier one, its attributes and weights drawn to fit, kept if the
    builder accepts it."""
    rng = np.random.default_rng(seed)
    sources = tuple(Source(f"x{i}", _input_shape(rng)) for i in range(1 + int(rng.random() < 0.3)))
    case = Case(seed, sources, (), (), (sources[0].name,))
    graph = structure(case)
    size = int(rng.integers(MIN_OPS, MAX_OPS + 1))
    kinds = sorted(MAKERS)
    for _ in range(attempts):
        if len(case.ops) >= size:
            break
        kind = _pick(rng, kinds)
        operand = _operand(rng, graph, kind)
        if operand is None:
            continue
        proposal = Proposal(case, graph, rng)
        MAKERS[kind](proposal, operand)
        extended = _extended(case, proposal, size)
        if extended is not None:
            case, graph = extended
    return _with_specials(rng, replace(case, outputs=_outputs(rng, case)))


# -- the float64 reference ---------------------------------------------------------------------
# One function per op kind, (inputs..., **attrs with the op's defaults) -> tensor(s), written from
# the op's TE lowering; each follows torch, whose NaN and infinity semantics the ops promise.
def _ints(value) -> tuple[int, ...]:
    return (value,) if isinstance(value, int) else tuple(value)


def _window(value):
    return value if value is None or isinstance(value, int) else tuple(value)


def _all_axes(axes, rank: int) -> tuple[int, ...]:
    return tuple(range(rank)) if axes is None else _ints(axes)


def _reference_slice(x, begin, end, axis, strides):
    """Python slicing on each axis, as ``_slice_bounds`` resolves the bounds."""
    begins, ends = _ints(begin), _ints(end)
    axes = range(len(begins)) if axis is None else _ints(axis)
    steps = (1,) * len(begins) if strides is None else _ints(strides)
    index = [slice(None)] * x.dim()
    for a, b, e, s in zip(axes, begins, ends, steps):
        index[a] = slice(b, e, s)
    return x[tuple(index)]


def _reference_split(x, sections, sizes, axis):
    pieces = x.shape[axis] // sections if sizes is None else list(sizes)
    return [piece.clone() for piece in torch.split(x, pieces, axis)]


def _reference_embedding(table, ids):
    """Ids are clamped into [0, V) as the lowering's take(mode="clip") does; torch would raise."""
    return F.embedding(ids.clamp(0, table.shape[0] - 1), table)


def _reference_take(x, ids, axis):
    """Negative indices count from the end, others are clamped into the axis, as the lowering does."""
    axis %= x.dim()
    size = x.shape[axis]
    picks = torch.where(ids < 0, ids + size, ids).clamp(0, size - 1)
    taken = x.index_select(axis, picks.reshape(-1))
    return taken.reshape(x.shape[:axis] + ids.shape + x.shape[axis + 1:])


def _reference_batch_norm(x, gamma, beta, mean, var, eps):
    """Inference mode over axis 1; souffle takes (gamma, beta, mean, var), torch (mean, var, gamma, beta)."""
    return F.batch_norm(x, mean, var, gamma, beta, training=False, eps=eps)


COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
# A float comparison of operands this close (relative) is a tie: float32 rounding and the
# approximated exp/tanh/erf (within 2e-7) may decide it either way. tanh(x) rounds to x in float32
# for |x| < 2^-12, so le(x, tanh(x)) is true in float32 and false in float64 (fuzz seed 1795442239).
TIE_TOLERANCE = 1e-6


def _resolved_ties(kind: str, tie: bool) -> Callable:
    """``kind``, with every float tie decided as ``tie``."""
    compare_exactly = getattr(torch, kind)

    def decide(a, b):
        exact = compare_exactly(a, b)
        if not (a.is_floating_point() or b.is_floating_point()):
            return exact
        a, b = torch.broadcast_tensors(a.double(), b.double())
        scale = torch.maximum(torch.ones_like(a), torch.maximum(a.abs(), b.abs()))
        return torch.where((a - b).abs() <= TIE_TOLERANCE * scale, torch.tensor(tie), exact)

    return decide


REFERENCE: dict[str, Callable] = {
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "gelu": F.gelu,
    "silu": F.silu,
    "copy": torch.clone,
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "scale": lambda x, factor: x * factor,
    "full": lambda shape, value, dtype: torch.full(_ints(shape), value,
                                                   dtype=torch.float64 if _is_float(dtype) else torch.int64),
    "dense": lambda x, w, b=None, split_k=1: F.linear(x, w, b),  # split_k: the same product
    "matmul": lambda a, b, transpose_b, alpha: alpha * torch.matmul(a, b.transpose(-1, -2) if transpose_b else b),
    "batch_matmul": lambda a, b, transpose_a, transpose_b, alpha: alpha * torch.bmm(
        a.transpose(1, 2) if transpose_a else a, b.transpose(1, 2) if transpose_b else b),
    "conv2d": lambda x, w, b=None, *, stride, padding, dilation, groups, split_k=1: F.conv2d(
        x, w, b, _window(stride), _window(padding), _window(dilation), groups),
    "batch_norm": _reference_batch_norm,
    "layer_norm": lambda x, gamma, beta, eps: F.layer_norm(x, x.shape[-1:], gamma, beta, eps),
    "softmax": lambda x, axis: torch.softmax(x, axis),
    "max_pool2d": lambda x, kernel, stride, padding, dilation, ceil_mode: F.max_pool2d(
        x, _window(kernel), _window(stride), _window(padding), _window(dilation), ceil_mode),
    "avg_pool2d": lambda x, kernel, stride, padding, ceil_mode, count_include_pad: F.avg_pool2d(
        x, _window(kernel), _window(stride), _window(padding), ceil_mode, count_include_pad),
    "global_avg_pool2d": lambda x: x.mean((2, 3), keepdim=True),
    "mean": lambda x, axes, keepdims, split=1: x.mean(_all_axes(axes, x.dim()), keepdim=keepdims),  # split: the same mean
    "embedding": _reference_embedding,
    "reshape": lambda x, shape: x.reshape(_ints(shape)),
    "transpose": lambda x, axes: x.permute(tuple(reversed(range(x.dim()))) if axes is None else _ints(axes)),
    "concat": lambda *parts, axis: torch.cat(parts, axis),
    "slice": _reference_slice,
    "split": _reference_split,
    "flatten": lambda x, start_dim, end_dim: torch.flatten(x, start_dim, end_dim),
    "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "erf": torch.erf,
    "neg": torch.neg, "abs": torch.abs, "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "pow": lambda x, exponent: torch.pow(x, exponent),
    "clamp": lambda x, min, max: torch.clamp(x, min, max),  # noqa: A006  (the op's attribute names)
    "cast": lambda x, dtype: x.clone(),
    "expand": lambda x, shape: x.expand(*_ints(shape)),
    "sum": lambda x, axes, keepdims: x.sum(_all_axes(axes, x.dim()), keepdim=keepdims),
    **{kind: getattr(torch, kind) for kind in COMPARISONS + ("logical_and", "logical_or", "logical_not")},
    "where": lambda condition, a, b: torch.where(condition != 0, a, b),
    "pad": lambda x, before, after, value: F.pad(
        x, [amount for axis in reversed(range(x.dim())) for amount in (before[axis], after[axis])], value=value),
    "roll": lambda x, shifts, axes: torch.roll(x, _ints(shifts), _ints(axes)),
    "take": _reference_take,
}


def _as_torch(array: np.ndarray) -> torch.Tensor:
    """Floats as float64, ints as int64 (torch indexes with int64)."""
    return torch.from_numpy(np.asarray(array, np.float64 if _is_float(str(array.dtype)) else np.int64))


def reference_outputs(graph: Graph, inputs: Mapping[str, np.ndarray],
                      reference: Mapping[str, Callable] = REFERENCE) -> list[np.ndarray]:
    """The graph's outputs computed in float64 by ``reference``, op after op."""
    values = {name: _as_torch(array) for name, array in {**graph.weights, **inputs}.items()}
    for op in graph.ops:
        result = reference[op.kind](*(values[n] for n in op.inputs), **{**REGISTRY[op.kind].attrs, **op.attrs})
        values.update(zip(op.outputs, result if isinstance(result, list) else [result]))
    return [values[name].numpy() for name in graph.outputs]


def tie_references(graph: Graph, inputs: Mapping[str, np.ndarray],
                   reference: Mapping[str, Callable] = REFERENCE) -> list[list[np.ndarray]]:
    """The outputs again with every float comparison's ties decided true, then false: where a
    comparison is a tie, either answer (and what follows from it) is right. None without one."""
    if not any(op.kind in COMPARISONS for op in graph.ops):
        return []
    return [reference_outputs(graph, inputs, {**reference, **{kind: _resolved_ties(kind, tie) for kind in COMPARISONS}})
            for tie in (True, False)]


# -- checking one target -----------------------------------------------------------------------
# float32 rounding over the reductions of these graphs (a few hundred terms of order one) stays
# under about 1e-5; 1e-4 leaves room for it and still catches a wrong index, a dropped term or
# an unwritten element, which are off by far more.
RTOL = ATOL = 1e-4

COMPILE_ERROR, RUN_ERROR, CRASH, TIMEOUT, MISMATCH = "compile error", "run error", "crash", "timeout", "mismatch"
KINDS = (COMPILE_ERROR, RUN_ERROR, CRASH, TIMEOUT, MISMATCH)


@dataclass(frozen=True)
class Config:
    """A target and, for a target with opt levels, the level."""

    target: str
    level: int | None = None

    def __str__(self):
        return self.target if self.level is None else f"{self.target} O{self.level}"


def configs(targets: Iterable[str] = ("llvm", "llvm-persistent"),
            levels: Iterable[int] | None = None) -> list[Config]:
    """Each target at each of its opt levels (those in ``levels``, if given), or once if it has none."""
    from codegen.pipelines import PIPELINES

    chosen = []
    for target in targets:
        if target not in PIPELINES:
            raise ValueError(f"unknown target {target!r}; available: {', '.join(PIPELINES)}")
        own = sorted(PIPELINES[target].levels)
        picked = [level for level in own if levels is None or level in levels]
        if own and not picked:
            raise ValueError(f"target {target!r} has opt levels {own}, none of {sorted(levels)}")
        chosen += [Config(target, level) for level in picked] if own else [Config(target)]
    return chosen


@dataclass(frozen=True)
class Mismatch:
    """An output that differs from the reference: how (``cause``), by how much, and where first."""

    output: str
    cause: str
    max_abs_error: float
    detail: str


def compare(name: str, got: np.ndarray, want: np.ndarray, rtol: float = RTOL, atol: float = ATOL,
            alternatives: Sequence[np.ndarray] = ()) -> Mismatch | None:
    """``got`` against the float64 reference cast to ``got``'s dtype: NaN where it has NaN, the same
    infinities, finite values within rtol/atol. An element that agrees with one of ``alternatives``
    (the reference with comparison ties decided otherwise) agrees. None if they agree."""
    if got.shape != want.shape:
        return Mismatch(name, "shape differs", math.inf, f"shape {got.shape}, expected {want.shape}")
    want = want.astype(got.dtype)
    bad = ~np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    for other in alternatives:
        bad &= ~np.isclose(got, other.astype(got.dtype), rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return None
    finite = np.isfinite(got) & np.isfinite(want)
    error = np.abs(got.astype(np.float64) - want.astype(np.float64))
    max_abs = float(error[finite].max()) if finite.any() else 0.0
    if (bad & ~np.isfinite(want)).any():
        cause = "NaN or infinity not propagated"
    elif (bad & ~np.isfinite(got)).any():
        cause = "NaN or infinity where the reference is finite"
    else:
        cause = "values differ"
    first = np.unravel_index(int(np.argmax(bad)), bad.shape)
    detail = (f"{int(bad.sum())} of {bad.size} elements differ, max abs error {max_abs:.3g}; "
              f"first at {tuple(int(i) for i in first)}: got {got[first]!r}, expected {want[first]!r}")
    return Mismatch(name, cause, max_abs, detail)


def mismatches(names: Sequence[str], got: Sequence[np.ndarray], want: Sequence[np.ndarray],
               ties: Sequence[Sequence[np.ndarray]] = ()) -> list[Mismatch]:
    """Each output against the reference; ``ties`` are ``tie_references``' alternatives."""
    found = (compare(name, g, w, alternatives=[t[i] for t in ties]) for i, (name, g, w) in enumerate(zip(names, got, want)))
    return [m for m in found if m is not None]


def poisoned_run(model, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Run a CPU model with NaN (ints: their minimum) in its scratch arenas and its output
    buffers: an element the program reads before writing, or never writes, shows. The
    cuda-emulated target's device poisons every buffer it allocates itself."""
    if model.target == "cuda-emulated":
        return model.run(dict(inputs))
    arguments, outputs = model._arguments(inputs)
    for buffer in outputs + model._arenas:
        dtype = np.dtype(buffer.dtype)
        poison = np.nan if dtype.kind == "f" else np.iinfo(dtype).min
        buffer.copyfrom(np.full(buffer.shape, poison, dtype))
    model._function(*arguments)
    return [o.numpy().reshape(s.shape) for o, s in zip(outputs, model.plan.outputs)]


@dataclass(frozen=True)
class Failure:
    """One failure of one graph on one target and level.

    kind: compile error, run error (the exception's type is ``cause``), crash (the signal),
    timeout, or mismatch (``cause`` says how; ``output`` and ``max_abs_error`` say where and
    how much). ``detail`` is the message, the crash's last words, or the mismatch's figures.
    """

    seed: int
    config: Config
    kind: str
    cause: str
    detail: str
    output: str | None = None
    max_abs_error: float | None = None

    @property
    def signature(self) -> tuple[str, ...]:
        """What "fails the same way" compares: the kind and cause, and for an error the first line
        of its message with numbers and quoted names blanked (they change as a graph shrinks)."""
        if self.kind not in (COMPILE_ERROR, RUN_ERROR):
            return (self.kind, self.cause)
        line = next((ln for ln in self.detail.splitlines() if ln.strip()), "")
        return (self.kind, self.cause, re.sub(r"'[^']*'|0x[0-9a-f]+|\d+", "#", line))

    def summary(self) -> str:
        where = f" in output {self.output}" if self.output else ""
        first = self.detail.splitlines()[0] if self.detail else ""
        return f"seed {self.seed}, {self.config}: {self.kind} ({self.cause}){where}: {first}"


@dataclass(frozen=True)
class Task:
    case: Case
    config: Config


@dataclass(frozen=True)
class ConfigResult:
    """What checking a case on one config found: whether it compiled and ran, and its failures."""

    seed: int
    config: Config
    compiled: bool
    ran: bool
    failures: tuple[Failure, ...] = ()


def _error_detail(error: BaseException, limit: int = 2000) -> tuple[str, str]:
    """(qualified type, message): TVM's messages end with the check that failed after a long
    C++ backtrace, so the backtrace goes and the message is kept to ``limit`` characters."""
    kind = type(error)
    cause = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    lines = [ln for ln in str(error).splitlines() if ln.strip() and not ln.lstrip().startswith("File ")]
    return cause, "\n".join(ln for ln in lines if ln.strip() != "Traceback (most recent call last):")[-limit:]


def check_config(task: Task, reference_overrides: Mapping[str, Callable] | None = None) -> ConfigResult:
    """Compile the case for one config, run it poisoned and compare with the reference (whose
    functions ``reference_overrides`` may replace, for testing the fuzzer). The job of a worker."""
    case, config = task.case, task.config
    graph, inputs = materialize(case)
    reference = {**REFERENCE, **(reference_overrides or {})}
    expected = reference_outputs(graph, inputs, reference)
    ties = tie_references(graph, inputs, reference)
    try:
        model = souffle.compile(graph, target=config.target, opt_level=config.level)
    except Exception as error:
        cause, detail = _error_detail(error)
        failure = Failure(case.seed, config, COMPILE_ERROR, cause, detail)
        return ConfigResult(case.seed, config, False, False, (failure,))
    try:
        got = poisoned_run(model, inputs)
    except Exception as error:
        cause, detail = _error_detail(error)
        failure = Failure(case.seed, config, RUN_ERROR, cause, detail)
        return ConfigResult(case.seed, config, True, False, (failure,))
    failures = tuple(Failure(case.seed, config, MISMATCH, m.cause, m.detail, m.output, m.max_abs_error)
                     for m in mismatches(graph.outputs, got, expected, ties))
    return ConfigResult(case.seed, config, True, True, failures)


# -- worker processes --------------------------------------------------------------------------
DEFAULT_TIMEOUT = 300.0  # seconds for one task; a compile that takes longer is recorded as hung


@dataclass(frozen=True)
class Crashed:
    """A worker died during a task: its exit code (the negated signal number if a signal killed
    it) and the end of what it wrote to stderr (glibc's "double free or corruption", say)."""

    exitcode: int
    stderr_tail: str

    @property
    def cause(self) -> str:
        if self.exitcode < 0:
            return signal.Signals(-self.exitcode).name
        return f"exit code {self.exitcode}"


@dataclass(frozen=True)
class TimedOut:
    seconds: float


@dataclass(frozen=True)
class JobError:
    """The job itself raised: a bug in the fuzzer, not a finding; the pool raises it again."""

    traceback: str


PR_SET_PDEATHSIG = 1  # linux/prctl.h
READY = "ready"  # what a worker sends once it has imported everything: a task's time starts then


def _serve(job: Callable, connection, log_path: str, parent: int) -> None:
    """A worker's loop: run ``job`` on each task received and send back its result. Its stderr
    goes to ``log_path`` (emptied per task), so the parent can read a crash's last words."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if sys.platform.startswith("linux"):  # killed with the parent, not left mid-compile for minutes
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died while this worker was starting
        os._exit(1)
    torch.set_num_threads(1)  # the reference is small; the cores are for the workers
    os.dup2(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    connection.send(READY)
    while (task := connection.recv()) is not None:
        os.ftruncate(2, 0)
        os.lseek(2, 0, os.SEEK_SET)
        try:
            result = job(task)
        except Exception:
            result = JobError(traceback.format_exc())
        connection.send(result)


@dataclass
class _Worker:
    process: multiprocessing.Process
    connection: object
    log: Path


class WorkerPool:
    """Worker processes ("spawn": no state shared with the parent), each running ``job`` on one
    task at a time and reused across tasks; one that crashes or hangs is replaced, and its task
    gets a ``Crashed`` or ``TimedOut`` outcome instead of the job's result."""

    def __init__(self, job: Callable, workers: int = 2, timeout: float = DEFAULT_TIMEOUT):
        self.job, self.size, self.timeout = job, workers, timeout
        self._context = multiprocessing.get_context("spawn")
        self._logs = tempfile.TemporaryDirectory(prefix="souffle-fuzz-")
        self._workers = [self._start(slot) for slot in range(workers)]
        for worker in self._workers:
            self._wait_ready(worker)

    def _start(self, slot: int) -> _Worker:
        ours, theirs = self._context.Pipe()
        log = Path(self._logs.name) / f"worker{slot}.stderr"
        process = self._context.Process(target=_serve, args=(self.job, theirs, str(log), os.getpid()), daemon=True)
        process.start()
        theirs.close()
        return _Worker(process, ours, log)

    def _wait_ready(self, worker: _Worker) -> None:
        """Wait for a new worker's imports (seconds: TVM and torch), so they count against no task."""
        try:
            worker.connection.recv()
        except EOFError:
            raise RuntimeError(f"a fuzzing worker died while starting:\n{_tail(worker.log)}") from None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def map(self, tasks: Iterable) -> Iterator[tuple[object, object]]:
        """(task, outcome) as tasks finish; ``tasks`` is consumed only as workers free up, so it
        may be an endless generator that stops when time is up."""
        pending, running, idle = iter(tasks), {}, list(range(self.size))
        more = True
        while more or running:
            while more and idle:
                task = next(pending, None)
                if task is None:
                    more = False
                    break
                slot = idle.pop()
                self._workers[slot].connection.send(task)
                running[slot] = (task, time.monotonic())
            if not running:
                return
            watched = [self._workers[s] for s in running]
            wait([w.connection for w in watched] + [w.process.sentinel for w in watched], timeout=1.0)
            for slot, (task, started) in list(running.items()):
                outcome = self._outcome(slot, started)
                if outcome is None:
                    continue
                del running[slot]
                idle.append(slot)
                if isinstance(outcome, JobError):
                    raise RuntimeError(f"the fuzzer's job failed on {task}:\n{outcome.traceback}")
                yield task, outcome

    def _outcome(self, slot: int, started: float):
        """The worker's result if it sent one; a Crashed or TimedOut (and a new worker in its
        slot) if it died or ran too long; None while it is still working."""
        worker = self._workers[slot]
        if worker.connection.poll():
            try:
                return worker.connection.recv()
            except EOFError:
                worker.process.join()
        if worker.process.is_alive():
            if time.monotonic() - started < self.timeout:
                return None
            worker.process.kill()
            worker.process.join()
            outcome = TimedOut(self.timeout)
        else:
            outcome = Crashed(worker.process.exitcode, _tail(worker.log))
        worker.connection.close()
        self._workers[slot] = self._start(slot)
        self._wait_ready(self._workers[slot])
        return outcome

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.connection.send(None)
            except OSError:
                pass
        for worker in self._workers:
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
        self._logs.cleanup()


def _tail(path: Path, lines: int = 8) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join([ln for ln in text.splitlines() if ln.strip()][-lines:])


def config_result(task: Task, outcome) -> ConfigResult:
    """A task's outcome from the pool as a ConfigResult: a crash or a hang is a failure too."""
    if isinstance(outcome, ConfigResult):
        return outcome
    seed, config = task.case.seed, task.config
    if isinstance(outcome, Crashed):
        failure = Failure(seed, config, CRASH, outcome.cause, outcome.stderr_tail or "(nothing on stderr)")
    else:
        failure = Failure(seed, config, TIMEOUT, "timeout", f"no result after {outcome.seconds:.0f} s")
    return ConfigResult(seed, config, False, False, (failure,))


# -- fuzzing many seeds ------------------------------------------------------------------------
@dataclass
class FuzzResult:
    """Every case tried (by seed) and what each config found."""

    cases: dict[int, Case] = field(default_factory=dict)
    results: list[ConfigResult] = field(default_factory=list)

    @property
    def failures(self) -> list[Failure]:
        return [f for r in sorted(self.results, key=lambda r: (r.seed, str(r.config))) for f in r.failures]

    def counts(self) -> dict[str, object]:
        """Graphs, compiles (attempted and done), runs, and failures by kind."""
        by_kind = {kind: sum(f.kind == kind for f in self.failures) for kind in KINDS}
        return {"graphs": len(self.cases), "compiles": len(self.results),
                "compiled": sum(r.compiled for r in self.results), "runs": sum(r.ran for r in self.results),
                "failing graphs": len({f.seed for f in self.failures}), "failures": by_kind}


def fuzz(seeds: Iterable[int], chosen: Sequence[Config], pool: WorkerPool,
         progress: Callable[[FuzzResult], None] | None = None) -> FuzzResult:
    """Generate a case per seed and check it on every config in the pool; ``seeds`` is read
    lazily, so it may stop on a deadline. ``progress`` is called after every config's result."""
    result = FuzzResult()

    def tasks():
        for seed in seeds:
            case = result.cases[seed] = generate(seed)
            yield from (Task(case, config) for config in chosen)

    for task, outcome in pool.map(tasks()):
        result.results.append(config_result(task, outcome))
        if progress is not None:
            progress(result)
    return result


# -- the minimizer -----------------------------------------------------------------------------
def _pruned(case: Case, outputs: Sequence[str]) -> Case:
    """Only the ops ``outputs`` need, and only the inputs and parameters those ops read."""
    needed, kept = set(outputs), []
    for op in reversed(case.ops):
        if needed & set(op.outputs):
            kept.append(op)
            needed |= set(op.inputs)
    return replace(case, inputs=tuple(s for s in case.inputs if s.name in needed),
                   params=tuple(s for s in case.params if s.name in needed), ops=tuple(reversed(kept)),
                   outputs=tuple(outputs))


def _fewer_outputs(case: Case) -> list[Case]:
    """Any one tensor an op makes as the only output (the ops after it drop out), fewest ops
    first; then all outputs but one (two outputs may be needed together)."""
    alone = sorted((_pruned(case, [name]) for op in case.ops for name in op.outputs), key=lambda c: len(c.ops))
    if len(case.outputs) < 2:
        return alone
    return alone + [_pruned(case, [o for o in case.outputs if o != dropped]) for dropped in case.outputs]


def _cut(case: Case, tensor: str, shape: tuple[int, ...], dtype: str) -> Case:
    """``tensor`` (an op's output) read from a new input instead: the ops that only fed it drop out."""
    taken = {s.name for s in case.inputs}
    name = next(f"x{i}" for i in range(len(taken) + 1) if f"x{i}" not in taken)
    ops = tuple(replace(op, inputs=tuple(name if n == tensor else n for n in op.inputs)) for op in case.ops)
    return _pruned(replace(case, inputs=case.inputs + (Source(name, shape, dtype),), ops=ops), case.outputs)


def _cuts(case: Case) -> list[Case]:
    """The graph cut at each intermediate tensor, those removing the most ops first."""
    graph = structure(case)
    read = {n for op in case.ops for n in op.inputs}
    cuts = [_cut(case, name, graph.tensors[name].shape, graph.tensors[name].dtype)
            for op in case.ops for name in op.outputs if name in read and name not in case.outputs]
    return sorted(cuts, key=lambda c: len(c.ops))


def _resized(source: Source, axis: int, size: int) -> Source:
    shape = source.shape[:axis] + (size,) + source.shape[axis + 1:]
    count = int(np.prod(shape, dtype=np.int64))
    return replace(source, shape=shape, specials=tuple(s for s in source.specials if s[0] < count))


def _shrunk(case: Case, size: int, smaller: int, where: tuple[str, int] | None = None) -> Case:
    """``size`` made ``smaller`` in the shapes of the inputs and parameters: everywhere it occurs,
    or only at ``where`` (a source's name and axis)."""

    def shrink(source: Source) -> Source:
        for axis, d in enumerate(source.shape):
            if d == size and where in (None, (source.name, axis)):
                source = _resized(source, axis, smaller)
        return source

    return replace(case, inputs=tuple(map(shrink, case.inputs)), params=tuple(map(shrink, case.params)))


def _smaller_dims(case: Case) -> list[Case]:
    """Each size of the inputs and parameters made smaller: first everywhere it occurs (a dense's
    features are in its input and its weight), then at one place; largest sizes first."""
    sources = case.inputs + case.params
    candidates = []
    for size in sorted({d for s in sources for d in s.shape if d > 1}, reverse=True):
        for smaller in sorted({1, 2, size // 2, size - 1} - {0, size}):
            candidates.append(_shrunk(case, size, smaller))
            candidates += [_shrunk(case, size, smaller, (s.name, axis))
                           for s in sources for axis, d in enumerate(s.shape) if d == size]
    return candidates


def _no_specials(case: Case) -> list[Case]:
    if not any(s.specials for s in case.inputs):
        return []
    return [replace(case, inputs=tuple(replace(s, specials=()) for s in case.inputs))]


REDUCTIONS = (_fewer_outputs, _cuts, _no_specials, _smaller_dims)


def _valid(case: Case) -> bool:
    try:
        structure(case)
    except GraphError:
        return False
    return True


def _first_failing(candidates: list[Case], fails: Callable[[Sequence[Case]], list[bool]], width: int,
                   budget: int) -> tuple[Case | None, int]:
    """The first of ``candidates`` that fails, checking ``width`` at a time and at most ``budget``;
    also how many were checked."""
    checked = 0
    while checked < min(len(candidates), budget):
        batch = candidates[checked:min(checked + width, budget)]
        checked += len(batch)
        found = next((c for c, failed in zip(batch, fails(batch)) if failed), None)
        if found is not None:
            return found, checked
    return None, checked


def minimize(case: Case, fails: Callable[[Sequence[Case]], list[bool]], budget: int = 40, width: int = 2) -> Case:
    """A smaller case that still fails, by greedy delta debugging: try the reductions in order
    (an earlier or fewer outputs, a cut, no NaN, smaller sizes), ``width`` candidates at a time (``fails`` may
    check them in parallel), take the first that fails and start over; stop when none does or
    after ``budget`` candidates were checked."""
    checked = 0
    while checked < budget:
        for reduce in REDUCTIONS:
            candidates = list(dict.fromkeys(c for c in reduce(case) if c != case and _valid(c)))
            smaller, used = _first_failing(candidates, fails, width, budget - checked)
            checked += used
            if smaller is not None:
                case = smaller
                break
        else:
            return case
    return case


def same_failure(pool: WorkerPool, failure: Failure) -> Callable[[Sequence[Case]], list[bool]]:
    """Whether each case fails like ``failure`` (same config, same signature), checked in the pool."""

    def fails(cases: Sequence[Case]) -> list[bool]:
        tasks = [Task(c, failure.config) for c in cases]
        position = {id(t): i for i, t in enumerate(tasks)}
        verdicts = [False] * len(cases)
        for task, outcome in pool.map(tasks):
            found = config_result(task, outcome).failures
            verdicts[position[id(task)]] = any(f.signature == failure.signature for f in found)
        return verdicts

    return fails


# -- repros ------------------------------------------------------------------------------------
def _value_code(value: float) -> str:
    if math.isnan(value):
        return "np.nan"
    return ("np.inf" if value > 0 else "-np.inf") if math.isinf(value) else repr(value)


def _op_code(op: Op) -> str:
    args = [repr(n) for n in op.inputs] + [f"name={_op_name(op)!r}"]
    args += [f"n_outputs={len(op.outputs)}"] if len(op.outputs) > 1 else []
    return f"b.op({op.kind!r}, " + ", ".join(args + [f"{k}={v!r}" for k, v in op.attrs.items()]) + ")"


def repro(case: Case, config: Config) -> str:
    """The case as a runnable script (from the repository root): GraphBuilder code with its
    shapes, attributes and seeded weights and inputs, then, run as a script, the compile for
    ``config``, a poisoned run and the comparison with the float64 reference (ties allowed)."""
    lines = ["import numpy as np", "", "import souffle",
             "from tests.fuzzing import mismatches, poisoned_run, reference_outputs, tie_references", "",
             f"rng = np.random.default_rng({case.seed})", f"b = souffle.GraphBuilder({case.name!r})"]
    lines += [f"b.param({s.name!r}, {draw_code(s)})" for s in case.params]
    lines += [f"b.input({s.name!r}, {s.shape!r}" + (")" if s.dtype == "float32" else f", {s.dtype!r})")
              for s in case.inputs]
    lines += [_op_code(op) for op in case.ops]
    lines += [f"graph = b.build({', '.join(repr(o) for o in case.outputs)})", "inputs = {"]
    lines += [f"    {s.name!r}: {draw_code(s)}," for s in case.inputs]
    lines.append("}")
    lines += [f"inputs[{s.name!r}].flat[{i}] = {_value_code(v)}" for s in case.inputs for i, v in s.specials]
    level = "" if config.level is None else f", opt_level={config.level}"
    lines += ["", 'if __name__ == "__main__":', f"    model = souffle.compile(graph, target={config.target!r}{level})",
              "    outputs = poisoned_run(model, inputs)",
              "    expected, ties = reference_outputs(graph, inputs), tie_references(graph, inputs)",
              "    print(mismatches(graph.outputs, outputs, expected, ties) or \"outputs match\")"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Finding:
    """The failures of one seed that look alike (same signature), on every config that showed
    them, with one minimized case and its repro."""

    failures: tuple[Failure, ...]
    case: Case
    repro: str

    @property
    def configs(self) -> list[Config]:
        """The configs that showed it (once each: several outputs may fail on one)."""
        return list(dict.fromkeys(f.config for f in self.failures))

    def describe(self) -> str:
        first = self.failures[0]
        return (f"{first.summary()}\n  on: {', '.join(map(str, self.configs))}\n"
                f"  minimal repro ({len(self.case.ops)} ops, for {first.config}; "
                f"as repro.py, run `PYTHONPATH=. python repro.py` from the repository root):\n" + _indented(self.repro))


def _indented(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.splitlines())


def minimize_failures(result: FuzzResult, pool: WorkerPool, budget: int = 40,
                      progress: Callable[[str], None] | None = None) -> list[Finding]:
    """One finding per seed and signature, its case minimized on the first config that showed it."""
    groups: dict[tuple, list[Failure]] = {}
    for failure in result.failures:
        groups.setdefault((failure.seed, failure.signature), []).append(failure)
    findings = []
    for (seed, _), failures in groups.items():
        first = failures[0]
        if progress is not None:
            progress(f"minimizing {first.summary()}")
        case = minimize(result.cases[seed], same_failure(pool, first), budget, pool.size)
        findings.append(Finding(tuple(failures), case, repro(case, first.config)))
    return findings
