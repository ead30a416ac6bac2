"""Reductions accumulate in registers: no stage of any model loads and stores a global element
at every reduction step (read from the TIR that TVM hands to its CUDA code generator), and each
thread's accumulator is one register, not a local array (which nvcc puts in local memory)."""

import importlib
import math
import re

import numpy as np
import pytest
from tvm import s_tir, te, tirx

import souffle
from analysis.accumulation import global_accumulations
from analysis.threads import device_functions
from codegen.cuda import device_module
import codegen.schedule
from codegen.row_resident import ROW_VALUE, statistics_of, with_row_value
from codegen.schedule import MATMUL_MICRO, MATMUL_VTHREADS, WARP, schedule_te, stage_reduction
from souffle import models
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder

mutants = importlib.import_module("scripts.validate_mutants")


def _gemm(m: int, n: int, k: int):
    a, w = te.placeholder((m, k), name="a"), te.placeholder((n, k), name="w")
    r = te.reduce_axis((0, k), "r")
    return te.compute((m, n), lambda i, j: te.sum(a[i, r] * w[j, r], axis=r), name="c"), [a, w]


def _accumulations(funcs: dict) -> list[str]:
    return [str(a) for name, f in device_functions(device_module(funcs, "sm_90")).items()
            for a in global_accumulations(f, name)]


def test_an_in_place_thread_reduction_is_found():
    """The mutant: one output per thread, summed in place in its global element."""
    c, placeholders = _gemm(37, 61, 8)
    sch = s_tir.Schedule(te.create_prim_func(placeholders + [c]))
    block = sch.get_sblock("c")
    i, j, _ = sch.get_loops(block)
    tile, warp, lane = sch.split(sch.fuse(i, j), [None, 8, 32])
    for loop, tag in ((tile, "blockIdx.x"), (warp, "threadIdx.y"), (lane, "threadIdx.x")):
        sch.bind(loop, tag)
    assert _accumulations({"main": sch.mod["main"]}) == ["main_kernel: c is loaded and stored at every iteration of loop r"]


@pytest.mark.parametrize("shape, expected", [
    ("initialized once, summed in the loop", ["main: c is loaded and stored at every iteration of loop t"]),
    ("initialized when t == 0", ["main: c is loaded and stored at every iteration of loop t"]),
    ("initialized at every iteration", []),
])
def test_an_accumulation_is_a_load_and_store_carried_across_iterations(shape, expected):
    c, x = tirx.decl_buffer((1,), "float32", name="c"), tirx.decl_buffer((8,), "float32", name="x")
    t = tirx.Var("t", "int32")
    init = tirx.BufferStore(c, tirx.const(0.0, "float32"), [0])
    add = tirx.BufferStore(c, tirx.BufferLoad(c, [0]) + tirx.BufferLoad(x, [t]), [0])
    if shape == "initialized once, summed in the loop":
        body = tirx.SeqStmt([init, tirx.For(t, 0, 8, tirx.ForKind.SERIAL, add)])
    elif shape == "initialized when t == 0":
        body = tirx.For(t, 0, 8, tirx.ForKind.SERIAL, tirx.SeqStmt([tirx.IfThenElse(t == 0, init, None), add]))
    else:
        body = tirx.For(t, 0, 8, tirx.ForKind.SERIAL, tirx.SeqStmt([init, add]))
    assert [str(a) for a in global_accumulations(tirx.PrimFunc([], body))] == expected


@pytest.mark.parametrize("threads", [32, 256])
@pytest.mark.parametrize("m, n", [(5, 6), (37, 61), (384, 96)])
def test_a_thread_reduction_sums_in_a_register(m, n, threads, monkeypatch):
    monkeypatch.setattr(codegen.schedule, "MATMUL_MIN_OUTPUTS", m * n + 1)  # not dlight's rule: the template
    c, placeholders = _gemm(m, n, 8)
    func, schedule = schedule_te(c, placeholders, True, threads)
    assert schedule.template == "thread_reduce"
    assert _accumulations({"main": func}) == []


@pytest.mark.parametrize("m, n", [(384, 96), (200, 96)])
def test_a_matmul_stage_sums_in_registers(m, n, monkeypatch):
    """In its kernel: a software-pipelined stage is lowered with its slices in the kernel's pool
    (TVM's lowering refuses it alone, ``codegen.schedule._compacted``)."""
    monkeypatch.setattr("codegen.stage.stage_seconds", lambda stage, device, traffic: stage.schedule.template != "matmul")
    b = GraphBuilder("gemm")
    graph = b.build(b.op("dense", b.input("x", (m, 40)), b.param("w", np.ones((n, 40), np.float32))))
    plan = run_passes(graph, "cuda", stop="kernel_plan", opt_level=4).ir
    assert [s.schedule.template for s in plan.staged.stages()] == ["matmul"]
    assert _accumulations(plan.funcs) == []


@pytest.mark.parametrize("threads", [32, 256])
@pytest.mark.parametrize("shapes", [[(5, 8), (6, 8)], [(37, 8), (61, 8)], [(2, 5, 8), (2, 8, 6)]])
def test_a_partial_last_tile_stores_only_its_outputs(shapes, threads):
    """30 outputs in a tile of 32: the register write-back is guarded like the reduction (TVM's
    cache_write widened it to a 6 x 6 box and stored past the output, corrupting the heap)."""
    op = "batch_matmul" if len(shapes[0]) == 3 else "dense"
    b = GraphBuilder("partial_tile")
    out = b.op(op, b.input("a", shapes[0]), b.input("w", shapes[1]))
    model = souffle.compile(b.build(out), target="llvm-persistent", threads=threads)
    rng = np.random.default_rng(0)
    a, w = (rng.standard_normal(s).astype("float32") for s in shapes)
    want = a @ (w if op == "batch_matmul" else w.T)
    for _ in range(3):
        np.testing.assert_allclose(model(a, w), want, rtol=1e-5, atol=1e-5)


def _row_arrays(staged) -> set[tuple[str, int]]:
    """(local array, elements) a row-resident stage keeps per thread by design: its statistics'
    results for its row (a LayerNorm's two moments) and its row cache (the thread's width / 32
    columns of each tensor it reads along the row, rounded up, ``codegen.row_resident``; of each
    of the rows its warp loads together, for a tensor of rows: paper Swin's aligned window
    softmax, 7 rows of 49 scores, 2 columns a lane each), and the row's value where it is
    computed once (``with_row_value``, where a warp takes one row: the same columns of a row of
    split-K partials' sum)."""
    arrays = set()
    for stage in staged.stages():
        if stage.epilogue != "row":
            continue
        width = int(stage.tensor.shape[-1])
        rows = math.prod(int(d) for d in stage.tensor.shape[:-1])
        for op in statistics_of(stage.tensor):
            arrays.add((f"{op.name}_local_ptr", math.prod(int(d) for d in op.shape) // rows))
        arrays |= {(f"{p.op.name}_local_ptr", -(-width // WARP) * n) for p in stage.placeholders
                   for n in {1, stage.schedule.rows_together}}
        rows_per_warp = -(-(stage.schedule.per_tile // width) // (stage.schedule.threads // WARP))
        if rows_per_warp == 1 and with_row_value(stage.tensor) is not stage.tensor:
            arrays.add((f"{ROW_VALUE}_local_ptr", -(-width // WARP)))
    return arrays


def _rows_together_arrays(staged) -> set[tuple[str, int]]:
    """(local array, elements) of a warp_reduce stage whose warps reduce rows together: each
    lane's sum of each of its warp's rows (``codegen.schedule._reduce_rows_together``), indexed
    by constants once unrolled (paper LSTM: 48 registers, nothing in local memory, ptxas)."""
    return {(f"{stage_reduction(stage.tensor).op.name}_rf_local_ptr", stage.schedule.rows_together)
            for stage in staged.stages()
            if stage.schedule.template == "warp_reduce" and stage.schedule.rows_together > 1}


def _model_accumulations(name: str, config: str, level: int) -> list[str]:
    """The global accumulations of the model's kernels, and their per-thread arrays of more than
    one element (an epilogue's results indexed differently from its reduction's kept a whole
    array of them)."""
    run = run_passes(models.build(name, config), "cuda", stop="cuda_source", opt_level=level)
    source = run.ir
    found = [str(a) for kernel, f in device_functions(source.device).items() for a in global_accumulations(f, kernel)]
    arrays = re.findall(r"\b(?:float|double|half|int) (\w+)\[(\d+)\];", source.text)
    # a matmul stage's register tile (dlight's rule): its accumulators per thread, indexed
    # by constants once unrolled (ptxas keeps them in registers: tests/test_matmul_stage.py)
    tile = MATMUL_VTHREADS * math.prod(MATMUL_MICRO)
    by_design = _row_arrays(run.irs["staged"]) | _rows_together_arrays(run.irs["staged"])
    return found + [f"local array {name}[{n}]" for name, n in arrays
                    if int(n) > 1 and "shared" not in name and (re.sub(r"_\d+$", "", name), int(n)) not in by_design
                    and not ("_reindex" in name and "_local" in name and int(n) == tile)]


@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("name", models.MODELS)
def test_no_model_accumulates_in_global_memory(name, level):
    assert _model_accumulations(name, "tiny", level) == []


@pytest.mark.parametrize("name", ["lstm", "bert", "resnext", "mmoe"])
def test_no_paper_model_accumulates_in_global_memory(name):
    assert _model_accumulations(name, "paper", 4) == []


@pytest.mark.slow
@pytest.mark.parametrize("level", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("name", models.MODELS)
def test_no_paper_model_accumulates_in_global_memory_at_any_level(name, level):
    assert _model_accumulations(name, "paper", level) == []


@pytest.mark.parametrize("level", [0, 4])
def test_a_single_tile_reduction_keeps_one_register(level):
    """98 pooled outputs, one tile: TVM bound the write-back without the tile's index and the
    reduction with it, and kept a 98-float array per thread (local memory) where both now agree."""
    b = GraphBuilder("one_tile_pool")
    out = b.op("max_pool2d", b.input("x", (1, 2, 14, 14)), kernel=3, stride=2, padding=1)
    source = run_passes(b.build(out), "cuda", stop="cuda_source", opt_level=level).ir
    assert re.findall(r"float (\w+_local\w*)\[(\d+)\];", source.text) == [("pool_max_local_ptr", "1")]


def test_paper_efficientnet_kernel_is_thread_safe():
    """Simplifying every GPU stage (not only single-tile ones) made paper EfficientNet's O4
    kernel write its convolutions' last tile from two threads per element; the validator said so.
    Its coverage proof of a 1x1 convolution of 40 x 28 x 28 outputs in dlight's 13 matmul tiles
    of 64 (a tile width that does not divide the 784-element rows) took isl 15 minutes until the
    digits it compares followed the rows (now its writes are enumerated, ``Checker._enumerated_writes``);
    the same stage with half its warps is still caught, at the first element it misses."""
    plan = run_passes(models.build("efficientnet", "paper"), "cuda", stop="kernel_plan", opt_level=4).ir
    (kernel,) = [mutants.Kernel("efficientnet O4", name, func, plan.host_loop_trips(), plan.min_grids().get(name, 1),
                                plan.staged.threads)
                 for name, func in device_functions(device_module(plan.funcs, "sm_90")).items()]
    assert mutants.validate(kernel).violations == ()
    (stage,) = [k for k, s in enumerate(plan.staged.stages())
                if s.name.endswith("/convolution_19+_native_batch_norm_legit_no_training_11")]
    (half_the_warps,) = [make for what, make in mutants.sites(kernel)["fewer_threads"]
                         if what.startswith(f"stage {stage}:")]
    violations = mutants.validate(kernel, half_the_warps()).violations
    assert f"stage {stage} (writes T_add): T_add: element 25088 of 31360 is never written (grid size 1)" in violations
