"""The CPU backend: the stitched whole-model PrimFunc, or the persistent kernel's staged program
as one CPU function, compiled through LLVM (the CPU's graph rewrites: ``codegen.cpu_transforms``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import tvm
from tvm import tirx

from codegen.cpu_math import register_llvm_math
from codegen.staged import Loop, StagedProgram, synchronized
from codegen.stitch import seq
from codegen.tiled import on_chip_loads, slot_views, tiled_stage

PERSISTENT_CPU_GRID = 1056  # blocks the CPU run of the staged program uses at most (H200: 132 SMs x 8)


def host_target() -> tvm.target.Target:
    """LLVM for this machine's CPU. Plain "llvm" means baseline x86-64 (SSE2, no FMA),
    which halves the vector width and doubles the instructions of every multiply-add.

    LLVM's own loop vectorizer is off (``-vectorize-loops=false``): TVM's LLVM 22 vectorizes a
    load through a masked loop index (``x[base + (i & 7)]``, the broadcast read of an expand
    fused after an element-wise stage) as if it were ``x[base + i]``, reading past the tensor
    (fuzz seed 1795441933: half of an expand's outputs wrong or garbage, on AVX2 and AVX-512;
    LLVM issue 156849 is the same miscompile). The schedules vectorize explicitly where it pays
    (``codegen.schedule_cpu``), so the paper models run as fast without it (medians with and
    without: bert 366 and 363-366 ms, resnext 240 and 242 ms, lstm 9.2 and 9.1-12.4 ms).
    """
    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                              "cl-opt": ["-vectorize-loops:bool=false"]})


def use_every_core():
    """Size TVM's thread pool to the cores this process may run on. By default TVM assumes
    x86 cores are hyper-threaded and uses half of them, which here means one worker and a
    7 us wake-up per parallel loop instead of 1-2 us. The pool reads TVM_NUM_THREADS when it
    is created (at the first parallel loop run), so this runs at build time; an explicit
    setting is kept."""
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))


def build(func: tvm.tirx.PrimFunc, target: tvm.target.Target | str | None = None):
    """Compile a whole-model PrimFunc (for the host CPU unless ``target`` says otherwise)."""
    use_every_core()
    register_llvm_math()
    return tvm.compile(tvm.IRModule({"main": func}), target=target or host_target())


def staged_function(staged: StagedProgram, grid: int) -> tirx.PrimFunc:
    """The persistent kernel's staged program as one CPU function.

    The same stages, tiles, arena layout and barrier positions as ``codegen.cuda``: between two
    barriers, blocks ``0 .. grid-1`` run one after another, each walking its tiles
    ``block, block + grid, ...`` of every stage in that stretch; a barrier ends the stretch.
    A stage that reads another block's result without a barrier before it therefore reads
    memory that block has not written yet, as on the GPU — the CPU tests catch a missing barrier.
    Loop iterations, though, run one after another for all blocks, so a barrier missing at an
    iteration boundary goes unnoticed here; ``place_barriers`` analyses the next iteration
    for exactly that, and the GPU tests run it for real.
    """
    # Every block's on-chip weight copies (the GPU's shared memory), block after block.
    memory = staged.on_chip_memory(blocks=grid, scope="global")
    per_block = {dtype: int(buffer.shape[0]) // grid for dtype, buffer in memory.items()}

    def on_chip(block):
        return lambda load: (memory[load.dtype], block * per_block[load.dtype] + load.offset)

    def serial(n, body):
        e = tirx.Var("e", "int64")
        return tirx.For(e, 0, n, tirx.ForKind.SERIAL, body(e))

    def phases(items) -> list[tirx.Stmt]:
        stmts, run = [], []

        def close():
            if run:
                block = tirx.Var("block", "int32")
                body = seq([tiled_stage(stage, block, tirx.const(grid, "int32"), on_chip(block)) for stage in run])
                stmts.append(tirx.For(block, 0, grid, tirx.ForKind.SERIAL, body))
                run.clear()

        for item in items:
            if isinstance(item, Loop):
                close()  # a loop starts its own stretch: its iterations run one after another
                for load in item.loads:
                    block = tirx.Var("block", "int32")
                    copy = on_chip_loads(load, *on_chip(block)(load)[:1], block, grid, on_chip(block)(load)[1], serial)
                    stmts.append(tirx.For(block, 0, grid, tirx.ForKind.SERIAL, copy))
                stmts.append(tirx.For(item.var, 0, item.trips, tirx.ForKind.SERIAL, seq(phases(item.items))))
                continue
            if synchronized(item):
                close()
            run.append(item)
        close()
        return stmts

    body = seq([tirx.AllocBuffer(b) for b in memory.values()] + slot_views(staged) + phases(staged.items))
    return tirx.PrimFunc(staged.parameters(), body).with_attr("global_symbol", "main")


@dataclass(frozen=True)
class StagedFunction:
    """The staged program as one CPU function running ``grid`` blocks one after another."""

    staged: StagedProgram
    func: tirx.PrimFunc
    grid: int

    def __str__(self):
        return self.func.script()


def persistent_cpu_function(staged: StagedProgram) -> StagedFunction:
    """``staged_function`` on as many blocks as the widest stage has tiles, at most ``PERSISTENT_CPU_GRID``."""
    grid = min(staged.max_tiles, PERSISTENT_CPU_GRID)
    return StagedFunction(staged, staged_function(staged, grid), grid)


@dataclass(frozen=True)
class CpuModule:
    """A function built by LLVM, with the plan it runs (what it takes: inputs, weights, outputs,
    arenas) and, for the staged program, its grid."""

    plan: object  # codegen.stitch.StitchedProgram or codegen.staged.StagedProgram
    executable: object  # tvm.runtime.Executable
    grid: int | None = None

    def __str__(self):
        return self.executable.mod.inspect_source("ll")
