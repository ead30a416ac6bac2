"""The ``scale_past_matmul`` pass (O2): a scalar ``scale`` of a matmul's operand moves into the matmul.

Swin's attention scales the queries before their product with the keys (``q * head_dim ** -0.5``,
as torchvision and timm write it). Stored, the scaled queries are a stage of their own, behind a
grid barrier, in every block of the model (paper Swin: 24). As the matmul's ``alpha`` (cuBLAS's
alpha), the factor multiplies the float32 accumulator before it is rounded to a narrow dtype, in
the scores' GEMM epilogue beside the relative position bias: no stage, and no float16 product
that would overflow unscaled. A scalar commutes with the layout ops between the scale and the
product (reshape, transpose) and with the product itself, so both programs compute the same
scores up to where they round.
"""

from __future__ import annotations

from souffle.graph import Graph, Op, Scan

LAYOUT_OPS = ("reshape", "transpose")  # element order only: a scalar factor passes through them
# bilinear in their two operands (``dense`` is not: its bias would be scaled too)
MATMULS = ("batch_matmul", "matmul")


def scale_past_matmul(graph: Graph) -> tuple[Graph, list[str]]:
    """``graph`` with each ``scale`` whose result reaches a matmul's operand through layout ops
    alone, each read once, folded into the matmul's ``alpha`` (scan bodies included), and one
    note per move; ``graph`` itself is not changed."""
    notes: list[str] = []
    return _rewritten(graph, notes), notes


def _moves(graph: Graph) -> dict[int, int]:
    """scale op index -> the index of the matmul its result reaches through layout ops, each
    tensor on the way read by one op and not a graph output."""
    readers = graph.readers()
    moves = {}
    for index, op in enumerate(graph.ops):
        if isinstance(op, Scan) or op.kind != "scale":
            continue
        tensor = op.outputs[0]
        while tensor not in graph.outputs and len(readers.get(tensor, ())) == 1:
            reader = graph.ops[readers[tensor][0]]
            if isinstance(reader, Scan) or len(reader.outputs) != 1:
                break
            if reader.kind in MATMULS and reader.inputs.count(tensor) == 1:
                moves[index] = readers[tensor][0]
                break
            if reader.kind not in LAYOUT_OPS:
                break
            tensor = reader.outputs[0]
    return moves


def _rewritten(graph: Graph, notes: list[str]) -> Graph:
    moves = _moves(graph)
    factors: dict[int, float] = {}
    for scale, matmul in moves.items():
        factors[matmul] = factors.get(matmul, 1.0) * float(graph.ops[scale].attrs["factor"])
    renamed = {graph.ops[scale].outputs[0]: graph.ops[scale].inputs[0] for scale in moves}

    def rewrite(index: int, op: Op) -> list[Op]:
        if index in moves:
            return []
        if index in factors:
            alpha = float(op.attrs.get("alpha", 1.0)) * factors[index]
            inputs = tuple(renamed.get(n, n) for n in op.inputs)
            notes.append(f"{graph.name}/{op.outputs[0]}: the scale by {factors[index]:.6g} of its operand "
                         f"{' and '.join(graph.ops[s].inputs[0] for s in moves if moves[s] == index)} "
                         f"applied to its product (alpha {alpha:.6g})")
            return [Op(op.kind, inputs, op.outputs, {**op.attrs, "alpha": alpha})]
        return [op if not renamed.keys() & set(op.inputs) else
                Op(op.kind, tuple(renamed.get(n, n) for n in op.inputs), op.outputs, op.attrs)]

    return graph.rewritten(rewrite, lambda body: _rewritten(body, notes))
