"""Mutation testing of the thread-level validator (``analysis.threads``).

Takes the CUDA kernels of every tiny model at every opt level, as TVM lowers them for the code
generator, keeps those the validator accepts (the others are main's known defects, listed with
the validator's messages), injects classic faults into their TIR, and asks two judges about
each mutant:

- the validator (static, isl, every grid size);
- an independent concrete run (``Concrete``): every thread of every block of a small grid
  executes the kernel's index arithmetic (no data), with per-thread counts of the
  ``__syncthreads`` and grid barriers it passed; two accesses to one word, one a write, by
  different threads with the same barrier counts (the block's count for threads of one block,
  the grid barrier count across blocks) are a race; a stage's output element written by no
  thread or by two, an index outside its buffer, a barrier not every thread reaches, a launch
  shape the code does not declare, a vector access TVM prints as one instruction that does not
  start on a multiple of its bytes are faults too. It runs at two grid sizes.

The tiny models' kernels have no vector stores, so ``misalign_vector`` (a vector store moved one
element off its bytes) finds its sites in the tensor-core kernels of tests/test_tensor_core.py.

A mutant the concrete run finds unsafe must be rejected (else a false accept); one it finds
harmless (a barrier that orders nothing) is counted apart, accepted or not.

    python scripts/validate_mutants.py [--models lstm,bert,resnext,mmoe] [--levels 0,1,2,3,4]
                                       [--per-kind 4] [--seed 0]

prints the counts per fault kind and writes benchmarks/results/validate_mutants.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tvm  # noqa: E402
from tvm import tirx  # noqa: E402
from tvm.ir.expr import TensorLoad  # noqa: E402

from analysis.threads import device_functions, one_vector_instruction, validate_kernel  # noqa: E402
from benchmarks import common  # noqa: E402
from codegen.cuda import device_module  # noqa: E402
from souffle import models  # noqa: E402
from souffle.compiler import run_passes  # noqa: E402

UNBUILT: list[str] = []  # mutants whose TIR could not be rebuilt (listed in the results, not counted)
KINDS = ("drop_syncthreads", "drop_grid_barrier", "fewer_threads", "collapse_reduction", "barrier_under_if",
         "shift_store", "neighbour_read", "misalign_vector")
WARP = 32
PACKAGES = ("apache-tvm", "islpy", "numpy")


# -- the kernels ---------------------------------------------------------------------------------
@dataclass
class Kernel:
    config: str  # "model O<level>"
    name: str
    func: tirx.PrimFunc
    counters: dict
    min_grid: int
    threads: int


def kernels(model: str, level: int, config: str = "tiny") -> list[Kernel]:
    """Every kernel of ``model`` at ``level``, as TVM hands it to the CUDA code generator."""
    plan = run_passes(models.build(model, config=config), "cuda", stop="kernel_plan", opt_level=level).ir
    counters, min_grids = plan.host_loop_trips(), plan.min_grids()
    functions = device_functions(device_module(plan.funcs, "sm_90"))
    return [Kernel(f"{model} O{level}", name, func, counters, min_grids.get(name, 1), plan.staged.threads)
            for name, func in functions.items()]


def validate(kernel: Kernel, func: tirx.PrimFunc | None = None):
    return validate_kernel(func if func is not None else kernel.func, kernel.threads, kernel.name, kernel.counters,
                           kernel.min_grid)


# -- rewriting TIR -------------------------------------------------------------------------------
def rewrite_expr(e, fn):
    """``e`` rebuilt: ``fn`` applied to every node, outermost first (it returns the node, or a
    replacement that is not looked into)."""
    replaced = fn(e)
    if not replaced.same_as(e):
        return replaced
    if isinstance(e, TensorLoad):
        e = tirx.BufferLoad(e.source, [rewrite_expr(i, fn) for i in e.indices])
    elif isinstance(e, tvm.ir.Call):
        e = tvm.ir.Call(e.op, [rewrite_expr(a, fn) for a in e.args], attrs=e.attrs, ret_ty=e.ty)
    elif isinstance(e, tirx.Cast):
        e = tirx.Cast(e.ty, rewrite_expr(e.value, fn))
    elif isinstance(e, tirx.Let):
        e = tirx.Let(e.var, rewrite_expr(e.value, fn), rewrite_expr(e.body, fn))
    elif isinstance(e, tirx.Select):
        e = tirx.Select(rewrite_expr(e.condition, fn), rewrite_expr(e.true_value, fn), rewrite_expr(e.false_value, fn))
    elif isinstance(e, tirx.Ramp):
        e = tirx.Ramp(rewrite_expr(e.base, fn), rewrite_expr(e.stride, fn), e.lanes)
    elif isinstance(e, tirx.Broadcast):
        e = tirx.Broadcast(rewrite_expr(e.value, fn), e.lanes)
    elif isinstance(e, tirx.Not):
        e = tirx.Not(rewrite_expr(e.a, fn))
    elif hasattr(e, "a") and hasattr(e, "b"):
        e = type(e)(rewrite_expr(e.a, fn), rewrite_expr(e.b, fn))
    return e


def rewrite(s, fn, efn=None):
    """``s`` rebuilt: ``fn`` on every statement, outermost first (a replacement is not looked
    into), ``efn`` on every expression."""
    def expr(e):
        return e if efn is None or e is None else rewrite_expr(e, efn)

    replaced = fn(s)
    if not replaced.same_as(s):
        return replaced
    if isinstance(s, tirx.SeqStmt):
        s = tirx.SeqStmt([rewrite(c, fn, efn) for c in s.seq])
    elif isinstance(s, tirx.For):
        s = tirx.For(s.loop_var, expr(s.min), expr(s.extent), s.kind, rewrite(s.body, fn, efn), s.thread_binding,
                     s.annotations)
    elif isinstance(s, tirx.IfThenElse):
        s = tirx.IfThenElse(expr(s.condition), rewrite(s.then_case, fn, efn),
                            None if s.else_case is None else rewrite(s.else_case, fn, efn))
    elif isinstance(s, tirx.AttrStmt):
        s = tirx.AttrStmt(s.node, s.attr_key, s.value, rewrite(s.body, fn, efn))
    elif isinstance(s, tirx.BufferStore):
        s = tirx.BufferStore(s.buffer, expr(s.value), [expr(i) for i in s.indices])
    elif isinstance(s, tirx.Evaluate):
        s = tirx.Evaluate(expr(s.value))
    elif isinstance(s, tirx.Bind):
        s = tirx.Bind(s.var, expr(s.value))
    return s


def statements(s):
    """Every statement of ``s``, in program order."""
    yield s
    for child in ([*s.seq] if isinstance(s, tirx.SeqStmt) else
                  [s.then_case] + ([s.else_case] if s.else_case is not None else []) if isinstance(s, tirx.IfThenElse)
                  else [s.body] if isinstance(s, (tirx.For, tirx.AttrStmt)) else []):
        yield from statements(child)


def mentions(e, var) -> bool:
    found = []

    def look(x):
        if isinstance(x, tirx.Var) and x.same_as(var):
            found.append(x)
        return x

    rewrite_expr(e, look)
    return bool(found)


def is_barrier(s, op: str) -> bool:
    return isinstance(s, tirx.Evaluate) and isinstance(s.value, tvm.ir.Call) and s.value.op.name == op and (
        op != "tirx.tvm_storage_sync" or s.value.args[0].value in ("shared", "shared.dyn"))


def thread_vars(func) -> dict:
    return {s.node.thread_tag: s.node.var for s in statements(func.body)
            if isinstance(s, tirx.AttrStmt) and s.attr_key == "thread_extent"}


def grid_var(func):
    return next(p for p in func.params if p.name == "grid_size")


def tile_loops(func) -> list:
    grid, block = grid_var(func), thread_vars(func)["blockIdx.x"]
    return [s for s in statements(func.body) if isinstance(s, tirx.For) and mentions(s.extent, grid)
            and mentions(s.extent, block)]


def scope_of(buffer) -> str:
    return buffer.scope()


def replace_one(func, target, new) -> tirx.PrimFunc:
    """``func`` with the statement ``target`` (by identity) replaced by ``new``."""
    body = rewrite(func.body, lambda s: new if s.same_as(target) else s)
    return func.with_body(body)


# -- the faults ----------------------------------------------------------------------------------
def sites(kernel: Kernel) -> dict[str, list]:
    """Each fault kind's mutants of ``kernel``: (description, mutated PrimFunc) makers."""
    func = kernel.func
    threads = thread_vars(func)
    tx, ty, bx = threads.get("threadIdx.x"), threads.get("threadIdx.y"), threads.get("blockIdx.x")
    found: dict[str, list] = defaultdict(list)
    stmts = list(statements(func.body))
    tiles = tile_loops(func)
    for n, s in enumerate(stmts):
        for op, kind in (("tirx.tvm_storage_sync", "drop_syncthreads"), ("tirx.cuda.grid_sync", "drop_grid_barrier")):
            if is_barrier(s, op):
                found[kind].append((f"{op.split('.')[-1]} #{n} removed",
                                    lambda s=s: replace_one(func, s, tirx.Evaluate(tirx.const(0, "int32")))))
                found["barrier_under_if"].append((f"{op.split('.')[-1]} #{n} under if (threadIdx.x < 16)",
                                                  lambda s=s: replace_one(func, s, tirx.IfThenElse(tx < 16, s, None))))
    for k, loop in enumerate(tiles):
        var = ty if mentions_any(loop.body, ty) else tx
        half = (kernel.threads // WARP) // 2 if var is ty else WARP // 2
        if half >= 1 and mentions_any(loop.body, var):
            found["fewer_threads"].append((
                f"stage {k}: its {var.name} loop bound to {half} threads",
                lambda loop=loop, var=var, half=half: replace_one(func, loop, tirx.For(
                    loop.loop_var, loop.min, loop.extent, loop.kind,
                    rewrite(loop.body, lambda s: s, lambda e: tirx.floormod(e, half) if isinstance(e, tirx.Var)
                            and e.same_as(var) else e), loop.thread_binding, loop.annotations))))
    for k, loop in enumerate(tiles):
        for s in statements(loop.body):
            stage_sites(func, k, s, tx, bx, found)
    return found


def stage_sites(func, k: int, s, tx, bx, found: dict):
    """The faults of statement ``s`` of stage ``k``."""
    if isinstance(s, tirx.BufferStore) and not scope_of(s.buffer).startswith("local"):
        index = s.indices[0]
        if scope_of(s.buffer) == "global" and not isinstance(index, tirx.Ramp):
            found["shift_store"].append((f"stage {k}: store to {s.buffer.name} at index + 1",
                                         lambda s=s, index=index: replace_one(func, s, tirx.BufferStore(
                                             s.buffer, s.value, [index + 1]))))
        if mentions(index, tx) and "float" in str(s.buffer.dtype) and not isinstance(index, tirx.Ramp):
            collapsed = rewrite_expr(index, lambda e: tirx.const(0, str(e.ty.dtype)) if isinstance(e, tirx.Var)
                                     and e.same_as(tx) else e)
            found["collapse_reduction"].append((
                f"stage {k}: {s.buffer.name}'s 32 lanes accumulate into one word",
                lambda s=s, collapsed=collapsed: replace_one(func, s, tirx.BufferStore(
                    s.buffer, tirx.BufferLoad(s.buffer, [collapsed]) + s.value, [collapsed]))))
    if isinstance(s, tirx.IfThenElse) and isinstance(s.then_case, tirx.BufferStore) \
            and mentions(s.condition, tx) and not scope_of(s.then_case.buffer).startswith("local") \
            and "float" in str(s.then_case.buffer.dtype):
        store = s.then_case
        found["collapse_reduction"].append((
            f"stage {k}: the lane-0 store to {store.buffer.name} done by every lane, accumulating",
            lambda s=s, store=store: replace_one(func, s, tirx.BufferStore(
                store.buffer, tirx.BufferLoad(store.buffer, store.indices) + store.value, store.indices))))
    if isinstance(s, tirx.BufferStore) and not scope_of(s.buffer).startswith("local") \
            and one_vector_instruction(s.indices[0], int(getattr(s.indices[0], "lanes", 1)), write=True):
        ramp = s.indices[0]
        found["misalign_vector"].append((
            f"stage {k}: its {int(ramp.lanes)}-lane vector store to {s.buffer.name} one element later",
            lambda s=s, ramp=ramp: replace_one(func, s, tirx.BufferStore(
                s.buffer, s.value, [tirx.Ramp(ramp.base + 1, ramp.stride, ramp.lanes)]))))
    if isinstance(s, tirx.BufferStore):
        loads = []
        rewrite_expr(s.value, lambda e: loads.append(e) or e if isinstance(e, TensorLoad)
                     and scope_of(e.source) == "global" and mentions(e.indices[0], bx)
                     and not isinstance(e.indices[0], tirx.Ramp) else e)
        for load in loads[:1]:
            def neighbour(s=s, load=load):
                def shift(e):
                    if isinstance(e, TensorLoad) and e.same_as(load):
                        return tirx.BufferLoad(e.source, [rewrite_expr(e.indices[0], lambda x: x + 1 if isinstance(
                            x, tirx.Var) and x.same_as(bx) else x)])
                    return e
                return replace_one(func, s, tirx.BufferStore(s.buffer, rewrite_expr(s.value, shift), s.indices))
            found["neighbour_read"].append((f"stage {k}: {s.buffer.name} reads {load.source.name} of the "
                                            f"next block's tile", neighbour))


def mentions_any(s, var) -> bool:
    if var is None:
        return False
    for x in statements(s):
        for e in ([x.value, *x.indices] if isinstance(x, tirx.BufferStore) else [x.condition]
                  if isinstance(x, tirx.IfThenElse) else [x.value] if isinstance(x, (tirx.Evaluate, tirx.Bind)) else []):
            if mentions(e, var):
                return True
    return False


# -- the independent judge: a concrete run of the index arithmetic ---------------------------------
BINARY = {tirx.Add: np.add, tirx.Sub: np.subtract, tirx.Mul: np.multiply, tirx.FloorDiv: np.floor_divide,
          tirx.FloorMod: np.mod, tirx.Min: np.minimum, tirx.Max: np.maximum, tirx.LT: np.less, tirx.LE: np.less_equal,
          tirx.GT: np.greater, tirx.GE: np.greater_equal, tirx.EQ: np.equal, tirx.NE: np.not_equal,
          tirx.And: np.logical_and, tirx.Or: np.logical_or, tirx.RShift: np.right_shift,
          tirx.BitwiseAnd: np.bitwise_and, tirx.LShift: np.left_shift,
          tirx.Div: lambda a, b: np.trunc(np.divide(a, b)).astype(np.int64), tirx.Mod: np.fmod}


class DataDependent(Exception):
    """An integer that depends on data the concrete run does not compute."""


class Concrete:
    """Runs ``func``'s control flow and index arithmetic for every thread of ``grid`` blocks at
    once (numpy vectors of ``grid * threads`` lanes) and collects what makes the kernel unsafe."""

    def __init__(self, func, threads: int, grid: int, counters: dict):
        self.func = func
        self.threads = threads
        self.grid = grid
        n = grid * threads
        self.n = n
        lane = np.arange(n)
        self.block = lane // threads
        self.values = {"blockIdx.x": self.block, "threadIdx.x": lane % WARP, "threadIdx.y": (lane % threads) // WARP}
        self.env: dict = {}
        for p in func.params:
            if p.name == "grid_size":
                self.env[p] = np.int64(grid)
            elif p.name in counters:
                self.env[p] = np.int64(counters[p.name] - 1)  # the last host iteration
        self.views: dict = {}  # buffer -> (root, byte offset (vector), element bytes, extent or None, root bytes)
        self.block_epoch = np.zeros(n, np.int64)
        self.grid_epoch = np.zeros(n, np.int64)
        self.events: list = []
        self.faults: list[str] = []
        self.stage = None
        self.stages = 0
        self.coverage: dict = {}

    # integers
    def ev(self, e):
        kind = type(e)
        op = BINARY.get(kind)
        if op is not None:
            return op(self.ev(e.a), self.ev(e.b))
        if kind is tirx.IntImm:
            return np.int64(e.value)
        if kind is tirx.Var:
            if e in self.env:
                return self.env[e]
            raise DataDependent(e.name)
        if kind is tirx.Cast:
            return self.ev(e.value)
        if kind is TensorLoad:
            raise DataDependent("a load")
        if kind is tirx.Let:
            self.env[e.var] = self.ev(e.value)
            return self.ev(e.body)
        if kind is tirx.Select:
            return np.where(self.ev(e.condition), self.ev(e.true_value), self.ev(e.false_value))
        if kind is tvm.ir.Call and e.op.name in ("prim.if_then_else", "tirx.if_then_else"):
            return np.where(self.ev(e.args[0]), self.ev(e.args[1]), self.ev(e.args[2]))
        if kind is tvm.ir.Call and e.op.name in ("tirx.likely", "prim.likely"):
            return self.ev(e.args[0])
        if kind is tirx.Not:
            return np.logical_not(self.ev(e.a))
        raise DataDependent(kind.__name__)

    def vec(self, x):
        return np.broadcast_to(np.asarray(x), (self.n,))

    # memory
    def view(self, buffer):
        if buffer not in self.views:
            extent = int(np.prod([int(d) for d in buffer.shape])) if all(
                isinstance(d, tirx.IntImm) for d in buffer.shape) else None
            size = buffer.dtype.bits * buffer.dtype.lanes // 8
            self.views[buffer] = (buffer, np.int64(0), size, extent, None if extent is None else extent * size)
        return self.views[buffer]

    def declare(self, s):
        buffer, data = s.buffer, s.data
        size = buffer.dtype.bits * buffer.dtype.lanes // 8
        extent = int(np.prod([int(d) for d in buffer.shape])) if all(
            isinstance(d, tirx.IntImm) for d in buffer.shape) else None
        if isinstance(data, tvm.ir.Call) and data.op.name == "tirx.buffer_data":
            root, offset, _, _, root_bytes = self.view(data.args[0])
            self.views[buffer] = (root, offset, size, None, root_bytes)
        elif isinstance(data, tvm.ir.Call) and data.op.name == "tirx.address_of":
            load = data.args[0]
            root, offset, parent_size, _, root_bytes = self.view(load.source)
            try:
                offset = offset + self.ev(load.indices[0]) * parent_size
            except DataDependent:
                offset = None
            self.views[buffer] = (root, offset, size, extent, root_bytes)
        else:
            self.views[buffer] = (buffer, np.int64(0), size, extent, None if extent is None else extent * size)

    def access(self, buffer, index, write: bool, mask):
        if not mask.any():
            return
        root, offset, size, extent, root_bytes = self.view(buffer)
        if offset is not None and isinstance(index, tirx.Ramp):
            self.check_alignment(buffer, index, write, mask, offset)
        lanes = [index]
        if isinstance(index, tirx.Ramp):
            lanes = [index.base + index.stride * k for k in range(int(index.lanes))]
            size = buffer.dtype.bits // 8
        for lane in lanes:
            try:
                element = self.vec(self.ev(lane))
            except DataDependent:
                continue
            ids = np.nonzero(mask)[0]
            element = element[ids]
            if extent is not None and ((element < 0) | (element >= extent)).any():
                outside = (element < 0) | (element >= extent)
                bad = ids[outside][0]
                self.faults.append(f"out of bounds: {buffer.name}[{int(element[outside][0])}] of {extent} "
                                   f"by thread {bad % self.threads} of block {bad // self.threads}")
                ids, element = ids[~outside], element[~outside]  # the others' accesses still count
                if not len(ids):
                    continue
            if offset is None:
                continue
            address = self.vec(offset)[ids] + element * size
            if root_bytes is not None and ((address < 0) | (address + size > root_bytes)).any():
                self.faults.append(f"out of bounds: {buffer.name} beyond its allocation's {root_bytes} bytes")
                continue
            if buffer.scope().startswith("local"):
                continue
            self.events.append((root, buffer.scope(), address // 4, ids, write, self.block_epoch[ids].copy(),
                                self.grid_epoch[ids].copy()))
            if write and self.stage is not None and buffer.scope() == "global" and extent is not None:
                self.coverage.setdefault((self.stage, buffer), (extent, []))[1].append((element, ids))

    def check_alignment(self, buffer, index, write: bool, mask, offset):
        """A vector access TVM prints as one instruction (``one_vector_instruction``) must start on
        a multiple of its bytes, counted from its allocation (which starts on 16): else the GPU
        raises a misaligned address."""
        lanes = int(index.lanes)
        if not one_vector_instruction(index, lanes, write):
            return
        try:
            first = self.vec(self.ev(index.base))
        except DataDependent:
            return
        element = buffer.dtype.bits // 8
        address = (self.vec(offset) + first * element)[mask]
        if (address % (lanes * element)).any():
            self.faults.append(f"misaligned: a {lanes * element}-byte vector {'store to' if write else 'load from'} "
                               f"{buffer.name} at byte {int(address[address % (lanes * element) != 0][0])} "
                               f"of its allocation")

    def loads(self, e, mask):
        def visit(x, mask):
            if isinstance(x, TensorLoad):
                for i in x.indices:
                    visit(i, mask)
                self.access(x.source, x.indices[0], False, mask)
            elif isinstance(x, tvm.ir.Call):
                if x.op.name == "tirx.address_of":
                    return
                if x.op.name in ("prim.if_then_else", "tirx.if_then_else"):
                    visit(x.args[0], mask)
                    try:
                        cond = self.vec(self.ev(x.args[0])).astype(bool)
                        visit(x.args[1], mask & cond)
                        visit(x.args[2], mask & ~cond)
                    except DataDependent:
                        visit(x.args[1], mask)
                        visit(x.args[2], mask)
                    return
                for a in x.args:
                    visit(a, mask)
            elif isinstance(x, tirx.Let):
                visit(x.value, mask)
                try:
                    self.env[x.var] = self.ev(x.value)
                except DataDependent:
                    pass
                visit(x.body, mask)
            elif type(x) in BINARY:
                visit(x.a, mask)
                visit(x.b, mask)
            elif isinstance(x, (tirx.Cast, tirx.Broadcast)):
                visit(x.value, mask)
            elif isinstance(x, tirx.Select):
                visit(x.condition, mask)
                visit(x.true_value, mask)
                visit(x.false_value, mask)
            elif isinstance(x, tirx.Ramp):
                visit(x.base, mask)
            elif isinstance(x, tirx.Not):
                visit(x.a, mask)

        visit(e, mask)

    # control
    def run(self) -> list[str]:
        self.execute(self.func.body, np.ones(self.n, bool))
        self.check()
        return self.faults

    def barrier(self, mask, grid: bool):
        blocks = self.block
        reached = np.bincount(blocks[mask], minlength=self.grid)
        if grid and not mask.all():
            self.faults.append("deadlock: a grid barrier not every thread reaches")
        elif not grid and ((reached != 0) & (reached != self.threads)).any():
            self.faults.append("deadlock: a __syncthreads not every thread of a block reaches")
        self.block_epoch[mask] += 1
        if grid:
            self.grid_epoch[mask] += 1

    def execute(self, s, mask):
        if not mask.any():
            return
        if isinstance(s, tirx.SeqStmt):
            for child in s.seq:
                self.execute(child, mask)
        elif isinstance(s, tirx.DeclBuffer):
            self.declare(s)
        elif isinstance(s, tirx.AllocBuffer):
            self.view(s.buffer)
        elif isinstance(s, tirx.Bind):
            try:
                self.env[s.var] = self.ev(s.value)
            except DataDependent:
                self.env.pop(s.var, None)
        elif isinstance(s, tirx.AttrStmt):
            if s.attr_key == "thread_extent":
                tag = s.node.thread_tag
                expected = {"blockIdx.x": None, "threadIdx.x": WARP, "threadIdx.y": self.threads // WARP}.get(tag, 1)
                value = s.value
                if expected is not None and not (isinstance(value, tirx.IntImm) and value.value == expected):
                    self.faults.append(f"launch fit: {tag} declared over {value}, launched over {expected}")
                self.env[s.node.var] = self.values.get(tag, np.int64(0))
            self.execute(s.body, mask)
        elif isinstance(s, tirx.For):
            extent = self.vec(self.ev(s.extent) + 0)
            low = self.vec(self.ev(s.min) + 0)
            tile = mentions(s.extent, grid_var(self.func)) and "blockIdx" in str(s.extent)
            if tile:
                self.stage = self.stages
                self.stages += 1
            trips = int((extent[mask]).max(initial=0))
            for k in range(trips):
                self.env[s.loop_var] = low + k
                self.execute(s.body, mask & (k < extent))
            if tile:
                self.stage = None
        elif isinstance(s, tirx.IfThenElse):
            self.loads(s.condition, mask)
            try:
                cond = self.vec(self.ev(s.condition)).astype(bool)
                self.execute(s.then_case, mask & cond)
                if s.else_case is not None:
                    self.execute(s.else_case, mask & ~cond)
            except DataDependent:
                self.execute(s.then_case, mask)
                if s.else_case is not None:
                    self.execute(s.else_case, mask)
        elif isinstance(s, tirx.BufferStore):
            self.loads(s.value, mask)
            for i in s.indices:
                self.loads(i, mask)
            self.access(s.buffer, s.indices[0], True, mask)
        elif isinstance(s, tirx.Evaluate):
            if is_barrier(s, "tirx.cuda.grid_sync"):
                self.barrier(mask, True)
            elif is_barrier(s, "tirx.tvm_storage_sync"):
                self.barrier(mask, False)
            elif isinstance(s.value, tvm.ir.Call):
                self.loads(s.value, mask)

    def check(self):
        self.check_races()
        for (stage, buffer), (extent, writes) in self.coverage.items():
            elements = np.concatenate([e for e, _ in writes])
            ids = np.concatenate([i for _, i in writes])
            pairs = np.unique(np.stack([elements, ids]), axis=1)
            writers = np.bincount(pairs[0], minlength=extent)
            if (writers == 0).any():
                self.faults.append(f"coverage: stage {stage} never writes {buffer.name}[{int(np.argmin(writers))}]")
            if (writers > 1).any():
                self.faults.append(f"coverage: stage {stage} writes {buffer.name}[{int(np.argmax(writers))}] "
                                   f"from {int(writers.max())} threads")

    def check_races(self):
        """Two accesses to one word, one a write, race when they come from two threads of one
        block with the same __syncthreads count, or from two blocks with the same grid barrier
        count (shared memory belongs to its block)."""
        by_root: dict = defaultdict(list)
        for root, scope, words, ids, write, block_epoch, grid_epoch in self.events:
            by_root[(root, scope)].append((words, ids, np.full(len(ids), write), block_epoch, grid_epoch))
        for (root, scope), events in by_root.items():
            words, ids, writes, block_epochs, grid_epochs = (np.concatenate(column) for column in zip(*events))
            blocks = ids // self.threads
            checks = [("threads of one block", (words, blocks, block_epochs), ids)]
            if not scope.startswith("shared"):
                checks.append(("blocks", (words, grid_epochs), blocks))
            for kind, key, who in checks:
                group = np.unique(np.stack(key), axis=1, return_inverse=True)[1].reshape(-1)
                groups = group.max() + 1
                written = np.bincount(group, weights=writes.astype(float), minlength=groups) > 0
                distinct = np.unique(np.stack([group, who]), axis=1)[0]
                racy = written & (np.bincount(distinct, minlength=groups) > 1)
                if racy.any():
                    word = int(words[group == int(np.argmax(racy))][0])
                    self.faults.append(f"race: {root.name} word {word} between {kind}, no barrier between them")
                    break


def concrete_faults(kernel: Kernel, func) -> list[str]:
    """What the concrete run finds at two grid sizes (the smallest the kernel allows, and one more)."""
    faults = []
    for grid in (kernel.min_grid, kernel.min_grid + 1):
        faults += Concrete(func, kernel.threads, grid, kernel.counters).run()
    return list(dict.fromkeys(faults))


# -- the run -------------------------------------------------------------------------------------
def mutants(kernel_list: list[Kernel], per_kind: int, rng: random.Random):
    """Up to ``per_kind`` mutants of each kind, spread over the kernels, as (kind, kernel, what, func)."""
    by_kind: dict = defaultdict(list)
    for kernel in kernel_list:
        for kind, made in sites(kernel).items():
            by_kind[kind] += [(kernel, what, make) for what, make in made]
    for kind in KINDS:
        chosen = by_kind[kind]
        rng.shuffle(chosen)
        for kernel, what, make in chosen[:per_kind]:
            try:
                func = make()
            except (AttributeError, TypeError, ValueError, RuntimeError) as err:  # a site TIR cannot rebuild
                UNBUILT.append(f"{kernel.config} {kernel.name} {kind}: {what}: {type(err).__name__}: {err}")
                continue
            yield kind, kernel, what, func


def judge(kind: str, kernel: Kernel, what: str, func) -> dict:
    began = time.perf_counter()
    verdict = validate(kernel, func)
    seconds = time.perf_counter() - began
    faults = concrete_faults(kernel, func)
    rejected = bool(verdict.violations)
    outcome = ("rejected unsafe" if rejected and faults else "FALSE ACCEPT" if faults else
               "rejected harmless" if rejected else "accepted harmless")
    return {"kind": kind, "config": kernel.config, "kernel": kernel.name, "mutant": what, "outcome": outcome,
            "validator": verdict.violations[0] if rejected else "accepted", "concrete": faults[:2],
            "validate_seconds": round(seconds, 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="lstm,bert,resnext,mmoe")
    parser.add_argument("--levels", default="0,1,2,3,4")
    parser.add_argument("--per-kind", type=int, default=4, help="mutants of each fault kind per model and level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only, write no results")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    rows, baselines = [], []
    for model in args.models.split(","):
        for level in map(int, args.levels.split(",")):
            correct = []
            for kernel in kernels(model, level):
                verdict = validate(kernel)
                if verdict.violations:
                    faults = concrete_faults(kernel, kernel.func)
                    baselines.append({"config": kernel.config, "kernel": kernel.name,
                                      "validator": list(verdict.violations[:3]), "concrete": faults[:3]})
                else:
                    correct.append(kernel)
            print(f"{model} O{level}: {len(correct)} kernels accepted, "
                  f"{sum(b['config'] == f'{model} O{level}' for b in baselines)} rejected", flush=True)
            for kind, kernel, what, func in mutants(correct, args.per_kind, rng):
                rows.append(judge(kind, kernel, what, func))
    counts = {kind: Counter(r["outcome"] for r in rows if r["kind"] == kind) for kind in KINDS}
    outcomes = ("rejected unsafe", "rejected harmless", "accepted harmless", "FALSE ACCEPT")
    table = ["| fault kind | mutants | " + " | ".join(outcomes) + " |", "|---|---|" + "---|" * len(outcomes)]
    for kind in KINDS:
        table.append(f"| {kind} | {sum(counts[kind].values())} | "
                     + " | ".join(str(counts[kind][o]) for o in outcomes) + " |")
    total = Counter(r["outcome"] for r in rows)
    table.append(f"| all | {len(rows)} | " + " | ".join(str(total[o]) for o in outcomes) + " |")
    lines = ["# Mutation testing of the thread-level validator", "", f"`{common.command()}`", "", *table, "",
             f"Unmodified kernels the validator rejects (main's known defects; the concrete run's verdict "
             f"beside): {len(baselines)}", ""]
    for b in baselines:
        lines.append(f"- {b['config']} {b['kernel']}: {b['validator'][0][:400]}  \n  concrete run: "
                     f"{'; '.join(b['concrete']) or 'nothing found at its grid sizes'}")
    lines += ["", f"Mutants that could not be built (not counted): {len(UNBUILT)}", *[f"- {u}" for u in UNBUILT]]
    text = "\n".join(lines)
    print(text)
    for r in rows:
        if r["outcome"] in ("FALSE ACCEPT", "rejected harmless"):
            print(f"{r['outcome']}: {r['config']} {r['kernel']} {r['mutant']}: {r['concrete'] or r['validator']}")
    if not args.no_write:
        payload = {"command": common.command(), "machine": common.machine(), "versions": common.versions(*PACKAGES),
                   "counts": {k: dict(v) for k, v in counts.items()}, "mutants": rows, "rejected_baselines": baselines}
        common.write("validate_mutants", payload, text)
    return 1 if total["FALSE ACCEPT"] else 0


if __name__ == "__main__":
    sys.exit(main())
