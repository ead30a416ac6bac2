"""The pass pipelines: each target's passes as declared, the one runner (levels, timing, notes,
dumps, prints), the passes' purity, and the README's copy of the declared pipelines."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import souffle
from codegen.pipelines import CUDA, CUDA_EMULATED, LLVM, LLVM_PERSISTENT, PIPELINES
from souffle import models
from souffle.compiler import run_passes
from souffle.errors import SouffleError
from souffle.graph import GraphBuilder
from souffle.passes import CompileOptions, IRKind, Outcome, Pass, Pipeline

ROOT = Path(__file__).resolve().parents[1]


def _mlp():
    b = GraphBuilder("mlp")
    x = b.input("x", (4, 16))
    w = b.param("w", np.ones((32, 16), "float32") / 16)
    return b.build(b.op("relu", b.op("dense", x, w, name="xw"), name="y"))


def test_every_target_has_one_declared_pipeline():
    assert list(PIPELINES) == ["llvm", "cuda", "llvm-persistent", "cuda-emulated"]
    assert LLVM.names == ["precision", "hoist_scan_projections", "pack_weights", "lower", "stitch", "build"]
    front = ["wavefront", "precision", "horizontal", "scale_past_matmul", "commute_rolls", "split_k", "lower",
             "vertical", "fuse_epilogues", "stage"]
    synchronization = ["kernel_per_stage", "global_sync", "place_barriers", "partition", "keep_weights_on_chip",
                       "plan_arena"]
    # the tiles are aligned for a GPU's latency model only: the CPU runs the stages as they are
    assert CUDA.names == front + ["align_tiles", "keep_occupancy"] + synchronization + ["kernel_plan", "cuda_source",
                                                                       "validate_threads", "nvcc", "co_residency"]
    assert LLVM_PERSISTENT.names == front + synchronization + ["staged_function", "build"]
    assert CUDA_EMULATED.names == CUDA.names + ["emulated_build"]
    levels = {p.name: p.from_level for p in CUDA.passes if p.from_level}
    assert levels == {"wavefront": 1, "horizontal": 1, "scale_past_matmul": 2, "commute_rolls": 2, "split_k": 4, "vertical": 2, "fuse_epilogues": 3, "global_sync": 3,
                      "align_tiles": 4, "partition": 3, "place_barriers": 4, "keep_weights_on_chip": 4}


def _toy(log: list) -> Pipeline:
    """Three passes on integers, recording what ran."""
    def step(name, delta):
        def run(value, options):
            log.append(name)
            return Outcome(value + delta, [f"added {delta}"]) if delta > 1 else value + delta
        return run

    number = IRKind("number", "txt")
    return Pipeline("toy", number, (Pass("one", step("one", 1), number), Pass("two", step("two", 2), number,
                                                                             from_level=2, section="adds"),
                                    Pass("three", step("three", 3), number)), {0: "", 1: "", 2: ""}, 2)


def test_the_runner_applies_the_passes_of_a_level_and_collects_what_they_said():
    log = []
    toy = _toy(log)
    run = toy.run(10, CompileOptions("toy", 2, None, None))
    assert (run.ir, log, run.notes("adds"), run.notes("adds", prefixed=True)) == (16, ["one", "two", "three"],
                                                                                  ["added 2"], ["two: added 2"])
    assert list(run.seconds()) == ["one", "two", "three"] and all(s >= 0 for s in run.seconds().values())
    log.clear()
    assert toy.run(10, CompileOptions("toy", 1, None, None)).ir == 14 and log == ["one", "three"]
    log.clear()
    assert toy.run(10, CompileOptions("toy", 2, None, None), start="two", stop="two").ir == 12 and log == ["two"]


def test_the_runner_dumps_and_prints_the_ir_after_each_pass(tmp_path, capsys):
    toy = _toy([])
    (tmp_path / "02-two.txt").write_text("stale")
    (tmp_path / "notes.md").write_text("the user's")
    toy.run(10, CompileOptions("toy", 1, None, None), dump_dir=tmp_path, print_after=["three"])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00-input.txt", "01-one.txt", "03-three.txt", "notes.md"]  # two does not run at O1
    assert [(tmp_path / f).read_text() for f in files[:3]] == ["10\n", "11\n", "14\n"]
    assert capsys.readouterr().out == "-- IR after three (number) --\n14\n"


@pytest.mark.parametrize("kwargs, message", [
    ({"print_after": ["four"]}, "cannot print after 'four': target 'toy' has no such pass; its passes: one, two, three"),
    ({"print_after": ["two"], "level": 1}, "cannot print after 'two': it runs from opt level 2, and this compile is at O1"),
    ({"start": "zero"}, "target 'toy' has no pass 'zero'"),
    ({"print_after": ["one"], "start": "two"}, "cannot print after 'one': this run applies only the passes from two to three"),
])
def test_the_runner_refuses_names_it_does_not_know(kwargs, message):
    level = kwargs.pop("level", 2)
    with pytest.raises(SouffleError, match=re.escape(message)):
        _toy([]).run(10, CompileOptions("toy", level, None, None), **kwargs)


def test_staged_passes_leave_their_input_unchanged():
    """A pass is a pure function: each staged pass's input keeps its barriers, kernel starts,
    on-chip loads and arena, whatever the pass decided."""
    graph = models.build("lstm", "tiny")
    staged = run_passes(graph, "cuda", stop="stage").ir
    before = (staged.table(), [(s.barrier, s.launch, dict(s.on_chip)) for s in staged.stages()], staged.slot_offsets)
    after = run_passes(staged, "cuda", start="kernel_per_stage", stop="plan_arena")
    assert (staged.table(), [(s.barrier, s.launch, dict(s.on_chip)) for s in staged.stages()],
            staged.slot_offsets) == before
    assert after.ir.barrier_count() and after.ir.on_chip and after.ir.slot_offsets and not staged.slot_offsets


def test_each_level_adds_its_passes_to_the_one_below():
    """The ablation: what the levels' passes decide, on the tiny LSTM."""
    graph = models.build("lstm", "tiny")
    staged = {level: run_passes(graph, "cuda", stop="plan_arena", opt_level=level).ir for level in range(5)}
    assert staged[0].kernel_count() == staged[0].stage_count() and staged[0].barrier_count() == 0
    assert staged[3].kernel_count() == 1 and staged[3].barrier_count() == staged[3].stage_count() - 1
    assert staged[4].kernel_count() == 1 and staged[4].barrier_count() < staged[3].barrier_count()
    assert staged[4].on_chip and not staged[3].on_chip


def test_compile_dumps_one_file_per_pass_in_pipeline_order(tmp_path):
    souffle.compile(_mlp(), target="llvm-persistent", opt_level=2, dump_ir=tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    ran = [p for p in LLVM_PERSISTENT.passes if p.from_level <= 2]
    assert files == ["00-input.graph.txt"] + [LLVM_PERSISTENT.dump_name(p) for p in ran]
    assert "08-vertical.te.txt" in files and "12-global_sync.staged.txt" not in files
    assert (tmp_path / "16-plan_arena.staged.txt").read_text().startswith("staged program mlp: 2 stages")
    assert "define" in (tmp_path / "18-build.ll").read_text()  # LLVM IR


def test_report_compile_times_are_the_passes_times():
    model = souffle.compile(_mlp(), target="llvm")
    assert list(model.report().compile_seconds) == LLVM.names
    assert model.report().compile_seconds == model.passes.seconds()


def test_readme_shows_the_pipelines_as_declared():
    """README's "How it works" holds `souffle passes`, printed from the declared lists."""
    printed = subprocess.run([sys.executable, "-m", "souffle.cli", "passes"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
    assert printed == "\n\n".join(p.describe() for p in PIPELINES.values())
    assert f"```\n$ souffle passes\n{printed}\n```" in (ROOT / "README.md").read_text(), \
        "README.md's pipelines differ from the declared ones: paste the output of `souffle passes`"
