"""The staged program: the whole model as the stages of ONE persistent kernel.

``stage_program`` turns the global TE program into a list of stages (one per TE, plus the
copies a scan's carries and outputs need) and loops over stages (one per scan), each stage
tiled by ``codegen.schedule``. Then, as named passes over that one structure:

- ``place_barriers`` puts a grid barrier before a stage only where it reads memory another
  block may have written since the last barrier (or overwrites memory another block may still
  be reading). "Another block" is decided with the analysis' access relations: a stage whose
  every tile reads only elements the same-numbered tile of the writer wrote runs in the same
  block after it (tile ``t`` runs on block ``t mod grid`` in every stage), so it needs none.
  Loop bodies are analysed twice, the second time as the next iteration, so loop-carried
  dependences get their barrier too.
- ``plan_arena`` lays the intermediates out in one scratch arena per dtype and reuses an
  offset once every access to its previous tensor is separated from the new one by a barrier.

``codegen.cuda`` makes the program one CUDA kernel; ``codegen.llvm`` runs the very same
stages, tiles, arena layout and barriers on the CPU. Every step returns or annotates the same
``StagedProgram``, which prints as a table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import islpy as isl
import numpy as np
import tvm
from tvm import te, tirx

from analysis.affine import recompute
from analysis.dependence import (
    IslWriter,
    NotAffine,
    access_relations,
    element_dependences,
)
from codegen.schedule import (
    THREADS,
    ScheduleError,
    StageSchedule,
    schedule_stage,
    tiling,
)
from codegen.stitch import BufferRef, Stitcher, align, c_name
from souffle.errors import GraphError
from souffle.graph import TensorSpec
from souffle.lower import Region, TEProgram


@dataclass
class Stage:
    """One stage: a TE computed tile by tile into ``write``, reading ``reads``."""

    name: str
    tensor: te.Tensor  # the TE, over ``placeholders``
    placeholders: list[te.Tensor]  # one per read, in ``reads`` order
    func: tirx.PrimFunc  # scheduled; parameters: the placeholders, then the output
    schedule: StageSchedule
    reads: list[BufferRef]
    write: BufferRef
    barrier: str | None = None  # why a grid barrier precedes this stage; None: no barrier
    launch: str | None = None  # why a new kernel starts at this stage; None: same kernel
    epilogue: str | None = None  # 'register' or 'shared': ``tensor`` is a reduction's consumer fused into it
    on_chip: dict = field(default_factory=dict)  # read index -> OnChip: that weight is read from shared memory

    def read_relation(self, placeholder: te.Tensor) -> tuple[isl.Map, bool]:
        """Output element -> the elements of ``placeholder`` it reads (through the fused
        reduction for an epilogue stage), and whether that relation is exact."""
        if self.epilogue is None:
            access = access_relations(self.tensor)[placeholder.op]
            return access.spatial, access.exact
        dependence = element_dependences(self.tensor, placeholder)
        return dependence.relation, dependence.exact


@dataclass
class Loop:
    """A scan: ``items`` run ``trips`` times, ``var`` counting iterations."""

    name: str
    var: tirx.Var
    trips: int
    items: list
    barrier: str | None = None  # why a grid barrier precedes the loop; None: no barrier
    launch: str | None = None  # why a new kernel starts at the loop; None: same kernel
    loads: list = field(default_factory=list)  # OnChip weights each block loads before the loop

    @property
    def on_host(self) -> bool:
        """Whether a kernel starts inside the loop, so that the host runs it and launches its kernels."""
        return any(item.launch is not None or (isinstance(item, Loop) and item.on_host) for item in self.items)


@dataclass
class StagedProgram:
    """The persistent kernel's program: stages and loops, and what the launcher must pass."""

    name: str
    items: list
    input_buffers: list[tirx.Buffer]
    weights: list[tuple[TensorSpec, np.ndarray]]
    weight_buffers: list[tirx.Buffer]
    output_buffers: list[tirx.Buffer]
    outputs: list[TensorSpec]
    threads: int
    weight_recipes: dict[str, list] = field(default_factory=dict)  # weight -> how it is made (souffle.recipe)
    slots: dict = field(default_factory=dict)  # slot buffer -> (dtype, elements)
    slot_offsets: dict = field(default_factory=dict)  # slot buffer -> element offset in its arena
    arena_sizes: dict[str, int] = field(default_factory=dict)  # dtype -> elements
    arena_buffers: dict[str, tirx.Buffer] = field(default_factory=dict)
    level: int = 4  # the opt level that staged it (``codegen.transform``)
    transforms: list[str] = field(default_factory=list)  # what the program's transformations did
    partition: object = None  # ``analysis.partition.Partition`` (O3 and O4)
    on_chip_notes: list[str] = field(default_factory=list)  # weights kept on chip, or why not

    @property
    def on_chip(self) -> list:
        return [load for loop in loops_in(self.items) for load in loop.loads]

    @property
    def on_chip_bytes(self) -> int:
        """Dynamic shared memory per block for the on-chip weights."""
        return sum(load.bytes for load in self.on_chip)

    def on_chip_memory(self, blocks: int = 1, scope: str = "shared.dyn") -> dict[str, tirx.Buffer]:
        """One buffer per dtype holding ``blocks`` blocks' on-chip weight copies, side by side.
        One allocation, not one per weight: the copies are read through views, which TVM's
        liveness-based memory reuse does not see, so separate ones could be overlaid."""
        sizes: dict[str, int] = {}
        for load in self.on_chip:
            sizes[load.dtype] = sizes.get(load.dtype, 0) + load.elements
        return {dtype: tirx.decl_buffer((blocks * n,), dtype, name=f"on_chip_{dtype}", scope=scope)
                for dtype, n in sizes.items()}

    def parameters(self) -> list[tirx.Buffer]:
        """The buffers the program takes, in order: inputs, weights, outputs, arenas."""
        return self.input_buffers + self.weight_buffers + self.output_buffers + list(self.arena_buffers.values())

    def stages(self) -> list[Stage]:
        """Every stage, loop bodies included once, in program order."""
        return list(stages_in(self.items))

    def barrier_count(self, executed: bool = False) -> int:
        """Grid barriers in the code, or (``executed``) run per inference, loops unrolled."""
        return _count(self.items, lambda s: s.barrier is not None, executed)

    def stage_count(self, executed: bool = False) -> int:
        return _count(self.items, lambda s: isinstance(s, Stage), executed)

    def kernel_count(self, executed: bool = False) -> int:
        """Kernels in the code, or (``executed``) launched per inference."""
        first = next(iter(self.items), None)
        return _count(self.items, lambda s: s.launch is not None, executed) + int(first is not None and first.launch is None)

    @property
    def max_tiles(self) -> int:
        return max(s.schedule.n_tiles for s in self.stages())

    @property
    def arena_bytes(self) -> int:
        return sum(n * np.dtype(d).itemsize for d, n in self.arena_sizes.items())

    def table(self) -> str:
        """One line per stage: its tiling and why a barrier precedes it."""
        kernels = self.kernel_count()
        head = (f"staged program {self.name}: {self.stage_count()} stages, {kernels} kernel{'s' * (kernels != 1)} "
                f"({self.kernel_count(executed=True)} launched), {self.barrier_count()} grid barriers "
                f"({self.barrier_count(executed=True)} executed), arena {self.arena_bytes / 1e6:.3f} MB")
        lines = [head]

        def emit(items, depth):
            for item in items:
                pad = "  " * depth
                if item.launch:
                    lines.append(f"{pad}== new kernel: {item.launch}")
                if item.barrier:
                    lines.append(f"{pad}-- grid barrier: {item.barrier}")
                if isinstance(item, Loop):
                    lines.append(f"{pad}loop {item.name} x{item.trips}:")
                    emit(item.items, depth + 1)
                    continue
                lines.append(f"{pad}{item.name}: {item.schedule}")

        emit(self.items, 1)
        return "\n".join(lines)

    __str__ = table


def synchronized(item) -> bool:
    """Whether every block waits for all others before ``item``: a grid barrier or a new kernel."""
    return item.barrier is not None or item.launch is not None


def stages_in(items):
    """The stages of ``items``, loop bodies included once, in program order."""
    for item in items:
        if isinstance(item, Loop):
            yield from stages_in(item.items)
        else:
            yield item


def loops_in(items):
    """The loops of ``items``, nested ones included, outer before inner."""
    for item in items:
        if isinstance(item, Loop):
            yield item
            yield from loops_in(item.items)


def _count(items, predicate, executed: bool) -> int:
    """Items (stages, or loops for their own barrier) satisfying ``predicate``, loop bodies
    counted once or, ``executed``, once per trip."""
    total = 0
    for item in items:
        if isinstance(item, Loop):
            total += _count(item.items, predicate, executed) * (item.trips if executed else 1)
        total += int(predicate(item))
    return total


# -- building the stages ----------------------------------------------------------------------
class SlotArena:
    """Hands every intermediate its own slot buffer; ``plan_arena`` later places the slots."""

    def __init__(self):
        self.slots: dict = {}

    def alloc(self, spec: TensorSpec, count: int = 1) -> BufferRef:
        size = spec.size * count
        slot = tirx.decl_buffer((size,), spec.dtype, name=f"slot{len(self.slots)}_{c_name(spec.name)}"[:60])
        self.slots[slot] = (spec.dtype, size)
        return BufferRef(slot, 0, spec)


def isolate(tensor: te.Tensor) -> tuple[te.Tensor, list[te.Tensor]]:
    """``tensor``'s TE over fresh placeholders, one per tensor it reads (in ``input_tensors``
    order, returned with it), so that it compiles on its own as one stage."""
    if len(tensor.op.body) != 1:
        raise GraphError(f"{tensor.op.name}: TEs with {len(tensor.op.body)} outputs are not staged")
    inputs = list(tensor.op.input_tensors)
    holders = {t.op: te.placeholder(t.shape, t.dtype, name=f"{t.op.name}_in") for t in inputs}
    staged = recompute(tensor, lambda t, idx, _: holders[t.op](*idx), f"staging {tensor.op.name}")
    return staged, [holders[t.op] for t in inputs]


def isolate_epilogue(producer: te.Tensor, consumer: te.Tensor) -> tuple[te.Tensor, list[te.Tensor], list[te.Tensor]]:
    """``consumer`` and the reduction ``producer`` it alone reads, as one TE graph over fresh
    placeholders: (the consumer, its placeholders, the tensors they stand for)."""
    outside = list(dict.fromkeys([t for t in producer.op.input_tensors]
                                 + [t for t in consumer.op.input_tensors if not t.op.same_as(producer.op)]))
    holders = {t.op: te.placeholder(t.shape, t.dtype, name=f"{t.op.name}_in") for t in outside}
    inner = recompute(producer, lambda t, idx, _: holders[t.op](*idx), f"staging {producer.op.name}")
    staged = recompute(consumer, lambda t, idx, _: (inner if t.op.same_as(producer.op) else holders[t.op])(*idx),
                       f"staging {consumer.op.name}")
    return staged, [holders[t.op] for t in outside], outside


def epilogue_mode(producer: te.Tensor, consumer: te.Tensor, threads: int) -> str | None:
    """How ``consumer`` (element-wise, the only reader of the reduction ``producer``) can run in
    the producer's tiles: 'register' when it reads each result at its own index, 'shared'
    when each of its tiles reads only the same-numbered producer tile; None otherwise."""
    if consumer.op.reduce_axis or len(consumer.op.body) != 1 or len(producer.op.body) != 1:
        return None
    access = access_relations(consumer)[producer.op]
    if not access.exact:
        return None
    relation = access.spatial
    names = ", ".join(f"a{k}" for k in range(len(consumer.shape)))
    bounds = " and ".join(f"0 <= a{k} < {int(d)}" for k, d in enumerate(consumer.shape)) or "true"
    if not isl.Set(f"{{ {relation.get_tuple_name(isl.dim_type.in_)}[{names}] : {bounds} }}").is_subset(relation.domain()):
        return None  # elements that read no result (padding) would belong to no tile
    shape = [int(d) for d in producer.shape]
    if [int(d) for d in consumer.shape] == shape:
        names = ", ".join(f"a{k}" for k in range(len(shape)))
        source, target = relation.get_tuple_name(isl.dim_type.in_), relation.get_tuple_name(isl.dim_type.out)
        if relation.is_subset(isl.Map(f"{{ {source}[{names}] -> {target}[{names}] }}")):
            return "register"
    outputs = int(np.prod(shape))
    analyzer = tvm.sym.Analyzer()
    reduction = int(np.prod([int(analyzer.simplify(ax.dom.extent)) for ax in producer.op.reduce_axis]))
    template, per_tile = tiling(outputs, reduction, threads)
    consumer_size = int(np.prod([int(d) for d in consumer.shape]))
    if template != "warp_reduce" or (per_tile * consumer_size) % outputs:
        return None
    reads = _tiles_of(relation.get_tuple_name(isl.dim_type.in_), consumer.shape, per_tile * consumer_size // outputs, "R")
    writes = _tiles_of(relation.get_tuple_name(isl.dim_type.out), producer.shape, per_tile, "W")
    cross = reads.reverse().apply_range(relation).apply_range(writes)
    return "shared" if cross.is_subset(isl.Map("{ R[t] -> W[t] }")) else None


class _Stager(Stitcher):
    """The stitcher's memory placement, with regions and copies emitted as stages."""

    def __init__(self, graph, gpu: bool, threads: int, epilogues: bool):
        super().__init__(graph, None, SlotArena())
        self.gpu = gpu
        self.threads = threads
        self.epilogues = epilogues
        self.names: dict[str, int] = {}

    def unique(self, name: str) -> str:
        n = self.names.get(name, 0)
        self.names[name] = n + 1
        return name if n == 0 else f"{name}:{n + 1}"

    def stage(self, name: str, tensor: te.Tensor, placeholders: list[te.Tensor], reads: list[BufferRef],
              write: BufferRef, epilogue: str | None = None, scheduled=None) -> Stage:
        func, schedule = scheduled or self.schedule(tensor, placeholders, epilogue)
        return Stage(self.unique(name), tensor, placeholders, func, schedule, reads, write, epilogue=epilogue)

    def schedule(self, tensor: te.Tensor, placeholders: list[te.Tensor], epilogue: str | None = None):
        func, schedule = schedule_stage(te.create_prim_func(placeholders + [tensor]), self.gpu, self.threads, epilogue)
        if epilogue is not None:  # tiles are counted in the epilogue's output, which the stage writes
            outputs = int(np.prod([int(d) for d in tensor.shape]))
            schedule = dataclasses.replace(schedule, per_tile=schedule.per_tile * outputs // schedule.outputs,
                                           outputs=outputs)
        return func, schedule

    def fusions(self, region: Region) -> dict:
        """Consumer op -> (its reduction, mode, the fused TE, its placeholders, the tensors they
        stand for, its schedule) for every reduction fused with its one reader. A pair TVM cannot
        schedule that way (``reverse_compute_at`` refuses some access patterns) stays two stages."""
        if not self.epilogues:
            return {}
        kept = {t.op for t in region.output_tensors}
        readers: dict = {}
        for tensor in region.stages():
            for producer in tensor.op.input_tensors:
                readers.setdefault(producer.op, []).append(tensor)
        fused: dict = {}
        for tensor in region.stages():
            users = readers.get(tensor.op, [])
            if not tensor.op.reduce_axis or tensor.op in kept or len(users) != 1 or tensor.op in fused:
                continue
            mode = epilogue_mode(tensor, users[0], self.threads)
            if mode is None:
                continue
            staged, placeholders, outside = isolate_epilogue(tensor, users[0])
            try:
                scheduled = self.schedule(staged, placeholders, mode)
            except (RuntimeError, ValueError, ScheduleError):  # TVM raises ValueError or InternalError
                continue
            fused[users[0].op] = (tensor, mode, staged, placeholders, outside, scheduled)
        return fused

    def region(self, region: Region, refs: dict[str, BufferRef]) -> list:
        self.region_count += 1
        name_of = {t.op: n for n, t in region.tensors.items()}
        placed: dict = {}
        for name in region.inputs:
            placed[region.tensors[name].op] = self.resolve(refs, name)
        for name in region.outputs:
            placed[region.tensors[name].op] = refs[name]
        fusions = self.fusions(region)
        producers = {fusion[0].op for fusion in fusions.values()}
        stages = []
        for tensor in region.stages():
            if tensor.op in producers:
                continue
            if tensor.op not in placed:
                spec = TensorSpec(name_of.get(tensor.op, tensor.op.name), tuple(int(d) for d in tensor.shape),
                                  str(tensor.dtype))
                placed[tensor.op] = self.arena.alloc(spec)
            label = f"{region.name}/{name_of.get(tensor.op, tensor.op.name)}"
            if tensor.op in fusions:
                producer, mode, staged, placeholders, outside, scheduled = fusions[tensor.op]
                label = f"{region.name}/{name_of.get(producer.op, producer.op.name)}+{name_of.get(tensor.op, tensor.op.name)}"
                stages.append(self.stage(label, staged, placeholders, [placed[t.op] for t in outside],
                                         placed[tensor.op], mode, scheduled))
                continue
            staged, placeholders = isolate(tensor)
            reads = [placed[t.op] for t in tensor.op.input_tensors]
            stages.append(self.stage(label, staged, placeholders, reads, placed[tensor.op]))
        return stages

    def copy(self, src: BufferRef, dst: BufferRef) -> Stage:
        source = te.placeholder(src.spec.shape, src.spec.dtype, name=f"{c_name(src.spec.name)}_in")
        copied = te.compute(src.spec.shape, lambda *i: source(*i), name=f"copy_{c_name(src.spec.name)}")
        return self.stage(f"copy {src.spec.name} -> {dst.spec.name}", copied, [source], [src], dst)

    def make_loop(self, var: tirx.Var, trips: int, body: list, name: str) -> Loop:
        return Loop(name, var, trips, body)


def stage_program(program: TEProgram, gpu: bool, threads: int = THREADS, epilogues: bool = False) -> StagedProgram:
    """The program as stages of one persistent kernel with blocks of ``threads`` threads, tiled
    for the GPU (or, with the same tiles, for the CPU); ``epilogues`` fuses each reduction
    with its one element-wise reader where the reader's tiles need only the reduction's
    (``epilogue_mode``). Barriers and arena layout come next."""
    stager = _Stager(program.graph, gpu, threads, epilogues)
    items, inputs, outputs = stager.whole(program)
    weights, weight_buffers = stager.weights()
    staged = StagedProgram(program.graph.name, items, inputs, weights, weight_buffers, outputs,
                           program.graph.output_specs(), threads, slots=dict(stager.arena.slots),
                           weight_recipes={spec.name: stager.weight_recipe(spec.name) for spec, _ in weights})
    names = [b.name for b in staged.parameters()]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise GraphError(f"{program.graph.name}: tensors {clash} have the same C name; rename one")
    return staged


# -- where grid barriers are needed -----------------------------------------------------------
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


def _flat(names: list[str], shape) -> str:
    terms, stride = [], 1
    for name, extent in reversed(list(zip(names, shape))):
        terms.append(f"{stride}*{name}")
        stride *= int(extent)
    return " + ".join(terms) or "0"


def _tiles_of(tuple_name: str, shape, per_tile: int, tile_tuple: str) -> isl.Map:
    names = [f"a{k}" for k in range(len(shape))]
    bounds = " and ".join(f"0 <= {n} < {int(e)}" for n, e in zip(names, shape)) or "true"
    return isl.Map(f"{{ {tuple_name}[{', '.join(names)}] -> {tile_tuple}[t] : t = floor(({_flat(names, shape)})/{per_tile})"
                   f" and {bounds} }}")


def same_block(reader: Stage, placeholder: te.Tensor, writer: Stage) -> bool:
    """Every element ``reader``'s tile t reads of ``placeholder`` was written by ``writer``'s tile t."""
    access, _ = reader.read_relation(placeholder)
    reads = _tiles_of(access.get_tuple_name(isl.dim_type.in_), reader.tensor.shape, reader.schedule.per_tile, "R")
    writes = _tiles_of(access.get_tuple_name(isl.dim_type.out), placeholder.shape, writer.schedule.per_tile, "W")
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
        if overlap == "same" and w.stage.schedule.per_tile == stage.schedule.per_tile:
            continue
        return f"writes {stage.write.spec.name} also written by {w.stage.name} in other blocks"
    return None


class _BarrierPass:
    def __init__(self):
        self.writes: list[_Access] = []
        self.reads: list[_Access] = []
        self.scope = _Scope()
        self.changed = False

    def clear(self):
        self.writes, self.reads = [], []

    def run(self, items: list):
        for item in items:
            if isinstance(item, Loop):
                self.loop(item)
                continue
            if item.barrier is None:
                item.barrier = _conflict(item, self.writes, self.reads, self.scope)
                self.changed |= item.barrier is not None
            if item.barrier is not None:
                self.clear()
            self.reads += [_Access(item, ref, p) for ref, p in zip(item.reads, item.placeholders)]
            self.writes.append(_Access(item, item.write, None))

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
            self.writes = [_Access(a.stage, a.ref, a.placeholder, a.stale | {loop.var}) for a in self.writes]
            self.reads = [_Access(a.stage, a.ref, a.placeholder, a.stale | {loop.var}) for a in self.reads]
            self.run(loop.items)
            if not self.changed:
                break
        self.scope.open.pop()


def place_barriers(staged: StagedProgram) -> StagedProgram:
    """Mark the stages (and loops) that need a grid barrier before them, with the reason."""
    barriers = _BarrierPass()
    barriers.scope.trips = {loop.var: loop.trips for loop in loops_in(staged.items)}
    barriers.run(staged.items)
    return staged


# -- what the opt levels below O4 synchronize ---------------------------------------------------
def kernel_per_stage(staged: StagedProgram, why: str) -> StagedProgram:
    """Every stage its own kernel (the unfused levels O0-O2): loops run on the host."""
    for stage in staged.stages():
        stage.launch = why
    return staged


def barrier_per_stage(staged: StagedProgram, why: str) -> StagedProgram:
    """A grid barrier before every stage but the first (O3: each former kernel boundary becomes
    a grid synchronization, whether or not data crosses blocks there)."""
    for k, stage in enumerate(staged.stages()):
        if k and stage.launch is None:
            stage.barrier = why
    return staged


def split_kernels(staged: StagedProgram, splits) -> StagedProgram:
    """Start a new kernel at each top-level item a partition split before, with its reason."""
    by_name = {split.before: split.reason for split in splits}
    for item in staged.items:
        if item.name in by_name:
            item.launch, item.barrier = by_name.pop(item.name), None
    if by_name:
        raise GraphError(f"{staged.name}: the partition splits before {sorted(by_name)}, which are not top-level items")
    return staged


# -- weights kept on chip across a loop (O4) -----------------------------------------------------
@dataclass
class OnChip:
    """A weight a stage in a loop reads, loaded once per kernel into its block's shared memory.

    Tile t of the stage reads exactly the weight's elements ``[t * per_tile, (t + 1) * per_tile)``;
    a block runs tiles ``block + k * grid`` (k < ``slots``) and keeps each one's slice in slot k,
    so across the loop's iterations the weight is read from DRAM once.
    """

    stage: Stage
    read: int  # index into ``stage.reads``
    per_tile: int  # elements of the weight per tile
    slots: int  # tiles per block at the smallest grid the kernel is launched with
    min_grid: int  # that smallest grid: one block per SM, or one per tile of the kernel's widest stage
    offset: int = 0  # where the block's copy starts in the on-chip memory of its dtype (elements)

    @property
    def source(self) -> BufferRef:
        return self.stage.reads[self.read]

    @property
    def dtype(self) -> str:
        return self.source.spec.dtype

    @property
    def elements(self) -> int:
        return self.slots * self.per_tile

    @property
    def bytes(self) -> int:
        return self.elements * np.dtype(self.dtype).itemsize


def tile_slice(stage: Stage, read: int) -> int | None:
    """Elements per tile when tile t of ``stage`` reads exactly the contiguous run
    ``[t * n, (t + 1) * n)`` of its ``read``-th input (a GEMV's weight rows); else None."""
    holder = stage.placeholders[read]
    relation, exact = stage.read_relation(holder)
    if not exact:
        return None
    tiles = _tiles_of(relation.get_tuple_name(isl.dim_type.in_), stage.tensor.shape, stage.schedule.per_tile, "T")
    names = [f"o{k}" for k in range(len(holder.shape))]
    flat = isl.Map(f"{{ {relation.get_tuple_name(isl.dim_type.out)}[{', '.join(names)}] -> F[f] : "
                   f"f = {_flat(names, holder.shape)} }}")
    footprint = tiles.reverse().apply_range(relation).apply_range(flat)
    first = footprint.intersect_domain(isl.Set("{ T[0] }")).range()
    n = int(first.count_val().to_python()) if first.is_bounded() else 0
    if n == 0:
        return None
    size = int(np.prod([int(d) for d in holder.shape]))
    expected = isl.Map(f"{{ T[t] -> F[f] : 0 <= t < {stage.schedule.n_tiles} and t * {n} <= f < (t + 1) * {n} "
                       f"and f < {size} }}")
    return n if footprint.is_equal(expected) else None


def keep_weights_on_chip(staged: StagedProgram, device) -> StagedProgram:
    """Load the weight slices a loop's stages read into each block's shared memory before the
    loop, where every tile reads its own contiguous slice and the device's shared memory per
    block holds them at the smallest grid the kernel may run with (one block per SM, or one per
    tile when there are fewer tiles). Loops that launch kernels from the host are left alone."""
    weights = {b for b in staged.weight_buffers}
    budget = device.smem_per_block - max(s.schedule.shared_bytes for s in staged.stages())
    for kernel in _kernels(staged.items):
        min_grid = min(device.sms, max(s.schedule.n_tiles for s in stages_in(kernel)))
        for loop in [item for item in loops_in(kernel) if not item.on_host]:
            budget = _keep_on_chip(staged, loop, weights, min_grid, budget, device)
    return staged


def _kernels(items: list) -> list[list]:
    """The top-level items grouped by the kernel they run in."""
    kernels: list[list] = []
    for item in items:
        if item.launch is not None or not kernels:
            kernels.append([])
        kernels[-1].append(item)
    return kernels


def _keep_on_chip(staged: StagedProgram, loop: Loop, weights: set, min_grid: int, budget: int, device) -> int:
    """``keep_weights_on_chip`` for one loop; returns the shared memory per block left."""
    for stage in stages_in(loop.items):
        for k, ref in enumerate(stage.reads):
            if ref.base not in weights or not isinstance(ref.offset, int) or k in stage.on_chip:
                continue
            per_tile = tile_slice(stage, k)
            if per_tile is None:
                continue
            slots = -(-stage.schedule.n_tiles // min_grid)
            offset = sum(o.elements for o in staged.on_chip if o.dtype == ref.spec.dtype)
            load = OnChip(stage, k, per_tile, slots, min_grid, offset)
            where = f"{ref.spec.name} (read by {stage.name} in loop {loop.name})"
            if load.bytes > budget:
                staged.on_chip_notes.append(
                    f"{where} stays in global memory: {slots} tiles per block x "
                    f"{per_tile * np.dtype(ref.spec.dtype).itemsize} B = {load.bytes} B > {budget} B of shared "
                    f"memory left per block on {device.name}")
                continue
            budget -= load.bytes
            stage.on_chip[k] = load
            loop.loads.append(load)
            staged.on_chip_notes.append(
                f"{where} on chip: {slots} tiles per block x {per_tile} elements, {load.bytes} B of shared memory "
                f"per block at {min_grid} blocks or more, loaded once per inference")
    return budget


def on_chip_pointer(load: OnChip, buffer: tirx.Buffer, base, t, tile) -> tirx.PrimExpr:
    """Where the stage's view of the weight starts so that element ``tile * per_tile + e`` of
    the weight is slot ``t``'s element e of the block's copy at ``base`` in ``buffer``."""
    dtype = str(t.ty.dtype)
    n = tirx.const(load.per_tile, dtype)
    return tirx.address_of(tirx.BufferLoad(buffer, [_as(base, dtype) + t * n - _as(tile, dtype) * n]))


def on_chip_loads(load: OnChip, buffer: tirx.Buffer, block, grid, base, elements) -> tirx.Stmt:
    """Block ``block``'s copy of its tiles' slices into ``buffer`` at ``base``: slot k holds tile
    ``block + k * grid``. ``elements(n, body)`` loops ``body(e)`` over ``e < n`` (serially on
    the CPU, over the block's threads on the GPU)."""
    k = tirx.Var("k", "int64")
    n = load.per_tile
    tile = _as(block, "int64") + k * _as(grid, "int64")
    source = load.source
    size = int(np.prod(source.spec.shape))

    def copy(e):
        e = _as(e, "int64")
        value = tirx.BufferLoad(source.base, [tile * n + e + source.offset])
        store = tirx.BufferStore(buffer, value, [_as(base, "int64") + k * n + e])
        return tirx.IfThenElse(tirx.all(tile < load.stage.schedule.n_tiles, tile * n + e < size), store, None)

    return tirx.For(k, 0, load.slots, tirx.ForKind.SERIAL, elements(n, copy))


def _as(x, dtype: str):
    if isinstance(x, int):
        return tirx.const(x, dtype)
    return x if str(x.ty.dtype) == dtype else tirx.Cast(dtype, x)


# -- the scratch arena ------------------------------------------------------------------------
def _first_stage(items) -> Stage | None:
    return next(iter(stages_in(items)), None)


def _live_ranges(staged: StagedProgram) -> dict:
    """Slot -> (first, last) barrier interval in which it is accessed. A slot used inside a
    loop is live for the whole loop unless every iteration starts with a barrier, it is only
    used in that loop, and its first use there is a whole write at a fixed offset."""
    ranges: dict = {}
    phase = 0

    def touch(slot, lo, hi):
        old = ranges.get(slot)
        ranges[slot] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))

    def visit(items):
        nonlocal phase
        for item in items:
            if isinstance(item, Loop):
                phase += int(synchronized(item))
                start = phase
                inner_first = _first_stage(item.items)
                first_access: dict = {}
                for s in stages_in(item.items):
                    for ref in s.reads:
                        first_access.setdefault(ref.base, "read")
                    first_access.setdefault(s.write.base, "write" if isinstance(s.write.offset, int) else "read")
                before = dict(ranges)
                visit(item.items)
                restarts = inner_first is not None and synchronized(inner_first)
                for slot, kind in first_access.items():
                    local = restarts and kind == "write" and slot not in before
                    if slot in staged.slots and not local:
                        touch(slot, start, phase)
                continue
            if synchronized(item):
                phase += 1
            for ref in item.reads + [item.write]:
                if ref.base in staged.slots:
                    touch(ref.base, phase, phase)

    visit(staged.items)
    return ranges


def plan_arena(staged: StagedProgram) -> StagedProgram:
    """Give every slot an offset in its dtype's arena; a slot reuses memory whose previous
    tensor's accesses all ended at least one barrier before its own begin."""
    ranges = _live_ranges(staged)
    placed: dict[str, list] = {}  # dtype -> [(offset, size, last phase)]
    for slot, (lo, hi) in sorted(ranges.items(), key=lambda kv: (kv[1][0], -staged.slots[kv[0]][1])):
        dtype, size = staged.slots[slot]
        taken = [(o, n) for o, n, last, first in placed.get(dtype, []) if not (last < lo or hi < first)]
        offset = 0
        for o, n in sorted(taken):
            if offset + size <= o:
                break
            offset = max(offset, align(o + n))
        placed.setdefault(dtype, []).append((offset, size, hi, lo))
        staged.slot_offsets[slot] = offset
    staged.arena_sizes = {d: max((o + n for o, n, _, _ in v), default=0) for d, v in placed.items()}
    staged.arena_buffers = {d: tirx.decl_buffer((tirx.Var(f"arena_{d}_n", "int64"),), d, name=f"arena_{d}")
                            for d in staged.arena_sizes}
    return staged



# -- shared by the CUDA and CPU builders ------------------------------------------------------
def seq(stmts: list[tirx.Stmt]) -> tirx.Stmt:
    """Statements in order (TVM refuses a sequence of one)."""
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def slot_views(staged: StagedProgram, items: list | None = None) -> list[tirx.Stmt]:
    """Each slot ``items`` (by default the whole program) use, declared as a view into its
    arena at its planned offset."""
    used = None if items is None else buffers_used(items)
    views = []
    for slot, offset in staged.slot_offsets.items():
        if used is None or slot in used:
            arena = staged.arena_buffers[staged.slots[slot][0]]
            views.append(tirx.DeclBuffer(slot, data=BufferRef(arena, offset, None).pointer()))
    return views


def buffers_used(items: list) -> set:
    """The buffers (slots, inputs, weights, outputs) the stages of ``items`` read or write."""
    return {ref.base for stage in stages_in(items) for ref in stage.reads + [stage.write]}


def parameters_used(staged: StagedProgram, items: list) -> list[tirx.Buffer]:
    """The program's parameters ``items`` need: the buffers they touch and their slots' arenas."""
    used = buffers_used(items)
    arenas = {staged.arena_buffers[staged.slots[slot][0]] for slot in used if slot in staged.slots}
    return [b for b in staged.parameters() if b in used or b in arenas]


def tiled_stage(stage: Stage, block: tirx.PrimExpr, grid: tirx.PrimExpr, on_chip=None) -> tirx.Stmt:
    """The stage's code for one block: its parameters as views, and its outermost (tile) loop
    replaced by ``for t in range(ceildiv(n_tiles - block, grid)): tile = block + t * grid``.

    A weight kept on chip (``stage.on_chip``) is viewed, tile by tile, in the block's copy:
    ``on_chip(load)`` gives (buffer, where this block's copy starts in it)."""
    func = stage.func
    refs = stage.reads + [stage.write]
    views = [tirx.DeclBuffer(param, data=ref.pointer()) for k, (param, ref) in enumerate(zip(func.params, refs))
             if k not in stage.on_chip]
    realize = func.body
    root = realize.block
    tile_loop = root.body
    if not isinstance(tile_loop, tirx.For):
        raise TypeError(f"stage {stage.name}: the tile loop must be the root block's only statement")
    dtype = str(tile_loop.loop_var.ty.dtype)
    block, grid = (x if str(x.ty.dtype) == dtype else tirx.Cast(dtype, x) for x in (block, grid))
    t = tirx.Var("t", dtype)
    n_tiles = tirx.const(stage.schedule.n_tiles, dtype)
    tile = tile_loop.loop_var
    on_chip_views = [tirx.DeclBuffer(func.params[k], data=on_chip_pointer(load, *on_chip(load), t, tile))
                     for k, load in stage.on_chip.items()]
    persistent = tirx.For(t, 0, tirx.floordiv(n_tiles - block + grid - 1, grid), tirx.ForKind.SERIAL,
                          tirx.SeqStmt([tirx.Bind(tile, block + t * grid)] + on_chip_views + [tile_loop.body]))
    new_root = type(root)(root.iter_vars, root.reads, root.writes, root.name_hint, persistent, root.init,
                          root.alloc_buffers, root.match_buffers, root.annotations)
    return tirx.SeqStmt(views + [type(realize)(realize.iter_values, realize.predicate, new_root)])
