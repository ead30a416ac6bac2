"""benchmarks/compare.py and benchmarks/baselines.py: every system computes what PyTorch computes,
is timed as specified, and the tables say what was measured."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import baselines  # noqa: E402
import compare  # noqa: E402

from souffle.errors import TargetError  # noqa: E402


def _row(model, system, ms, launches=1, matches=True, **extra):
    return {"model": model, "system": system, "time": {"median_ms": ms}, "matches_pytorch": matches,
            "launches": launches, "launches_how": "counted", "static_bytes": None, "static_bytes_how": "", **extra}


def test_measure_warms_up_then_stops_at_repeat_or_budget():
    calls = []
    timed = compare.measure(lambda inputs: calls.append(inputs), "x", warmup=2, repeat=5, budget_s=60.0)
    assert len(calls) == 7 and timed["runs"] == 5
    assert timed["min_ms"] <= timed["median_ms"] <= timed["max_ms"]

    calls.clear()
    timed = compare.measure(lambda inputs: calls.append(inputs), "x", warmup=1, repeat=50, budget_s=0.0)
    assert timed["runs"] == compare.MIN_RUNS and len(calls) == 1 + compare.MIN_RUNS


def test_speedup_ignores_failed_and_wrong_systems():
    ours = _row("m", "souffle", 2.0)
    assert compare.speedup(ours, _row("m", "pytorch", 5.0)) == 2.5
    assert compare.speedup(ours, _row("m", "pytorch", 5.0, matches=False)) is None
    assert compare.speedup(ours, {"model": "m", "system": "pytorch", "error": "ValueError: x"}) is None


def test_latency_table_has_speedups_and_their_geometric_mean():
    rows = [_row("a", "souffle", 1.0), _row("a", "pytorch", 2.0), _row("b", "souffle", 1.0), _row("b", "pytorch", 8.0),
            {"model": "b", "system": "onnxruntime", "error": "RuntimeError: no"}, _row("a", "onnxruntime", 0.5, matches=False)]
    table = compare.latency_table(rows)
    assert "| a | 1.000 | 2.000 | 0.500 (wrong) |" in table
    assert "| b | 1.000 | 8.000 | failed |" in table
    assert "| a | 2.00x | - |" in table and "| b | 8.00x | - |" in table
    assert "| geometric mean | 4.00x | - |" in table


def test_kernel_table_shows_launches_and_megabytes():
    rows = [_row("a", "souffle", 1.0, launches=1, static_bytes=2_500_000, static_bytes_how="model"),
            _row("a", "pytorch", 2.0, launches=34)]
    table = compare.kernel_table(rows)
    assert "| a | 1 / 2.500 MB | 34 / - |" in table
    assert "souffle: counted, bytes: model" in table


def test_unknown_system_and_wrong_target_are_refused():
    case = baselines.Case.build("mmoe", "tiny")
    with pytest.raises(KeyError, match="unknown system 'nope'"):
        baselines.build("nope", case, baselines.Options())
    with pytest.raises(TargetError, match="does not run on target 'cuda'"):
        baselines.build("pytorch", case, baselines.Options(target="cuda"))


def test_persistent_cpu_runs_only_at_tiny_by_default():
    assert "souffle-persistent-O4" in baselines.default_systems("llvm", "tiny")
    assert "souffle-persistent-O4" not in baselines.default_systems("llvm", "paper")
    assert {"souffle", "tvm-relax", "metaschedule", "pytorch", "torch.compile", "onnxruntime"} <= set(
        baselines.default_systems("llvm", "paper"))


@pytest.mark.parametrize("system", ["souffle", "souffle-persistent-O0", "tvm-relax", "pytorch", "torch.compile",
                                    "onnxruntime"])
def test_every_untuned_system_matches_pytorch_on_tiny_bert(system):
    case = baselines.Case.build("bert", "tiny")
    expected = case.torch_function()(case.inputs)
    built = baselines.build(system, case, baselines.Options())
    outputs = built.run(case.inputs)
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    assert built.launches >= 1 and built.launches_how


def test_launch_counts_separate_one_kernel_from_per_op_systems():
    case = baselines.Case.build("mmoe", "tiny")
    launches = {name: baselines.build(name, case, baselines.Options()).launches
                for name in ("souffle", "souffle-persistent-O4", "souffle-persistent-O0", "tvm-relax", "onnxruntime")}
    assert launches["souffle"] == 1 and launches["souffle-persistent-O4"] == 1
    assert launches["souffle-persistent-O0"] > 10 and launches["tvm-relax"] > 10 and launches["onnxruntime"] > 10


def test_compare_writes_json_table_and_chart(tmp_path):
    done = subprocess.run(
        [sys.executable, "benchmarks/compare.py", "mmoe", "--systems", "souffle", "pytorch", "onnxruntime",
         "--repeat", "3", "--warmup", "1", "--results-dir", str(tmp_path), "--output", "cmp"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    payload = json.loads((tmp_path / "cmp.json").read_text())
    assert payload["command"].startswith("python") and "compare.py mmoe" in payload["command"]
    assert payload["machine"]["cores"] >= 1 and payload["versions"]["onnxruntime"]
    rows = {row["system"]: row for row in payload["results"]}
    assert list(rows) == ["souffle", "pytorch", "onnxruntime"]
    assert all(row["matches_pytorch"] and row["time"]["runs"] == 3 for row in rows.values())
    assert rows["souffle"]["launches"] == 1
    assert (tmp_path / "cmp.png").stat().st_size > 0
    assert "## Latency (Table 3 style)" in (tmp_path / "cmp.md").read_text()

    tables = subprocess.run([sys.executable, "scripts/paper_tables.py", str(tmp_path / "cmp.json")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, check=True).stdout
    assert "| mmoe |" in tables and "Table 5 style" in tables and "geometric mean" in tables
    assert "| mmoe | souffle | " in tables.split("## Compile and tuning time")[1]


@pytest.mark.parametrize(("args", "message"), [
    (["alexnet"], "invalid choice: 'alexnet'"),
    (["mmoe", "--target", "cuda"], "the GPU comparison is not built yet"),
    (["mmoe", "--trials", "0"], "--trials must be at least 1"),
])
def test_compare_refuses_bad_arguments_with_a_reason(args, message):
    done = subprocess.run([sys.executable, "benchmarks/compare.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2 and message in done.stderr


@pytest.mark.slow
def test_metaschedule_tunes_matches_pytorch_and_reuses_its_database(tmp_path):
    case = baselines.Case.build("mmoe", "tiny")
    options = baselines.Options(trials=2, work_dir=tmp_path)
    first = baselines.build("metaschedule", case, options)
    tuning = first.details["tuning"]
    assert tuning["reused"] is False and tuning["budget"] == 2 * tuning["tasks"] and 0 < tuning["trials"] <= tuning["budget"]
    for got, want in zip(first.run(case.inputs), case.torch_function()(case.inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    again = baselines.build("metaschedule", case, options)
    assert again.details["tuning"]["reused"] is True and again.compile_s < first.compile_s
