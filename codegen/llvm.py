"""The CPU backend: the stitched whole-model PrimFunc compiled through LLVM."""

from __future__ import annotations

import tvm

from codegen.schedule_cpu import schedule_cpu
from codegen.stitch import StitchedProgram, stitch
from souffle.lower import TEProgram


def build_llvm(program: TEProgram, target: str = "llvm") -> tuple[StitchedProgram, object]:
    """Stitch the program into one PrimFunc with CPU schedules and compile it."""
    stitched = stitch(program, schedule_cpu)
    executable = tvm.compile(tvm.IRModule({"main": stitched.func}), target=target)
    return stitched, executable
