"""Tensor-core tiles of fewer warps than the block's (codegen/tensor_core.py, ``_idle_warps``): a
tile of 4 warps in a block of 8 runs its fragment loads, products and accumulator stores under one
``if`` on the warp, while all 8 warps copy the slices and meet at every ``__syncthreads``. Checked
on the schedule as built, by the thread-level validator with each guard removed (mutants), on
emulated CUDA threads against numpy, and on paper BERT fp16, whose FFN GEMMs take 128 tiles of
96 x 96 on 4 warps for the H100's 132 SMs."""

from __future__ import annotations

import shutil

import islpy as isl
import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir, tirx

import codegen.schedule
import souffle
from analysis.device import H100, co_resident_grid
from codegen.latency import latency_estimate, stage_works
from codegen.partition import TENSOR_CORE_BASE_REGISTERS, stage_registers
from codegen.schedule import tensor_core_stages
from codegen.stage import keep_occupancy
from codegen.tensor_core import TILES, WARP, tensor_core_schedule
from souffle import models
from souffle.compiler import run_passes

from test_tensor_core import NARROW, _dense, _relu_dense, mutants

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")

(QUARTER,) = [tile for tile in TILES if (tile.rows, tile.columns) == (96, 96)]  # 2 x 2 warps of 3 x 3 fragments


def _calls_by_guard(stmt, guards: tuple = ()) -> list[tuple[str, tuple]]:
    """(intrinsic or block, the ``if`` conditions around it) for each wmma call and each block
    writing shared memory in ``stmt``, in program order."""
    found = []
    if isinstance(stmt, s_tir.SBlockRealize):
        block = stmt.block
        if any(w.source.scope() == "shared.dyn" for w in block.writes):
            found.append((f"block {block.name_hint}", guards))
        return found + _calls_by_guard(block.body, guards)
    if isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.Call):
        return [(stmt.value.op.name, guards)]
    if isinstance(stmt, tirx.SeqStmt):
        return [c for child in stmt.seq for c in _calls_by_guard(child, guards)]
    if isinstance(stmt, tirx.IfThenElse):
        return _calls_by_guard(stmt.then_case, guards + (str(stmt.condition),))
    if isinstance(stmt, (tirx.For, s_tir.SBlock, tirx.AttrStmt)):
        return _calls_by_guard(stmt.body, guards)
    return found


def test_a_tile_of_4_warps_guards_its_fragments_and_leaves_the_copies_to_all_8():
    sch, tile = tensor_core_schedule(_dense(384, 3072, 768), QUARTER, threads=256)
    assert tile.warps == 4 and (tile.rows, tile.columns) == (96, 96)
    func = sch.mod["main"]
    bound = []
    tvm_ffi.structural_walk(func.body, lambda node: bound.append(node) if isinstance(node, tirx.For)
                            and node.thread_binding is not None
                            and node.thread_binding.thread_tag == "threadIdx.y" else None)
    assert bound and all(int(loop.extent) == 8 for loop in bound)  # the block's warps, everywhere
    (warp,) = {loop.loop_var.name for loop in bound if "ax2_0_1_ax1_0_1" in loop.loop_var.name}
    calls = _calls_by_guard(func.body)
    guarded = {what for what, guards in calls if guards == (f"{warp} < 4",)}
    free = {what for what, guards in calls if not guards}
    # the fragments' loads, products and stores, and the accumulators' copy out, by the tile's warps
    assert {"tirx.tvm_load_matrix_sync", "tirx.tvm_mma_sync", "tirx.tvm_store_matrix_sync"} <= guarded
    assert any(what.startswith("block") and "T_matmul_NT" in what for what in guarded)
    # the accumulators' zeroing (registers only) and the slices' copies, by every warp
    assert "tirx.tvm_fill_fragment" in free and "tirx.tvm_fill_fragment" not in guarded
    copies = {what for what in free if what.startswith("block") and what.endswith("_shared.dyn")}
    assert {"block A_reindex_shared.dyn", "block W_reindex_shared.dyn"} <= copies
    assert all(len(guards) <= 1 for _, guards in calls)  # one if, not one a statement


def test_its_stage_writes_the_96_x_96_box_of_its_4_warps():
    (stage,) = [s for s in tensor_core_stages(_dense(384, 3072, 768)) if s[1].tensor_core_tile.warps == 4
                and s[1].box == (96, 96)]
    _, schedule = stage
    assert schedule.n_tiles == 4 * 32 and schedule.threads == 256
    tiles = isl.Map(schedule.tile_relation)
    assert tiles.range().is_equal(isl.Set("{ [i, j] : 0 <= i < 384 and 0 <= j < 3072 }"))
    assert tiles.reverse().is_single_valued()


def _pinned_kernel(monkeypatch, graph):
    monkeypatch.setattr(codegen.schedule, "TILES", (QUARTER,))
    plan = run_passes(graph, "cuda", stop="kernel_plan", opt_level=4, precision="fp16").ir
    (stage,) = [s for s in plan.staged.stages() if s.schedule.template == "tensor_core"]
    assert stage.schedule.tensor_core_tile.warps == 4
    (kernel,) = [mutants.Kernel("tensor cores", name, func, {}, 1, plan.staged.threads)
                 for name, func in mutants.device_functions(mutants.device_module(plan.funcs, "sm_90")).items()]
    return kernel


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_the_validator_refuses_the_tile_without_its_guards(monkeypatch):
    """Without its ``if``, a guarded statement runs on the 4 idle warps too, at warp indices past the
    tile: their products read slices that cp.async copies are still landing in, and their
    accumulators are stored, and read back for the output, past the tile's 96 x 96. (The guard of
    the last chunk's products, after every copy has landed, reads in bounds into registers no one
    stores: removing it wastes the tensor cores and changes no value, and the validator has
    nothing to refuse.)"""
    kernel = _pinned_kernel(monkeypatch, _relu_dense(192, 192, 128)[0])
    assert not mutants.validate(kernel).violations
    warp = mutants.thread_vars(kernel.func)["threadIdx.y"]
    guards = [s for s in mutants.statements(kernel.func.body) if isinstance(s, tirx.IfThenElse)
              and s.else_case is None and mutants.mentions(s.condition, warp) and str(s.condition).endswith("< 4")]
    # the products in the pipeline's loop and after it, the accumulators' store, their copy out
    assert len(guards) == 4
    refused = [mutants.validate(kernel, mutants.replace_one(kernel.func, guard, guard.then_case)).violations
               for guard in guards]
    assert any("is in flight" in v for v in refused[0])
    assert not refused[1]
    assert any("writes shared.dyn" in v and "outside its 9216 elements" in v for v in refused[2])
    assert any("reads shared.dyn" in v and "outside its 9216 elements" in v for v in refused[3])


@needs_gxx
@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
@pytest.mark.parametrize("precision", NARROW)
# whole tiles over 5 chunks (3 through the cp.async ring's loop); rows, columns and terms padded
@pytest.mark.parametrize("m, n, k", [(192, 192, 320), (90, 190, 72)])
def test_4_warp_tiles_match_numpy_on_emulated_threads(monkeypatch, m, n, k, precision):
    monkeypatch.setattr(codegen.schedule, "TILES", (QUARTER,))
    graph, inputs, expected = _relu_dense(m, n, k, NARROW[precision])
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    (stage,) = [s for s in model.kernel_plan.staged.stages() if s.schedule.tensor_core_tile]
    assert stage.schedule.tensor_core_tile.warps == 4
    assert stage.schedule.n_tiles == -(-m // 96) * -(-n // 96)
    for order in ("ascending", "descending"):
        (output,) = model.schedule(order, model.emulator.sms, seed=5).run(inputs)
        np.testing.assert_allclose(output, expected, rtol=1e-2, atol=1e-2, err_msg=order)


def test_paper_bert_fp16_ffn_gemms_take_96_x_96_tiles_of_4_warps_at_40_percent_of_peak():
    """384 x 3072 (FFN1) and 384 x 768 over split K (FFN2): 128 tiles of 96 x 96 for 132 SMs, where
    the 96 x 128 tiles of 8 warps were 96 (H100 model: 32% of peak). Each warp loads 6 fragments
    for 9 products, where 3 x 2 fragments a warp load 5 for 6."""
    plan = run_passes(models.build("bert", "paper"), "cuda", stop="kernel_plan", device="h100", precision="fp16").ir
    stages = {s.name: s for s in plan.staged.stages()}
    estimates = {e.work.name: e for e in latency_estimate(plan.staged, H100).stages}
    works = {w.name: w for w in stage_works(plan.staged, H100)}
    for name in ("bert_layer_r0/T_matmul_NT+compute:3", "bert_layer_r0/T_matmul_NT_part"):
        tile = stages[name].schedule.tensor_core_tile
        assert (tile.rows, tile.columns, tile.warps) == (96, 96, 4), name
        assert stages[name].schedule.n_tiles == 128
        assert stage_registers(stages[name]) == TENSOR_CORE_BASE_REGISTERS + 96 * 96 // (4 * WARP)
        work = works[name]
        assert work.active_threads == 4 * WARP  # the tensor cores see the tile's warps
        (fragments,) = [a for a in work.accesses if a.tensor == "fragments" and a.kind == "load"]
        assert fragments.per_tile == 4 * (768 // 16) * (3 + 3)  # FFN2's K in 4 parts of 768
        assert estimates[name].fraction_of_peak >= 0.4, name


def _staged_gemm():
    """A 384 x 3072 x 768 GEMM (96 x 96 tiles of 4 warps, 1 block/SM) after the input's cast
    to float16 (288 tiles, more than one round of 132 SMs)."""
    graph = _relu_dense(384, 3072, 768)[0]
    return run_passes(graph, "cuda", stop="align_tiles", opt_level=4, precision="fp16", device="h100").ir


def test_a_tile_of_4_warps_stays_where_the_model_finds_the_kernel_faster_with_it():
    staged = _staged_gemm()
    (gemm,) = [s for s in staged.stages() if s.schedule.template == "tensor_core"]
    assert gemm.schedule.tensor_core_tile == QUARTER and gemm.full_warp.schedule.tensor_core_tile.warps == 8
    kept, notes = keep_occupancy(staged, H100)
    assert kept is staged and notes == []


class _Estimate:
    def __init__(self, seconds: float):
        self.seconds = seconds


def test_a_tile_of_4_warps_is_taken_back_where_the_blocks_it_costs_slow_the_others_more(monkeypatch):
    """The cast, at 1 block/SM (the 4-warp tile's), made 10 us slower than at 2 (the 8-warp
    tile's): the GEMM takes its 8-warp candidate back, and a note says why. Made 0.1 us slower,
    the 4-warp tile stays."""
    staged = _staged_gemm()
    (gemm,) = [s for s in staged.stages() if s.schedule.template == "tensor_core"]
    assert blocks_per_sm(gemm) == 1 and blocks_per_sm(gemm.full_warp) == 2

    def estimate(penalty):
        def fake(stage, device, traffic=None, blocks_per_sm=None):
            cast = stage.schedule.template == "elementwise"
            return _Estimate((5e-6 if stage.schedule.tensor_core_tile == QUARTER else 6e-6) if not cast
                             else 1e-6 + (penalty if blocks_per_sm == 1 else 0.0))
        return fake

    monkeypatch.setattr("codegen.stage.stage_estimate", estimate(10e-6))
    taken, notes = keep_occupancy(staged, H100)
    (swapped,) = [s for s in taken.stages() if s.schedule.template == "tensor_core"]
    assert swapped is gemm.full_warp
    (note,) = notes
    assert note.startswith(f"{gemm.name}: 96x128x64 (2x4 warps") and "(1 blocks/SM)" in note and "16 -> 7 us" in note
    monkeypatch.setattr("codegen.stage.stage_estimate", estimate(0.1e-6))
    assert keep_occupancy(staged, H100) == (staged, [])


def blocks_per_sm(stage) -> int:
    return co_resident_grid(stage_registers(stage), stage.schedule.shared_bytes, H100,
                            stage.schedule.threads).blocks_per_sm


@pytest.mark.slow
def test_paper_swin_fp16_takes_its_96_x_96_tiles_back_to_stay_at_2_blocks_per_sm():
    """Swin's other stages allow 2 blocks/SM, and many run more than a round of 132 SMs."""
    run = run_passes(models.build("swin", "paper"), "cuda", stop="keep_occupancy", device="h100", precision="fp16")
    notes = [n for n in run.notes("transform") if "on all 8 warps" in n]
    assert len(notes) == 6
    assert not any(s.schedule.tensor_core_tile == QUARTER for s in run.ir.stages())
