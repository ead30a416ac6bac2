"""The CPU backend: graph rewrites for the CPU, and the stitched whole-model PrimFunc
compiled through LLVM."""

from __future__ import annotations

import os

import tvm

from codegen.cpu_math import register_llvm_math
from codegen.cpu_transforms import hoist_scan_projections, pack_weights
from codegen.stitch import StitchedProgram
from souffle.graph import Graph


def host_target() -> tvm.target.Target:
    """LLVM for this machine's CPU. Plain "llvm" means baseline x86-64 (SSE2, no FMA),
    which halves the vector width and doubles the instructions of every multiply-add."""
    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def use_every_core():
    """Size TVM's thread pool to the cores this process may run on. By default TVM assumes
    x86 cores are hyper-threaded and uses half of them, which here means one worker and a
    7 us wake-up per parallel loop instead of 1-2 us. The pool reads TVM_NUM_THREADS when it
    is created (at the first parallel loop run), so this runs at build time; an explicit
    setting is kept."""
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))


def prepare_graph(graph: Graph) -> Graph:
    """The CPU's graph rewrites: scan-invariant input projections hoisted out of their loops
    (one GEMM instead of one GEMV per step), then constant weights packed for vector loads."""
    return pack_weights(hoist_scan_projections(graph))


def build(stitched: StitchedProgram, target: tvm.target.Target | str | None = None):
    """Compile the stitched whole-model PrimFunc (for the host CPU unless ``target`` says otherwise)."""
    use_every_core()
    register_llvm_math()
    return tvm.compile(tvm.IRModule({"main": stitched.func}), target=target or host_target())
