"""Rows of a table picked by indices known at import time, taken as a slice instead of a gather.

Hugging Face's BERT gathers its position embeddings by the constant position ids 0..S-1 and,
called without token types, its token type embeddings by constant zeros. A gather's reads are
data-dependent, so the analysis widens them to the whole table and the vertical pass cannot
inline it; a slice reads exactly its rows, as the hand-built BERT's embeddings do. Shared by
the torch and ONNX importers.
"""

from __future__ import annotations

import numpy as np


def constant_rows(ctx, table, picks: np.ndarray, out_shape: tuple[int, ...]):
    """``table``'s rows at ``picks`` (integers known at import time, negative ones counting from
    the end), shaped ``out_shape`` (``picks.shape`` followed by a row's shape): consecutive rows
    a slice, one row picked everywhere that row broadcast; None for any other picks."""
    flat = np.asarray(picks).reshape(-1) % ctx.shape(table)[0]
    if not flat.size:
        return None
    start = int(flat[0])
    if np.array_equal(flat, np.arange(start, start + flat.size)):
        count = flat.size
    elif (flat == start).all():
        count = 1
    else:
        return None
    piece = ctx.op("slice", table, begin=[start], end=[start + count], axis=[0])
    if count == flat.size:
        return piece if ctx.shape(piece) == tuple(out_shape) else ctx.op("reshape", piece, shape=tuple(out_shape))
    return ctx.op("expand", piece, shape=tuple(out_shape))
