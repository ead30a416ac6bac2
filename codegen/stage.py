"""The ``stage`` pass: the global TE program as the stages of one persistent kernel.

Every TE becomes a stage (a reduction with a fused epilogue, marked by ``codegen.epilogues``,
becomes one stage with its reader), plus the copies a scan's carries and outputs need; each
scan becomes a ``Loop``. Each stage's TE is isolated over fresh placeholders and scheduled on
its own (``codegen.schedule``), and every tensor gets its place in memory from the stitcher's
placement (``codegen.stitch``): inputs, weights and outputs in their own buffers, the rest in
slots that ``codegen.arena`` later lays out. Nothing synchronizes yet: ``codegen.sync`` and
``codegen.barriers`` decide that.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm_ffi import structural_equal

from analysis.affine import recompute
from analysis.dependence import tensor_loads
from analysis.device import DeviceModel, co_resident_grid
from codegen.latency import kernel_runs, stage_estimate, stage_seconds
from codegen.partition import stage_registers
from codegen.row_resident import schedule_row_resident
from codegen.schedule import THREADS, WARP, scaled_factors, schedule_candidates
from codegen.staged import Loop, Stage, StagedProgram, replaced_stages
from codegen.stitch import BufferRef, Stitcher
from codegen.traffic import stage_traffic
from codegen.tuned import StageDatabase, workload
from souffle.errors import GraphError
from souffle.graph import TensorSpec
from souffle.lower import Region, TEProgram
from souffle.naming import UniqueNames, c_name


class SlotArena:
    """Hands every intermediate its own slot buffer; ``codegen.arena`` later places the slots."""

    def __init__(self):
        self.slots: dict = {}

    def alloc(self, spec: TensorSpec, count: int = 1) -> BufferRef:
        size = spec.size * count
        slot = tirx.decl_buffer((size,), spec.dtype, name=f"slot{len(self.slots)}_{c_name(spec.name)}"[:60])
        self.slots[slot] = (spec.dtype, size)
        return BufferRef(slot, 0, spec)


class _Placeholders:
    """Fresh placeholders for the tensors a TE reads, handed out load by load: one per tensor,
    except that a reduction reading one tensor at two places (the query and key of BERT's Q·K^T,
    both slices of one QKV tensor) gets one per place, so that the GEMM rules see two operands."""

    def __init__(self, tensors: list[te.Tensor], reduction: te.Tensor | None = None):
        self.holders = {t.op: te.placeholder(t.shape, t.dtype, name=f"{t.op.name}_in") for t in tensors}
        self.placeholders = list(self.holders.values())
        self.tensors = list(tensors)  # what each of ``placeholders`` stands for
        self.twice = set() if reduction is None else _read_at_two_places(reduction)
        self.seen: set = set()

    def __call__(self, tensor: te.Tensor, indices, _simplify):
        if tensor.op in self.twice and tensor.op in self.seen:
            second = te.placeholder(tensor.shape, tensor.dtype, name=f"{tensor.op.name}_in2")
            self.placeholders.append(second)
            self.tensors.append(tensor)
            return second(*indices)
        self.seen.add(tensor.op)
        return self.holders[tensor.op](*indices)


def _read_at_two_places(reduction: te.Tensor) -> set:
    """The tensors ``reduction`` (if it is one) reads at exactly two different indices, each
    unconditionally, as the two factors of its product (two operands; not the two halves of a
    concatenation, nor two split-K partials a LayerNorm sums, ``codegen.row_resident.with_row_value``)."""
    if not reduction.op.reduce_axis or scaled_factors(reduction.op.body[0].source[0]) is None:
        return set()
    sites: dict = {}
    for load in tensor_loads(reduction.op.body[0]):
        sites.setdefault(load.tensor.op, []).append(load)
    return {op for op, loads in sites.items()
            if len(loads) == 2 and not any(load.conditions for load in loads)
            and not structural_equal(list(loads[0].indices), list(loads[1].indices))}


def isolate(tensor: te.Tensor) -> tuple[te.Tensor, list[te.Tensor], list[te.Tensor]]:
    """``tensor``'s TE over fresh placeholders (see ``_Placeholders``), so that it compiles on
    its own as one stage: (the TE, its placeholders, the tensors they stand for)."""
    if len(tensor.op.body) != 1:
        raise GraphError(f"{tensor.op.name}: TEs with {len(tensor.op.body)} outputs are not staged")
    holders = _Placeholders(list(tensor.op.input_tensors), tensor)
    staged = recompute(tensor, holders, f"staging {tensor.op.name}")
    return staged, holders.placeholders, holders.tensors


def isolate_epilogue(producer: te.Tensor, consumer: te.Tensor) -> tuple[te.Tensor, list[te.Tensor], list[te.Tensor]]:
    """``consumer`` and the reduction ``producer`` it alone reads, as one TE graph over fresh
    placeholders: (the consumer, its placeholders, the tensors they stand for)."""
    return isolate_fused([producer], consumer)


def isolate_fused(producers: list[te.Tensor], consumer: te.Tensor) -> tuple[te.Tensor, list[te.Tensor], list[te.Tensor]]:
    """``consumer`` and the reductions ``producers`` (producers first) that only it and each other
    read, as one TE graph over fresh placeholders: (the consumer, its placeholders, the tensors
    they stand for). A row-resident stage's statistics (``codegen.row_resident``) are several."""
    fused = {p.op for p in producers}
    # keyed by op: a rank-0 tensor's ``==`` raises (TVM asks for ``Tensor.equal``)
    outside = list({t.op: t for tensor in [*producers, consumer] for t in tensor.op.input_tensors
                    if t.op not in fused}.values())
    holders = _Placeholders(outside, producers[0])
    inner: dict = {}

    def load(tensor, indices, simplify):
        return inner[tensor.op](*indices) if tensor.op in inner else holders(tensor, indices, simplify)

    for producer in producers:
        inner[producer.op] = recompute(producer, load, f"staging {producer.op.name}")
        holders.twice = set()  # later loads of a tensor the first reduction reads twice take the first
    staged = recompute(consumer, load, f"staging {consumer.op.name}")
    return staged, holders.placeholders, holders.tensors


class _Stager(Stitcher):
    """The stitcher's memory placement, with regions and copies emitted as stages."""

    def __init__(self, graph, gpu: bool, threads: int, device: DeviceModel | None, tf32: bool = False,
                 database: StageDatabase | None = None):
        super().__init__(graph, None, SlotArena())
        self.database = database
        self.gpu = gpu
        self.tf32 = tf32
        self.threads = threads
        self.device = device
        self.unique = UniqueNames()

    def stage(self, name: str, tensor: te.Tensor, placeholders: list[te.Tensor], reads: list[BufferRef],
              write: BufferRef, epilogue: str | None = None) -> Stage:
        """The stage with the schedule the latency model estimates fastest on ``device``, among
        those whose shared memory a block of ``device`` can have (the ``tc-depth-128`` variant's
        128 x 128 tiles in a ring of three copies of 128 terms would take 204 KB, more than an
        A100's block). On a tie, the first candidate (with no device, the first), except between
        warp_reduce ones, which differ in the rows a warp reduces together: alone, a GEMV reads
        its weight from DRAM, and they tie on those bytes where the program keeps the weight on
        chip (paper LSTM's gate product), so the one whose other limits add up to less with the
        weight on chip (a vector staged in shared memory saves L1 wavefronts but adds a block
        barrier and a trip to memory, which pays only once the weight's loads are on chip too)."""
        label = self.unique(name)
        tuned = None if self.database is None else \
            self.database.schedule(label, workload(tensor, placeholders), self.threads, self.device.arch)
        if tuned is not None:
            return Stage(label, tensor, placeholders, *tuned, reads, write, epilogue=epilogue)
        if epilogue == "row":
            candidates = [schedule_row_resident(tensor, placeholders, self.gpu, self.threads)]
        else:
            candidates = schedule_candidates(tensor, placeholders, self.gpu, self.threads, epilogue, self.tf32)
        stages = [Stage(label, tensor, placeholders, func, schedule, reads, write, epilogue=epilogue)
                  for func, schedule in candidates]
        if self.device is not None and self.device.smem_per_block:
            stages = [s for s in stages if s.schedule.shared_bytes <= self.device.smem_per_block] or stages[-1:]
        if len(stages) == 1 or self.device is None:
            return stages[0]
        traffic = stage_traffic(stages[0])  # the same bytes whichever schedule reads them

        def cost(stage: Stage) -> tuple[float, float]:
            seconds = stage_seconds(stage, self.device, traffic)
            if stage.schedule.template != "warp_reduce":
                return seconds, 0.0
            return seconds, sum(stage_estimate(stage, self.device, traffic, matrix_on_chip=True).times.values())

        costs = {id(stage): cost(stage) for stage in stages}
        fastest = min(stages, key=lambda stage: costs[id(stage)])
        full_warp = [s for s in stages if not idles_warps(s)]
        if idles_warps(fastest) and full_warp:
            fastest.full_warp = min(full_warp, key=lambda stage: costs[id(stage)])
        return fastest

    def region(self, region: Region, refs: dict[str, BufferRef]) -> list:
        name_of = {t.op: n for n, t in region.tensors.items()}
        placed: dict = {}
        for name in region.inputs:
            placed[region.tensors[name].op] = self.resolve(refs, name)
        for name in region.outputs:
            placed[region.tensors[name].op] = refs[name]
        producers = {producer.op for producer, _ in region.epilogues.values()}
        producers |= {t.op for statistics in region.statistics.values() for t in statistics}
        stages = []
        for tensor in region.stages():
            if tensor.op in producers:
                continue
            if tensor.op not in placed:
                spec = TensorSpec(name_of.get(tensor.op, tensor.op.name), tuple(int(d) for d in tensor.shape),
                                  str(tensor.dtype))
                placed[tensor.op] = self.arena.alloc(spec)
            label = f"{region.name}/{name_of.get(tensor.op, tensor.op.name)}"
            if tensor.op in region.epilogues:
                producer, mode = region.epilogues[tensor.op]
                fused = [*region.statistics.get(tensor.op, ()), producer]
                staged, placeholders, outside = isolate_fused(fused, tensor)
                label = f"{region.name}/" + "+".join(name_of.get(t.op, t.op.name) for t in [*fused, tensor])
                stages.append(self.stage(label, staged, placeholders, [placed[t.op] for t in outside],
                                         placed[tensor.op], mode))
                continue
            staged, placeholders, tensors = isolate(tensor)
            stages.append(self.stage(label, staged, placeholders, [placed[t.op] for t in tensors], placed[tensor.op]))
        return stages

    def copy(self, src: BufferRef, dst: BufferRef) -> Stage:
        source = te.placeholder(src.spec.shape, src.spec.dtype, name=f"{c_name(src.spec.name)}_in")
        copied = te.compute(src.spec.shape, lambda *i: source(*i), name=f"copy_{c_name(src.spec.name)}")
        return self.stage(f"copy {src.spec.name} -> {dst.spec.name}", copied, [source], [src], dst)

    def make_loop(self, var: tirx.Var, trips: int, body: list, name: str) -> Loop:
        return Loop(name, var, trips, body)


def idles_warps(stage: Stage) -> bool:
    """Whether ``stage``'s tile leaves some of the block's warps idle (a tensor-core tile of 4
    warps in a block of 8, ``codegen.tensor_core.TILES``)."""
    tile = stage.schedule.tensor_core_tile
    return tile is not None and tile.warps * WARP < stage.schedule.threads


def keep_occupancy(staged: StagedProgram, device: DeviceModel | None) -> tuple[StagedProgram, list[str]]:
    """The ``keep_occupancy`` pass: the stages whose tiles idle warps (a tile of 4 warps' 72
    accumulator registers a thread for 96 x 96) were chosen alone, but the kernel runs every stage
    at the fewest blocks per SM any of its stages allows. For each level of blocks per SM those
    stages allow, the ones allowing fewer take back their fastest candidate on all the block's
    warps (``Stage.full_warp``), and the latency model sums every stage's executions at the
    kernel's blocks per SM that leaves; the level of the least sum is kept (on a tie, the most
    tiles kept). Paper Swin fp16's 96 x 96 tiles of 4 warps (1 block/SM) split it into 7 kernels
    where its other stages allow 2 blocks/SM (H100 model 665 -> 753 us); paper BERT fp16 runs at
    1 block/SM whatever it takes (its whole-row scores tile, after ``align_tiles``, allows 1). A
    note for each stage taken back."""
    stages = staged.stages()
    idle = [s for s in stages if s.full_warp is not None and idles_warps(s)]
    if device is None or not idle:
        return staged, []

    def blocks(stage: Stage) -> int:
        return co_resident_grid(stage_registers(stage), stage.schedule.shared_bytes, device,
                                stage.schedule.threads).blocks_per_sm

    executions = {stage.name: runs for stage, _, runs in kernel_runs(staged.items) if isinstance(stage, Stage)}
    names = {s.name for s in idle}
    others = [s for s in stages if s.name not in names]
    levels = sorted({blocks(s) for s in idle})  # the first keeps every one
    lowest = min(blocks(s) for s in [*idle, *(s.full_warp for s in idle), *others])
    # a stage of at most a round of one block an SM takes as long at any level: left out of the sums
    affected = [s for s in others if s.schedule.n_tiles > device.sms * lowest]
    traffic: dict[str, object] = {}

    def seconds(stage: Stage, level: int) -> float:
        if stage.name not in traffic:
            traffic[stage.name] = stage_traffic(stage)
        return executions[stage.name] * stage_estimate(stage, device, traffic[stage.name], level).seconds

    def option(level: int) -> tuple[float, dict[str, Stage]]:
        taken = {s.name: s if blocks(s) >= level else s.full_warp for s in idle}
        kernel = min(blocks(s) for s in [*taken.values(), *others])
        return sum(seconds(s, kernel) for s in [*taken.values(), *affected]), taken

    options = [option(level) for level in levels] + [option(max(blocks(s) for s in stages) + 1)]
    total, taken = min(options, key=lambda o: o[0])  # first: the most idle-warp tiles kept
    swapped = [stage for stage in idle if taken[stage.name] is not stage]
    if not swapped:
        return staged, []
    notes = [f"{stage.name}: {stage.full_warp.schedule.tensor_core_tile or stage.full_warp.schedule.template} "
             f"on all {stage.schedule.threads // WARP} warps, not {stage.schedule.tensor_core_tile} "
             f"({blocks(stage)} blocks/SM): the stages the kernel's blocks per SM change, {options[0][0] * 1e6:.4g} -> "
             f"{total * 1e6:.4g} us on {device.name}" for stage in swapped]
    return staged.with_items(replaced_stages(staged.items, [(stage, stage.full_warp) for stage in swapped])), notes


def stage_program(program: TEProgram, gpu: bool, threads: int = THREADS,
                  device: DeviceModel | None = None, tf32: bool = False,
                  database: StageDatabase | None = None) -> StagedProgram:
    """The program as stages of one persistent kernel with blocks of ``threads`` threads, tiled
    for the GPU (or, with the same tiles, for the CPU), nothing synchronized yet; where a stage
    has several schedules, the one the latency model estimates fastest on ``device``. ``tf32``:
    float32 GEMMs may multiply on tensor cores in TF32 (``precision="tf32"``). A stage that
    ``database`` (GPU only, with ``device``) has a record for takes its schedule."""
    stager = _Stager(program.graph, gpu, threads, device, tf32, database)
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
