"""The timeline build (codegen.timeline, souffle.runtime.timeline): block 0 stamps the kernel's
start and every grid barrier, the segments between them name their stages and estimates, the
instrumented kernel keeps the base kernel's registers and still computes the model, and a
bundle's timeline files are checked like its kernel's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import souffle
from codegen import timeline
from souffle import models
from souffle.runtime.artifact import ArtifactError
from souffle.runtime.check import Check
from souffle.runtime.cuda import compile_cubin
from souffle.runtime.emulated import EmulatedDevice
from souffle.runtime.timeline import Timeline, measure

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_kernels  # noqa: E402


@pytest.fixture(scope="module")
def bert():
    return souffle.compile(models.build("bert", "tiny"), target="cuda")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    directory = tmp_path_factory.mktemp("timeline")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kernels.py"), "export", str(directory),
                           "--models", "bert", "lstm", "mmoe", "--configs", "tiny", "--levels", "4"],
                          capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return directory


def test_segments_are_the_barriers_executed_plus_one_with_the_models_estimates(bert):
    parts = timeline.segments(bert.plan, bert.latency)
    assert len(parts) == bert.plan.barrier_count(executed=True) + 1 == 16
    stages = [name for part in parts for name in part.stages]
    assert len(stages) == len(set(stages))  # each stage execution in exactly one segment
    launches = bert.latency.launches * bert.latency.device.launch_seconds
    assert sum(p.estimate_seconds for p in parts) == pytest.approx(bert.latency.seconds - launches)


def test_a_loops_stages_are_named_by_iteration():
    model = souffle.compile(models.build("lstm", "tiny"), target="cuda")
    parts = timeline.segments(model.plan, model.latency)
    assert len(parts) == model.plan.barrier_count(executed=True) + 1
    names = [name for part in parts for name in part.stages]
    assert any(name.endswith("@0") for name in names) and any(name.endswith("@1") for name in names)


def test_instrumented_source_stamps_at_the_start_and_after_each_grid_barrier(bert):
    source = timeline.instrument(bert.source, "main_kernel", 17)
    body = source.split("main_kernel(", 2)[2]  # the definition, after the declaration
    assert body.split("{", 1)[1].lstrip().startswith("souffle_stamp();")
    assert "cg::this_grid().sync();\n    souffle_stamp();" in source
    assert source.count("souffle_stamp();") == 2  # the kernel's start, and the grid barrier helper every barrier calls
    # the stamp is not inlined: ptxas allocates the kernel as it does without it
    (resources,) = compile_cubin(source, "sm_90", ("main_kernel",))[1].values()
    assert (resources.registers, resources.spill_bytes) == (bert.resources.registers, bert.resources.spill_bytes)


def test_a_source_it_cannot_instrument_is_refused_with_the_reason(bert):
    with pytest.raises(timeline.TimelineError, match="no grid barrier helper"):
        timeline.instrument("extern \"C\" __global__ void k(int n) {\n}\n", "k", 1)
    with pytest.raises(timeline.TimelineError, match="kernel 'nope'"):
        timeline.instrument(bert.source, "nope", 17)
    several = souffle.compile(models.build("bert", "tiny"), target="cuda", opt_level=2)
    with pytest.raises(timeline.TimelineError, match="more than one kernel"):
        timeline.segments(several.plan, several.latency)


@pytest.mark.parametrize("name, grid", [("bert_tiny_O4", 4), ("lstm_tiny_O4", 24)])
def test_the_timeline_build_runs_on_emulated_threads_and_takes_every_stamp(bundles, name, grid):
    check, built = Check.load(bundles / name), Timeline.load(bundles / name)
    result = measure(check, built, repeat=2, warmup=1, device=EmulatedDevice(grid=grid))
    assert result["passes"] and result["runs"] == 2
    assert [s["segment"] for s in result["segments"]] == list(range(built.stamps))
    assert all("measured_us" in s for s in result["segments"][:-1]) and "measured_us" not in result["segments"][-1]


def test_a_kernel_that_takes_another_count_of_stamps_is_refused(bundles):
    check, built = Check.load(bundles / "bert_tiny_O4"), Timeline.load(bundles / "bert_tiny_O4")
    built.segments = built.segments[:-1]
    with pytest.raises(ArtifactError, match="took 16 stamps, its timeline has 15 segments"):
        measure(check, built, repeat=1, warmup=0, device=EmulatedDevice(grid=4))


def test_timeline_files_are_checked_and_absent_where_there_is_none(bundles):
    static = json.loads((bundles / "mmoe_tiny_O4" / "static.json").read_text())
    assert static["timeline"].startswith("none: the source has no grid barrier helper")
    assert Timeline.load(bundles / "mmoe_tiny_O4") is None
    static = json.loads((bundles / "bert_tiny_O4" / "static.json").read_text())
    assert static["timeline"] == "timeline.json: 16 segments"
    resources = Timeline.load(bundles / "bert_tiny_O4").resources
    assert resources["timeline"] == resources["kernel"] and resources["kernel"]["registers"] > 0
    cubin = bundles / "bert_tiny_O4" / "timeline.sm_90.cubin"
    data = cubin.read_bytes()
    cubin.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    try:
        with pytest.raises(ArtifactError, match="timeline.sm_90.cubin"):
            Timeline.load(bundles / "bert_tiny_O4")
    finally:
        cubin.write_bytes(data)


def test_the_report_lists_the_slowest_segments_beside_their_estimates():
    result = {"passes": True, "runs": 20, "stamped_us": 30.0, "segments": [
        {"segment": 0, "stages": ["a", "b"], "estimate_us": 2.0, "measured_us": 10.0, "cycles": 19800},
        {"segment": 1, "stages": [], "estimate_us": 2.0, "measured_us": 20.0, "cycles": 39600},
        {"segment": 2, "stages": ["c"], "estimate_us": 5.0}]}
    table = gpu_kernels.timeline_table("bert_paper_O4", result)
    assert "3 segments, stamped 30.0 us (estimate 4.0 us for the same segments), outputs PASS" in table
    assert table.index("| 1 | (barrier only) | 20.00 | 2.00 |") < table.index("| 0 | a, b | 10.00 | 2.00 |")
    assert gpu_kernels.timeline_table("x", "failed (exit 1): no GPU") == "x timeline: failed (exit 1): no GPU"
