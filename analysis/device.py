"""Device models: the few hardware figures the cost model, partitioning and grid sizing need.

The GPUs are published figures (vendor datasheets for peak throughput and bandwidth,
the architecture whitepapers for SM count, clock and L2, the CUDA C++ Programming Guide's table
"Technical Specifications per Compute Capability" for the per-SM and per-block limits).
The local CPU is described from ``/proc/cpuinfo`` and a measured memory copy, once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from souffle.errors import TargetError, UnknownDeviceError

KiB = 1024
MiB = 1024 * KiB
REGISTER_ALLOCATION_UNIT = 256  # registers are allocated per warp in units of 256 (sm_70 and later)
SHARED_RESERVED_PER_BLOCK = 1024  # bytes the CUDA runtime reserves per resident block (sm_80 and later)


@dataclass(frozen=True)
class DeviceModel:
    """One device. Sizes in bytes, throughputs per second, limits as the CUDA occupancy rules use them."""

    name: str
    kind: str  # "gpu" or "cpu"
    arch: str  # "sm_90", "sm_80", or the CPU's model string
    sms: int  # streaming multiprocessors (cores for a CPU)
    peak_flops: dict[str, float] = field(hash=False)  # dtype -> FLOP/s
    mem_bandwidth: float  # bytes/s to device memory
    smem_per_sm: int
    smem_per_block: int  # the most one block may opt in to
    regs_per_sm: int  # 32-bit registers
    regs_per_block: int
    max_regs_per_thread: int
    max_threads_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    warp_size: int
    l2_bytes: int
    launch_seconds: float  # what starting one more kernel costs; ``codegen.partition`` weighs splits by it
    vector_lanes: int = 1  # fp32 lanes of the vectors the CPU schedules fill (1: a GPU's scalar threads)
    clock_hz: float = 0.0  # the clock at which ``peak_flops`` is reached (a GPU's boost clock)
    l2_bandwidth: float = 0.0  # bytes/s between the SMs and L2 (GPUs; ``analysis.latency`` reads it)
    # a grid barrier (GPUs): this much, plus ``grid_sync_seconds_per_block`` for each block of the grid
    grid_sync_base_seconds: float = 0.0
    grid_sync_seconds_per_block: float = 0.0

    @property
    def fp32_lanes_per_sm(self) -> int:
        """FP32 FMA lanes of one SM (or core): the fp32 peak over SMs x 2 FLOPs per FMA x clock,
        rounded (datasheet peaks are rounded: 67 TFLOP/s gives 128.2 lanes on an H100)."""
        return round(self.peak("float32") / (2 * self.sms * self.clock_hz))

    def peak(self, dtype) -> float:
        """Peak FLOP/s for arithmetic in ``dtype``; a dtype the table lacks is refused, never guessed."""
        try:
            return self.peak_flops[str(dtype)]
        except KeyError:
            known = ", ".join(self.peak_flops)
            raise ValueError(f"device {self.name!r} has no peak throughput for dtype {str(dtype)!r} "
                             f"(known: {known})") from None

    def grid_sync_seconds(self, blocks: int) -> float:
        """One cooperative-groups grid barrier (``grid.sync()``) of a grid of ``blocks`` blocks."""
        return self.grid_sync_base_seconds + blocks * self.grid_sync_seconds_per_block

    def ridge_point(self, dtype) -> float:
        """Arithmetic intensity (FLOP per byte) above which a kernel in ``dtype`` is compute-bound."""
        return self.peak(dtype) / self.mem_bandwidth


# A kernel launch, as one more kernel in a stream costs end to end: about 3 us for a null kernel
# "with recent hardware and software" (NVIDIA developer forums, "Too much time for kernel launch
# latency", 2022: https://forums.developer.nvidia.com/t/too-much-time-for-kernel-launch-latency/233645/3).
# It is the driver's and the host's cost more than the GPU's, so every GPU gets the same figure.
KERNEL_LAUNCH_SECONDS = 3e-6

# L2 bandwidth: the A100 whitepaper gives 5,120 bytes per clock of L2 read bandwidth (vs 2,048 on V100).
# NVIDIA publishes no such figure for GH100; the H100 and H200 models take the same 5,120 bytes per
# clock at their 1.98 GHz boost clock (10.1 TB/s), an assumption to correct once GPU timings exist.
L2_BYTES_PER_CLOCK = 5120

# A cooperative-groups grid barrier (``grid.sync()``), timed alone on an H100 80GB HBM3 with 1 to 8
# blocks of 256 threads per SM (``benchmarks/gpu_barrier.py``, CUDA events, 1000 barriers a launch;
# ``benchmarks/results/gpu_h100_3_runs/run1_gpu_barrier.json``): 1.12 us at 132 blocks, 1.29 at 264,
# 1.65 at 528, 1.77 at 660 and 2.25 at 1056. The least-squares line through them, 0.97 us + 1.22 ns
# per block, is within 0.04 us of each. The H200 (the same die) takes the H100's line; so does the
# A100, which no run has timed: an assumption.
GRID_SYNC_BASE_SECONDS = 0.97e-6
GRID_SYNC_SECONDS_PER_BLOCK = 1.22e-9

# NVIDIA H100 SXM5 80GB (GH100, compute capability 9.0). H100 datasheet: 3.35 TB/s HBM3, FP32 67 TFLOP/s,
# FP16 and BF16 tensor core 1,979 TFLOP/s each with 2:4 sparsity, i.e. 989.5 dense; TF32 tensor core 989
# with sparsity, 494.7 dense (the ``tf32`` key: float32 operands multiplied in TF32, ``precision="tf32"``). H100 architecture
# whitepaper: 132 SMs, 128 FP32 lanes per SM, 50 MB L2; the FP32 peak is reached at 67e12 / (132 x 128 x 2)
# = 1.98 GHz, the SXM5 boost clock. CUDA Programming Guide, cc 9.0: the same per-SM and per-block limits as the H200.
H100 = DeviceModel(
    name="h100",
    kind="gpu",
    arch="sm_90",
    sms=132,
    peak_flops={"float32": 67e12, "float16": 989.5e12, "bfloat16": 989.5e12, "tf32": 494.7e12},
    mem_bandwidth=3.35e12,
    smem_per_sm=228 * KiB,
    smem_per_block=227 * KiB,
    regs_per_sm=64 * KiB,
    regs_per_block=64 * KiB,
    max_regs_per_thread=255,
    max_threads_per_block=1024,
    max_threads_per_sm=2048,
    max_blocks_per_sm=32,
    warp_size=32,
    l2_bytes=50 * MiB,
    launch_seconds=KERNEL_LAUNCH_SECONDS,
    clock_hz=1.98e9,
    l2_bandwidth=L2_BYTES_PER_CLOCK * 1.98e9,
    grid_sync_base_seconds=GRID_SYNC_BASE_SECONDS,
    grid_sync_seconds_per_block=GRID_SYNC_SECONDS_PER_BLOCK,
)

# NVIDIA H200 SXM (GH100, compute capability 9.0). H200 datasheet: 4.8 TB/s HBM3e, FP32 67 TFLOP/s,
# FP16 and BF16 tensor core 989.5 TFLOP/s dense, as the H100; H100 architecture whitepaper (same SXM die
# configuration): 132 SMs, 128 FP32 lanes per SM, 50 MB L2, 1.98 GHz boost clock. CUDA Programming
# Guide, cc 9.0: 228 KB shared memory per SM, 227 KB per block, 64K registers per SM and per block,
# 255 per thread, 1024 threads per block, 2048 per SM, 32 blocks per SM.
H200 = dataclasses.replace(H100, name="h200", mem_bandwidth=4.8e12)  # the H100 die with HBM3e

# NVIDIA A100 SXM4 40GB (GA100, compute capability 8.0). A100 datasheet: 1,555 GB/s HBM2, FP32
# 19.5 TFLOP/s, FP16 and BF16 tensor core 312 TFLOP/s dense, TF32 tensor core 156 dense. A100 architecture whitepaper: 108 SMs,
# 64 FP32 lanes per SM, 1,410 MHz boost clock (19.5e12 = 108 x 64 x 2 x 1.41e9), 40 MB L2 with 5,120
# bytes per clock.
# CUDA Programming Guide, cc 8.0: 164 KB shared memory per SM, 163 KB per block, 64K registers per
# SM and per block, 255 per thread, 1024 threads per block, 2048 per SM, 32 blocks per SM.
A100 = DeviceModel(
    name="a100",
    kind="gpu",
    arch="sm_80",
    sms=108,
    peak_flops={"float32": 19.5e12, "float16": 312e12, "bfloat16": 312e12, "tf32": 156e12},
    mem_bandwidth=1.555e12,
    smem_per_sm=164 * KiB,
    smem_per_block=163 * KiB,
    regs_per_sm=64 * KiB,
    regs_per_block=64 * KiB,
    max_regs_per_thread=255,
    max_threads_per_block=1024,
    max_threads_per_sm=2048,
    max_blocks_per_sm=32,
    warp_size=32,
    l2_bytes=40 * MiB,
    launch_seconds=KERNEL_LAUNCH_SECONDS,
    clock_hz=1.41e9,
    l2_bandwidth=L2_BYTES_PER_CLOCK * 1.41e9,
    grid_sync_base_seconds=GRID_SYNC_BASE_SECONDS,
    grid_sync_seconds_per_block=GRID_SYNC_SECONDS_PER_BLOCK,
)

_GPUS = {"h200": H200, "h100": H100, "a100": A100}
DEVICES = (*_GPUS, "cpu")

DEFAULT_CPU_CLOCK_HZ = 2.0e9  # used only where /proc/cpuinfo gives no "cpu MHz"
_COPY_BYTES = 64 * MiB


def get_device(name: str) -> DeviceModel:
    """The model of device ``name`` (case-insensitive); the CPU is described on first use."""
    key = str(name).lower()
    if key == "cpu":
        return local_cpu()
    if key in _GPUS:
        return _GPUS[key]
    raise UnknownDeviceError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}")


@functools.cache
def local_cpu() -> DeviceModel:
    """This machine's CPU as a device, mapped onto the GPU fields.

    Peak: logical cores (``os.cpu_count()``) x fp32 SIMD lanes (16 with AVX-512, 8 with AVX2/FMA,
    else 4) x 2 (an FMA is two FLOPs) x 2 FMA units x the "cpu MHz" clock, an upper bound where
    hyperthreads share a core's units or a core has one FMA unit; float16, bfloat16 and TF32 get the
    same figure, as no CPU path here computes them faster.
    Bandwidth is measured (``measure_copy_bandwidth``). A core plays an SM: its private L2 stands
    for shared memory, the last-level cache for the GPU's L2, its vector register file (in 32-bit
    words) for registers, and its SIMD lanes for a warp; a block is one thread on one core. A
    kernel is a function call, so a launch costs nothing worth modelling (``launch_seconds`` 0).
    Without /proc/cpuinfo the model string is ``platform.processor()`` and the clock
    ``DEFAULT_CPU_CLOCK_HZ``.
    """
    info = _cpuinfo()
    flags = set(info.get("flags", info.get("Features", "")).split())
    lanes = 16 if "avx512f" in flags else 8 if flags & {"avx2", "fma"} else 4
    # The CPU schedules fill 256-bit vectors wherever AVX2 or AVX-512 is present: LLVM itself
    # prefers 256-bit vectors on most AVX-512 cores, and the schedules were tuned that way.
    vector_lanes = min(lanes, 8)
    clock = float(info["cpu MHz"]) * 1e6 if "cpu MHz" in info else DEFAULT_CPU_CLOCK_HZ
    cores = os.cpu_count() or 1
    peak = cores * lanes * 2 * 2 * clock
    vector_regs = lanes * (32 if "avx512f" in flags or platform.machine() in ("aarch64", "arm64") else 16)
    caches = _cache_sizes()
    private_l2 = caches.get(2, 0)
    return DeviceModel(
        name="cpu",
        kind="cpu",
        arch=info.get("model name") or platform.processor() or platform.machine() or "unknown CPU",
        sms=cores,
        peak_flops={"float32": peak, "float16": peak, "bfloat16": peak, "tf32": peak},
        mem_bandwidth=measure_copy_bandwidth(),
        smem_per_sm=private_l2,
        smem_per_block=private_l2,
        regs_per_sm=vector_regs,
        regs_per_block=vector_regs,
        max_regs_per_thread=vector_regs,
        max_threads_per_block=1,
        max_threads_per_sm=1,
        max_blocks_per_sm=1,
        warp_size=lanes,
        l2_bytes=caches[max(caches)] if caches else 0,
        launch_seconds=0.0,
        vector_lanes=vector_lanes,
        clock_hz=clock,
    )


def measure_copy_bandwidth(nbytes: int = _COPY_BYTES, repeats: int = 3) -> float:
    """Bytes/s of the best of ``repeats`` single-threaded numpy copies (read + write counted).

    One thread rarely saturates a multi-channel memory system, so this is a lower bound on what
    all cores together can stream; it takes a few tens of milliseconds.
    """
    source = np.ones(nbytes // 8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def _cpuinfo() -> dict[str, str]:
    """The first processor's "key: value" lines of /proc/cpuinfo; empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if info:
                break
            continue
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return info


def _cache_sizes() -> dict[int, int]:
    """Data/unified cache size in bytes by level, as cpu0 sees it (sysfs); empty where unreadable."""
    sizes: dict[int, int] = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": KiB, "M": MiB}
        sizes[level] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return sizes


# -- occupancy: how many blocks of a kernel one SM holds ------------------------------------------
@dataclass(frozen=True)
class Occupancy:
    """How many blocks of the kernel fit on one SM of a device, and what limits it."""

    device: str
    blocks_per_sm: int
    grid: int  # SMs x blocks per SM: every block co-resident
    limits: dict  # resource -> blocks per SM it allows

    @property
    def limiter(self) -> str:
        return min(self.limits, key=self.limits.get)

    def __str__(self):
        detail = ", ".join(f"{k} {v}" for k, v in self.limits.items())
        return f"{self.device}: {self.blocks_per_sm} blocks/SM ({detail}), grid {self.grid}"


def co_resident_grid(registers: int, shared_bytes: int, device: DeviceModel, threads: int) -> Occupancy:
    """The largest cooperative grid for a kernel using ``registers`` per thread and
    ``shared_bytes`` per block, by the CUDA occupancy rules; refuses one that cannot launch."""
    problems = []
    if threads > device.max_threads_per_block:
        problems.append(f"{threads} threads per block > {device.max_threads_per_block}")
    if registers > device.max_regs_per_thread:
        problems.append(f"{registers} registers per thread > {device.max_regs_per_thread}")
    warps = -(-threads // device.warp_size)
    regs_per_warp = -(-registers * device.warp_size // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    if regs_per_warp * warps > device.regs_per_block:
        problems.append(f"{registers} registers x {threads} threads = {regs_per_warp * warps} registers per block "
                        f"> {device.regs_per_block}")
    if shared_bytes > device.smem_per_block:
        problems.append(f"{shared_bytes} bytes of shared memory per block > {device.smem_per_block}")
    if problems:
        raise TargetError(f"the kernel cannot be co-resident on {device.name}: " + "; ".join(problems))
    limits = {
        "threads": device.max_threads_per_sm // threads,
        "blocks": device.max_blocks_per_sm,
        "registers": device.regs_per_sm // max(regs_per_warp * warps, 1),
    }
    if shared_bytes:
        limits["shared memory"] = device.smem_per_sm // (shared_bytes + SHARED_RESERVED_PER_BLOCK)
    blocks = min(limits.values())
    if blocks < 1:
        raise TargetError(f"the kernel cannot be co-resident on {device.name}: {limits}")
    return Occupancy(device.name, blocks, blocks * device.sms, limits)

