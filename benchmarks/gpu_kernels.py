"""Correctness and latency of the persistent CUDA kernels on a GPU, in two steps.

A lent GPU machine has no TVM (its wheel does not fit the transfer), so the kernels are built
here and run there (``scripts/gpu_run.sh`` does the whole GPU side):

    python benchmarks/gpu_kernels.py export DIR [--models ...] [--configs tiny paper] [--levels 0 4]
                                                [--precisions fp32 fp16 bf16]
    python benchmarks/gpu_kernels.py run DIR [--repeat 100] [--warmup 10] [--sanitize GLOB] [--ncu GLOB]   # on the GPU

``export`` compiles each model for target cuda at each opt level (default the compiler's, O4)
and precision, and writes one bundle per combination (``bert_paper_O4``, ``bert_paper_O4_fp16``;
with ``--variant NAME``, a variant of the compiler from ``gpu_variants``: ``bert_paper_O4+NAME``):
the kernel artifact (cubins for sm_80 and the device model's arch, the source, the call, the
weight recipes), seeded inputs, PyTorch's outputs at that precision and ``static.json``.
``run`` needs only numpy and cuda-python (torch where a model's seeded weights need it): each
bundle runs in its own process (``check``: outputs and scratch poisoned with NaN, compared with
PyTorch's, run twice for repeatability, ``repeat`` inferences timed with CUDA events after
``warmup``), so a hang or a crash is one bundle's row. Then compute-sanitizer (racecheck,
synccheck) and Nsight Compute (launches, DRAM bytes read and written, caches flushed) run one
inference of the bundles their globs select. Results go to ``--results`` (default
benchmarks/results) as gpu_kernels.{json,md}, rewritten after every row.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import fnmatch
import json
import os
import re
import statistics
import subprocess
import tempfile
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
from gpu_variants import SEPARATOR, VARIANTS, applied

from souffle import models
from souffle.errors import TargetError
from souffle.precision import DEFAULT_PRECISION, PRECISIONS
from souffle.runtime.artifact import Launcher
from souffle.runtime.check import Check


def bundle_name(name: str, config: str, level: int | None, precision: str, variant: str | None = None) -> str:
    """``bert_tiny_O4`` (fp32), ``bert_paper_O4_fp16``, ``lstm_paper_O4+no-on-chip`` (a
    ``gpu_variants`` variant); no level: the compiler's default."""
    return (f"{name}_{config}" + ("" if level is None else f"_O{level}")
            + ("" if precision == "fp32" else f"_{precision}") + ("" if variant is None else f"{SEPARATOR}{variant}"))


def export_all(directory: Path, names: list[str], configs: list[str], levels: list[int] | None,
               precisions: list[str], variant: str | None = None) -> None:
    from souffle.compiler import export_check  # the compiler: on the exporting machine only

    for config in configs:
        for name in names:
            for precision in precisions:
                for level in levels or [None]:
                    target = directory / bundle_name(name, config, level, precision, variant)
                    started = time.perf_counter()
                    with applied(variant) if variant else contextlib.nullcontext():
                        model = export_check(name, config, target, opt_level=level, precision=precision)
                    print(f"{target}: {model.kernel_count} kernels, {model.plan.stage_count()} stages, "
                          f"{model.plan.barrier_count()} barriers ({time.perf_counter() - started:.0f} s)", flush=True)


NCU_METRICS = ["dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum"]
SANITIZER_TOOLS = ("racecheck", "synccheck")


def once(target: Path) -> None:
    """Exactly one inference and nothing else on the GPU: the process ncu and compute-sanitizer watch."""
    check = Check.load(target)
    Launcher(check.artifact).run(check.inputs, poison=True)


def check_bundle(target: Path, repeat: int, warmup: int, lock: Path | None = None) -> dict:
    """One bundle on this GPU: outputs (poisoned first) against PyTorch's, then ``repeat`` timed
    inferences; the row ``run`` collects. With ``lock``, the GPU work waits for an exclusive lock
    on that file, so bundles can load and rebuild their weights side by side while one at a time
    uses the GPU (and its times are its own)."""
    from souffle.runtime.cuda import Device

    check = Check.load(target)
    artifact = check.artifact
    weights = artifact.weight_arrays()
    with _exclusive(lock):
        device = Device()
        launcher = Launcher(artifact, device=device, weight_arrays=weights)
        return _checked(target, check, launcher, repeat, warmup)


@contextlib.contextmanager
def _exclusive(lock: Path | None):
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _checked(target: Path, check: Check, launcher: Launcher, repeat: int, warmup: int) -> dict:
    artifact, device = check.artifact, launcher.device
    outputs = launcher.run(check.inputs, poison=True)
    errors, ok = check.errors(outputs), check.passes(outputs)
    outside, worst_excess = check.outside(outputs)
    unwritten = sum(int(np.isnan(output).sum()) for output in outputs if output.dtype.kind == "f")
    times = [t * 1e3 for t in launcher.benchmark(check.inputs, repeat=repeat, warmup=warmup)]
    again = launcher.run(check.inputs, poison=True)
    graph = _in_a_graph(check, launcher, outputs, repeat, warmup)
    return {"model": artifact.model, "config": artifact.config, "bundle": target.name,
            "device": device.name, "arch": device.arch, "kernels": len(artifact.kernels),
            "launches": sum(1 for _ in _launch_count(artifact.launches)),
            "grid": launcher.grid, "blocks_per_sm": launcher.blocks_per_sm, "threads": artifact.threads,
            "max_abs_error": max(errors), "outside_tolerance": outside, "worst_excess": worst_excess,
            "rtol": check.rtol, "atol": check.atol, "unwritten": unwritten,
            "repeatable": all(np.array_equal(a, b, equal_nan=True) for a, b in zip(outputs, again)),
            "check": "PASS" if ok else "FAIL",
            "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "runs": len(times),
            **graph}


def _in_a_graph(check: Check, launcher: Launcher, outputs: list, repeat: int, warmup: int) -> dict:
    """The inference replayed from a CUDA graph: its outputs (poisoned first) against the direct
    launches' bit for bit, and its times. Timed per call, the direct launches include the host's
    launch overhead, which the GPU waits out between the events: on the H100 about 25 us of a
    one-kernel MMoE's 30 (its segments took 4), and 11 us per launch at O0."""
    try:
        replayed = launcher.run(check.inputs, poison=True, graph=True)
        times = [t * 1e3 for t in launcher.benchmark(check.inputs, repeat=repeat, warmup=warmup, graph=True)]
    except TargetError as err:
        return {"graph": f"not captured: {err}"}
    return {"graph": "same outputs" if all(np.array_equal(a, b, equal_nan=True) for a, b in zip(outputs, replayed))
            else "different outputs", "graph_median_ms": statistics.median(times), "graph_min_ms": min(times)}


def timeline_bundle(target: Path, repeat: int, warmup: int) -> dict:
    """The bundle's timeline build on this GPU (``souffle.runtime.timeline``): each segment's
    time between grid barriers beside the model's estimate."""
    from souffle.runtime.timeline import Timeline, measure

    timeline = Timeline.load(target)
    if timeline is None:
        return {"timeline": "none in the bundle"}
    return measure(Check.load(target), timeline, repeat=repeat, warmup=warmup)


def _launch_count(launches: list):
    """One item per kernel launch of an inference, host loops unrolled."""
    for launch in launches:
        if "loop" in launch:
            for _ in range(launch["trips"]):
                yield from _launch_count(launch["body"])
        else:
            yield launch


def _subprocess(command: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit code, or None when it ran past ``timeout`` seconds and was killed; its output)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    except OSError as e:  # the program is not there (compute-sanitizer on a machine without it)
        return 127, str(e)
    return done.returncode, done.stdout + done.stderr


def _last_json(output: str) -> dict:
    """The last line of a step's output that is a JSON object: torch may warn on stderr after it."""
    return json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("{")))


def _tail(text: str, lines: int = 6) -> str:
    return " / ".join(text.strip().splitlines()[-lines:])


def sanitize(target: Path, tool: str, timeout: float) -> dict:
    """compute-sanitizer ``tool`` on one inference of the bundle: its hazard or error count."""
    code, out = _subprocess(["compute-sanitizer", "--tool", tool, "--error-exitcode", "3",
                             sys.executable, __file__, "once", str(target)], timeout)
    if code is None:
        return {f"{tool}": f"timeout after {timeout:.0f} s"}
    summary = re.findall(r"(?:ERROR|RACECHECK|SYNCCHECK) SUMMARY: (\d+) (?:error|hazard)", out)
    counted = sum(int(n) for n in summary)
    if code not in (0, 3) or not summary:
        return {tool: f"did not run (exit {code}): {_tail(out)}"}
    return {tool: counted, **({f"{tool}_log": _tail(out, 12)} if counted else {})}


def prioritized(targets: list[Path], first: list[str]) -> list[Path]:
    """``targets`` with those whose names match the globs of ``first`` ahead, in the globs' order."""
    rank = {t: next((k for k, glob in enumerate(first) if fnmatch.fnmatch(t.name, glob)), len(first)) for t in targets}
    return sorted(targets, key=lambda t: rank[t])


def run(directory: Path, repeat: int, warmup: int, ncu: str | None, sanitize_glob: str | None,
        timeout: float, results: Path | None, budget_s: float, timeline_glob: str | None = None,
        jobs: int = 1, first: list[str] = (), check_budget_s: float | None = None) -> None:
    """Every bundle in ``directory``, each in its own process (a hang or a crash is that bundle's
    row, not the end of the run); then the timelines, compute-sanitizer and ncu, on the bundles
    their globs select. Nothing starts after ``budget_s`` seconds, no check after
    ``check_budget_s`` (so that the timelines and profilers get the rest); the rows say what was
    not run. Bundles matching the globs of ``first`` are checked first, in their order.
    ``jobs`` bundles are checked at once, their GPU work one at a time (``check_bundle``'s lock):
    a paper model's weights take seconds to rebuild on the CPU, its checks a fraction of that."""
    from souffle.runtime.ncu import profile_launches, require_ncu

    ncu_path = None
    if ncu:
        try:
            ncu_path = require_ncu()
        except TargetError as e:  # the checks and times still run; the rows say why ncu did not
            print(e, flush=True)
            ncu_missing = str(e)
    deadline = time.monotonic() + budget_s
    checks_deadline = min(deadline, time.monotonic() + (budget_s if check_budget_s is None else check_budget_s))
    rows = []

    def save():  # after every row: a run stopped at its time limit keeps what it measured
        common.write("gpu_kernels", {"command": common.command(), "results": rows}, kernels_table(rows), results)

    lock = Path(tempfile.mkdtemp()) / "gpu.lock"

    def check(target: Path) -> dict:
        if time.monotonic() > checks_deadline:
            return {"bundle": target.name, "check": "NOT RUN (time budget)", "path": str(target)}
        code, out = _subprocess([sys.executable, __file__, "check", str(target), "--repeat", str(repeat),
                                 "--warmup", str(warmup), "--lock", str(lock)], timeout)
        if code == 0:
            return {**_last_json(out), "path": str(target)}
        return {"bundle": target.name, "path": str(target), "error": _tail(out),
                "check": "HANG (killed after %d s)" % timeout if code is None else f"ERROR (exit {code})"}

    targets = prioritized(sorted(p for p in directory.iterdir() if (p / "manifest.json").exists()), first)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for row in pool.map(check, targets):  # in order; up to ``jobs`` processes prepare at once
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()
    ran = [r for r in rows if "device" in r]
    for row in (r for r in ran if timeline_glob and fnmatch.fnmatch(r["bundle"], timeline_glob)):
        if time.monotonic() > deadline:
            row["timeline"] = "not run (time budget)"
            continue
        code, out = _subprocess([sys.executable, __file__, "timeline", row["path"], "--repeat", "20",
                                 "--warmup", "3"], timeout)
        row["timeline"] = _last_json(out) if code == 0 else f"failed (exit {code}): {_tail(out)}"
        save()
    for row in (r for r in ran if sanitize_glob and fnmatch.fnmatch(r["bundle"], sanitize_glob)):
        for tool in SANITIZER_TOOLS:
            row.update(sanitize(Path(row["path"]), tool, timeout) if time.monotonic() < deadline
                       else {tool: "not run (time budget)"})
        print(row["bundle"], {t: row[t] for t in SANITIZER_TOOLS}, flush=True)
        save()
    for row in (r for r in ran if ncu and fnmatch.fnmatch(r["bundle"], ncu)):
        if ncu_path is None:
            row["ncu"] = f"not run: {ncu_missing}"
            continue
        if time.monotonic() > deadline:
            row["ncu"] = "not run (time budget)"
            continue
        try:
            launches = profile_launches(ncu_path, [sys.executable, __file__, "once", row["path"]], NCU_METRICS,
                                        row["bundle"])
            row.update({"ncu_launches": len(launches),
                        "dram_read_mb": sum(x["dram__bytes_read.sum"] for x in launches) / 1e6,
                        "dram_write_mb": sum(x["dram__bytes_write.sum"] for x in launches) / 1e6,
                        "ncu_gpu_time_ms": sum(x["gpu__time_duration.sum"] for x in launches) / 1e6})
        except Exception as e:  # a profiler failure is this row's finding, not the run's end
            row["ncu"] = f"failed: {_tail(str(e))}"
        print(row["bundle"], {k: row.get(k) for k in ("ncu_launches", "dram_read_mb", "dram_write_mb", "ncu")},
              flush=True)
        save()
    common.publish("gpu_kernels", rows, kernels_table(rows), ("numpy", "cuda-bindings", "torch"),
                   f"CUDA events, {warmup} warm-up runs, median of {repeat}; outputs poisoned (0xFF) before each check",
                   results)


def outside_cell(row: dict) -> str:
    """A FAIL's size: how many elements miss the tolerance, and the worst by how much."""
    if not row.get("outside_tolerance"):
        return ""
    return (f"; {row['outside_tolerance']} outside rtol/atol {row['rtol']:g}/{row['atol']:g} "
            f"by up to {row['worst_excess']:.2g}")


def graph_cell(row: dict) -> str:
    """The median of the inference replayed from a CUDA graph, and whether its outputs were the
    direct launches'; or why it was not captured."""
    if "graph_median_ms" in row:
        return f"{row['graph_median_ms']:.3f} ms ({row['graph']})"
    return row.get("graph", "-")


def kernels_table(rows: list[dict]) -> str:
    header = ("| bundle | check (max abs error) | unwritten | launches | grid | median | min | runs | in a CUDA graph "
              "| racecheck | synccheck | kernels (ncu) | DRAM read MB (ncu) | DRAM write MB (ncu) |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")

    def cell(row, key, fmt="{}", missing="-"):
        return fmt.format(row[key]) if key in row else missing

    device = next((r["device"] for r in rows if "device" in r), "no bundle ran")
    timelines = "".join(f"\n\n{timeline_table(r['bundle'], r['timeline'])}" for r in rows if "timeline" in r)
    return f"Device: {device}\n\n" + header + "\n".join(
        f"| {r['bundle']} | {r['check']}{cell(r, 'max_abs_error', ' ({:.2g})', '')}{outside_cell(r)} "
        f"| {cell(r, 'unwritten')} "
        f"| {cell(r, 'launches')} | {cell(r, 'grid')}{cell(r, 'blocks_per_sm', ' ({}/SM)', '')} "
        f"| {cell(r, 'median_ms', '{:.3f} ms')} | {cell(r, 'min_ms', '{:.3f} ms')} | {cell(r, 'runs')} "
        f"| {graph_cell(r)} | {cell(r, 'racecheck')} | {cell(r, 'synccheck')} | {cell(r, 'ncu_launches')} "
        f"| {cell(r, 'dram_read_mb', '{:.2f}')} | {cell(r, 'dram_write_mb', '{:.2f}')} |" for r in rows) + timelines


def timeline_table(bundle: str, timeline, top: int = 8) -> str:
    """A bundle's slowest segments between grid barriers, measured beside estimated."""
    if not isinstance(timeline, dict) or "segments" not in timeline:
        return f"{bundle} timeline: {timeline}"
    timed = [s for s in timeline["segments"] if "measured_us" in s]
    measured = sum(s["measured_us"] for s in timed)
    estimated = sum(s["estimate_us"] for s in timed)
    lines = [f"{bundle} timeline: {len(timeline['segments'])} segments, stamped {timeline['stamped_us']:.1f} us "
             f"(estimate {estimated:.1f} us for the same segments), outputs {'PASS' if timeline['passes'] else 'FAIL'}; "
             f"the {top} slowest:", "", "| segment | stages | measured us | estimate us |", "|---|---|---|---|"]
    for s in sorted(timed, key=lambda s: -s["measured_us"])[:top]:
        stages = ", ".join(s["stages"][:4]) + (f" (+{len(s['stages']) - 4})" if len(s["stages"]) > 4 else "")
        lines.append(f"| {s['segment']} | {stages or '(barrier only)'} | {s['measured_us']:.2f} | {s['estimate_us']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("export", "run", "check", "once", "timeline"))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--models", nargs="+", default=list(models.MODELS))
    parser.add_argument("--configs", nargs="+", default=["tiny", "paper"])
    parser.add_argument("--levels", nargs="+", type=int, default=None, help="opt levels to export (default: O4)")
    parser.add_argument("--precisions", nargs="+", default=[DEFAULT_PRECISION], choices=sorted(PRECISIONS),
                        help="precisions to export")
    parser.add_argument("--variant", choices=sorted(VARIANTS), help="export: compile with this variant of the "
                        "compiler (benchmarks/gpu_variants.py), bundles named BASE+VARIANT")
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--ncu", metavar="GLOB", help="also count launches and DRAM bytes with Nsight Compute "
                        "for the bundles matching GLOB (e.g. '*_paper_O4')")
    parser.add_argument("--timeline", metavar="GLOB", help="time the stages between grid barriers of the "
                        "bundles matching GLOB that have a timeline build (e.g. '*_paper_O4*')")
    parser.add_argument("--sanitize", metavar="GLOB", help="run compute-sanitizer racecheck and synccheck on the "
                        "bundles matching GLOB (e.g. '*_tiny_*')")
    parser.add_argument("--timeout", type=float, default=120, help="seconds one bundle's process may take")
    parser.add_argument("--jobs", type=int, default=1, help="bundles prepared at once (their GPU work one at a time)")
    parser.add_argument("--lock", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds after which nothing starts")
    parser.add_argument("--check-budget", type=float, default=None, help="seconds after which no bundle's check "
                        "starts (default: --budget), leaving the rest to the timelines, sanitizers and ncu")
    parser.add_argument("--first", nargs="+", default=[], metavar="GLOB",
                        help="check the bundles matching these globs first, in this order")
    parser.add_argument("--results", type=Path, default=None, help="where the JSON and markdown go "
                        "(default benchmarks/results)")
    args = parser.parse_args()
    if args.step == "export":
        export_all(args.directory, args.models, args.configs, args.levels, args.precisions, args.variant)
    elif args.step == "once":
        once(args.directory)
    elif args.step == "check":
        print(json.dumps(check_bundle(args.directory, args.repeat, args.warmup, args.lock)))
    elif args.step == "timeline":
        print(json.dumps(timeline_bundle(args.directory, args.repeat, args.warmup)))
    else:
        run(args.directory, args.repeat, args.warmup, args.ncu, args.sanitize, args.timeout, args.results, args.budget,
            args.timeline, args.jobs, args.first, args.check_budget)


if __name__ == "__main__":
    main()
