"""The static latency model (analysis.latency) and the facts it reads off a staged program
(codegen.latency): a dense layer's stage worked out by hand on the H100 model, and the model's
response to tiles, barriers and launches; a reduction stores its register once."""

import dataclasses
import math

import numpy as np
import pytest

from analysis.device import DEVICES, H100, Occupancy, get_device
from analysis.latency import (
    DRAM_CYCLES,
    L1_HIT_CYCLES,
    L2_HIT_CYCLES,
    MemoryAccess,
    StageWork,
    estimate_program,
    estimate_stage,
)
import codegen.schedule
from codegen.latency import latency_estimate, stage_seconds, stage_works
from codegen.schedule import schedule_candidates
from codegen.traffic import memory_traffic
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder

M, N, K = 512, 256, 128  # x [M, K] times w [N, K]^T: 131072 outputs, one per thread of 512 tiles


def _dense():
    """relu(x @ w.T + b): at O4 one thread_reduce stage with relu as its register epilogue; at O2
    the matmul, then an elementwise stage."""
    b = GraphBuilder("dense")
    x = b.input("x", (M, K))
    w = b.param("w", np.ones((N, K), np.float32))
    bias = b.param("b", np.ones((N,), np.float32))
    return b.build(b.op("relu", b.op("dense", x, w, bias, name="fc"), name="act"))


@pytest.fixture(scope="module")
def dense_works():
    """The stages as the thread_reduce template schedules them (a GEMM this size goes to
    dlight's matmul rule by default: ``test_matmul_stage_facts_by_hand``)."""
    graph = _dense()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codegen.schedule, "MATMUL_MIN_OUTPUTS", M * N + 1)
        return {level: stage_works(run_passes(graph, "cuda", stop="plan_arena", device="h100", opt_level=level).ir,
                                   H100) for level in (2, 4)}


def test_matmul_stage_facts_by_hand():
    """The same dense layer as dlight's matmul rule schedules it at O4 (relu and bias in its
    epilogue): tiles of 64 x 64 outputs, K walked 16 terms at a time through shared memory."""
    (work,) = stage_works(run_passes(_dense(), "cuda", stop="plan_arena", device="h100", opt_level=4).ir, H100)
    assert (work.template, work.n_tiles, work.threads, work.active_threads) == ("matmul", (M // 64) * (N // 64), 256, 256)
    assert work.gemm and work.flops == 2 * M * N * K + M * N
    chunks = K // 16
    copies = (64 + 64) * K // (32 * 4)  # both slices of every chunk, 4 floats (16 sectors a warp) per lane
    # lane i holds rows i and i + 32, padded to 20 floats: nvcc loads 4 terms of a row at once, 8
    # lanes' 16 bytes on 8 distinct groups of 4 banks (4 wavefronts); the column operand's 8 values
    # are one address per warp (a broadcast), also 4 terms a load; the 64 x 64 results one per lane
    assert work.accesses == (MemoryAccess("operand slices", "load", "global", copies, 16),
                             MemoryAccess("operand slices", "store", "shared", copies, 16),
                             MemoryAccess("row operand", "load", "shared", 8 * K * 2 // 4, 16),
                             MemoryAccess("column operand", "load", "shared", 8 * K * 8 // 4, 1),
                             MemoryAccess("compute", "store", "global", 64 * 64 // 32, 32))
    assert (work.memory_steps, work.on_chip_steps, work.block_barriers) == (chunks, K, 2 * chunks)
    assert work.l2_read_bytes == (64 + 64) * K * 4


def test_h100_is_a_device_everywhere_a_name_is():
    assert "h100" in DEVICES and get_device("h100") is H100
    assert run_passes(_dense(), "cuda", stop="stage", device="h100", opt_level=4).options.device is H100


def test_dense_stage_facts_by_hand(dense_works):
    (work,) = dense_works[4]
    assert (work.template, work.n_tiles, work.threads, work.active_threads) == ("thread_reduce", 512, 256, 256)
    # no ptxas: 32 registers (thread_reduce's estimate) x 256 threads -> 8 blocks per SM, grid 1056, 512 tiles
    assert (work.grid, work.blocks_per_sm) == (512, 8)
    assert work.gemm and not work.tensor_core
    assert work.flops == 2 * M * N * K + M * N  # the product's FMAs, then the bias add (relu is a select)
    # per tile 8 warps x 128 steps: x[m, k] one sector for the warp (every lane the same m), w[n, k] 32 (lanes
    # 512 bytes apart); then the epilogue: bias b[n] and the output, 32 consecutive floats, 4 sectors each
    assert work.accesses == (MemoryAccess("x_in", "load", "global", 8 * K, 1),
                             MemoryAccess("w_in", "load", "global", 8 * K, 32),
                             MemoryAccess("b_in", "load", "global", 8, 4),
                             MemoryAccess("compute", "store", "global", 8, 4))
    # a register accumulator: 8 unrolled steps' loads in flight, 128 / 8 round trips, one more for the bias
    assert work.memory_steps == K // 8 + 1
    # the middle tile (256: row m = 256, n = 0..255) touches x's row, all of w, all of b, once each
    assert work.l2_read_bytes == K * 4 + N * K * 4 + N * 4
    # DRAM: every operand once; the 512 KB output stays in the 50 MB L2 (written back after the kernel)
    assert work.dram_bytes == (M * K + N * K + N) * 4


def test_dram_bytes_are_what_l2_leaves():
    """A stage's DRAM bytes are ``codegen.traffic.l2_traffic``'s for it: at O2 the bias and
    activation read the matmul's output from L2 and their own output stays there, so they move
    only the bias from DRAM; behind an L2 of 0 bytes every stage moves all it counts."""
    staged = run_passes(_dense(), "cuda", stop="plan_arena", device="h100", opt_level=2).ir
    dense, act = stage_works(staged, H100)
    assert (dense.dram_bytes, act.dram_bytes) == ((M * K + N * K) * 4, N * 4)
    no_l2 = dataclasses.replace(H100, l2_bytes=0)
    counted = memory_traffic(staged).stages
    assert [w.dram_bytes for w in stage_works(staged, no_l2)] == [r.bytes_read + r.bytes_written for r in counted]


def test_dense_estimate_by_hand(dense_works):
    (work,) = dense_works[4]
    estimate = estimate_stage(work, H100)
    clock = 1.98e9
    tiles_on_sm = math.ceil(512 / 132)  # 4, one wave: every tile its own block
    requested = (8 * K * 1 + 8 * K * 32 + 8 * 4) * 32 * 512
    missed = work.l2_read_bytes * 512 / requested
    latency_cycles = L1_HIT_CYCLES + missed * (L2_HIT_CYCLES - L1_HIT_CYCLES) + \
        (work.dram_bytes / requested) * (DRAM_CYCLES - L2_HIT_CYCLES)
    l1_clocks = 8 * K * 1 + 8 * K * (32 / 4) + 8 * 1 + 8 * 1  # an uncoalesced w load takes 8 clocks
    expected = {
        "latency": (K // 8 + 1) * latency_cycles / clock,
        "fp": tiles_on_sm * (work.flops / 512) / (67e12 / 132),  # 4 blocks x 256 threads fill the 128 lanes
        "l1": tiles_on_sm * l1_clocks / clock,
        "l2": 512 * (work.l2_read_bytes + 8 * 4 * 32) / (5120 * clock),
        "dram": work.dram_bytes / 3.35e12,
    }
    assert estimate.times == pytest.approx(expected)
    assert estimate.bound == "l1" and estimate.seconds == pytest.approx(18.65e-6, rel=1e-3)
    assert estimate.fraction_of_peak == pytest.approx(work.flops / (estimate.seconds * 67e12))


def test_a_thread_reduce_gemm_is_far_below_the_goal(dense_works):
    (work,) = dense_works[4]
    assert estimate_stage(work, H100).fraction_of_peak < 0.4


def test_a_reduction_without_an_epilogue_stores_its_register_once(dense_works):
    """At O2 the matmul has no fused epilogue; it still sums in a register (``codegen.schedule``)
    and stores each result once, not at every reduction step."""
    matmul, _ = dense_works[2]
    assert MemoryAccess("T_matmul_NT", "store", "global", 8, 4) in matmul.accesses
    assert not any(a.kind == "store" and a.per_tile == 8 * K for a in matmul.accesses)
    assert matmul.memory_steps == K // 8  # 8 unrolled steps' loads in flight


def _work(**changes) -> StageWork:
    """An elementwise stage of one wave on the H100 model: 264 tiles of 256 threads on a grid of
    264 blocks (2 per SM)."""
    base = StageWork(name="add", template="elementwise", dtype="float32", executions=1, n_tiles=264, threads=256,
                     active_threads=256, grid=264, blocks_per_sm=2, flops=264 * 256, tensor_core=False, gemm=False,
                     memory_steps=1, on_chip_steps=0, block_barriers=0,
                     accesses=(MemoryAccess("x", "load", "global", 8, 4), MemoryAccess("y", "store", "global", 8, 4)),
                     l2_read_bytes=1024, dram_bytes=264 * 2048)
    return dataclasses.replace(base, **changes)


def test_tiles_beyond_one_wave_take_longer():
    one = estimate_stage(_work(), H100)
    two = estimate_stage(_work(n_tiles=528, dram_bytes=528 * 2048), H100)
    assert _work(n_tiles=528).waves == 2 and two.seconds > one.seconds
    assert two.times["latency"] == pytest.approx(2 * one.times["latency"])


def test_idle_lanes_slow_the_arithmetic():
    busy = estimate_stage(_work(flops=10**9), H100)
    idle = estimate_stage(_work(flops=10**9, active_threads=32), H100)
    assert idle.times["fp"] == pytest.approx(2 * busy.times["fp"])  # 2 blocks x 32 threads fill half of 128 lanes


def test_a_cp_async_cg_copy_takes_the_l1_array_once():
    """A 16-byte cp.async.cg caches in L2 only: its bytes cross the L1/shared array once, as the
    shared store counted beside its global load, so the load's clocks leave the L1 time."""
    copy = (MemoryAccess("slices", "load", "global", 64, 16), MemoryAccess("slices", "store", "shared", 64, 16))
    bypass = (dataclasses.replace(copy[0], through_l1=False), copy[1])
    through, around = (estimate_stage(_work(accesses=accesses), H100) for accesses in (copy, bypass))
    tiles_on_sm = 264 // H100.sms
    assert through.times["l1"] == pytest.approx(tiles_on_sm * 2 * 64 * 4 / H100.clock_hz)
    assert around.times["l1"] == pytest.approx(through.times["l1"] / 2)
    assert around.times["l2"] == through.times["l2"] and around.times["latency"] == through.times["latency"]


def test_padded_tiles_take_the_time_of_their_flops_and_count_their_useful_ones():
    """A GEMM padded to whole tiles multiplies zeros at full cost: its arithmetic takes the
    issued FLOPs' time, its share of peak counts the useful FLOPs."""
    exact = estimate_stage(_work(flops=10**9), H100)
    padded = estimate_stage(_work(flops=10**9, issued_flops=2 * 10**9), H100)
    assert padded.times["fp"] == pytest.approx(2 * exact.times["fp"])
    assert padded.fraction_of_peak == pytest.approx(10**9 / (padded.seconds * H100.peak("float32")))


def test_a_padded_tensor_core_stage_issues_its_whole_tiles(monkeypatch):
    monkeypatch.setattr("codegen.stage.stage_seconds",
                        lambda stage, device, traffic: stage.schedule.template != "tensor_core")
    b = GraphBuilder("padded")
    graph = b.build(b.op("dense", b.input("x", (100, 72)), b.param("w", np.ones((132, 72), np.float32))))
    staged = run_passes(graph, "cuda", stop="plan_arena", precision="fp16").ir
    (stage,) = [s for s in staged.stages() if s.schedule.template == "tensor_core"]
    (work,) = [w for w in stage_works(staged, H100) if w.template == "tensor_core"]
    tile = stage.schedule.tensor_core_tile
    chunks = -(-72 // tile.depth)
    assert work.flops == 2 * 100 * 132 * 72
    assert work.issued_flops == 2 * stage.schedule.n_tiles * tile.rows * tile.columns * chunks * tile.depth


def test_barriers_and_launches_add_their_cost():
    works = [_work()]
    plain = estimate_program("m", works, [], 1, 0, H100)
    synced = estimate_program("m", works, [(works[0].grid, 3)], 2, 0, H100)
    assert synced.seconds - plain.seconds == pytest.approx(3 * H100.grid_sync_seconds(works[0].grid)
                                                           + H100.launch_seconds)


def test_a_grid_barrier_costs_what_the_h100_measured_at_its_grid():
    """The H100's grid.sync() alone (benchmarks/results/gpu_h100_3_runs/run1_gpu_barrier.json): the
    model's line is within 0.04 us of each measured grid, and grows with the grid's blocks."""
    import json
    from pathlib import Path

    measured = json.loads((Path(__file__).parents[1] / "benchmarks/results/gpu_h100_3_runs/run1_gpu_barrier.json")
                          .read_text())
    assert measured["device"].startswith("NVIDIA H100")
    for row in measured["rows"]:
        assert H100.grid_sync_seconds(row["grid"]) * 1e6 == pytest.approx(row["barrier_us"], abs=0.04)
    assert H100.grid_sync_seconds(1056) > H100.grid_sync_seconds(132) > 1e-6
    works = [_work(grid=132), _work(grid=660)]
    estimate = estimate_program("m", works, [(132, 4), (660, 6)], 2, 0, H100)
    assert estimate.grid_barriers == 10
    assert estimate.barrier_seconds == pytest.approx(4 * H100.grid_sync_seconds(132) + 6 * H100.grid_sync_seconds(660))


def test_roofline_bound_is_flops_at_peak_or_compulsory_bytes():
    estimate = estimate_program("m", [_work(flops=67 * 10**9)], [], 1, 3350, H100)
    assert estimate.roofline_seconds == pytest.approx(1e-3)  # 67 GFLOP at 67 TFLOP/s; 3350 B take 1 ns
    assert estimate.seconds > estimate.roofline_seconds


def test_the_model_is_for_gpus():
    with pytest.raises(ValueError, match="the latency model is for GPUs"):
        estimate_stage(_work(), get_device("cpu"))


def test_a_scan_body_counts_once_per_trip():
    from souffle import models

    staged = run_passes(models.build("lstm", "tiny"), "cuda", stop="plan_arena", device="h100").ir
    estimate = latency_estimate(staged, H100)
    loop = next(s for s in estimate.stages if s.work.executions > 1)
    assert loop.total_seconds == pytest.approx(loop.seconds * loop.work.executions)
    assert estimate.grid_barriers == staged.barrier_count(executed=True)
    assert estimate.seconds == pytest.approx(sum(s.total_seconds for s in estimate.stages)
                                             + estimate.grid_barriers * H100.grid_sync_seconds(estimate.barrier_grid)
                                             + H100.launch_seconds)


def test_each_kernel_pays_its_barriers_at_its_own_grid():
    """Tiny ResNeXt split in two halfway: each kernel's executed barriers at its own grid, the
    second kernel's first item waiting for its launch instead."""
    from codegen.latency import kernel_barriers
    from codegen.partition import Split, split_kernels
    from codegen.staged import count_items, stages_in
    from souffle import models

    staged = run_passes(models.build("resnext", "tiny"), "cuda", stop="plan_arena", device="h100").ir
    middle = next(k for k, item in enumerate(staged.items) if k >= len(staged.items) // 2 and item.barrier)
    split = split_kernels(staged, [Split(staged.items[middle].name, "halfway")])
    before, after = (count_items(items, lambda s: s.barrier is not None, executed=True)
                     for items in (staged.items[:middle], staged.items[middle + 1:]))
    assert kernel_barriers(split.items) == [before, after] and before and after
    occupancies = [Occupancy("h100", blocks, 132 * blocks, {"registers": blocks}) for blocks in (2, 1)]
    widest = [max(s.schedule.n_tiles for s in stages_in(items))
              for items in (split.items[:middle], split.items[middle:])]
    grids = [min(o.grid, tiles) for o, tiles in zip(occupancies, widest)]  # a kernel launches no idle blocks
    estimate = latency_estimate(split, H100, occupancies)
    assert estimate.barriers == ((grids[0], before), (grids[1], after))
    assert estimate.barrier_seconds == pytest.approx(before * H100.grid_sync_seconds(grids[0])
                                                     + after * H100.grid_sync_seconds(grids[1]))


@pytest.mark.parametrize("level", [0, 4])
def test_stages_belong_to_the_kernels_codegen_launches(level):
    from codegen.latency import kernel_runs
    from souffle import models

    plan = run_passes(models.build("lstm", "tiny"), "cuda", stop="kernel_plan", device="h100", opt_level=level).ir
    runs = kernel_runs(plan.staged.items)
    kernels = max(kernel for _, kernel, _ in runs) + 1
    widest = [max(item.schedule.n_tiles for item, k, _ in runs if k == kernel and hasattr(item, "schedule"))
              for kernel in range(kernels)]
    assert widest == [launch.max_tiles for launch in plan.kernel_launches()]  # O0: host loops launch kernels


@pytest.mark.parametrize("m, n, k, fastest", [(M, N, K, "matmul"), (128, 96, 16, "thread_reduce")])
def test_each_stage_takes_the_schedule_the_model_estimates_fastest(m, n, k, fastest):
    """A GEMM stage has two schedules (``codegen.schedule.schedule_candidates``): dlight's
    matmul and its own template. 512 x 256 x 128 is faster as 32 matmul tiles; 128 x 96 x 16 is
    four tiles of 64 x 64 outputs, which leave all but four SMs idle, and takes thread_reduce's
    48 tiles of one output per thread."""
    device = get_device("h200")
    b = GraphBuilder("gemm")
    x = b.input("x", (m, k))
    graph = b.build(b.op("dense", x, b.param("w", np.ones((n, k), np.float32))))
    (stage,) = run_passes(graph, "cuda", stop="stage", device="h200").ir.stages()
    assert stage.schedule.template == fastest
    candidates = [dataclasses.replace(stage, func=func, schedule=schedule) for func, schedule in
                  schedule_candidates(stage.tensor, stage.placeholders, True, stage.schedule.threads, stage.epilogue)]
    assert sorted(c.schedule.template for c in candidates) == ["matmul", "thread_reduce"]
    assert stage_seconds(stage, device) == min(stage_seconds(c, device) for c in candidates)


def test_warps_to_saturate_scales_memory_throughput_by_the_warps_resident(dense_works, monkeypatch):
    """analysis.latency.WARPS_TO_SATURATE (off by default): a stage whose SMs hold one block of 8
    warps gets a quarter of L1, L2 and DRAM at 32; one with 4 blocks on its busiest SM all of its L1."""
    import analysis.latency

    (work,) = dense_works[4]
    one_block = dataclasses.replace(work, grid=132)  # 512 tiles on 132 blocks: 1 working block per SM
    off = {w: estimate_stage(w, H100).times for w in (work, one_block)}
    monkeypatch.setattr(analysis.latency, "WARPS_TO_SATURATE", 32)
    on = {w: estimate_stage(w, H100).times for w in (work, one_block)}
    # ceil(512 / 132) = 4 blocks of 8 warps on the busiest SM: all of its L1; 512 blocks of 8 warps
    # on the GPU, against the 132 x 32 warps that saturate L2 and DRAM
    assert on[work]["l1"] == off[work]["l1"]
    assert on[work]["l2"] == pytest.approx(off[work]["l2"] * 132 * 32 / (512 * 8))
    for part in ("l1", "l2", "dram"):
        assert on[one_block][part] == pytest.approx(4 * off[one_block][part])
    assert (on[one_block]["latency"], on[one_block]["fp"]) == (off[one_block]["latency"], off[one_block]["fp"])


def test_a_row_resident_stage_loads_its_row_once():
    """softmax as one row-resident stage (``codegen.row_resident``): a tile of 8 warps, a row
    each; each lane loads its 384 / 32 columns once, 4 floats at a time (three 16-byte loads, a
    warp's touching 16 sectors), in one trip to memory, then reduces the max and the sum of
    exp(x - max) with a round of shuffles each, and stores its columns 4 at a time; no shared
    memory, no barrier."""
    from codegen.latency import SHUFFLE_ROUNDS

    b = GraphBuilder("softmax")
    rows, columns = 512, 384
    graph = b.build(b.op("softmax", b.input("x", (rows, columns)), name="sm"))
    (work,) = stage_works(run_passes(graph, "cuda", stop="plan_arena", device="h100", opt_level=4).ir, H100)
    assert work.name.split("/")[-1] == "T_softmax_maxelem+T_softmax_expsum+sm"
    assert (work.template, work.n_tiles, work.memory_steps, work.on_chip_steps, work.block_barriers) == \
        ("warp_reduce", rows // 8, 1, 2 * SHUFFLE_ROUNDS, 0)
    assert [(a.kind, a.space, a.per_tile, a.sectors) for a in work.accesses] == \
        [("load", "global", 8 * columns // 128, 16), ("store", "global", 8 * columns // 128, 16)]


def test_a_reduction_with_a_row_epilogue_counts_one_row_per_warp(pair_epilogues):
    """softmax's sum of exp(x - max) with the normalization as its epilogue: a tile of 8 warps
    holds 8 x 384 outputs but reduces 8 rows, one per warp; each lane loads 384 / 32 terms a row
    (a regression: the model once read the epilogue's 384 outputs per warp as 384 rows, and paper
    BERT fp16's estimate went from 0.78 to 7.8 ms). The max before it has no epilogue."""
    from codegen.latency import SHUFFLE_ROUNDS, UNROLLED_STEPS

    b = GraphBuilder("softmax")
    rows, columns = 512, 384
    graph = b.build(b.op("softmax", b.input("x", (rows, columns)), name="sm"))
    works = stage_works(run_passes(graph, "cuda", stop="plan_arena", device="h100", opt_level=4).ir, H100)
    row_steps = -(-(columns // 32) // UNROLLED_STEPS)
    assert [w.name.split("/")[-1] for w in works] == ["T_softmax_maxelem", "T_softmax_expsum+sm"]
    for work, epilogue_steps in zip(works, (0, 1)):  # the row, then the epilogue's loads
        assert work.template == "warp_reduce" and work.n_tiles == rows // 8
        assert work.memory_steps == row_steps + epilogue_steps
        assert work.on_chip_steps == SHUFFLE_ROUNDS
    reduced = [a for a in works[1].accesses if a.kind == "store" and a.space == "shared"]
    assert [a.per_tile for a in reduced] == [8]
    assert not [a for a in works[0].accesses if a.space == "shared"]


def test_a_gemm_is_measured_against_its_operands_peak_whatever_it_stores(monkeypatch):
    """At fp16 on dlight's SIMT matmul, the dense stores float32 at O2 (bias, relu and the cast a
    stage of their own) and float16 at O3 (they are its epilogue): both are float16 GEMMs, read
    against the tensor-core peak, with the same share of it (a regression: the float32 one was
    read against the FP32 FMA peak, 15x lower). Both copy float16 operands into float32 slices
    (``codegen.schedule.widened_operands``)."""
    monkeypatch.setattr(codegen.schedule, "TILES", ())
    shares = {}
    for level in (2, 3):
        staged = run_passes(_dense(), "cuda", stop="plan_arena", device="h100", opt_level=level, precision="fp16").ir
        (gemm,) = [s for s in latency_estimate(staged, H100).stages if s.work.gemm]
        assert gemm.work.template == "matmul" and gemm.work.dtype == "float16" and not gemm.work.tensor_core
        # it copies float16, 4 halves a lane (8 sectors a warp, half the float32 bytes from L2), into
        # float32 slices (16 sectors a warp's store), read 4 terms a load as float32 models' are
        copies = {a.kind: a.sectors for a in gemm.work.accesses if a.tensor == "operand slices"}
        assert copies == {"load": 8, "store": 16} and gemm.work.l2_read_bytes == (64 + 64) * K * 2
        row = next(a for a in gemm.work.accesses if a.tensor == "row operand")
        assert row.per_tile == 8 * K * 2 // 4
        shares[level] = gemm.fraction_of_peak
    assert [str(s.tensor.dtype) for s in staged.stages()][:1] == ["float16"]
    assert shares[2] == pytest.approx(shares[3], rel=0.2) and shares[3] < 0.2
