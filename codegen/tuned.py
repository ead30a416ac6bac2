"""Stage schedules from a MetaSchedule database: where a stage's workload was tuned on a GPU
(MetaSchedule, Ansor's successor, measuring schedules on the device), the persistent kernel
takes the database's best schedule for that stage instead of dlight's rules and this project's
templates (``codegen.schedule``).

A database is MetaSchedule's JSON database (a directory with ``database_workload.json`` and
``database_tuning_record.json``, as ``tune_tir`` writes it). A stage's workload is its TE over
fresh placeholders as one PrimFunc (``codegen.stage.isolate``), the function ``tune_tir`` is
given; TVM matches it structurally.

A database schedule is written for a kernel of its own: its tiles bound to ``blockIdx`` (folded
into the persistent tile loop, as dlight's are: ``codegen.schedule.stitchable``) and its threads
to ``threadIdx``. The persistent kernel has one block shape, ``WARP`` lanes by ``threads / WARP``
warps. A schedule over exactly ``threads`` threads along ``threadIdx.x`` (MetaSchedule's usual
form) is re-bound to it, its thread index ``threadIdx.y * WARP + threadIdx.x``; one already of
the kernel's shape is taken as it is; any other is refused, with the reason, and the stage keeps
its own schedule. Its time in the latency model is the record's measured run time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import tvm
import tvm_ffi
from tvm import s_tir, te, tirx
from tvm.s_tir import meta_schedule as ms

from codegen.cuda import thread_loop
from codegen.schedule import WARP, StageSchedule, stitchable
from souffle.errors import TargetError

TEMPLATE = "database"
FILES = ("database_workload.json", "database_tuning_record.json")


@dataclass(frozen=True)
class Lookup:
    """What a database holds for one stage: its schedule, or why it was refused (neither: no record)."""

    scheduled: tuple[tirx.PrimFunc, StageSchedule] | None = None
    refused: str | None = None


class StageDatabase:
    """A MetaSchedule JSON database, read-only, queried stage by stage."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        missing = [name for name in FILES if not (self.path / name).is_file()]
        if missing:
            raise TargetError(f"no MetaSchedule database at {self.path}: {', '.join(missing)} missing "
                              "(MetaSchedule's tune_tir writes both into its work_dir)")
        self.database = ms.database.JSONDatabase(work_dir=str(self.path), allow_missing=False)
        self.notes: list[str] = []  # one per stage the database had a record for: taken, or refused and why

    def schedule(self, name: str, func: tirx.PrimFunc, threads: int, arch: str) -> tuple[tirx.PrimFunc, StageSchedule] | None:
        """Stage ``name``'s schedule from the database (``lookup``), None where it has none to
        give; noted either way where it has a record."""
        found = self.lookup(func, threads, arch)
        if found.scheduled is not None:
            measured = found.scheduled[1].measured_seconds
            self.notes.append(f"{name}: scheduled from {self.path}"
                              + (f" (measured {measured * 1e6:.3g} us)" if measured is not None else ""))
        elif found.refused is not None:
            self.notes.append(f"{name}: its record in {self.path} is refused: {found.refused}; it keeps its own schedule")
        return found.scheduled

    def lookup(self, func: tirx.PrimFunc, threads: int, arch: str) -> Lookup:
        """The best record's schedule for ``func`` made a stage of a kernel of ``threads``-thread
        blocks, or the reason it cannot be one."""
        mod = tvm.IRModule({"main": func})
        if not self.database.has_workload(mod):
            return Lookup()
        target = tvm.target.Target({"kind": "cuda", "arch": arch})
        record = self.database.query_tuning_record(mod, target, "main")
        if record is None:
            return Lookup()
        try:
            sch = self.database.query_schedule(mod, target, "main")
        except (RuntimeError, ValueError) as error:  # its trace does not apply: TVM raises ScheduleError or InternalError
            return Lookup(refused=f"its trace does not apply: {str(error).strip().splitlines()[-1]}")
        # a reduction's init as its first step (TVM's own lowering; MetaSchedule's
        # RewriteReductionBlock would have split it off), across threads first where it is reduced there
        lowered = tvm.transform.Sequential([s_tir.transform.LowerCrossThreadReduction(),
                                            s_tir.transform.LowerInitBlock()])(sch.mod)["main"]
        in_global = sorted({b.name for b in _allocated(lowered) if b.scope() in ("", "global")})
        if in_global:
            return Lookup(refused=f"it keeps {', '.join(in_global)} in global memory, which a kernel cannot allocate")
        shape = _thread_extents(lowered)
        if shape == {("threadIdx.x", threads)}:
            sch = s_tir.Schedule(_onto_warps(lowered, threads))
        elif shape == {("threadIdx.x", WARP), ("threadIdx.y", threads // WARP)}:
            sch = s_tir.Schedule(lowered)
        else:
            bound = ", ".join(f"{tag} = {n}" for tag, n in sorted(shape)) or "no threads"
            return Lookup(refused=f"it binds {bound}; the kernel's blocks are threadIdx.x = {WARP}, "
                                  f"threadIdx.y = {threads // WARP} (or {threads} threads along threadIdx.x)")
        stage = stitchable(sch, TEMPLATE, threads, pipelined=_pipelined(lowered))
        if stage is None:
            return Lookup(refused="its tiles do not stitch into the persistent kernel (an index isl cannot "
                                  "represent, or tiles mostly idle)")
        func, schedule = stage
        seconds = [float(s) for s in record.run_secs or ()]
        return Lookup(scheduled=(func, replace(schedule, measured_seconds=statistics.median(seconds) if seconds else None)))


def workload(tensor: te.Tensor, placeholders: list[te.Tensor]) -> tirx.PrimFunc:
    """A stage's workload: its TE over its placeholders as one PrimFunc, what the database is
    queried with (and what to tune: ``souffle.stage_workloads``)."""
    return te.create_prim_func(placeholders + [tensor])


def _thread_extents(func: tirx.PrimFunc) -> set[tuple[str, int]]:
    """(threadIdx tag, extent) of every loop bound to a thread index; virtual threads, which TVM
    unrolls into each thread, are not among them."""
    extents: set[tuple[str, int]] = set()

    def visit(node):
        if isinstance(node, tirx.For) and node.kind == tirx.ForKind.THREAD_BINDING:
            tag = node.thread_binding.thread_tag
            if tag.startswith("threadIdx"):
                extents.add((tag, int(node.extent)))

    tvm_ffi.structural_walk(func.body, visit)
    return extents


def _pipelined(func: tirx.PrimFunc) -> bool:
    """Whether a loop of ``func`` is annotated for TVM's software pipeline (MetaSchedule's
    ``software_pipeline_stage``), which ``stitchable`` then injects on the stage alone."""
    found = []

    def visit(node):
        if isinstance(node, tirx.For) and "software_pipeline_stage" in node.annotations:
            found.append(node)

    tvm_ffi.structural_walk(func.body, visit)
    return bool(found)


def _allocated(func: tirx.PrimFunc) -> list:
    """The buffers the function's blocks allocate."""
    found = []

    def visit(node):
        if isinstance(node, s_tir.SBlock):
            found.extend(node.alloc_buffers)

    tvm_ffi.structural_walk(func.body, visit)
    return found


def _onto_warps(func: tirx.PrimFunc, threads: int) -> tirx.PrimFunc:
    """``func`` with each loop over ``threads`` threads along ``threadIdx.x`` made a loop over the
    kernel's warps (``threadIdx.y``) around one over its lanes (``threadIdx.x``), the old index
    ``warp * WARP + lane``."""

    def rebind(node):
        if not (isinstance(node, tirx.For) and node.kind == tirx.ForKind.THREAD_BINDING
                and node.thread_binding.thread_tag == "threadIdx.x" and int(node.extent) == threads):
            return node
        dtype = str(node.loop_var.ty.dtype)
        warp, lane = tirx.Var("warp", dtype), tirx.Var("lane", dtype)
        index = warp * WARP + lane
        old = node.loop_var
        body = tvm_ffi.structural_map(node.body, [(tirx.Var, lambda v: index if v.same_as(old) else v)])
        lanes = thread_loop(lane, WARP, "threadIdx.x", body)
        return thread_loop(warp, threads // WARP, "threadIdx.y", lanes)

    return tvm_ffi.structural_map(func, [(tirx.For, rebind)], order="pre")
