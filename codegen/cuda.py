"""The staged program as ONE persistent, grid-synchronized CUDA kernel (or, where the opt
level or the partition starts new kernels, one kernel per subprogram).

``persistent_kernel`` wraps every stage in a single ``blockIdx.x`` binding over a grid whose
size is a kernel argument: each stage walks its tiles ``block, block + grid, ...``, a
``T.cuda.grid_sync()`` (cooperative groups' ``this_grid().sync()``) stands where
``codegen.staging`` placed a barrier, and a scan is a plain loop around its stages, run by
every block. TVM lowers the one PrimFunc to one ``__global__`` function; its registers and
shared memory, read back from ptxas, give the co-resident grid on a device model
(``co_resident_grid``), and a kernel that cannot be co-resident is refused with the numbers.

Where stages start new kernels (``Stage.launch``), ``kernel_plan`` makes each run of stages
between two starts a kernel of its own, and a loop with a kernel start inside runs on the
host (``HostLoop``), its kernels taking the loop counters as arguments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import tvm
from tvm import tirx

from analysis.device import DeviceModel
from codegen.schedule import THREADS, WARP
from codegen.staging import (
    Loop,
    StagedProgram,
    loops_in,
    on_chip_loads,
    parameters_used,
    seq,
    slot_views,
    stages_in,
    tiled_stage,
)
from souffle.errors import TargetError

KERNEL_NAME = "main_kernel"
GRID_PARAM = "grid_size"
REGISTER_ALLOCATION_UNIT = 256  # registers are allocated per warp in units of 256 (sm_70 and later)
SHARED_RESERVED_PER_BLOCK = 1024  # bytes the CUDA runtime reserves per resident block (sm_80 and later)


def _grid_sync() -> tirx.Stmt:
    return tirx.Evaluate(tirx.call_intrin("", "tirx.cuda.grid_sync"))


def _block_sync() -> tirx.Stmt:
    return tirx.Evaluate(tirx.call_intrin("int32", "tirx.tvm_storage_sync", "shared"))


def _thread_loop(var: tirx.Var, extent: int, tag: str, body: tirx.Stmt) -> tirx.Stmt:
    binding = tirx.IterVar(tvm.ir.Range(0, extent), var, tirx.IterVar.ThreadIndex, tag)
    return tirx.For(var, 0, extent, tirx.ForKind.THREAD_BINDING, body, thread_binding=binding)


def _block_threads(threads: int):
    """``elements(n, body)`` for ``on_chip_loads``: element e = (i * warps + warp) * 32 + lane."""
    def elements(n: int, body) -> tirx.Stmt:
        warp, lane, i = tirx.Var("ty", "int32"), tirx.Var("tx", "int32"), tirx.Var("i", "int32")
        e = i * threads + warp * WARP + lane
        rounds = tirx.For(i, 0, -(-n // threads), tirx.ForKind.SERIAL, tirx.IfThenElse(e < n, body(e), None))
        return _thread_loop(warp, threads // WARP, "threadIdx.y", _thread_loop(lane, WARP, "threadIdx.x", rounds))
    return elements


def _statements(items: list, block: tirx.Var, grid: tirx.Var, threads: int, memory: dict) -> list[tirx.Stmt]:
    stmts: list[tirx.Stmt] = []
    for item in items:
        if isinstance(item, Loop):
            if item.barrier is not None:
                stmts.append(_grid_sync())
            if item.loads:
                stmts += [on_chip_loads(load, memory[load.dtype], block, grid, load.offset, _block_threads(threads))
                          for load in item.loads]
                stmts.append(_block_sync())
            stmts.append(tirx.For(item.var, 0, item.trips, tirx.ForKind.SERIAL,
                                  seq(_statements(item.items, block, grid, threads, memory))))
            continue
        if item.barrier is not None:
            stmts.append(_grid_sync())
        stmts.append(tiled_stage(item, block, grid, lambda load: (memory[load.dtype], load.offset)))
    return stmts


def persistent_kernel(staged: StagedProgram, items: list | None = None, counters: tuple = (),
                      name: str = "main") -> tirx.PrimFunc:
    """``items`` (by default the whole staged program) as one PrimFunc with one ``blockIdx.x``
    binding; ``counters`` are the host loops' variables, passed as arguments."""
    block = tirx.Var("block", "int32")
    grid = tirx.Var(GRID_PARAM, "int32")
    whole = items is None
    items = staged.items if whole else items
    memory = staged.on_chip_memory() if any(loop.loads for loop in loops_in(items)) else {}
    allocations = [tirx.AllocBuffer(buffer) for buffer in memory.values()]
    views = slot_views(staged, None if whole else items)
    body = seq(allocations + views + _statements(items, block, grid, staged.threads, memory))
    binding = tirx.IterVar(tvm.ir.Range(0, grid), block, tirx.IterVar.ThreadIndex, "blockIdx.x")
    loop = tirx.For(block, 0, grid, tirx.ForKind.THREAD_BINDING, body, thread_binding=binding)
    params = staged.parameters() if whole else parameters_used(staged, items)
    return tirx.PrimFunc(params + list(counters) + [grid], loop).with_attr("global_symbol", name)


@dataclass(frozen=True)
class Launch:
    """Launch kernel ``kernel`` (cooperatively when it synchronizes the grid inside)."""

    kernel: str
    cooperative: bool
    max_tiles: int  # the widest stage's tiles: more blocks than that would idle
    dynamic_shared: int = 0  # bytes of dynamic shared memory per block (on-chip weights)
    min_grid: int = 1  # fewer blocks would leave on-chip weight slices unloaded


@dataclass(frozen=True)
class HostLoop:
    """A loop the host runs, its counter ``counter`` passed to the kernels it launches."""

    counter: str
    trips: int
    body: tuple


@dataclass
class KernelPlan:
    """The kernels of a staged program, and the order the host launches them in."""

    funcs: dict[str, tirx.PrimFunc] = field(default_factory=dict)
    launches: list = field(default_factory=list)

    @property
    def kernel_names(self) -> list[str]:
        return [f"{name}_kernel" for name in self.funcs]

    def kernel_launches(self, launches: list | None = None):
        """Every ``Launch``, host loops' bodies included once."""
        for launch in self.launches if launches is None else launches:
            if isinstance(launch, HostLoop):
                yield from self.kernel_launches(list(launch.body))
            else:
                yield launch


def kernel_plan(staged: StagedProgram) -> KernelPlan:
    """One kernel per run of items between kernel starts; a loop with a kernel start inside
    becomes a host loop. A program without kernel starts is one kernel, ``main``."""
    plan = KernelPlan()
    many = staged.kernel_count() > 1

    def kernels(items: list, counters: tuple) -> list:
        launches, run = [], []

        def close():
            if run:
                name = f"k{len(plan.funcs)}" if many else "main"
                plan.funcs[name] = persistent_kernel(staged, list(run), counters, name)
                stages = list(stages_in(run))
                loads = [load for loop in loops_in(run) for load in loop.loads]
                barriers = [item for item in [*stages, *loops_in(run)] if item.barrier is not None]
                launches.append(Launch(name, bool(barriers),
                                       max(s.schedule.n_tiles for s in stages), sum(load.bytes for load in loads),
                                       max((load.min_grid for load in loads), default=1)))
                run.clear()

        for item in items:
            if isinstance(item, Loop) and item.on_host:
                close()
                body = kernels(item.items, counters + (item.var,))
                launches.append(HostLoop(item.var.name, item.trips, tuple(body)))
                continue
            if item.launch is not None:
                close()
            run.append(item)
        close()
        return launches

    plan.launches = kernels(staged.items, ())
    return plan




def cuda_target(arch: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": arch})


def cuda_source(funcs: tirx.PrimFunc | dict, arch: str) -> str:
    """TVM's CUDA code for the kernel (no GPU needed: TVM emits source, nvcc compiles it later).

    ``tirx.merge_static_smem`` makes TVM pool the stages' shared-memory buffers by liveness
    (the kernel needs the most any stage needs, not the sum); its TVM 0.27 implementation
    fails on a block-wide all-reduce, which is why reductions stay within a warp.
    """
    funcs = funcs if isinstance(funcs, dict) else {"main": funcs}
    with tvm.transform.PassContext(config={"tirx.merge_static_smem": True}):
        executable = tvm.compile(tvm.IRModule(funcs), target=cuda_target(arch))
    return executable.mod.imports[0].inspect_source()


def kernel_count(source: str) -> int:
    """``__global__`` functions defined (not just declared) in a CUDA source."""
    return len(re.findall(r"__global__[^;{]*\{", source))


def kernel_signature(source: str, kernel: str = KERNEL_NAME) -> list[tuple[str, str]]:
    """(C type, name) of each parameter of ``kernel``'s definition, in order."""
    match = re.search(rf"__global__\s+void\s+(?:__launch_bounds__\(\d+\)\s+)?{kernel}\s*\(([^)]*)\)\s*{{", source)
    if match is None:
        raise TargetError(f"no definition of {kernel} in the generated CUDA source")
    params = []
    for text in match.group(1).split(","):
        words = text.replace("__restrict__", " ").replace("*", " * ").split()
        params.append((" ".join(words[:-1]), words[-1]))
    return params


def argument_order(source: str, staged: StagedProgram, kernel: str = KERNEL_NAME) -> list[str]:
    """The kernel's parameters as our buffer names, loop counters and ``grid_size``, in the
    order TVM chose."""
    known = {b.name for b in staged.parameters()} | {loop.var.name for loop in loops_in(staged.items)}
    order = []
    for _, name in kernel_signature(source, kernel):
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

