"""Compose the index maps of a chain of data-movement TEs into one TVM index expression.

A chain such as reshape -> transpose -> slice only moves elements: every TE of it
costs a kernel and a buffer but computes nothing. Each step's access relation
(``analysis.dependence``) is an exact, single-valued isl map from an output
element to the one element it reads, so the chain composes into one map from
the chain's last tensor (the *target*) to its first (the *source*). Written back
as TVM index expressions, that map lets a consumer read the source directly and
the chain disappears.

isl -> TVM goes through sympy: each piece of the map's ``pw_multi_aff`` (its lexicographic
minimum, which for a single-valued map is the map itself; ``as_pw_multi_aff`` ran for
minutes on paper Swin's window partition, ``lexmin`` takes a millisecond) is walked
structurally (coefficients, constant, floor divisions) into a sympy expression,
every ``m*a - m*d*floor(a/d)`` is folded into ``m*Mod(a, d)``, the result becomes
``floordiv`` / ``floormod`` arithmetic and ``tvm.sym.Analyzer`` simplifies it
knowing each target index ranges over its axis. Several pieces (a concat in the
chain) become nested ``Select``s on the pieces' domains; where no piece is
defined (a padding halo) the target element has no source element, which
``ComposedMap.domain`` / ``ComposedMap.condition`` say.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import islpy as isl
import sympy
import tvm
from tvm import te, tirx

from analysis.dependence import (
    IF_THEN_ELSE,
    TENSOR_LOAD,
    NotAffine,
    access_relations,
    classify,
    constant,
    is_call_to,
    isl_gave_up,
    isl_name,
    isl_operations_at_most,
)
from souffle.errors import SouffleError

_ANALYZER = tvm.sym.Analyzer()  # binds nothing: what it proves holds for any index values


class NotComposable(SouffleError, ValueError):
    """A chain (or a rebuild) the composition cannot express; the message names the TE and why."""


ISL_OPERATIONS = 2_000_000  # isl's work on one chain (about 30 s), past which it is left as it is


@contextmanager
def _bounded_isl(what: str):
    """isl gives up on ``what`` after ``ISL_OPERATIONS`` operations, as a NotComposable."""
    try:
        with isl_operations_at_most(ISL_OPERATIONS):
            yield
    except isl.Error as error:
        if not isl_gave_up(error):
            raise
        raise NotComposable(f"{what}: isl gave up after {ISL_OPERATIONS:,} operations") from None


# -- the composed map -------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ComposedMap:
    """Where each element of ``target`` (the chain's last tensor) comes from in ``source`` (its first).

    ``source_indices`` and ``defined`` are expressions over ``axes``, fresh variables
    standing for the target's indices and named like its axes; ``indices``, ``load`` and
    ``condition`` put the caller's index expressions in their place. Simplification
    assumes each target index lies in the target's shape, which any valid load's do.
    """

    source: te.Tensor
    target: te.Tensor
    map: isl.Map  # { Target[...] -> Source[...] }, single-valued
    axes: tuple[tirx.Var, ...]
    source_indices: tuple[tirx.Expr, ...]
    defined: tirx.Expr  # the domain as a condition over ``axes``

    @property
    def domain(self) -> isl.Set:
        """The target elements that hold a source element (all of them unless the chain pads)."""
        return self.map.domain()

    @property
    def total(self) -> bool:
        """Whether every target element holds a source element."""
        return self.domain.is_equal(_box(self.target, self.map.get_tuple_name(isl.dim_type.in_)))

    @property
    def pieces(self) -> int:
        """How many affine pieces the map has (several after a concat)."""
        return self.map.as_pw_multi_aff().n_piece()

    def indices(self, target_indices: Sequence) -> list[tirx.Expr]:
        """The source index for each source dimension, as expressions of ``target_indices``."""
        rewrite = Rewriter(self._bind(target_indices), f"indices of {self.source.op.name}")
        return [_ANALYZER.simplify(rewrite(e)) for e in self.source_indices]

    def load(self, target_indices: Sequence) -> tirx.Expr:
        """The source element the target element at ``target_indices`` holds."""
        return self.source(*self.indices(target_indices))

    def condition(self, target_indices: Sequence) -> tirx.Expr:
        """True where ``target_indices`` lie in ``domain``: elsewhere there is no source element."""
        return _ANALYZER.simplify(Rewriter(self._bind(target_indices), "condition")(self.defined))

    def _bind(self, target_indices: Sequence) -> dict:
        if len(target_indices) != len(self.axes):
            raise NotComposable(f"{self.target.op.name} has {len(self.axes)} axes, "
                                f"but {len(target_indices)} indices were given")
        variables = {}
        for var, index in zip(self.axes, target_indices):
            dtype = str(var.ty)
            if not tvm.ir.is_prim_expr(index):
                index = tirx.const(int(index), dtype)
            elif str(index.ty) != dtype:
                index = tirx.Cast(dtype, index)
            variables[var] = index
        return variables

    def __str__(self):
        axes = ", ".join(v.name for v in self.axes)
        indices = ", ".join(str(e) for e in self.source_indices)
        lines = [f"{self.target.op.name}[{axes}] = {self.source.op.name}[{indices}]", f"  isl: {self.map}"]
        if not self.total:
            lines.append(f"  defined where: {self.defined}")
        return "\n".join(lines)


def compose(chain: Sequence[te.Tensor]) -> ComposedMap:
    """Compose the element maps of ``chain`` (``chain[k+1]`` reads ``chain[k]``) into one map.

    Every step must be exact and one-relies-on-one (each output element reads at most one
    element of the previous tensor); otherwise ``NotComposable`` names the step and why.
    """
    chain = _check_chain(chain)
    steps = []
    for k in range(len(chain) - 1):
        producer, consumer = chain[k], chain[k + 1]
        where = f"step {k + 1} ({consumer.op.name} reading {producer.op.name})"
        if not isinstance(consumer.op, te.ComputeOp):
            raise NotComposable(f"{where}: {consumer.op.name} is not a compute TE, it reads nothing")
        try:
            access = access_relations(consumer).get(producer.op)
        except NotAffine as why:
            raise NotComposable(f"{where}: {why}") from why
        if access is None:
            raise NotComposable(f"{where}: {consumer.op.name} does not read {producer.op.name}")
        if not access.exact or not access.spatial.is_single_valued():
            _, _, _, reason = classify(access)
            raise NotComposable(f"{where} is not one-relies-on-one: {reason}")
        steps.append(access.spatial.set_tuple_name(isl.dim_type.in_, f"s{k + 1}")
                     .set_tuple_name(isl.dim_type.out, f"s{k}"))
    source, target = chain[0], chain[-1]
    target_name = isl_name(target.op.name)
    axes = tuple(tirx.Var(ax.var.name, str(ax.var.ty)) for ax in target.op.axis)
    analyzer = tvm.sym.Analyzer()
    for var, extent in zip(axes, target.shape):
        analyzer.bind(var, tvm.ir.Range(0, constant(extent)))
    converter = _Converter(axes, _box(target, target_name), analyzer)
    with _bounded_isl(f"composing {' -> '.join(t.op.name for t in chain)}"):
        composed = steps[-1]
        for step in reversed(steps[:-1]):
            composed = composed.apply_range(step)
        composed = (composed.set_tuple_name(isl.dim_type.in_, target_name)
                    .set_tuple_name(isl.dim_type.out, isl_name(source.op.name)).coalesce())
        source_indices, defined = converter.convert(composed)
    return ComposedMap(source, target, composed, axes, tuple(source_indices), defined)


def _check_chain(chain) -> list[te.Tensor]:
    chain = list(chain)
    if len(chain) < 2:
        raise NotComposable(f"a chain needs a source and at least one TE reading it, got {len(chain)} tensor(s)")
    for k, tensor in enumerate(chain):
        if not isinstance(tensor, te.Tensor):
            raise NotComposable(f"chain element {k} is a {type(tensor).__name__}, not a te.Tensor")
    return chain


def _box(tensor: te.Tensor, name: str) -> isl.Set:
    """``{ name[i0, ..] : 0 <= i_d < shape_d }``: every element of ``tensor``."""
    dims = [f"i{d}" for d in range(len(tensor.shape))]
    bounds = [f"0 <= {v} < {constant(n)}" for v, n in zip(dims, tensor.shape)]
    return isl.Set(f"{{ {name}[{', '.join(dims)}] : {' and '.join(bounds) or 'true'} }}")


# -- isl -> sympy -> TVM ----------------------------------------------------------------------
class _Converter:
    """Turns a single-valued isl map over the target's indices into TVM expressions of ``axes``."""

    def __init__(self, axes: tuple[tirx.Var, ...], box: isl.Set, analyzer):
        self.axes = axes
        self.box = box
        self.analyzer = analyzer
        self.dtype = str(axes[0].ty) if axes else "int32"
        self.symbols = [sympy.Symbol(v.name + f"_{d}", integer=True, nonnegative=True) for d, v in enumerate(axes)]
        self.vars_of = dict(zip(self.symbols, axes))

    def convert(self, composed: isl.Map) -> tuple[list[tirx.Expr], tirx.Expr]:
        """(source index per source dimension, condition for the map's domain)."""
        pieces = []
        composed.lexmin_pw_multi_aff().foreach_piece(lambda domain, multi: pieces.append((domain, multi)))
        n_out = composed.dim(isl.dim_type.out)
        if not pieces:  # the target never reaches the source: any index, never defined
            return [tirx.const(0, self.dtype)] * n_out, tirx.const(False, "bool")
        per_piece = [[_fold_mods(_aff_to_sympy(multi.get_aff(d), self.symbols)) for d in range(n_out)]
                     for _, multi in pieces]
        conditions = [self.condition(domain) for domain, _ in pieces]
        indices = []
        for d in range(n_out):
            expr = self.to_tvm(per_piece[-1][d])
            if any(per_piece[p][d] != per_piece[-1][d] for p in range(len(pieces) - 1)):
                for p in reversed(range(len(pieces) - 1)):
                    expr = tirx.Select(conditions[p], self.to_tvm(per_piece[p][d]), expr)
            indices.append(self.analyzer.simplify(expr))
        return indices, self.condition(composed.domain())

    def condition(self, domain: isl.Set) -> tirx.Expr:
        """``domain`` (within the target's box) as a TVM boolean: or of basic sets, and of constraints."""
        domain = domain.gist(self.box).coalesce()
        disjuncts = []
        for basic in domain.get_basic_sets():
            conjuncts = []
            for constraint in basic.get_constraints():
                value = self.to_tvm(_fold_mods(_aff_to_sympy(constraint.get_aff(), self.symbols)))
                conjuncts.append(tirx.EQ(value, tirx.const(0, value.ty)) if constraint.is_equality() else value >= 0)
            disjuncts.append(tirx.all(*conjuncts) if conjuncts else tirx.const(True, "bool"))
        return self.analyzer.simplify(tirx.any(*disjuncts) if disjuncts else tirx.const(False, "bool"))

    def to_tvm(self, expr: sympy.Expr) -> tirx.Expr:
        """Integer-valued sympy arithmetic (Add, Mul, floor, Mod) as TVM index arithmetic."""
        numerator, denominator = sympy.fraction(sympy.together(expr))
        if denominator != 1:  # integral on the domain: exact floor division
            return tirx.floordiv(self.to_tvm(sympy.expand(numerator)), int(denominator))
        if expr.is_Integer:
            return tirx.const(int(expr), self.dtype)
        if expr.is_Symbol:
            return self.vars_of[expr]
        if expr.is_Add:
            terms = sorted(sympy.Add.make_args(expr), key=lambda t: (t.is_number, t.could_extract_minus_sign()))
            total = self.to_tvm(terms[0])
            for term in terms[1:]:
                if term.could_extract_minus_sign():
                    total = total - self.to_tvm(-term)
                else:
                    total = total + self.to_tvm(term)
            return total
        if expr.is_Mul:
            coefficient, rest = expr.as_coeff_Mul()
            if coefficient == -1:
                return tirx.const(0, self.dtype) - self.to_tvm(rest)
            factors = [self.to_tvm(f) for f in sympy.Mul.make_args(rest)]
            product = factors[0]
            for factor in factors[1:]:
                product = product * factor
            return product if coefficient == 1 else product * int(coefficient)
        if isinstance(expr, sympy.floor):
            numerator, denominator = sympy.fraction(sympy.together(expr.args[0]))
            return tirx.floordiv(self.to_tvm(sympy.expand(numerator)), int(denominator))
        if isinstance(expr, sympy.Mod):
            return tirx.floormod(self.to_tvm(expr.args[0]), self.to_tvm(expr.args[1]))
        raise NotComposable(f"cannot write {expr} as a TVM index expression")


def _rational(value: isl.Val) -> sympy.Rational:
    return sympy.Rational(value.get_num_si(), value.get_den_val().get_num_si())


def _aff_to_sympy(aff: isl.Aff, symbols: list[sympy.Symbol]) -> sympy.Expr:
    """The quasi-affine ``aff`` over ``symbols``: rational coefficients, constant, floors of its divs."""
    expr = _rational(aff.get_constant_val())
    for d, symbol in enumerate(symbols):
        expr += _rational(aff.get_coefficient_val(isl.dim_type.in_, d)) * symbol
    for k in range(aff.dim(isl.dim_type.div)):
        coefficient = _rational(aff.get_coefficient_val(isl.dim_type.div, k))
        if coefficient:
            expr += coefficient * _floor(_aff_to_sympy(aff.get_div(k), symbols))
    return sympy.expand(expr)


def _floor(value: sympy.Expr) -> sympy.Expr:
    """``floor(value)`` with the smallest coefficients left inside the floor.

    isl picks its own representative of a division: ``i - floor((6i + 6)/7)`` for
    ``floor(i/7)``. Whole multiples of the divisor leave the floor, each remaining
    coefficient ``r`` taken either in ``[0, d)`` or in ``(-d, 0]`` and then reflected
    (``floor(a/d) = -floor((d - 1 - a)/d)``), whichever keeps the coefficients smaller.
    """
    numerator, denominator = sympy.fraction(sympy.together(sympy.expand(value)))
    if denominator == 1:
        return numerator
    d = int(denominator)
    terms = sympy.expand(numerator).as_coefficients_dict()
    constant_part = int(terms.pop(sympy.S.One, 0))
    up = {atom: divmod(int(c), d) for atom, c in terms.items()}  # remainders in [0, d)
    down = {atom: (q + 1, r - d) if r else (q, r) for atom, (q, r) in up.items()}  # in (-d, 0]
    if sum(-r for _, r in down.values()) < sum(r for _, r in up.values()):
        outside, reflected = divmod(d - 1 - constant_part, d)
        inside = sum((-r * atom for atom, (_, r) in down.items()), sympy.S(reflected))
        return sum((q * atom for atom, (q, _) in down.items()), sympy.S(0)) - outside - _plain_floor(inside, d)
    outside, remainder = divmod(constant_part, d)
    inside = sum((r * atom for atom, (_, r) in up.items()), sympy.S(remainder))
    return sum((q * atom for atom, (q, _) in up.items()), sympy.S(outside)) + _plain_floor(inside, d)


def _plain_floor(numerator: sympy.Expr, d: int) -> sympy.Expr:
    return sympy.floor(numerator / d) if numerator.free_symbols else sympy.S(int(numerator) // d)


def _symbolic_terms(expr: sympy.Expr) -> set:
    return {t for t in sympy.Add.make_args(expr) if t.free_symbols}


def _fold_mods(expr: sympy.Expr) -> sympy.Expr:
    """Rewrite every ``m*a - m*d*floor(a/d)`` (inner expressions first) into ``m*Mod(a, d)``.

    For a term ``c*floor(a/d)`` with ``d`` dividing ``c``, ``m = -c/d``: the rewrite is kept
    when taking ``m*a`` out of the other terms strictly removes some of them (and adds none),
    so an unrelated floor is left alone. ``floor(n/4)`` is also tried as ``floor(floor(n/2)/2)``
    when ``floor(n/2)`` is another term, which folds ``floor(n/2) - 2*floor(n/4)`` too.
    """
    if expr.is_Atom:
        return expr
    expr = expr.func(*[_fold_mods(a) for a in expr.args])
    if not expr.is_Add:
        return expr
    rewritten = True
    while rewritten:
        rewritten = False
        for term in sympy.Add.make_args(expr):
            coefficient, factor = term.as_coeff_Mul()
            if not isinstance(factor, sympy.floor):
                continue
            for dividend, divisor in _division_views(factor, expr):
                if not (coefficient / divisor).is_Integer:
                    continue
                multiplier = -coefficient / divisor
                rest = expr - term
                remaining = sympy.expand(rest - multiplier * dividend)
                if _symbolic_terms(remaining) < _symbolic_terms(rest):
                    expr = remaining + multiplier * sympy.Mod(dividend, divisor)
                    rewritten = True
                    break
            if rewritten:
                break
    return expr


def _division_views(floor: sympy.floor, expr: sympy.Expr):
    """Each ``(a, d)`` with ``floor == floor(a/d)``: ``a`` the numerator, or another floor term of ``expr``
    dividing the same numerator by a divisor of ``d``."""
    numerator, denominator = sympy.fraction(sympy.together(floor.args[0]))
    if not denominator.is_Integer or denominator <= 1:
        return
    yield numerator, int(denominator)
    for term in sympy.Add.make_args(expr):
        _, other = term.as_coeff_Mul()
        if isinstance(other, sympy.floor) and other != floor:
            inner_numerator, inner_denominator = sympy.fraction(sympy.together(other.args[0]))
            if inner_numerator == numerator and inner_denominator.is_Integer and denominator % inner_denominator == 0:
                yield other, int(denominator // inner_denominator)


# -- rewriting TE bodies ----------------------------------------------------------------------
# the binary nodes of TE bodies (``Rewriter`` rebuilds them from their two operands)
BINARY_NODES = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Mod, tirx.FloorDiv, tirx.FloorMod, tirx.Min, tirx.Max,
                tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.And, tirx.Or)


def _same_index_dtype(a, b):
    """``a`` and ``b`` with the narrower integer one widened: a substituted variable may carry a
    wider index (int64 ids from an embedding) than the int32 constants of the body it lands in."""
    a_type, b_type = str(a.ty), str(b.ty)
    if a_type == b_type or not (_is_scalar_int(a_type) and _is_scalar_int(b_type)):
        return a, b
    if int(a_type[3:]) < int(b_type[3:]):
        return tirx.Cast(b_type, a), b
    return a, tirx.Cast(a_type, b)


def _is_scalar_int(dtype: str) -> bool:
    return dtype.startswith("int") and dtype[3:].isdigit()


class Rewriter:
    """Rebuilds a TE expression with variables replaced and each tensor load passed to ``on_load``.

    TVM has no Python expression mutator, so this covers the nodes TE bodies are made of.
    """

    def __init__(self, variables: dict, where: str, on_load=None, reduce_axes: dict | None = None):
        self.variables = variables
        self.where = where
        self.on_load = on_load or (lambda tensor, indices: tensor(*indices))
        self.reduce_axes = reduce_axes or {}

    def __call__(self, e):
        if isinstance(e, tirx.Var):
            return self.variables.get(e, e)
        if isinstance(e, (tirx.IntImm, tirx.FloatImm, tvm.ir.expr.StringImm)):
            return e
        if isinstance(e, BINARY_NODES):
            return type(e)(*_same_index_dtype(self(e.a), self(e.b)))
        if isinstance(e, tirx.Not):
            return tirx.Not(self(e.a))
        if isinstance(e, tirx.Select):
            return tirx.Select(self(e.condition), self(e.true_value), self(e.false_value))
        if isinstance(e, tirx.Cast):
            return tirx.Cast(e.ty, self(e.value))
        if is_call_to(e, TENSOR_LOAD):
            return self.on_load(e.args[0], [self(index) for index in e.args[1:]])
        if isinstance(e, tvm.ir.expr.Call):
            return tvm.ir.expr.Call(e.op, [self(a) for a in e.args], attrs=e.attrs, ty_args=e.ty_args, ret_ty=e.ty)
        if isinstance(e, tirx.Reduce):
            axes = [self.reduce_axes.get(ax.var, ax) for ax in e.axis]
            return tirx.Reduce(e.combiner, [self(s) for s in e.source], axes, self(e.condition), e.value_index,
                               [self(i) for i in e.init])
        raise NotComposable(f"{self.where}: cannot rewrite a {type(e).__name__} node")


def _value_computation(stage: te.Tensor) -> str | None:
    """Why ``stage`` computes values rather than moving elements of one tensor; None if it only moves."""
    op = stage.op
    if not isinstance(op, te.ComputeOp):
        return f"{op.name} is not a compute TE"
    if len(op.body) != 1:
        return f"it has {len(op.body)} outputs"
    read: set = set()

    def why(e) -> str | None:
        if is_call_to(e, TENSOR_LOAD):
            read.add(e.args[0].op)
            return None if len(read) == 1 else "it reads several tensors"
        if isinstance(e, tirx.Select):
            return why(e.true_value) or why(e.false_value)
        if is_call_to(e, IF_THEN_ELSE):
            return why(e.args[1]) or why(e.args[2])
        if isinstance(e, tirx.Reduce):
            return f"it reduces over {', '.join(ax.var.name for ax in e.axis)}"
        if isinstance(e, (tirx.IntImm, tirx.FloatImm)):
            return f"it writes the constant {e.value} (padding or fill)"
        name = e.op.name if isinstance(e, tvm.ir.expr.Call) else type(e).__name__
        return f"it computes {name}"

    return why(op.body[0])


def moves_data(stage: te.Tensor) -> bool:
    """Whether every value of ``stage`` is a load of one tensor (reshape, transpose, slice, roll)."""
    return _value_computation(stage) is None


def _check_moves_data(chain: list[te.Tensor]):
    for stage in chain[1:]:
        why = _value_computation(stage)
        if why is not None:
            raise NotComposable(f"{stage.op.name} computes values ({why}), so the chain cannot be skipped: "
                                f"inline {stage.op.name} into its consumer instead")


def row_major(index: Sequence, shape: Sequence[int]):
    """The row-major flat position of ``index`` in a tensor of ``shape``: integers, or TVM index
    expressions (0 for a rank-0 tensor)."""
    if not index:
        return 0
    flat = index[0]
    for i, d in zip(index[1:], shape[1:]):
        flat = flat * int(d) + i
    return flat


def unravel(flat, shape: Sequence[int]) -> list:
    """The index in a tensor of ``shape`` of the element at row-major position ``flat``
    (``row_major``'s inverse; integers, or TVM index expressions)."""
    index = []
    for d in reversed([int(d) for d in shape]):
        index.append(flat % d)
        flat = flat // d
    return index[::-1]


def reads_tensor(index: tirx.Expr) -> bool:
    """Whether ``index`` loads a tensor element (a gather's index, as in take): TVM's analyzer
    cannot simplify such an index (it cannot hash the TE it reads), and need not."""
    reads = []

    def on_load(read, indices):
        reads.append(read)
        return read(*indices)

    Rewriter({}, "finding loads", on_load)(index)
    return bool(reads)


def recompute(tensor: te.Tensor, load, where: str) -> te.Tensor:
    """``tensor``'s TE built again over fresh axes, each of its loads replaced by
    ``load(tensor_read, indices, simplify)``, where ``simplify`` simplifies an index expression
    with the new axes' ranges. Attributes are dropped (they name the tensors the old TE read)."""
    op = tensor.op
    reduce_axes = {ax.var: te.reduce_axis(ax.dom, ax.var.name) for ax in op.reduce_axis}

    def body(*axes):
        analyzer = tvm.sym.Analyzer()
        variables = {}
        for old, axis in zip(op.axis, axes):
            analyzer.bind(axis, old.dom)
            variables[old.var] = axis
        for old_var, axis in reduce_axes.items():
            analyzer.bind(axis.var, axis.dom)
            variables[old_var] = axis.var
        def simplify(index):
            return index if reads_tensor(index) else analyzer.simplify(index)

        return Rewriter(variables, where, lambda read, indices: load(read, indices, simplify), reduce_axes)(op.body[0])

    return te.compute(tensor.shape, body, name=op.name, tag=op.tag, varargs_names=[ax.var.name for ax in op.axis])


def rebuild(consumer: te.Tensor, chain: Sequence[te.Tensor]) -> te.Tensor:
    """``consumer`` recomputed to read ``chain[0]`` directly wherever it read ``chain[-1]``.

    Every TE of ``chain[1:]`` must only move data (see ``moves_data``): skipping a TE that
    computes values would drop the computation. Loads of other tensors are kept.
    """
    chain = _check_chain(chain)
    composed = compose(chain)
    _check_moves_data(chain)
    target = chain[-1]
    op = consumer.op
    if not isinstance(op, te.ComputeOp) or not any(t.op.same_as(target.op) for t in op.input_tensors):
        raise NotComposable(f"{consumer.op.name} does not read {target.op.name}, the end of the chain")
    if len(op.body) != 1:
        raise NotComposable(f"{op.name} has {len(op.body)} outputs; only single-output consumers are rebuilt")

    def load(tensor, indices, simplify):
        if tensor.op.same_as(target.op):
            return composed.source(*[simplify(i) for i in composed.indices(indices)])
        return tensor(*indices)

    return recompute(consumer, load, f"rebuilding {op.name}")


def rebuild_chain(chain: Sequence[te.Tensor]) -> te.Tensor:
    """The chain's last tensor computed in one TE straight from ``chain[0]``."""
    chain = _check_chain(chain)
    composed = compose(chain)
    _check_moves_data(chain)
    target = chain[-1]
    return te.compute(target.shape, lambda *axes: composed.load(axes), name=target.op.name, tag=target.op.tag,
                      varargs_names=[ax.var.name for ax in target.op.axis])


# -- the chains of a program ------------------------------------------------------------------
@dataclass(frozen=True)
class Chain:
    """A maximal run of data-movement TEs in a program, and the one map that replaces it.

    ``composed`` is None where the composition gave up (``left_because`` says why): the
    chain's TEs then stay as they are, which costs their buffers, never correctness.
    """

    names: tuple[str, ...]  # the TEs' names in the program, in order
    source: str  # what the first TE reads
    composed: ComposedMap | None
    left_because: str = ""

    def __str__(self):
        if self.composed is None:
            return f"{' -> '.join(self.names)}: left as it is, {self.left_because}"
        indices = ", ".join(str(e) for e in self.composed.source_indices)
        axes = ", ".join(v.name for v in self.composed.axes)
        partial = "" if self.composed.total else f" where {self.composed.defined}"
        return f"{' -> '.join(self.names)}: [{axes}] reads {self.source}[{indices}]{partial}"


def find_chains(deps) -> list[Chain]:
    """Every maximal chain of TEs that only move one input's elements, composed into one map.

    A TE joins a chain when it reads exactly one tensor, one relying on one, and each value
    it writes is an element of that tensor (reshape, transpose, slice, and flatten/unsqueeze
    views); ``deps`` is ``analysis.dependence.dependences(program)``. A chain that does not
    compose is kept with the reason.
    """
    moving = {}
    for s in deps.stages:
        if len(s.edges) == 1 and s.one_relies_on_one and moves_data(s.stage):
            moving[s.stage.op] = (s, s.edges[0])
    continued = {edge.tensor.op for _, edge in moving.values()}
    chains = []
    for op, (stage, _) in moving.items():
        if op in continued:
            continue
        run = [stage]
        while run[0].edges[0].tensor.op in moving:
            run.insert(0, moving[run[0].edges[0].tensor.op][0])
        tensors = [run[0].edges[0].tensor] + [s.stage for s in run]
        names, source = tuple(s.name for s in run), run[0].edges[0].name
        try:
            chains.append(Chain(names, source, compose(tensors)))
        except NotComposable as why:
            chains.append(Chain(names, source, None, str(why)))
    return chains
