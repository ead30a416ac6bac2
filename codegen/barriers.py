"""The ``place_barriers`` pass (O4): a grid barrier only where data crosses blocks.

A barrier goes before a stage only where it reads memory another block may have written since
the last barrier (or overwrites memory another block may still be reading). "Another block" is
decided with the analysis' access relations: a stage whose every tile reads only elements the
same-numbered tile of the writer wrote runs in the same block after it (tile ``t`` runs on block
``t mod grid`` in every stage), so it needs none. Loop bodies are analysed twice, the second time
as the next iteration, so loop-carried dependences get their barrier too.

Where the data stays in the block but may cross its threads (a tile's threads do not write and
read the same elements: a reduction's result is written by one lane and read by all, an
epilogue's tile is spread over the block in another order), a ``__syncthreads`` goes before the
stage instead (``Stage.block_barrier``): within a block it orders global memory as well as
shared. Neither is needed where every element is read by the thread that wrote it: both stages
compute each element in the thread at its place in the tile (``same_thread``, with isl).
"""

from __future__ import annotations

from dataclasses import dataclass

import islpy as isl
from tvm import te, tirx

from analysis.dependence import IslWriter, NotAffine
from codegen.staged import (Loop, Stage, StagedProgram, copy_items, flat_index, loops_in, same_tiles, stage_tiles,
                            stages_in)
from codegen.stitch import BufferRef


@dataclass
class _Access:
    stage: Stage
    ref: BufferRef
    placeholder: te.Tensor | None  # the reader's placeholder; None for a write
    stale: frozenset = frozenset()  # loop variables that advanced since the access


class _Scope:
    """The loops around the stage being placed: each loop variable's trip count, and which
    are in scope (an access recorded inside a loop that has ended happened at every trip)."""

    def __init__(self):
        self.trips: dict = {}
        self.open: list = []


def _offset_text(offset, writer: IslWriter) -> str:
    return str(offset) if isinstance(offset, int) else writer.aff(offset).text


def _same_memory(earlier: _Access, ref: BufferRef, scope: _Scope) -> str:
    """'disjoint', 'same' (every element ``earlier`` may have touched there is the element at
    the same place of ``ref``), or 'unknown' (partly overlapping, or not provable).

    Offsets may depend on loop variables (a scan's ping-pong slots, sliced sequences): isl
    decides over all trips. A variable the earlier access saw an earlier iteration of
    (``stale``) ranges over the iterations before the current one; one whose loop has ended
    ranges over all its trips."""
    a = earlier.ref
    if not a.base.same_as(ref.base):
        return "disjoint"
    a_vars = [] if isinstance(a.offset, int) else list(tirx.analysis.undefined_vars(a.offset))
    b_vars = [] if isinstance(ref.offset, int) else list(tirx.analysis.undefined_vars(ref.offset))
    names, bounds, a_axes, b_axes = [], [], [], []
    for k, var in enumerate(dict.fromkeys(a_vars + b_vars)):
        name = f"v{k}"
        in_scope = any(var.same_as(v) for v in scope.open)
        if any(var.same_as(b) for b in b_vars) or in_scope:
            names.append(name)
            bounds.append(f"0 <= {name} < {scope.trips[var]}")
            b_axes.append((var, name))
        if any(var.same_as(v) for v in a_vars):
            if in_scope and var in earlier.stale:
                names.append(f"p{k}")
                bounds.append(f"0 <= p{k} < {name}")
                a_axes.append((var, f"p{k}"))
            elif in_scope or any(var.same_as(b) for b in b_vars):
                a_axes.append((var, name))
            else:
                names.append(f"p{k}")
                bounds.append(f"0 <= p{k} < {scope.trips[var]}")
                a_axes.append((var, f"p{k}"))
    try:
        a_lo, b_lo = _offset_text(a.offset, IslWriter(a_axes)), _offset_text(ref.offset, IslWriter(b_axes))
    except NotAffine:
        return "unknown"
    domain = f"[{', '.join(names)}] : " + " and ".join(bounds or ["true"])
    overlap = isl.Set(f"{{ {domain} and {a_lo} < {b_lo} + {ref.spec.size} and {b_lo} < {a_lo} + {a.spec.size} }}")
    if overlap.is_empty():
        return "disjoint"
    if a.spec.size == ref.spec.size and overlap.is_subset(isl.Set(f"{{ {domain} and {a_lo} = {b_lo} }}")):
        return "same"
    return "unknown"


def same_block(reader: Stage, placeholder: te.Tensor, writer: Stage) -> bool:
    """Every element ``reader``'s tile t reads of ``placeholder`` was written by ``writer``'s tile t."""
    access, _ = reader.read_relation(placeholder)
    reads = stage_tiles(reader.schedule, access.get_tuple_name(isl.dim_type.in_), reader.tensor.shape, "R")
    writes = stage_tiles(writer.schedule, access.get_tuple_name(isl.dim_type.out), placeholder.shape, "W")
    cross = reads.reverse().apply_range(access).apply_range(writes)
    return cross.is_subset(isl.Map("{ R[t] -> W[t] }"))


def _conflict(stage: Stage, writes: list[_Access], reads: list[_Access], scope: _Scope) -> str | None:
    """Why ``stage`` cannot run without a barrier after these accesses; None if it can."""
    for k, ref in enumerate(stage.reads):
        for w in writes:
            overlap = _same_memory(w, ref, scope)
            if overlap == "disjoint" or w.stage is stage:
                continue
            if overlap == "same" and same_block(stage, stage.placeholders[k], w.stage):
                continue
            return f"reads {ref.spec.name} written by {w.stage.name} in other blocks"
    for r in reads:
        overlap = _same_memory(r, stage.write, scope)
        if overlap == "disjoint" or r.stage is stage:
            continue
        if overlap == "same" and same_block(r.stage, r.placeholder, stage):
            continue
        return f"overwrites {stage.write.spec.name} while {r.stage.name} may still read it in other blocks"
    for w in writes:
        overlap = _same_memory(w, stage.write, scope)
        if overlap == "disjoint":
            continue
        if overlap == "same" and same_tiles(w.stage.schedule, stage.schedule):
            continue
        return f"writes {stage.write.spec.name} also written by {w.stage.name} in other blocks"
    return None


def _own_thread(stage: Stage) -> bool:
    """Whether each output element of ``stage`` is computed, from what it reads, by one thread:
    the one at the element's place in its tile modulo the block (``codegen.schedule``'s
    elementwise and thread_reduce templates, alone or with a register epilogue)."""
    return stage.schedule.template in ("elementwise", "thread_reduce") and stage.epilogue in (None, "register")


def _threads_of(tuple_name: str, shape, stage: Stage, thread_tuple: str) -> isl.Map:
    """Element of a tensor of ``shape`` written by ``stage`` -> the thread of the block writing it."""
    names = [f"a{k}" for k in range(len(shape))]
    bounds = " and ".join(f"0 <= {n} < {int(e)}" for n, e in zip(names, shape)) or "true"
    per_tile, threads = stage.schedule.per_tile, stage.schedule.threads
    return isl.Map(f"{{ {tuple_name}[{', '.join(names)}] -> {thread_tuple}[h] : "
                   f"h = (({flat_index(names, shape)}) mod {per_tile}) mod {threads} and {bounds} }}")


def same_thread(reader: Stage, placeholder: te.Tensor, writer: Stage) -> bool:
    """Every element ``reader``'s thread h reads of ``placeholder`` was written by ``writer``'s
    thread h (of the same block: ``same_block``), so no thread reads another's result."""
    if not (_own_thread(reader) and _own_thread(writer)):
        return False
    access, _ = reader.read_relation(placeholder)
    reads = _threads_of(access.get_tuple_name(isl.dim_type.in_), reader.tensor.shape, reader, "R")
    writes = _threads_of(access.get_tuple_name(isl.dim_type.out), placeholder.shape, writer, "W")
    return reads.reverse().apply_range(access).apply_range(writes).is_subset(isl.Map("{ R[h] -> W[h] }"))


def _thread_conflict(stage: Stage, writes: list[_Access], reads: list[_Access], scope: _Scope) -> str | None:
    """Why ``stage`` needs a ``__syncthreads`` after these accesses of its block (since the last
    barrier of any kind); None if every element it shares with them is its own thread's. A
    stage's own accesses in the same iteration are ordered by its thread mapping; in a later
    iteration they count as another stage's."""
    def other(access: _Access) -> bool:
        return access.stage is not stage or bool(access.stale)

    for k, ref in enumerate(stage.reads):
        for w in writes:
            overlap = _same_memory(w, ref, scope)
            if not other(w) or overlap == "disjoint":
                continue
            if overlap == "same" and same_thread(stage, stage.placeholders[k], w.stage):
                continue
            return f"reads {ref.spec.name} written by {w.stage.name} in other threads of the block"
    for r in reads:
        overlap = _same_memory(r, stage.write, scope)
        if not other(r) or overlap == "disjoint":
            continue
        if overlap == "same" and same_thread(r.stage, r.placeholder, stage):
            continue
        return f"overwrites {stage.write.spec.name} that {r.stage.name} reads in other threads of the block"
    for w in writes:
        overlap = _same_memory(w, stage.write, scope)
        if not other(w) or overlap == "disjoint":
            continue
        if overlap == "same" and _own_thread(w.stage) and _own_thread(stage) and \
                (w.stage.schedule.per_tile, w.stage.schedule.threads) == (stage.schedule.per_tile, stage.schedule.threads):
            continue
        return f"overwrites {stage.write.spec.name} that {w.stage.name} writes in other threads of the block"
    return None


class _BarrierPass:
    def __init__(self):
        self.writes: list[_Access] = []  # since the last grid barrier
        self.reads: list[_Access] = []
        self.block_writes: list[_Access] = []  # since the last barrier of either kind
        self.block_reads: list[_Access] = []
        self.scope = _Scope()
        self.changed = False

    def clear(self):
        self.writes, self.reads = [], []
        self.block_writes, self.block_reads = [], []

    def run(self, items: list):
        for item in items:
            if isinstance(item, Loop):
                self.loop(item)
                continue
            if item.barrier is None:
                item.barrier = _conflict(item, self.writes, self.reads, self.scope)
                self.changed |= item.barrier is not None
            if item.barrier is not None:
                item.block_barrier = None
                self.clear()
            elif item.block_barrier is None:
                item.block_barrier = _thread_conflict(item, self.block_writes, self.block_reads, self.scope)
                self.changed |= item.block_barrier is not None
            if item.block_barrier is not None:
                self.block_writes, self.block_reads = [], []
            reads = [_Access(item, ref, p) for ref, p in zip(item.reads, item.placeholders)]
            self.reads += reads
            self.block_reads += reads
            self.writes.append(_Access(item, item.write, None))
            self.block_writes.append(_Access(item, item.write, None))

    def loop(self, loop: Loop):
        """One barrier before the loop when its body conflicts with what ran before it; then
        the body as the first iteration, and again as a later one until no barrier is added."""
        self.scope.open.append(loop.var)
        if loop.barrier is None:
            loop.barrier = next((why for s in stages_in(loop.items)
                                 if (why := _conflict(s, self.writes, self.reads, self.scope))), None)
        if loop.barrier is not None:
            self.clear()
        self.run(loop.items)
        while True:
            self.changed = False
            self.writes, self.reads, self.block_writes, self.block_reads = (
                [_Access(a.stage, a.ref, a.placeholder, a.stale | {loop.var}) for a in accesses]
                for accesses in (self.writes, self.reads, self.block_writes, self.block_reads))
            self.run(loop.items)
            if not self.changed:
                break
        self.scope.open.pop()


def place_barriers(staged: StagedProgram) -> StagedProgram:
    """``staged`` with a grid barrier before exactly the stages (and loops) that need one, and a
    ``__syncthreads`` before the other stages that depend on what ran since the last barrier,
    each with its reason; whatever synchronized them before is replaced."""
    items = copy_items(staged.items)
    for item in [*stages_in(items), *loops_in(items)]:
        item.barrier = None
    for stage in stages_in(items):
        stage.block_barrier = None
    barriers = _BarrierPass()
    barriers.scope.trips = {loop.var: loop.trips for loop in loops_in(items)}
    barriers.run(items)
    for loop in loops_in(items):
        if loop.barrier is not None and not loop.loads and _opens_with_a_barrier(loop):
            loop.barrier = None
    return staged.with_items(items)


def _opens_with_a_barrier(loop: Loop) -> bool:
    """Whether every iteration of ``loop`` starts with a grid barrier (its first stage reads what
    the iteration before wrote): then the first iteration's is the loop's too, and one before the
    loop would follow the last stage before it with a barrier and nothing between them (paper
    BERT: after the embeddings' LayerNorm, 1.2 us on the H100)."""
    first = loop.items[0] if loop.items else None
    return isinstance(first, Stage) and first.barrier is not None
