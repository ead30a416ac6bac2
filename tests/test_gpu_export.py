"""What the GPU run needs from this machine: ``benchmarks/gpu_kernels.py export`` writes bundles
that a machine without TVM loads, rebuilds the weights of and runs (here on the emulated
device), with outputs poisoned first so an unwritten element fails the check."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from souffle import models, recipe, tensor
from souffle.runtime.artifact import Launcher
from souffle.runtime.check import Check
from souffle.runtime.emulated import EmulatedDevice

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_kernels.py"

# Run in a fresh interpreter where importing TVM (and ml_dtypes, numpy's bfloat16) fails, as on the
# GPU machine: the bundle loads, its weights are rebuilt from the model's seeded initialisation,
# and it runs on the emulated device, outputs poisoned first.
WITHOUT_TVM = textwrap.dedent("""
    import json, sys
    sys.modules["tvm"] = None
    sys.modules["ml_dtypes"] = None
    from souffle.runtime.artifact import Launcher
    from souffle.runtime.check import Check
    from souffle.runtime.emulated import EmulatedDevice
    check = Check.load(sys.argv[1])
    outputs = Launcher(check.artifact, device=EmulatedDevice(grid=4)).run(check.inputs, poison=True)
    print(json.dumps({"passes": check.passes(outputs), "tvm": any(m.startswith("tvm") for m in sys.modules
                                                                   if sys.modules[m] is not None)}))
""")


def _export(directory: Path, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, str(SCRIPT), "export", str(directory), *args], capture_output=True,
                          text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "kernels" in line]


def _run_without_tvm(bundle: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", WITHOUT_TVM, str(bundle)], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# 21-26 s: with -m slow, as the fresh-clone suite reached 20:59 of its 20 minutes on a slow run (17:26 to
# 17:54 on others); the other bundle tests run a bundle without TVM by default
@pytest.mark.slow
def test_swin_bundle_carries_its_folded_masks_and_runs_without_tvm(tmp_path):
    """Swin's shifted-window masks are constants the importer folded, not weights its seeded
    initialisation makes: the bundle carries them, so the GPU machine needs no import."""
    lines = _export(tmp_path, "--models", "swin", "--configs", "tiny", "--levels", "4")
    bundle = tmp_path / "swin_tiny_O4"
    assert lines == [f"{bundle}: " + lines[0].split(": ", 1)[1]]
    check = Check.load(bundle)
    carried = [w for w in check.artifact.weights if w["recipe"][0] == "const"]
    assert carried, "no constant carried: the masks would need the importer"
    state = models.get("swin").init_weights(models.config("swin", "tiny"), 0)
    assert all(not recipe.sources(w["recipe"]) - set(state) for w in check.artifact.weights)
    graph = models.build("swin", "tiny")
    rebuilt = check.artifact.weight_arrays()
    for w in check.artifact.weights:
        if w["recipe"][0] == "model":
            np.testing.assert_array_equal(rebuilt[w["buffer"]], graph.weights[w["recipe"][1]].reshape(-1))
    assert _run_without_tvm(bundle) == {"passes": True, "tvm": False}


def test_bundles_are_named_by_level_and_precision_and_run_without_tvm(tmp_path):
    lines = _export(tmp_path, "--models", "mmoe", "--configs", "tiny", "--levels", "0", "4",
                    "--precisions", "fp32", "fp16")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["mmoe_tiny_O0", "mmoe_tiny_O0_fp16", "mmoe_tiny_O4", "mmoe_tiny_O4_fp16"]
    assert len(lines) == 4
    assert len(Check.load(tmp_path / "mmoe_tiny_O0").artifact.kernels) > 1  # O0: a kernel per stage
    assert Check.load(tmp_path / "mmoe_tiny_O4_fp16").rtol == models.tolerance("mmoe", "tiny", "fp16")[0]
    for name in ("mmoe_tiny_O0", "mmoe_tiny_O4_fp16"):
        assert _run_without_tvm(tmp_path / name) == {"passes": True, "tvm": False}


def test_a_bf16_bundle_rebuilds_its_bfloat16_weights_without_ml_dtypes(tmp_path, monkeypatch):
    """The GPU machine's Python has no ml_dtypes: the bundle's bfloat16 weights are rebuilt as
    their bits, rounded as ml_dtypes rounds them, and the kernel matches bfloat16 autocast."""
    _export(tmp_path, "--models", "mmoe", "--configs", "tiny", "--levels", "4", "--precisions", "bf16")
    bundle = tmp_path / "mmoe_tiny_O4_bf16"
    check = Check.load(bundle)
    assert check.rtol == models.tolerance("mmoe", "tiny", "bf16")[0]
    narrow = [w["buffer"] for w in check.artifact.weights if w["dtype"] == "bfloat16"]
    assert narrow
    with_ml_dtypes = check.artifact.weight_arrays()
    monkeypatch.setattr(tensor, "ml_dtypes", None)
    as_bits = check.artifact.weight_arrays()
    for name in narrow:
        assert str(with_ml_dtypes[name].dtype) == "bfloat16" and as_bits[name].dtype == np.uint16
        np.testing.assert_array_equal(as_bits[name], with_ml_dtypes[name].view(np.uint16))
    assert _run_without_tvm(bundle) == {"passes": True, "tvm": False}


def test_poisoned_outputs_show_an_unwritten_result(tmp_path):
    """A mutant that launches nothing: with poison its outputs are NaN and the check fails;
    without, the allocation's bytes would decide."""
    _export(tmp_path, "--models", "mmoe", "--configs", "tiny", "--levels", "4")
    check = Check.load(tmp_path / "mmoe_tiny_O4")
    launcher = Launcher(check.artifact, device=EmulatedDevice(grid=2))
    assert check.passes(launcher.run(check.inputs, poison=True))
    buffers, _ = launcher.arguments(check.inputs, poison=True)
    for arena in check.artifact.arenas:
        assert (buffers[arena].bytes[:buffers[arena].nbytes] == 0xFF).all()
    launcher.artifact.launches = []
    outputs = launcher.run(check.inputs, poison=True)
    assert all(np.isnan(output).all() for output in outputs)
    assert not check.passes(outputs)


def test_with_constants_replaces_only_the_named_weights():
    value = np.arange(4, dtype=np.float32).reshape(2, 2)
    nested = recipe.cast(recipe.concat([recipe.model("a"), recipe.take(recipe.model("mask"), [1, 0])], axis=1),
                         "float16")
    carried = recipe.with_constants(nested, {"mask": value})
    assert recipe.sources(carried) == {"a"}
    weights = {"a": np.ones((2, 3), np.float32)}
    np.testing.assert_array_equal(recipe.evaluate(carried, weights),
                                  recipe.evaluate(nested, {**weights, "mask": value}))
    stacked = recipe.add([recipe.stack([recipe.model("mask")]), recipe.pad(recipe.model("b"), [[0, 0]])])
    assert recipe.sources(recipe.with_constants(stacked, {"mask": value})) == {"b"}
    assert recipe.with_constants(recipe.model("a"), {}) == recipe.model("a")


@pytest.mark.slow
def test_every_model_exports_at_every_level_and_loads_without_tvm(tmp_path):
    """Issue 18's first step: every model, tiny config, opt levels 0 to 4, exported as the GPU
    run needs it, and each bundle loads and rebuilds its weights where TVM cannot be imported."""
    lines = _export(tmp_path, "--configs", "tiny", "--levels", "0", "1", "2", "3", "4")
    expected = sorted(f"{name}_tiny_O{level}" for name in models.MODELS for level in range(5))
    assert sorted(p.name for p in tmp_path.iterdir()) == expected
    assert len(lines) == len(expected)
    script = ("import sys; sys.modules['tvm'] = None\n"
              "from souffle.runtime.check import Check\n"
              "for path in sys.argv[1:]:\n"
              "    Check.load(path).artifact.weight_arrays()\n")
    done = subprocess.run([sys.executable, "-c", script, *(str(tmp_path / name) for name in expected)],
                          capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_run_without_a_gpu_makes_each_failure_a_row_and_writes_the_results(tmp_path):
    """The GPU side's harness: a bundle whose process fails (here: no GPU) is a row naming the
    error, not the end of the run; one not started within the budget says so."""
    _export(tmp_path / "bundles", "--models", "mmoe", "--configs", "tiny", "--levels", "0", "4")
    done = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path / "bundles"), "--results",
                           str(tmp_path), "--timeout", "120", "--ncu", "*", "--sanitize", "*", "--jobs", "2"],
                          capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_kernels.json").read_text())["results"]
    assert [r["bundle"] for r in rows] == ["mmoe_tiny_O0", "mmoe_tiny_O4"]
    assert all(r["check"] == "ERROR (exit 1)" and "needs an NVIDIA GPU" in r["error"] for r in rows)
    assert "| mmoe_tiny_O4 | ERROR (exit 1) | - |" in (tmp_path / "gpu_kernels.md").read_text()
    skipped = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path / "bundles"), "--results",
                              str(tmp_path), "--budget", "0"], capture_output=True, text=True, cwd=ROOT, check=False)
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_kernels.json").read_text())["results"]
    assert [r["check"] for r in rows] == ["NOT RUN (time budget)"] * 2
    # --first puts the bundles its globs match ahead; --check-budget stops the checks alone
    first = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path / "bundles"), "--results",
                            str(tmp_path), "--first", "*_O4", "--check-budget", "0", "--budget", "600"],
                           capture_output=True, text=True, cwd=ROOT, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_kernels.json").read_text())["results"]
    assert [(r["bundle"], r["check"]) for r in rows] == [("mmoe_tiny_O4", "NOT RUN (time budget)"),
                                                         ("mmoe_tiny_O0", "NOT RUN (time budget)")]
