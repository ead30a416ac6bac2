"""A static latency model of a GPU program's stages: what a stage's schedule, as emitted, should
take on a device model, and the whole model's estimate next to its roofline bound.

It is a model, not a measurement: its constants are published figures where there are any and
stated assumptions elsewhere, each to be corrected once the same kernels are timed on a GPU. It
takes plain numbers (``StageWork``, which ``codegen.latency`` reads off the staged program), so
it knows nothing of TE or TIR.

A stage runs its ``n_tiles`` tiles on ``grid`` co-resident blocks, tile t on block t mod grid,
and the blocks are taken to be spread evenly over the SMs (the block scheduler's round robin).
So a block runs up to ``waves = ceil(n_tiles / grid)`` tiles one after the other, and the busiest
SM holds ``ceil(min(n_tiles, grid) / SMs)`` working blocks and ``ceil(n_tiles / min(SMs, grid))``
tiles. One execution of the stage takes the largest of five times:

- latency: each block's tiles in turn, each the dependent chain of one of its threads: round
  trips to memory (``memory_steps``, at the average latency of the stage's loads: L1 hits, the
  rest from L2, the share of DRAM bytes from DRAM), on-chip steps (warp shuffles) and
  ``__syncthreads``;
- FP: the busiest SM's FLOPs at its share of the peak, scaled by how many of its FP32 lanes (or
  tensor cores) the tiles resident on it keep busy: a tile of 8 active threads leaves 120 of an
  H100 SM's 128 lanes idle. Tensor-core peak only where the schedule issues mma (``tensor_core``);
- L1: the busiest SM's warp memory instructions (but the global side of a ``cp.async.cg``, whose
  bytes the shared store counts), each taking ``max(1, sectors / 4)`` clocks of
  the L1/shared memory's 128 bytes per clock: an uncoalesced access (32 lanes, 32 sectors) takes
  8 clocks where a coalesced one takes 1;
- L2: every tile's global loads at sector granularity, each sector once per tile (L1 keeps a
  tile's reuse), plus every global store (L1 writes through to L2), at
  ``DeviceModel.l2_bandwidth``;
- DRAM: the stage's bytes that miss L2 (``codegen.traffic.l2_traffic``: its distinct bytes less
  what earlier stages left in L2, plus the dirty bytes its accesses evict), at most what its
  loads request (a gather's read relation spans the whole table it indexes).

Where ``WARPS_TO_SATURATE`` is set, L1, L2 and DRAM reach those throughputs only with enough
warps waiting on them: an SM with fewer warps of working blocks gets that share of its L1, and
the GPU that share of L2 and DRAM (one block of 8 warps per SM, the LSTM's with its weights on
chip: a quarter at 32).

Which of them is the largest is the stage's ``bound``. The whole model adds every stage's time
times its executions (scan bodies run once per trip), ``DeviceModel.grid_sync_seconds`` per grid
barrier executed, at its own kernel's grid (measured on an H100: it grows with the grid's blocks) and
``DeviceModel.launch_seconds`` per kernel launched. Its roofline bound is ``max(FLOPs at peak,
compulsory bytes at DRAM bandwidth)``: no schedule beats it. A stage's
``fraction_of_peak`` is its FLOPs over its time at the peak of its dtype (the FMA peak for
float32, the tensor-core peak for float16 and bfloat16, and for float32 operands multiplied in TF32
the ``tf32`` one), the figure the 40%-of-peak goal for GEMM-shaped stages is checked against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from analysis.device import DeviceModel

SECTOR_BYTES = 32  # the unit L1 and L2 move global memory in (CUDA C++ Best Practices Guide, "Coalesced Access")
# The L1/shared-memory array returns 128 bytes per clock per SM: 32 banks of 4 bytes each per clock
# (CUDA C++ Programming Guide, shared memory of compute capability 5.x and later; L1 and shared
# memory are one array since Volta), i.e. 4 sectors per clock.
L1_SECTORS_PER_CLOCK = 4
# Latencies in SM clocks: round figures of the order published microbenchmarks give (Jia et al.,
# "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018: an L1 hit 28 clocks,
# an L2 hit 193 on V100), DRAM twice L2. Assumptions for the A100, H100 and H200 until measured.
L1_HIT_CYCLES = 30
L2_HIT_CYCLES = 200
DRAM_CYCLES = 400
ON_CHIP_STEP_CYCLES = 30  # a warp shuffle round, taken as an L1 hit's latency (an assumption)
BLOCK_BARRIER_CYCLES = 30  # a __syncthreads once every warp has arrived (an assumption)
# Warps an SM needs resident to keep its memory pipelines busy, or None to take every stage at
# its throughputs whatever its occupancy. With fewer, each warp waits on its own loads and L1, L2
# and DRAM serve a share warps / WARPS_TO_SATURATE of their peak (Little's law: the bytes in
# flight are what the resident warps asked for). On the H200's 59 measured kernels 32 (half an
# SM's 64 warp slots) orders the opt levels as measured in 77 of 84 pairs against 73 without it,
# measured over estimated 1.62 at the median against 3.08 (benchmarks/results/latency_vs_h200.md
# and latency_vs_h200_warps32.md: paper LSTM O3 and O4, BERT and ResNeXt O2 and O4 the right way
# round), but it also moves the schedules codegen.stage picks (with the 128 x 32 matmul tiles of
# that run: small GEMMs from dlight's matmul to thread_reduce, BERT's tensor-core tiles from 128
# to 64 wide) to kernels no GPU has timed. The H100 has timed both: on its 87 kernels the term
# brings the median to 1.54 against 2.34 and the least-squares stage factor to 1.08 against 1.81,
# and orders 99 of 111 pairs against 97 (latency_vs_h100.md, latency_vs_h100_warps32.md), but
# the schedules it picks (the `occupancy` variant, gpu_h100.md) ran from 0.85x (paper BERT fp16)
# to 1.28x (Swin fp16) the default's: it stays off while it slows BERT fp16, the model with a goal.
WARPS_TO_SATURATE: int | None = None
TENSOR_CORES_PER_SM = 4  # one per SM sub-partition (A100 and H100 architecture whitepapers)
TIMES = ("latency", "fp", "l1", "l2", "dram")  # the five times a modelled stage takes the largest of
GOAL_FRACTION = 0.4  # the goal: GEMM-shaped stages at 40% or more of their dtype's peak


@dataclass(frozen=True)
class MemoryAccess:
    """One memory instruction of a stage's code, as a warp runs it."""

    tensor: str
    kind: str  # "load" or "store"
    space: str  # "global" or "shared"
    per_tile: int  # times the tile's warps run it
    sectors: int  # distinct 32-byte sectors the warp's lanes touch (1 for an unconflicted shared access)
    # False for the global side of a 16-byte ``cp.async.cg``: it caches in L2 only (PTX ISA,
    # cp.async's .cg qualifier), its bytes land in shared memory without an L1 pass, so they cross
    # the L1/shared array once, as the shared store counted beside it
    through_l1: bool = True


@dataclass(frozen=True)
class StageWork:
    """One stage as its schedule runs it, per execution: the facts the model reads."""

    name: str
    template: str
    dtype: str  # the arithmetic's, whose peak it runs at ("tf32": float32 operands on tensor cores)
    executions: int  # per inference: the product of the enclosing loops' trips
    n_tiles: int
    threads: int  # per block
    active_threads: int  # threads of a tile that compute (a warp_reduce tile of 3 outputs: 96)
    grid: int  # blocks of its kernel
    blocks_per_sm: int  # co-resident blocks of its kernel per SM
    flops: int
    tensor_core: bool  # whether the schedule issues tensor-core (mma) instructions
    gemm: bool  # a reduction of products (dense, matmul, convolution): what the 40% goal is about
    memory_steps: int  # dependent round trips to memory on one thread's path through a tile
    on_chip_steps: int  # dependent on-chip steps (shuffle rounds) on that path
    block_barriers: int  # __syncthreads per tile
    accesses: tuple[MemoryAccess, ...]
    l2_read_bytes: int  # per tile: the sectors its global loads touch, each once
    dram_bytes: int  # distinct bytes read and written per execution
    block_barrier_before: bool = False  # a __syncthreads before the stage, once per block
    # FLOPs the tiles issue where they exceed ``flops``: a GEMM's tiles padded past its edges
    # multiply zeros at the same cost (``flops`` stays the useful work the share of peak counts)
    issued_flops: int = 0
    # a schedule taken from a MetaSchedule database (``codegen.tuned``): its record's run time on
    # the GPU it was tuned on, taken as the stage's time instead of the model's five
    measured_seconds: float | None = None

    @property
    def waves(self) -> int:
        return -(-self.n_tiles // self.grid)

    @property
    def last_wave_use(self) -> float:
        """The share of the grid's blocks at work in the last wave."""
        return (self.n_tiles - (self.waves - 1) * self.grid) / self.grid


@dataclass(frozen=True)
class StageEstimate:
    """One stage's estimated time per execution, the five times it is the largest of, and why."""

    work: StageWork
    seconds: float
    times: dict  # each of TIMES -> seconds; {"measured": seconds} for a schedule from a database
    fraction_of_peak: float | None  # None for a stage without FLOPs

    @property
    def bound(self) -> str:
        return max(self.times, key=self.times.get)

    @property
    def total_seconds(self) -> float:
        return self.seconds * self.work.executions


def load_latency_cycles(work: StageWork, device: DeviceModel) -> float:
    """The average latency of the stage's global loads: an L1 hit, or an L2 hit for the share of
    requested sectors L1 misses (``l2_read_bytes`` of all requested), or DRAM for the share of
    DRAM bytes."""
    requested = sum(a.per_tile * a.sectors for a in work.accesses
                    if a.kind == "load" and a.space == "global") * SECTOR_BYTES * work.n_tiles
    if not requested:
        return L1_HIT_CYCLES
    missed = min(1.0, work.l2_read_bytes * work.n_tiles / requested)
    from_dram = min(missed, work.dram_bytes / requested)
    return L1_HIT_CYCLES + missed * (L2_HIT_CYCLES - L1_HIT_CYCLES) + from_dram * (DRAM_CYCLES - L2_HIT_CYCLES)


def estimate_stage(work: StageWork, device: DeviceModel) -> StageEstimate:
    """One execution of ``work`` on ``device`` (see the module docstring)."""
    if device.kind != "gpu" or not device.l2_bandwidth:
        raise ValueError(f"the latency model is for GPUs; device {device.name!r} has no L2 bandwidth figure")
    if work.measured_seconds is not None:
        seconds = work.measured_seconds
        fraction = work.flops / (seconds * device.peak(work.dtype)) if work.flops and seconds else None
        return StageEstimate(work, seconds, {"measured": seconds}, fraction)
    clock = device.clock_hz
    working_blocks = min(work.n_tiles, work.grid)
    blocks_on_sm = -(-working_blocks // device.sms)
    warps_per_block = -(-work.threads // device.warp_size)
    sm_share = gpu_share = 1.0
    if WARPS_TO_SATURATE:
        sm_share = min(1.0, blocks_on_sm * warps_per_block / WARPS_TO_SATURATE)
        gpu_share = min(1.0, working_blocks * warps_per_block / (device.sms * WARPS_TO_SATURATE))
    tiles_on_sm = -(-work.n_tiles // min(device.sms, work.grid))
    chain = (work.memory_steps * load_latency_cycles(work, device) + work.on_chip_steps * ON_CHIP_STEP_CYCLES
             + work.block_barriers * BLOCK_BARRIER_CYCLES)
    latency = (work.waves * chain + BLOCK_BARRIER_CYCLES * work.block_barrier_before) / clock
    if work.tensor_core:
        busy = min(1.0, blocks_on_sm * (work.active_threads / device.warp_size) / TENSOR_CORES_PER_SM)
        sm_peak = device.peak(work.dtype) / device.sms
    else:
        busy = min(1.0, blocks_on_sm * work.active_threads / device.fp32_lanes_per_sm)
        sm_peak = device.peak("float32") / device.sms
    fp = tiles_on_sm * (max(work.flops, work.issued_flops) / work.n_tiles) / (sm_peak * busy) if work.flops else 0.0
    l1_clocks = sum(a.per_tile * max(1.0, a.sectors / L1_SECTORS_PER_CLOCK) for a in work.accesses if a.through_l1)
    stores = sum(a.per_tile * a.sectors for a in work.accesses if a.kind == "store" and a.space == "global")
    times = {
        "latency": latency,
        "fp": fp,
        "l1": tiles_on_sm * l1_clocks / clock / sm_share,
        "l2": work.n_tiles * (work.l2_read_bytes + stores * SECTOR_BYTES) / device.l2_bandwidth / gpu_share,
        "dram": work.dram_bytes / device.mem_bandwidth / gpu_share,
    }
    seconds = max(times.values())
    # the peak of the stage's dtype: FMA for float32, tensor cores for float16, bfloat16 and tf32 (the goal's peaks)
    fraction = work.flops / (seconds * device.peak(work.dtype)) if work.flops and seconds else None
    return StageEstimate(work, seconds, times, fraction)


def _bound(estimate: StageEstimate) -> str:
    """What sets a stage's time, for the report: the largest of the model's times, or a measurement."""
    return "measured on the GPU it was tuned on" if estimate.bound == "measured" else f"{estimate.bound}-bound"


@dataclass(frozen=True)
class LatencyEstimate:
    """The whole model on one device: every stage's estimate, the barriers and launches."""

    model: str
    device: DeviceModel
    stages: tuple[StageEstimate, ...]
    barriers: tuple[tuple[int, int], ...]  # per kernel: (its grid, grid barriers it executes per inference)
    launches: int  # kernels launched per inference
    compulsory_bytes: int  # weights, inputs and outputs: what any implementation moves once

    @property
    def stage_seconds(self) -> float:
        return sum(s.total_seconds for s in self.stages)

    @property
    def grid_barriers(self) -> int:
        """Grid barriers executed per inference, in every kernel."""
        return sum(count for _, count in self.barriers)

    @property
    def barrier_grid(self) -> int:
        """The blocks the widest kernel's grid barrier waits for (a one-kernel program's only grid)."""
        return max((grid for grid, _ in self.barriers), default=1)

    @property
    def barrier_seconds(self) -> float:
        """Each kernel's barriers at its own grid: a barrier waits for every block of its kernel."""
        return sum(count * self.device.grid_sync_seconds(grid) for grid, count in self.barriers)

    @property
    def launch_seconds(self) -> float:
        return self.launches * self.device.launch_seconds

    @property
    def seconds(self) -> float:
        return self.stage_seconds + self.barrier_seconds + self.launch_seconds

    @property
    def flops(self) -> int:
        return sum(s.work.flops * s.work.executions for s in self.stages)

    @property
    def roofline_seconds(self) -> float:
        """max(every stage's FLOPs at its dtype's peak, the compulsory bytes at DRAM bandwidth)."""
        compute = sum(s.work.flops * s.work.executions / self.device.peak(s.work.dtype)
                      for s in self.stages if s.work.flops)
        return max(compute, self.compulsory_bytes / self.device.mem_bandwidth)

    def gemm_stages(self) -> list[StageEstimate]:
        return [s for s in self.stages if s.work.gemm and s.fraction_of_peak is not None]

    def summary(self) -> dict[str, str]:
        """The report's lines: the estimate and its parts, the roofline bound, the GEMM-shaped stages."""
        d = self.device
        head = (f"{d.name}: {_duration(self.seconds)} = stages {_duration(self.stage_seconds)} + "
                f"{self.grid_barriers} grid "
                f"barriers {_duration(self.barrier_seconds)} + {self.launches} launch{'es' * (self.launches != 1)} "
                f"{_duration(self.launch_seconds)} (a static model, not a measurement)")
        ratio = self.seconds / self.roofline_seconds if self.roofline_seconds else math.inf
        lines = {"latency model": head,
                 "roofline bound": f"{_duration(self.roofline_seconds)} on {d.name} (the estimate is {ratio:.3g}x it)"}
        gemms = self.gemm_stages()
        if gemms:
            best = max(gemms, key=lambda s: s.fraction_of_peak)
            at_goal = sum(s.fraction_of_peak >= GOAL_FRACTION for s in gemms)
            lines["GEMM stages"] = (f"{at_goal} of {len(gemms)} at >= {GOAL_FRACTION:.0%} of peak; best "
                                    f"{_percent(best.fraction_of_peak)} ({best.work.name}, {_bound(best)})")
        slowest = sorted(self.stages, key=lambda s: s.total_seconds, reverse=True)[:3]
        lines["slowest stages"] = "; ".join(
            f"{s.work.name} {_duration(s.total_seconds)} ({s.work.template}, {_bound(s)}"
            + (f", {_percent(s.fraction_of_peak)} of peak" if s.fraction_of_peak is not None else "") + ")"
            for s in slowest)
        return lines

    def table(self) -> str:
        """One line per stage: executions, tiles and waves, the five times, the bound, the share of peak."""
        header = (f"latency model {self.model} on {self.device.name} (static estimate): {_duration(self.seconds)}, "
                  f"roofline bound {_duration(self.roofline_seconds)}")
        columns = (f"  {'stage':<48} {'runs':>5} {'tiles':>6} {'waves':>5} {'us/run':>9} "
                   + " ".join(f"{k:>8}" for k in TIMES) + f" {'bound':>7} {'peak':>6}")
        lines = [header, columns]
        for s in self.stages:
            w = s.work
            share = _percent(s.fraction_of_peak) if s.fraction_of_peak is not None else "-"
            lines.append(f"  {w.name[:48]:<48} {w.executions:>5} {w.n_tiles:>6} {w.waves:>5} {s.seconds * 1e6:>9.2f} "
                         + " ".join(f"{s.times[k] * 1e6:>8.2f}" if k in s.times else f"{'-':>8}" for k in TIMES)
                         + f" {s.bound:>7} {share:>6}")
        return "\n".join(lines)

    __str__ = table

    def to_json(self) -> dict:
        return {"device": self.device.name, "seconds": self.seconds, "stage_seconds": self.stage_seconds,
                "barrier_seconds": self.barrier_seconds, "launch_seconds": self.launch_seconds,
                "roofline_seconds": self.roofline_seconds, "grid_barriers": self.grid_barriers,
                "barriers": [{"grid": grid, "executed": count} for grid, count in self.barriers],
                "launches": self.launches,
                "stages": [{"name": s.work.name, "template": s.work.template, "executions": s.work.executions,
                            "n_tiles": s.work.n_tiles, "waves": s.work.waves,
                            "last_wave_use": s.work.last_wave_use, "seconds": s.seconds,
                            "times": s.times, "bound": s.bound, "fraction_of_peak": s.fraction_of_peak,
                            "gemm": s.work.gemm} for s in self.stages]}


def estimate_program(model: str, works: list[StageWork], barriers: list[tuple[int, int]], launches: int,
                     compulsory_bytes: int, device: DeviceModel) -> LatencyEstimate:
    """The whole model: every stage of ``works`` estimated on ``device``, with its barriers ((grid,
    executed count) per kernel) and launches."""
    return LatencyEstimate(model, device, tuple(estimate_stage(w, device) for w in works),
                           tuple((int(g), int(n)) for g, n in barriers), launches, compulsory_bytes)


def _duration(seconds: float) -> str:
    """3 significant digits in ms, us or ns."""
    for unit, scale in (("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _percent(fraction: float) -> str:
    return f"{fraction:.1%}" if fraction >= 0.001 else "<0.1%"
