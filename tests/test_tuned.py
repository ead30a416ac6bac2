"""Stage schedules from a MetaSchedule database (codegen.tuned).

No GPU here tunes anything, so the records are made as MetaSchedule's tuner would leave them: a
schedule's trace committed for the stage's workload (``souffle.stage_workloads``) with its measured
run times. Each test then compiles with the database and checks what the stage took, what the
report says, and, on the emulator (every GPU thread a fiber), that the kernel still computes the
model; the refusals are checked by the records that must be refused.
"""

import re

import numpy as np
import pytest
import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

import souffle
from codegen.schedule import _CUDA, _KernelShapedMatmul, _pipeline_slices
from souffle.errors import TargetError
from souffle.graph import GraphBuilder

RUN_SECONDS = [3e-6, 2e-6, 4e-6]


def _dense_relu():
    rng = np.random.default_rng(0)
    b = GraphBuilder("dense")
    x = b.input("x", (256, 128))
    return b.build(b.op("relu", b.op("dense", x, b.param("w", rng.standard_normal((192, 128)).astype("float32")))))


def _workload(graph) -> tuple[str, tvm.IRModule]:
    (name, mod), = souffle.stage_workloads(graph).items()
    return name, mod


def _threads_along_x(mod: tvm.IRModule, threads: int) -> s_tir.Schedule:
    """The GEMM and its relu in tiles of ``threads`` outputs, one per thread along threadIdx.x,
    the product in a register: the form MetaSchedule's CUDA rules give a small GEMM."""
    sch = s_tir.Schedule(mod)
    gemm, relu = sch.get_child_blocks(sch.get_sblock("root"))
    i, j, k = sch.get_loops(gemm)
    side = int(threads ** 0.5)
    i_tile, i_thread = sch.split(i, [None, side])
    j_tile, j_thread = sch.split(j, [None, threads // side])
    sch.reorder(i_tile, j_tile, i_thread, j_thread, k)
    sch.bind(sch.fuse(i_tile, j_tile), "blockIdx.x")
    thread = sch.fuse(i_thread, j_thread)
    sch.bind(thread, "threadIdx.x")
    sch.set_scope(gemm, 0, "local")
    sch.reverse_compute_at(relu, thread)
    sch.decompose_reduction(gemm, k)
    return sch


def _each_block_its_kernel(mod: tvm.IRModule, threads: tuple[int, int], gemm_scope: str = "global") -> s_tir.Schedule:
    """The GEMM and its relu each in tiles of ``threads`` of its outputs, one a thread along
    threadIdx.x, as two kernels would be; the GEMM's result kept in ``gemm_scope``."""
    sch = s_tir.Schedule(mod)
    gemm, relu = sch.get_child_blocks(sch.get_sblock("root"))
    sch.set_scope(gemm, 0, gemm_scope)
    for block, count in zip((gemm, relu), threads):
        i, j, *_ = sch.get_loops(block)
        tile, thread = sch.split(sch.fuse(i, j), [None, count])
        sch.bind(tile, "blockIdx.x")
        sch.bind(thread, "threadIdx.x")
    return sch


def _database(tmp_path, mod: tvm.IRModule, sch: s_tir.Schedule, run_seconds=RUN_SECONDS):
    database = ms.database.JSONDatabase(work_dir=str(tmp_path))
    tuned = ms.TuneContext(mod=mod["main"]).mod  # the workload as tune_tir commits it (its normalization)
    record = ms.database.TuningRecord(sch.trace, database.commit_workload(tuned), run_seconds,
                                      tvm.target.Target({"kind": "cuda", "arch": "sm_90"}),
                                      ms.arg_info.ArgInfo.from_prim_func(mod["main"]))
    database.commit_tuning_record(record)
    return tmp_path


def _check_emulated(model, graph):
    x = np.random.default_rng(1).standard_normal((256, 128)).astype("float32")
    for order in ("ascending", "descending"):
        (got,) = model.schedule(order).run({"x": x})
        np.testing.assert_allclose(got, np.maximum(x @ graph.weights["w"].T, 0), rtol=1e-5, atol=1e-4)


def test_a_stage_takes_its_schedule_from_the_database(tmp_path):
    """MetaSchedule's form (256 threads along threadIdx.x) re-bound to the kernel's 32 x 8
    block; the stage's time in the model is the record's median; the kernel still computes it."""
    graph = _dense_relu()
    name, mod = _workload(graph)
    database = _database(tmp_path, mod, _threads_along_x(mod, 256))
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, database=database)
    (stage,) = model.plan.stages()
    assert (stage.name, stage.schedule.template, stage.schedule.measured_seconds) == (name, "database", 3e-6)
    assert (stage.schedule.n_tiles, stage.schedule.box) == (256 * 192 // 256, (16, 16))
    bindings = {(tag, extent) for extent, tag in
                re.findall(r'T\.thread_binding\((\d+), thread="(threadIdx\.[xyz])"\)', stage.func.script())}
    assert bindings == {("threadIdx.x", "32"), ("threadIdx.y", "8")}
    assert model.report().extra["database 1"] == f"{name}: scheduled from {database} (measured 3 us)"
    (estimate,) = model.latency.stages
    assert (estimate.seconds, estimate.bound) == (3e-6, "measured")
    _check_emulated(model, graph)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_schedule_in_the_kernel_s_block_shape_is_taken_as_it_is(tmp_path, pipelined):
    """A record whose trace is dlight's matmul rule in the kernel's shape (what this project's
    own ``matmul`` stage is), replayed from the database; software pipelined (its loop over
    chunks annotated, as MetaSchedule annotates it), the pipeline is injected on the stage."""
    graph = _dense_relu()
    _, mod = _workload(graph)
    sch = _KernelShapedMatmul(256).apply(mod["main"].with_attr("dlight.do_not_tensorize", True),
                                         tvm.target.Target(_CUDA), False)
    assert not pipelined or _pipeline_slices(sch)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, database=_database(tmp_path, mod, sch))
    (stage,) = model.plan.stages()
    assert stage.schedule.template == "database"
    assert ("software_pipeline_stage" in stage.func.script()) is False  # injected, not left for the kernel
    _check_emulated(model, graph)


def test_a_record_of_another_block_shape_is_refused_with_its_reason(tmp_path):
    graph = _dense_relu()
    name, mod = _workload(graph)
    model = souffle.compile(graph, target="cuda", opt_level=4,
                            database=_database(tmp_path, mod, _threads_along_x(mod, 64)))
    assert [s.schedule.template for s in model.plan.stages()] != ["database"]
    assert model.report().extra["database 1"] == (
        f"{name}: its record in {tmp_path} is refused: it binds threadIdx.x = 64; the kernel's blocks are "
        "threadIdx.x = 32, threadIdx.y = 8 (or 256 threads along threadIdx.x); it keeps its own schedule")


def test_a_record_binding_two_thread_counts_is_refused(tmp_path):
    """The GEMM over 256 threads along threadIdx.x, its relu over 128: only loops of the whole
    block along threadIdx.x are re-bound onto the kernel's warps, so the record is refused."""
    graph = _dense_relu()
    name, mod = _workload(graph)
    sch = _each_block_its_kernel(mod, (256, 128), "shared")
    model = souffle.compile(graph, target="cuda", opt_level=4, database=_database(tmp_path, mod, sch))
    assert "it binds threadIdx.x = 128, threadIdx.x = 256;" in model.report().extra["database 1"]


def test_a_schedule_keeping_an_intermediate_in_global_memory_is_refused(tmp_path):
    graph = _dense_relu()
    name, mod = _workload(graph)
    sch = _each_block_its_kernel(mod, (192, 192))  # a row of the 256 x 192 output a block
    model = souffle.compile(graph, target="cuda", opt_level=4, database=_database(tmp_path, mod, sch))
    assert "in global memory, which a kernel cannot allocate" in model.report().extra["database 1"]


def test_a_database_without_the_stage_s_workload_changes_nothing(tmp_path):
    graph = _dense_relu()
    other = GraphBuilder("other")
    _, mod = _workload(other.build(other.op("relu", other.input("y", (64, 64)))))
    plain = souffle.compile(graph, target="cuda", opt_level=4)
    model = souffle.compile(graph, target="cuda", opt_level=4, database=_database(tmp_path, mod, s_tir.Schedule(mod)))
    assert model.source == plain.source
    assert model.report().extra["database 1"] == f"no stage's workload has a record in {tmp_path}"


def test_a_database_is_for_cuda_kernels_and_must_exist(tmp_path):
    graph = _dense_relu()
    with pytest.raises(TargetError, match="database_workload.json, database_tuning_record.json missing"):
        souffle.compile(graph, target="cuda", database=tmp_path)
    with pytest.raises(TargetError, match="not target 'llvm'"):
        souffle.compile(graph, target="llvm", database=tmp_path)


def test_the_command_line_names_a_missing_database(tmp_path, capsys):
    from souffle.cli import main

    assert main(["compile", "mmoe", "--target", "cuda", "--no-run", "--database", str(tmp_path / "tuned")]) == 2
    assert f"no MetaSchedule database at {tmp_path / 'tuned'}: database_workload.json, " \
           "database_tuning_record.json missing" in capsys.readouterr().err
