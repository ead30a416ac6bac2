"""Nsight Compute from Python: run a command under ``ncu`` and read back each kernel launch.

Needs only the standard library, so the TVM-free GPU benchmark (benchmarks/gpu_kernels.py) and
the profiling scripts share it.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import tempfile
from pathlib import Path

from souffle.errors import TargetError
from souffle.runtime.cuda import gpu_available

# what ``ncu --print-units base`` prints for our metrics (2025.3 on an H200 printed durations in "ns")
_UNIT_SCALE = {"": 1, "byte": 1, "nsecond": 1, "ns": 1}


def require_ncu() -> str:
    """ncu's path; refused before anything is compiled where it cannot measure."""
    if not gpu_available():
        raise TargetError("--ncu needs an NVIDIA GPU, and no CUDA device is usable on this machine; "
                          "run without --ncu for the static columns")
    ncu = shutil.which("ncu")
    if ncu is None:
        raise TargetError("--ncu needs Nsight Compute: `ncu` is not on PATH")
    return ncu


def profile_launches(ncu: str, command: list[str], metrics: list[str], what: str) -> list[dict]:
    """Each kernel launch ``command`` makes, as ``{"kernel": name, metric: value}``, from ``ncu --csv``.

    ncu profiles every launch of the process it starts, so ``command`` should run exactly the
    work to be measured (one inference, no warm-up). Caches are flushed before each launch
    (ncu's default), so DRAM figures start cold.
    """
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "ncu.csv"
        cmd = [ncu, "--csv", "--print-units", "base", "--clock-control", "none", "--metrics", ",".join(metrics),
               "--log-file", str(log), *command]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        text = log.read_text() if log.exists() else ""
    if done.returncode != 0 or "==ERROR==" in text:
        tail = "\n".join((text + done.stdout + done.stderr).strip().splitlines()[-15:])
        raise TargetError(f"ncu failed on {what}, exit {done.returncode}:\n{tail}")
    launches = parse_ncu_csv(text)
    if not launches:
        raise TargetError(f"ncu recorded no kernel launch for {what}; its log:\n{text.strip()[-2000:]}")
    return launches


def parse_ncu_csv(text: str) -> list[dict]:
    """``ncu --csv`` rows (one per launch and metric) grouped by launch ID, in launch order.
    ``==PROF==`` lines and anything else not quoted is skipped; values may carry thousands separators."""
    rows = csv.DictReader(line for line in text.splitlines() if line.startswith('"'))
    launches: dict[str, dict] = {}
    for row in rows:
        unit = row["Metric Unit"]
        if unit not in _UNIT_SCALE:
            raise TargetError(f"ncu reported {row['Metric Name']} in {unit!r}; expected base units (--print-units base)")
        launch = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
        launch[row["Metric Name"]] = float(row["Metric Value"].replace(",", "")) * _UNIT_SCALE[unit]
    return list(launches.values())
