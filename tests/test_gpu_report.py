"""benchmarks/gpu_report.py: how the files a GPU run brings back are merged (which run's figure
wins, which PyTorch modes are taken) and what the speedups are computed from."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_report  # noqa: E402


def _results(path: Path, rows: list[dict], command: str = "python3 x") -> Path:
    path.write_text(json.dumps({"command": command, "machine": {"gpus": ["NVIDIA H200, 580"]},
                                "versions": {"souffle_commit": "abc"}, "timing": "CUDA events", "results": rows}))
    return path


def _kernel(bundle: str, **fields) -> dict:
    return {"bundle": bundle, "check": "PASS", "max_abs_error": 1e-6, "unwritten": 0, "repeatable": True,
            "launches": 1, "grid": 132, "blocks_per_sm": 1, "path": "/tmp/b/k/" + bundle, **fields}


def _torch(bundle: str, mode: str, ms: float, status: str = "ok") -> dict:
    return {"bundle": bundle, "mode": mode, "status": status, "median_ms": ms, "kernels": 100}


def test_the_first_run_keeps_its_figures_and_a_later_one_adds_its_own(tmp_path):
    first = _results(tmp_path / "a.json", [_kernel("bert_paper_O4", median_ms=2.0)])
    later = _results(tmp_path / "b.json", [_kernel("bert_paper_O4", median_ms=9.0, dram_read_mb=172.7)])
    merged = gpu_report.merge_kernels([first, later])
    assert merged["bert_paper_O4"]["median_ms"] == 2.0
    assert merged["bert_paper_O4"]["dram_read_mb"] == 172.7
    assert "path" not in merged["bert_paper_O4"]


def test_a_later_run_fills_what_an_earlier_one_did_not_run(tmp_path):
    cut = "not run (time budget)"
    first = _results(tmp_path / "a.json", [_kernel("swin_tiny_O4_fp16", median_ms=0.245, racecheck=cut, synccheck=cut)])
    later = _results(tmp_path / "b.json", [_kernel("swin_tiny_O4_fp16", median_ms=0.258, racecheck=0, synccheck=0)])
    row = gpu_report.merge_kernels([first, later])["swin_tiny_O4_fp16"]
    assert (row["median_ms"], row["racecheck"], row["synccheck"]) == (0.245, 0, 0)
    skipped = _results(tmp_path / "c.json", [_kernel("swin_tiny_O4_fp16", racecheck=cut)])
    assert gpu_report.merge_kernels([later, skipped])["swin_tiny_O4_fp16"]["racecheck"] == 0


def test_torch_rows_are_restricted_to_the_named_modes_and_failures_left_out(tmp_path):
    run1 = _results(tmp_path / "t1.json", [_torch("bert_paper_O4", "eager", 6.0),
                                            _torch("bert_paper_O4", "compile", 1.0),  # not trusted: left out
                                            _torch("bert_paper_O4", "cuda-graph", 9.0, status="failed: x")])
    run2 = _results(tmp_path / "t2.json", [_torch("bert_paper_O4", "reduce-overhead", 3.0)])
    merged = gpu_report.merge_torch([f"{run1}:eager,cuda-graph", str(run2)])
    assert sorted(merged) == [("bert_paper_O4", "eager"), ("bert_paper_O4", "reduce-overhead")]


def test_speedup_is_over_the_fastest_pytorch_mode_measured():
    kernels = {"bert_paper_O4_fp16": _kernel("bert_paper_O4_fp16", median_ms=2.0),
               "bert_paper_O3": _kernel("bert_paper_O3", median_ms=5.0)}
    torch = {("bert_paper_O4_fp16", "eager"): _torch("bert_paper_O4_fp16", "eager", 6.0),
             ("bert_paper_O4_fp16", "reduce-overhead"): _torch("bert_paper_O4_fp16", "reduce-overhead", 1.0),
             ("bert_paper_O3", "eager"): _torch("bert_paper_O3", "eager", 6.0)}
    (row,) = gpu_report.comparison_rows(kernels, torch)  # O3 is not compared: PyTorch runs the model, not a level
    assert (row["model"], row["precision"], row["best_pytorch"]) == ("bert", "fp16", "reduce-overhead")
    assert row["speedup_over_best"] == pytest.approx(0.5)
    table = gpu_report.comparison_table([row])
    assert "| 2.000 (1) | - | - | 6.000 (100) | not measured |" in table and "0.50x (reduce-overhead)" in table


def test_the_report_sets_estimate_and_counted_bytes_beside_the_measurements(tmp_path):
    bundle = tmp_path / "bundles" / "mmoe_paper_O4"
    bundle.mkdir(parents=True)
    (bundle / "static.json").write_text(json.dumps({"device": "h200", "estimate_ms": 0.007, "read_bytes": 60848,
                                                    "write_bytes": 992, "compulsory_bytes": 59744}))
    kernels = _results(tmp_path / "k.json", [_kernel("mmoe_paper_O4", median_ms=0.025, dram_read_mb=0.11,
                                                     dram_write_mb=0.0),
                                             _kernel("mmoe_paper_O0", median_ms=1.0, launches=108)])
    torch = _results(tmp_path / "t.json", [_torch("mmoe_paper_O4", "cuda-graph", 0.078)])
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_report.py"), "gpu_test",
                           "--bundles", str(tmp_path / "bundles"), "--kernels", str(kernels), "--torch", str(torch),
                           "--results", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    md = (tmp_path / "gpu_test.md").read_text()
    assert "| mmoe_paper_O4 | 0.11 | - | 0.06 | 0.00 | - | 0.00 | 0.06 |" in md
    assert "| mmoe | paper | fp32 | 1.000 (108; -) | not run | not run | not run | 0.025 (1; 0.007) |" in md
    assert "3.12x (cuda-graph)" in md
    payload = json.loads((tmp_path / "gpu_test.json").read_text())
    assert payload["static"]["mmoe_paper_O4"]["read_bytes"] == 60848


def test_a_variant_is_set_beside_its_base_with_its_question():
    """A compiler variant's bundle (benchmarks/gpu_variants.py) against its base: both times,
    the variant's speedup, and what timing it asks; a variant whose base did not run says so."""
    from gpu_variants import VARIANTS

    kernels = {"lstm_paper_O4": _kernel("lstm_paper_O4", median_ms=1.5),
               "lstm_paper_O4+no-on-chip": _kernel("lstm_paper_O4+no-on-chip", median_ms=1.0, grid=792,
                                                   blocks_per_sm=6),
               "bert_paper_O4_fp16+two-blocks": _kernel("bert_paper_O4_fp16+two-blocks", median_ms=1.8)}
    table = gpu_report.variants_table(kernels, {"lstm_paper_O4+no-on-chip": {"estimate_ms": 0.7}})
    assert f"- no-on-chip: {VARIANTS['no-on-chip'].question}" in table
    assert "| lstm_paper_O4 | no-on-chip | PASS | 1.500 (132, 1) | 1.000 (792, 6) | 1.50x | - | 0.700 |" in table
    assert "| bert_paper_O4_fp16 | two-blocks | PASS | not run | 1.800 (132, 1) | - | - | - |" in table
    assert gpu_report.variants_table({"lstm_paper_O4": kernels["lstm_paper_O4"]}, {}) == "No variant was run."


def test_a_failed_check_row_says_how_many_elements_miss_the_tolerance_and_by_how_much():
    import types

    import numpy as np
    import gpu_kernels
    from souffle.runtime.check import Check

    expected = np.array([1.0, 2.0, -4.0], dtype=np.float32)
    artifact = types.SimpleNamespace(model="bert", config="paper", kernels=[object()], launches=[], threads=256)
    check = Check(artifact, [], [expected], rtol=0.05, atol=0.05)
    got = np.array([1.0, 2.2, -4.0], dtype=np.float32)  # 0.2 off where 0.15 is allowed
    launcher = types.SimpleNamespace(device=types.SimpleNamespace(name="NVIDIA H100", arch="sm_90"), grid=132,
                                     blocks_per_sm=1, run=lambda inputs, poison, graph=False: [got.copy()],
                                     benchmark=lambda inputs, repeat, warmup, graph=False: [1e-3] * repeat)
    row = gpu_kernels._checked(Path("bert_paper_O4_bf16"), check, launcher, repeat=3, warmup=1)
    assert (row["check"], row["outside_tolerance"], row["repeatable"]) == ("FAIL", 1, True)
    assert (row["graph"], row["graph_median_ms"]) == ("same outputs", pytest.approx(1.0))
    assert row["worst_excess"] == pytest.approx(0.05, abs=1e-6)
    assert "FAIL (0.2); 1 outside rtol/atol 0.05/0.05 by up to 0.05 |" in gpu_kernels.kernels_table([row])


def test_pytorchs_float32_rows_run_ieee_float32_and_its_tf32_rows_tf32():
    """cuDNN runs float32 convolutions in TF32 by default; the baselines turn that off, so that
    PyTorch's fp32 rows do Souffle's fp32 arithmetic, and on for the tf32 rows (in a process of its
    own: the flags are global)."""
    flags = "print(torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision)"
    probe = (f"import gpu_torch, torch; print(gpu_torch.float32_arithmetic('fp32')); {flags}; "
             f"print(gpu_torch.float32_arithmetic('tf32')); {flags}; gpu_torch.float32_arithmetic('fp16'); {flags}")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT / "benchmarks", capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["ieee (TF32 off for matmuls and cuDNN convolutions)", "ieee ieee",
                   "tf32 (TF32 on for matmuls and cuDNN convolutions)", "tf32 tf32", "ieee ieee"]
