"""The global analysis as one pass over a lowered model: rows, summary, JSON, and its figures."""

import json

import pytest

from analysis import analyze
from analysis.characterize import count_flops
from analysis.device import get_device
from souffle import models
from souffle.lower import lower_graph


@pytest.fixture(scope="module")
def lstm_paper():
    return analyze(lower_graph(models.structure("lstm", "paper")), get_device("h200"))


@pytest.mark.parametrize("name", models.MODELS)
def test_every_te_gets_a_row(name):
    program = lower_graph(models.structure(name, "tiny"))
    result = analyze(program, get_device("cpu"))
    summary = result.summary()
    assert summary["tes"] == program.te_count() == len(result.stages)
    assert summary["one_relies_on_one"] + summary["one_relies_on_many"] == summary["tes"]
    assert summary["flops"] == sum(count_flops(s.dependence.stage) * s.trips for s in result.stages)
    assert summary["compute_bound"] + summary["memory_bound"] == summary["tes"]
    rows = json.loads(json.dumps(result.to_json()))["stages"]
    assert [r["name"] for r in rows] == [s.name for s in result.stages]
    assert all(r["bound"] in ("compute", "memory") and r["bytes_written"] > 0 for r in rows)
    table = result.table().splitlines()
    assert len(table) == len(result.stages) + 2  # header, one line per TE, legend


def test_lstm_paper_figures(lstm_paper):
    """10 layers x 100 steps, two 1x256 @ 256x1024 GEMVs per cell; weights re-read every step when unfused."""
    gemv = [s for s in lstm_paper.stages if s.dependence.stage.op.name == "T_matmul_NT"]
    assert sum(s.trips for s in gemv) == 2 * 10 * 100
    assert sum(s.cost.flops * s.trips for s in gemv) == 2 * 10 * 100 * (2 * 256 * 1024)
    weight_bytes = 1024 * 256 * 4
    assert all(s.cost.bytes_read >= weight_bytes for s in gemv)
    assert all(s.cost.bound == "memory" for s in gemv)  # 0.5 FLOP/B against a ridge of ~14 (fp32, H200)
    invariants = {t.tensor: t.iterations for t in lstm_paper.reuse.temporal if t.iterations > 1}
    assert invariants["layers/time/w_ih"] == invariants["layers/time/w_hh"] == 100


def test_row_explains_one_relies_on_many(lstm_paper):
    row = next(s.row() for s in lstm_paper.stages if s.name == "layers/time/dense_2.T_matmul_NT")
    assert row["one_relies_on_one"] is False and row["trips"] == 900
    assert [(i["tensor"], i["role"], i["mapping"], i["fan_in"]) for i in row["inputs"]] == [
        ("layers/time/h", "carry", "many-to-many", 256), ("layers/time/w_hh", "invariant", "many-to-many", 256)]
    assert "256 elements of h" in row["reason"]


def test_summary_text(lstm_paper):
    text = str(lstm_paper)
    assert "lstm on h200: 46 TEs (20014 executed per inference)" in text
    assert "1.05 GFLOP" in text


@pytest.mark.parametrize("name", models.MODELS)
def test_paper_configs_compute_bound_only_where_intensity_is_high(name):
    result = analyze(lower_graph(models.structure(name, "paper")), get_device("h200"))
    ridge = get_device("h200").ridge_point("float32")
    for s in result.stages:
        assert (s.cost.bound == "compute") == (s.cost.flops > 0 and s.cost.intensity >= ridge)


def test_bert_report_lists_the_attention_head_chains():
    result = analyze(lower_graph(models.structure("bert", "tiny")), get_device("h200"))
    summary = result.summary()
    assert summary["data_movement_chains"] == 22 and summary["data_movement_tes"] == 31
    text = str(result)
    assert ("encoder/dense_1 -> encoder/reshape_2 -> encoder/transpose_3: [ax0, ax1, ax2] reads "
            "encoder/dense_1.T_add[ax1, ax0 * 16 + ax2]") in text
    merge_heads = next(c for c in result.to_json()["data_movement_chains"] if c["source"] == "encoder/batch_matmul_13")
    assert merge_heads["tes"] == ["encoder/transpose_14", "encoder/reshape_15", "encoder/dense_16.T_reshape"]
    assert merge_heads["source_indices"] == ["ax1 // 16", "ax0", "ax1 % 16"]


def test_a_graph_and_a_device_name_are_accepted():
    result = analyze(models.structure("mmoe", "tiny"), "a100")
    assert result.device is get_device("a100") and result.summary()["tes"] == 58
    assert analyze(models.structure("mmoe", "tiny")).device.name == "h200"


def test_lower_bound_of_the_paper_lstm(lstm_paper):
    weights = 10 * (2 * 1024 * 256 + 2 * 1024) * 4  # per layer: W_ih, W_hh, b_ih, b_hh
    x, y, h_n, c_n = 100 * 256 * 4, 100 * 256 * 4, 10 * 256 * 4, 10 * 256 * 4
    assert lstm_paper.compulsory_bytes == weights + x + y + h_n + c_n
    h200 = get_device("h200")
    flops = lstm_paper.summary()["flops"]
    assert lstm_paper.lower_bound_s == max(flops / h200.peak("float32"), lstm_paper.compulsory_bytes / h200.mem_bandwidth)
    assert "lower bound 15.7 us" in str(lstm_paper)
