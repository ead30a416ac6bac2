"""Dropping what an imported graph computes but never uses."""

from __future__ import annotations

from souffle.graph import Graph


def without_dead_ops(graph: Graph) -> Graph:
    """``graph`` without the ops and weights no output depends on. An importer makes some (a
    reshape a later reshape reads past, a constant's unused copy); left in, they would be
    computed for nothing and would read tensors that transforms such as the LSTM wavefront
    must otherwise be the only readers of."""
    needed = set(graph.outputs)
    live = []
    for op in reversed(graph.ops):
        if needed.intersection(op.outputs):
            live.append(op)
            needed.update(op.inputs)
    params = [spec for name, spec in graph.params.items() if name in needed]
    weights = None if graph.weights is None else {spec.name: graph.weights[spec.name] for spec in params}
    return Graph(graph.name, graph.inputs, params, live[::-1], graph.outputs, weights)
