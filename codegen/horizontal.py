"""Horizontal transformation: independent GEMMs with the same shape become one GEMM.

``dense`` ops of one graph that read the same activation with same-shaped weights are
one wider matrix product: their weights (and biases) are concatenated along the output
features at compile time, the product runs as one op, and one ``slice`` per original op
produces exactly the tensor that op produced, so every consumer is left untouched. BERT's
query, key and value projections and MMoE's experts are the paper's cases.

Only weights known at compile time can be concatenated: top-level parameters, and scan-body
parameters bound, iteration by iteration, to such weights. A fused body parameter gets its
own scan binding whose per-iteration names are new concatenated weights one level up, down
to new top-level weight arrays, so nested scans are handled the same way. Parameters the
fusion leaves unused are dropped, with their bindings and arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from souffle import recipe
from souffle.graph import Graph, Op, Scan, TensorSpec


def horizontal(graph: Graph) -> tuple[Graph, list[str]]:
    """``graph`` with same-shaped dense ops on a shared activation fused, and one line per
    fusion saying what was fused. ``graph`` itself is not changed; a graph without weight
    arrays (``souffle.models.structure``) is rewritten in structure only."""
    rewrite = _Rewrite(None if graph.weights is None else dict(graph.weights), graph.recipes)
    root = _Level(graph, None, graph.name, {})
    rewrite.fuse(root)
    return rewrite.rebuild(root), rewrite.notes


@dataclass(eq=False)
class _Level:
    """One graph under rewrite (the top level or a scan body) as mutable lists, since a
    ``Graph`` is validated once and immutable; it is rebuilt when every fusion is done."""

    graph: Graph
    parent: _Level | None
    label: str
    bindings: dict[str, tuple[str, ...]]  # body parameter -> outer name per iteration
    ops: list[Op | Scan] = field(init=False)
    params: dict[str, TensorSpec] = field(init=False)
    names: set[str] = field(init=False)  # every tensor name taken, so new ones are unique
    retired: set[str] = field(default_factory=set)  # replaced parameters, dropped if unused
    concatenated: dict[tuple[str, ...], str] = field(default_factory=dict)  # members -> new param
    children: dict[int, _Level] = field(init=False)  # id(scan) -> its body

    def __post_init__(self):
        self.ops = list(self.graph.ops)
        self.params = dict(self.graph.params)
        self.names = set(self.graph.tensors)
        self.children = {
            id(op): _Level(op.body, self, f"{self.label}/{op.name}", dict(op.params))
            for op in self.graph.ops if isinstance(op, Scan)
        }

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.names:
            k += 1
            name = f"{base}.{k}"
        self.names.add(name)
        return name

    def is_weight(self, name: str) -> bool:
        """Whether ``name`` is a model weight in every iteration (a top-level parameter, or
        a body parameter bound to such weights): only those can be concatenated up front."""
        if name not in self.graph.params:
            return False
        return self.parent is None or all(self.parent.is_weight(outer) for outer in self.bindings[name])


class _Rewrite:
    """One ``horizontal`` call: its copy of the top-level weights and what it has fused."""

    def __init__(self, weights: dict[str, np.ndarray] | None, recipes: dict[str, list]):
        self.weights = weights  # top-level arrays, new concatenations added; None: structure only
        self.recipes = dict(recipes)  # how derived top-level weights are made (souffle.recipe)
        self.notes: list[str] = []

    def fuse(self, level: _Level):
        for members in _groups(level):
            self._fuse_group(level, members)
        for child in level.children.values():
            self.fuse(child)

    def _fuse_group(self, level: _Level, members: list[Op]):
        """Replace ``members`` by one dense and a slice per member, at the first member.

        That position is always valid: the fused op reads the shared activation, produced
        before every member, and parameters, defined before any op; the slices define each
        member's output no later than the member did, so all its consumers still follow.
        """
        first = members[0]
        params = tuple(self._concatenated(level, tuple(op.inputs[k] for op in members)) for k in range(1, len(first.inputs)))
        fused = level.fresh(_merged_name([op.outputs[0] for op in members]))
        weight = level.graph.tensors[first.inputs[1]]
        rows = weight.shape[0]
        replacement = [Op("dense", (first.inputs[0],) + params, (fused,), dict(first.attrs))]
        replacement += [
            Op("slice", (fused,), op.outputs, {"begin": k * rows, "end": (k + 1) * rows, "axis": -1})
            for k, op in enumerate(members)
        ]
        replaced = {id(op) for op in members}
        ops: list[Op | Scan] = []
        for op in level.ops:
            if op is first:
                ops += replacement
            elif id(op) not in replaced:
                ops.append(op)
        level.ops = ops
        self.notes.append(
            f"{level.label}: fused dense {', '.join(op.inputs[1].removesuffix('.weight') for op in members)} "
            f"({len(members)} x {list(weight.shape)}) reading {first.inputs[0]} -> one dense "
            f"{list(level.params[params[0]].shape)}"
        )

    def _concatenated(self, level: _Level, members: tuple[str, ...]) -> str:
        """A parameter of ``level`` holding ``members`` concatenated along axis 0: at the top
        a new weight array, in a scan body a parameter bound per iteration to the
        concatenation of that iteration's member weights one level up."""
        if members in level.concatenated:
            return level.concatenated[members]
        specs = [level.params[name] for name in members]
        rows = sum(spec.shape[0] for spec in specs)
        spec = TensorSpec(level.fresh(_merged_name(members)), (rows,) + specs[0].shape[1:], specs[0].dtype)
        if level.parent is not None:
            per_iteration = zip(*(level.bindings[name] for name in members))
            level.bindings[spec.name] = tuple(self._concatenated(level.parent, outers) for outers in per_iteration)
        else:
            self.recipes[spec.name] = recipe.concat([self.recipes.get(name, recipe.model(name)) for name in members])
            if self.weights is not None:
                self.weights[spec.name] = np.concatenate([self.weights[name] for name in members], axis=0)
        level.params[spec.name] = spec
        level.retired.update(members)
        level.concatenated[members] = spec.name
        return spec.name

    def rebuild(self, level: _Level) -> Graph:
        """The level's Graph, bodies first (a scan binds only the parameters its rebuilt body
        kept); replaced parameters nothing reads any more are dropped."""
        ops: list[Op | Scan] = []
        for op in level.ops:
            if isinstance(op, Scan):
                child = level.children[id(op)]
                body = self.rebuild(child)
                op = replace(op, body=body, params=tuple((p, outers) for p, outers in child.bindings.items() if p in body.params))
            ops.append(op)
        used = {name for op in ops for name in op.inputs} | set(level.graph.outputs)
        params = [spec for spec in level.params.values() if spec.name in used or spec.name not in level.retired]
        weights, recipes = None, {}
        if level.parent is None:
            recipes = {spec.name: self.recipes[spec.name] for spec in params if spec.name in self.recipes}
            if self.weights is not None:
                weights = {spec.name: self.weights[spec.name] for spec in params}
        return Graph(level.graph.name, level.graph.inputs, params, ops, level.graph.outputs, weights, recipes)


def _groups(level: _Level) -> list[list[Op]]:
    """Dense ops of ``level`` that can become one, in graph order, groups of two or more.

    Members read the same activation and otherwise only parameters, so none can depend on
    another: a data path from one member to another would have to enter through that shared
    activation, which both read and so precedes both. Grouping by input is what makes them
    independent; no separate check is needed.
    """
    groups: dict[tuple, list[Op]] = {}
    tensors = level.graph.tensors
    for op in level.graph.ops:
        if isinstance(op, Op) and op.kind == "dense" and all(level.is_weight(name) for name in op.inputs[1:]):
            shapes = tuple((tensors[name].shape, tensors[name].dtype) for name in op.inputs[1:])
            key = (op.inputs[0], shapes, repr(sorted(op.attrs.items())))
            groups.setdefault(key, []).append(op)
    return [members for members in groups.values() if len(members) > 1]


def _merged_name(names: list[str] | tuple[str, ...]) -> str:
    """``a.{b,c}.d`` for ``a.b.d`` and ``a.c.d``: says what was merged, is deterministic, and
    (with its braces) cannot be a model's own state_dict name. Every member keeps at least
    one dotted component inside the braces."""
    parts = [name.split(".") for name in names]
    shared = min(len(p) for p in parts) - 1
    head = 0
    while head < shared and len({p[head] for p in parts}) == 1:
        head += 1
    tail = 0
    while head + tail < shared and len({p[-1 - tail] for p in parts}) == 1:
        tail += 1
    middle = ",".join(".".join(p[head : len(p) - tail]) for p in parts)
    first = parts[0]
    return ".".join(first[:head] + ["{" + middle + "}"] + first[len(first) - tail :])
