"""The device table: published GPU figures, the local CPU model, name lookup."""

import dataclasses
import os
import platform

import pytest

from analysis import device
from analysis.device import (
    A100,
    DEVICES,
    H100,
    H200,
    get_device,
    local_cpu,
    measure_copy_bandwidth,
)
from souffle.errors import SouffleError, UnknownDeviceError

KiB, MiB = 1024, 1024 * 1024


@pytest.mark.parametrize("device, name, bandwidth", [(H200, "h200", 4.8e12), (H100, "h100", 3.35e12)])
def test_hopper_figures(device, name, bandwidth):
    assert (device.name, device.kind, device.arch, device.sms) == (name, "gpu", "sm_90", 132)
    assert device.peak_flops == {"float32": 67e12, "float16": 989.5e12, "bfloat16": 989.5e12, "tf32": 494.7e12}
    assert device.mem_bandwidth == bandwidth
    assert (device.smem_per_sm, device.smem_per_block) == (228 * KiB, 227 * KiB)
    assert (device.regs_per_sm, device.regs_per_block, device.max_regs_per_thread) == (65536, 65536, 255)
    assert (device.max_threads_per_block, device.max_threads_per_sm, device.max_blocks_per_sm) == (1024, 2048, 32)
    assert (device.warp_size, device.l2_bytes) == (32, 50 * MiB)


def test_clocks_lanes_and_l2_bandwidth():
    # the clock at which the FP32 peak is reached: peak = SMs x lanes x 2 x clock
    assert [(d.clock_hz, d.fp32_lanes_per_sm) for d in (H100, H200, A100)] == [(1.98e9, 128), (1.98e9, 128),
                                                                                (1.41e9, 64)]
    assert [d.l2_bandwidth for d in (H100, H200, A100)] == [5120 * 1.98e9, 5120 * 1.98e9, 5120 * 1.41e9]


def test_a100_figures():
    assert (A100.name, A100.kind, A100.arch, A100.sms) == ("a100", "gpu", "sm_80", 108)
    assert A100.peak_flops == {"float32": 19.5e12, "float16": 312e12, "bfloat16": 312e12, "tf32": 156e12}
    assert A100.mem_bandwidth == 1.555e12
    assert (A100.smem_per_sm, A100.smem_per_block) == (164 * KiB, 163 * KiB)
    assert (A100.regs_per_sm, A100.regs_per_block, A100.max_regs_per_thread) == (65536, 65536, 255)
    assert (A100.max_threads_per_block, A100.max_threads_per_sm, A100.max_blocks_per_sm) == (1024, 2048, 32)
    assert (A100.warp_size, A100.l2_bytes) == (32, 40 * MiB)


def test_ridge_points():
    # peak FLOP/s / bytes/s = FLOP per byte
    assert H200.ridge_point("float32") == pytest.approx(67e12 / 4.8e12)  # ~13.96
    assert H200.ridge_point("float16") == pytest.approx(206.146, rel=1e-5)  # 989.5 / 4.8
    assert A100.ridge_point("float32") == pytest.approx(12.540, rel=1e-4)  # 19.5 / 1.555
    assert A100.ridge_point("float16") == pytest.approx(200.643, rel=1e-5)  # 312 / 1.555


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="no peak throughput for dtype 'int8'.*float32, float16"):
        H200.peak("int8")
    with pytest.raises(ValueError, match="'float64'"):
        A100.ridge_point("float64")


def test_models_are_frozen_and_hashable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        H200.sms = 1
    assert len({H200, A100, H200}) == 2


def test_get_device_is_case_insensitive():
    assert DEVICES == ("h200", "h100", "a100", "cpu")
    assert get_device("H100") is H100
    assert get_device("h200") is H200
    assert get_device("H200") is H200
    assert get_device("A100") is A100
    assert get_device("CPU") is get_device("cpu") is local_cpu()


def test_unknown_device_names_the_known_ones():
    with pytest.raises(UnknownDeviceError) as info:
        get_device("v100")
    assert isinstance(info.value, SouffleError) and isinstance(info.value, KeyError)
    assert str(info.value) == "unknown device 'v100'; known devices: h200, h100, a100, cpu"


def test_local_cpu_is_positive_and_consistent():
    cpu = local_cpu()
    assert cpu.kind == "cpu" and cpu.arch
    assert cpu.sms == os.cpu_count()
    assert cpu.warp_size in (4, 8, 16)
    assert cpu.peak("float32") == cpu.peak("float16") == cpu.peak("bfloat16") > 0
    assert cpu.mem_bandwidth > 0
    assert cpu.ridge_point("float32") > 0
    assert cpu.smem_per_block == cpu.smem_per_sm >= 0  # the private L2, 0 where sysfs is unreadable
    assert cpu.max_threads_per_block == cpu.max_threads_per_sm == cpu.max_blocks_per_sm == 1


def test_cpu_peak_from_cpuinfo(monkeypatch):
    info = {"model name": "Test CPU 9000", "flags": "fpu sse2 avx avx2 fma avx512f", "cpu MHz": "3000.000"}
    monkeypatch.setattr(device, "_cpuinfo", lambda: info)
    monkeypatch.setattr(device, "measure_copy_bandwidth", lambda: 1e11)
    cpu = local_cpu.__wrapped__()
    cores = os.cpu_count()
    assert cpu.arch == "Test CPU 9000"
    assert cpu.warp_size == 16  # AVX-512: 16 fp32 lanes
    assert cpu.peak("float32") == cores * 16 * 2 * 2 * 3.0e9  # lanes x FMA x 2 units x clock
    assert cpu.regs_per_sm == 32 * 16  # 32 zmm registers of 16 words
    assert cpu.mem_bandwidth == 1e11

    info["flags"] = "fpu sse2 avx avx2 fma"
    assert local_cpu.__wrapped__().peak("float32") == cores * 8 * 2 * 2 * 3.0e9


def test_cpu_without_cpuinfo(monkeypatch):
    monkeypatch.setattr(device, "_cpuinfo", dict)
    monkeypatch.setattr(device, "measure_copy_bandwidth", lambda: 1e10)
    cpu = local_cpu.__wrapped__()
    assert cpu.arch == (platform.processor() or platform.machine() or "unknown CPU")
    assert cpu.warp_size == 4
    assert cpu.peak("float32") == os.cpu_count() * 4 * 2 * 2 * device.DEFAULT_CPU_CLOCK_HZ


def test_copy_bandwidth_is_measured():
    assert measure_copy_bandwidth(nbytes=4 * MiB, repeats=2) > 1e8  # any machine copies > 100 MB/s
