"""What every benchmark records: the machine, the versions, the exact command, medians."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "os": platform.platform(),
            "python": platform.python_version(), "gpus": gpus()}


def gpus() -> list[str]:
    """Each NVIDIA GPU's name and driver as nvidia-smi reports them; none where it is absent."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def versions(*packages: str) -> dict:
    found = {}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    try:
        found["souffle_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                 text=True, cwd=RESULTS.parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        # a tree sent without .git (the GPU machine's copy) names its commit in SOUFFLE_COMMIT
        found["souffle_commit"] = os.environ.get("SOUFFLE_COMMIT")
    return found


def command() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def time_call(fn, warmup: int, repeat: int, budget_s: float | None = None, min_runs: int = 1) -> dict:
    """Median, min and max wall time of ``fn()`` in ms after ``warmup`` untimed calls: ``repeat``
    runs, or fewer (at least ``min_runs``) once ``budget_s`` seconds of runs have passed."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    while len(samples) < repeat and (budget_s is None or len(samples) < min_runs or sum(samples) / 1e3 < budget_s):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return summarize(samples)


def summarize(samples_ms: list[float]) -> dict:
    return {"median_ms": statistics.median(samples_ms), "min_ms": min(samples_ms), "max_ms": max(samples_ms),
            "runs": len(samples_ms)}


def write(name: str, payload: dict, table: str, results: Path | None = None) -> tuple[Path, Path]:
    results = RESULTS if results is None else results
    results.mkdir(parents=True, exist_ok=True)
    json_path, md_path = results / f"{name}.json", results / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text(table + "\n")
    return json_path, md_path


def publish(name: str, rows: list[dict], table: str, packages: tuple[str, ...], timing: str,
            results: Path | None = None) -> None:
    """Write the rows with the command, machine and versions as JSON, and the table as markdown."""
    payload = {"command": command(), "machine": machine(), "versions": versions(*packages), "timing": timing,
               "results": rows}
    md = (f"Command: `{payload['command']}`\n\nMachine: {payload['machine']['cpu']}, {payload['machine']['cores']} "
          f"cores. Versions: {payload['versions']}\n\n" + table)
    json_path, md_path = write(name, payload, md, results)
    print(md)
    print(f"wrote {json_path} and {md_path}")
