"""A GEMV-shaped warp_reduce stage with each warp's rows reduced together (``codegen.schedule``'s
``_reduce_rows_together``, TVM's ``rfactor`` as dlight's GEMV rule uses it): each lane keeps one
sum per row, the vector's element is loaded once for all of them, and the latency model counts it
so. Checked: the loops as scheduled, the model's counts, which candidate the model takes (paper
LSTM's gate product at fp16: 4 rows a warp, 320 tiles, where 1280 took three rounds of the grid,
its vector staged in shared memory), and an LSTM whose gate product takes 2 rows a warp at fp16,
its vector staged (1 row at fp32), against PyTorch on emulated threads in both thread orders.
"""

import dataclasses
import importlib
import json

import pytest
from tvm import te, tirx

from analysis.characterize import shares_loads_along_rows
from analysis.threads import device_functions
from analysis.device import get_device
from codegen import latency
from codegen.cuda import device_module
from codegen.schedule import WARP, schedule_stage
from souffle import models
from souffle.cli import main
from souffle.compiler import run_passes

mutants = importlib.import_module("scripts.validate_mutants")

ROWS, TERMS = 256, 512


def _gemv():
    weight = te.placeholder((ROWS, TERMS), "float16", name="weight")
    vector = te.placeholder((TERMS,), "float16", name="vector")
    k = te.reduce_axis((0, TERMS), "k")
    product = te.compute((ROWS,), lambda i: te.sum(weight[i, k].astype("float32") * vector[k].astype("float32"),
                                                   axis=k), name="product")
    return weight, vector, product


def _loops(stmt, found):
    """(extent, kind, thread tag) of every loop of ``stmt``, outermost first, depth-first."""
    if isinstance(stmt, tirx.For):
        tag = stmt.thread_binding.thread_tag if stmt.thread_binding is not None else ""
        found.append((int(stmt.extent), tirx.ForKind(int(stmt.kind)).name, tag))
        _loops(stmt.body, found)
    elif isinstance(stmt, tirx.SeqStmt):
        for child in stmt.seq:
            _loops(child, found)
    elif hasattr(stmt, "block"):
        _loops(stmt.block.body, found)
        if stmt.block.init is not None:
            _loops(stmt.block.init, found)
    elif hasattr(stmt, "body"):
        _loops(stmt.body, found)
    return found


def test_a_warp_s_rows_are_summed_in_one_pass_over_the_terms_then_shuffled():
    weight, vector, product = _gemv()
    func, schedule = schedule_stage(te.create_prim_func([weight, vector, product]), True, 256, per_warp=4,
                                    together=True)
    assert (schedule.template, schedule.n_tiles, schedule.per_tile, schedule.rows_together) == \
        ("warp_reduce", ROWS // 32, 32, 4)
    loops = _loops(func.body, [])
    steps = TERMS // WARP
    # the sums: tile, warp, lane, then the steps over the terms with the 4 rows unrolled inside
    assert loops[:3] == [(ROWS // 32, "THREAD_BINDING", "blockIdx.x"), (8, "THREAD_BINDING", "threadIdx.y"),
                         (WARP, "THREAD_BINDING", "threadIdx.x")]
    at = loops.index((steps, "SERIAL", ""))
    assert loops[at + 1] == (4, "UNROLLED", "")
    # then each row's sums shuffled across the lanes (the rows' loop around the lanes, unrolled by nvcc)
    assert loops[-2:] == [(4, "UNROLLED", ""), (WARP, "THREAD_BINDING", "threadIdx.x")]


def test_one_after_the_other_stays_the_default():
    weight, vector, product = _gemv()
    _, schedule = schedule_stage(te.create_prim_func([weight, vector, product]), True, 256, per_warp=4)
    assert schedule.rows_together == 1


def test_a_gemv_shares_its_vector_along_its_rows_and_a_row_sum_does_not():
    _, _, product = _gemv()
    assert shares_loads_along_rows(product)
    a, b = te.placeholder((64, 32), name="a"), te.placeholder((32, 64), name="b")
    k = te.reduce_axis((0, 32), "k")
    # a matmul's columns share its first operand's row
    assert shares_loads_along_rows(te.compute((64, 64), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k)))
    row = te.reduce_axis((0, 32), "row")
    sums = te.compute((64,), lambda i: te.sum(a[i, row], axis=row))
    assert not shares_loads_along_rows(sums)  # every load is indexed by the row
    both = te.compute((64, 2), lambda i, s: te.sum(a[i, row] * a[i, row], axis=row))
    assert not shares_loads_along_rows(both)  # the last axis indexes none


@pytest.fixture(scope="module")
def paper_lstm_stages():
    """Paper LSTM's staged program at fp16 on the H100 model, and its gate product."""
    staged = run_passes(models.build("lstm", "paper"), "cuda", stop="stage", device="h100", precision="fp16").ir
    (gates,) = [s for s in staged.stages() if s.schedule.template == "warp_reduce" and "state_next" in s.name]
    return staged, gates


def test_paper_lstm_s_gate_product_takes_four_rows_a_warp_and_stages_its_vector(paper_lstm_stages):
    """Alone, its candidates tie, bound by the weight's DRAM bytes (the program keeps the weight
    on chip): the tie goes to the one with least else to do with the weight on chip, 4 rows a
    warp and the vector copied into shared memory once a tile."""
    _, gates = paper_lstm_stages
    assert (gates.schedule.rows_together, gates.schedule.n_tiles, gates.schedule.staged_vector) == (4, 320, True)
    h100 = get_device("h100")
    alone = latency.stage_estimate(gates, h100)
    assert alone.bound == "dram"
    unstaged = dataclasses.replace(gates, schedule=dataclasses.replace(gates.schedule, staged_vector=False))
    assert alone.seconds == latency.stage_estimate(unstaged, h100).seconds
    on_chip = [sum(latency.stage_estimate(s, h100, matrix_on_chip=True).times.values()) for s in (gates, unstaged)]
    assert on_chip[0] < on_chip[1]


def test_the_model_counts_a_shared_load_once_for_the_rows_together(paper_lstm_stages):
    _, gates = paper_lstm_stages
    unstaged = dataclasses.replace(gates, schedule=dataclasses.replace(gates.schedule, staged_vector=False))
    one_row = dataclasses.replace(unstaged, schedule=dataclasses.replace(unstaged.schedule, rows_together=1))
    dram = latency.Dram.counted(latency.stage_traffic(gates))
    staged, together, apart = (latency._stage_work(stage, 1, 528, 4, dram) for stage in (gates, unstaged, one_row))

    def per_tile(work, tensor, kind="load", space="global"):
        return sum(a.per_tile for a in work.accesses if a.tensor == tensor and a.kind == kind and a.space == space)

    # 32 gates a tile, 512 terms: 16 steps a lane; the weight per row, the inputs once per 4 rows,
    # or, staged, copied once a tile (512 terms, 16 loads of a warp) and read from shared memory
    assert per_tile(apart, "weight_in") == per_tile(together, "weight_in") == per_tile(staged, "weight_in") == 32 * 16
    assert per_tile(apart, "x_s_in") == 32 * 16 and per_tile(together, "x_s_in") == 8 * 16
    assert per_tile(staged, "x_s_in") == 16
    vector = "T_batch_matmul_NT_vector"
    assert (per_tile(staged, vector, "store", "shared"), per_tile(staged, vector, "load", "shared")) == (16, 8 * 16)
    assert together.memory_steps < apart.memory_steps
    # the copy is one trip to memory and one block barrier more
    assert (staged.memory_steps, staged.block_barriers) == (together.memory_steps + 1, together.block_barriers + 1)


def test_the_staged_vector_is_copied_by_the_block_before_a_barrier_then_read(paper_lstm_stages):
    _, gates = paper_lstm_stages
    lines = [line.strip() for line in gates.func.script().splitlines()]
    assert 'T_batch_matmul_NT_gathered0_shared = T.sblock_alloc_buffer((10, 512), "float16", scope="shared")' in lines
    copy = lines.index('with T.sblock("T_batch_matmul_NT_gathered0"):')
    read = lines.index('with T.sblock("T_batch_matmul_NT_rf_update"):')
    syncs = [i for i, line in enumerate(lines) if line == 'T.tvm_storage_sync("shared")']
    assert len(syncs) == 3 and copy < syncs[0] < read < syncs[1]
    # what a tile keeps in shared memory: its layer's 512 inputs and its 32 results
    assert gates.schedule.shared_bytes == 512 * 2 + 32 * 4


def test_the_validator_refuses_the_staged_vector_without_its_barrier():
    """The kernel of the LSTM below at fp16 with each of its ``__syncthreads`` dropped in turn: the
    one after the copy guards the vector, the one after the reduction the results; the one after
    the epilogue orders nothing the copy's does not (the next tile's copy writes the vector, which
    the epilogue does not read, and its barrier comes before the next results)."""
    plan = run_passes(models.build("lstm", json.loads(EMULATED_LSTM)), "cuda", stop="kernel_plan", device="h100",
                      precision="fp16").ir
    ((name, func),) = device_functions(device_module(plan.funcs, "sm_90")).items()
    kernel = mutants.Kernel("lstm fp16", name, func, plan.host_loop_trips(), plan.min_grids().get(name, 1),
                            plan.staged.threads)
    assert mutants.validate(kernel, None).violations == ()
    refused = [" ".join(mutants.validate(kernel, make()).violations) for _, make in mutants.sites(kernel)["drop_syncthreads"]]
    raced = [{buffer for buffer in ("T_batch_matmul_NT_gathered0_shared[", "T_batch_matmul_NT_shared[") if buffer in text}
             for text in refused]
    assert raced[-3:] == [{"T_batch_matmul_NT_gathered0_shared["}, {"T_batch_matmul_NT_shared["}, set()]


EMULATED_LSTM = '{"input_size": 256, "hidden_size": 256, "num_layers": 3, "steps": 3}'


@pytest.mark.parametrize("precision, rows", [("fp16", 2), ("fp32", 1)])
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_lstm_with_rows_together_matches_torch_on_emulated_threads(precision, rows, order, capsys):
    """3 layers of 256 over 3 steps (384 tiles of 8 gates alone): on the H100 model (the CLI's
    default) the gate product takes 2 rows a warp at fp16, its vector staged in shared memory; at
    fp32 its weights are not 16-bit and it keeps one."""
    config = EMULATED_LSTM
    staged = run_passes(models.build("lstm", json.loads(config)), "cuda", stop="stage", device="h100",
                        precision=precision).ir
    assert [(s.schedule.rows_together, s.schedule.staged_vector) for s in staged.stages()
            if s.schedule.template == "warp_reduce"] == [(rows, rows > 1)]
    assert main(["compile", "lstm", "--config", config, "--target", "cuda-emulated", "--precision", precision,
                 "--check", "--thread-order", order]) == 0
    assert "check          PASS" in capsys.readouterr().out
