"""benchmarks/latency_vs_gpu.py: the bundle names it reads, how it counts opt levels ordered as
measured, and its least-squares split recovering known per-barrier and per-launch costs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import latency_vs_gpu  # noqa: E402


def _row(bundle: str, measured: float, estimate: float, stages: float = 0.0, barriers: int = 0,
         launches: int = 1) -> dict:
    return {"bundle": bundle, **latency_vs_gpu.bundle_fields(bundle), "measured_ms": measured, "estimate_ms": estimate,
            "parts_ms": {"stages": stages}, "counts": {"grid barriers": barriers, "launches": launches}}


def test_bundle_names_and_devices():
    assert latency_vs_gpu.bundle_fields("bert_paper_O4_fp16") == {"model": "bert", "config": "paper", "level": 4,
                                                                   "precision": "fp16"}
    assert latency_vs_gpu.bundle_fields("lstm_tiny_O0")["precision"] == "fp32"
    assert latency_vs_gpu.bundle_fields("bert_paper_O4_bf16")["precision"] == "bf16"
    with pytest.raises(ValueError, match="not a bundle name"):
        latency_vs_gpu.bundle_fields("lstm_paper_fast")
    assert latency_vs_gpu.device_model("NVIDIA H200") == "h200"
    assert latency_vs_gpu.device_model("NVIDIA H100 80GB HBM3") == "h100"
    with pytest.raises(ValueError, match="no device model for GPU 'NVIDIA L4'"):
        latency_vs_gpu.device_model("NVIDIA L4")


def test_a_pair_of_levels_ordered_the_other_way_is_named():
    rows = [_row("lstm_paper_O3", 1.2, 0.9), _row("lstm_paper_O4", 1.5, 0.7), _row("lstm_paper_O0", 200, 60),
            _row("lstm_tiny_O4", 0.03, 0.02)]  # another config: not compared with the paper's
    order = latency_vs_gpu.order_agreement(rows)
    assert (order["pairs"], order["agree"]) == (3, 2)
    assert order["disagree"] == ["lstm_paper_O3 vs O4: measured 1.200 vs 1.500 ms, estimated 0.900 vs 0.700"]


def test_the_split_recovers_the_costs_the_times_were_made_of():
    """Times made as 2 x stage time + 3 us per barrier + 10 us per launch are split back into them."""
    parts = [(0.5, 100, 1), (2.0, 10, 1), (0.01, 0, 300), (1.0, 300, 1), (0.2, 0, 50)]
    rows = [_row(f"model{'abcde'[k]}_paper_O4", 2 * s + b * 3e-3 + n * 10e-3, 1.0, s, b, n)
            for k, (s, b, n) in enumerate(parts)]
    fit = latency_vs_gpu.fit_parts(rows)
    assert fit["stage_time_factor"] == pytest.approx(2.0)
    assert (fit["grid_barrier_us"], fit["launch_us"]) == (pytest.approx(3.0), pytest.approx(10.0))
    assert fit["fitted_ratio_median"] == pytest.approx(1.0)


def test_a_variant_bundle_is_compiled_and_estimated_with_its_variant():
    """``lstm_tiny_O4+no-on-chip`` is tiny LSTM at O4 without its weights on chip: its estimate
    has no on-chip load and differs from the base's; it forms no opt-level pair with its base."""
    base = latency_vs_gpu.estimate_row({"bundle": "lstm_tiny_O4", "device": "NVIDIA H200", "median_ms": 0.036},
                                       None, stages=True)
    variant = latency_vs_gpu.estimate_row({"bundle": "lstm_tiny_O4+no-on-chip", "device": "NVIDIA H200",
                                           "median_ms": 0.030}, None, stages=True)
    assert (base["variant"], variant["variant"], variant["level"]) == (None, "no-on-chip", 4)

    def loads(row):
        return [s["name"] for s in row["stages"] if s["name"].startswith("on-chip load")]

    assert loads(base) and not loads(variant)
    assert variant["estimate_ms"] != base["estimate_ms"]
    assert latency_vs_gpu.order_agreement([base, variant])["pairs"] == 0


def test_timed_segments_are_set_beside_their_stages_estimates_and_split_into_factor_and_fixed_cost():
    """A segment is matched to its stages by name (a loop's ``@i`` dropped), one naming a stage the
    estimate lacks is left out; segments made as 3 x estimate + 4 us are split back into them."""
    from types import SimpleNamespace

    def stage(name, us, template):
        return SimpleNamespace(seconds=us * 1e-6, work=SimpleNamespace(name=name, template=template))

    estimate = SimpleNamespace(stages=[stage("r0/a", 2.0, "matmul"), stage("r0/b", 1.0, "elementwise"),
                                       stage("r0/c", 10.0, "tensor_core")])
    timed = [{"stages": ["r0/a@0"], "measured_us": 10.0}, {"stages": ["r0/a@1", "r0/b@1"], "measured_us": 13.0},
             {"stages": ["r0/c"], "measured_us": 34.0}, {"stages": ["on-chip load for r0/a"], "measured_us": 5.0},
             {"stages": ["r0/b"], "measured_us": None}]
    rows = latency_vs_gpu.segment_rows(timed, estimate)
    assert [(r["estimate_us"], r["templates"]) for r in rows] == [
        (2.0, ["matmul"]), (3.0, ["elementwise", "matmul"]), (10.0, ["tensor_core"])]
    stats = latency_vs_gpu.segment_summary([{"segments": rows}])
    assert stats["fit"] == {"estimate_factor": pytest.approx(3.0), "fixed_us_per_segment": pytest.approx(4.0)}
    assert stats["by_template"]["matmul"]["median"] == pytest.approx(5.0)  # the mixed segment is no template's
    assert set(stats["by_template"]) == {"matmul", "tensor_core"}
    assert "3.00 x the stages' estimate + 4.00 us per segment" in "\n".join(latency_vs_gpu.segment_table(stats))
