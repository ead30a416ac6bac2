"""Static thread-level validation of a persistent CUDA kernel, on the TIR that becomes its source.

``lower_for_device`` runs TVM's own CUDA pipeline on the kernel plan's PrimFuncs up to the point
where ``target.build.cuda`` prints them (after ``SplitHostDevice`` and the device finalization
passes); ``codegen.cuda.cuda_source`` prints that very module, so what is checked is what nvcc
compiles. ``validate_kernel`` reads one device function as a persistent kernel: a 1-D grid of
``grid_size`` blocks (an isl parameter ``G``: every check holds for every grid size from 1, or
from the launch's minimum where on-chip weights need more blocks), blocks of (32, warps, 1) threads,
each stage a loop ``for t in range(ceildiv(n_tiles - blockIdx.x, G))`` over tiles
``tile = blockIdx.x + t * G``. Every memory access becomes an isl set over (tile or block,
threadIdx.x, threadIdx.y, loop iterations) with its byte address; it checks

- launch fit: the thread extents are the launch's block shape, the block extent is ``grid_size``;
- no deadlock: no barrier under a condition or a loop trip count that depends on the thread
  index, the block index or data (a grid barrier also not inside a stage's tile loop);
- bounds: every affine index lies inside the buffer (or view) it indexes;
- coverage: each stage writes every element of each global buffer it writes, each element from
  exactly one (tile, thread); a thread may write an element several times (a reduction
  accumulates in place), no other thread may. Where a stage's writes are the same at every grid
  size and their loops have constant bounds, every thread's writes are enumerated (a finite
  domain, so as much a proof as isl's, and seconds where isl's subtraction took over half an
  hour on a tensor-core tile's nested floors); else isl proves it for every grid size;
- no races: two accesses to the same bytes, one a write, by different threads, must be ordered by
  a barrier executed between them: a ``__syncthreads`` (or grid barrier) for threads of one
  block, in shared or global memory, the grid barrier for threads of different blocks.
  Registers (``local``) and warp shuffles, which exchange registers, never race;
- asynchronous copies (``cp.async``, TVM's ``cp_async_raw`` in commit and wait scopes): each
  copy reads its source at the issue and writes its destination at some moment up to the
  ``cp.async.wait_group`` that retires its group, found by running the tile's commits and waits
  in order (``Walker.resolve_async``; they may sit in one loop of constant trips, the software
  pipeline's). The write is checked as a race at both ends, against what came before the issue
  and what comes after that wait, and no thread may touch its bytes in between
  (``Checker.in_flight``). A copy no wait retires within its tile, or a pattern of commits and
  waits the walker cannot run (under a condition, in nested loops), is refused.

How every grid size is covered: an address is a function of the tile, never of ``G`` (``t * G``
is rewritten as ``tile - blockIdx.x``). Two accesses with different tiles (or blocks) run on
different blocks for a large enough ``G`` and on one block for ``G = 1``; so a conflict between
different tiles needs a grid barrier (global memory), and in shared memory any conflict between
different threads needs a block barrier, whatever the tiles. Between two tiles of one block only
the barriers in those two tiles' iterations are counted, never those of the tiles in between
(which another ``G`` may give to another block). Over-approximations, reported in the result's
notes, never accept silently: a non-affine index is any address; a non-affine condition is
dropped (the access may happen), and a stage with one cannot prove its coverage; ``blockIdx.x``
or ``t`` left alone in an index are variables bounded only by ``blockIdx.x <= tile`` and
``t * min_grid <= tile - blockIdx.x``; a C division or modulo is exact only where its operand is
provably non-negative (every index variable is), else not affine. The race search stops after
``REPORTED`` violations.
"""

from __future__ import annotations

import ast
import functools
import itertools
import math
import re
from dataclasses import dataclass, field

import islpy as isl
import numpy as np
import tvm
from tvm import sym, tirx
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad builds
from tvm.tirx.build import split_host_device_mods
from tvm_ffi import structural_equal

from souffle.errors import ValidationError

WARP = 32
GRID = "G"
BLOCK = "bx"
LANE = "tx"
WARP_INDEX = "ty"
THREAD_TAGS = {"threadIdx.x": LANE, "threadIdx.y": WARP_INDEX}
FRAGMENT_SHAPES = ((16, 16, 16), (16, 16, 8))  # wmma's m16n16k16 (halves, bfloat16s) and m16n16k8 (TF32)
# wmma's operations: every lane of the warp must run each of them together
WARP_COLLECTIVE = ("tirx.tvm_fill_fragment", "tirx.tvm_load_matrix_sync", "tirx.tvm_store_matrix_sync",
                   "tirx.tvm_mma_sync")


def lower_for_device(funcs: dict, target: tvm.target.Target, config: dict) -> tvm.IRModule:
    """The device IRModule ``tvm.compile(IRModule(funcs), target)`` hands to the CUDA code
    generator under ``PassContext(config=config)``: TVM's own pipeline, run to that point."""
    with tvm.transform.PassContext(config=config):
        mod = tvm.tirx.transform.BindTarget(target.with_host(tvm.target.Target("llvm")))(tvm.IRModule(funcs))
        pipeline, _, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
        _, devices = split_host_device_mods(pipeline(mod))
        if len(devices) != 1:
            raise ValidationError(f"the kernels lower to {len(devices)} device modules, not one")
        return finalize_device()(next(iter(devices.values())))


def device_functions(module: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    """The kernels of a lowered device module, by name."""
    return {gvar.name_hint: func for gvar, func in module.functions.items()}


# -- quasi-affine forms ------------------------------------------------------------------------
class NonAffine(Exception):
    """An expression isl cannot represent exactly."""


@dataclass(frozen=True)
class Floor:
    """floor(form / divisor), an isl quasi-affine term."""

    form: tuple
    divisor: int


@dataclass(frozen=True)
class Modulo:
    """form mod divisor (in [0, divisor)), an isl quasi-affine term."""

    form: tuple
    divisor: int


class Form:
    """An integer linear combination of monomials (tuples of atoms: variable names or ``Floor``);
    monomials of degree 2 exist only until ``t * G`` is rewritten as ``tile - blockIdx.x``."""

    __slots__ = ("terms",)

    def __init__(self, terms=None):
        self.terms = {k: v for k, v in (terms or {}).items() if v}

    @staticmethod
    def const(c: int) -> Form:
        return Form({(): int(c)})

    @staticmethod
    def atom(a) -> Form:
        return Form({(a,): 1})

    def __add__(self, other: Form) -> Form:
        terms = dict(self.terms)
        for k, v in other.terms.items():
            terms[k] = terms.get(k, 0) + v
        return Form(terms)

    def scale(self, c: int) -> Form:
        return Form({k: v * c for k, v in self.terms.items()})

    def __sub__(self, other: Form) -> Form:
        return self + other.scale(-1)

    def constant(self) -> int | None:
        return self.terms.get((), 0) if all(k == () for k in self.terms) else None

    def atoms(self) -> set:
        found = set()
        for k in self.terms:
            for a in k:
                found |= Form(dict(a.form)).atoms() if isinstance(a, (Floor, Modulo)) else {a}
        return found

    def frozen(self) -> tuple:
        return tuple(sorted(self.terms.items(), key=repr))

    def renamed(self, names: dict) -> Form:
        """The form with each variable in ``names`` renamed (inside floors and remainders too)."""
        def atom(a):
            if isinstance(a, (Floor, Modulo)):
                return type(a)(Form(dict(a.form)).renamed(names).frozen(), a.divisor)
            return names.get(a, a)
        terms: dict = {}
        for k, v in self.terms.items():
            key = tuple(atom(a) for a in k)
            terms[key] = terms.get(key, 0) + v
        return Form(terms)

    def render(self, suffix: str = "") -> str:
        parts = []
        for k, v in self.terms.items():
            if len(k) > 1:
                raise NonAffine(" * ".join(map(str, k)))
            parts.append(f"{v}" if not k else f"{v}*{_render_atom(k[0], suffix)}")
        return "(" + (" + ".join(parts) or "0") + ")"


def _render_atom(a, suffix: str) -> str:
    if isinstance(a, Floor):
        return f"floor({Form(dict(a.form)).render(suffix)}/{a.divisor})"
    if isinstance(a, Modulo):
        return f"({Form(dict(a.form)).render(suffix)} mod {a.divisor})"
    return a if _is_parameter(a) else a + suffix


def _is_parameter(atom) -> bool:
    """The grid size and the kernel's scalar arguments (host loop counters): one value for every thread."""
    return atom == GRID or (isinstance(atom, str) and atom.startswith("P_"))


def _times(x: Form, y: Form, tiles: dict) -> Form:
    terms: dict = {}
    for (kx, vx), (ky, vy) in itertools.product(x.terms.items(), y.terms.items()):
        k = tuple(sorted(kx + ky, key=repr))
        terms[k] = terms.get(k, 0) + vx * vy
    out = Form()
    for k, v in terms.items():
        tile = tiles.get(k)
        if tile is not None:  # t * G == tile - blockIdx.x
            out = out + (Form.atom(tile) - Form.atom(BLOCK)).scale(v)
        elif len(k) > 2:
            raise NonAffine("a product of more than two variables")
        else:
            out = out + Form({k: v})
    return out


def _floordiv(x: Form, c: int) -> Form:
    if c <= 0:
        raise NonAffine(f"a division by {c}")
    if any(len(k) > 1 for k in x.terms):
        raise NonAffine("a division of a product")
    constant = x.constant()
    if constant is not None:
        return Form.const(constant // c)
    if _nonnegative(x) and _upper(x) < c:
        return Form.const(0)
    return Form.atom(Floor(x.frozen(), c))


def _floormod(x: Form, c: int) -> Form:
    if c <= 0:
        raise NonAffine(f"a modulo by {c}")
    if any(len(k) > 1 for k in x.terms):
        raise NonAffine("a modulo of a product")
    constant = x.constant()
    if constant is not None:
        return Form.const(constant % c)
    return Form.atom(Modulo(x.frozen(), c))


def _nonnegative(x: Form) -> bool:
    """Sufficient: every variable is >= 0 (thread, block and tile indices, loop counters from 0,
    the grid size, host loop counters), so a form with no negative coefficient is."""
    for k, v in x.terms.items():
        if v < 0 or any(isinstance(a, Floor) and not _nonnegative(Form(dict(a.form))) for a in k):
            return False
    return True


def _upper(x: Form) -> float:
    """An upper bound of a non-negative form, where its atoms have one (modulos)."""
    total = 0
    for k, v in x.terms.items():
        if not k:
            total += v
        elif len(k) == 1 and isinstance(k[0], Modulo):
            total += v * (k[0].divisor - 1)
        else:
            return float("inf")
    return total


class Converter:
    """TIR integer expressions -> ``Form`` (variables named by the walker)."""

    def __init__(self):
        self.env: dict = {}  # tirx.Var -> Form
        self.tiles: dict = {}  # (G, t_k) monomial -> tile variable
        # numerators of C divisions taken as floor divisions, for the caller to prove >= 0 on its
        # domain; None: such a division is refused
        self.assumed: list | None = None
        # a vector index's lane (an atom in [0, lanes)), or None: a scalar index, where a Ramp or
        # a Broadcast is no index
        self.lane: Form | None = None

    def form(self, e) -> Form:
        if isinstance(e, tirx.IntImm):
            return Form.const(e.value)
        if isinstance(e, (tirx.Ramp, tirx.Broadcast)):
            if self.lane is None:
                raise NonAffine(f"a {type(e).__name__} in a scalar index")
            if isinstance(e, tirx.Broadcast):
                return self.form(e.value)
            return self.form(e.base) + _times(self.form(e.stride), self.lane, self.tiles)
        if isinstance(e, tirx.Var):
            if e in self.env:
                return self.env[e]
            raise NonAffine(f"variable {e.name}")
        if isinstance(e, tirx.Cast):
            return self.form(e.value)
        if isinstance(e, tirx.Add):
            floor = self.c_floor_idiom(e)
            return floor if floor is not None else self.form(e.a) + self.form(e.b)
        if isinstance(e, tirx.Sub):
            return self.form(e.a) - self.form(e.b)
        if isinstance(e, tirx.Mul):
            return _times(self.form(e.a), self.form(e.b), self.tiles)
        if isinstance(e, (tirx.FloorDiv, tirx.FloorMod, tirx.Div, tirx.Mod, tirx.RShift, tirx.BitwiseAnd)):
            a, b = e.a, e.b
            if isinstance(e, tirx.BitwiseAnd) and isinstance(a, tirx.IntImm):
                a, b = b, a
            x, c = self.form(a), self.form(b).constant()
            if c is None:
                raise NonAffine(f"{type(e).__name__} by a variable")
            if isinstance(e, (tirx.Div, tirx.Mod)) and not _nonnegative(x):
                if self.assumed is None:
                    raise NonAffine(f"a C division of {x.render()}, which may be negative")
                self.assumed.append(x)
            if isinstance(e, tirx.RShift):
                return _floordiv(x, 2 ** c)
            if isinstance(e, tirx.BitwiseAnd):
                if x.constant() == 0:
                    return Form.const(0)
                if c < 0 or (c + 1) & c:
                    raise NonAffine(f"& {c}")
                return _floormod(x, c + 1)
            if isinstance(e, (tirx.FloorDiv, tirx.Div)):
                return _floordiv(x, c)
            return _floormod(x, c)
        if isinstance(e, tirx.Let):
            self.env[e.var] = self.form(e.value)
            return self.form(e.body)
        raise NonAffine(type(e).__name__)

    def c_floor_idiom(self, e: tirx.Add) -> Form | None:
        """floordiv(x, c) or floormod(x, c) where TVM lowered them for an x it cannot prove
        non-negative (an offset index, i - 3 in one branch of a roll): C's truncating
        ``x / c + (x % c >> 31)`` and ``x % c + (c & (x % c >> 31))``, exact for any sign of x;
        None for any other sum."""
        for first, second in ((e.a, e.b), (e.b, e.a)):
            if not isinstance(first, (tirx.Div, tirx.Mod)) or not isinstance(first.b, tirx.IntImm):
                continue
            x, c = first.a, first.b.value
            mask = second
            if isinstance(first, tirx.Mod):
                if not isinstance(second, tirx.BitwiseAnd):
                    continue
                pair = (second.a, second.b) if isinstance(second.a, tirx.IntImm) else (second.b, second.a)
                if not (isinstance(pair[0], tirx.IntImm) and pair[0].value == c):
                    continue
                mask = pair[1]
            sign_bit = tvm.DataType(str(x.ty.dtype)).bits - 1
            if not (isinstance(mask, tirx.RShift) and isinstance(mask.b, tirx.IntImm) and mask.b.value == sign_bit
                    and isinstance(mask.a, tirx.Mod) and isinstance(mask.a.b, tirx.IntImm) and mask.a.b.value == c
                    and structural_equal(mask.a.a, x)):
                continue
            return (_floordiv if isinstance(first, tirx.Div) else _floormod)(self.form(x), c)
        return None

    def condition(self, e) -> str:
        """An isl constraint template (``{s}`` for the variables' suffix)."""
        if isinstance(e, tirx.And):
            return f"({self.condition(e.a)} and {self.condition(e.b)})"
        if isinstance(e, tirx.Or):
            return f"({self.condition(e.a)} or {self.condition(e.b)})"
        if isinstance(e, tirx.Not):
            return f"(not {self.condition(e.a)})"
        ops = {tirx.LT: "<", tirx.LE: "<=", tirx.GT: ">", tirx.GE: ">=", tirx.EQ: "=", tirx.NE: "!="}
        for kind, op in ops.items():
            if isinstance(e, kind):
                return f"({self.template(self.form(e.a))} {op} {self.template(self.form(e.b))})"
        if isinstance(e, tirx.IntImm):
            return "(0 = 0)" if e.value else "(1 = 0)"
        raise NonAffine(type(e).__name__)

    @staticmethod
    def template(f: Form) -> str:
        return f.render("{s}")


def _free(e, env: dict) -> set:
    """The names (walker variables) and "data" an expression depends on."""
    found: set = set()

    def visit(x):
        if isinstance(x, tirx.Var):
            found.update(env[x].atoms() if x in env else {f"?{x.name}"})
        elif isinstance(x, TensorLoad):
            found.add("data")
            for i in x.indices:
                visit(i)
        elif isinstance(x, tirx.Let):
            visit(x.value)
            visit(x.body)
        elif isinstance(x, tvm.ir.Call):
            if x.op.name not in ("tirx.likely", "prim.likely"):
                found.add("data")
            for a in x.args:
                visit(a)
        elif isinstance(x, tirx.Ramp):
            visit(x.base)
            visit(x.stride)
        else:
            for name in ("a", "b", "value", "condition", "true_value", "false_value"):
                if hasattr(x, name) and isinstance(getattr(x, name), tirx.Expr):
                    visit(getattr(x, name))

    visit(e)
    return {n if isinstance(n, str) else str(n) for n in found}


# -- what the walker records -------------------------------------------------------------------
@dataclass
class Memory:
    """A buffer's place: ``root`` (the allocation or parameter it views) at ``offset`` bytes."""

    name: str
    root: object  # the root buffer
    scope: str
    offset: Form | None  # None: not affine
    elem_bytes: int
    extent: int | None  # elements of the view; None where symbolic or an alias of merged shared memory
    root_bytes: int | None = None  # the root allocation's size, where known


@dataclass
class Access:
    statement: object  # the TIR statement, printed for messages
    buffer: str
    memory: Memory
    write: bool
    index: Form | None  # element index in the buffer; None: not affine
    width: int  # bytes
    variables: list
    domain: list  # isl constraint templates
    path: tuple
    block: str  # the variable telling blocks apart: a tile or blockIdx.x
    stage: int | None
    approximate: bool
    # a cp.async copy's write: "issued" where it is issued, "landed" at the wait that retires it.
    # Races are checked against the issue with the other access first (the copy must not overwrite
    # what a thread has yet to read) and against the landing with it first (a thread reads the copy
    # after it lands); ``Checker.in_flight`` refuses every access in between.
    copy: str = ""
    # bytes the access's address must be a multiple of, where more than its element's: a vector
    # load or store of a Ramp (one instruction of all its lanes), a cp.async's bytes
    align: int = 0
    lane: str | None = None  # a vector index's lane variable (its first element at lane 0)

    @property
    def stmt(self) -> str:
        return _stmt_text(self.statement)


@dataclass
class Kernel:
    """What ``validate_kernel`` read of one device function."""

    name: str
    accesses: list = field(default_factory=list)
    stages: dict = field(default_factory=dict)  # stage number -> (tile variable, n_tiles, name)
    surely: dict = field(default_factory=dict)  # (kind, seq id) -> [child runs a barrier of kind]
    loop_body_surely: dict = field(default_factory=dict)  # (kind, loop id) -> body runs one
    loop_info: dict = field(default_factory=dict)  # loop id -> (variable, is tile loop)
    notes: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    params: list = field(default_factory=lambda: [GRID])  # isl parameters
    parameter_domain: list = field(default_factory=list)  # host loop counters' ranges
    min_grid: int = 1  # the fewest blocks the kernel is launched with
    bounds: dict = field(default_factory=dict)  # variable -> (lowest, highest), where constant
    in_flight: list = field(default_factory=list)  # InFlight: each cp.async copy, issued to retired


REPORTED = 5  # violations found before the race search stops (the error lists these)


@dataclass
class AsyncEvent:
    """A cp.async event of one stage's tile body, as every thread of the block runs it: an
    ``issue`` (its shared write ``access``, in the commit scope at ``scope``), a ``commit`` (at the
    end of the commit scope at ``path``) or a ``wait`` (at the start of the wait scope at ``path``,
    leaving ``pending`` groups in flight)."""

    kind: str
    path: tuple
    pending: int = 0
    access: Access | None = None
    scope: tuple = ()


@dataclass
class InFlight:
    """A cp.async copy from its issue to the wait that retires it: ``landed`` is its write at that
    wait (``issue``'s address, the issue's iteration of the pipeline loop renamed ``issued``)."""

    issue: Access
    landed: Access
    issued: str | None  # the variable of the issue's pipeline iteration in ``landed``, if in the loop
    loop: int | None  # the pipeline loop's id


class Walker:
    def __init__(self, func: tirx.PrimFunc, warps: int, name: str, counters: dict, min_grid: int):
        self.counters = counters
        self.min_grid = min_grid
        self.func = func
        self.warps = warps
        self.kernel = Kernel(name, min_grid=min_grid)
        self.conv = Converter()
        self.memories: dict = {}  # buffer -> Memory
        self.ids = itertools.count()
        self.grid_var = None
        self.data_buffers: dict = {}  # a buffer's data variable -> the buffer (cp.async names data)
        self.async_events: list[AsyncEvent] = []  # the current tile body's
        self.commit_scopes: list[tuple] = []  # the paths of the commit scopes being walked

    # memory
    def root(self, buffer: tirx.Buffer, scope: str) -> Memory:
        extent = _extent(buffer)
        bytes_ = buffer.dtype.bits * buffer.dtype.lanes // 8
        return Memory(buffer.name, buffer, scope, Form.const(0), bytes_, extent,
                      None if extent is None else extent * bytes_)

    def declare(self, stmt: tirx.DeclBuffer):
        """A view: over another buffer's data (an alias) or at ``address_of(base[offset])``."""
        buffer = stmt.buffer
        self.data_buffers[buffer.data] = buffer
        data = stmt.data
        bytes_ = buffer.dtype.bits * buffer.dtype.lanes // 8
        if isinstance(data, tvm.ir.Call) and data.op.name == "tirx.buffer_data":
            # an alias (TVM's merged shared memory): its declared shape does not bound it, its root does
            parent = self.memory(data.args[0])
            self.memories[buffer] = Memory(buffer.name, parent.root, parent.scope, parent.offset, bytes_, None,
                                           parent.root_bytes)
            return
        if not (isinstance(data, tvm.ir.Call) and data.op.name == "tirx.address_of"):
            self.memories[buffer] = self.root(buffer, buffer.scope())
            return
        load = data.args[0]
        parent = self.memory(load.source)
        try:
            offset = None if parent.offset is None else (
                parent.offset + self.conv.form(load.indices[0]).scale(parent.elem_bytes))
        except NonAffine as why:
            self.kernel.notes.append(f"view {buffer.name}: offset not affine ({why}): any address")
            offset = None
        self.memories[buffer] = Memory(buffer.name, parent.root, parent.scope, offset, bytes_, _extent(buffer),
                                       parent.root_bytes)

    def memory(self, buffer) -> Memory:
        """Where ``buffer`` lives (a buffer never declared is its own root)."""
        if buffer not in self.memories:
            self.memories[buffer] = self.root(buffer, buffer.scope())
        return self.memories[buffer]

    # walk
    def run(self) -> Kernel:
        for param in self.func.params:
            if param.name == "grid_size":
                self.grid_var = param
                self.conv.env[param] = Form.atom(GRID)
            elif str(getattr(param.ty, "dtype", "")).startswith("int"):
                self.conv.env[param] = Form.atom(f"P_{param.name}")
                self.kernel.params.append(f"P_{param.name}")
                if param.name in self.counters:
                    self.kernel.parameter_domain.append(f"0 <= P_{param.name} < {self.counters[param.name]}")
                    self.kernel.bounds[f"P_{param.name}"] = (0, self.counters[param.name] - 1)
                else:
                    self.kernel.notes.append(f"argument {param.name}: any value")
        if self.grid_var is None:
            self.kernel.errors.append("launch: the kernel has no grid_size parameter")
            return self.kernel
        ctx = Context(variables=[BLOCK, LANE, WARP_INDEX],
                      domain=[f"0 <= {BLOCK}{{s}} < {GRID}", f"{GRID} >= {self.min_grid}",
                              *self.kernel.parameter_domain],
                      path=(), block=BLOCK, stage=None, uniform_block=True, uniform_grid=True, approximate=False,
                      in_tile=False)
        ctx.domain += [f"0 <= {LANE}{{s}} < {WARP}", f"0 <= {WARP_INDEX}{{s}} < {self.warps}"]
        self.stmt(self.func.body, ctx)
        return self.kernel

    def stmt(self, s, ctx: Context) -> tuple[bool, bool]:
        """Walk ``s``; returns whether it surely runs a (grid, block-or-grid) barrier."""
        if isinstance(s, tirx.SeqStmt):
            sid = next(self.ids)
            flags = []
            for k, child in enumerate(s.seq):
                flags.append(self.stmt(child, ctx.child(path=ctx.path + (("s", sid, k),))))
            self.kernel.surely[("grid", sid)] = [f[0] for f in flags]
            self.kernel.surely[("block", sid)] = [f[1] for f in flags]
            return any(f[0] for f in flags), any(f[1] for f in flags)
        if isinstance(s, tirx.DeclBuffer):
            self.declare(s)
            return False, False
        if isinstance(s, tirx.AllocBuffer):
            self.memories[s.buffer] = self.root(s.buffer, s.buffer.scope())
            self.data_buffers[s.buffer.data] = s.buffer
            return False, False
        if isinstance(s, tirx.Bind):
            self.bind(s.var, s.value)
            return False, False
        if isinstance(s, tirx.LetStmt):
            self.bind(s.var, s.value)
            return self.stmt(s.body, ctx)
        if isinstance(s, tirx.AttrStmt):
            if s.attr_key == "thread_extent":
                self.launch(s, ctx)
            if s.attr_key == "async_commit_queue_scope":
                return self.commit_scope(s, ctx)
            if s.attr_key == "async_wait_queue_scope":
                return self.wait_scope(s, ctx)
            return self.stmt(s.body, ctx)
        if isinstance(s, tirx.For):
            return self.loop(s, ctx)
        if isinstance(s, tirx.IfThenElse):
            return self.branch(s, ctx)
        if isinstance(s, tirx.BufferStore):
            self.reads(s.value, ctx, s)
            for i in s.indices:
                self.reads(i, ctx, s)
            self.access(s.buffer, s.indices, True, ctx, s)
            return False, False
        if isinstance(s, tirx.Evaluate):
            return self.evaluate(s, ctx)
        if isinstance(s, tirx.While):
            self.kernel.errors.append("control: a while loop, which the validator does not model")
            return False, False
        raise ValidationError(f"kernel {self.kernel.name}: a {type(s).__name__} statement, which the validator "
                              f"does not model")

    # cp.async
    def commit_scope(self, s: tirx.AttrStmt, ctx: Context) -> tuple[bool, bool]:
        """A group of cp.async copies, committed as one at the scope's end (``cp.async.commit_group``)."""
        if not ctx.uniform_block:
            self.kernel.errors.append(f"cp.async: a commit {self.where(ctx)} under a condition or loop that "
                                      f"depends on the thread or data, which the validator does not model")
        self.commit_scopes.append(ctx.path)
        flags = self.stmt(s.body, ctx)
        self.commit_scopes.pop()
        self.async_events.append(AsyncEvent("commit", ctx.path))
        return flags

    def wait_scope(self, s: tirx.AttrStmt, ctx: Context) -> tuple[bool, bool]:
        """``cp.async.wait_group N`` at the start of the scope: all but the ``N`` latest groups land."""
        inner = s.body
        if not (isinstance(inner, tirx.AttrStmt) and inner.attr_key == "async_wait_inflight_count"
                and isinstance(inner.value, tirx.IntImm)):
            self.kernel.errors.append(f"cp.async: a wait {self.where(ctx)} without a constant count of groups "
                                      f"left in flight, which the validator does not model")
            return self.stmt(inner, ctx)
        if not ctx.uniform_block:
            self.kernel.errors.append(f"cp.async: a wait {self.where(ctx)} under a condition or loop that "
                                      f"depends on the thread or data, which the validator does not model")
        self.async_events.append(AsyncEvent("wait", ctx.path, pending=inner.value.value))
        return self.stmt(inner.body, ctx)

    def async_copy(self, call: tvm.ir.Call, ctx: Context, stmt):
        """``cp_async_raw(dst, dst_offset, src, src_offset, bytes[, predicate])``, offsets in elements
        of the call's dtype: the source is read at the issue (where the predicate holds: a padded
        operand's copy stores zeros elsewhere); the destination is written some time between the
        issue and the wait that retires the copy's group (``resolve_async``)."""
        destination, destination_offset, source, source_offset, size, *predicate = call.args
        dtype = str(call.ty.dtype)  # the offsets' unit (printed as the call's first argument)
        buffers = [self.buffer_of(v) for v in (destination, source)]
        if None in buffers or not isinstance(size, tirx.IntImm) or not self.commit_scopes or len(predicate) > 1:
            self.kernel.errors.append(f"cp.async {self.where(ctx)}: {call} is not a copy the validator models "
                                      f"(buffers it can name, a constant size, inside a commit scope)")
            return
        reading = ctx
        if predicate:  # a padded operand: the copy where the predicate holds, else zeros stored at the issue
            self.reads(predicate[0], ctx, stmt)
            try:
                reading = ctx.child(domain=ctx.domain + [self.conv.condition(predicate[0])])
            except NonAffine:
                reading = ctx.child(approximate=True)
        for buffer, offset, write in ((buffers[1], source_offset, False), (buffers[0], destination_offset, True)):
            where = ctx if write else reading
            if str(buffer.dtype) != dtype:
                self.kernel.errors.append(f"cp.async {self.where(ctx)}: offsets in {dtype} into "
                                          f"{buffer.name} of {buffer.dtype}, which the validator does not model")
                return
            self.reads(offset, where, stmt)
            access = self.access(buffer, [offset], write, where, stmt, size.value, "issued" if write else "")
        self.async_events.append(AsyncEvent("issue", ctx.path, access=access, scope=self.commit_scopes[-1]))

    def buffer_of(self, data):
        """The buffer whose data ``data`` is (``buffer_data(buffer)``, or a data variable)."""
        if isinstance(data, tvm.ir.Call) and data.op.name == "tirx.buffer_data":
            return data.args[0]
        return self.data_buffers.get(data)

    def resolve_async(self, tile_lid: int):
        """Each cp.async copy of the tile body just walked, matched with the wait that retires it,
        by running the body's commits and waits in order: a copy's group is the number of groups
        committed before it; ``wait_group N`` retires every group but the ``N`` latest. The events
        may sit in one loop over the tile's chunks (the software pipeline's), run for each of its
        iterations; every copy must be retired by the end of the tile. Each copy's write is then
        also recorded at the wait that retires it (``InFlight``), where other threads may read it
        after a ``__syncthreads``; ``Checker.in_flight`` refuses any access to its bytes between
        the issue and that wait."""
        events, self.async_events = self.async_events, []
        if not events:
            return

        def inner_loops(path):
            start = path.index(("l", tile_lid)) + 1
            if any(step[0] == "i" for step in path[start:]):
                return None  # under a condition
            return [step[1] for step in path[start:] if step[0] == "l"]

        problems, loops = [], set()
        for e in events:
            found = inner_loops(e.scope if e.kind == "issue" else e.path)
            if found is None or len(found) > 1:
                problems.append(f"a cp.async {e.kind} under a condition or in nested loops")
            else:
                loops.update(found)
        loop = next(iter(loops)) if len(loops) == 1 else None
        trips = None
        if loop is not None:
            name = self.kernel.loop_info[loop][0]
            low, high = self.kernel.bounds.get(name, (None, None))
            trips = None if low != 0 or high is None else high + 1
        if len(loops) > 1 or (loop is not None and trips is None):
            problems.append("cp.async events in more than one loop, or in one of no constant trip count from 0")
        if problems:
            self.kernel.errors.append(f"cp.async in stage {len(self.kernel.stages) - 1}: {problems[0]}, a pattern "
                                      f"the validator does not model")
            return

        def key(e):  # program order; a commit runs at its scope's end, a wait at its scope's start
            steps = [(step[2],) if step[0] == "s" else (0,) for step in e.path]
            return (*steps, ({"wait": -1, "issue": 0, "commit": math.inf}[e.kind],))

        def in_loop(e):
            return loop is not None and _in_path(e.scope if e.kind == "issue" else e.path, loop)

        ordered = sorted(events, key=key)
        outside = [(e, None) for e in ordered if not in_loop(e)]
        if loop is not None:
            body = [e for e in ordered if in_loop(e)]
            loop_path = body[0].path[:body[0].path.index(("l", loop))]
            before = [(e, j) for e, j in outside if _path_before(e.path, loop_path)]
            after = [(e, j) for e, j in outside if not _path_before(e.path, loop_path)]
            trace = before + [(e, j) for j in range(trips) for e in body] + after
        else:
            trace = outside
        groups, pending, retired = 0, [], {}
        for e, iteration in trace:
            if e.kind == "issue":
                pending.append((e, iteration, groups))
            elif e.kind == "commit":
                groups += 1
            else:
                kept = []
                for issue, issued, group in pending:
                    if group <= groups - 1 - e.pending:
                        retired.setdefault((id(issue), id(e)), (issue, e, []))[2].append((issued, iteration))
                    else:
                        kept.append((issue, issued, group))
                pending = kept
        if pending:
            self.kernel.errors.append(f"cp.async in stage {len(self.kernel.stages) - 1}: copies still in flight at "
                                      f"the end of a tile (no cp.async.wait_group retires them): {pending[0][0].access.stmt}")
            return
        for issue, wait, pairs in retired.values():
            for constraint in _runs(pairs, self.kernel.loop_info[loop][0] if loop is not None else None):
                self.record_in_flight(issue, wait, constraint, loop)

    def record_in_flight(self, issue: AsyncEvent, wait: AsyncEvent, constraint, loop: int | None):
        """The copy ``issue`` as written at ``wait`` for the iterations ``constraint`` pairs them in."""
        a = issue.access
        issued = None
        renames = {}
        if loop is not None and _in_path(issue.scope, loop):
            issued = f"q{next(self.ids)}"
            renames[self.kernel.loop_info[loop][0]] = issued
            self.kernel.bounds[issued] = self.kernel.bounds[self.kernel.loop_info[loop][0]]
        variables = [renames.get(v, v) for v in a.variables]
        domain = [_renamed_template(c, renames) for c in a.domain]
        if loop is not None and _in_path(wait.path, loop):
            variables.append(self.kernel.loop_info[loop][0])
        domain += constraint(issued)
        landed = Access(a.statement, a.buffer, a.memory, True, None if a.index is None else a.index.renamed(renames),
                        a.width, variables, domain, wait.path, a.block, a.stage, a.approximate, "landed")
        self.kernel.accesses.append(landed)
        self.kernel.in_flight.append(InFlight(a, landed, issued, loop))

    def bind(self, var, value):
        try:
            self.conv.env[var] = self.conv.form(value)
        except NonAffine:
            self.conv.env.pop(var, None)

    def launch(self, s: tirx.AttrStmt, ctx: Context):
        tag = s.node.thread_tag
        var = s.node.var
        extent = s.value
        if tag == "blockIdx.x":
            if not (isinstance(extent, tirx.Var) and extent.same_as(self.grid_var)):
                self.kernel.errors.append(f"launch fit: blockIdx.x runs over {extent}, not the grid_size parameter")
            self.conv.env[var] = Form.atom(BLOCK)
            return
        if tag in THREAD_TAGS:
            expected = WARP if tag == "threadIdx.x" else self.warps
            if not (isinstance(extent, tirx.IntImm) and extent.value == expected):
                self.kernel.errors.append(f"launch fit: {tag} is launched over {extent}, but the block is "
                                          f"(32, {self.warps}, 1): {tag} must run over {expected}")
            self.conv.env[var] = Form.atom(THREAD_TAGS[tag])
            return
        if not (isinstance(extent, tirx.IntImm) and extent.value == 1):
            self.kernel.errors.append(f"launch fit: {tag} is launched over {extent}; the persistent kernel's "
                                      f"launch has a 1-D grid and (32, {self.warps}, 1) blocks")
        self.conv.env[var] = Form.const(0)

    def loop(self, s: tirx.For, ctx: Context) -> tuple[bool, bool]:
        lid = next(self.ids)
        free = _free(s.extent, self.conv.env) | _free(s.min, self.conv.env)
        tile = self.persistent_extent(s)
        name = f"i{lid}"
        child = ctx.child(path=ctx.path + (("l", lid),), variables=ctx.variables + [name])
        if tile is not None:
            if ctx.in_tile:
                self.kernel.errors.append(f"loop {s.loop_var.name}: a stage's tile loop inside another")
            stage = len(self.kernel.stages)
            tile_name = f"T{lid}"
            n_tiles = tile
            self.kernel.stages[stage] = (tile_name, n_tiles, None)
            self.conv.tiles[tuple(sorted((GRID, name), key=repr))] = tile_name
            self.conv.env[s.loop_var] = Form.atom(name)
            # t alone is over-approximated: tile - bx = t*G >= t*min_grid
            child.variables.append(tile_name)
            child.domain = child.domain + [f"0 <= {tile_name}{{s}} < {n_tiles}", f"{BLOCK}{{s}} <= {tile_name}{{s}}",
                                           f"0 <= {name}{{s}}",
                                           f"{self.min_grid}*{name}{{s}} <= {tile_name}{{s}} - {BLOCK}{{s}}"]
            child.block, child.stage, child.in_tile = tile_name, stage, True
            self.kernel.bounds[name] = (0, n_tiles - 1)
            child.uniform_grid = False
            self.kernel.loop_info[lid] = (tile_name, True)
        else:
            if free & {LANE, WARP_INDEX, "data"} or any(n.startswith("?") for n in free):
                child.uniform_block = child.uniform_grid = False
            if free & {LANE, "data"} or any(n.startswith("?") for n in free):
                child.uniform_warp = False
            if free & {BLOCK} or any(n.startswith("T") for n in free):
                child.uniform_grid = False
            self.conv.env[s.loop_var] = Form.atom(name)
            try:
                lo, ext = self.conv.form(s.min), self.conv.form(s.extent)
                child.domain = child.domain + [f"{Converter.template(lo)} <= {name}{{s}} < "
                                               f"{Converter.template(lo + ext)}"]
                if lo.constant() is not None and ext.constant() is not None:
                    self.kernel.bounds[name] = (lo.constant(), lo.constant() + ext.constant() - 1)
            except NonAffine as why:
                child.approximate = True
                self.kernel.notes.append(f"loop {s.loop_var.name}: bounds not affine ({why}): any iteration")
            self.kernel.loop_info[lid] = (name, False)
        grid, block = self.stmt(s.body, child)
        if tile is not None:
            self.resolve_async(lid)
        self.kernel.loop_body_surely[("grid", lid)] = grid
        self.kernel.loop_body_surely[("block", lid)] = block
        if tile is not None or not isinstance(s.extent, tirx.IntImm) or s.extent.value < 1:
            return False, False
        return grid, block

    def persistent_extent(self, s: tirx.For) -> int | None:
        """n_tiles where ``s`` is a stage's ``for t in range(ceildiv(n_tiles - blockIdx.x, G))``."""
        free = _free(s.extent, self.conv.env)
        if not ({BLOCK, GRID} <= free):
            return None
        found = []

        def visit(x):
            if isinstance(x, (tirx.Div, tirx.FloorDiv)) and isinstance(x.b, tirx.Var) and x.b.same_as(self.grid_var):
                found.append(x.a)
            for name in ("a", "b", "value", "body", "condition", "true_value", "false_value"):
                if hasattr(x, name) and isinstance(getattr(x, name), tirx.Expr):
                    visit(getattr(x, name))

        visit(s.extent)
        for numerator in found:
            try:
                f = self.conv.form(numerator)
            except NonAffine:
                continue
            rest = f - Form.atom(GRID) + Form.atom(BLOCK)
            if rest.constant() is not None and rest.constant() >= 0:
                return rest.constant() + 1
        self.kernel.errors.append(f"loop {s.loop_var.name}: its trip count {s.extent} depends on the block and the "
                                  f"grid but is not a persistent tile loop the validator recognizes")
        return None

    def branch(self, s: tirx.IfThenElse, ctx: Context) -> tuple[bool, bool]:
        bid = next(self.ids)
        free = _free(s.condition, self.conv.env)
        uniform_block = ctx.uniform_block and not (free & {LANE, WARP_INDEX, "data"}) and not any(
            n.startswith("?") for n in free)
        uniform_grid = ctx.uniform_grid and uniform_block and not (free & {BLOCK}) and not any(
            n.startswith("T") for n in free)
        uniform_warp = ctx.uniform_warp and not (free & {LANE, "data"}) and not any(n.startswith("?") for n in free)
        self.reads(s.condition, ctx, s)
        try:
            cond = self.conv.condition(s.condition)
            approximate = False
        except NonAffine:
            cond, approximate = None, True
        for k, case in enumerate((s.then_case, s.else_case)):
            if case is None:
                continue
            domain = ctx.domain if cond is None else ctx.domain + [cond if k == 0 else f"(not {cond})"]
            self.stmt(case, ctx.child(path=ctx.path + (("i", bid, k),), domain=domain,
                                      uniform_block=uniform_block, uniform_grid=uniform_grid, uniform_warp=uniform_warp,
                                      approximate=ctx.approximate or approximate))
        return False, False

    def evaluate(self, s: tirx.Evaluate, ctx: Context) -> tuple[bool, bool]:
        call = s.value
        if isinstance(call, tvm.ir.Call):
            op = call.op.name
            if op == "tirx.cuda.grid_sync":
                if not ctx.uniform_grid:
                    self.kernel.errors.append(
                        f"deadlock: a grid barrier {self.where(ctx)} under a condition or loop that depends on the "
                        f"block, the thread or data: not every thread of the grid reaches it")
                return True, True
            if op == "tirx.tvm_storage_sync":
                scope = call.args[0].value
                if scope == "warp":
                    return False, False
                if not ctx.uniform_block:
                    self.kernel.errors.append(
                        f"deadlock: a __syncthreads {self.where(ctx)} under a condition or loop that depends on the "
                        f"thread or data: not every thread of the block reaches it")
                return False, True
            if op in WARP_COLLECTIVE and not ctx.uniform_warp:
                self.kernel.errors.append(
                    f"deadlock: {op.removeprefix('tirx.')} {self.where(ctx)} under a condition or loop that depends on "
                    f"the lane or data: wmma needs every lane of the warp")
            if op in ("tirx.tvm_load_matrix_sync", "tirx.tvm_store_matrix_sync"):
                self.fragment_tile(call, op == "tirx.tvm_store_matrix_sync", ctx, s)
                return False, False
            if op == "tirx.s_tir.cp_async_raw":
                self.async_copy(call, ctx, s)
                return False, False
            if "cp_async" in op or "async_commit" in op or "async_wait" in op:
                self.kernel.errors.append(f"cp.async: {op} {self.where(ctx)}, which the validator does not model")
                return False, False
        self.reads(call, ctx, s)
        return False, False

    def fragment_tile(self, call: tvm.ir.Call, write: bool, ctx: Context, stmt):
        """wmma's load or store of a tile (``tvm_load_matrix_sync(fragment, m, n, k, index,
        address_of(buffer[offset]), stride, layout)``), a warp-collective access of
        ``offset + major * stride + minor``: a load reads the whole tile in every lane (the
        fragment is spread over the warp in an unspecified layout, so each lane's load depends on
        all of it); a store writes each element once, lane l the 8 from element 8 l of the tile in
        memory order, as the emulator's ``mma.h`` does. The fragments themselves are registers.
        The tile is m x k for a ``matrix_a`` fragment, k x n for ``matrix_b``, m x n for the
        accumulator, in rows (``row_major``: major) or columns (``col_major``)."""
        shape = [a.value if isinstance(a, tirx.IntImm) else None for a in call.args[1:4]]
        if tuple(shape) not in FRAGMENT_SHAPES:
            self.kernel.errors.append(f"wmma: a fragment of shape {shape}; the validator models "
                                      f"{' and '.join('m{}n{}k{}'.format(*f) for f in FRAGMENT_SHAPES)} only")
            return
        m, n, k = shape
        fragment = call.args[0].args[0] if isinstance(call.args[0], tvm.ir.Call) and call.args[0].args else None
        scope = fragment.scope() if hasattr(fragment, "scope") else None
        if scope not in ("wmma.matrix_a", "wmma.matrix_b", "wmma.accumulator"):
            self.kernel.errors.append(f"wmma: a tile of fragment {call.args[0]}, whose use (matrix_a, matrix_b or "
                                      f"accumulator) the validator cannot tell")
            return
        rows, columns = {"wmma.matrix_a": (m, k), "wmma.matrix_b": (k, n)}.get(scope, (m, n))
        column_major = len(call.args) > 7 and isinstance(call.args[7], tvm.ir.StringImm) and \
            call.args[7].value == "col_major"
        extents = (columns, rows) if column_major else (rows, columns)
        pointer, stride = call.args[5], call.args[6]
        if not (isinstance(pointer, tvm.ir.Call) and pointer.op.name == "tirx.address_of"):
            self.kernel.errors.append(f"wmma: a tile at {pointer}, not the address of a buffer element")
            return
        load = pointer.args[0]
        self.reads(load.indices[0], ctx, stmt)
        memory = self.memory(load.source)
        major, minor = f"f{next(self.ids)}", f"f{next(self.ids)}"
        for v, extent in zip((major, minor), extents):
            self.kernel.bounds[v] = (0, extent - 1)
        domain = ctx.domain + [f"0 <= {major}{{s}} < {extents[0]}", f"0 <= {minor}{{s}} < {extents[1]}"]
        share = rows * columns // WARP
        if write:
            domain.append(f"{share} * {LANE}{{s}} <= {extents[1]} * {major}{{s}} + {minor}{{s}} < "
                          f"{share} * {LANE}{{s}} + {share}")
        variables = ctx.variables + [major, minor]
        self.conv.assumed = []
        try:
            if not isinstance(stride, tirx.IntImm):
                raise NonAffine(f"a tile stride {stride}")
            index = self.conv.form(load.indices[0]) + Form.atom(major).scale(stride.value) + Form.atom(minor)
            index.render()
            self.check_divisions(self.conv.assumed, variables, domain)
        except NonAffine as why:
            self.kernel.notes.append(f"{load.source.name}: wmma tile at {load.indices[0]} not affine ({why}): any element")
            index = None
        finally:
            self.conv.assumed = None
            self.conv.lane = None
        self.kernel.accesses.append(Access(stmt, load.source.name, memory, write, index, memory.elem_bytes, variables,
                                           domain, ctx.path, ctx.block, ctx.stage, ctx.approximate))

    def where(self, ctx: Context) -> str:
        return "outside any stage" if ctx.stage is None else f"in stage {ctx.stage}"

    def reads(self, e, ctx: Context, stmt):
        """Record the loads of ``e``; an ``if_then_else`` loads only from the branch it takes."""
        def visit(x, ctx):
            if isinstance(x, TensorLoad):
                for i in x.indices:
                    visit(i, ctx)
                self.access(x.source, x.indices, False, ctx, stmt)
            elif isinstance(x, tvm.ir.Call):
                if x.op.name == "tirx.address_of":
                    return
                if x.op.name in ("prim.if_then_else", "tirx.if_then_else"):
                    condition, then, other = x.args
                    visit(condition, ctx)
                    try:
                        cond = self.conv.condition(condition)
                    except NonAffine:
                        visit(then, ctx.child(approximate=True))
                        visit(other, ctx.child(approximate=True))
                        return
                    visit(then, ctx.child(domain=ctx.domain + [cond]))
                    visit(other, ctx.child(domain=ctx.domain + [f"(not {cond})"]))
                    return
                for a in x.args:
                    visit(a, ctx)
            elif isinstance(x, tirx.Let):
                visit(x.value, ctx)
                self.bind(x.var, x.value)
                visit(x.body, ctx)
            else:
                for name in ("a", "b", "value", "condition", "true_value", "false_value", "base", "stride"):
                    if hasattr(x, name) and isinstance(getattr(x, name), tirx.Expr):
                        visit(getattr(x, name), ctx)

        visit(e, ctx)

    def access(self, buffer: tirx.Buffer, indices, write: bool, ctx: Context, stmt, width: int | None = None,
               copy: str = "") -> Access:
        """The access of ``buffer[indices]``, recorded; ``width`` bytes from the element (a
        cp.async's), else the element's or the vector's, and its role in a ``copy``."""
        memory = self.memory(buffer)
        if memory.scope.startswith("local") or memory.scope == "warp":
            variables, domain = ctx.variables, ctx.domain
            index = self.index(indices[0], ctx, buffer)
            if index is not None:
                index, variables, domain = index
            access = Access(stmt, buffer.name, memory, write, index, memory.elem_bytes, variables, domain, ctx.path,
                            ctx.block, ctx.stage, ctx.approximate)
            self.kernel.accesses.append(access)
            return access
        found = self.index(indices[0], ctx, buffer)
        index, variables, domain = found if found is not None else (None, ctx.variables, ctx.domain)
        lanes = tvm.DataType(str(indices[0].ty.dtype)).lanes
        align = width if width is not None else \
            lanes * (buffer.dtype.bits // 8) if one_vector_instruction(indices[0], lanes, write) else 0
        if width is None:
            width = memory.elem_bytes if lanes == 1 else buffer.dtype.bits // 8
        access = Access(stmt, buffer.name, memory, write, index, width, variables, domain, ctx.path, ctx.block,
                        ctx.stage, ctx.approximate, copy, align, variables[-1] if lanes > 1 and found else None)
        self.kernel.accesses.append(access)
        if write and ctx.stage is not None:
            tile, n, name = self.kernel.stages[ctx.stage]
            if name is None and memory.scope == "global":
                self.kernel.stages[ctx.stage] = (tile, n, buffer.name)
        return access

    def index(self, e, ctx: Context, buffer):
        self.conv.assumed = []
        try:
            lanes = tvm.DataType(str(e.ty.dtype)).lanes
            if lanes > 1:  # each lane's element: a Ramp's run, or a gather's (an im2col copy's) own index
                lane = f"l{next(self.ids)}"
                self.kernel.bounds[lane] = (0, lanes - 1)
                self.conv.lane = Form.atom(lane)
                form = self.conv.form(e)
                form.render()
                found = form, ctx.variables + [lane], ctx.domain + [f"0 <= {lane}{{s}} < {lanes}"]
            else:
                form = self.conv.form(e)
                form.render()
                found = form, ctx.variables, ctx.domain
            self.check_divisions(self.conv.assumed, found[1], found[2])
            return found
        except NonAffine as why:
            self.kernel.notes.append(f"{buffer.name}: index {e} not affine ({why}): any element")
            return None
        finally:
            self.conv.assumed = None
            self.conv.lane = None

    def check_divisions(self, numerators: list, variables: list, domain: list):
        """A C division or remainder is the floor one where its numerator is >= 0. TVM leaves one
        plain where an enclosing condition proves that (the branch i >= 3 of a roll reading
        (i - 3) / 7), so the access's domain, conditions included, must prove it too."""
        for x in numerators:
            if not _is_empty(_set(self.kernel.params, [(variables, domain, "_a")], [f"{x.render('_a')} < 0"])):
                raise NonAffine(f"a C division of {x.render()}, which may be negative")


def one_vector_instruction(index, lanes: int, write: bool) -> bool:
    """Whether TVM's CUDA code generator prints an access at ``index`` (``lanes`` elements) as one
    instruction of all its lanes (``*(float4*)``), whose address must then be on its bytes: a store
    of a Ramp of stride 1 always, a load only where the Ramp's start is a multiple of its lanes by
    TVM's modular analysis (else lane by lane, as ``CodeGenC`` does)."""
    if lanes == 1 or not (isinstance(index, tirx.Ramp) and isinstance(index.stride, tirx.IntImm)
                          and index.stride.value == 1):
        return False
    if write:
        return True
    start = sym.Analyzer().modular_set(index.base)
    return start.coeff % lanes == 0 and start.base % lanes == 0


def _in_path(path: tuple, loop: int) -> bool:
    """Whether ``path`` runs inside the loop ``loop``."""
    return ("l", loop) in path


def _path_before(a: tuple, b: tuple) -> bool:
    """Whether the statement at path ``a`` runs before the one at ``b`` (neither inside the
    other): at their first difference, a sequence position."""
    for x, y in zip(a, b):
        if x != y:
            return x[0] == "s" and y[0] == "s" and x[1] == y[1] and x[2] < y[2]
    return False


def _renamed_template(constraint: str, names: dict) -> str:
    """An isl constraint template (variables written ``name{s}``) with variables renamed."""
    for old, new in names.items():
        constraint = re.sub(rf"\b{re.escape(old)}\{{s\}}", f"{new}{{s}}", constraint)
    return constraint


def _runs(pairs: list, loop: str | None) -> list:
    """The (issue iteration, retiring wait iteration) ``pairs`` of one copy and one wait as
    isl constraint templates, one per run of consecutive issues at one distance: each a function
    of the variable naming the issue's iteration (None outside the pipeline loop, as is a wait's
    iteration there); the wait's iteration is the loop variable ``loop``."""
    if all(i is None for i, _ in pairs):
        return [lambda issued, j=j: [] if j is None else [f"{loop}{{s}} = {j}"] for _, j in pairs]
    runs: list = []
    for i, j in sorted(pairs):
        distance = None if j is None else j - i
        if runs and runs[-1][1] == i - 1 and runs[-1][2] == distance:
            runs[-1][1] = i
        else:
            runs.append([i, i, distance])
    return [lambda issued, low=low, high=high, d=d: [f"{low} <= {issued}{{s}} <= {high}"]
            + ([] if d is None else [f"{loop}{{s}} = {issued}{{s}} + {d}"]) for low, high, d in runs]


def _precedes(a: tuple, names_a, b: tuple, names_b, tile: int | None) -> list[list[str]]:
    """The ways the point at path ``a`` runs before the one at ``b`` in one tile of one block,
    as alternatives of isl constraints; ``names_x(loop)`` is the variable of a loop's iteration
    on each side. A path that is a prefix of the other's is the start of the statement holding it
    (a wait runs at the start of its scope)."""
    alternatives, equal = [], []
    for x, y in zip(a, b):
        if x == y:
            if x[0] == "l" and x[1] != tile:
                alternatives.append(equal + [f"{names_a(x[1])} < {names_b(x[1])}"])
                equal = equal + [f"{names_a(x[1])} = {names_b(x[1])}"]
            continue
        if x[0] == "s" and y[0] == "s" and x[1] == y[1] and x[2] < y[2]:
            alternatives.append(equal)
        return alternatives
    if len(a) < len(b):
        alternatives.append(equal)
    return alternatives


@dataclass
class Context:
    variables: list
    domain: list
    path: tuple
    block: str
    stage: int | None
    uniform_block: bool
    uniform_grid: bool
    approximate: bool
    in_tile: bool
    uniform_warp: bool = True  # every lane of a warp runs this (no condition on the lane or on data)

    def child(self, **changes) -> Context:
        fields_ = dict(self.__dict__)
        fields_.update(changes)
        fields_["variables"] = list(fields_["variables"])
        return Context(**fields_)


def _extent(buffer: tirx.Buffer) -> int | None:
    n = 1
    for d in buffer.shape:
        if not isinstance(d, tirx.IntImm):
            return None
        n *= d.value
    return n


def _stmt_text(stmt) -> str:
    """A short text of the statement an access is in, for messages."""
    if isinstance(stmt, tirx.BufferStore):
        text = f"{stmt.buffer.name}[{stmt.indices[0]}] = {stmt.value}"
    elif isinstance(stmt, tirx.IfThenElse):
        text = f"if {stmt.condition}"
    else:
        text = str(stmt).strip()
    text = " ".join(text.split())
    return text if len(text) <= 140 else text[:137] + "..."


# -- the checks --------------------------------------------------------------------------------
def _set(params: list, variables_and_domains: list, extra: list | None = None) -> str:
    """The isl text of the set of the variables' values that meet the domains and ``extra``."""
    names, constraints = [], []
    for variables, domain, suffix in variables_and_domains:
        names += [v + suffix for v in variables]
        constraints += [c.format(s=suffix) for c in domain]
    constraints += extra or []
    return f"[{', '.join(params)}] -> {{ [{', '.join(names)}] : {' and '.join(constraints) or '0 = 0'} }}"


_EMPTY: dict = {}  # canonical isl text -> whether the set is empty (stages repeat: layers, experts)
_ADDRESSES: dict = {}  # canonical isl text -> the bytes an access touches, an isl set


def _canonical(text: str) -> str:
    """``text`` with its set variables renamed by position, so that the same question about
    another copy of a stage is answered once."""
    head, _, body = text.partition("] : ")
    names = head[head.rindex("[") + 1:].split(", ") if "[" in head else []
    rename = {name: f"v{k}" for k, name in enumerate(names) if name}
    if not rename:
        return text
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(rename, key=len, reverse=True))) + r")\b")
    return pattern.sub(lambda m: rename[m.group(1)], text)


def _cached(cache: dict, text: str, compute):
    canonical = _canonical(text)
    if canonical not in cache:
        if len(cache) > 100_000:
            cache.clear()
        cache[canonical] = compute(canonical)
    return cache[canonical]


def _is_empty(text: str) -> bool:
    """Whether the set ``text`` is empty."""
    return _cached(_EMPTY, text, lambda canonical: isl.Set(canonical).is_empty())


def _placed(a: Access) -> bool:
    """Whether the bytes ``a`` may touch are known: an affine address, or a view of known place and size."""
    return a.memory.offset is not None and (a.index is not None or a.memory.extent is not None)


def _touched_bytes(params: list, a: Access) -> isl.Set:
    """The bytes ``a`` touches over its whole domain (first bytes, widened by its width), a
    one-dimensional set: two accesses whose sets do not meet cannot race, and comparing them
    is far cheaper than the race question itself, whose isl parse costs about a millisecond.

    An access whose index is not affine (a gather's, read from memory) touches some element of
    its view: the bytes of the whole view. Indexing stays inside a view: ``bounds`` proves it for
    every affine index, TVM clamps a gather's index into the table, and the emulator checks
    every access's bounds as it runs."""
    if a.index is None:
        start = a.memory.offset.render("_a")
        span = f"{start} <= byte < {start} + {a.memory.elem_bytes * a.memory.extent}"
    else:
        span = f"{_address(a, '_a')} <= byte <= {_address(a, '_a')} + {a.width - 1}"
    text = _set(params, [(a.variables, a.domain, "_a"), (["byte"], [], "")], [span])

    def compute(canonical: str) -> isl.Set:
        touched = isl.Set(canonical)
        return touched.project_out(isl.dim_type.set, 0, touched.dim(isl.dim_type.set) - 1)

    return _cached(_ADDRESSES, text, compute)


def _mixed_radix(writes: list, extent: int) -> list[int]:
    """Strides, largest first and ending in 1, each a multiple of the next and the largest a
    divisor of ``extent``: the coefficients of the writes' indices that form such a chain (a
    tensor's row strides, a tile's offsets), which ``Checker._unwritten`` compares digit by digit.

    The chain is taken from the largest coefficient down, so that a tensor's rows win over a
    tile width that does not divide them: for dlight's 64-wide tiles of 784-element rows
    (``6272*ty + 784*i + 64*tile + tx``) it is [6272, 784, 1], whose digits isl compares at
    once; taken from the smallest up it was [6272, 64, 1], which cut every row at a tile edge
    and took isl about 450 seconds."""
    coefficients = sorted({abs(v) for w in writes for k, v in w.index.terms.items() if k and v}, reverse=True)
    chain = [extent]
    for c in coefficients:
        if c < chain[-1] and chain[-1] % c == 0:
            chain.append(c)
    return [c for c in chain[1:] if c != 1] + [1]


def _point(found: str | isl.Set) -> dict:
    """A point of the set ``found`` (isl text or a set): its parameters' and variables' values."""
    s = isl.Set(found) if isinstance(found, str) else found
    point = s.sample_point()
    space = s.get_space()
    values = {space.get_dim_name(isl.dim_type.param, k): point.get_coordinate_val(isl.dim_type.param, k).to_python()
              for k in range(space.dim(isl.dim_type.param))}
    for k in range(space.dim(isl.dim_type.set)):
        values[space.get_dim_name(isl.dim_type.set, k)] = point.get_coordinate_val(isl.dim_type.set, k).to_python()
    return values


def _address(a: Access, suffix: str) -> str:
    return f"({a.memory.offset.render(suffix)} + {a.memory.elem_bytes}*{a.index.render(suffix)})"


def _interval(a: Access, bounds: dict) -> tuple[float, float]:
    """Bytes an access may touch, by interval arithmetic (a cheap filter before isl)."""
    if a.index is None or a.memory.offset is None:
        return float("-inf"), float("inf")
    if a.block != BLOCK:  # in a tile loop, blockIdx.x <= tile
        bounds = {**bounds, BLOCK: bounds[a.block]}
    lo, hi = _range(a.memory.offset + a.index.scale(a.memory.elem_bytes), bounds)
    return lo, hi + a.width - 1


def _range(form: Form, bounds: dict) -> tuple[float, float]:
    unknown = (float("-inf"), float("inf"))
    lo = hi = 0
    for k, v in form.terms.items():
        if not k:
            lo, hi = lo + v, hi + v
            continue
        if len(k) > 1:
            return unknown
        atom = k[0]
        if isinstance(atom, Modulo):
            b = (0, atom.divisor - 1)
        elif isinstance(atom, Floor):
            inner = _range(Form(dict(atom.form)), bounds)
            b = (inner[0] // atom.divisor, inner[1] // atom.divisor)
        else:
            b = bounds.get(atom, unknown)
        lo, hi = lo + min(v * b[0], v * b[1]), hi + max(v * b[0], v * b[1])
    return lo, hi


class Checker:
    def __init__(self, kernel: Kernel, warps: int):
        self.kernel = kernel
        self.warps = warps
        self.violations: list[str] = []
        self.touched: dict = {}  # id(access) -> _touched_bytes

    def describe(self, a: Access, point: dict, suffix: str) -> str:
        block = point.get(a.block + suffix)
        who = f"tile {block}" if a.block != BLOCK else f"block {block}"
        return f"thread ({point.get(LANE + suffix)},{point.get(WARP_INDEX + suffix)}) of {who}"

    def element(self, a: Access, point: dict, suffix: str) -> str:
        if a.index is None:
            return "?"
        try:
            values = {k.removesuffix(suffix): v for k, v in point.items() if k.endswith(suffix) or _is_parameter(k)}
            return str(_evaluate(a.index, values))
        except (KeyError, TypeError):
            return "?"

    def stage_name(self, stage) -> str:
        if stage is None:
            return "outside the stages' tile loops"
        _, _, name = self.kernel.stages[stage]
        return f"stage {stage}" + (f" (writes {name})" if name else "")

    def bounds(self):
        """Every affine index inside its view and its allocation (interval arithmetic first, isl
        where that cannot tell)."""
        variable_bounds = self.variable_bounds()
        for a in self.kernel.accesses:
            if a.index is None:
                continue
            index = a.index.render("_a")
            outside = []
            known = {**variable_bounds, BLOCK: variable_bounds[a.block]} if a.block != BLOCK else variable_bounds
            low, high = _range(a.index, known)
            if a.memory.extent is not None and not (0 <= low and high < a.memory.extent):
                outside.append((f"({index} < 0 or {index} >= {a.memory.extent})", f"its {a.memory.extent} elements"))
            low, high = _interval(a, variable_bounds)
            if a.memory.offset is not None and a.memory.root_bytes is not None and not (
                    0 <= low and high < a.memory.root_bytes) and not self.touched_within(a, a.memory.root_bytes):
                address = _address(a, "_a")
                outside.append((f"({address} < 0 or {address} + {a.width} > {a.memory.root_bytes})",
                                f"the {a.memory.root_bytes} bytes of its allocation"))
            for condition, what in outside:
                found = _set(self.kernel.params, [(a.variables, a.domain, "_a")], [condition])
                if _is_empty(found):
                    continue
                p = _point(found)
                self.violations.append(
                    f"{self.stage_name(a.stage)}: {self.describe(a, p, '_a')} "
                    f"{'writes' if a.write else 'reads'} {a.memory.scope} {a.buffer}[{self.element(a, p, '_a')}], "
                    f"outside {what} (grid size {p[GRID]}): {a.stmt}")
                break

    def alignment(self):
        """Every vector access (a Ramp printed as one instruction) and every cp.async starts on a
        multiple of its bytes, counted from its allocation's start (a GPU's allocations, global
        and shared, start on at least 16 bytes): else the GPU raises a misaligned address, which
        no CPU run shows (an x86 load may straddle). The coefficients first, isl where they cannot
        tell."""
        for a in self.kernel.accesses:
            if a.align <= a.memory.elem_bytes or a.index is None or a.memory.offset is None:
                continue
            address = a.memory.offset + a.index.scale(a.memory.elem_bytes)
            if all(v % a.align == 0 for k, v in address.terms.items() if a.lane is None or (a.lane,) != k):
                continue
            first = [f"{a.lane}_a = 0"] if a.lane else []
            found = _set(self.kernel.params, [(a.variables, a.domain, "_a")],
                         first + [f"({_address(a, '_a')}) mod {a.align} != 0"])
            if _is_empty(found):
                continue
            p = _point(found)
            try:
                byte = _evaluate(address, {k.removesuffix("_a"): v for k, v in p.items()
                                           if k.endswith("_a") or _is_parameter(k)})
            except (KeyError, TypeError):
                byte = "?"
            self.violations.append(
                f"{self.stage_name(a.stage)}: {self.describe(a, p, '_a')} {'writes' if a.write else 'reads'} "
                f"{a.align} bytes of {a.memory.scope} {a.buffer} from element {self.element(a, p, '_a')}, byte "
                f"{byte} of its allocation, not a multiple of {a.align} (a misaligned address): {a.stmt}")

    def coverage(self):
        """Every element of a stage's global output has exactly one writer thread. Where the
        writes do not depend on the grid and their loops have constant bounds, by enumerating
        every thread's writes (``_enumerated_writes``); else by isl, for every grid size."""
        by_stage: dict = {}
        for a in self.kernel.accesses:
            if a.write and a.stage is not None and a.memory.scope == "global":
                by_stage.setdefault((a.stage, a.buffer), []).append(a)
        for (stage, buffer), writes in by_stage.items():
            where = f"{self.stage_name(stage)}: {buffer}"
            if any(w.index is None or w.approximate for w in writes):
                self.violations.append(f"{where}: coverage cannot be proved (an index or condition is not affine)")
                continue
            tile = self.kernel.stages[stage][0]
            extent = writes[0].memory.extent
            enumerated = self._enumerated_writes(writes, tile)
            if enumerated is not None:
                self._enumerated_coverage(where, extent, *enumerated)
                continue
            parts = []
            for w in writes:
                others = [v + "_a" for v in w.variables if v not in (tile, LANE, WARP_INDEX)]
                domain = " and ".join(c.format(s="_a") for c in w.domain)
                exists = f"exists ({', '.join(others)} : {domain} and e = {w.index.render('_a')})" if others else \
                    f"{domain} and e = {w.index.render('_a')}"
                parts.append(f"[{tile}_a, {LANE}_a, {WARP_INDEX}_a] -> [e] : {exists}")
            written = isl.Map(f"[{', '.join(self.kernel.params)}] -> {{ {'; '.join(parts)} }}")
            if extent is not None:
                missing = self._unwritten(written, extent, _mixed_radix(writes, extent))
                if missing is not None:
                    self.violations.append(f"{where}: element {missing[0]} of {extent} is never written "
                                           f"(grid size {missing[1]})")
                    continue
            if not written.reverse().is_single_valued():
                same = written.apply_range(written.reverse())  # (tile, tx, ty) -> another writing the same element
                twice = same.subtract(isl.Map.identity(same.get_space())).wrap()
                point = twice.sample_point()
                t1, x1, y1, t2, x2, y2 = (point.get_coordinate_val(isl.dim_type.set, k).to_python() for k in range(6))
                self._two_writers(where, (t1, x1, y1), (t2, x2, y2))

    def _two_writers(self, where: str, first: tuple, second: tuple):
        (t1, x1, y1), (t2, x2, y2) = first, second
        self.violations.append(f"{where}: threads ({x1},{y1}) of tile {t1} and ({x2},{y2}) of tile {t2} both "
                               f"write one element (each element must have exactly one writer)")

    def _enumerated_writes(self, writes: list, tile: str) -> tuple[np.ndarray, np.ndarray, int] | None:
        """(element, writer, warps) of every write of ``writes`` by every thread of every tile, the writer
        numbered ``(tile * warps + ty) * 32 + tx``; None where isl must prove it instead: a write
        depends on the grid (beyond the tile loop's own constraints, which every grid size meets
        with block 0 at the loop's first trip), a variable has no constant bounds, or the threads'
        writes are more than ``ENUMERATED_POINTS``.

        The same answer as isl's for a domain that is finite and the same at every grid size, in
        seconds: a tensor-core stage's output through shared memory (nested floors of a 96 x 96
        tile, 99 tiles) took isl's subtraction over 35 minutes."""
        minimum = self.kernel.min_grid
        trip = "i" + tile.removeprefix("T")
        tile_loop = {f"0 <= {BLOCK}{{s}} < {GRID}", f"{GRID} >= {minimum}", f"{BLOCK}{{s}} <= {tile}{{s}}",
                     f"0 <= {trip}{{s}}", f"{minimum}*{trip}{{s}} <= {tile}{{s}} - {BLOCK}{{s}}"}
        warps = None
        parts = []
        for w in writes:
            domain = [c for c in w.domain if c not in tile_loop]
            if not tile_loop <= set(w.domain):
                return None
            names = set(re.findall(r"[A-Za-z_]\w*", " ".join(c.format(s="") for c in domain) + " "
                                   + w.index.render(""))) - {"floor", "mod", "and", "or", "not"}
            if names & {GRID, BLOCK, trip}:
                return None
            bounds = {}
            for c in domain + self.kernel.parameter_domain:
                found = _CONSTANT_BOUNDS.fullmatch(c.format(s=""))
                if found:
                    low, name, high = found.groups()
                    bounds[name] = range(int(low), int(high))
            if not names <= set(bounds) or WARP_INDEX not in bounds or warps not in (None, len(bounds[WARP_INDEX])):
                return None
            warps = len(bounds[WARP_INDEX])
            variables = sorted(names | {tile, LANE, WARP_INDEX})
            if math.prod(len(bounds[v]) for v in variables) > ENUMERATED_POINTS:
                return None
            grids = np.meshgrid(*(np.arange(bounds[v].start, bounds[v].stop, dtype=np.int64) for v in variables),
                                indexing="ij")
            values = {v: g.ravel() for v, g in zip(variables, grids)}
            inside = np.ones(len(values[tile]), dtype=bool)
            for c in domain:
                inside &= np.broadcast_to(_holds(c.format(s=""), values), inside.shape)
            element = np.broadcast_to(np.asarray(_evaluate(w.index, values)), inside.shape)[inside]
            writer = ((values[tile] * warps + values[WARP_INDEX]) * WARP + values[LANE])[inside]
            parts.append((element, writer))
        return np.concatenate([e for e, _ in parts]), np.concatenate([t for _, t in parts]), warps

    def _enumerated_coverage(self, where: str, extent: int | None, element: np.ndarray, writer: np.ndarray,
                             warps: int):
        """``coverage``'s two checks on the enumerated (element, writer) pairs."""
        if extent is not None:
            written = np.zeros(extent, dtype=bool)
            written[element[(element >= 0) & (element < extent)]] = True
            if not written.all():
                self.violations.append(f"{where}: element {int(np.argmin(written))} of {extent} is never written "
                                       f"(grid size {self.kernel.min_grid})")
                return
        writers = int(writer.max(initial=0)) + 1
        pairs = np.sort((element - element.min(initial=0)) * writers + writer)  # (element, writer) pairs
        pairs = pairs[np.concatenate([[True], pairs[1:] != pairs[:-1]])]  # each once (np.unique takes 50x as long)
        repeated = np.flatnonzero(pairs[1:] // writers == pairs[:-1] // writers)
        if len(repeated):
            threads = [int(pairs[k] % writers) for k in (repeated[0], repeated[0] + 1)]
            self._two_writers(where, *((w // (warps * WARP), w % WARP, w // WARP % warps) for w in threads))

    def _unwritten(self, written: isl.Map, extent: int, strides: list[int]) -> tuple[int, int] | None:
        """(an element of ``[0, extent)`` that ``written`` misses, the grid size) or None.

        Compared digit by digit in the mixed radix ``strides`` rather than as flat indices: the
        map from a flat index to its digits is a bijection of ``[0, extent)`` onto a box, so the
        answer is the same, but isl subtracts a tiled matmul's flat indices (nested divisions of
        the tile by its grid's extents) from the flat range for minutes, and their digits in
        well under a second."""
        params = f"[{', '.join(self.kernel.params)}]"
        digits = [f"d{k}" for k in range(len(strides))]
        spans = [extent] + strides[:-1]
        definitions = [f"{d} = floor((e mod {span}) / {stride})" for d, stride, span in zip(digits, strides, spans)]
        to_digits = isl.Map(f"{params} -> {{ [e] -> [{', '.join(digits)}] : 0 <= e < {extent} and "
                            f"{' and '.join(definitions)} }}")
        box = " and ".join([f"0 <= {d} < {span // stride}" for d, stride, span in zip(digits, strides, spans)]
                           + [f"{GRID} >= {self.kernel.min_grid}", *self.kernel.parameter_domain])
        missing = isl.Set(f"{params} -> {{ [{', '.join(digits)}] : {box} }}").subtract(
            written.range().apply(to_digits))
        if missing.is_empty():
            return None
        p = _point(missing)
        return sum(p[d] * stride for d, stride in zip(digits, strides)), p[GRID]

    def races(self):
        bounds = self.variable_bounds()
        groups: dict = {}
        for a in self.kernel.accesses:
            if a.memory.scope.startswith("local") or a.memory.scope == "warp":
                continue
            groups.setdefault(a.memory.root, []).append(a)
        for accesses in groups.values():
            if not any(a.write for a in accesses):
                continue
            spans = [_interval(a, bounds) for a in accesses]
            reported = set()
            for i, a in enumerate(accesses):
                for j, b in enumerate(accesses):
                    if not (a.write or b.write) or a.copy == "issued" or b.copy == "landed":
                        continue
                    if spans[i][1] < spans[j][0] or spans[j][1] < spans[i][0]:
                        continue
                    key = (id(a.statement), id(b.statement), a.buffer, b.buffer)
                    if key in reported or self.same_thread_only(a, b):
                        continue
                    message = self.pair(a, b, i <= j)
                    if message:
                        reported.add(key)
                        self.violations.append(message)
                        if len(self.violations) >= REPORTED:  # enough to refuse the kernel and say why
                            return

    def in_flight(self):
        """No thread touches a cp.async copy's bytes between the copy's issue and the wait that
        retires it: the copy may land at any moment in between, whoever's barriers come between
        (the races check the issue and the landing as writes at either end)."""
        for flight in self.kernel.in_flight:
            issue, landed = flight.issue, flight.landed
            tile = next((lid for lid, (name, is_tile) in self.kernel.loop_info.items()
                         if is_tile and name == issue.block), None)
            for other in self.kernel.accesses:
                if other.memory.root is not issue.memory.root or other is landed or other.stage != issue.stage:
                    continue
                if self.apart(landed, other):
                    continue

                def side(suffix, renamed=None):
                    return lambda lid: (renamed if renamed and lid == flight.loop
                                        else self.kernel.loop_info[lid][0]) + suffix

                after_issue = _precedes(issue.path, side("_a", flight.issued), other.path, side("_b"), tile)
                before_landing = _precedes(other.path, side("_b"), landed.path, side("_a"), tile)
                if not after_issue or not before_landing:
                    continue
                order = [f"(({' or '.join('(' + ' and '.join(c or ['0 = 0']) + ')' for c in after_issue)}) and "
                         f"({' or '.join('(' + ' and '.join(c or ['0 = 0']) + ')' for c in before_landing)}))"]
                same_block = [f"{landed.block}_a = {other.block}_b", f"{BLOCK}_a = {BLOCK}_b"]
                common = []
                if landed.index is not None and other.index is not None and other.memory.offset is not None:
                    x, y = _address(landed, "_a"), _address(other, "_b")
                    common = [f"{x} <= {y} + {other.width - 1}", f"{y} <= {x} + {landed.width - 1}"]
                conflict = _set(self.kernel.params, [(landed.variables, landed.domain, "_a"),
                                                     (other.variables, other.domain, "_b")],
                                common + same_block + order)
                if _is_empty(conflict):
                    continue
                p = _point(conflict)
                verb = "writes" if other.write else "reads"
                self.violations.append(
                    f"{self.stage_name(issue.stage)}: {self.describe(other, p, '_b')} {verb} {other.memory.scope} "
                    f"{other.buffer}[{self.element(other, p, '_b')}] while the cp.async copy of "
                    f"{self.describe(landed, p, '_a')} into {issue.buffer}[{self.element(landed, p, '_a')}] is in "
                    f"flight (issued, not yet retired by the cp.async.wait_group that lands it; grid size {p[GRID]}): "
                    f"{issue.stmt} | {other.stmt}")
                if len(self.violations) >= REPORTED:
                    return

    def touched_bytes(self, a: Access) -> isl.Set:
        if id(a) not in self.touched:
            self.touched[id(a)] = _touched_bytes(self.kernel.params, a)
        return self.touched[id(a)]

    def apart(self, a: Access, b: Access) -> bool:
        """Whether ``a`` and ``b`` touch no byte in common, whichever threads run them (one whose
        index is not affine: anywhere in its view, where the view's place and size are known)."""
        if not (_placed(a) and _placed(b)):
            return False
        return self.touched_bytes(a).intersect(self.touched_bytes(b)).is_empty()

    def touched_within(self, a: Access, size: int) -> bool:
        """Whether every byte ``a`` touches lies in [0, ``size``) (the set races reuse)."""
        return self.touched_bytes(a).is_subset(isl.Set(f"{{ [byte] : 0 <= byte < {size} }}"))

    def same_thread_only(self, a: Access, b: Access) -> bool:
        """Whether ``a`` and ``b`` reach the same bytes only from the same thread of the same
        tile: one address function of (tile, threadIdx.y, threadIdx.x) alone, injective (mixed
        radix), with the tile in it for global memory (else other blocks reach it too)."""
        if a.index is None or b.index is None or a.memory.offset is None or b.memory.offset is None \
                or a.width != b.width or a.memory.elem_bytes != b.memory.elem_bytes:
            return False
        forms = []
        for x in (a, b):
            form = x.memory.offset + x.index.scale(x.memory.elem_bytes)
            forms.append({tuple("T*" if atom == x.block else atom for atom in k): v for k, v in form.terms.items()})
        if forms[0] != forms[1]:
            return False
        ranges = {LANE: WARP, WARP_INDEX: self.warps, "T*": None}
        terms = sorted(((abs(v), k[0]) for k, v in forms[0].items() if k), key=lambda t: t[0])
        if any(len(k) != 1 or k[0] not in ranges for k in forms[0] if k):
            return False
        present = {name for _, name in terms}
        if not {LANE, WARP_INDEX} <= present or (a.memory.scope == "global" and "T*" not in present):
            return False  # the address does not tell the thread (or, in global memory, the block) apart
        if a.block == BLOCK or b.block == BLOCK:
            return False
        reach = a.width - 1
        for coefficient, name in terms:
            if coefficient <= reach:
                return False
            reach += coefficient * ((ranges[name] or 1) - 1)
            if ranges[name] is None and name != terms[-1][1]:
                return False
        return True

    def variable_bounds(self) -> dict:
        bounds = {LANE: (0, WARP - 1), WARP_INDEX: (0, self.warps - 1), BLOCK: (0, float("inf")),
                  **self.kernel.bounds}
        for tile, n, _ in self.kernel.stages.values():
            bounds[tile] = (0, n - 1)
        return bounds

    def pair(self, a: Access, b: Access, same_order: bool) -> str | None:
        """A race between ``a`` (first in program order) and ``b``, or None. One isl question
        for every way they may meet; only when it has an answer, one per way for the message."""
        shared = a.memory.scope.startswith("shared")
        checks = [("block", "same block")] if shared else [("block", "same block"), ("grid", "different blocks")]
        threads = f"({LANE}_a != {LANE}_b or {WARP_INDEX}_a != {WARP_INDEX}_b)"
        ways = []
        for kind, relation in checks:
            for case, extra in self.unseparated(a, b, kind, same_order):
                constraints = list(extra)
                if shared:
                    constraints.append(threads)
                elif kind == "block":
                    constraints += [f"{a.block}_a = {b.block}_b", threads]
                else:
                    constraints.append(f"{a.block}_a != {b.block}_b")
                ways.append((kind, relation, case, constraints))
        if not ways or self.apart(a, b):
            return None
        common = []
        if a.index is not None and b.index is not None and a.memory.offset is not None and b.memory.offset is not None:
            x, y = _address(a, "_a"), _address(b, "_b")
            common = [f"{x} <= {y} + {b.width - 1}", f"{y} <= {x} + {a.width - 1}"]
        domains = [(a.variables, a.domain, "_a"), (b.variables, b.domain, "_b")]
        alternatives = " or ".join("(" + " and ".join(c or ["0 = 0"]) + ")" for *_, c in ways)
        if _is_empty(_set(self.kernel.params, domains, common + [f"({alternatives})"])):
            return None
        for kind, relation, case, constraints in ways:
            conflict = _set(self.kernel.params, domains, common + constraints)
            if _is_empty(conflict):
                continue
            p = _point(conflict)
            approximate = " (over-approximated: an index or condition is not affine)" if (
                a.index is None or b.index is None or a.approximate or b.approximate) else ""
            verb = "both write" if a.write and b.write else "write and read"
            barrier = "__syncthreads" if kind == "block" else "grid barrier"
            stages = self.stage_name(a.stage) + ("" if b.stage == a.stage else f" / {self.stage_name(b.stage)}")
            return (f"{stages}: {self.describe(a, p, '_a')} and {self.describe(b, p, '_b')} "
                    f"({relation}, grid size {p[GRID]}) {verb} {a.memory.scope} {a.buffer}"
                    f"[{self.element(a, p, '_a')}] / {b.buffer}[{self.element(b, p, '_b')}] with no {barrier} "
                    f"between them ({case}){approximate}: {a.stmt} | {b.stmt}")
        return None

    def unseparated(self, a: Access, b: Access, kind: str, same_order: bool):
        """(description, isl constraints) of each way ``a`` then ``b`` can run with no barrier of
        ``kind`` between them; ``same_order``: count the pair where neither comes first."""
        pa, pb = a.path, b.path
        k = 0
        while k < len(pa) and k < len(pb) and pa[k] == pb[k]:
            k += 1
        common = [(n, step[1]) for n, step in enumerate(pa[:k]) if step[0] == "l"]
        equal = [f"{self.kernel.loop_info[lid][0]}_a = {self.kernel.loop_info[lid][0]}_b" for _, lid in common]
        # the same iterations of every common loop
        if k < len(pa) and k < len(pb):
            (ka, sa, ia), (kb, sb, ib) = pa[k], pb[k]
            if ka == "s" and ia < ib:
                between = any(self.kernel.surely[(kind, sa)][ia + 1:ib])
                if not (between or self.after(pa, k + 1, kind) or self.before(pb, k + 1, kind)):
                    yield "in the same iterations", equal
            elif ka == "i" and ia != ib and same_order:  # two branches of one condition run side by side
                if not (self.after(pa, k + 1, kind) or self.before(pb, k + 1, kind)):
                    yield "in the two branches of one condition", equal
        elif len(pa) == k and (len(pb) > k or same_order):  # a's statement holds b (a condition) or is b's
            if not self.before(pb, k, kind):
                yield "in the same statement", equal
        # a in an earlier iteration of a common loop
        for n, (position, lid) in enumerate(common):
            name, is_tile = self.kernel.loop_info[lid]
            if self.after(pa, position + 1, kind) or self.before(pb, position + 1, kind):
                continue
            extra = equal[:n] + [f"{name}_a < {name}_b"]
            if not is_tile and self.kernel.loop_body_surely[(kind, lid)]:
                extra.append(f"{name}_b = {name}_a + 1")
                yield f"in consecutive iterations of loop {name}", extra
            else:
                yield f"in different iterations of loop {name}", extra

    def after(self, path, start: int, kind: str) -> bool:
        """Whether a barrier of ``kind`` surely runs after the point ``path`` within its level ``start``."""
        return any(any(self.kernel.surely[(kind, step[1])][step[2] + 1:]) for step in path[start:] if step[0] == "s")

    def before(self, path, start: int, kind: str) -> bool:
        return any(any(self.kernel.surely[(kind, step[1])][:step[2]]) for step in path[start:] if step[0] == "s")


# The most points (threads x their loops' trips) ``Checker.coverage`` enumerates for one write of a
# stage, at about 100 MB of arrays a million; beyond, isl proves it.
ENUMERATED_POINTS = 1 << 22
# An isl constraint template (formatted) bounding one variable by constants: "(0) <= i7 < (18)".
_CONSTANT_BOUNDS = re.compile(r"\(?(-?\d+)\)? <= ([A-Za-z_]\w*) < \(?(-?\d+)\)?")


def _holds(constraint: str, values: dict) -> np.ndarray | bool:
    """Where the isl constraint text ``constraint`` (``Converter.condition``'s and the loops'
    bounds: affine forms with floor and mod, comparisons, chained or not, and, or, not) holds for
    the arrays of variable ``values``."""
    text = re.sub(r"(?<![<>!=])=(?!=)", "==", constraint.replace(" mod ", " % "))
    return _value(ast.parse(text, mode="eval").body, values)


def _value(node, values: dict):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.BoolOp):
        combine = np.logical_and if isinstance(node.op, ast.And) else np.logical_or
        return functools.reduce(combine, (_value(v, values) for v in node.values))
    if isinstance(node, ast.UnaryOp):
        operand = _value(node.operand, values)
        return np.logical_not(operand) if isinstance(node.op, ast.Not) else -operand
    if isinstance(node, ast.Compare):
        sides = [_value(node.left, values)] + [_value(c, values) for c in node.comparators]
        return functools.reduce(np.logical_and, (_COMPARE[type(op)](a, b)
                                                 for op, a, b in zip(node.ops, sides, sides[1:])))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "floor" \
            and isinstance(node.args[0], ast.BinOp) and isinstance(node.args[0].op, ast.Div):
        return _value(node.args[0].left, values) // _value(node.args[0].right, values)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](_value(node.left, values), _value(node.right, values))
    raise ValueError(f"not an isl constraint the validator writes: {ast.unparse(node)}")


_COMPARE = {ast.Lt: np.less, ast.LtE: np.less_equal, ast.Gt: np.greater, ast.GtE: np.greater_equal,
            ast.Eq: np.equal, ast.NotEq: np.not_equal}
_ARITHMETIC = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply, ast.Mod: np.mod}


def _evaluate(form: Form, values: dict) -> int:
    total = 0
    for k, v in form.terms.items():
        term = v
        for atom in k:
            if isinstance(atom, Floor):
                term *= _evaluate(Form(dict(atom.form)), values) // atom.divisor
            elif isinstance(atom, Modulo):
                term *= _evaluate(Form(dict(atom.form)), values) % atom.divisor
            else:
                term *= values[atom]
        total += term
    return total


@dataclass(frozen=True)
class Validation:
    """What the validator found in one kernel: violations (an error unless empty) and notes
    (where it over-approximated)."""

    kernel: str
    violations: tuple
    notes: tuple


def validate_kernel(func: tirx.PrimFunc, threads: int, name: str = "kernel", counters: dict | None = None,
                    min_grid: int = 1) -> Validation:
    """``func`` checked as a persistent kernel of ``threads``-thread blocks, for every grid size
    from ``min_grid`` (more where on-chip weights assume it); ``counters`` are the ranges (trip
    counts) of its scalar arguments, the host loops' counters."""
    walker = Walker(func, threads // WARP, name, counters or {}, min_grid)
    kernel = walker.run()
    checker = Checker(kernel, threads // WARP)
    checker.violations += kernel.errors
    if not kernel.errors:
        checker.bounds()
        checker.alignment()
        checker.coverage()
        checker.races()
        checker.in_flight()
    return Validation(name, tuple(checker.violations), tuple(dict.fromkeys(kernel.notes)))


def validate_kernels(functions: dict[str, tirx.PrimFunc], threads: int, counters: dict | None = None,
                     min_grids: dict | None = None) -> list[Validation]:
    """Every device function validated (``min_grids``: each kernel's smallest grid, by name);
    a ``ValidationError`` naming the violations if any."""
    results = [validate_kernel(func, threads, name, counters, (min_grids or {}).get(name, 1))
               for name, func in functions.items()]
    failed = [r for r in results if r.violations]
    if failed:
        lines = [f"kernel {r.kernel}: {v}" for r in failed for v in r.violations[:REPORTED]]
        more = sum(len(r.violations) for r in failed) - len(lines)
        raise ValidationError("the CUDA kernel is not thread-safe:\n  " + "\n  ".join(lines)
                              + (f"\n  ... and {more} more" if more > 0 else ""))
    return results
