"""Per-TE cost figures for the roofline model: FLOPs, bytes written, intensity, bound.

Everything here is a pure function of one TE (and the device); the bytes a TE reads depend on
which of its inputs stay on chip, which the caller decides, so they are passed in.

FLOP counting rule. A TE's FLOPs are (points of its iteration domain: the product of its spatial
and reduce axis extents) x (floating-point operations per point). Per point, each output's body is
walked as a tree and each of these nodes whose result is a float counts 1:

- a binary arithmetic node (+ - * / % floordiv floormod min max);
- a call of an intrinsic (exp, erf, tanh, sigmoid, sqrt, rsqrt, log, pow, ...).

Free (0, but their float operands are walked): select, if_then_else, casts, let. Not walked at
all: tensor loads' indices (address arithmetic is not FLOPs), comparisons and logical operators
and whatever sits under them (predicates are not FLOPs), integer arithmetic of any kind. A
reduction costs its sources plus its combiner's results (``x + y`` is 1, ``max(x, y)`` is 1) per
point; its ``init`` is once per output element and is not counted. The tree is counted as
written, a subexpression used twice costs twice. In a multi-output TE (a tuple reduction such as
argmax) the outputs share one reduction: its sources and all its combiner results are counted
once for the TE, not once per output. So a matmul TE is 2*M*N*K, a convolution 2*N*K*(C/groups)*
R*S*P*Q and a relu M*N.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import tvm
from tvm import te, tirx

from analysis.dependence import IF_THEN_ELSE, TENSOR_LOAD, constant, tensor_loads
from analysis.device import DeviceModel

_ARITHMETIC = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Mod, tirx.FloorDiv, tirx.FloorMod, tirx.Min, tirx.Max)
_PREDICATES = (tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.And, tirx.Or, tirx.Not)
_LEAVES = (tirx.Var, tirx.IntImm, tirx.FloatImm, tvm.ir.StringImm, tirx.Ramp)
_LIKELY = "prim.likely"


def dtype_bytes(dtype) -> int:
    """Bytes of one element of ``dtype`` (a string or TVM dtype); sub-byte types round up."""
    dt = tvm.DataType(str(dtype))
    return (dt.bits * dt.lanes + 7) // 8


def tensor_bytes(tensor: te.Tensor) -> int:
    """Bytes of one whole tensor."""
    return math.prod(constant(d) for d in tensor.shape) * dtype_bytes(tensor.dtype)


def bytes_written(stage: te.Tensor) -> int:
    """Bytes of all of the TE's outputs, each written once."""
    op = stage.op
    return sum(tensor_bytes(op.output(i)) for i in range(op.num_outputs))


def count_flops(stage: te.Tensor, one_branch: bool = False) -> int:
    """Floating-point operations of the whole TE (see the module docstring for the rule); with
    ``one_branch``, those a GPU executes: of each ``if_then_else`` only its costlier branch, as
    CUDA's ``?:`` evaluates one (a ``select`` evaluates both). A roll's four branches, the
    arithmetic it reads carried into each (paper Swin's rolled LayerNorms), cost one's."""
    op = stage.op
    per_point = 0
    counted_reductions: list[tirx.Reduce] = []
    for body in op.body:
        if isinstance(body, tirx.Reduce):
            if any(_same_reduction(body, seen) for seen in counted_reductions):
                continue
            counted_reductions.append(body)
        per_point += _flops_per_point(body, one_branch)
    return _domain_points(op) * per_point


@dataclass(frozen=True)
class StageCost:
    """A TE's roofline figures on one device."""

    flops: int
    bytes_read: int
    bytes_written: int
    intensity: float  # FLOP per byte moved; 0.0 when no bytes move
    bound: str  # "compute" or "memory"
    time_s: float  # roofline estimate: max(compute time, memory time)


def same_elements_axis(reduction: te.Tensor, max_extent: int) -> int | None:
    """The extent of ``reduction``'s last output axis where it is at most ``max_extent`` and
    indexes none of its loads, else None: its outputs along that axis read the same elements (a
    row's moments, the sums of d and of d^2, side by side)."""
    if not reduction.op.reduce_axis or not reduction.op.axis:
        return None
    last = reduction.op.axis[-1]
    if int(last.dom.extent) > max_extent:
        return None
    if any(indexed_by_last_axis(load, reduction) for load in tensor_loads(reduction.op.body[0])):
        return None
    return int(last.dom.extent)


def indexed_by_last_axis(load, reduction: te.Tensor) -> bool:
    """Whether ``load`` (one of ``reduction``'s ``tensor_loads``) reads another element at each
    point of ``reduction``'s last output axis: its indices use that axis."""
    last = reduction.op.axis[-1].var
    return any(v.same_as(last) for index in load.indices for v in tirx.analysis.undefined_vars(index))


def shares_loads_along_rows(reduction: te.Tensor) -> bool:
    """Whether consecutive outputs along ``reduction``'s last axis (longer than 1) read some of
    the same elements and not all: a GEMV's rows read one vector and each its own row of the
    matrix, so rows reduced together load the vector once for all of them."""
    if not reduction.op.reduce_axis or not reduction.op.axis or int(reduction.op.axis[-1].dom.extent) < 2:
        return False
    indexed = [indexed_by_last_axis(load, reduction) for load in tensor_loads(reduction.op.body[0])]
    return any(indexed) and not all(indexed)


def is_gemm(reduction: te.Tensor | None, batched: bool = False) -> bool:
    """A sum of products whose two factors are each reused along an output axis the other
    varies with (an axis longer than 1): dense, matmul, convolution, a grouped convolution whose
    group is an axis of its own (``souffle.ops.nn``). Not a GEMV (its vector factor is reused,
    its matrix is not), a variance (both factors vary alike), nor a depthwise convolution (its
    input varies with the output channel as its weight does). ``batched``: and both factors vary
    with an output axis too (a batched matmul's batch, a grouped convolution's group)."""
    if reduction is None:
        return False
    source = reduction.op.body[0].source[0]
    while isinstance(source, tirx.Cast):
        source = source.value
    if not isinstance(source, tirx.Mul):
        return False
    axes = [ax.var for ax in reduction.op.axis if int(ax.dom.extent) > 1]

    def varies_with(factor) -> set[int]:
        used = [v for load in tensor_loads(factor) for i in load.indices for v in tirx.analysis.undefined_vars(i)]
        return {k for k, var in enumerate(axes) if any(var.same_as(v) for v in used)}

    left, right = varies_with(source.a), varies_with(source.b)
    return bool(left - right) and bool(right - left) and (not batched or bool(left & right))


def stage_cost(stage: te.Tensor, bytes_read: int, device: DeviceModel) -> StageCost:
    """Roofline cost of ``stage`` on ``device``, reading ``bytes_read`` bytes from device memory.

    The peak is that of the TE's (first) output dtype; a TE with no FLOPs is memory-bound
    whatever its dtype, so integer TEs (indices, shapes) need no integer peak.
    """
    flops = count_flops(stage)
    written = bytes_written(stage)
    moved = bytes_read + written
    intensity = flops / moved if moved else 0.0
    memory_time = moved / device.mem_bandwidth
    if flops == 0:
        return StageCost(flops, bytes_read, written, intensity, "memory", memory_time)
    dtype = stage.dtype
    bound = "compute" if intensity >= device.ridge_point(dtype) else "memory"
    return StageCost(flops, bytes_read, written, intensity, bound, max(flops / device.peak(dtype), memory_time))


def _domain_points(op: te.ComputeOp) -> int:
    """Points of the TE's iteration domain, spatial x reduce.

    A reduce extent that varies with the output point (adaptive pooling's unequal windows) is
    evaluated at each value of the spatial axes it depends on and summed, so the count stays exact.
    """
    spatial = [int(ax.dom.extent) for ax in op.axis]
    analyzer = tvm.sym.Analyzer()
    for ax in op.axis:
        analyzer.bind(ax.var, ax.dom)
    extents = [analyzer.simplify(r.dom.extent) for r in op.reduce_axis]
    fixed = math.prod(int(e) for e in extents if isinstance(e, tirx.IntImm))
    varying = [e for e in extents if not isinstance(e, tirx.IntImm)]
    if not varying:
        return math.prod(spatial) * fixed
    used = [v for e in varying for v in tirx.analysis.undefined_vars(e)]
    dependent = [i for i, ax in enumerate(op.axis) if any(ax.var.same_as(v) for v in used)]
    others = math.prod(n for i, n in enumerate(spatial) if i not in dependent)
    varying_points = 0
    for point in itertools.product(*(range(spatial[i]) for i in dependent)):
        at_point = tvm.sym.Analyzer()
        for i, value in zip(dependent, point):
            var = op.axis[i].var
            at_point.bind(var, tirx.const(value, var.ty.dtype))
        varying_points += math.prod(int(at_point.simplify(e)) for e in varying)
    return others * fixed * varying_points


def _same_reduction(a: tirx.Reduce, b: tirx.Reduce) -> bool:
    """Whether two bodies are outputs of one tuple reduction (same combiner, same sources)."""
    return (a.combiner.same_as(b.combiner) and len(a.source) == len(b.source)
            and all(x.same_as(y) for x, y in zip(a.source, b.source)))


def _is_float(expr) -> bool:
    return expr.ty.dtype.is_float


def _flops_per_point(expr, one_branch: bool = False) -> int:
    """Float operations one evaluation of ``expr`` performs (``count_flops``'s ``one_branch``)."""
    def walk(e) -> int:
        return _flops_per_point(e, one_branch)

    if isinstance(expr, _ARITHMETIC):
        return _is_float(expr) + walk(expr.a) + walk(expr.b)
    if isinstance(expr, tvm.ir.Call):
        name = expr.op.name if isinstance(expr.op, tvm.ir.Op) else None
        if name in (TENSOR_LOAD, _LIKELY):
            return 0
        if name == IF_THEN_ELSE:
            branches = [walk(expr.args[1]), walk(expr.args[2])]
            return max(branches) if one_branch else sum(branches)
        own = 1 if name is not None and _is_float(expr) else 0
        return own + sum(walk(arg) for arg in expr.args)
    if isinstance(expr, tirx.Reduce):
        return sum(walk(e) for e in expr.source) + sum(walk(e) for e in expr.combiner.result)
    if isinstance(expr, tirx.Select):
        return walk(expr.true_value) + walk(expr.false_value)
    if isinstance(expr, tirx.Cast):
        return walk(expr.value)
    if isinstance(expr, tirx.Let):
        return walk(expr.value) + walk(expr.body)
    if isinstance(expr, tirx.Broadcast):
        return walk(expr.value)
    if isinstance(expr, _PREDICATES + _LEAVES):
        return 0
    raise TypeError(f"cannot count the FLOPs of a {type(expr).__name__} node: {expr}")
