"""The staged program as ONE persistent, grid-synchronized CUDA kernel.

``persistent_kernel`` wraps every stage in a single ``blockIdx.x`` binding over a grid whose
size is a kernel argument: each stage walks its tiles ``block, block + grid, ...``, a
``T.cuda.grid_sync()`` (cooperative groups' ``this_grid().sync()``) stands where
``codegen.staging`` placed a barrier, and a scan is a plain loop around its stages, run by
every block. TVM lowers the one PrimFunc to one ``__global__`` function; its registers and
shared memory, read back from ptxas, give the co-resident grid on a device model
(``co_resident_grid``), and a kernel that cannot be co-resident is refused with the numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import tvm
from tvm import tirx

from analysis.device import DeviceModel
from codegen.schedule import THREADS
from codegen.staging import Loop, StagedProgram, seq, slot_views, tiled_stage
from souffle.errors import TargetError

KERNEL_NAME = "main_kernel"
GRID_PARAM = "grid_size"
REGISTER_ALLOCATION_UNIT = 256  # registers are allocated per warp in units of 256 (sm_70 and later)
SHARED_RESERVED_PER_BLOCK = 1024  # bytes the CUDA runtime reserves per resident block (sm_80 and later)


def _grid_sync() -> tirx.Stmt:
    return tirx.Evaluate(tirx.call_intrin("", "tirx.cuda.grid_sync"))


def _statements(items: list, block: tirx.Var, grid: tirx.Var) -> list[tirx.Stmt]:
    stmts: list[tirx.Stmt] = []
    for item in items:
        if isinstance(item, Loop):
            if item.barrier is not None:
                stmts.append(_grid_sync())
            stmts.append(tirx.For(item.var, 0, item.trips, tirx.ForKind.SERIAL,
                                  seq(_statements(item.items, block, grid))))
            continue
        if item.barrier is not None:
            stmts.append(_grid_sync())
        stmts.append(tiled_stage(item, block, grid))
    return stmts


def persistent_kernel(staged: StagedProgram) -> tirx.PrimFunc:
    """The whole staged program as one PrimFunc with one ``blockIdx.x`` binding."""
    block = tirx.Var("block", "int32")
    grid = tirx.Var(GRID_PARAM, "int32")
    body = seq(slot_views(staged) + _statements(staged.items, block, grid))
    binding = tirx.IterVar(tvm.ir.Range(0, grid), block, tirx.IterVar.ThreadIndex, "blockIdx.x")
    loop = tirx.For(block, 0, grid, tirx.ForKind.THREAD_BINDING, body, thread_binding=binding)
    return tirx.PrimFunc(staged.parameters() + [grid], loop).with_attr("global_symbol", "main")


def cuda_target(arch: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": arch})


def cuda_source(func: tirx.PrimFunc, arch: str) -> str:
    """TVM's CUDA code for the kernel (no GPU needed: TVM emits source, nvcc compiles it later).

    ``tirx.merge_static_smem`` makes TVM pool the stages' shared-memory buffers by liveness
    (the kernel needs the most any stage needs, not the sum); its TVM 0.27 implementation
    fails on a block-wide all-reduce, which is why reductions stay within a warp.
    """
    with tvm.transform.PassContext(config={"tirx.merge_static_smem": True}):
        executable = tvm.compile(tvm.IRModule({"main": func}), target=cuda_target(arch))
    return executable.mod.imports[0].inspect_source()


def kernel_count(source: str) -> int:
    """``__global__`` functions defined (not just declared) in a CUDA source."""
    return len(re.findall(r"__global__[^;{]*\{", source))


def kernel_signature(source: str) -> list[tuple[str, str]]:
    """(C type, name) of each parameter of the kernel's definition, in order."""
    match = re.search(rf"__global__\s+void\s+(?:__launch_bounds__\(\d+\)\s+)?{KERNEL_NAME}\s*\(([^)]*)\)\s*{{", source)
    if match is None:
        raise TargetError(f"no definition of {KERNEL_NAME} in the generated CUDA source")
    params = []
    for text in match.group(1).split(","):
        words = text.replace("__restrict__", " ").replace("*", " * ").split()
        params.append((" ".join(words[:-1]), words[-1]))
    return params


def argument_order(source: str, staged: StagedProgram) -> list[str]:
    """The kernel's parameters as our buffer names (and ``grid_size``), in the order TVM chose."""
    known = {b.name for b in staged.parameters()}
    order = []
    for _, name in kernel_signature(source):
        base = name.removesuffix("_ptr")
        if base not in known and base != GRID_PARAM:
            raise TargetError(f"kernel parameter {name!r} matches no buffer of the staged program")
        order.append(base)
    return order


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


def co_resident_grid(registers: int, shared_bytes: int, device: DeviceModel, threads: int = THREADS) -> Occupancy:
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

