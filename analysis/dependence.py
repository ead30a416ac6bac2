"""Element-level dependences of the global TE program, as isl access relations.

For every TE and every tensor it reads, the access relation maps each point of
the TE's iteration domain (spatial axes, then reduction axes) to the elements
it loads: ``{ S[i0, .., r0, ..] -> X[idx] : domain and path conditions }``.
Quasi-affine indices (floordiv/floormod by constants, strides, the padding
conditions of ``if_then_else``) are kept exactly; an index or condition isl
cannot hold (a gather through a loaded value, a product of two axes) is
over-approximated and the edge records why.

Projecting out the reduction axes gives the relation from each *output element*
to what it reads. From it every edge is classified:

- one-relies-on-one: exact and single-valued — each output element reads at
  most one element of that input; otherwise one-relies-on-many;
- the mapping type: ``one-to-one`` (each input index is one output axis plus a
  constant, axes in order: elementwise, slice, pad, concat),
  ``shuffle`` (the same, axes permuted: transpose), ``reorganize`` (any other
  injective map: reshape, strided slice), ``one-to-many`` (single-valued but an
  input element feeds several outputs: broadcast), ``many-to-many`` (an output
  element reads several input elements: reduction, or an over-approximation).

A TE is one-relies-on-one when all its inputs are.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import islpy as isl
import tvm
from tvm import te, tirx

from souffle.graph import Op
from souffle.naming import UniqueNames

ONE_TO_ONE = "one-to-one"
ONE_TO_MANY = "one-to-many"
MANY_TO_MANY = "many-to-many"
REORGANIZE = "reorganize"
SHUFFLE = "shuffle"
MAPPING_TYPES = (ONE_TO_ONE, SHUFFLE, REORGANIZE, ONE_TO_MANY, MANY_TO_MANY)

TENSOR_LOAD = "te.tensor_load"  # the op of a tensor read in a TE body: args = (tensor, *indices)
IF_THEN_ELSE = "prim.if_then_else"


class NotAffine(Exception):
    """An index or condition isl cannot represent; the message says which part and why."""


# -- PrimExpr -> isl syntax -------------------------------------------------------------------
@dataclass(frozen=True)
class _Aff:
    """A quasi-affine expression in isl syntax; ``value`` is set when it is a constant."""

    text: str
    value: int | None = None


class IslWriter:
    """Writes TE index expressions and conditions in isl syntax over named axes."""

    def __init__(self, axes: list[tuple[tirx.Var, str]]):
        self.axes = axes

    def name_of(self, var) -> str:
        for axis, name in self.axes:
            if axis.same_as(var):
                return name
        raise NotAffine(f"variable {var} is not an axis of this TE")

    def index(self, e) -> _Aff:
        """A load index; one that depends on another load is a gather, which isl cannot hold."""
        gathered = tensor_loads(e)
        if gathered:
            raise NotAffine(f"it depends on values loaded from {gathered[0].tensor.op.name} (a data-dependent gather)")
        return self.aff(e)

    def aff(self, e) -> _Aff:
        if isinstance(e, tirx.IntImm):
            return _Aff(str(int(e.value)), int(e.value))
        if isinstance(e, tirx.Var):
            return _Aff(self.name_of(e))
        if isinstance(e, tirx.Cast) and "int" in str(e.ty):
            return self.aff(e.value)
        if isinstance(e, (tirx.Add, tirx.Sub)):
            a, b = self.aff(e.a), self.aff(e.b)
            op = "+" if isinstance(e, tirx.Add) else "-"
            value = None if a.value is None or b.value is None else (a.value + b.value if op == "+" else a.value - b.value)
            return _Aff(f"({a.text} {op} {b.text})", value)
        if isinstance(e, tirx.Mul):
            a, b = self.aff(e.a), self.aff(e.b)
            if a.value is None and b.value is None:
                raise NotAffine(f"{e} multiplies two axes")
            value = None if a.value is None or b.value is None else a.value * b.value
            return _Aff(f"({a.text} * {b.text})", value)
        if isinstance(e, (tirx.FloorDiv, tirx.FloorMod)):
            a, b = self.aff(e.a), self.aff(e.b)
            if b.value is None or b.value <= 0:
                raise NotAffine(f"{e} divides by a non-constant or non-positive value")
            if isinstance(e, tirx.FloorDiv):
                return _Aff(f"floor(({a.text}) / {b.value})", None if a.value is None else a.value // b.value)
            return _Aff(f"(({a.text}) mod {b.value})", None if a.value is None else a.value % b.value)
        if isinstance(e, (tirx.Min, tirx.Max)):
            a, b = self.aff(e.a), self.aff(e.b)
            fn = "min" if isinstance(e, tirx.Min) else "max"
            if a.value is not None and b.value is not None:
                v = min(a.value, b.value) if fn == "min" else max(a.value, b.value)
                return _Aff(str(v), v)
            return _Aff(f"{fn}({a.text}, {b.text})")
        if is_call_to(e, TENSOR_LOAD):
            raise NotAffine(f"it reads a loaded value ({e.args[0].op.name}): a data-dependent gather")
        raise NotAffine(f"{type(e).__name__} {e} is not quasi-affine")

    def condition(self, e) -> str:
        if isinstance(e, tirx.IntImm):
            return "true" if int(e.value) else "false"
        if isinstance(e, tirx.And):
            return f"(({self.condition(e.a)}) and ({self.condition(e.b)}))"
        if isinstance(e, tirx.Or):
            return f"(({self.condition(e.a)}) or ({self.condition(e.b)}))"
        if isinstance(e, tirx.Not):
            return f"not ({self.condition(e.a)})"
        compare = {tirx.LT: "<", tirx.LE: "<=", tirx.GT: ">", tirx.GE: ">=", tirx.EQ: "=", tirx.NE: "!="}
        for cls, symbol in compare.items():
            if isinstance(e, cls):
                return f"{self.aff(e.a).text} {symbol} {self.aff(e.b).text}"
        raise NotAffine(f"condition {e} is not a comparison of quasi-affine indices")


def is_call_to(e, name: str) -> bool:
    """Whether ``e`` calls the TVM op ``name`` (TE bodies read tensors through ``te.tensor_load`` calls)."""
    return isinstance(e, tvm.ir.expr.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == name


def sub_expressions(expr):
    """Every sub-expression of a TIR expression, ``expr`` included."""
    stack = [expr]
    while stack:
        node = stack.pop()
        yield node
        for name in ("a", "b", "value", "condition", "true_value", "false_value"):
            child = getattr(node, name, None)
            if isinstance(child, tvm.ir.Expr):
                stack.append(child)
        for name in ("args", "indices"):
            children = getattr(node, name, None)
            if children is not None:
                stack.extend(c for c in children if isinstance(c, tvm.ir.Expr))


def mentions(expr, var) -> bool:
    """Whether the TIR expression ``expr`` reads the variable ``var``."""
    return any(node.same_as(var) for node in sub_expressions(expr))


# -- the loads of a TE body -------------------------------------------------------------------
@dataclass(frozen=True)
class TensorLoad:
    """One load of a tensor in a TE body: its index expressions and the guards on its path."""

    tensor: te.Tensor
    indices: tuple
    conditions: tuple  # the if_then_else / select / reduce conditions guarding this load


def tensor_loads(body) -> list[TensorLoad]:
    """Every tensor load of a TE body with the conditions on its path, in program order.

    A condition that tests loaded values only (``isnan(x[i])``, ``x[i] < 0``) is no guard: over
    all inputs either branch may run, so the elements both branches read, unguarded, are exactly
    those the TE may read. A condition on the axes (padding's bounds) restricts them.
    """
    found: list[TensorLoad] = []

    def walk(e, conds: tuple):
        if isinstance(e, (int, float, str)) or e is None:
            return
        if is_call_to(e, TENSOR_LOAD):
            found.append(TensorLoad(e.args[0], tuple(e.args[1:]), conds))
            for index in e.args[1:]:
                walk(index, conds)
            return
        if is_call_to(e, IF_THEN_ELSE) or isinstance(e, tirx.Select):
            cond, then, other = (e.args if not isinstance(e, tirx.Select) else (e.condition, e.true_value, e.false_value))
            walk(cond, conds)
            on_values = _tests_values_only(cond)
            walk(then, conds if on_values else conds + (cond,))
            walk(other, conds if on_values else conds + (tirx.Not(cond),))
            return
        if isinstance(e, tirx.Reduce):
            guard = conds if _is_true(e.condition) else conds + (e.condition,)
            for source in e.source:
                walk(source, guard)
            return
        if isinstance(e, tvm.ir.expr.Call):
            for arg in e.args:
                walk(arg, conds)
            return
        for name in ("a", "b", "value"):
            child = getattr(e, name, None)
            if child is not None and not isinstance(child, (int, float)):
                walk(child, conds)

    walk(body, ())
    return found


def _tests_values_only(cond) -> bool:
    """Whether ``cond`` reads tensor elements and uses the axes only in those loads' indices."""

    def axis_free(e) -> bool:
        if is_call_to(e, TENSOR_LOAD):
            return True
        if isinstance(e, tirx.Var):
            return False
        if isinstance(e, tvm.ir.expr.Call):
            return all(axis_free(arg) for arg in e.args)
        children = (getattr(e, name, None) for name in ("a", "b", "value", "condition", "true_value", "false_value"))
        return all(axis_free(child) for child in children if child is not None and not isinstance(child, (int, float)))

    return bool(tensor_loads(cond)) and axis_free(cond)


def _is_true(e) -> bool:
    return isinstance(e, tirx.IntImm) and bool(e.value)


# -- relations --------------------------------------------------------------------------------
def isl_name(name: str) -> str:
    """A TE or tensor name as a valid isl tuple name."""
    cleaned = re.sub(r"\W", "_", name)
    return cleaned if cleaned[:1].isalpha() else "t_" + cleaned


def constant(e) -> int:
    """An extent or bound that TE left as an expression of constants (e.g. pooling's), as an int."""
    if isinstance(e, int):
        return e
    folded = _ANALYZER.simplify(e)
    if not isinstance(folded, tirx.IntImm):
        raise NotAffine(f"{e} is not a constant")
    return int(folded.value)


_ANALYZER = tvm.sym.Analyzer()


def _bounds(axes) -> tuple[list[str], list[str]]:
    """``min <= axis < min + extent`` per axis, and why any bound had to be widened.

    A reduction's bounds may be affine in the spatial axes, which isl holds exactly; any other
    bound (adaptive pooling's ceil-division windows) is widened to its largest value.
    """
    writer = IslWriter([(ax.var, name) for ax, name in axes])
    analyzer = tvm.sym.Analyzer()
    for ax, _ in axes:
        analyzer.bind(ax.var, ax.dom)
    out, reasons = [], []
    for ax, name in axes:
        low, extent = analyzer.simplify(ax.dom.min), analyzer.simplify(ax.dom.extent)
        try:
            out.append(f"{writer.aff(low).text} <= {name} < {writer.aff(low).text} + {writer.aff(extent).text}")
        except NotAffine as why:
            lo, hi = analyzer.const_int_bound(low).min_value, analyzer.const_int_bound(low + extent).max_value
            out.append(f"{lo} <= {name} < {hi}")
            reasons.append(f"the range of axis {ax.var.name} is widened to [{lo}, {hi}): {why}")
    return out, reasons


def stage_axes(stage: te.Tensor) -> list[tuple[tirx.IterVar, str]]:
    """The TE's iteration axes with their isl names: spatial ``i0..``, then reduction ``r0..``."""
    op = stage.op
    spatial = [(ax, f"i{k}") for k, ax in enumerate(op.axis)]
    return spatial + [(ax, f"r{k}") for k, ax in enumerate(op.reduce_axis)]


def iteration_domain(stage: te.Tensor) -> isl.Set:
    """``{ S[i.., r..] }``: every point the TE computes, reductions included."""
    axes = stage_axes(stage)
    names = ", ".join(n for _, n in axes)
    return isl.Set(f"{{ {isl_name(stage.op.name)}[{names}] : {' and '.join(_bounds(axes)[0]) or 'true'} }}")


@dataclass(frozen=True)
class AccessRelation:
    """What one TE reads of one tensor, as an isl map, and whether the map is exact."""

    stage: te.Tensor
    tensor: te.Tensor
    relation: isl.Map  # { S[spatial..., reduce...] -> X[...] }
    n_spatial: int
    exact: bool
    reasons: tuple[str, ...]  # why the relation is over-approximated, empty when exact
    sites: int  # load sites of the tensor in the body
    reduce_axes_used: tuple[str, ...]  # names of reduction axes some index of the tensor uses

    @property
    def spatial(self) -> isl.Map:
        """Output element -> the elements it reads: the reduction axes projected out."""
        n_reduce = self.relation.dim(isl.dim_type.in_) - self.n_spatial
        projected = self.relation.project_out(isl.dim_type.in_, self.n_spatial, n_reduce)
        return projected.set_tuple_name(isl.dim_type.in_, self.relation.get_tuple_name(isl.dim_type.in_))


def access_relations(stage: te.Tensor) -> dict[te.Operation, AccessRelation]:
    """For each tensor the TE reads (keyed by its operation): the union of its load sites' relations."""
    axes = stage_axes(stage)
    writer = IslWriter([(ax.var, name) for ax, name in axes])
    domain_names = ", ".join(n for _, n in axes)
    domain_bounds, widened = _bounds(axes)
    sname = isl_name(stage.op.name)
    by_tensor: dict[te.Operation, list] = {}
    for body in stage.op.body:
        for load in tensor_loads(body):
            by_tensor.setdefault(load.tensor.op, []).append(load)
    result = {}
    order = {t.op: k for k, t in enumerate(stage.op.input_tensors)}
    for op, loads in sorted(by_tensor.items(), key=lambda item: order.get(item[0], len(order))):
        tensor = loads[0].tensor
        tname = isl_name(tensor.op.name)
        reasons: list[str] = list(widened)
        used: set[str] = set()
        union = None
        for load in loads:
            outs = [f"o{k}" for k in range(len(load.indices))]
            constraints = list(domain_bounds)
            constraints += [f"0 <= {o} < {constant(d)}" for o, d in zip(outs, tensor.shape)]
            for k, index in enumerate(load.indices):
                try:
                    text = writer.index(index).text
                except NotAffine as why:
                    reasons.append(f"index {k} of {tensor.op.name} is over-approximated by its whole extent: {why}")
                    continue
                constraints.append(f"{outs[k]} = {text}")
                used.update(n for _, n in axes if n.startswith("r") and re.search(rf"\b{n}\b", text))
            for cond in load.conditions:
                try:
                    constraints.append(writer.condition(cond))
                except NotAffine as why:
                    reasons.append(f"a guard of {tensor.op.name} is dropped (over-approximation): {why}")
            site = isl.Map(f"{{ {sname}[{domain_names}] -> {tname}[{', '.join(outs)}] : {' and '.join(constraints)} }}")
            union = site if union is None else union.union(site)
        result[op] = AccessRelation(stage, tensor, union.coalesce(), len(stage.op.axis), not reasons,
                                    tuple(dict.fromkeys(reasons)), len(loads), tuple(sorted(used)))
    return result


@dataclass(frozen=True)
class ElementDependence:
    """Which elements of ``source`` each element of ``output`` depends on, through any TEs between."""

    relation: isl.Map  # { output[...] -> source[...] }
    exact: bool  # False when an access on some path was over-approximated


def element_dependences(output: te.Tensor, source: te.Tensor) -> ElementDependence:
    """The transitive element-level dependence of ``output`` on ``source``.

    The spatial access relations of every path from ``output`` down to ``source`` are
    composed (reductions contribute every element they fold) and united, so this is the
    set of source elements whose value can change each output element (empty when no path
    leads from ``output`` to ``source``).
    """
    memo: dict = {}

    def down(t: te.Tensor) -> tuple[isl.Map | None, bool]:
        if t.op in memo:
            return memo[t.op]
        union, exact = None, True
        for op, access in access_relations(t).items():
            step = access.spatial.set_tuple_name(isl.dim_type.in_, "out").set_tuple_name(isl.dim_type.out, "mid")
            if op.same_as(source.op):
                reached, reached_exact = step.set_tuple_name(isl.dim_type.out, "src"), True
            elif isinstance(op, te.ComputeOp):
                below, reached_exact = down(access.tensor)
                if below is None:
                    continue
                reached = step.apply_range(below.set_tuple_name(isl.dim_type.in_, "mid"))
            else:
                continue
            union = reached if union is None else union.union(reached)
            exact = exact and reached_exact and access.exact
        memo[t.op] = (None if union is None else union.coalesce(), exact)
        return memo[t.op]

    relation, exact = down(output)
    if relation is None:  # no path: the empty relation between the two index spaces
        outs = ", ".join(f"i{d}" for d in range(len(output.shape)))
        ins = ", ".join(f"o{d}" for d in range(len(source.shape)))
        relation = isl.Map(f"{{ out[{outs}] -> src[{ins}] : false }}")
    return ElementDependence(relation.set_tuple_name(isl.dim_type.in_, isl_name(output.op.name))
                             .set_tuple_name(isl.dim_type.out, isl_name(source.op.name)), exact)


# -- counting ---------------------------------------------------------------------------------
def count_points(s: isl.Set) -> int:
    """The number of integer points of a bounded set.

    A box (or a product of one-dimensional sets, like a strided slice) is counted
    per dimension; only other shapes are enumerated.
    """
    s = s.coalesce()
    if s.is_empty():
        return 0
    n = s.dim(isl.dim_type.set)
    if n == 0:
        return 1
    if s.is_box():
        total = 1
        for d in range(n):
            total *= s.dim_max_val(d).to_python() - s.dim_min_val(d).to_python() + 1
        return total
    factors = [s.project_out(isl.dim_type.set, d + 1, n - d - 1).project_out(isl.dim_type.set, 0, d) for d in range(n)]
    product = factors[0]
    for f in factors[1:]:
        product = product.flat_product(f)
    if product.reset_tuple_id().is_equal(s.reset_tuple_id()):
        total = 1
        for f in factors:
            total *= _count(f)
        return total
    return _count(s)


class CountGaveUp(Exception):
    """isl stopped counting a set (its operations bound, ``count_points_at_most``)."""


def _count(s: isl.Set) -> int:
    text = s.count_val().to_str()
    if text is None or text == "NaN":  # isl past its operations bound: NaN, or no value at all
        raise CountGaveUp("isl gave up counting a set")
    return int(text)


COUNT_OPERATIONS = 200_000  # isl's work on one count (a few seconds), past which a bound is taken


@contextmanager
def isl_operations_at_most(operations: int):
    """isl's default context stops after ``operations`` operations inside the block (a call past
    it raises, or returns no value); lifted afterwards."""
    ctx = isl.DEFAULT_CONTEXT
    ctx.reset_operations()
    ctx.set_max_operations(operations)
    try:
        yield
    finally:
        ctx.set_max_operations(0)


def isl_gave_up(error: isl.Error) -> bool:
    """Whether ``error`` is isl stopping at its operations bound (``isl_operations_at_most``)."""
    return "maximal number of operations exceeded" in str(error)


def count_points_at_most(s: isl.Set, operations: int = COUNT_OPERATIONS) -> tuple[int, bool]:
    """(``count_points(s)``, True), or where isl does not count ``s`` within ``operations``
    operations, (the points of its bounding box, False): an upper bound. isl's general counting
    ran for many minutes on paper Swin's read relations at float16."""
    try:
        with isl_operations_at_most(operations):
            return count_points(s), True
    except CountGaveUp:
        pass
    except isl.Error as error:
        if not isl_gave_up(error):
            raise
    total = 1
    for d in range(s.dim(isl.dim_type.set)):
        total *= s.dim_max_val(d).to_python() - s.dim_min_val(d).to_python() + 1
    return total, False


def representative_point(s: isl.Set) -> isl.Set:
    """One point of ``s``, near the middle of its bounding box (so halo effects do not show)."""
    n = s.dim(isl.dim_type.set)
    middle = s
    for d in range(n):
        mid = (s.dim_min_val(d).to_python() + s.dim_max_val(d).to_python()) // 2
        middle = middle.fix_val(isl.dim_type.set, d, mid)
    chosen = middle if not middle.is_empty() else s
    return chosen.lexmin() if not chosen.is_singleton() else chosen


# -- classification ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Edge:
    """One (TE, input) pair: the access relation and its classification."""

    access: AccessRelation
    name: str  # the input as a user knows it: graph tensor, weight, or "op.te" for an intermediate
    producer: te.Tensor | None  # the TE that computes the input (for a carry: in the previous
    # iteration), None for graph inputs, weights and loop slices/invariants
    mapping: str
    one_relies_on_one: bool
    fan_in: int  # elements of the input one (representative) output element reads
    elements_read: int  # distinct elements of the input the whole TE reads
    reason: str
    role: str  # "intermediate", "input", "weight", or in a loop body "carry", "slice", "invariant"

    @property
    def tensor(self) -> te.Tensor:
        return self.access.tensor


def classify(access: AccessRelation) -> tuple[str, bool, int, str]:
    """(mapping type, one-relies-on-one, fan-in, reason) of one access relation."""
    spatial = access.spatial
    name = access.tensor.op.name
    if spatial.is_empty():
        return ONE_TO_ONE, True, 0, f"reads nothing of {name}"
    point = representative_point(spatial.domain())
    fan_in = count_points(spatial.intersect_domain(point).range())
    if not access.exact:
        return MANY_TO_MANY, False, fan_in, "; ".join(access.reasons)
    if not spatial.is_single_valued():
        over = f" over reduction axes {', '.join(access.reduce_axes_used)}" if access.reduce_axes_used else ""
        return MANY_TO_MANY, False, fan_in, f"each output element reads {fan_in} elements of {name}{over}"
    if not spatial.is_injective():
        return ONE_TO_MANY, True, fan_in, f"each element of {name} is read by several output elements (broadcast)"
    order = _axis_order(spatial)
    if order is None:
        return REORGANIZE, True, fan_in, f"reads {name} through a quasi-affine re-indexing"
    if order == sorted(order):
        return ONE_TO_ONE, True, fan_in, f"reads {name} element for element"
    return SHUFFLE, True, fan_in, f"reads {name} with its axes permuted"


def _axis_order(spatial: isl.Map) -> list[int] | None:
    """For a map whose every index is ``axis + c`` or a constant, the axes in index order; else None."""
    pieces = []
    spatial.gist_domain(spatial.domain()).as_pw_multi_aff().foreach_piece(lambda s, ma: pieces.append(ma))
    orders = set()
    for ma in pieces:
        order = []
        for k in range(ma.dim(isl.dim_type.out)):
            aff = ma.get_aff(k)
            if aff.dim(isl.dim_type.div) or not aff.get_denominator_val().is_one():
                return None
            coefficients = [aff.get_coefficient_val(isl.dim_type.in_, d).to_python() for d in range(aff.dim(isl.dim_type.in_))]
            used = [d for d, c in enumerate(coefficients) if c != 0]
            if not used:
                continue
            if len(used) != 1 or coefficients[used[0]] != 1:
                return None
            order.append(used[0])
        orders.add(tuple(order))
    return list(orders.pop()) if len(orders) == 1 else None


# -- the whole program ------------------------------------------------------------------------
@dataclass
class StageDependence:
    """One TE of the program with its classified inputs."""

    stage: te.Tensor
    name: str  # unique in the program: loop path, then the graph tensor or "op.te" name
    op: Op | None
    loops: tuple[tuple[str, int], ...]  # enclosing loops (name, trip count), outermost first
    edges: list[Edge] = field(default_factory=list)

    @property
    def one_relies_on_one(self) -> bool:
        return all(e.one_relies_on_one for e in self.edges)

    @property
    def trips(self) -> int:
        """How many times the TE runs per inference."""
        total = 1
        for _, n in self.loops:
            total *= n
        return total

    @property
    def reason(self) -> str:
        many = [e for e in self.edges if not e.one_relies_on_one]
        return "; ".join(e.reason for e in many) if many else "every input is read one element per output element"


@dataclass
class Dependences:
    """Every TE of the global program, in execution order, with its classified edges."""

    stages: list[StageDependence]

    def __getitem__(self, key: str | te.Tensor) -> StageDependence:
        """A TE's entry, by its name in the program or by the TE itself."""
        for s in self.stages:
            if s.name == key if isinstance(key, str) else s.stage.op.same_as(key.op):
                return s
        raise KeyError(key if isinstance(key, str) else key.op.name)

    def __str__(self):
        lines = []
        for s in self.stages:
            kind = "one-relies-on-one" if s.one_relies_on_one else "one-relies-on-many"
            inputs = ", ".join(f"{e.name}:{e.mapping}" for e in s.edges)
            lines.append(f"{s.name} [{kind}] <- {inputs}")
        return "\n".join(lines)


def dependences(program) -> Dependences:
    """Classify every (TE, input) edge of a lowered program, loop bodies included once."""
    stages: list[StageDependence] = []
    _collect(program, (), "", stages)
    return Dependences(stages)


def _collect(program, loops: tuple, prefix: str, out: list[StageDependence], scan=None):
    from souffle.lower import LoopRegion

    roles = _placeholder_roles(program.graph, scan)
    computed = {n: t for r in program.regions if not isinstance(r, LoopRegion) for n, t in r.tensors.items()
                if isinstance(t.op, te.ComputeOp)}
    carried_from = {c[0]: computed.get(c[1]) for c in (scan.carry if scan is not None else ())}
    names = _TENames()
    for region in program.regions:
        if isinstance(region, LoopRegion):
            _collect(region.body, loops + ((region.name, region.scan.length),), f"{prefix}{region.name}/", out,
                     region.scan)
            continue
        for stage in region.stages():
            entry = StageDependence(stage, prefix + _name(stage, region, names), region.op_of.get(stage.op), loops)
            for tensor_op, access in access_relations(stage).items():
                mapping, one, fan_in, reason = classify(access)
                producer = program.links.get(tensor_op)
                if producer is None and isinstance(tensor_op, te.ComputeOp):
                    producer = access.tensor
                name = _name(access.tensor, region, names)
                role = "intermediate" if producer is not None else roles.get(name, "input")
                if role == "carry":
                    producer = carried_from[name]  # written by the previous iteration
                entry.edges.append(Edge(access, prefix + name, producer, mapping, one, fan_in,
                                        count_points(access.spatial.range()), reason, role))
            out.append(entry)


def _placeholder_roles(graph, scan) -> dict[str, str]:
    """What each graph-level input of a (body) graph is: a weight, an input, or a loop's carry/slice/invariant."""
    roles = {name: "weight" for name in graph.params}
    roles.update({spec.name: "input" for spec in graph.inputs})
    if scan is not None:
        roles.update({c[0]: "carry" for c in scan.carry})
        roles.update({x[0]: "slice" for x in scan.xs})
        roles.update({v[0]: "invariant" for v in scan.invariants})
    return roles


class _TENames:
    """Each TE's name in one (loop body) program: its graph tensor's, or a unique one."""

    def __init__(self):
        self.of: dict = {}  # TE op -> name
        self.unique = UniqueNames()


def _name(tensor: te.Tensor, region, names: _TENames) -> str:
    """The tensor's name in its program: the graph tensor's, or "op.te" for a TE inside an op's
    lowering, numbered ("op.te:2") when the op made several of that name. ``names`` remembers."""
    if tensor.op not in names.of:
        graph_name = next((n for n, t in region.tensors.items() if t.op.same_as(tensor.op)), None)
        if graph_name is not None:
            names.unique.reserve(graph_name)
            names.of[tensor.op] = graph_name
        else:
            op = region.op_of.get(tensor.op)
            names.of[tensor.op] = names.unique(f"{op.outputs[0]}.{tensor.op.name}" if op is not None else tensor.op.name)
    return names.of[tensor.op]
