"""scripts/profile_kernels.py and scripts/profile_dram.py, run as a user runs them."""

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import souffle
from codegen.traffic import memory_traffic
from souffle import models
from souffle.runtime.cuda import gpu_available

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, f"scripts/{name}.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def _table(out: str) -> list[dict]:
    """The rows of the markdown table a script prints, keyed by column header."""
    lines = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines() if line.startswith("|")]
    header, rows = lines[0], lines[2:]
    return [dict(zip(header, row)) for row in rows]


def test_profile_kernels_counts_one_kernel_per_target(tmp_path):
    path = tmp_path / "kernels.json"
    done = _script("profile_kernels", "mmoe", "--config", "tiny", "--targets", "llvm,cuda", "--json", str(path))
    rows = _table(done.stdout)
    assert [(r["model"], r["target"]) for r in rows] == [("mmoe", "llvm"), ("mmoe", "cuda")]
    assert all(r["kernels per inference"] == "1" for r in rows)
    assert rows[0]["stages executed"] == "-" and int(rows[1]["stages executed"]) > 0
    record = json.loads(path.read_text())
    assert record["command"].endswith("scripts/profile_kernels.py mmoe --config tiny --targets llvm,cuda --json " + str(path))
    assert {"machine", "versions"} <= record.keys() and record["versions"]["nvcc"]
    assert [r["kernels"] for r in record["results"]] == [1, 1]


def test_profile_dram_prints_memory_traffic_of_the_cuda_build(tmp_path):
    path = tmp_path / "dram.json"
    done = _script("profile_dram", "mmoe", "--config", "tiny", "--json", str(path))
    (row,) = _table(done.stdout)
    (result,) = json.loads(path.read_text())["results"]
    traffic = memory_traffic(souffle.compile(models.build("mmoe", "tiny"), "cuda").plan)
    assert (result["read_bytes"], result["write_bytes"], result["compulsory_bytes"]) == \
        (traffic.read_bytes, traffic.write_bytes, traffic.compulsory_bytes)
    assert [round(float(row[k]) * 1e6) for k in ("read MB (static)", "write MB (static)", "compulsory MB")] == \
        [traffic.read_bytes, traffic.write_bytes, traffic.compulsory_bytes]
    assert int(row["stages executed"]) == traffic.stages_executed


@pytest.mark.skipif(gpu_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("script", ["profile_kernels", "profile_dram"])
def test_ncu_without_a_gpu_is_refused(script):
    done = _script(script, "mmoe", "--ncu", check=False)
    assert done.returncode != 0
    assert "--ncu needs an NVIDIA GPU" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("argv, message", [
    (["gpt5"], "unknown model 'gpt5'; available: lstm, bert, resnext, mmoe"),
    (["mmoe", "--targets", "llvm,tpu"], "unknown target 'tpu'"),
    (["mmoe", "--targets", "llvm", "--ncu"], "--ncu measures the cuda build"),
])
def test_bad_arguments_are_usage_errors(argv, message):
    done = _script("profile_kernels", *argv, check=False)
    assert done.returncode == 2 and message in done.stderr


def test_ncu_csv_is_grouped_per_launch():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        parse = importlib.import_module("souffle.runtime.ncu").parse_ncu_csv
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    header = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Section Name",' \
             '"Metric Name","Metric Unit","Metric Value"'

    def row(launch, metric, value):
        return f'"{launch}","7","python","h","main_kernel","1","7","Command line profiler metrics","{metric}","byte","{value}"'

    log = "\n".join(["==PROF== Connected to process 7 (python)", header,
                     row(0, "dram__bytes_read.sum", "1,234,560"), row(0, "dram__bytes_write.sum", "512"),
                     row(1, "dram__bytes_read.sum", "8"), row(1, "dram__bytes_write.sum", "0"),
                     "==PROF== Disconnected from process 7"])
    assert parse(log) == [
        {"kernel": "main_kernel", "dram__bytes_read.sum": 1234560.0, "dram__bytes_write.sum": 512.0},
        {"kernel": "main_kernel", "dram__bytes_read.sum": 8.0, "dram__bytes_write.sum": 0.0},
    ]


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("ncu") is None, reason="needs Nsight Compute's ncu")
def test_ncu_sees_one_launch_and_dram_traffic():
    (row,) = _table(_script("profile_kernels", "mmoe", "--targets", "cuda", "--ncu").stdout)
    assert row["launches (ncu)"] == "1" and float(row["GPU time ms (ncu)"]) > 0
    (row,) = _table(_script("profile_dram", "mmoe", "--ncu").stdout)
    assert row["launches (ncu)"] == "1" and float(row["DRAM read MB (ncu)"]) > 0


def test_ablation_writes_every_level_with_its_counts(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    ablation = importlib.import_module("ablation")
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    assert ablation.main(["mmoe", "--levels", "0,2,4", "--repeat", "1", "--name", "ablation_test"]) == 0
    rows = json.loads((tmp_path / "ablation_test.json").read_text())["results"]
    assert [(r["level"], r["kernels"], r["launches"], r["matches_pytorch"]) for r in rows] == [
        ("O0", 58, 58, True), ("O2", 12, 12, True), ("O4", 1, 1, True)]
    moved = [r["read_bytes"] + r["write_bytes"] for r in rows]
    assert moved == sorted(moved, reverse=True) and moved[-1] < moved[0]
    assert "| mmoe | fp32 | O4 | 1 | 1 |" in (tmp_path / "ablation_test.md").read_text()
    # the latency model's estimate beside the roofline bound, on the h100 model by default; O0 pays 58 launches
    assert all(r["estimate_device"] == "h100" and r["estimate_ms"] > r["roofline_ms"] > 0 for r in rows)
    assert rows[0]["estimate_launches_ms"] == pytest.approx(58 * 3e-3) and rows[-1]["estimate_ms"] < rows[0]["estimate_ms"]
    assert [r["estimate_launches"] for r in rows] == [58, 12, 1]  # the cuda program's, which the estimate is of
    header = (tmp_path / "ablation_test.md").read_text().split("| model |")[1].splitlines()[0]
    # GPU ms: empty until measured
    assert header.endswith("| launches (cuda) | grid barriers (cuda) | roofline ms (h100) | estimate ms (h100) "
                           "| GPU ms |")
    assert [r["estimate_grid_barriers"] for r in rows] == [0, 0, rows[-1]["barriers_executed"]]


def test_ablation_estimates_on_another_device_without_running(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    ablation = importlib.import_module("ablation")
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    assert ablation.main(["mmoe", "--levels", "4", "--no-run", "--device", "a100", "--name", "ablation_a100"]) == 0
    (row,) = json.loads((tmp_path / "ablation_a100.json").read_text())["results"]
    assert row["estimate_device"] == "a100" and "cpu_ms" not in row and "gpu_ms" not in row
    assert row["estimate"]["latency model"].startswith("a100: ")


def test_ablation_at_fp16_checks_against_autocast_and_names_its_results_so(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    ablation = importlib.import_module("ablation")
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    assert ablation.main(["mmoe", "--levels", "4", "--repeat", "1", "--precision", "fp16"]) == 0
    (row,) = json.loads((tmp_path / "ablation_tiny_fp16.json").read_text())["results"]
    assert (row["precision"], row["level"], row["matches_pytorch"]) == ("fp16", "O4", True)
