"""The ``commute_rolls`` pass (O2): a shifted Swin block's rolls moved to where a row-wise stage
reads through them.

A shifted block rolls its normalized input (``roll(norm1(x), -shift, (1, 2))``) before it cuts
the map into windows, and rolls the attention's output back before the residual sum
(``x + roll(attn, shift)``, then ``norm2``). A roll over the map's axes moves whole tokens; a
LayerNorm normalizes each token's channels (the last axis), and a sum adds token to token. So
both commute with it, element for element (the same values, the same arithmetic):

- ``roll(layer_norm(x))`` is ``layer_norm(roll(x))``. Rolled after, the LayerNorm's output (which
  the roll reads at another token) was computed by the roll's stage from statistics other blocks
  made: the statistics two stages, a grid barrier, the roll, another grid barrier before the QKV
  GEMM. Rolled before, the roll is read through (``codegen.vertical`` inlines it: it selects, by
  index alone, between two places of its input) by the LayerNorm's row-resident stage
  (``codegen.row_resident``), which writes its rows in the rolled order: one stage, one barrier.
- ``a + roll(b)``, read by a LayerNorm, is ``roll(roll^-1(a) + b)``. Rolled inside, the sum read
  the projection GEMM through the roll (two places) and was a stage behind a grid barrier of its
  own. Rolled outside, the sum reads the GEMM at one place (through the window reverse) and is
  stored as its epilogue (``codegen.vertical``'s permuted order); the LayerNorm after it, and the
  block's last sum, read it through the roll.

Paper Swin rolls in 12 of its 24 blocks.
"""

from __future__ import annotations

from souffle.graph import Graph, Op, Scan


def commute_rolls(graph: Graph) -> tuple[Graph, list[str]]:
    """``graph`` with each roll of a LayerNorm's output (read by the roll alone, rolling no
    normalized axis) applied to the LayerNorm's input, and each sum of a tensor and a roll (read
    by the sum alone) that a LayerNorm reads taken as the roll of the sum with the other term
    rolled back (scan bodies included), and one note per move; ``graph`` itself is not changed."""
    notes: list[str] = []
    return _rewritten(graph, notes), notes


def _read_by_one(graph: Graph, readers: dict, name: str, index: int) -> bool:
    return name not in graph.outputs and readers.get(name) == [index]


def _moves(graph: Graph) -> tuple[dict[int, int], dict[int, int]]:
    """(roll op index -> the layer_norm whose output it alone reads, add op index -> the roll whose
    output it alone reads, the sum read by a layer_norm)."""
    readers = graph.readers()
    producer = {name: index for index, op in enumerate(graph.ops) if not isinstance(op, Scan) for name in op.outputs}
    norms, sums = {}, {}
    for index, op in enumerate(graph.ops):
        if isinstance(op, Scan):
            continue
        if op.kind == "roll":
            source = op.inputs[0]
            norm = producer.get(source)
            rank = len(graph.tensors[source].shape)
            if norm is not None and graph.ops[norm].kind == "layer_norm" and \
                    _read_by_one(graph, readers, source, index) and \
                    all(int(axis) % rank != rank - 1 for axis in op.attrs["axes"]):
                norms[index] = norm
        elif op.kind == "add" and graph.tensors[op.inputs[0]].shape == graph.tensors[op.inputs[1]].shape:
            rolls = [producer.get(name) for name in op.inputs]
            rolls = [r for r, name in zip(rolls, op.inputs) if r is not None and graph.ops[r].kind == "roll"
                     and _read_by_one(graph, readers, name, index)]
            normed = any(not isinstance(graph.ops[r], Scan) and graph.ops[r].kind == "layer_norm"
                         for r in readers.get(op.outputs[0], ()))
            if len(rolls) == 1 and normed:
                sums[index] = rolls[0]
    return norms, sums


def _rewritten(graph: Graph, notes: list[str]) -> Graph:
    norms, sums = _moves(graph)
    removed = set(norms.values()) | set(sums.values())

    def rewrite(index: int, op: Op) -> list[Op]:
        if index in removed:
            return []
        if index in norms:
            norm = graph.ops[norms[index]]
            x, *affine = norm.inputs
            rolled = f"{op.outputs[0]}_input"
            notes.append(f"{graph.name}/{op.outputs[0]}: the roll of {norm.outputs[0]} (axes "
                         f"{list(op.attrs['axes'])}) applied to the LayerNorm's input, {x}")
            return [Op("roll", (x,), (rolled,), op.attrs), Op("layer_norm", (rolled, *affine), op.outputs, norm.attrs)]
        if index in sums:
            roll = graph.ops[sums[index]]
            (other,) = [name for name in op.inputs if name != roll.outputs[0]]
            back = {**roll.attrs, "shifts": [-int(s) for s in roll.attrs["shifts"]]}
            unrolled, total = f"{op.outputs[0]}_unrolled_term", f"{op.outputs[0]}_unrolled"
            notes.append(f"{graph.name}/{op.outputs[0]}: the sum of {other} and the roll of {roll.inputs[0]} taken "
                         f"as the roll of their sum, {other} rolled back (axes {list(roll.attrs['axes'])})")
            return [Op("roll", (other,), (unrolled,), back), Op("add", (unrolled, roll.inputs[0]), (total,)),
                    Op("roll", (total,), op.outputs, roll.attrs)]
        return [op]

    return graph.rewritten(rewrite, lambda body: _rewritten(body, notes))
