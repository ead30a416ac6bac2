"""GEMM-shaped stages scheduled by TVM's dlight matmul rule inside the persistent kernel
(codegen/schedule.py ``matmul_stage``): shared-memory slices of both operands and a register
tile per thread, the rule's block indices folded into the kernel's tile loop, each tile a box of
the output handed to the barrier analysis as an isl relation read off the schedule, the slices
in a shared pool the stages share. Checked against the expected tiles, by the thread-level
validator (with mutants), on emulated CUDA threads against PyTorch, and on paper BERT's kernel."""

from __future__ import annotations

import importlib
import re
import shutil
import sys
from pathlib import Path

import islpy as isl
import numpy as np
import pytest
from tvm import te, topi

import codegen.schedule
import souffle
from codegen.schedule import POOL_ALIGN_BYTES, matmul_stage
from souffle import models
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
mutants = importlib.import_module("scripts.validate_mutants")

@pytest.fixture(autouse=True)
def matmul_wherever_it_applies(monkeypatch):
    """These tests check the matmul stages themselves on GEMMs small enough to run emulated,
    where the latency model would pick another template (``codegen.stage``): pin the choice."""
    monkeypatch.setattr("codegen.stage.stage_seconds", lambda stage, device, traffic: stage.schedule.template != "matmul")


# BERT with GEMMs large enough for the rule (its tiny configuration's are not): 128 tokens, hidden 64.
BERT_GEMMS = {"seq": 128, "hidden": 64, "heads": 2, "ffn": 128, "max_positions": 128}


def _dense(m: int, n: int, k: int):
    a, w = te.placeholder((m, k), name="A"), te.placeholder((n, k), name="W")
    return te.create_prim_func([a, w, topi.nn.dense(a, w)])


def _tiles(schedule) -> isl.Map:
    return isl.Map(schedule.tile_relation)


def test_a_dense_stage_is_tiled_in_boxes_of_64_rows_by_64_columns():
    func, schedule = matmul_stage(_dense(128, 192, 64))
    assert (schedule.template, schedule.n_tiles, schedule.box, schedule.threads) == ("matmul", 6, (64, 64), 256)
    expected = isl.Map("{ [t] -> [i, j] : 0 <= t < 6 and 64 * (t mod 2) <= i < 64 * (t mod 2) + 64 and "
                       "64 * floor(t / 2) <= j < 64 * floor(t / 2) + 64 }")
    assert _tiles(schedule).is_equal(expected)
    # one chunk of 16 reduction terms of each operand in shared memory, rows padded to 20 floats
    # (128-bit loads, no two of 8 lanes on one bank; the last row unpadded), the second slice
    # starting on 32 bytes
    slice_bytes = ((64 - 1) * 20 + 16) * 4
    assert schedule.shared_bytes == -(-slice_bytes // 32) * 32 + slice_bytes
    assert "blockIdx.y" not in func.script() and func.script().count("blockIdx.x") == 1


@pytest.mark.parametrize("m, n, k", [(200, 96, 24), (250, 300, 16)])
def test_partial_tiles_write_every_element_once(m, n, k):
    _, schedule = matmul_stage(_dense(m, n, k))
    tiles = _tiles(schedule)
    assert tiles.range().is_equal(isl.Set(f"{{ [i, j] : 0 <= i < {m} and 0 <= j < {n} }}"))
    assert tiles.reverse().is_single_valued()  # no element in two tiles
    assert tiles.domain().is_equal(isl.Set(f"{{ [t] : 0 <= t < {schedule.n_tiles} }}"))


def test_a_batched_product_folds_its_batch_into_the_tiles():
    a, b = te.placeholder((3, 128, 40), name="A"), te.placeholder((3, 40, 64), name="B")
    _, schedule = matmul_stage(te.create_prim_func([a, b, topi.nn.batch_matmul(a, b, transpose_b=False)]))
    assert schedule.n_tiles == 3 * 2 and schedule.box == (1, 64, 64)
    tiles = _tiles(schedule)
    assert tiles.range().is_equal(isl.Set("{ [b, i, j] : 0 <= b < 3 and 0 <= i < 128 and 0 <= j < 64 }"))
    assert tiles.reverse().is_single_valued()


def test_the_rule_is_not_used_where_it_does_not_fit():
    assert matmul_stage(_dense(16, 32, 64)) is None  # fewer outputs than one tile
    assert matmul_stage(_dense(1, 8192, 64)) is None  # a GEMV: 127 of every 128 rows idle
    x = te.placeholder((4096, 64), name="x")
    k = te.reduce_axis((0, 64), name="k")
    row_sums = te.compute((4096,), lambda i: te.sum(x[i, k], axis=k), name="row_sums")
    assert matmul_stage(te.create_prim_func([x, row_sums])) is None  # a reduction, but of no product
    # a padded convolution: the rule would copy its input with vector loads under a select,
    # which loads both sides (out of bounds in the padding: the validator refused paper EfficientNet)
    x, w = te.placeholder((1, 8, 32, 32), name="x"), te.placeholder((16, 8, 3, 3), name="w")
    padded = topi.nn.conv2d_nchw(x, w, stride=1, padding=1, dilation=1)
    assert matmul_stage(te.create_prim_func([x, w, padded])) is None


def test_a_3x3_convolution_is_an_implicit_gemm_whose_tiles_cover_its_output():
    """dlight's rule reindexes a convolution's input into GEMM form (the padded input read at
    row ``y + ry``): the tiles are boxes of 16 channels x 2 rows x 32 columns."""
    x, w = te.placeholder((1, 8, 34, 34), name="x"), te.placeholder((16, 8, 3, 3), name="w")
    conv = topi.nn.conv2d_nchw(x, w, stride=1, padding=0, dilation=1)
    _, schedule = matmul_stage(te.create_prim_func([x, w, conv]))
    assert (schedule.n_tiles, schedule.box) == (16, (1, 16, 2, 32))
    tiles = _tiles(schedule)
    assert tiles.range().is_equal(isl.Set("{ [0, c, y, x] : 0 <= c < 16 and 0 <= y < 32 and 0 <= x < 32 }"))
    assert tiles.reverse().is_single_valued()


def _two_gemms():
    """Two independent GEMMs, so that nothing but the shared pool orders them."""
    rng = np.random.default_rng(0)
    builder = GraphBuilder("two_gemms")
    x1, x2 = builder.input("x1", (128, 16)), builder.input("x2", (128, 48))
    w1 = builder.param("w1", rng.standard_normal((96, 16)).astype(np.float32))
    w2 = builder.param("w2", rng.standard_normal((64, 48)).astype(np.float32))
    graph = builder.build(builder.op("dense", x1, w1), builder.op("dense", x2, w2))
    inputs = {"x1": rng.standard_normal((128, 16)).astype(np.float32),
              "x2": rng.standard_normal((128, 48)).astype(np.float32)}
    return graph, inputs, [inputs["x1"] @ graph.weights["w1"].T, inputs["x2"] @ graph.weights["w2"].T]


def test_stages_share_one_pool_of_shared_memory():
    graph, _, _ = _two_gemms()
    plan = run_passes(graph, "cuda", stop="kernel_plan", opt_level=4).ir
    stages = plan.staged.stages()
    assert [s.schedule.template for s in stages] == ["matmul", "matmul"]
    assert all(s.barrier is None for s in stages)  # independent: one runs right after the other
    (launch,) = plan.kernel_launches()
    most = max(s.schedule.shared_bytes for s in stages)
    assert launch.dynamic_shared == -(-most // POOL_ALIGN_BYTES) * POOL_ALIGN_BYTES  # the most, not the sum


def test_dropping_a_syncthreads_around_the_pool_is_caught():
    """The validator accepts the two GEMMs' kernel and refuses it without any one of its
    __syncthreads: a chunk's slices written before they are read, or read before the next
    chunk, tile or stage overwrites them."""
    graph, _, _ = _two_gemms()
    plan = run_passes(graph, "cuda", stop="kernel_plan", opt_level=4).ir
    (kernel,) = [mutants.Kernel("two_gemms O4", name, func, {}, 1, plan.staged.threads)
                 for name, func in mutants.device_functions(mutants.device_module(plan.funcs, "sm_90")).items()]
    assert mutants.validate(kernel).violations == ()
    dropped = mutants.sites(kernel)["drop_syncthreads"]
    # the first GEMM (K = 16, one chunk): before its slices are written and before they are read;
    # the second (K = 48, three chunks, software pipelined): also between the FMAs on a chunk and
    # the stores of the next, and after those stores
    assert len(dropped) == 6
    for what, make in dropped:
        assert mutants.validate(kernel, make()).violations, f"dropping {what} was not caught"


def test_a_matmul_stage_writing_too_little_is_caught():
    """The validator's coverage check on tiled matmuls (their flat indices nest divisions of the
    tile, which isl compares digit by digit): each matmul stage with half its warps, or with a
    warp's lanes writing one word, leaves elements unwritten or written twice (a 64-wide tile of
    BERT's 32-wide heads: the first half of its warps write every column), and the validator's
    coverage check names one."""
    plan = run_passes(models.build("bert", BERT_GEMMS), "cuda", stop="kernel_plan", opt_level=4).ir
    matmuls = {k for k, s in enumerate(plan.staged.stages()) if s.schedule.template == "matmul"}
    (kernel,) = [mutants.Kernel("bert O4", name, func, {}, 1, plan.staged.threads)
                 for name, func in mutants.device_functions(mutants.device_module(plan.funcs, "sm_90")).items()]
    assert mutants.validate(kernel).violations == ()
    sites = mutants.sites(kernel)
    faults = [(what, make) for kind in ("fewer_threads", "collapse_reduction") for what, make in sites[kind]
              if int(what.split(":")[0].removeprefix("stage ")) in matmuls]
    assert len(faults) >= len(matmuls)
    for what, make in faults:
        violations = mutants.validate(kernel, make()).violations
        assert violations, what
        if "reindex_shared" not in what:  # the output's coverage (a slice's: lanes racing on a word)
            assert any("is never written" in v or "must have exactly one writer" in v for v in violations), \
                (what, violations)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")
@pytest.mark.parametrize("level", [0, 4])
def test_matmul_stages_match_pytorch_on_emulated_threads(level):
    graph = models.build("bert", BERT_GEMMS, seed=0)
    inputs = models.make_inputs("bert", BERT_GEMMS, seed=0)
    expected = models.reference("bert", BERT_GEMMS, graph.weights)(inputs)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=level)
    # Q, K and V separate at O0, one fused dense from O1 on
    assert sum(s.schedule.template == "matmul" for s in model.kernel_plan.staged.stages()) == (8 if level == 0 else 6)
    rtol, atol = models.tolerance("bert", "tiny")
    for grid in (model.emulator.sms, model.emulator.sms + 1):
        for order in ("ascending", "descending"):
            for output, reference in zip(model.schedule(order, grid, seed=5).run(inputs), expected):
                np.testing.assert_allclose(output, reference, rtol=rtol, atol=atol, err_msg=f"O{level} {order} {grid}")


def _relu_dense_kernel_source(pipelined: bool, monkeypatch) -> str:
    monkeypatch.setattr(codegen.schedule, "MATMUL_PIPELINED", pipelined)
    b = GraphBuilder("dense")
    graph = b.build(b.op("relu", b.op("dense", b.input("x", (256, 128)), b.param("w", np.ones((256, 128), np.float32)))))
    return run_passes(graph, "cuda", stop="cuda_source", opt_level=4).ir.text


def test_a_matmul_stage_loads_the_next_chunk_into_registers_during_this_ones_fmas(monkeypatch):
    """Software pipelined (``codegen.schedule._pipeline_slices``): each thread loads a float4 of
    each operand's next 16-term chunk into a register before the FMAs on this chunk, in the loop
    over chunks and once before it (the first chunk); unpipelined, it copies global to shared
    memory directly."""
    staged = re.compile(r"(\w+)_shared_local_ptr\[0\] = \*\(float4\*\)\((\w+) \+")
    pipelined = _relu_dense_kernel_source(True, monkeypatch)
    assert sorted(m.group(1) for m in staged.finditer(pipelined)) == ["w_in_reindex", "w_in_reindex",
                                                                     "x_in_reindex", "x_in_reindex"]
    loop = pipelined[pipelined.index("for (int ax3_0 = 0; ax3_0 < 7; ++ax3_0)"):]  # 8 chunks: the loop has 7
    fmas = loop.index("T_matmul_NT_reindex_local_ptr")  # the accumulators, updated from the slices
    assert loop.index("_shared_local_ptr[0] = *(float4*)") < loop.index("__syncthreads()") < fmas
    assert loop.index("= x_in_reindex_shared_local_ptr[0]", fmas) > fmas  # stored to the slice after
    plain = _relu_dense_kernel_source(False, monkeypatch)
    assert not staged.search(plain) and "_shared_local_ptr" not in plain


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")
def test_a_pipelined_matmul_of_eight_chunks_matches_float64_on_emulated_threads():
    rng = np.random.default_rng(3)
    b = GraphBuilder("dense")
    w = (rng.standard_normal((192, 128)) * 0.1).astype(np.float32)
    graph = b.build(b.op("relu", b.op("dense", b.input("x", (256, 128)), b.param("w", w))))
    inputs = {"x": rng.standard_normal((256, 128)).astype(np.float32)}
    expected = np.maximum(inputs["x"].astype(np.float64) @ w.T.astype(np.float64), 0)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    assert [s.schedule.template for s in model.kernel_plan.staged.stages()] == ["matmul"]
    for order in ("ascending", "descending"):
        (output,) = model.schedule(order, model.emulator.sms, seed=5).run(inputs)
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5, err_msg=order)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_narrow_operands_are_widened_into_float32_slices_and_match_numpy_on_emulated_threads(precision, monkeypatch):
    """dlight's SIMT matmul (tensor cores off) of float16 or bfloat16 operands copies them into
    float32 slices (``codegen.schedule.widened_operands``), so its rows are read as float32's
    are, four terms a load; the product matches float64 over the rounded operands."""
    import ml_dtypes

    monkeypatch.setattr(codegen.schedule, "TILES", ())
    narrow = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}[precision]
    rng = np.random.default_rng(4)
    b = GraphBuilder("dense")
    w = (rng.standard_normal((192, 128)) * 0.1).astype(np.float32)
    graph = b.build(b.op("relu", b.op("dense", b.input("x", (256, 128)), b.param("w", w))))
    inputs = {"x": rng.standard_normal((256, 128)).astype(np.float32)}
    rounded = [a.astype(narrow).astype(np.float64) for a in (inputs["x"], w)]
    expected = np.maximum(rounded[0] @ rounded[1].T, 0)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    assert [s.schedule.template for s in model.kernel_plan.staged.stages()].count("matmul") == 1
    assert "_f32_reindex_shared" in model.source and "float4" in model.source
    for order in ("ascending", "descending"):
        (output,) = model.schedule(order, model.emulator.sms, seed=5).run(inputs)
        np.testing.assert_allclose(output, expected, rtol=2e-2, atol=2e-2, err_msg=order)


def test_only_operands_read_as_float32_are_widened():
    """A float32 copy stands in for a narrow operand only where every read of it is cast to
    float32 (a GEMM's); a LayerNorm's row sum recomputing float16 additions reads its operands
    in float16, and is left as it is (a copy there was a float16 + float32 add TVM refuses)."""
    x, w = te.placeholder((64, 32), "float16", "x"), te.placeholder((48, 32), "float16", "w")
    k = te.reduce_axis((0, 32), "k")
    gemm = te.compute((64, 48), lambda i, j: te.sum(x[i, k].astype("float32") * w[j, k].astype("float32"), axis=k))
    widened = codegen.schedule.widened_operands(gemm)
    assert sorted(t.op.name for t in widened.op.input_tensors) == ["w_f32", "x_f32"]
    row = te.compute((64,), lambda i: te.sum((x[i, k] + w[i % 48, k]).astype("float32"), axis=k))
    assert codegen.schedule.widened_operands(row) is row


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")
def test_two_gemms_in_one_block_match_numpy():
    graph, inputs, expected = _two_gemms()
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    for order in ("ascending", "descending"):
        for output, reference in zip(model.schedule(order, 1, seed=5).run(inputs), expected):
            np.testing.assert_allclose(output, reference, rtol=1e-5, atol=1e-4)


def test_paper_bert_gemms_are_tiled_matmuls_in_one_kernel_without_spills():
    """Issue 16's acceptance at fp32: paper BERT's six GEMM-shaped stages (QKV, Q.K^T, P.V,
    attention output, FFN1, FFN2) are dlight matmuls; one __global__, validated, no spills."""
    compiled = souffle.compile(models.build("bert", "paper"), target="cuda")
    stages = compiled.kernel_plan.staged.stages()
    assert sum(s.schedule.template == "matmul" for s in stages) == 6
    assert compiled.kernel_count == 1
    assert compiled.resources.spill_bytes == 0
    assert "__shared__" in compiled.source or "extern __shared__" in compiled.source
