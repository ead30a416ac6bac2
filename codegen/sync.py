"""What synchronizes the stages at the lower opt levels: the paper's ablation, pass by pass.

- ``kernel_per_stage`` (O0-O2): every stage is its own kernel, as a library of operators runs
  a model; a loop whose body launches kernels runs on the host.
- ``global_sync`` (from O3): one kernel; every former kernel boundary becomes a grid barrier,
  whether or not data crosses blocks there.

``codegen.barriers.place_barriers`` (O4) then keeps only the barriers the data needs, and
``codegen.partition`` starts new kernels only where the device forces it.
"""

from __future__ import annotations

from codegen.staged import StagedProgram, copy_items, stages_in

KERNEL_PER_STAGE = "one kernel per TE"
GLOBAL_SYNC = "every stage boundary synchronizes the grid"


def kernel_per_stage(staged: StagedProgram) -> StagedProgram:
    """``staged`` with a kernel starting at every stage."""
    items = copy_items(staged.items)
    for stage in stages_in(items):
        stage.launch = KERNEL_PER_STAGE
    return staged.with_items(items)


def global_sync(staged: StagedProgram) -> StagedProgram:
    """``staged`` as one kernel with a grid barrier before every stage but the first."""
    items = copy_items(staged.items)
    for k, stage in enumerate(stages_in(items)):
        stage.launch = None
        stage.barrier = GLOBAL_SYNC if k else None
    return staged.with_items(items)
