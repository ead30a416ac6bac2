"""A sum over a short axis imported as the adds of its slices, shared by both importers.

A mixture of experts written in torch stacks its experts' outputs and sums them weighted by the
gate, ``(gate.unsqueeze(2) * torch.stack(experts, 1)).sum(1)`` (MMoE). As a reduction, the
weighted product is a TE of its own: arithmetic is not inlined into a reduction, which would
redo it at every step of a longer one, so the product is stored and read back. As the adds of
its slices the sum is element-wise: the product, the stacking and the sum are inlined into one
expression per output, as in the hand-built MMoE, which adds each expert's weighted output to
the sum of the ones before.
"""

from __future__ import annotations

SHORT_AXIS = 16  # elements: the paper MMoE's 8 experts and twice as many; a longer axis stays a reduction


def is_short_sum(ctx, x, axes) -> bool:
    """Whether a sum of ``x`` over ``axes`` (a list, None for all) is over one short axis."""
    return axes is not None and len(axes) == 1 and ctx.shape(x)[axes[0]] <= SHORT_AXIS


def sum_of_slices(ctx, x, axis: int, keepdims: bool):
    """``x`` summed over ``axis`` as slice 0 + slice 1 + ..., in the order a reduction adds them."""
    shape = ctx.shape(x)
    axis %= len(shape)
    out_shape = shape[:axis] + ((1,) if keepdims else ()) + shape[axis + 1:]
    total = None
    for index in range(shape[axis]):
        term = ctx.op("slice", x, begin=[index], end=[index + 1], axis=[axis])
        if ctx.shape(term) != out_shape:
            term = ctx.op("reshape", term, shape=out_shape)
        total = term if total is None else ctx.op("add", total, term)
    return total
