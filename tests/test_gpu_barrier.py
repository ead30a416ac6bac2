"""benchmarks/gpu_barrier.py: the grid-barrier microbenchmark builds here for both archs, reports
what it measured per grid, and runs on a GPU where there is one."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_barrier  # noqa: E402


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_export_builds_both_archs_cubins_of_both_kernels(tmp_path):
    directory = gpu_barrier.export(tmp_path / "barrier")
    assert (directory / "barrier.cu").read_text() == gpu_barrier.SOURCE
    for arch in gpu_barrier.ARCHS:
        cubin = (directory / f"barrier.{arch}.cubin").read_bytes()
        assert cubin[:4] == b"\x7fELF" and all(name.encode() in cubin for name in gpu_barrier.KERNELS)


def test_the_table_has_a_row_per_grid_and_a_column_per_phase_size():
    result = {"device": "GPU", "sms": 132, "threads": 256, "phases": 1000, "repeat": 20,
              "rows": [{"blocks_per_sm": 1, "grid": 132, "barrier_us": 1.234, "phase_us": {"0": 1.5, "294912": 2.25}},
                       {"blocks_per_sm": 8, "grid": 1056, "barrier_us": 3.5}]}
    lines = gpu_barrier.table(result).splitlines()
    assert "| blocks/SM | grid | grid.sync() alone | 0 floats + grid.sync() | 294912 floats + grid.sync() |" in lines
    assert "| 1 | 132 | 1.23 | 1.50 | 2.25 |" in lines and "| 8 | 1056 | 3.50 | - | - |" in lines


@pytest.mark.gpu
def test_a_grid_barrier_costs_a_positive_time_that_grows_no_faster_than_the_grid(tmp_path):
    from souffle.runtime.cuda import gpu_available

    if not gpu_available():
        pytest.skip("no GPU")
    result = gpu_barrier.run(gpu_barrier.export(tmp_path / "barrier"), phases=200, repeat=5, elements=[1024])
    first, last = result["rows"][0], result["rows"][-1]
    assert 0 < first["barrier_us"] < 100 and last["barrier_us"] < 100 * first["barrier_us"]
    assert first["phase_us"]["1024"] > 0
