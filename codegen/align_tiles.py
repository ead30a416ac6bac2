"""The ``align_tiles`` pass (O4): a row-resident stage tiled like the stage that reads it, and the
GEMM that writes its rows tiled in whole rows to match, so that no grid barrier separates them.

``codegen.barriers`` leaves out the grid barrier before a stage whose every tile reads only what
the same-numbered tile of the writer wrote (tile ``t`` runs on block ``t mod grid`` in every
stage). A softmax is scheduled a warp a row, 8 rows a tile; the batched product that reads it
(attention's P.V) takes 64 whole rows of it a tile: paper BERT's P.V is 72 tiles of 64 x 64, one
head's 64 rows each, and its softmax 576 tiles, so every P.V tile reads the rows of 8 softmax
tiles run by 8 other blocks, and a grid barrier goes between them in every layer. With 8 rows a
warp (loaded together, then reduced one after the other) the softmax is 72 tiles of 64 rows, tile
``t`` the rows P.V's tile ``t`` reads: the two run in the same block, after a ``__syncthreads``.
The scores before it (Q.K^T, 108 tiles of 128 x 128) go the same way in tiles of 64 whole rows
of 384 (``codegen.tensor_core.whole_row_tile``): tile ``t`` writes the rows the softmax's tile
``t`` reads, and a second grid barrier a layer goes.

Fewer, longer tiles can cost more than the barriers they save (each warp's rows are a chain, and
fewer blocks work), and another stage between the two may need a barrier before the reader
anyway (a cast of its other operand). So the barriers are placed with and without each way of
aligning (``codegen.barriers.place_barriers``, every run of a loop counted), and the latency model
prices the difference: the new stages alone against the stages as they were, times their runs,
against the grid barriers saved, each of a block per SM (the cheapest a kernel's grid makes it).
The way that gains most is taken, or none.
"""

from __future__ import annotations

import dataclasses

from tvm_ffi import structural_equal

from analysis.device import DeviceModel
from codegen.barriers import place_barriers, same_block
from codegen.latency import stage_seconds
from codegen.row_resident import schedule_row_resident
from codegen.schedule import WARP, ScheduleError, whole_row_stage
from codegen.staged import Loop, Stage, StagedProgram, replaced_stages


def align_tiles(staged: StagedProgram, device: DeviceModel) -> tuple[StagedProgram, list[str]]:
    """``staged`` with each row-resident stage tiled like the stage that reads it, and the GEMM
    that writes its rows in whole rows to match, where that saves grid barriers the latency model
    prices above what the stages lose (``codegen.align_tiles``), and a note per stage it aligned
    or kept; ``staged`` itself is not changed."""
    notes: list[str] = []
    barrier = device.grid_sync_seconds(device.sms)
    barriers = None  # executed by ``staged`` as it stands, placed once it has a candidate
    for stage, writer, reader, executions in _candidates(staged.items, 1):
        options = _options(stage, writer, reader, device)
        if not options:
            continue
        if barriers is None:
            barriers = place_barriers(staged).barrier_count(True)
        judged = []
        for changes, what in options:
            trial = staged.with_items(replaced_stages(staged.items, changes))
            saved = barriers - place_barriers(trial).barrier_count(True)
            before = sum(stage_seconds(old, device) for old, _ in changes)
            after = sum(stage_seconds(new, device) for _, new in changes)
            judged.append((saved * barrier - (after - before) * executions, saved, before, after, trial, what))
        gain, saved, before, after, trial, what = max(judged, key=lambda option: option[0])
        runs = _counted(executions, "run")
        if saved <= 0:
            notes.append(f"{what}, not taken: a grid barrier would still precede {reader.name}")
        elif gain <= 0:
            notes.append(f"{what}, not taken: {after * 1e6:.2f} us against {before * 1e6:.2f} us as it is ({runs}), "
                         f"more than the {_counted(saved, 'grid barrier')} it would save ({barrier * 1e6:.2f} us "
                         f"each on {device.name})")
        else:
            notes.append(f"{what}: {_counted(saved, 'grid barrier')} fewer ({device.name}: {before * 1e6:.2f} -> "
                         f"{after * 1e6:.2f} us a run, {runs}; a barrier {barrier * 1e6:.2f} us)")
            staged, barriers = trial, barriers - saved
    return staged, notes


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def _candidates(items: list, executions: int):
    """(row-resident stage, the tensor-core stage right before it that writes what it reads or
    None, the first stage after it in the same list that reads its output, the stage's runs per
    inference), loop bodies included."""
    for k, item in enumerate(items):
        if isinstance(item, Loop):
            yield from _candidates(item.items, executions * item.trips)
        elif isinstance(item, Stage) and item.epilogue == "row":
            before = items[k - 1] if k else None
            writer = before if isinstance(before, Stage) and before.schedule.template == "tensor_core" and \
                any(_same_ref(ref, before.write) for ref in item.reads) else None
            for later in items[k + 1:]:
                if isinstance(later, Loop):
                    break
                if any(_same_ref(ref, item.write) for ref in later.reads):
                    yield item, writer, later, executions
                    break


def _options(stage: Stage, writer: Stage | None, reader: Stage, device: DeviceModel) -> list[tuple[list, str]]:
    """The ways to align ``stage``: ([(a stage, its new schedule's stage)], what it is); the
    writer's whole rows only where a block of ``device`` has their shared memory (paper BERT's
    scores: 96 KB, their accumulators)."""
    aligned = _aligned_with(stage, reader)
    if aligned is None:
        return []
    warps = aligned.schedule.threads // WARP
    width = int(stage.tensor.shape[-1])
    rows = aligned.schedule.per_tile // width
    what = (f"{stage.name}: {-(-rows // warps)} rows a warp, {aligned.schedule.n_tiles} tiles of {rows} rows, each "
            f"the rows tile t of {reader.name} reads")
    options = [([(stage, aligned)], what)]
    whole = None if writer is None else whole_row_stage(writer.tensor, writer.placeholders, writer.schedule.threads,
                                                        rows)
    if whole is not None and (not device.smem_per_block or whole[1].shared_bytes <= device.smem_per_block):
        retiled = dataclasses.replace(writer, func=whole[0], schedule=whole[1])
        read = next(k for k, ref in enumerate(stage.reads) if _same_ref(ref, writer.write))
        if same_block(aligned, aligned.placeholders[read], retiled):
            options.append(([(stage, aligned), (writer, retiled)],
                            f"{what}; {writer.name} in {retiled.schedule.n_tiles} tiles of {rows} whole rows "
                            f"({retiled.schedule.tensor_core_tile}), tile t the rows tile t reads"))
    return options


def _aligned_with(stage: Stage, reader: Stage) -> Stage | None:
    """``stage`` (a row-resident stage, a warp a row) in tiles of the rows ``reader``'s tile t
    reads, where each of ``reader``'s tiles reads its own rows (``same_block``); else None."""
    read = [k for k, ref in enumerate(reader.reads) if _same_ref(ref, stage.write)]
    warps = stage.schedule.threads // WARP
    width = int(stage.tensor.shape[-1])
    rows = stage.schedule.outputs // width
    if len(read) != 1 or stage.schedule.per_tile != warps * width or rows % reader.schedule.n_tiles:
        return None
    tile_rows = rows // reader.schedule.n_tiles
    rows_per_warp = -(-tile_rows // warps)
    if rows_per_warp < 2:
        return None
    try:
        func, schedule = schedule_row_resident(stage.tensor, stage.placeholders, True, stage.schedule.threads,
                                               rows_per_warp, tile_rows)
    except ScheduleError:
        return None
    aligned = dataclasses.replace(stage, func=func, schedule=schedule)
    return aligned if same_block(reader, reader.placeholders[read[0]], aligned) else None


def _same_ref(a, b) -> bool:
    """Whether two buffer references are the same place: one buffer, one offset."""
    if not a.base.same_as(b.base):
        return False
    if isinstance(a.offset, int) or isinstance(b.offset, int):
        return a.offset == b.offset
    return structural_equal(a.offset, b.offset)
