"""The facts ``analysis.latency`` estimates a staged program from, read off its stages as they
are scheduled and emitted (``codegen.schedule``, ``codegen.cuda``), not as they could be.

Per stage, from its template, tiles and epilogue:

- who works: an elementwise or thread_reduce tile gives one output to each of its threads, a
  warp_reduce tile ``per_tile / warps`` outputs to each warp (one by default), one after the
  other or ``rows_together`` (a GEMV's rows: a load they share is one load for all of them, and
  they take one dependent chain), its 32 lanes splitting each reduction;
- where the reduction accumulates: in a register, in every template (a thread_reduce stage
  without a fused epilogue gets a copy as its register epilogue, ``codegen.schedule``); the
  result is stored once;
- the dependent chain of one thread through a tile: a step of a register-accumulated reduction
  has no store, so nvcc unrolls its loop and issues several steps' loads at once
  (``UNROLLED_STEPS``);
- every memory instruction a warp runs, with the 32-byte sectors its 32 lanes touch, from the
  TE's index expressions evaluated at a representative warp (the middle tile's first warp, the
  middle of the reduction): consecutive threads on consecutive outputs, or for warp_reduce
  consecutive lanes on consecutive reduction steps. A load whose index reads memory (a gather)
  is taken as one sector per lane. A weight kept on chip (``Stage.on_chip``) is a shared-memory
  load;
- the sectors one tile reads from L2, each once (isl, on the stage's read relations: the middle
  tile's footprint), and the stage's DRAM bytes: in a program, what ``codegen.traffic.l2_traffic``
  leaves of its counted bytes behind an L2 of the device's size (the operands a stage before it
  left in L2 are not read from DRAM, its output is written back only when evicted); a stage
  alone (``stage_seconds``), its counted bytes.

A stage scheduled by dlight's matmul rule is read off the rule's configuration instead
(``_matmul_work``), one on tensor cores off its tile (``_tensor_core_work``), the only
template whose ``tensor_core`` is True.
Each stage's kernel gives its grid and co-resident blocks: from ptxas where the caller has them
(``occupancies``, one per kernel in launch order), else estimated like ``codegen.partition``
does before ptxas runs (``stage_registers``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import islpy as isl
import numpy as np
from tvm import te, tirx
from tvm_ffi import structural_equal

from analysis.affine import unravel
from analysis.characterize import count_flops, indexed_by_last_axis, is_gemm
from analysis.dependence import count_points, iteration_domain, tensor_loads
from analysis.device import DeviceModel, Occupancy, co_resident_grid
from analysis.latency import (L1_SECTORS_PER_CLOCK, SECTOR_BYTES, LatencyEstimate, MemoryAccess, StageEstimate,
                              StageWork, estimate_program, estimate_stage)
from codegen.partition import stage_registers
from codegen.row_resident import statistics_of
from codegen.schedule import (MATMUL_K_CHUNK, MATMUL_MICRO, MATMUL_VECTOR, MATMUL_VTHREADS, WARP, epilogue_reduction,
                              gathered_factors, scaled_operands)
from codegen.staged import Loop, OnChip, Stage, StagedProgram, flat_index, stage_tiles
from codegen.tensor_core import FRAGMENT
from codegen.traffic import (L2Traffic, StageTraffic, Traffic, compulsory_bytes, l2_traffic, memory_traffic,
                             stage_traffic)
from codegen.tuned import TEMPLATE as TUNED_TEMPLATE

# Steps of a register-accumulated reduction whose loads one thread has in flight at once: nvcc 13
# unrolls the k loop of a thread_reduce dense with a register accumulator by 8, every load of the
# unrolled body independent of the others (checked on its PTX, sm_90, K = 128).
UNROLLED_STEPS = 8
CP_ASYNC_CG_BYTES = 16  # the one copy size cp.async's .cg (cache in L2 only) takes (PTX ISA, cp.async)
SHARED_BANKS = 32  # four-byte shared-memory banks (CUDA C++ Programming Guide, compute capability 5.x on)
SHUFFLE_ROUNDS = int(math.log2(WARP)) + 1  # TVM's warp all-reduce: 5 shfl_down rounds, then one shfl broadcast


class Dram(NamedTuple):
    """A stage's DRAM bytes per execution: per read (``Stage.reads`` order; an on-chip load's
    one source) and written."""

    reads: tuple[float, ...]
    written: float

    @classmethod
    def counted(cls, row: StageTraffic) -> Dram:
        """The counted bytes, as though no stage before it left anything in L2."""
        return cls(tuple(n for _, n in row.reads), row.bytes_written)


def latency_estimate(staged: StagedProgram, device: DeviceModel,
                     occupancies: list[Occupancy] | None = None, traffic: Traffic | None = None,
                     behind_l2: L2Traffic | None = None) -> LatencyEstimate:
    """``staged`` estimated on ``device`` (``analysis.latency``); ``occupancies``: each kernel's,
    from ptxas; ``traffic``: ``memory_traffic(staged)`` and ``behind_l2`` its ``l2_traffic`` on
    ``device``, where the caller has them already."""
    works = stage_works(staged, device, occupancies, traffic, behind_l2)
    grids = {kernel: work.grid for (_, kernel, _), work in zip(kernel_runs(staged.items), works, strict=True)}
    barriers = [(grids[kernel], count) for kernel, count in enumerate(kernel_barriers(staged.items)) if count]
    return estimate_program(staged.name, works, barriers, staged.kernel_count(executed=True),
                            compulsory_bytes(staged), device)


def stage_works(staged: StagedProgram, device: DeviceModel,
                occupancies: list[Occupancy] | None = None, traffic: Traffic | None = None,
                behind_l2: L2Traffic | None = None) -> list[StageWork]:
    """One ``StageWork`` per stage and per on-chip weight load, in program order (as
    ``codegen.traffic`` lists them); loop bodies once, with their executions."""
    runs = kernel_runs(staged.items)
    kernels = max((kernel for _, kernel, _ in runs), default=-1) + 1
    if occupancies is not None and len(occupancies) != kernels:
        raise ValueError(f"{staged.name}: {len(occupancies)} occupancies for {kernels} kernels")
    members = [[item for item, kernel, _ in runs if kernel == k] for k in range(kernels)]
    if occupancies is None:
        occupancies = [_estimated_occupancy(items, staged.threads, device) for items in members]
    grids = [min(occupancy.grid, max(s.schedule.n_tiles for s in items if isinstance(s, Stage)))
             for occupancy, items in zip(occupancies, members)]
    traffic = traffic or memory_traffic(staged)
    if behind_l2 is None or behind_l2.l2_bytes != device.l2_bytes:
        behind_l2 = l2_traffic(staged, device.l2_bytes, traffic)
    works = []
    for (item, kernel, executions), reads, written in zip(runs, behind_l2.stage_reads, behind_l2.stage_writes):
        shape = (grids[kernel], occupancies[kernel].blocks_per_sm)
        dram = Dram(tuple(n / executions for n in reads), written / executions)
        if isinstance(item, OnChip):
            works.append(_load_work(item, executions, staged.threads, *shape, round(sum(dram.reads))))
        else:
            works.append(_stage_work(item, executions, *shape, dram))
    return works


def stage_seconds(stage: Stage, device: DeviceModel, traffic: StageTraffic | None = None) -> float:
    """One execution of ``stage`` alone on ``device``, on the grid its own registers and shared
    memory allow: how ``codegen.stage`` compares a stage's candidate schedules before the
    program around it (its kernel's grid, its on-chip weights, what L2 holds) exists: its DRAM
    bytes are the counted ones. ``traffic``: the stage's ``stage_traffic``, which its schedule
    does not change (computed when not given)."""
    return stage_estimate(stage, device, traffic).seconds


def stage_estimate(stage: Stage, device: DeviceModel, traffic: StageTraffic | None = None,
                   blocks_per_sm: int | None = None, matrix_on_chip: bool = False) -> StageEstimate:
    """``stage_seconds``' estimate, with the five times it is the largest of; ``blocks_per_sm``:
    in a kernel of at most that many blocks per SM (its own registers and shared memory may allow
    fewer), not its own grid; ``matrix_on_chip``: with the reads its rows do not share (a GEMV's
    matrix) from shared memory, where ``codegen.on_chip`` may keep them."""
    schedule = stage.schedule
    if matrix_on_chip and (reduction := _reduction(stage)) is not None:
        holders = {p.op: k for k, p in enumerate(stage.placeholders)}
        matrix = {holders[load.tensor.op] for load in _loads(reduction) if indexed_by_last_axis(load, reduction)}
        stage = dataclasses.replace(stage, on_chip={**dict.fromkeys(matrix), **stage.on_chip})
    occupancy = co_resident_grid(stage_registers(stage), schedule.shared_bytes, device, schedule.threads)
    blocks = occupancy.blocks_per_sm if blocks_per_sm is None else min(occupancy.blocks_per_sm, blocks_per_sm)
    work = _stage_work(stage, 1, min(blocks * device.sms, schedule.n_tiles), blocks,
                       Dram.counted(traffic or stage_traffic(stage)))
    return estimate_stage(work, device)


def kernel_runs(items: list) -> list[tuple[Stage | OnChip, int, int]]:
    """(stage or on-chip load, its kernel's index, executions per inference), in program order,
    the kernels numbered as ``codegen.cuda.kernel_plan`` makes them: a new one at every item with
    a ``launch``, and after every loop the host runs (whose body's kernels come between)."""
    return [run for run in _walk(items) if not isinstance(run[0], Loop)]


def kernel_barriers(items: list) -> list[int]:
    """Grid barriers each kernel (numbered as ``kernel_runs``) executes per inference."""
    counts: list[int] = []
    for item, kernel, executions in _walk(items):
        if not isinstance(item, OnChip) and item.barrier is not None:
            counts.extend([0] * (kernel + 1 - len(counts)))
            counts[kernel] += executions
    return counts


def _walk(items: list) -> list[tuple[Stage | Loop | OnChip, int, int]]:
    """``kernel_runs`` with the loops the kernels run (each before its loads and body) among them."""
    runs: list = []
    kernel, open_run = -1, False

    def visit(items: list, executions: int):
        nonlocal kernel, open_run
        for item in items:
            if isinstance(item, Loop) and item.on_host:
                open_run = False
                visit(item.items, executions * item.trips)
                open_run = False
                continue
            if item.launch is not None or not open_run:
                kernel, open_run = kernel + 1, True
            runs.append((item, kernel, executions))
            if isinstance(item, Loop):
                runs.extend((load, kernel, executions) for load in item.loads)
                visit(item.items, executions * item.trips)

    visit(items, 1)
    return runs


def _estimated_occupancy(items: list, threads: int, device: DeviceModel) -> Occupancy:
    """A kernel's co-resident grid before ptxas: its stages' register estimates, its largest
    stage's shared memory plus its on-chip weights."""
    stages = [item for item in items if isinstance(item, Stage)]
    loads = [item for item in items if isinstance(item, OnChip)]
    return co_resident_grid(max(stage_registers(s) for s in stages),
                            max(s.schedule.shared_bytes for s in stages) + sum(load.bytes for load in loads),
                            device, threads)


def _load_work(load: OnChip, executions: int, threads: int, grid: int, blocks_per_sm: int, dram: int) -> StageWork:
    """Each block's copy of its on-chip weight slices: coalesced loads by all its threads, stored
    to shared memory, then a ``__syncthreads``."""
    itemsize = np.dtype(load.dtype).itemsize
    instructions = -(-load.elements // WARP)
    name = load.source.spec.name
    return StageWork(
        name=f"on-chip load of {name}", template="on-chip load", dtype=load.dtype, executions=executions,
        n_tiles=grid, threads=threads, active_threads=threads, grid=grid, blocks_per_sm=blocks_per_sm, flops=0,
        tensor_core=False, gemm=False, memory_steps=1, on_chip_steps=0, block_barriers=1,
        accesses=(MemoryAccess(name, "load", "global", instructions, -(-WARP * itemsize // SECTOR_BYTES)),
                  MemoryAccess(name, "store", "shared", instructions, 1)),
        l2_read_bytes=load.elements * itemsize, dram_bytes=dram)


def _executed_flops(tensor: te.Tensor) -> int:
    """``tensor``'s FLOPs as the GPU executes them: one branch of each ``if_then_else``."""
    return count_flops(tensor, one_branch=True)


def _gemm_flops(stage: Stage, reduction: te.Tensor) -> int:
    """A GEMM-shaped stage's FLOPs, its epilogue's included. A scaled operand's multiply
    (``codegen.schedule.scaled_operands``) is done as the tile copies the operand, once for each
    element it copies, not once for each term of each output: it is not counted (paper
    EfficientNet's 672 -> 112 projection: 1% of its FLOPs so, 50% counted for each term)."""
    epilogue = _executed_flops(stage.tensor) if stage.epilogue is not None else 0
    return epilogue + _executed_flops(scaled_operands(reduction))


def _reduction(stage: Stage) -> te.Tensor | None:
    """The reduction ``stage`` computes: its TE, or the one fused into its epilogue; None if element-wise."""
    if stage.epilogue is None:
        return stage.tensor if stage.tensor.op.reduce_axis else None
    return epilogue_reduction(stage.tensor)


def _reduction_length(reduction: te.Tensor) -> int:
    """Terms per output, on average where the reduction's extent varies (adaptive pooling)."""
    return max(1, count_points(iteration_domain(reduction)) // _size(reduction))


def _reduce_box(reduction: te.Tensor) -> list[tuple[int, int]]:
    """(lowest value, extent) of each reduce axis over the whole iteration domain."""
    domain = iteration_domain(reduction)
    n_spatial = len(reduction.op.axis)
    bounds = [(domain.dim_min_val(d).to_python(), domain.dim_max_val(d).to_python())
              for d in range(n_spatial, n_spatial + len(reduction.op.reduce_axis))]
    return [(lowest, highest - lowest + 1) for lowest, highest in bounds]


def _peak_dtype(stage: Stage, reduction: te.Tensor | None) -> str:
    """The dtype whose peak the stage is measured against: a GEMM-shaped stage's operands' (a
    float16 GEMM on FP32 lanes is far from the float16 peak whatever its epilogue stores), any
    other stage's output's."""
    return _operand_dtype(reduction) if is_gemm(reduction) else str(stage.tensor.dtype)


def _operand_dtype(reduction: te.Tensor) -> str:
    """The dtype of the tensors a reduction reads (its first load's): what its slices hold."""
    return str(tensor_loads(reduction.op.body[0])[0].tensor.dtype)


def _size(tensor: te.Tensor) -> int:
    return math.prod(int(d) for d in tensor.shape)


def _stage_work(stage: Stage, executions: int, grid: int, blocks_per_sm: int, dram: Dram) -> StageWork:
    """What one execution of ``stage`` makes the GPU do (see the module docstring). Its bytes
    from L2 and DRAM are at most what its loads request: a gather's read relation spans the whole
    table it indexes (``codegen.traffic``), its loads only the rows they fetch."""
    schedule = stage.schedule
    threads, template = schedule.threads, schedule.template
    if template == "matmul":
        return _matmul_work(stage, executions, grid, blocks_per_sm, dram)
    if template == "tensor_core":
        return _tensor_core_work(stage, executions, grid, blocks_per_sm, dram)
    if template == TUNED_TEMPLATE:
        return _database_work(stage, executions, grid, blocks_per_sm, dram)
    warps = threads // WARP
    tile = schedule.n_tiles // 2
    holders = {p.op: k for k, p in enumerate(stage.placeholders)}
    reduction = _reduction(stage)
    accesses: list[MemoryAccess] = []

    def loads_of(loads: list, lanes: list | None, count: int):
        """One access per load, ``count`` per tile: from shared memory for an on-chip weight;
        ``lanes`` None: one lane loads (a warp's result)."""
        for load in loads:
            space = "shared" if holders[load.tensor.op] in stage.on_chip else "global"
            sectors = _sectors(load, lanes) if space == "global" and lanes is not None else 1
            accesses.append(MemoryAccess(load.tensor.op.name, "load", space, count, sectors))

    if stage.epilogue == "row":
        accesses, active, memory_steps, on_chip_steps, barriers = _row_accesses(stage, tile, holders)
    elif reduction is None:  # elementwise: one output per thread in each round of the tile
        active = min(threads, schedule.outputs)
        lanes = _thread_lanes(stage.tensor, tile * schedule.per_tile)
        count = -(-min(schedule.per_tile, schedule.outputs) // WARP)
        loads_of(_loads(stage.tensor), lanes, count)
        memory_steps, on_chip_steps, barriers = int(bool(accesses)), 0, 0
        stored = _store_sectors(stage.tensor, lanes)
        accesses.append(MemoryAccess(stage.tensor.op.name, "store", "global", count, stored))
    else:
        terms, outputs = _reduction_length(reduction), _size(reduction)
        loads = _loads(reduction)
        staged = staging_steps = staging_barriers = 0  # a staged vector's copy: accesses, steps, barriers
        if template == "thread_reduce":  # one output per thread, the reduction serial
            active = min(threads, outputs)
            lanes = _thread_lanes(reduction, tile * threads)
            results = -(-active // WARP)
            instructions = results * terms
            steps = -(-terms // UNROLLED_STEPS)
            result_sectors = _store_sectors(reduction, lanes)
            on_chip_steps = 0
        else:  # warp_reduce: each warp's outputs one after the other, or ``rows_together`` at a
            # time, its lanes along the reduction, then shuffles
            # per_tile counts the stage's outputs: an epilogue's (softmax's exp: a row of 384 per
            # reduced output) when it has one, so the reductions per tile scale back from it
            reduced = schedule.per_tile * outputs // schedule.outputs
            rows = max(1, reduced // warps)
            together = min(rows, schedule.rows_together)
            results = min(reduced, outputs)
            active = WARP * min(warps, outputs)
            lanes = _reduction_lanes(reduction, min(tile * reduced, outputs - 1), terms)
            per_lane = -(-terms // WARP)
            instructions = results * per_lane
            steps = -(-rows // together) * -(-per_lane // UNROLLED_STEPS)
            result_sectors = 1
            on_chip_steps = rows * SHUFFLE_ROUNDS
            if together > 1:  # a load its rows share (a GEMV's vector) is one load for all of them
                shared = [load for load in loads if not indexed_by_last_axis(load, reduction)]
                reads = -(-results // together) * per_lane
                if schedule.staged_vector:  # copied into shared memory by the block, once a tile
                    copies = -(-terms // WARP)
                    loads_of(shared, lanes, copies)
                    accesses.append(MemoryAccess(f"{reduction.op.name}_vector", "store", "shared", copies, 1))
                    staged, staging_steps, staging_barriers = len(accesses), 1, 1
                    accesses.append(MemoryAccess(f"{reduction.op.name}_vector", "load", "shared", reads, 1))
                else:
                    loads_of(shared, lanes, reads)
                loads = [load for load in loads if indexed_by_last_axis(load, reduction)]
        loads_of(loads, lanes, instructions)
        if all(a.space == "shared" for a in accesses[staged:]):
            memory_steps, on_chip_steps = staging_steps, on_chip_steps + steps
        else:
            memory_steps = staging_steps + steps
        barriers = staging_barriers
        if stage.epilogue is None:
            accesses.append(MemoryAccess(reduction.op.name, "store", "global", results, result_sectors))
        else:
            epilogue = [load for load in _loads(stage.tensor) if not load.tensor.op.same_as(reduction.op)]
            if stage.epilogue == "register":  # in the thread (or warp) holding each result
                consumer_lanes = _thread_lanes(stage.tensor, tile * threads) if template == "thread_reduce" else None
                count = results
            else:  # the tile's results through shared memory, the epilogue over the whole block
                consumer_lanes = _thread_lanes(stage.tensor, tile * schedule.per_tile)
                count = -(-schedule.per_tile // WARP)
                accesses += [MemoryAccess(reduction.op.name, "store", "shared", results, 1),
                             MemoryAccess(reduction.op.name, "load", "shared", count, 1)]
                barriers += 2
            loads_of(epilogue, consumer_lanes, count)
            memory_steps += int(bool(epilogue))
            sectors = 1 if consumer_lanes is None else _store_sectors(stage.tensor, consumer_lanes)
            accesses.append(MemoryAccess(stage.tensor.op.name, "store", "global", count, sectors))
    flops = _stage_flops(stage)
    requested: dict[str, int] = {}  # global bytes each input's loads request per tile
    for a in accesses:
        if a.kind == "load" and a.space == "global":
            requested[a.tensor] = requested.get(a.tensor, 0) + a.per_tile * a.sectors * SECTOR_BYTES
    global_reads = [(k, requested.get(stage.placeholders[k].op.name, 0)) for k in range(len(stage.reads))
                    if k not in stage.on_chip]
    return StageWork(
        name=stage.name, template=template, dtype=_peak_dtype(stage, reduction), executions=executions,
        n_tiles=schedule.n_tiles, threads=threads, active_threads=active, grid=grid, blocks_per_sm=blocks_per_sm,
        flops=flops, tensor_core=False, gemm=is_gemm(reduction), memory_steps=memory_steps,
        on_chip_steps=on_chip_steps, block_barriers=barriers, accesses=tuple(accesses),
        l2_read_bytes=sum(min(_tile_read_bytes(stage, k, tile), asked) for k, asked in global_reads),
        dram_bytes=round(sum(min(dram.reads[k], asked * schedule.n_tiles) for k, asked in global_reads)
                         + dram.written),
        block_barrier_before=stage.barrier is None and stage.block_barrier is not None)


def _database_work(stage: Stage, executions: int, grid: int, blocks_per_sm: int, dram: Dram) -> StageWork:
    """A stage scheduled from a MetaSchedule database (``codegen.tuned``): the model does not
    know its code, so it takes the record's measured time; a record without one is taken at the
    stage's roofline (its FLOPs at peak, its DRAM bytes at the device's bandwidth)."""
    schedule = stage.schedule
    reduction = _reduction(stage)
    return StageWork(
        name=stage.name, template=TUNED_TEMPLATE, dtype=_peak_dtype(stage, reduction), executions=executions,
        n_tiles=schedule.n_tiles, threads=schedule.threads, active_threads=schedule.threads, grid=grid,
        blocks_per_sm=blocks_per_sm, flops=_stage_flops(stage),
        tensor_core=False, gemm=is_gemm(reduction), memory_steps=0, on_chip_steps=0, block_barriers=0, accesses=(),
        l2_read_bytes=0, dram_bytes=round(sum(dram.reads) + dram.written), measured_seconds=schedule.measured_seconds)


def _stage_flops(stage: Stage) -> int:
    """The FLOPs of ``stage``'s TE and of the reductions fused into it."""
    return _executed_flops(stage.tensor) + sum(_executed_flops(r) for r in _fused_reductions(stage))


def _fused_reductions(stage: Stage) -> list[te.Tensor]:
    """The reductions computed in ``stage``'s tiles besides its TE: an epilogue's reduction, and
    a row-resident stage's statistics (``statistics_of``)."""
    if stage.epilogue == "row":
        return statistics_of(stage.tensor)
    return [_reduction(stage)] if stage.epilogue is not None else []


def _row_accesses(stage: Stage, tile: int, holders: dict) -> tuple:
    """A row-resident stage's tile (``codegen.row_resident``): each warp loads its row once, every
    tensor its blocks read ``width / (WARP * row_vector)`` times a lane (consecutive lanes on
    consecutive vectors of ``row_vector`` columns), reduces each of its row's statistics with a round of shuffles apiece, and stores
    its row. One trip to memory for the row, one more for what only the output reads (a
    LayerNorm's weight and bias). A warp of several rows loads them ``rows_together`` at a time,
    then reduces and stores them one after the other: one more trip a row for what only the
    output reads, and every row's shuffles. Returns (accesses, active threads, memory steps,
    on-chip steps, block barriers)."""
    schedule = stage.schedule
    warps = schedule.threads // WARP
    width = int(stage.tensor.shape[-1])
    rows = max(1, schedule.outputs // width)
    tile_rows = max(1, schedule.per_tile // width)
    rows_per_warp = -(-tile_rows // warps)  # the last warps' last rows idle where the tile is fewer
    span = WARP * schedule.row_vector  # the columns of a warp's access
    count = tile_rows * -(-width // span)
    first = tile * schedule.per_tile
    loads: dict = {}  # (placeholder op, place) -> (a load of it, the lanes that load it)
    for load in _loads(stage.tensor):
        if load.tensor.op in holders:
            loads.setdefault(_row_place(load), (load, _thread_lanes(stage.tensor, first, span)))
    statistics = statistics_of(stage.tensor)
    for statistic in statistics:
        lanes = _reduction_lanes(statistic, min(first // width * _size(statistic) // rows, _size(statistic) - 1), width,
                                 span)
        for load in _loads(statistic):
            if load.tensor.op in holders:
                loads.setdefault(_row_place(load), (load, lanes))
    accesses = []
    for (op, _), (load, lanes) in loads.items():
        space = "shared" if holders[op] in stage.on_chip else "global"
        accesses.append(MemoryAccess(op.name, "load", space, count, _sectors(load, lanes) if space == "global" else 1))
    accesses.append(MemoryAccess(stage.tensor.op.name, "store", "global", count,
                                 _store_sectors(stage.tensor, _thread_lanes(stage.tensor, first, span))))
    row_reads = {load.tensor.op for s in statistics for load in _loads(s)}
    output_only = any(op not in row_reads for op, _ in loads)
    shuffles = sum(_size(s) for s in statistics) // rows * SHUFFLE_ROUNDS
    trips = -(-rows_per_warp // schedule.rows_together) + rows_per_warp * int(output_only)
    return accesses, schedule.threads, trips, rows_per_warp * shuffles, 0


def _row_place(load) -> tuple:
    """Which row of its tensor a row-resident stage's ``load`` reads, as a key: the tensor, and
    the constants among its leading indices (each split-K partial a row of its own, loaded once
    by ``codegen.row_resident.with_row_value``), whatever the body's iterators are called."""
    return load.tensor.op, tuple(int(i) if isinstance(i, tirx.IntImm) else None for i in load.indices[:-1])


def _matmul_work(stage: Stage, executions: int, grid: int, blocks_per_sm: int, dram: Dram) -> StageWork:
    """One execution of a stage dlight's matmul rule schedules (``codegen.schedule.matmul_stage``),
    from its configuration rather than from the TE's indices: a tile of ``rows x cols`` outputs
    (``WARP`` lanes x ``MATMUL_VTHREADS x MATMUL_MICRO[0]`` rows by ``threads / WARP`` warps x
    ``MATMUL_MICRO[1]`` columns) walks the reduction ``MATMUL_K_CHUNK`` terms at a time. Per chunk every thread
    copies its share of both operands' slices (``rows + cols`` rows of the chunk) from global to
    shared memory, ``MATMUL_VECTOR`` elements per instruction, coalesced along the reduction; the
    block synchronizes; then for each term each thread loads its rows' values of one
    operand and ``MATMUL_MICRO[1]`` values of the other from shared memory (4 terms per 128-bit
    load where the padded slice rows allow) and issues its FMAs; and synchronizes again before
    the next chunk overwrites the slices. A warp's loads of the row operand hit the same
    shared-memory banks from several lanes (the conflict degree from the padded row stride), its
    loads of the column operand are one address broadcast to the warp; the results are stored
    from registers once, one element per lane and instruction, a warp's lanes on ``WARP`` rows
    (one sector each)."""
    schedule = stage.schedule
    reduction = _reduction(stage)
    warps = schedule.threads // WARP
    rows, cols = WARP * MATMUL_VTHREADS * MATMUL_MICRO[0], warps * MATMUL_MICRO[1]
    terms = _reduction_length(reduction)
    chunks = -(-terms // MATMUL_K_CHUNK)
    # the copies read the operands' dtype; the slices hold float32 (narrower operands are
    # widened as they are copied: ``codegen.schedule.widened_operands``)
    itemsize = np.dtype(_operand_dtype(reduction)).itemsize
    slice_itemsize = max(itemsize, 4)
    vector_sectors = max(1, WARP * MATMUL_VECTOR * itemsize // SECTOR_BYTES)
    slice_sectors = max(1, WARP * MATMUL_VECTOR * slice_itemsize // SECTOR_BYTES)
    copies = -(-(rows + cols) * chunks * MATMUL_K_CHUNK // (WARP * MATMUL_VECTOR))
    # a slice row holds MATMUL_K_CHUNK terms padded by MATMUL_VECTOR (dlight's storage_align);
    # at one term the lanes read the row operand MATMUL_MICRO[0] rows apart: that stride's
    # common factor with the 32 four-byte banks is how many lanes share a bank (1 at 17 words,
    # 8 at dlight's default 4 x 18)
    row_words = (MATMUL_K_CHUNK + MATMUL_VECTOR) * slice_itemsize // 4
    stride = MATMUL_MICRO[0] * row_words
    row_loads = MATMUL_VTHREADS * MATMUL_MICRO[0]
    # nvcc unrolls a chunk's terms, and where a slice row starts on 16 bytes loads 4 consecutive
    # float32 terms of it with one 128-bit instruction (checked with cuobjdump on a 384 x 3072 x
    # 768 dense, sm_90: with rows of 20 words 40 LDS.128 per 256 FFMA in 64 x 64 tiles, 32 in
    # 128 x 32 tiles; with rows of 17, 43 narrower loads per 128 FFMA). A 128-bit load is served
    # 8 lanes (128 bytes) at a time: 4 wavefronts, times the lanes of 8 whose 16 bytes share banks.
    if slice_itemsize == 4 and row_words % 4 == 0 and MATMUL_K_CHUNK % 4 == 0:
        k_vector = 4
        groups = len({stride * lane % SHARED_BANKS // 4 for lane in range(8)})
        row_sectors = 4 * (8 // groups) * L1_SECTORS_PER_CLOCK
    else:
        k_vector = 1
        row_sectors = math.gcd(stride, SHARED_BANKS) * L1_SECTORS_PER_CLOCK
    accesses = (MemoryAccess("operand slices", "load", "global", copies, vector_sectors),
                MemoryAccess("operand slices", "store", "shared", copies, slice_sectors),
                MemoryAccess("row operand", "load", "shared", warps * terms * row_loads // k_vector, row_sectors),
                MemoryAccess("column operand", "load", "shared", warps * terms * MATMUL_MICRO[1] // k_vector, 1),
                MemoryAccess(stage.tensor.op.name, "store", "global", -(-rows * cols // WARP), WARP))
    flops = _gemm_flops(stage, reduction)
    issued = _padded_flops(stage, reduction, rows * cols * chunks * MATMUL_K_CHUNK)
    read_bytes = sum(dram.reads)
    return StageWork(
        name=stage.name, template="matmul", dtype=_peak_dtype(stage, reduction), executions=executions,
        n_tiles=schedule.n_tiles, threads=schedule.threads, active_threads=schedule.threads, grid=grid,
        blocks_per_sm=blocks_per_sm, flops=flops, tensor_core=False, gemm=True, memory_steps=chunks,
        on_chip_steps=terms, block_barriers=2 * chunks, accesses=accesses, issued_flops=issued,
        l2_read_bytes=(rows + cols) * chunks * MATMUL_K_CHUNK * itemsize,
        dram_bytes=round(min(read_bytes, (rows + cols) * chunks * MATMUL_K_CHUNK * itemsize * schedule.n_tiles)
                         + dram.written),
        block_barrier_before=stage.barrier is None and stage.block_barrier is not None)


def _tensor_core_work(stage: Stage, executions: int, grid: int, blocks_per_sm: int,
                      dram: Dram) -> StageWork:
    """One execution of a stage on tensor cores (``codegen.tensor_core``), from its tile: per
    chunk of ``depth`` terms every thread copies its share of both operands' slices (``rows +
    columns`` rows) from global to shared memory, ``copy_vector`` float16, bfloat16 or float32 elements
    (16 bytes) per store, loaded in the instructions the schedule found (``_slice_copies``); the
    block synchronizes; for each 16 terms (8 in TF32) each of the tile's warps (the tensor cores
    see those alone; a tile of 4 warps idles the block's other 4) loads its
    ``fragments_i + fragments_j`` fragments from shared memory (512 bytes each) and issues its
    ``mma_sync``s; the block synchronizes again. At the end each warp stores its accumulators to
    shared memory (1 KB per fragment), the block synchronizes, and the tile is read back and
    stored to global memory ``store_vector`` elements per instruction, the epilogue computed on the way.
    A tile whose slices are copied by cp.async waits on memory once for every ``async_stages - 1``
    chunks (that many are in flight together), where the register pipeline waits once a chunk."""
    schedule = stage.schedule
    reduction = _reduction(stage)
    tile = schedule.tensor_core_tile
    warps = tile.warps  # the tile's: a tile of fewer warps than the block's idles the others
    rows, cols = tile.rows, tile.columns
    terms = _reduction_length(reduction)
    chunks = -(-terms // tile.depth)
    steps = chunks * tile.k_fragments
    # the chunks whose loads one wait covers: one a chunk, or with a ring of cp.async copies, the
    # ``async_stages - 1`` chunks in flight together
    in_flight = tile.async_stages - 1 if tile.copies_async else 1
    operand = str(reduction.op.input_tensors[0].dtype)  # both operands', at the tensor-core peak of their dtype
    element, out = np.dtype(operand).itemsize, np.dtype(str(stage.tensor.dtype)).itemsize
    peak_dtype = "tf32" if operand == "float32" else operand  # float32 operands are multiplied in TF32
    fragment_sectors = FRAGMENT * tile.fragment_k * element // SECTOR_BYTES
    accumulator_sectors = FRAGMENT * FRAGMENT * 4 // SECTOR_BYTES
    stores = rows * cols // (WARP * tile.store_vector)
    accesses = (*_slice_copies(reduction, (rows, cols), chunks * tile.depth, element, tile.copy_vector,
                                tile.warp_copies, tile.copies_async),
                MemoryAccess("fragments", "load", "shared", warps * steps * (tile.fragments_i + tile.fragments_j),
                             fragment_sectors),
                MemoryAccess("accumulators", "store", "shared", warps * tile.fragments_i * tile.fragments_j,
                             accumulator_sectors),
                MemoryAccess("accumulators", "load", "shared", stores, WARP * tile.store_vector * 4 // SECTOR_BYTES),
                MemoryAccess(stage.tensor.op.name, "store", "global", stores,
                             max(1, WARP * tile.store_vector * out // SECTOR_BYTES)))
    flops = _gemm_flops(stage, reduction)
    issued = _padded_flops(stage, reduction, rows * cols * chunks * tile.depth)
    read_bytes = sum(dram.reads)
    slices = (rows + cols) * chunks * tile.depth * element
    return StageWork(
        name=stage.name, template="tensor_core", dtype=peak_dtype, executions=executions,
        n_tiles=schedule.n_tiles, threads=schedule.threads, active_threads=warps * WARP, grid=grid,
        blocks_per_sm=blocks_per_sm, flops=flops, tensor_core=True, gemm=True, memory_steps=-(-chunks // in_flight) + 1,
        on_chip_steps=steps + 2, block_barriers=2 * chunks + 2, accesses=accesses, l2_read_bytes=slices,
        issued_flops=issued,
        dram_bytes=round(min(read_bytes, slices * schedule.n_tiles) + dram.written),
        block_barrier_before=stage.barrier is None and stage.block_barrier is not None)


def _slice_copies(reduction: te.Tensor, extents: tuple[int, int], terms: int, element: int,
                  vector: int, warp_copies: tuple = (), asynchronous: bool = False) -> list[MemoryAccess]:
    """A tensor-core tile's copies of its operands' slices (``extents``: rows, columns; ``terms``
    per row, all chunks), global to shared: ``vector`` elements per store, loaded as the schedule
    found (``TensorCoreTile.warp_copies``: one instruction a vector, or one a lane of it, and the
    sectors each touches; a scaled operand's too), else one coalesced instruction a vector; or one
    element a lane where the operand is gathered under a condition
    (``codegen.schedule.gathered_factors``: a padded convolution's input),
    whose warp reads 32 consecutive terms of a row, in the sectors the lanes' indices touch.
    ``asynchronous``: copied by ``cp.async``, which TVM prints as ``cp.async.cg`` (L2 only, no
    pass through L1) for 16 bytes a lane, the only size .cg takes, and as ``.ca`` below it."""
    accesses = []
    for index, (name, extent, gathered) in enumerate(zip(("first operand", "second operand"), extents,
                                                           gathered_factors(reduction))):
        measured = warp_copies[index] if warp_copies else None
        width = measured.width if measured is not None else 1 if gathered else vector
        copies = extent * terms // (WARP * width)
        if measured is not None:
            loads, sectors = copies * measured.loads, -(-measured.sectors // measured.loads)
        elif gathered:
            loads, sectors = copies, _gathered_sectors(reduction)
        else:
            loads, sectors = copies, WARP * width * element // SECTOR_BYTES
        bypasses_l1 = asynchronous and not gathered and width * element == CP_ASYNC_CG_BYTES
        accesses += [MemoryAccess(f"{name} slices", "load", "global", loads, sectors, through_l1=not bypasses_l1),
                     MemoryAccess(f"{name} slices", "store", "shared", copies,
                                  max(1, WARP * width * element // SECTOR_BYTES))]
    return accesses


def _gathered_sectors(reduction: te.Tensor) -> int:
    """The sectors a warp's copy of a gathered operand touches: its lanes take 32 consecutive
    terms of one row (a middle output), each its guarded load."""
    guarded = next(load for load in tensor_loads(reduction.op.body[0]) if load.conditions)
    return _sectors(guarded, _reduction_lanes(reduction, _size(reduction) // 2, _reduction_length(reduction)))


def _padded_flops(stage: Stage, reduction: te.Tensor, products_per_tile: int) -> int:
    """The FLOPs a GEMM's tiles issue, ``products_per_tile`` multiply-adds each (the tile's
    outputs times its chunks' terms: dlight pads a GEMM to whole tiles and chunks), its epilogue
    included."""
    epilogue = _executed_flops(stage.tensor) if stage.epilogue is not None else 0
    return 2 * products_per_tile * stage.schedule.n_tiles + epilogue


# -- one warp's accesses, evaluated at a representative warp --------------------------------------
def _loads(tensor: te.Tensor) -> list:
    """The loads ``tensor``'s body issues, each distinct (tensor, indices) once: nvcc loads an
    element the expression reads twice (an inlined ``x * sigmoid(x)``) once."""
    distinct: list = []
    for body in tensor.op.body:
        for load in tensor_loads(body):
            if not any(seen.tensor.op.same_as(load.tensor.op)
                       and structural_equal(list(seen.indices), list(load.indices)) for seen in distinct):
                distinct.append(load)
    return distinct


def _thread_lanes(tensor: te.Tensor, first: int, span: int = WARP) -> list[tuple[int, dict]]:
    """(flat output index, axis values) of the lanes of a warp whose threads take consecutive
    outputs of ``tensor`` from ``first`` (lanes past the last output are idle), each at the
    middle of the reduction; ``span`` outputs where each lane takes a vector of them (a
    row-resident stage's ``row_vector``)."""
    op = tensor.op
    shape = [int(d) for d in tensor.shape]
    box = _reduce_box(tensor) if getattr(op, "reduce_axis", None) else []
    middle = {ax.var: lower + extent // 2 for ax, (lower, extent) in zip(getattr(op, "reduce_axis", []), box)}
    return [(flat, {**dict(zip((ax.var for ax in op.axis), unravel(flat, shape))), **middle})
            for flat in range(first, min(first + span, _size(tensor)))]


def _reduction_lanes(reduction: te.Tensor, output: int, terms: int, span: int = WARP) -> list[tuple[int, dict]]:
    """(flat output index, axis values) of a warp_reduce warp's lanes: output ``output``,
    consecutive steps of the (row-major fused) reduction from its middle; ``span`` steps where
    each lane takes a vector of them."""
    op = reduction.op
    spatial = dict(zip((ax.var for ax in op.axis), unravel(output, [int(d) for d in reduction.shape])))
    box = _reduce_box(reduction)
    start = (terms // 2) // span * span
    lanes = []
    for step in range(start, min(start + span, terms)):
        index = unravel(step, [extent for _, extent in box])
        reduce = {ax.var: lower + r for ax, (lower, _), r in zip(op.reduce_axis, box, index)}
        lanes.append((output, {**spatial, **reduce}))
    return lanes


def _sectors(load, lanes: list[tuple[int, dict]]) -> int:
    """Distinct 32-byte sectors the lanes' loads of ``load`` touch (row-major, from the tensor's
    start); a lane whose index cannot be evaluated (it reads memory) counts as its own sector."""
    shape = [int(d) for d in load.tensor.shape]
    itemsize = np.dtype(str(load.tensor.dtype)).itemsize
    sectors: set = set()
    for lane, (_, env) in enumerate(lanes):
        index = [_value(i, env) for i in load.indices]
        if any(i is None for i in index):
            sectors.add(("lane", lane))
            continue
        flat = 0
        for i, extent in zip(index, shape):
            flat = flat * extent + i
        sectors.add(flat * itemsize // SECTOR_BYTES)
    return max(1, len(sectors))


def _store_sectors(tensor: te.Tensor, lanes: list[tuple[int, dict]]) -> int:
    """Distinct sectors of ``tensor``'s output the lanes store, one output each."""
    itemsize = np.dtype(str(tensor.dtype)).itemsize
    return max(1, len({flat * itemsize // SECTOR_BYTES for flat, _ in lanes}))


_BINARY = {
    tirx.Add: lambda a, b: a + b,
    tirx.Sub: lambda a, b: a - b,
    tirx.Mul: lambda a, b: a * b,
    tirx.FloorDiv: lambda a, b: a // b,
    tirx.FloorMod: lambda a, b: a % b,
    tirx.Div: lambda a, b: int(a / b),
    tirx.Mod: lambda a, b: a - b * int(a / b),
    tirx.Min: min,
    tirx.Max: max,
    tirx.LT: lambda a, b: a < b,
    tirx.LE: lambda a, b: a <= b,
    tirx.GT: lambda a, b: a > b,
    tirx.GE: lambda a, b: a >= b,
    tirx.EQ: lambda a, b: a == b,
    tirx.NE: lambda a, b: a != b,
    tirx.And: lambda a, b: a and b,
    tirx.Or: lambda a, b: a or b,
}


def _value(expr, env: dict) -> int | None:
    """``expr`` (integer index arithmetic) at the axis values ``env``; None where it reads memory
    or is not index arithmetic."""
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        return env.get(expr)
    if isinstance(expr, tirx.Cast):
        return _value(expr.value, env)
    if isinstance(expr, tirx.Select):
        condition = _value(expr.condition, env)
        return None if condition is None else _value(expr.true_value if condition else expr.false_value, env)
    operation = _BINARY.get(type(expr))
    if operation is None:
        return None
    a, b = _value(expr.a, env), _value(expr.b, env)
    if a is None or b is None or (b == 0 and type(expr) in (tirx.FloorDiv, tirx.FloorMod, tirx.Div, tirx.Mod)):
        return None
    return int(operation(a, b))


# -- what one tile reads from L2 ------------------------------------------------------------------
def _tile_read_bytes(stage: Stage, read: int, tile: int) -> int:
    """Bytes of the 32-byte sectors tile ``tile`` of ``stage`` reads of its ``read``-th input,
    each sector once: L1 serves the tile's reuse of a sector, L2 the first touch."""
    holder = stage.placeholders[read]
    relation, _ = stage.read_relation(holder)
    tiles = stage_tiles(stage.schedule, relation.get_tuple_name(isl.dim_type.in_), stage.tensor.shape, "T")
    outputs = tiles.intersect_range(isl.Set(f"{{ T[{tile}] }}")).domain()
    elements = relation.intersect_domain(outputs).range()
    names = [f"a{k}" for k in range(len(holder.shape))]
    per_sector = max(1, SECTOR_BYTES // np.dtype(str(holder.dtype)).itemsize)
    sector = isl.Map(f"{{ {relation.get_tuple_name(isl.dim_type.out)}[{', '.join(names)}] -> S[s] : "
                     f"s = floor(({flat_index(names, holder.shape)})/{per_sector}) }}")
    return count_points(elements.apply(sector)) * SECTOR_BYTES
