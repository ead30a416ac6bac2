"""The CUDA source nvcc gets, run on the CPU: every GPU thread a fiber (no GPU, no TVM).

``build`` compiles the exact source with the host C++ compiler against ``emulator/``: a header
that gives CUDA's names (blocks, threads, ``__syncthreads``, warp shuffles and votes, the
cooperative-groups grid barrier, shared and dynamic shared memory, math intrinsics) and a
runtime that runs every thread of every block as a fiber, one at a time, in a chosen order
between barriers. The kernel is built with ``-fsanitize=thread`` and ``-fsanitize=bounds``, whose
hooks the runtime defines: every access to shared or global memory is checked for a race with no
barrier between (``__syncthreads`` within a block, the grid barrier across blocks) and for
falling outside every buffer, and a register array indexed past its end is caught. A barrier
not every thread reaches is a deadlock, reported with the kernel, block and threads.

``EmulatedDevice`` has the interface of ``souffle.runtime.cuda.Device`` that
``souffle.runtime.artifact.Launcher`` uses, so an artifact's launch plan (host loops, kernel
order, arguments, grids) runs unchanged; the grid is the user's (a persistent kernel is right at
any grid size), at most the launch's tiles. Every buffer it allocates starts poisoned (0xff
bytes: NaN floats), and so does each block's shared memory.

Asynchronous copies (``cp.async``, TVM's inline PTX, rewritten by ``emulable``) read their source
when issued and land only when a ``cp.async.wait_group`` retires their group, the latest a GPU may
land them: a thread that reads its copy before the wait reads what was there, another thread's
read with no ``__syncthreads`` after that wait is a race, and a copy never waited on is an error.
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
from pathlib import Path

import numpy as np

from souffle.errors import SouffleError, TargetError

EMULATOR = Path(__file__).parent / "emulator"
HEADER = EMULATOR / "souffle_emulated.h"
RUNTIME = EMULATOR / "runtime.cpp"
ORDERS = ("ascending", "descending", "random")
DEFAULT_GRID = 2
_KERNEL_FLAGS = ("-x", "c++", "-std=gnu++17", "-O1", "-g1", "-fPIC", "-w", "-fsanitize=thread,bounds",
                 "-fno-sanitize-recover=bounds")
_RUNTIME_FLAGS = ("-std=gnu++17", "-O2", "-fPIC", "-w")
_PADDING = 64  # bytes after each buffer, outside it: an access past its end lands there and is caught
_ERROR_LINES = 12  # of the compiler's output shown in a build error


class EmulationError(SouffleError, RuntimeError):
    """The emulated kernel did something a GPU would get wrong or hang on: a data race, a
    deadlock at a barrier, an access outside every buffer; the message names the kernel,
    block, threads and source lines."""


def kernel_signature(source: str, kernel: str = "main_kernel") -> list[tuple[str, str]]:
    """(C type, name) of each parameter of ``kernel``'s definition in CUDA ``source``, in order."""
    bounds = r"__launch_bounds__\(\d+(?:,\s*\d+)?\)\s+"  # threads, and blocks per SM where given
    match = re.search(rf"__global__\s+void\s+(?:{bounds})?{kernel}\s*\(([^)]*)\)\s*{{", source)
    if match is None:
        raise TargetError(f"no definition of {kernel} in the generated CUDA source")
    params = []
    for text in match.group(1).split(","):
        words = text.replace("__restrict__", " ").replace("*", " * ").split()
        params.append((" ".join(words[:-1]), words[-1]))
    return params


def _compiler() -> str:
    path = shutil.which(os.environ.get("CXX", "g++"))
    if path is None:
        raise TargetError("the cuda-emulated target needs a host C++ compiler: g++ not found on PATH (or set CXX)")
    return path


@functools.cache
def _compiler_version(path: str) -> str:
    return subprocess.run([path, "--version"], check=False, capture_output=True, text=True).stdout.strip()


def _cache_dir() -> Path:
    if root := os.environ.get("SOUFFLE_CACHE_DIR"):
        return Path(root) / "emulated"
    return Path.home() / ".cache" / "souffle" / "emulated"


# TVM's inline PTX for cp.async (``codegen.tensor_core``'s asynchronous pipeline), as its CUDA code
# generator prints it, and the emulator's calls that replace it (``emulator/souffle_emulated.h``).
_CP_ASYNC = re.compile(r'unsigned int (\w+) = __cvta_generic_to_shared\((\w+)\);\s*'
                       r'asm volatile\("cp\.async\.c[ag]\.shared\.global \[%0\], \[%1\], %2;"\s*'
                       r'::\s*"r"\(\1\), "l"\((\w+)\), "n"\((\d+)\)\);')
# a padded operand's copy: where the predicate is 1 the copy, else zeros stored at once
_CP_ASYNC_PREDICATED = re.compile(
    r'unsigned int (\w+) = __cvta_generic_to_shared\((\w+)\);\s*__asm__ __volatile__\(\s*'
    r'"\{\\n"\s*" \.reg \.pred p;\\n"\s*" setp\.eq\.u32 p, %3, 1;\\n"\s*'
    r'" @p cp\.async\.c[ag]\.shared\.global \[%0\], \[%1\], %2;\\n"\s*'
    r'" @!p st\.shared\.v\d\.u32 \[%0\], \{[^}]*\};\\n"\s*"\}\\n"\s*'
    r'::\s*"r"\(\1\), "l"\((\w+)\), "n"\((\d+)\), "r"\((\w+)\), "r"\(0\)\s*\);')
_CP_ASYNC_COMMIT = re.compile(r'asm volatile\("cp\.async\.commit_group;"[^;]*\);')
_CP_ASYNC_WAIT = re.compile(r'asm volatile\("cp\.async\.wait_group (\d+);"[^;]*\);')


def emulable(source: str) -> str:
    """``source`` with TVM's inline PTX for cp.async replaced by the emulator's calls; a form of
    cp.async it does not know is a TargetError, never PTX the host compiler would choke on or,
    worse, copies the emulator would not model."""
    text = _CP_ASYNC.sub(r"souffle_cp_async(\2, \3, \4);", source)
    text = _CP_ASYNC_PREDICATED.sub(r"if (\5 == 1) souffle_cp_async(\2, \3, \4); else souffle_zeros(\2, \4);", text)
    text = _CP_ASYNC_COMMIT.sub("souffle_cp_async_commit();", text)
    text = _CP_ASYNC_WAIT.sub(r"souffle_cp_async_wait(\1);", text)
    for number, line in enumerate(text.splitlines(), 1):
        if "cp.async" in line:
            raise TargetError(f"the cuda-emulated target does not model this cp.async (line {number}): {line.strip()}")
    return text


def _glue(source: str, kernels: tuple[str, ...], dynamic_shared: int) -> str:
    """An entry ``souffle_entry_<kernel>(void** args)`` per kernel, and the dynamic shared array
    the source declares ``extern``, sized for the largest launch."""
    lines = ["#include <cstdint>", "#include <cuda_fp16.h>", "#include <cuda_bf16.h>", "#define uint unsigned int",
             "#define uchar unsigned char"]
    for kernel in kernels:
        params = kernel_signature(source, kernel)
        lines.append(f'extern "C" void {kernel}({", ".join(ctype for ctype, _ in params)});')
        args = ", ".join(f"({ctype})args[{i}]" if ctype.endswith("*") else f"*({ctype}*)args[{i}]"
                         for i, (ctype, _) in enumerate(params))
        lines.append(f'extern "C" void souffle_entry_{kernel}(void** args) {{ {kernel}({args}); }}')
    for ctype, name in set(re.findall(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w ]+?)\s+(\w+)\[\]", source)):
        lines.append(f"thread_local __attribute__((aligned(64))) {ctype} {name}[{max(dynamic_shared, 1)} / sizeof({ctype}) + 1];")
    return "\n".join(lines) + "\n"


def build(source: str, kernels: tuple[str, ...], dynamic_shared: int = 0) -> Path:
    """The shared library of CUDA ``source`` built for emulation (``kernels`` its ``__global__``
    functions, ``dynamic_shared`` the most dynamic shared memory a launch asks for), cached by
    source, emulator and compiler. A compile error is a TargetError with the first error lines."""
    compiler = _compiler()
    text = emulable(source)
    key = json.dumps({"source": text, "kernels": kernels, "dynamic_shared": dynamic_shared,
                      "header": HEADER.read_text(), "runtime": RUNTIME.read_text(),
                      "stubs": sorted((str(p.relative_to(EMULATOR)), p.read_text())
                                      for p in (EMULATOR / "include").rglob("*") if p.is_file()),
                      "flags": [_KERNEL_FLAGS, _RUNTIME_FLAGS], "compiler": _compiler_version(compiler)}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()
    library = _cache_dir() / f"{digest}.so"
    if library.exists():
        return library
    with tempfile.TemporaryDirectory(prefix="souffle-emulated-") as work:
        work = Path(work)
        (work / "kernel.cu").write_text(text)
        (work / "glue.cpp").write_text(_glue(source, kernels, dynamic_shared))
        steps = {
            "the kernel": [compiler, *_KERNEL_FLAGS, "-include", str(HEADER), "-I", str(EMULATOR / "include"), "-c",
                           "kernel.cu", "-o", "kernel.o"],
            "its entry points": [compiler, *_RUNTIME_FLAGS, "-I", str(EMULATOR / "include"), "-c", "glue.cpp", "-o",
                                 "glue.o"],
            "the emulator": [compiler, *_RUNTIME_FLAGS, "-c", str(RUNTIME), "-o", "runtime.o"],
            "the link": [compiler, "-shared", "-Wl,-z,defs", "kernel.o", "glue.o", "runtime.o", "-o", "kernel.so",
                         "-ldl"],
        }
        for what, command in steps.items():
            result = subprocess.run(command, cwd=work, check=False, capture_output=True, text=True)
            if result.returncode != 0:
                output = result.stderr.splitlines()
                shown = "\n".join(([line for line in output if "error" in line] or output)[:_ERROR_LINES])
                raise TargetError(f"the emulated build of the CUDA source failed in {what}:\n{shown}")
        library.parent.mkdir(parents=True, exist_ok=True)
        temporary = library.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(work / "kernel.so", temporary)
        os.replace(temporary, library)
    return library


class EmulatedBuffer:
    """Device memory on the CPU: a numpy byte array, poisoned (0xff) when allocated."""

    def __init__(self, device: EmulatedDevice, nbytes: int):
        self.device = device
        self.nbytes = nbytes
        self.bytes = np.full(nbytes + _PADDING, 0xFF, dtype=np.uint8)

    @property
    def ptr(self) -> int:
        return self.bytes.ctypes.data

    def upload(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        if data.size > self.nbytes:
            raise SouffleError(f"upload of {data.size} B into a buffer of {self.nbytes} B")
        self.bytes[:data.size] = data

    def fill(self, byte: int) -> None:
        self.bytes[:self.nbytes] = byte

    def download(self, dtype, shape) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        return self.bytes[:count * dtype.itemsize].view(dtype).reshape(shape).copy()

    def free(self) -> None:
        self.bytes = np.empty(0, dtype=np.uint8)


class EmulatedDevice:
    """What ``Launcher`` needs of a GPU, emulated: ``grid`` blocks ("SMs" of one block each),
    threads run in ``order`` (ascending, descending or random with ``seed``)."""

    arch = "emulated"

    def __init__(self, grid: int = DEFAULT_GRID, order: str = "ascending", seed: int = 0):
        if order not in ORDERS:
            raise SouffleError(f"unknown thread order {order!r}; use one of {', '.join(ORDERS)}")
        if type(grid) is not int or grid < 1:
            raise SouffleError(f"the emulated grid must be a positive number of blocks, got {grid!r}")
        self.sms = grid
        self.order = order
        self.seed = seed
        self.launches = 0
        self.name = f"cuda-emulated ({grid} blocks, {order} thread order{f', seed {seed}' if order == 'random' else ''})"

    def __repr__(self):
        return f"<EmulatedDevice {self.name}>"

    def alloc(self, nbytes: int) -> EmulatedBuffer:
        return EmulatedBuffer(self, nbytes)

    def upload(self, array: np.ndarray) -> EmulatedBuffer:
        array = np.ascontiguousarray(array)
        buffer = self.alloc(array.nbytes)
        buffer.upload(array)
        return buffer

    def synchronize(self) -> None:
        """Launches run to completion; nothing is pending."""

    def load_kernels(self, source: str, cubins: dict, names: tuple[str, ...], dynamic_shared: int) -> dict:
        library = build(source, names, dynamic_shared)
        module = EmulatedModule(ctypes.CDLL(str(library)))
        module.cdll.souffle_emulate.restype = ctypes.c_int
        return {name: EmulatedKernel(self, module, library, source, name, dynamic_shared) for name in names}


class EmulatedModule:
    """An emulated build's library, with its ``__device__`` variables as the GPU's Module has them."""

    def __init__(self, cdll: ctypes.CDLL):
        self.cdll = cdll

    def _global(self, name: str, nbytes: int):
        return (ctypes.c_uint8 * nbytes).in_dll(self.cdll, name)

    def read_global(self, name: str, dtype, shape) -> np.ndarray:
        out = np.empty(shape, dtype)
        return np.frombuffer(bytes(self._global(name, out.nbytes)), dtype=dtype).reshape(shape).copy()

    def zero_global(self, name: str, nbytes: int) -> None:
        ctypes.memset(self._global(name, nbytes), 0, nbytes)


class EmulatedKernel:
    """One ``__global__`` function of an emulated build, launched like ``souffle.runtime.cuda.Kernel``."""

    def __init__(self, device: EmulatedDevice, module, library: Path, source: str, name: str, dynamic_shared: int):
        self.device = device
        self.module = module
        self.library = library
        self.source = source
        self.name = name
        self.dynamic_shared = dynamic_shared
        self.params = kernel_signature(source, name)
        self.entry = getattr(module.cdll, f"souffle_entry_{name}")

    def max_active_blocks_per_sm(self, threads: int, dynamic_smem: int = 0) -> int:
        return 1

    def allow_dynamic_shared(self, nbytes: int) -> None:
        if nbytes > self.dynamic_shared:
            raise TargetError(f"{self.name}: {nbytes} B of dynamic shared memory asked, the build has {self.dynamic_shared}")

    def prepare(self, grid: int, threads, args: list, cooperative: bool = True, stream=None, shared_bytes: int = 0):
        """A call that makes this launch (``souffle.runtime.cuda.Kernel.prepare``'s interface)."""
        return functools.partial(self.launch, grid, threads, args, cooperative, shared_bytes)

    def launch(self, grid: int, threads, args: list, cooperative: bool = True, shared_bytes: int = 0) -> None:
        block = tuple(threads) + (1,) * (3 - len(threads)) if isinstance(threads, tuple) else (threads, 1, 1)
        if len(args) != len(self.params):
            raise SouffleError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        self.allow_dynamic_shared(shared_bytes)
        values, regions, names = [], [], []
        for (ctype, name), arg in zip(self.params, args):
            if isinstance(arg, EmulatedBuffer):
                values.append(ctypes.c_void_p(arg.ptr))
                regions += [arg.ptr, arg.nbytes]
                names.append(name.removesuffix("_ptr"))
            else:
                scalar = np.array(arg, dtype=np.int64 if "64" in ctype else np.int32)
                values.append(scalar)
        pointers = (ctypes.c_void_p * len(values))(
            *[v.value if isinstance(v, ctypes.c_void_p) else v.ctypes.data for v in values])
        region_array = (ctypes.c_size_t * len(regions))(*regions)
        error, pcs = ctypes.create_string_buffer(4096), ctypes.create_string_buffer(256)
        order = ORDERS.index(self.device.order)
        seed = self.device.seed * 1_000_003 + self.device.launches
        self.device.launches += 1
        failed = self.module.cdll.souffle_emulate(
            self.entry, pointers, self.name.encode(), ctypes.c_int(grid), ctypes.c_uint(block[0]),
            ctypes.c_uint(block[1]), ctypes.c_uint(block[2]), region_array, ctypes.c_int(len(names)),
            "\n".join(names).encode(), ctypes.c_int(order), ctypes.c_uint64(seed), error, ctypes.c_size_t(len(error)),
            pcs, ctypes.c_size_t(len(pcs)))
        if failed:
            raise EmulationError(error.value.decode() + self._lines(pcs.value.decode().split()))

    def _lines(self, offsets: list[str]) -> str:
        """The kernel source lines of the instructions at ``offsets`` in the library, via addr2line."""
        tool = shutil.which("addr2line")
        if not offsets or tool is None:
            return ""
        result = subprocess.run([tool, "-e", str(self.library), *(hex(max(int(o) - 1, 0)) for o in offsets)],
                                check=False, capture_output=True, text=True)
        source = self.source.splitlines()
        shown = []
        for location in result.stdout.split():
            match = re.fullmatch(r".*kernel\.cu:(\d+).*", location)
            if match and 0 < int(match[1]) <= len(source):
                line = int(match[1])
                shown.append(f"  line {line}: {source[line - 1].strip()[:300]}")
        return ("\n" + "\n".join(shown)) if shown else ""
