"""Resource-aware partitioning: one kernel unless a stage's resources make a split pay for itself,
with the cost model's figures checked by hand (H200: 4.8 TB/s, 132 SMs, 3 us per launch)."""

import dataclasses

import pytest

from analysis.device import A100, H200
from codegen.partition import (
    REGISTER_ESTIMATES,
    TENSOR_CORE_BASE_REGISTERS,
    partition,
    saturating_grid,
    stage_registers,
    time_at_grid,
)
from codegen.tensor_core import TensorCoreTile
from souffle import models
from souffle.compiler import staged_program
from souffle.errors import TargetError
from souffle.graph import GraphBuilder
from souffle.lower import lower_graph

KB = 1024


def _staged(graph):
    return staged_program(lower_graph(graph), "cuda", 256)


def _chain(side: int, ops: list[str]):
    """x (side x side float32) through one unary op after another: one elementwise stage each."""
    b = GraphBuilder("chain")
    t = b.input("x", (side, side))
    for k, op in enumerate(ops):
        t = b.op(op, t, name=f"{op}{k}")
    return b.build(t)


def _needs_shared(staged, name: str, nbytes: int):
    stage = next(s for s in staged.stages() if s.name == name)
    stage.schedule = dataclasses.replace(stage.schedule, shared_bytes=nbytes)
    return staged


@pytest.fixture(scope="module")
def paper():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _staged(models.build(name, "paper"))
        return cache[name]

    return get


@pytest.mark.parametrize("name", models.MODELS)
def test_paper_models_are_one_kernel_on_the_h200(paper, name):
    staged = paper(name)
    h200 = partition(staged, H200)
    assert len(h200.kernels) == 1 and h200.kernels[0] == staged.items and h200.splits == []
    # every model has a warp_reduce stage (64 registers): 4 blocks of 256 threads per SM; BERT's and
    # ResNeXt's matmul stages (80 registers): 3
    blocks = 3 if any(s.schedule.template == "matmul" for s in staged.stages()) else 4
    assert name not in ("bert", "resnext") or blocks == 3
    assert str(h200) == (f"1 kernel: every stage co-resident at grid {132 * blocks} on h200 ({blocks} blocks/SM, "
                         "limited by registers)")
    a100 = partition(staged, A100)
    if len(a100.kernels) == 1:
        assert str(a100) == (f"1 kernel: every stage co-resident at grid {108 * blocks} on a100 "
                             f"({blocks} blocks/SM, limited by registers)")
    else:  # the A100's 108 SMs: stages apart from the matmul ones at 4 blocks/SM can be worth a launch
        assert blocks == 3 and str(a100).count("needs 80 registers per thread") == len(a100.kernels) - 1


def test_register_estimates_per_template():
    staged = _staged(models.build("bert", "tiny"))
    templates = {s.schedule.template: stage_registers(s) for s in staged.stages()}
    assert templates == {"elementwise": 32, "warp_reduce": 64, "thread_reduce": 32}
    # tiny BERT's GEMMs are too small for dlight's rule; a MetaSchedule schedule's registers are unknown until ptxas
    assert REGISTER_ESTIMATES == dict(templates, matmul=80, database=128)
    stage = staged.stages()[0]
    # tensor cores: a base plus each thread's share of the tile's float32 accumulators
    stage.schedule = dataclasses.replace(stage.schedule, template="tensor_core", threads=256,
                                         tensor_core_tile=TensorCoreTile(2, 4, 2, 2))  # 64 x 128
    assert stage_registers(stage) == TENSOR_CORE_BASE_REGISTERS + 32
    stage.schedule = dataclasses.replace(stage.schedule, template="wgmma")
    with pytest.raises(ValueError, match="no register estimate for template 'wgmma'"):
        stage_registers(stage)


def test_saturating_grid_is_half_the_thread_slots():
    assert saturating_grid(H200, 256) == 132 * 4  # 1024 of 2048 threads per SM
    assert saturating_grid(A100, 256) == 108 * 4
    assert saturating_grid(H200, 96) == 132 * 10  # 960 threads
    assert saturating_grid(H200, 1024) == 132  # never below one block per SM


def test_time_at_grid_scales_with_the_share_of_saturating_blocks():
    # enough tiles: full throughput on any grid of at least 528 blocks, 4x slower on 132.
    assert time_at_grid(1e-6, 4096, 1056, 528) == 1e-6
    assert time_at_grid(1e-6, 4096, 528, 528) == 1e-6
    assert time_at_grid(1e-6, 4096, 132, 528) == pytest.approx(4e-6)
    # 100 tiles never saturate the device, whatever the grid above 100.
    assert time_at_grid(1e-6, 100, 1056, 528) == time_at_grid(1e-6, 100, 132, 528) == pytest.approx(5.28e-6)
    assert time_at_grid(1e-6, 100, 50, 528) == pytest.approx(10.56e-6)


def test_a_200_kb_stage_is_split_off_with_its_numbers():
    staged = _needs_shared(_staged(_chain(1024, ["relu", "sigmoid", "tanh"])), "chain_r0/tanh2", 200 * KB)
    result = partition(staged, H200)
    assert [[item.name for item in kernel] for kernel in result.kernels] == [
        ["chain_r0/relu0", "chain_r0/sigmoid1"], ["chain_r0/tanh2"]]
    assert [o.grid for o in result.occupancy] == [1056, 132]
    assert [s.before for s in result.splits] == ["chain_r0/tanh2"]
    # Each stage moves 2 x 4 MiB: 1.75 us at 4.8 TB/s, 4x that at grid 132 (132 of 528 saturating
    # blocks). Together 3 x 4 x 1.75 = 21.0 us; apart 2 x 1.75 + 4 x 1.75 = 10.5 us. The split
    # costs 3 us + 2 x 4 MiB of sigmoid1's output (written, read back) = 4.7 us.
    assert result.splits[0].reason == (
        "split before chain_r0/tanh2: chain_r0/tanh2 needs 200 KB of shared memory per block, so one kernel for "
        "the 3 stages of this kernel and the one before would fit 1 blocks/SM (grid 132) where apart they get "
        "grids 1056 and 132; at grid 132 their stages and grid barriers would take 21.0 us instead of 10.5 us, 10.5 us more, against a "
        "split's cost of 4.7 us (launch 3.0 us + DRAM round trip of 4.19 MB the kernel before writes for this one)")
    assert str(result) == "\n".join([
        "2 kernels on h200:",
        "  kernel 1: 2 items, chain_r0/relu0 .. chain_r0/sigmoid1; grid 1056 (8 blocks/SM, limited by threads)",
        "  " + result.splits[0].reason,
        "  kernel 2: chain_r0/tanh2; grid 132 (1 blocks/SM, limited by shared memory)",
    ])


def test_a_register_hungry_stage_is_split_off():
    staged = _staged(_chain(1024, ["relu", "sigmoid", "tanh"]))
    result = partition(staged, H200, registers=lambda s: 255 if s.name == "chain_r0/tanh2" else 32)
    assert [len(kernel) for kernel in result.kernels] == [2, 1]
    # 255 registers are allocated as 256 per thread: 65536 per block of 256 threads, 1 block per SM.
    assert result.occupancy[1].grid == 132 and result.occupancy[1].limiter == "registers"
    assert "chain_r0/tanh2 needs 255 registers per thread, so one kernel" in result.splits[0].reason


def test_small_stages_stay_in_one_kernel_at_the_reduced_grid():
    staged = _needs_shared(_staged(_chain(64, ["relu", "sigmoid", "tanh"])), "chain_r0/tanh2", 200 * KB)
    result = partition(staged, H200)
    assert result.kernels == [staged.items] and result.splits == []
    assert str(result) == "1 kernel: every stage co-resident at grid 132 on h200 (1 blocks/SM, limited by shared memory)"


@pytest.mark.parametrize("side,kernels", [(512, 1), (1024, 2)])
def test_split_only_when_the_slowdown_exceeds_its_cost(side, kernels):
    # Two light stages of T = 8 x side^2 / 4.8 TB/s each slow down by 3T at grid 132: 6T in all,
    # against a split's 3 us + T. 512: 6 x 0.44 = 2.6 us < 3.4 us; 1024: 6 x 1.75 = 10.5 us > 4.7 us.
    staged = _needs_shared(_staged(_chain(side, ["relu", "sigmoid", "tanh"])), "chain_r0/tanh2", 200 * KB)
    assert len(partition(staged, H200).kernels) == kernels


def test_each_kernel_pays_its_grid_barriers_at_its_own_grid():
    """The 1024 chain above with a grid barrier before sigmoid1 and tanh2 (0.97 us + 1.22 ns a
    block). One kernel: 21.0 us of stages + 2 barriers at grid 132 (1.13 us each) = 23.2 us. Apart:
    10.5 us + sigmoid1's barrier at grid 1056 (2.26 us) = 12.7 us; tanh2 waits for its launch. At
    20 ns a block a barrier at grid 1056 (22.1 us) costs more than a launch, and every stage takes
    its own kernel."""
    staged = _needs_shared(_staged(_chain(1024, ["relu", "sigmoid", "tanh"])), "chain_r0/tanh2", 200 * KB)
    for item in staged.items[1:]:
        item.barrier = "reads what the stage before writes"
    result = partition(staged, H200)
    assert len(result.kernels) == 2
    assert "would take 23.2 us instead of 12.7 us, 10.5 us more" in result.splits[0].reason
    costly_barriers = dataclasses.replace(H200, grid_sync_seconds_per_block=20e-9)
    assert len(partition(staged, costly_barriers).kernels) == 3


def test_a_costlier_launch_keeps_one_kernel():
    staged = _needs_shared(_staged(_chain(1024, ["relu", "sigmoid", "tanh"])), "chain_r0/tanh2", 200 * KB)
    slow_launch = dataclasses.replace(H200, launch_seconds=20e-6)  # more than the 10.5 us saved
    assert len(partition(staged, slow_launch).kernels) == 1


def test_many_small_slowdowns_add_up_to_a_split():
    # The 200 KB stage comes first; each light stage after it alone loses 3 x 0.44 = 1.3 us at grid
    # 132, less than a split (3.4 us), but four lose 5.2 us together: the split comes right after it.
    # Together 5 stages x 4 x 0.44 = 8.7 us; apart 4 x 0.44 + 4 x 0.44 = 3.5 us.
    four = _needs_shared(_staged(_chain(512, ["tanh", "relu", "sigmoid", "relu", "sigmoid"])), "chain_r0/tanh0",
                         200 * KB)
    result = partition(four, H200)
    assert [len(kernel) for kernel in result.kernels] == [1, 4]
    assert [s.before for s in result.splits] == ["chain_r0/relu1"]
    assert "at grid 132 their stages and grid barriers would take 8.7 us instead of 3.5 us, 5.2 us more" in (
        result.splits[0].reason)
    two = _needs_shared(_staged(_chain(512, ["tanh", "relu", "sigmoid"])), "chain_r0/tanh0", 200 * KB)
    assert len(partition(two, H200).kernels) == 1


def test_a_stage_no_kernel_can_hold_is_refused_by_name():
    staged = _staged(_chain(64, ["relu", "sigmoid", "tanh"]))
    with pytest.raises(TargetError, match=r"stage chain_r0/sigmoid1 needs 300 registers per thread and 0 B of shared "
                                          r"memory per block with 256 threads: no kernel running it can be "
                                          r"co-resident \(.*300 registers per thread > 255;"):
        partition(staged, H200, registers=lambda s: 300 if s.name == "chain_r0/sigmoid1" else 32)
    _needs_shared(staged, "chain_r0/tanh2", 240_000)
    with pytest.raises(TargetError, match=r"stage chain_r0/tanh2 needs 32 registers .* 240000 B of shared memory .*"
                                          r"240000 bytes of shared memory per block > 232448"):
        partition(staged, H200)


def test_a_loop_is_one_item_named_with_its_stage():
    staged = _staged(models.build("lstm", "tiny"))
    _needs_shared(staged, "lstm_cell_r0/gates:2", 240_000)
    with pytest.raises(TargetError, match=r"stage lstm_cell_r0/gates:2 \(in loop layers/time\) needs"):
        partition(staged, H200)
    _needs_shared(staged, "lstm_cell_r0/gates:2", 200 * KB)
    # the whole loop takes the stage's 200 KB; the tiny model's stages are too small to split for.
    assert str(partition(staged, H200)) == ("1 kernel: every stage co-resident at grid 132 on h200 "
                                            "(1 blocks/SM, limited by shared memory)")
