"""CUDA runtime without TVM: nvcc to cubin (cached), and the driver API through cuda-bindings.

This module needs only numpy, nvcc for compiling and ``cuda-bindings`` for running, so it
works on a GPU machine where TVM is not installed. Importing it needs neither a GPU nor a
driver: the driver is loaded on the first call of :func:`driver`.

Every failure of the toolchain or the GPU is a :class:`~souffle.errors.TargetError` naming the
problem: a missing nvcc, a compile error (with nvcc's first lines), a missing driver or GPU, a
failed driver call (with the call and the CUDA error name), a grid too large for a cooperative
launch. A bad argument (a buffer size, an upload or download that does not fit, a kernel argument
of the wrong type or range) is an :class:`~souffle.errors.InputError`, raised before any driver call.
The nvcc cache never raises: an entry that does not verify is rebuilt, an unwritable cache is
skipped, each with a :class:`CacheWarning`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import warnings
import weakref
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from souffle.errors import InputError, TargetError

# ---------------------------------------------------------------------------------------------
# nvcc

# The path a cubin records for its source. nvcc compiles in a fresh temporary directory, whose
# path would otherwise reach the cubin twice and make every compile's bytes differ: in the line
# info (set by the #line that starts the compiled file) and in the module id hashed into the
# names of internal-linkage functions such as cooperative_groups' grid sync (set by cicc's
# --orig_src_path_name, which overrides the path nvcc passes it).
_SOURCE_PATH = "/souffle/kernel.cu"
_NVCC_FLAGS = ("-O3", "-lineinfo", "--resource-usage", "-Xcicc", f"--orig_src_path_name={_SOURCE_PATH}")
ARCH = re.compile(r"sm_\d{2,3}[af]?")  # a real architecture, as nvcc's -arch takes it
_ERROR_LINES = 20


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one entry function: the inputs of the occupancy calculation.

    ``shared_bytes`` is static shared memory; ``spill_bytes`` is the bytes of spill stores
    (the local-memory footprint of spilled registers), non-zero meaning the kernel spills.
    """

    arch: str
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_bytes: int
    barriers: int


def parse_resource_usage(text: str, arch: str, kernel: str = "main_kernel") -> KernelResources:
    """Read ``kernel``'s resources from the ``ptxas info`` lines of ``nvcc --resource-usage``.

    ptxas writes, per entry function, a "Compiling entry function" header, a "Function
    properties for" line followed by the stack/spill line, and a "Used N registers" line
    whose parts (barriers, smem) are left out when zero. Other functions' lines (other
    kernels, non-inlined device functions) are skipped.
    """
    entry = props = None
    found = {}
    for line in text.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            entry, props = m[1], None
        elif m := re.search(r"Function properties for (\S+)", line):
            props = m[1]
        elif "bytes stack frame" in line:
            if props == kernel:
                found["stack_bytes"] = _number(r"(\d+) bytes stack frame", line)
                found["spill_bytes"] = _number(r"(\d+) bytes spill stores", line)
        # The Used line belongs to the entry being compiled; output without "Compiling entry
        # function" headers names it only in "Function properties".
        elif (m := re.search(r"\bUsed (\d+) registers", line)) and (entry if entry is not None else props) == kernel:
            found["registers"] = int(m[1])
            found["barriers"] = _number(r"used (\d+) barriers", line)
            found["shared_bytes"] = _number(r"(\d+) bytes smem", line)
    if "registers" not in found:
        raise TargetError(
            f"ptxas reported no resource usage for kernel {kernel!r}: is it an extern \"C\" "
            f"__global__ function of the source (C++ names are mangled)?"
        )
    return KernelResources(arch=arch, **{"stack_bytes": 0, "spill_bytes": 0, **found})


def _number(pattern: str, line: str) -> int:
    m = re.search(pattern, line)
    return int(m[1]) if m else 0


def _nvcc_path() -> str:
    path = shutil.which("nvcc")
    if path is None:
        raise TargetError("nvcc not found on PATH: install the CUDA toolkit and put its bin/ directory on PATH")
    return path


def nvcc_version() -> str:
    """The output of ``nvcc --version`` for the nvcc on PATH (part of every cache key)."""
    path = _nvcc_path()
    stat = os.stat(path)
    return _nvcc_version(path, stat.st_mtime_ns, stat.st_size)


@functools.cache
def _nvcc_version(path: str, mtime_ns: int, size: int) -> str:
    """Memoized per nvcc binary, so that a cache hit runs no nvcc at all after the first one."""
    result = subprocess.run([path, "--version"], check=False, capture_output=True, text=True)
    if result.returncode != 0:
        raise TargetError(f"{path} --version failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip()


def cache_root(kind: str) -> Path:
    """Where souffle caches ``kind`` ("cubin", "validated"): under $SOUFFLE_CACHE_DIR, else ~/.cache/souffle."""
    if root := os.environ.get("SOUFFLE_CACHE_DIR"):
        return Path(root) / kind
    return Path.home() / ".cache" / "souffle" / kind


def _cache_dir(cache_dir) -> Path:
    return Path(cache_dir) if cache_dir is not None else cache_root("cubin")


class CacheWarning(UserWarning):
    """The nvcc cache could not be used as it is: an entry that did not verify was rebuilt, or
    the cache directory cannot be written and compiles go uncached."""


# Part of every cache key: entries of an older layout are misses, not entries that fail to verify.
_CACHE_FORMAT = 2
_unwritable_caches: set[Path] = set()


def compile_cubin(source: str, arch: str, kernel: str | tuple[str, ...] = "main_kernel",
                  cache_dir=None) -> tuple[bytes, KernelResources | dict[str, KernelResources]]:
    """Compile CUDA ``source`` to a cubin for ``arch`` ("sm_90") and report ``kernel``'s resources
    (for a tuple of kernels, a dict of each one's).

    Results are cached under ``cache_dir``, else ``$SOUFFLE_CACHE_DIR/cubin``, else
    ``~/.cache/souffle/cubin``, keyed by the source, arch, kernel, nvcc version and flags; a hit
    reads two files and runs no nvcc. An entry is the cubin and a JSON of the cubin's SHA-256
    and the resources, sealed by the JSON's own SHA-256; both are checked on every hit, and an
    entry that does not verify (truncated, emptied, malformed, edited) is rebuilt with a
    :class:`CacheWarning`, never raised. A cache directory that cannot be created or written
    does not stop a compile: it goes uncached, with one CacheWarning per directory.

    The cubin is reproducible: the same source, arch and nvcc give the same bytes in any cache.
    """
    if not isinstance(arch, str) or not ARCH.fullmatch(arch):
        raise TargetError(f"bad CUDA arch {arch!r}: expected a real architecture like 'sm_80' or 'sm_90'")
    nvcc = _nvcc_path()
    key = json.dumps(
        {"source": source, "arch": arch, "kernel": kernel, "nvcc": nvcc_version(), "flags": _NVCC_FLAGS,
         "cache_format": _CACHE_FORMAT},
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()
    directory = _cache_dir(cache_dir)
    cubin_path, meta_path = directory / f"{digest}.cubin", directory / f"{digest}.json"
    try:
        cached = _cached_entry(cubin_path, meta_path, arch, kernel)
    except _CorruptEntry as corrupt:
        warnings.warn(f"nvcc cache entry {meta_path} does not verify ({corrupt}): rebuilding it", CacheWarning,
                      stacklevel=2)
        cached = None
    if cached is not None:
        return cached

    cubin, resources = _nvcc_compile(nvcc, source, arch, kernel)
    meta = {"cubin_sha256": sha256_hex(cubin), "resources": _resources_json(resources)}
    meta["sha256"] = sha256_hex(canonical_json(meta))
    # The JSON is written last and marks the entry complete; os.replace makes each file appear
    # whole, and a compile is reproducible, so concurrent compiles of one key write equal files.
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(cubin_path, cubin)
        write_atomic(meta_path, json.dumps(meta).encode())
    except OSError as err:
        if directory not in _unwritable_caches:
            _unwritable_caches.add(directory)
            warnings.warn(f"nvcc cache {directory} cannot be written ({err}): compiling without caching; set "
                          f"SOUFFLE_CACHE_DIR to a writable directory", CacheWarning, stacklevel=2)
    return cubin, resources


class _CorruptEntry(Exception):
    """A cache entry that exists but does not verify; its message says why."""


def _cached_entry(cubin_path: Path, meta_path: Path, arch: str, kernel):
    """The cached (cubin, resources), None on a miss; raises _CorruptEntry for an entry that
    does not verify."""
    try:
        meta_bytes = meta_path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None  # no entry (or no cache), or one whose JSON was never written: a compile was interrupted
    except OSError as err:
        raise _CorruptEntry(f"unreadable: {err}") from None
    try:
        meta = json.loads(meta_bytes)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError alike
        raise _CorruptEntry(f"not JSON: {err}") from None
    if not isinstance(meta, dict) or set(meta) != {"cubin_sha256", "resources", "sha256"}:
        raise _CorruptEntry("not an object of cubin_sha256, resources and sha256")
    if meta["sha256"] != sha256_hex(canonical_json({k: meta[k] for k in ("cubin_sha256", "resources")})):
        raise _CorruptEntry("its content does not match its sha256")
    try:
        cubin = cubin_path.read_bytes()
    except OSError as err:
        raise _CorruptEntry(f"its cubin {cubin_path.name} is unreadable: {err}") from None
    if sha256_hex(cubin) != meta["cubin_sha256"]:
        raise _CorruptEntry(f"its cubin {cubin_path.name} ({len(cubin)} bytes) does not match its sha256")
    return cubin, _resources_from_json(meta["resources"], arch, kernel)


def _resources_json(resources) -> dict:
    return {k: asdict(r) for k, r in resources.items()} if isinstance(resources, dict) else asdict(resources)


def _resources_from_json(value, arch: str, kernel):
    """The resources an entry records, checked field by field (a sealed entry written by another
    version of this code must still not raise a TypeError)."""
    if isinstance(kernel, tuple):
        if not isinstance(value, dict) or set(value) != set(kernel):
            raise _CorruptEntry(f"its resources are not those of kernels {', '.join(kernel)}")
        return {k: _kernel_resources(value[k], arch) for k in kernel}
    return _kernel_resources(value, arch)


def _kernel_resources(value, arch: str) -> KernelResources:
    names = [f.name for f in fields(KernelResources)]
    if not isinstance(value, dict) or set(value) != set(names) or value["arch"] != arch:
        raise _CorruptEntry(f"its resources are not {arch}'s {', '.join(names)}")
    if not all(type(value[name]) is int and value[name] >= 0 for name in names if name != "arch"):
        raise _CorruptEntry("its resources are not non-negative integers")
    return KernelResources(**value)


def _nvcc_compile(nvcc: str, source: str, arch: str, kernel):
    """Run nvcc on ``source`` in a temporary directory: the cubin and ``kernel``'s resources."""
    with tempfile.TemporaryDirectory(prefix="souffle-nvcc-") as tmp:
        src, out = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        src.write_text(f'#line 1 "{_SOURCE_PATH}"\n' + source)
        result = subprocess.run(
            [nvcc, "-cubin", f"-arch={arch}", *_NVCC_FLAGS, "-o", str(out), str(src)],
            check=False,
            capture_output=True,
            text=True,
            cwd=tmp,
        )
        if result.returncode != 0:
            lines = (result.stderr or result.stdout).strip().splitlines()
            shown = "\n".join(lines[:_ERROR_LINES])
            more = f"\n... ({len(lines) - _ERROR_LINES} more lines)" if len(lines) > _ERROR_LINES else ""
            raise TargetError(f"nvcc failed to compile {kernel!r} for {arch}:\n{shown}{more}")
        text = result.stderr + result.stdout
        if isinstance(kernel, tuple):
            resources = {k: parse_resource_usage(text, arch, k) for k in kernel}
        else:
            resources = parse_resource_usage(text, arch, kernel)
        return out.read_bytes(), resources


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(value) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------------------------
# the driver

_NO_GPU = "target 'cuda' needs an NVIDIA GPU and driver"


def _bindings():
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        raise TargetError(f"target 'cuda' needs cuda-python's driver bindings: pip install cuda-bindings ({e})") from e
    return cu


def driver():
    """The ``cuda.bindings.driver`` module, initialized (``cuInit``); loads libcuda on first use."""
    cu = _bindings()
    try:
        (err,) = cu.cuInit(0)
    except (RuntimeError, OSError) as e:  # the loader raises when libcuda.so is not found
        raise TargetError(f"{_NO_GPU}: {e}") from e
    if err != cu.CUresult.CUDA_SUCCESS:
        raise TargetError(f"{_NO_GPU}: cuInit failed with {_error_name(cu, err)}")
    return cu


def gpu_available() -> bool:
    """Whether a CUDA device can be used here; never raises (every failure below is a TargetError)."""
    try:
        return _check(driver().cuDeviceGetCount(), "cuDeviceGetCount") > 0
    except TargetError:
        return False


def _error_name(cu, err) -> str:
    status, name = cu.cuGetErrorName(err)
    return name.decode() if status == cu.CUresult.CUDA_SUCCESS else f"CUresult {int(err)}"


def _check(result, what: str):
    """Unpack a cuda-bindings result ``(CUresult, *values)``, raising TargetError on failure.

    Returns None, the one value, or the tuple of values.
    """
    cu = _bindings()
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise TargetError(f"{what} failed: {_error_name(cu, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class Device:
    """One GPU with its primary context, made current on the calling thread by every method."""

    def __init__(self, ordinal: int = 0):
        cu = driver()
        count = _check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= ordinal < count:
            raise TargetError(f"no CUDA device {ordinal}: this machine has {count}")
        self.ordinal = ordinal
        self.handle = _check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = _check(cu.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self._finalizer = weakref.finalize(self, _release_context, cu, self.handle)
        self._current()
        raw = _check(cu.cuDeviceGetName(256, self.handle), "cuDeviceGetName")
        self.name = raw.split(b"\0", 1)[0].decode()
        major = self._attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = self._attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        self.arch = f"sm_{major}{minor}"
        self.sms = self._attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.cooperative_launch = bool(self._attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH))

    def __repr__(self):
        return f"Device({self.ordinal}: {self.name}, {self.arch}, {self.sms} SMs)"

    def _attribute(self, attribute) -> int:
        return _check(_bindings().cuDeviceGetAttribute(attribute, self.handle), f"cuDeviceGetAttribute({attribute.name})")

    def _current(self):
        """Make this device's context current on this thread (the driver tracks it per thread)."""
        cu = _bindings()
        _check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        return cu

    def alloc(self, nbytes: int) -> DeviceBuffer:
        return DeviceBuffer(self, nbytes)

    def upload(self, array: np.ndarray) -> DeviceBuffer:
        array = np.ascontiguousarray(array)
        buffer = DeviceBuffer(self, array.nbytes)
        buffer.upload(array)
        return buffer

    def load_kernels(self, source: str, cubins: dict[str, bytes], names: tuple[str, ...],
                     dynamic_shared: int = 0) -> dict[str, Kernel]:
        """The ``__global__`` functions ``names``, from the cubin for this device's arch in
        ``cubins`` or else compiled from ``source``."""
        cubin = cubins.get(self.arch)
        if cubin is None:
            cubin = compile_cubin(source, self.arch, names)[0]
        module = Module(self, cubin)
        return {name: Kernel(self, module, name) for name in names}

    def synchronize(self) -> None:
        _check(self._current().cuCtxSynchronize(), "cuCtxSynchronize")


def _release_context(cu, handle) -> None:
    cu.cuDevicePrimaryCtxRelease(handle)  # at teardown there is no one to report a failure to


class DeviceBuffer:
    """Device memory, freed by :meth:`free` or when garbage-collected.

    It holds its Device, so the context outlives the memory.
    """

    def __init__(self, device: Device, nbytes: int):
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
            raise InputError(f"a device buffer needs a positive whole number of bytes, got {nbytes!r}")
        cu = device._current()
        self.device = device
        self.nbytes = nbytes
        self.ptr = int(_check(cu.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes} bytes)"))
        self._finalizer = weakref.finalize(self, _free, device, self.ptr)

    def __repr__(self):
        return f"DeviceBuffer({self.nbytes} bytes at {self.ptr:#x})"

    def _require_alive(self) -> None:
        """Refuse a freed buffer, without a driver call (a launch checks its arguments first)."""
        if not self._finalizer.alive:
            raise TargetError(f"device buffer at {self.ptr:#x} was already freed")

    def _live(self):
        """The driver, with this buffer's context current."""
        self._require_alive()
        return self.device._current()

    def upload(self, array: np.ndarray) -> None:
        """Copy ``array`` (made C-contiguous) to the start of this buffer."""
        array = np.ascontiguousarray(array)
        if array.nbytes > self.nbytes:
            raise InputError(f"cannot upload {array.nbytes} bytes into a {self.nbytes}-byte device buffer")
        cu = self._live()
        _check(cu.cuMemcpyHtoD(self.ptr, array.ctypes.data, array.nbytes), "cuMemcpyHtoD")

    def fill(self, byte: int) -> None:
        """Set every byte of this buffer to ``byte`` (0xFF poisons: NaN in every float, -1 in
        every integer), so that an element a kernel leaves unwritten shows."""
        cu = self._live()
        _check(cu.cuMemsetD8(self.ptr, byte, self.nbytes), "cuMemsetD8")

    def download(self, dtype, shape) -> np.ndarray:
        """A new array of ``dtype`` and ``shape`` read from the start of this buffer."""
        out = np.empty(shape, dtype)
        if out.nbytes > self.nbytes:
            raise InputError(f"cannot download {out.nbytes} bytes from a {self.nbytes}-byte device buffer")
        cu = self._live()
        _check(cu.cuMemcpyDtoH(out.ctypes.data, self.ptr, out.nbytes), "cuMemcpyDtoH")
        return out

    def free(self) -> None:
        self._finalizer()


def _free(device: Device, ptr: int) -> None:
    cu = _bindings()
    cu.cuCtxSetCurrent(device.context)
    cu.cuMemFree(ptr)  # runs from the garbage collector, where raising would only print


class Kernel:
    """One ``__global__`` function of a cubin, loaded on a device."""

    def __init__(self, device: Device, cubin: bytes | Module, name: str = "main_kernel"):
        cu = device._current()
        self.device = device
        self.name = name
        self.module = cubin if isinstance(cubin, Module) else Module(device, cubin)
        self.function = _check(cu.cuModuleGetFunction(self.module.handle, name.encode()),
                               f"cuModuleGetFunction({name!r})")

    def max_active_blocks_per_sm(self, threads: int, dynamic_smem: int = 0) -> int:
        cu = self.device._current()
        return _check(
            cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, threads, dynamic_smem),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )

    def allow_dynamic_shared(self, nbytes: int) -> None:
        """Let launches use ``nbytes`` of dynamic shared memory (above 48 KB the driver asks)."""
        if nbytes > 48 * 1024:
            cu = self.device._current()
            attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(cu.cuFuncSetAttribute(self.function, attribute, nbytes),
                   f"cuFuncSetAttribute({self.name!r}, {nbytes} B of dynamic shared memory)")

    def launch(self, grid: int, threads: int | tuple[int, ...], args: list, cooperative: bool = True,
               stream=None, shared_bytes: int = 0) -> None:
        """Launch on a 1-D grid of ``grid`` blocks of ``threads`` threads (an int, or the block's
        (x, y, z) shape); asynchronous.

        ``args`` are DeviceBuffers (passed as pointers), ints (int32; ``np.int64`` as int64) and
        floats (float32), in the kernel's parameter order. A cooperative launch (needed for grid-wide sync) is
        refused up front when the grid cannot be co-resident, with the numbers that say why.
        """
        self.prepare(grid, threads, args, cooperative, stream, shared_bytes)()

    def prepare(self, grid: int, threads: int | tuple[int, ...], args: list, cooperative: bool = True,
                stream=None, shared_bytes: int = 0):
        """``launch``'s checks and argument packing done once: a call that launches with one
        driver call. A model compiled at O0 launches thousands of kernels per inference, and
        repeating the checks at each took about as long as the launch."""
        params = _kernel_params(args)
        cu = self.device._current()
        bx, by, bz = (tuple(threads) + (1, 1))[:3] if isinstance(threads, tuple) else (threads, 1, 1)
        threads = bx * by * bz
        if cooperative:
            if not self.device.cooperative_launch:
                raise TargetError(f"{self.device.name} does not support cooperative launches")
            per_sm = self.max_active_blocks_per_sm(threads, shared_bytes)
            limit = self.device.sms * per_sm
            if grid > limit:
                raise TargetError(
                    f"grid of {grid} blocks cannot be co-resident: "
                    f"{self.device.sms} SMs x {per_sm} blocks/SM = {limit}"
                )
        what = f"{'cooperative launch' if cooperative else 'launch'} of {self.name!r} ({grid} blocks x {threads} threads)"
        function, device = self.function, self.device

        buffers = [arg for arg in args if isinstance(arg, DeviceBuffer)]

        def launch() -> None:
            # the buffers stay referenced here, so the packed pointers stay allocated; one freed
            # since is refused before the driver sees its pointer
            for buffer in buffers:
                buffer._require_alive()
            device._current()
            if cooperative:
                result = cu.cuLaunchCooperativeKernel(function, grid, 1, 1, bx, by, bz, shared_bytes, stream, params)
            else:
                result = cu.cuLaunchKernel(function, grid, 1, 1, bx, by, bz, shared_bytes, stream, params, 0)
            _check(result, what)

        return launch


class Module:
    """A cubin loaded on a device, unloaded when no Kernel of it is left: a model compiled at O0
    has hundreds of kernels in one cubin, loaded once."""

    def __init__(self, device: Device, cubin: bytes):
        cu = device._current()
        # The driver reads the image through a pointer, so keep it in memory we own for the call.
        image = np.frombuffer(cubin, dtype=np.uint8)
        self.handle = _check(cu.cuModuleLoadData(image.ctypes.data), f"cuModuleLoadData (a cubin on {device.arch})")
        self._finalizer = weakref.finalize(self, _unload, device, self.handle)
        self.device = device

    def _global(self, name: str) -> tuple[int, int]:
        cu = self.device._current()
        pointer, nbytes = _check(cu.cuModuleGetGlobal(self.handle, name.encode()), f"cuModuleGetGlobal({name!r})")
        return int(pointer), int(nbytes)

    def read_global(self, name: str, dtype, shape) -> np.ndarray:
        """The ``__device__`` variable ``name``, read as an array of ``dtype`` and ``shape``."""
        pointer, nbytes = self._global(name)
        out = np.empty(shape, dtype)
        if out.nbytes != nbytes:
            raise TargetError(f"__device__ {name} is {nbytes} B, read as {out.nbytes} B ({shape} {np.dtype(dtype)})")
        _check(self.device._current().cuMemcpyDtoH(out.ctypes.data, pointer, nbytes), f"cuMemcpyDtoH({name})")
        return out

    def zero_global(self, name: str, nbytes: int) -> None:
        """Set the ``nbytes`` of the ``__device__`` variable ``name`` to zero."""
        pointer, size = self._global(name)
        if size != nbytes:
            raise TargetError(f"__device__ {name} is {size} B, not {nbytes} B")
        _check(self.device._current().cuMemsetD8(pointer, 0, nbytes), f"cuMemsetD8({name})")


class Graph:
    """One inference's launches captured once in a CUDA graph on a stream of its own, then
    replayed with one driver call (``launch``): the host's cost per inference no longer grows
    with its launches, and a one-kernel model's latency is the GPU's, as torch's CUDA-graph mode
    is timed. ``record(stream)`` makes the launches, on ``stream``; a launch the driver cannot
    capture (a cooperative one on a driver without it) is refused with the driver's reason."""

    def __init__(self, device: Device, record):
        cu = device._current()
        self.device = device
        self.stream = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        handles = [None, None]  # the graph and its executable, once made: the finalizer destroys them
        self._finalizer = weakref.finalize(self, _destroy_graph, device, self.stream, handles)
        _check(cu.cuStreamBeginCapture(self.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
               "cuStreamBeginCapture")
        try:
            record(self.stream)
        except TargetError as err:
            ended, *graph = cu.cuStreamEndCapture(self.stream)  # the stream leaves capture; the launch's error
            handles[0] = graph[0] if ended == cu.CUresult.CUDA_SUCCESS and graph else None  # is the one to report
            raise TargetError(f"one inference cannot be captured in a CUDA graph: {err}") from None
        except BaseException:
            cu.cuStreamEndCapture(self.stream)
            raise
        handles[0] = _check(cu.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        self.exec = handles[1] = _check(cu.cuGraphInstantiate(handles[0], 0), "cuGraphInstantiate")
        self._recorded = record  # its launches hold the buffers whose pointers the graph passes

    def launch(self) -> None:
        cu = self.device._current()
        _check(cu.cuGraphLaunch(self.exec, self.stream), "cuGraphLaunch")


def _destroy_graph(device: Device, stream, graph_and_exec: list) -> None:
    cu = _bindings()
    cu.cuCtxSetCurrent(device.context)
    graph, graph_exec = graph_and_exec
    if graph_exec is not None:
        cu.cuGraphExecDestroy(graph_exec)
    if graph is not None:
        cu.cuGraphDestroy(graph)
    cu.cuStreamDestroy(stream)  # from the garbage collector, where raising would only print


def _unload(device: Device, module) -> None:
    cu = _bindings()
    cu.cuCtxSetCurrent(device.context)
    cu.cuModuleUnload(module)  # runs from the garbage collector, where raising would only print


def _kernel_params(args: list) -> tuple[tuple, tuple]:
    """cuda-bindings' kernel-parameter form: (values, ctypes types), one pair per parameter.

    Pointers go as c_void_p: a plain int with type None is refused by cuda-bindings, which
    takes None only for its own objects (CUdeviceptr and the like). Makes no driver call, so a
    bad argument is refused before the launch touches the GPU.
    """
    values, types = [], []
    for i, arg in enumerate(args):
        if isinstance(arg, DeviceBuffer):
            arg._require_alive()
            values.append(arg.ptr)
            types.append(ctypes.c_void_p)
        elif isinstance(arg, np.int64):
            values.append(int(arg))
            types.append(ctypes.c_int64)
        elif isinstance(arg, (int, np.integer)):
            if not -(2**31) <= int(arg) < 2**31:
                raise InputError(f"kernel argument {i} = {arg} does not fit the int32 it is passed as")
            values.append(int(arg))
            types.append(ctypes.c_int32)
        elif isinstance(arg, (float, np.floating)):
            values.append(float(arg))
            types.append(ctypes.c_float)
        else:
            raise InputError(f"kernel argument {i} is a {type(arg).__name__}: expected a DeviceBuffer, int or float")
    return tuple(values), tuple(types)


def time_kernel(run, device: Device, warmup: int = 5, repeat: int = 50, stream=None) -> list[float]:
    """Seconds taken by each of ``repeat`` calls of ``run()``, after ``warmup`` untimed calls.

    Each call is bracketed by a pair of CUDA events on ``stream`` (the default stream if None),
    where ``run`` must launch, and waited for before the next, so a time covers the launches and
    the GPU work of one call, with no overlap between calls; the one pair is reused, being idle
    between calls.
    """
    cu = device._current()
    for _ in range(warmup):
        run()
    device.synchronize()
    start, stop = (_check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate") for _ in range(2))
    try:
        times = []
        for _ in range(repeat):
            _check(cu.cuEventRecord(start, 0 if stream is None else stream), "cuEventRecord")
            run()
            _check(cu.cuEventRecord(stop, 0 if stream is None else stream), "cuEventRecord")
            _check(cu.cuEventSynchronize(stop), "cuEventSynchronize")
            times.append(_check(cu.cuEventElapsedTime(start, stop), "cuEventElapsedTime") / 1e3)
        return times
    finally:
        for event in (start, stop):
            _check(cu.cuEventDestroy(event), "cuEventDestroy")
