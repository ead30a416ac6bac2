"""The staged program as ONE persistent, grid-synchronized CUDA kernel (or, where the opt
level or the partition starts new kernels, one kernel per subprogram).

``persistent_kernel`` wraps every stage in a single ``blockIdx.x`` binding over a grid whose
size is a kernel argument: each stage walks its tiles ``block, block + grid, ...``, a
``T.cuda.grid_sync()`` (cooperative groups' ``this_grid().sync()``) stands where
``codegen.barriers`` placed a barrier, and a scan is a plain loop around its stages, run by
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

import numpy as np
import tvm
from tvm import tirx

from analysis.device import DeviceModel, Occupancy, co_resident_grid
from analysis.threads import lower_for_device
from codegen.staged import Loop, StagedProgram, loops_in, stages_in
from codegen.stitch import BufferRef, align, seq
from codegen.schedule import POOL_ALIGN_BYTES, WARP, pool_offsets, pooled_shared
from codegen.tf32 import tf32_source
from codegen.tiled import on_chip_loads, parameters_used, slot_views, tiled_stage
from souffle.errors import TargetError
from souffle.passes import Outcome
from souffle.runtime.cuda import KernelResources, compile_cubin
from souffle.runtime.emulated import build as emulated_build
from souffle.runtime.emulated import kernel_signature

KERNEL_NAME = "main_kernel"
GRID_PARAM = "grid_size"
PASS_CONFIG = {"tirx.merge_static_smem": True, "tirx.use_async_copy": True}  # TVM's lowering of every kernel (source and validation)


def _grid_sync() -> tirx.Stmt:
    return tirx.Evaluate(tirx.call_intrin("", "tirx.cuda.grid_sync"))


def _block_sync() -> tirx.Stmt:
    return tirx.Evaluate(tirx.call_intrin("int32", "tirx.tvm_storage_sync", "shared"))


def thread_loop(var: tirx.Var, extent: int, tag: str, body: tirx.Stmt) -> tirx.Stmt:
    """``for var in thread_binding(extent, tag): body``."""
    binding = tirx.IterVar(tvm.ir.Range(0, extent), var, tirx.IterVar.ThreadIndex, tag)
    return tirx.For(var, 0, extent, tirx.ForKind.THREAD_BINDING, body, thread_binding=binding)


def _block_threads(threads: int):
    """``elements(n, body)`` for ``on_chip_loads``: element e = (i * warps + warp) * 32 + lane."""
    def elements(n: int, body) -> tirx.Stmt:
        warp, lane, i = tirx.Var("ty", "int32"), tirx.Var("tx", "int32"), tirx.Var("i", "int32")
        e = i * threads + warp * WARP + lane
        rounds = tirx.For(i, 0, -(-n // threads), tirx.ForKind.SERIAL, tirx.IfThenElse(e < n, body(e), None))
        return thread_loop(warp, threads // WARP, "threadIdx.y", thread_loop(lane, WARP, "threadIdx.x", rounds))
    return elements


def _statements(items: list, block: tirx.Var, grid: tirx.Var, threads: int, memory: dict,
                pools: dict) -> list[tirx.Stmt]:
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
                                  seq(_statements(item.items, block, grid, threads, memory, pools))))
            continue
        if item.barrier is not None:
            stmts.append(_grid_sync())
        elif item.block_barrier is not None:
            stmts.append(_block_sync())
        stmts.append(tiled_stage(item, block, grid, lambda load: (memory[load.dtype], load.offset), pools))
    return stmts


def _cleared(buffer: tirx.Buffer, start: int, end: int, threads: int) -> tirx.Stmt:
    """The block's threads zero elements ``[start, end)`` of ``buffer`` (the stages' pool) once,
    when the kernel starts. The stages reach the pool only through views, and TVM's
    ``StorageRewrite`` refuses a buffer that no statement loads or stores directly ("occurred
    before its declaration"); zeroing it is such a statement, and costs a few stores per thread.
    It needs no ``__syncthreads`` of its own: a stage writes the pool only after one
    (``codegen.tiled.pool_shared``)."""
    return _block_threads(threads)(end - start, lambda e: tirx.BufferStore(buffer, tirx.const(0, buffer.dtype),
                                                                            [e + start]))


@dataclass(frozen=True)
class SharedLayout:
    """The kernel's one dynamic shared allocation, in bytes: each dtype's on-chip weight copies
    (``StagedProgram.on_chip``) in a region of their own, where ``on_chip[dtype]`` starts
    (``on_chip_elements[dtype]`` elements), then the pool the stages allocate their shared buffers
    in (``codegen.tiled.pool_shared``) from ``pool`` on, as large as the most any one stage needs
    (``pool_bytes``) and read as every dtype ``pool_dtypes`` of its stages' buffers."""

    on_chip: dict
    on_chip_elements: dict
    pool: int
    pool_bytes: int
    pool_dtypes: tuple

    @property
    def words(self) -> int:
        """The allocation's size in 4-byte words. Where there is no pool, one spare word at the
        end, which ``_cleared`` zeroes: TVM's ``StorageRewrite`` refuses an allocation that no
        statement loads or stores directly, and the stages reach it only through views."""
        end = align(self.pool + self.pool_bytes, POOL_ALIGN_BYTES)
        if not end:
            return 0
        return end // 4 + (0 if self.pool_bytes else 1)

    def cleared(self) -> tuple[int, int]:
        """The words zeroed when the kernel starts (``_cleared``): the pool, or the spare word.
        The on-chip weights are not: other threads load them, unsynchronized with the zeroing."""
        if self.pool_bytes:
            return self.pool // 4, -(-(self.pool + self.pool_bytes) // 4)
        return self.words - 1, self.words


def shared_layout(staged: StagedProgram, items: list) -> SharedLayout:
    """``items``' dynamic shared memory (``SharedLayout``), each region on ``POOL_ALIGN_BYTES``."""
    elements: dict[str, int] = {}
    for load in (load for loop in loops_in(items) for load in loop.loads):
        elements[load.dtype] = elements.get(load.dtype, 0) + load.elements
    on_chip, end = {}, 0
    for dtype, n in elements.items():
        on_chip[dtype] = end
        end = align(end + n * np.dtype(dtype).itemsize, POOL_ALIGN_BYTES)
    stages = list(stages_in(items))
    pool_bytes = max((pooled_shared(stage.func) for stage in stages), default=0)
    dtypes = tuple(dict.fromkeys(str(buffer.dtype) for stage in stages for buffer, _ in pool_offsets(stage.func)))
    return SharedLayout(on_chip, elements, end, pool_bytes, dtypes)


def dynamic_shared_bytes(staged: StagedProgram, items: list) -> int:
    return 4 * shared_layout(staged, items).words


def _dynamic_shared(staged: StagedProgram, items: list) -> tuple[list[tirx.Stmt], dict, dict]:
    """The kernel's dynamic shared memory: ONE allocation (``SharedLayout``), each dtype's on-chip
    region and each dtype's view of the pool a view into it; returns its statements, the on-chip
    regions by dtype and the pool's views by dtype (each with the element it starts at, 0). With
    one allocation per dtype, TVM's ``MergeSharedMemoryAllocations`` placed a float32 and a
    float16 region at the same bytes: it takes an allocation to be live only where it is accessed
    directly, and the stages reach their regions through views. The allocation is float32 so that
    zeroing the pool (``_cleared``) takes a store per 4 bytes."""
    layout = shared_layout(staged, items)
    if not layout.words:
        return [], {}, {}
    allocation = tirx.decl_buffer((layout.words,), "float32", name="on_chip", scope="shared.dyn")
    stmts = [tirx.AllocBuffer(allocation), _cleared(allocation, *layout.cleared(), staged.threads)]
    memory = {}
    for dtype, offset in layout.on_chip.items():
        memory[dtype] = tirx.decl_buffer((layout.on_chip_elements[dtype],), dtype, name=f"on_chip_{dtype}",
                                         scope="shared.dyn")
        stmts.append(tirx.DeclBuffer(memory[dtype], data=BufferRef(allocation, offset // 4, None).pointer()))
    pools = {}
    for dtype in layout.pool_dtypes:
        view = tirx.decl_buffer((layout.pool_bytes // np.dtype(dtype).itemsize,), dtype, name=f"pool_{dtype}",
                                scope="shared.dyn")
        stmts.append(tirx.DeclBuffer(view, data=BufferRef(allocation, layout.pool // 4, None).pointer()))
        pools[dtype] = (view, 0)
    return stmts, memory, pools


def persistent_kernel(staged: StagedProgram, items: list | None = None, counters: tuple = (),
                      name: str = "main") -> tirx.PrimFunc:
    """``items`` (by default the whole staged program) as one PrimFunc with one ``blockIdx.x``
    binding; ``counters`` are the host loops' variables, passed as arguments."""
    block = tirx.Var("block", "int32")
    grid = tirx.Var(GRID_PARAM, "int32")
    whole = items is None
    items = staged.items if whole else items
    allocations, memory, pools = _dynamic_shared(staged, items)
    views = slot_views(staged, None if whole else items)
    body = seq(allocations + views + _statements(items, block, grid, staged.threads, memory, pools))
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

    staged: StagedProgram
    funcs: dict[str, tirx.PrimFunc] = field(default_factory=dict)
    launches: list = field(default_factory=list)

    def __str__(self):
        return tvm.IRModule(self.funcs).script()

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

    def host_loop_trips(self, launches: list | None = None) -> dict[str, int]:
        """Each host loop's counter and trip count (the kernels inside take the counter)."""
        trips = {}
        for launch in self.launches if launches is None else launches:
            if isinstance(launch, HostLoop):
                trips[launch.counter] = launch.trips
                trips.update(self.host_loop_trips(list(launch.body)))
        return trips

    def min_grids(self) -> dict[str, int]:
        """The fewest blocks each kernel may launch with (on-chip weights need a grid)."""
        return {f"{launch.kernel}_kernel": launch.min_grid for launch in self.kernel_launches()}


def kernel_plan(staged: StagedProgram) -> KernelPlan:
    """One kernel per run of items between kernel starts; a loop with a kernel start inside
    becomes a host loop. A program without kernel starts is one kernel, ``main``."""
    plan = KernelPlan(staged)
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
                                       max(s.schedule.n_tiles for s in stages), dynamic_shared_bytes(staged, run),
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


def device_module(funcs: tirx.PrimFunc | dict, arch: str) -> tvm.IRModule:
    """The kernels as TVM's CUDA pipeline hands them to its code generator (no GPU needed).

    ``tirx.merge_static_smem`` makes TVM pool the stages' shared-memory buffers by liveness
    (the kernel needs the most any stage needs, not the sum); its TVM 0.27 implementation
    fails on a block-wide all-reduce, which is why reductions stay within a warp.
    """
    funcs = funcs if isinstance(funcs, dict) else {"main": funcs}
    return lower_for_device(funcs, cuda_target(arch), PASS_CONFIG)


def cuda_source(funcs: tirx.PrimFunc | dict | tvm.IRModule, arch: str) -> str:
    """TVM's CUDA code for the kernels (or for an already lowered ``device_module``): what
    ``tvm.compile`` prints, from the very module the thread-level validator reads (TF32 fragments
    printed as CUDA declares them: ``codegen.tf32``)."""
    device = funcs if isinstance(funcs, tvm.IRModule) else device_module(funcs, arch)
    with tvm.transform.PassContext(config=PASS_CONFIG):
        source = tvm.get_global_func("target.build.cuda")(device, cuda_target(arch)).inspect_source()
    return tf32_source(source)


def kernel_count(source: str) -> int:
    """``__global__`` functions defined (not just declared) in a CUDA source."""
    return len(re.findall(r"__global__[^;{]*\{", source))


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


# -- the built kernels -------------------------------------------------------------------------
@dataclass(frozen=True)
class CudaSource:
    """The kernel plan's CUDA source, as TVM emits it, and the lowered kernels it is printed from."""

    plan: KernelPlan
    text: str
    device: tvm.IRModule | None = field(default=None, compare=False)

    def __str__(self):
        return self.text


@dataclass(frozen=True)
class CudaBinary:
    """The source compiled by nvcc, with what ptxas reports for each kernel."""

    source: CudaSource
    cubin: bytes
    resources: dict[str, KernelResources]

    def __str__(self):
        return "\n".join(f"{name}: {r.registers} registers/thread, {r.shared_bytes} B static shared memory, "
                         f"{r.stack_bytes} B stack, {r.spill_bytes} B spilled ({r.arch})"
                         for name, r in self.resources.items())


@dataclass(frozen=True)
class CudaKernels:
    """The kernels, each checked to be co-resident on the device model with its launch, and
    their parameters in the order TVM chose."""

    binary: CudaBinary
    occupancy: dict[str, Occupancy]
    argument_orders: dict[str, list[str]]

    @property
    def plan(self) -> KernelPlan:
        return self.binary.source.plan

    def __str__(self):
        return "\n".join(f"{name}: {occupancy}; parameters {', '.join(self.argument_orders[name])}"
                         for name, occupancy in self.occupancy.items())


def cuda_compile(source: CudaSource, device: DeviceModel) -> Outcome:
    """nvcc's cubin of ``source`` for ``device``'s arch, and each kernel's registers and shared
    memory.

    ptxas chooses a kernel's registers itself, and for a large persistent kernel it may take
    fewer than the kernel needs, to fit more blocks per SM, and spill: paper BERT fp32 with its
    FFN2 split over K got 80 registers (3 blocks/SM) and spilled 32 B, where
    ``__launch_bounds__(256, 2)`` gives it 128 and none. A kernel that spills is built again,
    bounded to one block per SM fewer each time, until it does not spill or one block is left;
    the first bound without spills is kept, and a note says so. Otherwise ptxas' choice stays.

    A kernel whose on-chip weights need a grid (``Launch.min_grid``) of more blocks per SM than
    ptxas' registers leave is bounded to those blocks per SM (``codegen.on_chip`` placed the
    weights for them), and is never bounded below them to save a spill."""
    names = tuple(source.plan.kernel_names)
    launches = _launches_by_kernel(source.plan)
    threads = source.plan.staged.threads
    text, notes = source.text, []
    cubin, resources = compile_cubin(text, device.arch, names)
    for name in names:
        needed = -(-launches[name].min_grid // device.sms)
        try:
            blocks = _occupancy(resources[name], launches[name], device, threads).blocks_per_sm
        except TargetError:
            continue  # check_co_residency refuses it, with the reason
        if blocks < needed:  # where the shared memory is what limits it, check_co_residency refuses it
            bounded = _launch_bounds(text, name, threads, needed)
            bounded_cubin, bounded_resources = compile_cubin(bounded, device.arch, names)
            notes.append(f"{name}: its on-chip weights need {launches[name].min_grid} blocks ({needed} blocks/SM), "
                         f"ptxas took {resources[name].registers} registers ({blocks} blocks/SM); bounded to "
                         f"{needed} blocks/SM: {bounded_resources[name].registers} registers, "
                         f"{bounded_resources[name].spill_bytes} B spilled")
            text, cubin, resources = bounded, bounded_cubin, bounded_resources
            blocks = _occupancy(resources[name], launches[name], device, threads).blocks_per_sm
        used = resources[name]
        for bound in range(blocks - 1, needed - 1, -1) if used.spill_bytes else ():
            bounded = _launch_bounds(text, name, threads, bound)
            bounded_cubin, bounded_resources = compile_cubin(bounded, device.arch, names)
            if not bounded_resources[name].spill_bytes:
                notes.append(f"{name}: ptxas spilled {used.spill_bytes} B at {used.registers} registers "
                             f"({blocks} blocks/SM); bounded to {bound} blocks/SM: "
                             f"{bounded_resources[name].registers} registers, 0 B spilled")
                text, cubin, resources = bounded, bounded_cubin, bounded_resources
                break
    return Outcome(CudaBinary(CudaSource(source.plan, text, source.device), cubin, resources), notes)


def _launches_by_kernel(plan: KernelPlan) -> dict:
    """Each kernel's launch, by the kernel's name in the source (``<kernel>_kernel``)."""
    return {f"{launch.kernel}_kernel": launch for launch in plan.kernel_launches()}


def _occupancy(used: KernelResources, launch, device: DeviceModel, threads: int) -> Occupancy:
    """The kernel's co-resident grid from ptxas' figures and its launch's dynamic shared memory."""
    return co_resident_grid(used.registers, used.shared_bytes + launch.dynamic_shared, device, threads)


def _launch_bounds(text: str, kernel: str, threads: int, blocks: int) -> str:
    """``text`` with ``kernel``'s ``__launch_bounds__`` (declaration and definition) asking
    ptxas for ``blocks`` co-resident blocks of ``threads`` threads."""
    pattern = re.compile(rf"__launch_bounds__\({threads}(?:,\s*\d+)?\)(\s+{re.escape(kernel)}\()")
    bounded, count = pattern.subn(rf"__launch_bounds__({threads}, {blocks})\1", text)
    if not count:
        raise TargetError(f"kernel {kernel}: no __launch_bounds__({threads}) in its source to bound")
    return bounded


def build_emulated(kernels: CudaKernels) -> Outcome:
    """The kernels' CUDA source built to run on the CPU (``souffle.runtime.emulated``): built
    here so that a source the host compiler refuses fails at compile time."""
    plan = kernels.plan
    dynamic_shared = max((launch.dynamic_shared for launch in plan.kernel_launches()), default=0)
    library = emulated_build(kernels.binary.source.text, tuple(plan.kernel_names), dynamic_shared)
    return Outcome(kernels, [f"emulated build {library.name}"])


def check_co_residency(binary: CudaBinary, device: DeviceModel) -> CudaKernels:
    """Each kernel's co-resident grid on ``device`` from its ptxas figures and its launch; a kernel
    that cannot be co-resident, or not with the grid its on-chip weights assume, is refused."""
    plan = binary.source.plan
    launches = _launches_by_kernel(plan)
    occupancy = {}
    for name, used in binary.resources.items():
        launch = launches[name]
        try:
            occupancy[name] = _occupancy(used, launch, device, plan.staged.threads)
        except TargetError as err:
            raise TargetError(f"kernel {name}: {err}") from None
        if occupancy[name].grid < launch.min_grid:
            raise TargetError(f"kernel {name}: its on-chip weights assume at least {launch.min_grid} blocks, but only "
                              f"{occupancy[name].grid} can be co-resident on {device.name}")
    orders = {name: argument_order(binary.source.text, plan.staged, name) for name in plan.kernel_names}
    return CudaKernels(binary, occupancy, orders)
