"""A GEMV-shaped warp_reduce stage with each warp's rows reduced together (``codegen.schedule``'s
``_reduce_rows_together``, TVM's ``rfactor`` as dlight's GEMV rule uses it): each lane keeps one
sum per row, the vector's element is loaded once for all of them, and the latency model counts it
so. Checked: the loops as scheduled, the model's counts, which candidate the model takes (paper
LSTM's gate product at fp16: 4 rows a warp, 320 tiles, where 1280 took three rounds of the grid),
and an LSTM whose gate product takes 2 rows a warp at fp16 (1 at fp32) against PyTorch on emulated
threads in both thread orders.
"""

import dataclasses
import json

import pytest
from tvm import te, tirx

from analysis.characterize import shares_loads_along_rows
from analysis.device import get_device
from codegen import latency
from codegen.schedule import WARP, schedule_stage
from souffle import models
from souffle.cli import main
from souffle.compiler import run_passes

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


def test_paper_lstm_s_gate_product_takes_four_rows_a_warp(paper_lstm_stages):
    """Alone, its three candidates tie, bound by the weight's DRAM bytes (the program keeps the
    weight on chip): the tie goes to the one with least else to do."""
    _, gates = paper_lstm_stages
    assert (gates.schedule.rows_together, gates.schedule.n_tiles) == (4, 320)
    h100 = get_device("h100")
    alone = latency.stage_estimate(gates, h100)
    assert alone.bound == "dram"


def test_the_model_counts_a_shared_load_once_for_the_rows_together(paper_lstm_stages):
    _, gates = paper_lstm_stages
    one_row = dataclasses.replace(gates, schedule=dataclasses.replace(gates.schedule, rows_together=1))
    dram = latency.Dram.counted(latency.stage_traffic(gates))
    together, apart = (latency._stage_work(stage, 1, 528, 4, dram) for stage in (gates, one_row))

    def per_tile(work, tensor):
        return sum(a.per_tile for a in work.accesses if a.tensor == tensor and a.kind == "load")

    # 32 gates a tile, 512 terms: 16 steps a lane; the weight per row, the inputs once per 4 rows
    assert per_tile(apart, "weight_in") == per_tile(together, "weight_in") == 32 * 16
    assert per_tile(apart, "x_s_in") == 32 * 16 and per_tile(together, "x_s_in") == 8 * 16
    assert together.memory_steps < apart.memory_steps


@pytest.mark.parametrize("precision, rows", [("fp16", 2), ("fp32", 1)])
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_lstm_with_rows_together_matches_torch_on_emulated_threads(precision, rows, order, capsys):
    """3 layers of 256 over 3 steps (384 tiles of 8 gates alone): on the H200 model the gate
    product takes 2 rows a warp at fp16; at fp32 its weights are not 16-bit and it keeps one."""
    config = '{"input_size": 256, "hidden_size": 256, "num_layers": 3, "steps": 3}'
    staged = run_passes(models.build("lstm", json.loads(config)), "cuda", stop="stage", device="h200",
                        precision=precision).ir
    assert [s.schedule.rows_together for s in staged.stages() if s.schedule.template == "warp_reduce"] == [rows]
    assert main(["compile", "lstm", "--config", config, "--target", "cuda-emulated", "--precision", precision,
                 "--check", "--thread-order", order]) == 0
    assert "check          PASS" in capsys.readouterr().out
