"""Stage-level timing of a persistent kernel on a GPU: where its time goes, next to the model.

A persistent kernel is one launch, so a profiler sees one duration. Its grid barriers cut it
into segments, though: every block leaves barrier k together, so the time between block 0
leaving barrier k-1 and barrier k is what the stages between them took on the slowest block,
plus the barrier. ``instrument`` makes a variant of the kernel's source in which block 0's
first thread stamps ``%globaltimer`` (nanoseconds) and ``clock64()`` (its SM's cycles) when
the kernel starts and after every grid barrier, into ``__device__`` arrays the host reads back
(``souffle.runtime.timeline.measure``); ``segments`` lists, for the same program, which
stages each segment holds and what the latency model estimates for it, in execution order
(loops unrolled), so the two can be set side by side stage by stage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from analysis.latency import LatencyEstimate
from codegen.latency import kernel_runs
from codegen.staged import Loop, StagedProgram

STAMPS = "souffle_timeline"  # __device__ unsigned long long[capacity][2]: (globaltimer ns, clock64)
COUNT = "souffle_timeline_count"  # __device__ unsigned int: stamps taken (the host zeroes it)

_PRELUDE = """
#ifndef SOUFFLE_UNCHECKED
#define SOUFFLE_UNCHECKED
#endif
__device__ unsigned long long {stamps}[{capacity}][2];
__device__ unsigned int {count};
// block 0's first thread stamps the time; the others pass (souffle timeline build). Not inlined:
// inlined, it changed ptxas' register allocation of the kernel around it (tiny BERT spilled)
__device__ __noinline__ SOUFFLE_UNCHECKED void souffle_stamp() {{
  if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {{
    unsigned long long now = 0, cycles = 0;  // 0 where there is no GPU clock (the emulator)
#ifdef __CUDA_ARCH__
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    cycles = (unsigned long long)clock64();
#endif
    if ({count} < {capacity}) {{
      {stamps}[{count}][0] = now;
      {stamps}[{count}][1] = cycles;
    }}
    {count} += 1;
  }}
}}
"""
_GRID_SYNC = "__forceinline__ __device__ void tvm_builtin_cuda_grid_sync() {"
_SYNC_CALL = "cg::this_grid().sync();"


class TimelineError(ValueError):
    """A program the timeline cannot instrument, with the reason."""


@dataclass(frozen=True)
class Segment:
    """What runs between two grid barriers (or from the kernel's start to its first)."""

    stages: tuple[str, ...]  # in order; a loop's stages carry their iteration, "name@3"
    estimate_seconds: float  # the stages' estimates plus the grid barrier that ends the segment


def instrument(source: str, kernel: str, capacity: int) -> str:
    """``source`` with ``kernel`` stamping at its start and after every grid barrier (at most
    ``capacity`` stamps are kept; the count says how many were taken)."""
    if _GRID_SYNC not in source or _SYNC_CALL not in source:
        raise TimelineError("the source has no grid barrier helper to stamp after (TVM's "
                            "tvm_builtin_cuda_grid_sync): a kernel without grid barriers is one segment")
    definition = re.compile(r'^(extern "C" __global__ void[^\n;]*\b' + re.escape(kernel) + r'\([^\n;]*\) \{)$',
                            re.MULTILINE)
    if len(definition.findall(source)) != 1:
        raise TimelineError(f"kernel {kernel!r}: its definition is not one line of the source ending in '{{'")
    prelude = _PRELUDE.format(stamps=STAMPS, count=COUNT, capacity=capacity)
    source = source.replace(_GRID_SYNC, prelude + _GRID_SYNC, 1)
    source = source.replace(_GRID_SYNC + "\n    namespace cg = cooperative_groups;\n    " + _SYNC_CALL,
                            _GRID_SYNC + "\n    namespace cg = cooperative_groups;\n    " + _SYNC_CALL
                            + "\n    souffle_stamp();", 1)
    if "souffle_stamp();" not in source:
        raise TimelineError("the grid barrier helper's body is not TVM 0.27's: nothing to stamp after")
    return definition.sub(lambda m: m[1] + "\n  souffle_stamp();", source, count=1)


def segments(staged: StagedProgram, estimate: LatencyEstimate) -> list[Segment]:
    """The segments one inference of a one-kernel program runs, in order, with the model's
    estimate of each: a grid barrier ends one and starts the next."""
    runs = kernel_runs(staged.items)
    if any(kernel != 0 for _, kernel, _ in runs):
        raise TimelineError(f"{staged.name} launches more than one kernel per inference; the timeline "
                            "times one persistent kernel (ncu times each of several)")
    seconds = {id(item): stage.seconds for (item, _, _), stage in zip(runs, estimate.stages, strict=True)}
    barrier_seconds = estimate.device.grid_sync_seconds(estimate.barrier_grid)
    done: list[Segment] = []
    current: list[str] = []
    current_seconds = 0.0

    def barrier():
        nonlocal current, current_seconds
        done.append(Segment(tuple(current), current_seconds + barrier_seconds))
        current, current_seconds = [], 0.0

    def visit(items: list, suffix: str):
        nonlocal current_seconds
        for item in items:
            if item.barrier is not None:
                barrier()
            if isinstance(item, Loop):
                for load in item.loads:
                    current.append(f"on-chip load for {load.reader}{suffix}")
                    current_seconds += seconds[id(load)]
                for trip in range(item.trips):
                    visit(item.items, f"{suffix}@{trip}")
                continue
            current.append(item.name + suffix)
            current_seconds += seconds[id(item)]

    visit(staged.items, "")
    done.append(Segment(tuple(current), current_seconds))  # the last runs to the kernel's end
    return done
