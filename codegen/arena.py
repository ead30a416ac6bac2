"""The ``plan_arena`` pass: every intermediate's place in one scratch arena per dtype.

The stages write their intermediates into slots (``codegen.stage``); here each slot gets an
offset in its dtype's arena, and a slot reuses memory whose previous tensor's accesses all ended
at least one barrier (or kernel start) before its own begin: between two synchronizations no
block can still be reading the old tensor.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx

from codegen.staged import Loop, Stage, StagedProgram, stages_in, synchronized
from codegen.stitch import align


def _first_stage(items) -> Stage | None:
    return next(iter(stages_in(items)), None)


def _live_ranges(staged: StagedProgram) -> dict:
    """Slot -> (first, last) barrier interval in which it is accessed. A slot used inside a
    loop is live for the whole loop unless every iteration starts with a barrier, it is only
    used in that loop, and its first use there is a whole write at a fixed offset."""
    ranges: dict = {}
    phase = 0

    def touch(slot, lo, hi):
        old = ranges.get(slot)
        ranges[slot] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))

    def visit(items):
        nonlocal phase
        for item in items:
            if isinstance(item, Loop):
                phase += int(synchronized(item))
                start = phase
                inner_first = _first_stage(item.items)
                first_access: dict = {}
                for s in stages_in(item.items):
                    for ref in s.reads:
                        first_access.setdefault(ref.base, "read")
                    first_access.setdefault(s.write.base, "write" if isinstance(s.write.offset, int) else "read")
                before = dict(ranges)
                visit(item.items)
                restarts = inner_first is not None and synchronized(inner_first)
                for slot, kind in first_access.items():
                    local = restarts and kind == "write" and slot not in before
                    if slot in staged.slots and not local:
                        touch(slot, start, phase)
                continue
            if synchronized(item):
                phase += 1
            for ref in item.reads + [item.write]:
                if ref.base in staged.slots:
                    touch(ref.base, phase, phase)

    visit(staged.items)
    return ranges


def plan_arena(staged: StagedProgram) -> StagedProgram:
    """``staged`` with every slot given an offset in its dtype's arena; a slot reuses memory
    whose previous tensor's accesses all ended at least one barrier before its own begin."""
    ranges = _live_ranges(staged)
    placed: dict[str, list] = {}  # dtype -> [(offset, size, last phase, first phase)]
    offsets: dict = {}
    for slot, (lo, hi) in sorted(ranges.items(), key=lambda kv: (kv[1][0], -staged.slots[kv[0]][1])):
        dtype, size = staged.slots[slot]
        taken = [(o, n) for o, n, last, first in placed.get(dtype, []) if not (last < lo or hi < first)]
        offset = 0
        for o, n in sorted(taken):
            if offset + size <= o:
                break
            offset = max(offset, align(o + n))
        placed.setdefault(dtype, []).append((offset, size, hi, lo))
        offsets[slot] = offset
    sizes = {d: max((o + n for o, n, _, _ in v), default=0) for d, v in placed.items()}
    buffers = {d: tirx.decl_buffer((tirx.Var(f"arena_{d}_n", "int64"),), d, name=f"arena_{d}") for d in sizes}
    return dataclasses.replace(staged, slot_offsets=offsets, arena_sizes=sizes, arena_buffers=buffers)
