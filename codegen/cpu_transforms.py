"""Graph -> Graph rewrites for the CPU backend, done once at compile time.

``hoist_scan_projections``: per-step matrix products of a scan's inputs by step-invariant
weights are done once over the whole sequence before the scan (see its docstring).

``pack_weights``: every ``dense``/``conv2d`` whose weight is a compile-time constant
reads a packed copy instead (``souffle.ops.packed``), so the CPU schedule can load a
vector of consecutive output features from one cache line. A weight is constant when
it is a top-level parameter, or, inside a scan body, a body parameter bound to
constants (per-layer weights, stacked by the stitcher) or an invariant input bound to
a constant; the packed copy is threaded through the same bindings. Parameters left
unused are dropped, so each weight is stored once, packed.
"""

from __future__ import annotations

from dataclasses import replace

from souffle.graph import Graph, Op, Scan, TensorSpec
from souffle.ops.packed import pack_rows

PACKABLE = {"dense": ("dense_packed", 2), "conv2d": ("conv2d_packed", 4)}  # op kind -> (packed kind, weight rank)


def packed_name(name: str, block: int) -> str:
    return f"{name}.packed{block}"


def _block_for(rows: int) -> int | None:
    """Output features per packed block: two AVX2 vectors, else one; None if neither divides."""
    for block in (16, 8):
        if rows % block == 0:
            return block
    return None


def _packed_spec(spec: TensorSpec, block: int) -> TensorSpec:
    shape = (spec.shape[0] // block,) + spec.shape[1:] + (block,)
    return TensorSpec(packed_name(spec.name, block), shape, spec.dtype)


def pack_weights(graph: Graph) -> Graph:
    """``graph`` with constant dense/conv2d weights packed (the same graph if none is)."""
    if graph.weights is None:
        return graph
    rewritten, exports = _rewrite(graph, set(graph.params))
    if not exports:
        return graph
    weights = {name: value for name, value in graph.weights.items() if name in rewritten.params}
    for name, block in exports.items():
        weights[packed_name(name, block)] = pack_rows(graph.weights[name], block)
    return Graph(rewritten.name, rewritten.inputs, rewritten.params.values(), rewritten.ops, rewritten.outputs, weights)


def _rewrite(graph: Graph, constants: set[str]) -> tuple[Graph, dict[str, int]]:
    """Rewrite ``graph`` given which of its tensors are constants. Returns the new graph
    (weights not attached) and ``exports``: constant inputs/params of ``graph`` whose
    packed copy the new graph expects, as a new input/param ``packed_name(name, block)``."""
    exports: dict[str, int] = {}
    ops: list[Op | Scan] = []
    for op in graph.ops:
        if isinstance(op, Scan):
            ops.append(_rewrite_scan(op, constants, exports))
        elif op.kind in PACKABLE and op.inputs[1] in constants:
            ops.append(_packed_op(graph, op, exports))
        else:
            ops.append(op)
    used = {name for op in ops for name in op.inputs} | set(graph.outputs)
    inputs = [s for s in graph.inputs if s.name in used or s.name not in constants]
    inputs += [_packed_spec(s, exports[s.name]) for s in graph.inputs if s.name in exports]
    params = [s for s in graph.params.values() if s.name in used]
    params += [_packed_spec(s, exports[s.name]) for s in graph.params.values() if s.name in exports]
    return Graph(graph.name, inputs, params, ops, graph.outputs), exports


def _packed_op(graph: Graph, op: Op, exports: dict[str, int]) -> Op:
    kind, rank = PACKABLE[op.kind]
    weight = op.inputs[1]
    spec = graph.tensors[weight]
    block = _block_for(spec.shape[0])
    if len(spec.shape) != rank or block is None:
        return op
    exports[weight] = block
    # split_k is a GPU choice (codegen.split_k) of the same product; packed rows are the CPU's
    attrs = {key: value for key, value in op.attrs.items() if key != "split_k"}
    return Op(kind, (op.inputs[0], packed_name(weight, block)) + op.inputs[2:], op.outputs, attrs)


def _rewrite_scan(scan: Scan, constants: set[str], exports: dict[str, int]) -> Scan:
    """Rewrite the body, then bind each packed body tensor to the packed outer tensors."""
    body = scan.body
    body_constants = {inner for inner, outer in scan.invariants if outer in constants}
    body_constants |= {inner for inner, outers in scan.params if all(o in constants for o in outers)}
    new_body, body_exports = _rewrite(body, body_constants)
    if not body_exports:
        return scan
    kept = {s.name for s in new_body.inputs} | set(new_body.params)
    invariants = [(inner, outer) for inner, outer in scan.invariants if inner in kept]
    params = [(inner, outers) for inner, outers in scan.params if inner in kept]
    for inner, outer in scan.invariants:
        if inner in body_exports:
            block = body_exports[inner]
            invariants.append((packed_name(inner, block), packed_name(outer, block)))
            exports[outer] = block
    for inner, outers in scan.params:
        if inner in body_exports:
            block = body_exports[inner]
            params.append((packed_name(inner, block), tuple(packed_name(o, block) for o in outers)))
            exports.update({o: block for o in outers})
    return replace(scan, body=new_body, invariants=tuple(invariants), params=tuple(params))



def hoist_scan_projections(graph: Graph) -> Graph:
    """``graph`` with each scan's per-step projections of its scanned inputs done up front.

    A ``dense`` in a scan body whose input is a scanned slice (``xs``) and whose weight and
    bias are the same every step (invariants) does not depend on the carried state, so it
    runs once over the whole sequence before the scan, as one matrix product, and the body
    reads its slice of the result instead: an LSTM's input projection becomes a GEMM per
    layer instead of a GEMV per step, halving the weights each step streams. Nested scans
    are rewritten inside out. Returns the same graph when nothing moves.
    """
    ops: list[Op | Scan] = []
    changed = False
    for op in graph.ops:
        if isinstance(op, Scan):
            body = hoist_scan_projections(op.body)
            hoisted, scan = _hoist_projections(replace(op, body=body) if body is not op.body else op)
            ops += hoisted + [scan]
            changed |= bool(hoisted) or scan is not op
        else:
            ops.append(op)
    if not changed:
        return graph
    return Graph(graph.name, graph.inputs, graph.params.values(), ops, graph.outputs, graph.weights)


def _hoist_projections(scan: Scan) -> tuple[list[Op], Scan]:
    body = scan.body
    sequences = dict(scan.xs)
    invariants = dict(scan.invariants)
    invariants.update({inner: outers[0] for inner, outers in scan.params if len(set(outers)) == 1})
    hoisted: list[Op] = []
    new_xs: list[tuple[str, str]] = []
    kept_ops: list[Op | Scan] = []
    for op in body.ops:
        movable = (
            isinstance(op, Op) and op.kind == "dense" and op.inputs[0] in sequences
            and all(name in invariants for name in op.inputs[1:]) and op.outputs[0] not in body.outputs
        )
        if not movable:
            kept_ops.append(op)
            continue
        stacked = f"{scan.name}.{op.outputs[0]}"
        hoisted.append(Op("dense", (sequences[op.inputs[0]],) + tuple(invariants[n] for n in op.inputs[1:]),
                          (stacked,), dict(op.attrs)))
        new_xs.append((op.outputs[0], stacked))
    if not hoisted:
        return [], scan
    used = {name for op in kept_ops for name in op.inputs} | set(body.outputs)
    used |= {inner for inner, _, _, _ in scan.carry}
    inputs = [s for s in body.inputs if s.name in used] + [body.tensors[inner] for inner, _ in new_xs]
    params = [s for s in body.params.values() if s.name in used]
    new_body = Graph(body.name, inputs, params, kept_ops, body.outputs)
    return hoisted, replace(
        scan, body=new_body,
        xs=tuple(x for x in scan.xs if x[0] in used) + tuple(new_xs),
        invariants=tuple(v for v in scan.invariants if v[0] in used),
        params=tuple(p for p in scan.params if p[0] in used),
    )
