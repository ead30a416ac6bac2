"""GEMM-shaped float16 stages on tensor cores (codegen/tensor_core.py): dlight's tensor-core matmul
rule in the persistent kernel's block shape, wmma fragments fed from shared-memory slices. Checked
against the expected tiles, by the thread-level validator (which models wmma's warp-collective
loads and stores) with mutants, on emulated CUDA threads (the emulator's mma.h) against PyTorch,
and on paper BERT's kernel (issue 16's acceptance); the emulated runs and the latency model also
at bfloat16 (tests/test_bf16_cuda.py checks bfloat16 stages apart from the front end)."""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import islpy as isl
import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from tvm import te, tirx, topi

import souffle
from analysis.threads import WARP_COLLECTIVE
from analysis.device import H100
import codegen.schedule
from codegen.latency import latency_estimate, stage_works
from codegen.schedule import (MATMUL_MIN_USE, NARROW_MIN_USE, buffer_elements, matmul_stage, pool_offsets, pooled_shared,
                              tensor_core_stages)
from codegen.tensor_core import ASYNC_STAGES, NARROW_TILES, TILES, WarpCopy
from souffle import models
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
mutants = importlib.import_module("scripts.validate_mutants")

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")

# BERT with GEMMs large enough for tensor-core tiles (its tiny configuration's are not)
BERT_GEMMS = {"seq": 128, "hidden": 64, "heads": 2, "ffn": 128, "max_positions": 128}
NARROW = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}  # precision -> the numpy type its operands round to


def _dense(m: int, n: int, k: int, dtype: str = "float16"):
    """A dense of float16 operands accumulating in float32, rounded to float16 on the way out
    (what the precision pass makes of one)."""
    a, w = te.placeholder((m, k), dtype, name="A"), te.placeholder((n, k), dtype, name="W")
    if dtype == "float32":
        return te.create_prim_func([a, w, topi.nn.dense(a, w)])
    product = topi.nn.dense(a, w, out_dtype="float32")
    return te.create_prim_func([a, w, te.compute(product.shape, lambda i, j: product[i, j].astype(dtype), name="C")])


def test_a_dense_gets_one_candidate_per_tile_that_fits_it():
    stages = tensor_core_stages(_dense(256, 256, 128))
    # 8 warps a tile, then 4 (the block's other 4 idle through the products)
    assert [s.box for _, s in stages] == [(128, 128), (96, 128), (64, 128), (64, 64), (128, 128), (96, 96), (64, 64)]
    assert [s.tensor_core_tile for _, s in stages] == list(TILES)
    assert [s.tensor_core_tile.warps for _, s in stages] == [8, 8, 8, 8, 4, 4, 4]
    for func, schedule in stages:
        assert schedule.template == "tensor_core" and schedule.threads == 256
        # 96-row (and -column) tiles: 3 of them a column (a row), the last padded to 288
        assert schedule.n_tiles == -(-256 // schedule.box[0]) * -(-256 // schedule.box[1])
        tiles = isl.Map(schedule.tile_relation)
        assert tiles.range().is_equal(isl.Set("{ [i, j] : 0 <= i < 256 and 0 <= j < 256 }"))
        assert tiles.reverse().is_single_valued()  # no element in two tiles
        text = func.script()
        for intrinsic in ("tvm_fill_fragment", "tvm_load_matrix_sync", "tvm_mma_sync", "tvm_store_matrix_sync"):
            assert f"T.{intrinsic}(" in text, intrinsic  # TVM's wmma intrinsics, tensorized
        assert text.count('thread="blockIdx') == 1 and "wmma.accumulator" in text  # one loop of tiles
    _, small = stages[-1]
    # the 64 x 64 tile: the cp.async ring's three copies of both operands' 64 x 64 slices, rows
    # padded to 72 halves (the last row of the last not padded); its float32 accumulators (staged
    # through shared memory to the output once the slices are read) share their bytes
    assert small.shared_bytes == (ASYNC_STAGES * 2 * 64 * 72 - 8) * 2 > 64 * 64 * 4


def test_tensor_cores_are_not_used_where_they_do_not_fit():
    assert tensor_core_stages(_dense(256, 256, 128, "float32")) == []  # float32 operands: the SIMT rule
    assert tensor_core_stages(_dense(256, 256, 98)) == []  # a padded vector of terms would be read in part
    # 190 columns, not whole vectors: the output tile is stored an element a lane; the operands'
    # vectors run along the terms, whole vectors of 8, and are copied 16 bytes a lane by cp.async
    stages = tensor_core_stages(_dense(256, 190, 64))
    assert stages and all(s.tensor_core_tile.store_vector == 1 and s.tensor_core_tile.copy_vector == 8
                          and s.tensor_core_tile.copies_async
                          and [c.width for c in s.tensor_core_tile.warp_copies] == [8, 8] for _, s in stages)
    # 40 rows: 128- and 96-row tiles would be a third or less used; the 64-row ones write boxes of 40 rows
    wide = {(tile.rows, tile.columns, tile.warps): tile for tile in TILES}
    assert [(s.tensor_core_tile, s.box) for _, s in tensor_core_stages(_dense(40, 256, 64))] == \
        [(wide[64, 128, 8], (40, 128)), (wide[64, 64, 8], (40, 64)), (wide[64, 64, 4], (40, 64))]
    assert tensor_core_stages(_dense(16, 64, 64)) == []  # fewer outputs than one SIMT tile
    assert matmul_stage(_dense(256, 256, 128)) is not None  # the SIMT form stays a candidate


def test_a_gemm_that_no_wide_tile_fills_half_takes_the_narrow_tiles():
    """Paper EfficientNet's projection of 480 channels to 80 at 14 x 14 (196 x 80 x 480): every
    wide tile of 8 warps would be under half used (196 x 80 of 256 x 128 padded), the narrow ones
    are 77% and 64% used (and the 96 x 96 tile of 4 warps 57%). 112 columns fill the wide tiles of 8 warps to two thirds: no narrow tile then."""
    stages = tensor_core_stages(_dense(196, 80, 480))
    (quarter,) = [tile for tile in TILES if (tile.rows, tile.columns) == (96, 96)]
    assert [s.tensor_core_tile for _, s in stages] == [quarter, *NARROW_TILES]
    assert [s.n_tiles for _, s in stages] == [3, 2 * 5, 4 * 3]
    # (all the wide tiles but 96 x 96 on 4 warps: 196 x 112 of 288 x 192 padded is 40% used)
    assert [s.tensor_core_tile for _, s in tensor_core_stages(_dense(196, 112, 480))] == \
        [tile for tile in TILES if (tile.rows, tile.columns) != (96, 96)]


def test_every_candidate_fills_its_padded_tiles_to_the_minimum():
    """A tile's fill is checked once, before scheduling (``tensor_core_schedule``'s ``min_use``,
    on the GEMM's rows and columns); the stitched stage's outputs over its tiles' area (a padded
    tile's warps work on the whole tile) keep to it, rows, columns or both padded."""
    for m, n, k in [(40, 256, 64), (100, 132, 72), (196, 80, 96), (256, 48, 64)]:
        stages = tensor_core_stages(_dense(m, n, k))
        assert stages, (m, n, k)
        for _, schedule in stages:
            tile = schedule.tensor_core_tile
            minimum = NARROW_MIN_USE if tile.narrow else MATMUL_MIN_USE
            assert schedule.outputs == m * n
            assert schedule.outputs >= minimum * schedule.n_tiles * tile.rows * tile.columns, (m, n, k, str(tile))


def test_a_gemm_of_partial_tiles_is_padded_and_only_its_own_elements_are_written():
    """dlight's padding (``pad_einsum``): 100 x 132 outputs in 64 x 64 tiles, 72 terms in two
    chunks of 64. The tiles write the GEMM's elements only, and each read of an operand past its
    edge is a branch around the vector load."""
    stages = tensor_core_stages(_dense(100, 132, 72))  # larger tiles would be less than half used
    assert [s.tensor_core_tile.warps for _, s in stages] == [8, 4]  # 64 x 64 on 8 warps and on 4
    for func, schedule in stages:
        assert schedule.box == (64, 64) and schedule.n_tiles == 2 * 3
        tiles = isl.Map(schedule.tile_relation)
        assert tiles.range().is_equal(isl.Set("{ [i, j] : 0 <= i < 100 and 0 <= j < 132 }"))
        assert tiles.reverse().is_single_valued()
        text = func.script()
        assert "< 100" in text and "< 132" in text and "< 72" in text  # the rows', columns' and terms' edges


def _relu_dense(m: int, n: int, k: int, narrow=np.float16):
    rng = np.random.default_rng(0)
    builder = GraphBuilder("tc")
    x = builder.input("x", (m, k))
    w = builder.param("w", (rng.standard_normal((n, k)) * 0.1).astype(np.float32))
    graph = builder.build(builder.op("relu", builder.op("dense", x, w)))
    inputs = {"x": rng.standard_normal((m, k)).astype(np.float32)}
    rounded = [inputs["x"].astype(narrow).astype(np.float32), graph.weights["w"].astype(narrow).astype(np.float32)]
    return graph, inputs, np.maximum(rounded[0] @ rounded[1].T, 0)


def _kernel(graph) -> mutants.Kernel:
    plan = run_passes(graph, "cuda", stop="kernel_plan", opt_level=4, precision="fp16").ir
    assert "tensor_core" in [s.schedule.template for s in plan.staged.stages()]
    (kernel,) = [mutants.Kernel("tensor cores", name, func, {}, 1, plan.staged.threads)
                 for name, func in mutants.device_functions(mutants.device_module(plan.funcs, "sm_90")).items()]
    return kernel


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply", "register_pipeline")
def test_the_validator_reads_wmma_tiles_and_catches_a_missing_syncthreads():
    """The validator accepts the pipelined tensor-core kernel (4 chunks: a prologue, the pipeline's
    loop twice, its epilogue) and refuses it without each __syncthreads that orders a chunk's
    slices stored (from the registers that loaded them) before the fragments' loads, or the loads
    before the next stores into the same copy, and the accumulators' stores (wmma, lane by lane)
    before the block reads them back, and the one before the accumulators' store: the kernel's
    pool gives the accumulators the slices' bytes (``codegen.schedule._pool_bytes``), so the
    last fragments must be loaded before any warp stores over them. The one before the first
    chunk's stores guards nothing here (the kernel has one tile, so no tile before it read
    those bytes), and dropping it is accepted."""
    graph, _, _ = _relu_dense(128, 128, 256)
    kernel = _kernel(graph)
    assert mutants.validate(kernel).violations == ()
    dropped = mutants.sites(kernel)["drop_syncthreads"]
    assert len(dropped) == 6
    violations = [mutants.validate(kernel, make()).violations for _, make in dropped]
    assert [bool(v) for v in violations] == [False, True, True, True, True, True], dropped
    for caught in violations[1:4]:  # the pipeline's: the operand slices
        assert any("compute_in_reindex_shared.dyn" in v for v in caught), caught
    assert any("compute_in_reindex_shared.dyn" in v and "T_matmul_NT_reindex_shared.dyn" in v
               for v in violations[4]), violations[4]  # the slices' last loads, the accumulators over them
    assert any("T_matmul_NT_reindex_shared.dyn" in v for v in violations[-1]), violations[-1]  # the accumulators


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply", "register_pipeline")
def test_the_validator_catches_a_padded_tile_read_or_stored_past_the_gemm():
    """A padded tile's loads past the operands' edges are under a branch, its stores past the
    output's under a condition: without either, the validator finds the access out of bounds."""
    kernel = _kernel(_relu_dense(100, 132, 72)[0])
    assert mutants.validate(kernel).violations == ()
    unguarded_loads = kernel.func.with_body(mutants.rewrite(
        kernel.func.body, lambda s: s,
        lambda e: e.args[1] if isinstance(e, tvm.ir.Call) and e.op.name == "prim.if_then_else" else e))
    assert not unguarded_loads.same_as(kernel.func)
    assert any("outside" in v for v in mutants.validate(kernel, unguarded_loads).violations)
    (gemm,) = [loop for loop in mutants.tile_loops(kernel.func) if "mma_sync" in str(loop)]
    (guarded,) = [s for s in mutants.statements(gemm.body) if isinstance(s, tirx.IfThenElse)
                  and any(isinstance(store, tirx.BufferStore) and store.buffer.scope() == "global"
                          for store in mutants.statements(s.then_case))]
    unguarded_stores = mutants.replace_one(kernel.func, guarded, guarded.then_case)
    assert any("outside" in v for v in mutants.validate(kernel, unguarded_stores).violations)


def _async_attributes(within, key: str) -> list:
    """The attribute statements ``key`` of a function or a statement, in program order."""
    body = within.body
    return [s for s in mutants.statements(body) if isinstance(s, tirx.AttrStmt) and s.attr_key == key]


def _with_waits_leaving(func, counts: dict) -> tirx.PrimFunc:
    """``func`` with the k-th cp.async wait (in program order) leaving ``counts[k]`` groups in flight."""
    waits = _async_attributes(func, "async_wait_inflight_count")
    for k, count in counts.items():
        wait = waits[k]
        func = mutants.replace_one(func, wait, tirx.AttrStmt(wait.node, wait.attr_key, tirx.IntImm("int32", count),
                                                              wait.body))
        waits = _async_attributes(func, "async_wait_inflight_count")
    return func


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_the_validator_reads_cp_async_pipelines_and_catches_their_faults():
    """5 chunks of 64 terms in a ring of three slices: two issued before the pipeline's loop, three
    iterations that each issue one chunk, wait for all but the latest two and compute on the oldest,
    then two waits. The validator finds, for each copy, the wait that retires it, and refuses a wait
    that leaves one group more in flight (the warps read a chunk still landing), one that leaves the
    last copies in flight past the tile, a loop without the __syncthreads after its wait (other
    threads' copies are read before they are known to have landed) or before its copies (they
    overwrite the slices the slowest warps still read)."""
    graph, _, _ = _relu_dense(128, 128, 320)
    kernel = _kernel(graph)
    assert "cp_async" in kernel.func.script() and mutants.validate(kernel).violations == ()
    waits = [w.value.value for w in _async_attributes(kernel.func, "async_wait_inflight_count")]
    assert waits == [2, 1, 0]  # the loop's, then the two after it
    late = mutants.validate(kernel, _with_waits_leaving(kernel.func, {0: 3})).violations
    assert late and all("is in flight" in v for v in late), late
    assert any("still in flight at the end of a tile" in v
               for v in mutants.validate(kernel, _with_waits_leaving(kernel.func, {2: 1})).violations)
    tiles = mutants.tile_loops(kernel.func)
    (loop,) = [s for s in mutants.statements(kernel.func.body) if isinstance(s, tirx.For)
               and not any(s.same_as(t) for t in tiles) and _async_attributes(s, "async_wait_queue_scope")]
    syncs = [s for s in mutants.statements(loop.body) if mutants.is_barrier(s, "tirx.tvm_storage_sync")]
    assert len(syncs) == 2  # before the loop's copies, after its wait
    for sync in syncs:
        dropped = mutants.replace_one(kernel.func, sync, tirx.Evaluate(tirx.IntImm("int32", 0)))
        assert any("no __syncthreads between them" in v for v in mutants.validate(kernel, dropped).violations)


def test_the_accumulators_share_the_slices_bytes_in_the_pool_and_the_slices_do_not():
    """The pool gives each of a stage's shared buffers bytes that no buffer in use at the same time
    has: the two operands' slices (read chunk by chunk together) apart, the float32 accumulators
    (stored after the last chunk) over them."""
    (func, schedule), *_ = tensor_core_stages(_dense(256, 256, 128))
    placed = {buffer.name: (offset * buffer.dtype.bits // 8, buffer_elements(buffer) * buffer.dtype.bits // 8)
              for buffer, offset in pool_offsets(func)}
    (accumulators,) = [name for name in placed if "T_matmul" in name]
    a, b = sorted((name for name in placed if name != accumulators), key=lambda name: placed[name][0])
    assert placed[a][0] + placed[a][1] <= placed[b][0]  # the slices apart
    assert placed[accumulators][0] == 0 and placed[accumulators][1] == 128 * 128 * 4  # over the slices
    assert schedule.shared_bytes == placed[b][0] + placed[b][1] == pooled_shared(func) < 128 * 128 * 4 + placed[b][1] * 2


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_the_validator_catches_a_padded_cp_async_read_past_the_gemm():
    """A padded tile's cp.async copies read the operand only where their predicate holds (zeros
    are stored elsewhere); copying unconditionally reads past the operand's edge."""
    kernel = _kernel(_relu_dense(100, 132, 72)[0])
    assert "cp_async" in kernel.func.script() and mutants.validate(kernel).violations == ()

    def unpredicated(e):
        if isinstance(e, tvm.ir.Call) and e.op.name == "tirx.s_tir.cp_async_raw" and len(e.args) == 6:
            return tvm.ir.Call(e.op, [*e.args[:5], tirx.IntImm("int32", 1)], attrs=e.attrs, ret_ty=e.ty)
        return e

    copied = kernel.func.with_body(mutants.rewrite(kernel.func.body, lambda s: s, unpredicated))
    assert not copied.same_as(kernel.func)
    assert any("outside" in v for v in mutants.validate(kernel, copied).violations)


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_a_batched_product_s_values_are_copied_along_their_rows():
    """P.V reads V[k, j] with its rows along the product's columns. Its slice was [columns, terms],
    so each copied vector gathered four elements a row apart (on the H100 P.V took 11.0 us against the
    model's 2.1, the slowest GEMM for its FLOPs); it is now [terms, columns], copied in whole vectors
    by cp.async, its fragments loaded row-major (wmma's untransposed B). Every other GEMM of BERT
    reads its weights along the terms, transposed as before."""
    graph = models.build("bert", BERT_GEMMS, seed=0)
    plan = run_passes(graph, "cuda", stop="kernel_plan", opt_level=4, precision="fp16").ir
    stages = {s.name: s for s in plan.staged.stages() if s.schedule.tensor_core_tile}
    # the scores in whole rows with their softmax (codegen.align_tiles): one chunk, copied once
    whole_rows = {name for name, s in stages.items() if not s.schedule.tensor_core_tile.pipelined}
    assert whole_rows == {"bert_layer_r0/T_batch_matmul_NT+compute"}
    assert all(s.schedule.tensor_core_tile.copies_async for name, s in stages.items() if name not in whole_rows)
    # wmma reads A row-major; B column-major where its slice is [columns, terms]
    untransposed = {name for name, s in stages.items() if '"col_major")' not in s.func.script()}
    assert untransposed == {"bert_layer_r0/T_batch_matmul_NN+batch_matmul_13"}


def _transposed_a_product():
    """A batched product of A^T (A read along its columns: neither operand order can make each
    vector of it consecutive elements) by B."""
    rng = np.random.default_rng(0)
    builder = GraphBuilder("at_b")
    a = builder.input("a", (2, 64, 128))
    b = builder.input("b", (2, 64, 96))
    graph = builder.build(builder.op("batch_matmul", a, b, transpose_a=True))
    inputs = {"a": rng.standard_normal((2, 64, 128)).astype(np.float32),
              "b": rng.standard_normal((2, 64, 96)).astype(np.float32)}
    rounded = [inputs[n].astype(np.float16).astype(np.float32) for n in ("a", "b")]
    return graph, inputs, rounded[0].transpose(0, 2, 1) @ rounded[1]


@needs_gxx
@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_an_operand_gathered_from_strided_elements_is_not_copied_by_cp_async():
    """TVM would make one 8-byte cp.async of a vector of four elements a row apart, copying the
    wrong ones: an operand read across its rows keeps the register pipeline, and the product
    stays right on emulated threads."""
    graph, inputs, expected = _transposed_a_product()
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision="fp16")
    (stage,) = [s for s in model.kernel_plan.staged.stages() if s.schedule.tensor_core_tile]
    assert stage.schedule.tensor_core_tile.pipelined and not stage.schedule.tensor_core_tile.copies_async
    for order in ("ascending", "descending"):
        (output,) = model.schedule(order, model.emulator.sms, seed=5).run(inputs)
        np.testing.assert_allclose(output, expected, rtol=1e-2, atol=1e-2, err_msg=order)


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_the_latency_model_counts_a_gathered_vector_lane_by_lane():
    """Each copied vector of A^T gathers four elements a row of A apart: TVM's code generator loads
    it lane by lane, four instructions a vector, each touching a sector for every two lanes. The
    latency model counts the loads as scheduled, where it took every copy as one coalesced
    instruction; B's vectors stay one instruction of 8 sectors."""
    plan = run_passes(_transposed_a_product()[0], "cuda", stop="kernel_plan", opt_level=4, precision="fp16").ir
    (stage,) = [s for s in plan.staged.stages() if s.schedule.tensor_core_tile]
    tile = stage.schedule.tensor_core_tile
    assert (tile.depth, tile.copy_vector, tile.copies_async) == (64, 4, False)
    # lane l copies terms 4 (l % 16) to 4 (l % 16) + 3 of the slice's row l // 16: A[k, m], at 128 k + m
    lanes = np.arange(32)
    per_instruction = [len(set(((lanes % 16 * 4 + e) * 128 + lanes // 16) * 2 // 32)) for e in range(4)]
    assert per_instruction == [16] * 4
    assert tile.warp_copies == (WarpCopy(4, 4, 64), WarpCopy(4, 1, 32 * 4 * 2 // 32))
    (work,) = [w for w in stage_works(plan.staged, H100) if w.template == "tensor_core"]
    copies = {(a.tensor, a.kind): a for a in work.accesses}
    vectors = tile.rows * tile.depth // (32 * 4)  # one chunk: 64 terms
    assert (copies["first operand slices", "load"].per_tile, copies["first operand slices", "load"].sectors) == \
        (4 * vectors, 16)
    assert copies["first operand slices", "store"].per_tile == vectors
    assert (copies["second operand slices", "load"].per_tile, copies["second operand slices", "load"].sectors) == \
        (tile.columns * tile.depth // (32 * 4), 8)
    # loaded into registers, then stored: both pass through the L1/shared array
    assert all(a.through_l1 for a in work.accesses)


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_16_bit_operands_are_copied_16_bytes_at_a_time():
    """One cp.async.cg of 8 halves per lane, where 8-byte copies took two; the latency model counts
    a copy per 8 elements, and its bytes through the L1/shared array once, as they land in shared
    memory (.cg caches in L2 only)."""
    graph, _, _ = _relu_dense(128, 128, 320)
    model = souffle.compile(graph, target="cuda", device="h100", opt_level=4, precision="fp16")
    (stage,) = [s for s in model.kernel_plan.staged.stages() if s.schedule.tensor_core_tile]
    tile = stage.schedule.tensor_core_tile
    assert tile.copy_vector == 8 and tile.copies_async
    assert 'cp.async.cg.shared.global [%0], [%1], %2;"\n    :: "r"(dst_addr), "l"(src_p), "n"(16)' in model.source
    assert "cp.async.ca" not in model.source
    (work,) = [w for w in stage_works(model.kernel_plan.staged, H100) if w.template == "tensor_core"]
    copies = {(a.tensor, a.kind): a for a in work.accesses}
    chunks = -(-320 // tile.depth)
    assert copies["first operand slices", "load"].per_tile == tile.rows * chunks * tile.depth // (32 * 8)
    assert copies["first operand slices", "load"].sectors == 32 * 16 // 32
    assert [a.through_l1 for a in work.accesses if a.tensor.endswith("slices")] == [False, True, False, True]


def _shifted_dense(shift: int):
    """A dense whose first operand starts ``shift`` halves into each row of a wider tensor."""
    m, n, k = 128, 128, 320
    a, w = te.placeholder((m, k + shift), "float16", name="A"), te.placeholder((n, k), "float16", name="W")
    shifted = te.compute((m, k), lambda i, j: a[i, j + shift], name="shifted")
    product = topi.nn.dense(shifted, w, out_dtype="float32")
    return te.create_prim_func([a, w, te.compute(product.shape, lambda i, j: product[i, j].astype("float16"), name="C")])


def test_an_operand_copied_from_off_a_16_byte_boundary_is_copied_8_bytes_at_a_time():
    """A vector load or cp.async must start on its bytes: rows read from 4 halves in (8 bytes) are
    copied 4 at a time; from 2 halves in (4 bytes) no vector is aligned, and the copies go through
    registers, which TVM's code generator then loads lane by lane."""
    for shift, vector, async_copies in ((0, 8, True), (4, 4, True), (2, 4, False)):
        tiles = [s.tensor_core_tile for _, s in tensor_core_stages(_shifted_dense(shift))]
        assert tiles and all(t.copy_vector == vector and t.copies_async == async_copies for t in tiles), (shift, tiles)


def _pointwise_conv(channels: int, outputs: int, size: int):
    """A 1 x 1 convolution in NCHW and its ReLU: a GEMM whose data operand, X[c, hw], has its rows
    along the GEMM's rows as dlight orders them ([hw, c])."""
    rng = np.random.default_rng(0)
    builder = GraphBuilder("pointwise")
    x = builder.input("x", (1, channels, size, size))
    w = builder.param("w", (rng.standard_normal((outputs, channels, 1, 1)) * 0.1).astype(np.float32))
    graph = builder.build(builder.op("relu", builder.op("conv2d", x, w, stride=1, padding=0, groups=1)))
    inputs = {"x": rng.standard_normal((1, channels, size, size)).astype(np.float32)}
    x16, w16 = (torch.tensor(a).half().float() for a in (inputs["x"], graph.weights["w"]))
    return graph, inputs, torch.relu(torch.nn.functional.conv2d(x16, w16)).half().float().numpy()


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_a_pointwise_convolution_is_the_transposed_gemm_with_its_copies_async(order):
    """Taken as dlight orders it, each copied vector of the input gathered channels 196 halves
    apart, through registers; as the transposed GEMM (weights first, the input kept [channels,
    hw] like P.V's V) its tiles' rows are output channels and both operands are copied by cp.async,
    each in its own width: the weights 8 halves a lane (16 bytes, along the 64 channels), the input
    4 (its 196 columns are not whole vectors of 8); the output matches PyTorch on emulated threads."""
    graph, inputs, expected = _pointwise_conv(64, 48, 14)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision="fp16")
    (stage,) = [s for s in model.kernel_plan.staged.stages() if s.schedule.tensor_core_tile]
    tile = stage.schedule.tensor_core_tile
    assert tile.copies_async and [copy.width for copy in tile.warp_copies] == [8, 4]
    # 16 bytes: .cg (its 48 channels' rows padded to 64, each under its predicate); 8 bytes: .ca
    assert "@p cp.async.cg.shared.global" in model.source and "@p cp.async.ca.shared.global" in model.source
    # a tile holds all 48 output channels at consecutive positions (the transposed GEMM's rows and
    # columns); dlight's order would give it consecutive channels at each position
    first = isl.Map(stage.schedule.tile_relation).intersect_domain(isl.Set("{ [0] }")).range()
    assert first.is_equal(isl.Set("{ [0, c, h, w] : 0 <= c < 48 and 0 <= h < 14 and 0 <= w < 14 and 14h + w < 128 }"))
    (output,) = model.schedule(order, model.emulator.sms, seed=5).run(inputs)
    np.testing.assert_allclose(output.reshape(expected.shape), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_a_pointwise_convolution_over_a_28_x_28_map_copies_its_input_16_bytes_a_lane():
    """The input read at [c, hw // 28, hw % 28] is read at 784 c + hw once TVM simplifies the
    index, as the kernel's lowering does before it vectorizes: 8 halves a lane (16 bytes, one
    cp.async.cg each), where the check, vectorizing the unsimplified index, found no ramp and
    copied 4 (paper ResNeXt's 1 x 1 convolutions over 28 x 28); the output matches PyTorch on
    emulated threads."""
    graph, inputs, expected = _pointwise_conv(64, 48, 28)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision="fp16")
    (stage,) = [s for s in model.kernel_plan.staged.stages() if s.schedule.tensor_core_tile]
    tile = stage.schedule.tensor_core_tile
    assert tile.copies_async and tile.warp_copies == (WarpCopy(8, 1, 16), WarpCopy(8, 1, 16))
    assert "cp.async.cg.shared.global" in model.source and "cp.async.ca.shared.global" not in model.source
    (output,) = model.schedule("descending", model.emulator.sms, seed=5).run(inputs)
    np.testing.assert_allclose(output.reshape(expected.shape), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_a_pointwise_convolution_over_a_7_x_7_map_is_the_transposed_gemm_copied_an_element_a_lane(order, monkeypatch):
    """A 7 x 7 map is 49 columns of the transposed GEMM, not whole vectors: the input (kept
    [channels, hw]) is copied an element a lane, 32 consecutive halves a warp (2 sectors), and the
    output tile stored an element a lane, where dlight's order gathers each vector of four channels
    a feature map apart; the weights, along the 64 input channels, 8 halves (16 bytes) a lane.
    Where the latency model takes it (paper ResNeXt's layer-4 1 x 1 convolutions), it matches
    PyTorch on emulated threads."""
    graph, inputs, expected = _pointwise_conv(64, 128, 7)
    monkeypatch.setattr("codegen.stage.stage_seconds", lambda stage, device, traffic: not (
        stage.schedule.tensor_core_tile and stage.schedule.tensor_core_tile.store_vector == 1))
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision="fp16")
    (stage,) = [s for s in model.kernel_plan.staged.stages() if s.schedule.tensor_core_tile]
    tile = stage.schedule.tensor_core_tile
    assert tile.store_vector == 1 and not tile.copies_async
    assert tile.warp_copies == (WarpCopy(8, 1, 16), WarpCopy(1, 1, 2))
    (output,) = model.schedule(order, model.emulator.sms, seed=5).run(inputs)
    np.testing.assert_allclose(output.reshape(expected.shape), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_a_tensor_core_stage_with_half_its_warps_is_caught():
    kernel = _kernel(_relu_dense(128, 128, 128)[0])
    faults = [(what, make) for what, make in mutants.sites(kernel)["fewer_threads"] if what.startswith("stage 1")]
    assert faults
    for what, make in faults:
        assert any("is never written" in v for v in mutants.validate(kernel, make()).violations), what


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
@pytest.mark.parametrize("pipeline", ["cp.async", "registers"])
def test_a_vector_store_one_element_off_its_bytes_is_caught(pipeline, request):
    """Each vector store of the tensor-core kernel (the output tile's, and the slices' copies
    where they go through registers) moved one element later starts off a multiple of its bytes:
    the validator refuses each, and the concrete run of scripts/validate_mutants.py finds the
    misaligned address."""
    if pipeline == "registers":
        request.getfixturevalue("register_pipeline")
    kernel = _kernel(_relu_dense(128, 128, 128)[0])
    faults = mutants.sites(kernel)["misalign_vector"]
    stores = {what.split(" to ")[1].split(" ")[0] for what, _ in faults}
    assert "compute" in stores and (pipeline == "cp.async") == (len(stores) == 1), stores
    for what, make in faults:
        func = make()
        assert any("misaligned" in v for v in mutants.validate(kernel, func).violations), what
        assert any(f.startswith("misaligned") for f in mutants.concrete_faults(kernel, func)), what


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_a_wmma_operation_on_half_a_warp_is_caught():
    """wmma needs all 32 lanes: each of its operations under ``if threadIdx.x < 16`` is refused."""
    kernel = _kernel(_relu_dense(128, 128, 128)[0])
    lane = mutants.thread_vars(kernel.func)["threadIdx.x"]
    collective = [s for s in mutants.statements(kernel.func.body) if isinstance(s, tirx.Evaluate)
                  and isinstance(s.value, tvm.ir.Call) and s.value.op.name in WARP_COLLECTIVE]
    assert {s.value.op.name for s in collective} == set(WARP_COLLECTIVE)
    for s in collective:
        violations = mutants.validate(kernel, mutants.replace_one(kernel.func, s, tirx.IfThenElse(lane < 16, s, None)))
        assert any("wmma needs every lane of the warp" in v for v in violations.violations), s.value.op.name


@needs_gxx
@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
@pytest.mark.parametrize("precision", NARROW)
# each tile first; 5 chunks: 3 in the pipeline's loop; rows, columns and terms padded; a narrow
# tile on a GEMM the wide ones would leave over half empty (rows and columns padded, 2 chunks);
# columns not whole vectors (the output tile stored an element a lane, as Swin's 49 x 49 scores)
@pytest.mark.parametrize("m, n, k", [(128, 128, 320), (64, 256, 128), (256, 192, 128), (100, 132, 72),
                                     (196, 80, 96), (96, 190, 64)])
def test_tensor_core_stages_match_numpy_on_emulated_threads(m, n, k, precision):
    graph, inputs, expected = _relu_dense(m, n, k, NARROW[precision])
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    assert "nvcuda::wmma::mma_sync" in model.source
    for order in ("ascending", "descending"):
        (output,) = model.schedule(order, model.emulator.sms, seed=5).run(inputs)
        np.testing.assert_allclose(output, expected, rtol=1e-2, atol=1e-2, err_msg=order)


@needs_gxx
@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
@pytest.mark.parametrize("precision", NARROW)
# whole 96-row tiles (paper BERT's FFN GEMMs are 384 rows), and rows padded past the second tile
@pytest.mark.parametrize("m, n, k", [(192, 256, 320), (100, 128, 128)])
def test_96_row_tiles_match_numpy_on_emulated_threads(monkeypatch, m, n, k, precision):
    """The tile of 3 x 2 fragments a warp (96 x 128), which the pinned choice above never reaches
    while the 128 x 128 tile fits: alone among the wide tiles here, in its cp.async ring."""
    (tile,) = [t for t in TILES if (t.rows, t.columns) == (96, 128)]
    monkeypatch.setattr(codegen.schedule, "TILES", (tile,))
    graph, inputs, expected = _relu_dense(m, n, k, NARROW[precision])
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    (stage,) = [s for s in model.kernel_plan.staged.stages() if s.schedule.tensor_core_tile]
    assert (stage.schedule.tensor_core_tile.rows, stage.schedule.n_tiles) == (96, -(-m // 96) * (n // 128))
    assert stage.schedule.tensor_core_tile.copies_async
    for order in ("ascending", "descending"):
        (output,) = model.schedule(order, model.emulator.sms, seed=5).run(inputs)
        np.testing.assert_allclose(output, expected, rtol=1e-2, atol=1e-2, err_msg=order)


@needs_gxx
@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
@pytest.mark.parametrize("precision", [*NARROW, "tf32"])  # tf32: against PyTorch's float32 (the CPU has no TF32)
def test_bert_on_tensor_cores_matches_pytorch_on_emulated_threads(precision):
    graph = models.build("bert", BERT_GEMMS, seed=0)
    inputs = models.make_inputs("bert", BERT_GEMMS, seed=0)
    expected = models.reference("bert", BERT_GEMMS, graph.weights, precision)(inputs)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    # all six GEMMs: Q.K^T's 32 terms a head and P.V's 32 columns padded to tiles of 64
    assert sum(s.schedule.template == "tensor_core" for s in model.kernel_plan.staged.stages()) == 6
    rtol, atol = models.tolerance("bert", "tiny", precision)
    for order in ("ascending", "descending"):
        for output, reference in zip(model.schedule(order, model.emulator.sms + 1, seed=5).run(inputs), expected):
            np.testing.assert_allclose(output, reference, rtol=rtol, atol=atol, err_msg=order)


@needs_gxx
@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_attention_reads_query_key_and_value_from_the_projection_on_tensor_cores():
    """With heads of 64 every GEMM of BERT fits a tile. The QKV projection stores its bias add in
    its own layout (``codegen.vertical``), so Q.K^T reads query and key as two places of that one
    tensor, through two placeholders (``codegen.stage``), and P.V reads the value: no transposed
    copies between them."""
    config = {**BERT_GEMMS, "hidden": 128}
    graph = models.build("bert", config, seed=0)
    inputs = models.make_inputs("bert", config, seed=0)
    expected = models.reference("bert", config, graph.weights, "fp16")(inputs)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision="fp16")
    stages = model.kernel_plan.staged.stages()
    assert sum(s.schedule.template == "tensor_core" for s in stages) == 6
    assert not [s.name for s in stages if "transpose" in s.name]
    (scores,) = [s for s in stages if "T_batch_matmul_NT" in s.name]
    assert len(scores.placeholders) == 2 and scores.reads[0] == scores.reads[1]
    rtol, atol = models.tolerance("bert", "tiny", "fp16")
    for order in ("ascending", "descending"):
        for output, reference in zip(model.schedule(order, model.emulator.sms + 1, seed=5).run(inputs), expected):
            np.testing.assert_allclose(output, reference, rtol=rtol, atol=atol, err_msg=order)


@pytest.mark.parametrize("precision, dtype", [("fp16", "float16"), ("bf16", "bfloat16"), ("tf32", "tf32")])
def test_the_latency_model_counts_tensor_core_stages_at_the_tensor_core_peak(precision, dtype):
    staged = run_passes(models.build("bert", BERT_GEMMS), "cuda", stop="plan_arena", precision=precision).ir
    estimate = latency_estimate(staged, H100)
    on_tensor_cores = [s for s in estimate.stages if s.work.template == "tensor_core"]
    assert on_tensor_cores and all(s.work.tensor_core and s.work.dtype == dtype for s in on_tensor_cores)
    assert all(0 < s.fraction_of_peak <= 1 for s in on_tensor_cores)
