"""Horizontal transformation: independent GEMMs become one GEMM.

Two kinds of ``dense`` groups of one graph are merged, both with weights known at compile
time, so every consumer is left untouched (each member's output is produced again under its
own name):

- **Shared activation** (BERT's query, key and value projections; MMoE's experts and gates):
  dense ops reading the same input with the same in_features, output widths free, are one
  wider matrix product. Their weights (and biases) are concatenated along the output
  features, the product runs as one ``dense``, and one ``slice`` per member at its row
  offset gives back that member's output.
- **Same shapes, different activations** (MMoE's per-task towers): mutually independent dense
  ops whose inputs are distinct tensors of one shape and whose weights (and biases) share
  their shapes are one batched product over a new leading axis: the inputs are stacked
  (reshape each to ``[1, M, K]``, concat along axis 0), multiplied by the stacked weight
  ``[G, N, K]`` in one ``batch_matmul`` (``transpose_b``), the stacked bias added as
  ``[G, 1, N]``, and each member's output is its slice along axis 0, reshaped back.

Only weights known at compile time can be concatenated or stacked: top-level parameters, and
scan-body parameters bound, iteration by iteration, to such weights. A merged body parameter
gets its own scan binding whose per-iteration names are new merged weights one level up,
down to new top-level weight arrays (each with a ``souffle.recipe`` saying how it is made
from the model's weights), so nested scans are handled the same way. Parameters the fusion
leaves unused are dropped, with their bindings and arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from souffle import recipe
from souffle.graph import Graph, Op, Scan, TensorSpec
from souffle.naming import UniqueNames


def horizontal(graph: Graph) -> tuple[Graph, list[str]]:
    """``graph`` with dense ops on a shared activation fused, and independent same-shaped dense
    ops batched, and one line per fusion saying what was merged. ``graph`` itself is not
    changed; a graph without weight arrays (``souffle.models.structure``) is rewritten in
    structure only."""
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
    specs: dict[str, TensorSpec] = field(init=False)  # every tensor, new ones included
    fresh: UniqueNames = field(init=False)  # every tensor name taken, so new ones are unique
    retired: set[str] = field(default_factory=set)  # replaced parameters, dropped if unused
    derived: dict[tuple, str] = field(default_factory=dict)  # (how, members) -> new param
    children: dict[int, _Level] = field(init=False)  # id(scan) -> its body

    def __post_init__(self):
        self.ops = list(self.graph.ops)
        self.params = dict(self.graph.params)
        self.specs = dict(self.graph.tensors)
        self.fresh = UniqueNames(self.graph.tensors, separator=".")
        self.children = {
            id(op): _Level(op.body, self, f"{self.label}/{op.name}", dict(op.params))
            for op in self.graph.ops if isinstance(op, Scan)
        }

    def define(self, base: str, shape: tuple[int, ...], dtype: str) -> str:
        """A new tensor named after ``base`` (made unique), with its spec recorded."""
        name = self.fresh(base)
        self.specs[name] = TensorSpec(name, shape, dtype)
        return name

    def is_weight(self, name: str) -> bool:
        """Whether ``name`` is a model weight in every iteration (a top-level parameter, or
        a body parameter bound to such weights): only those can be merged up front."""
        if name not in self.params:
            return False
        return self.parent is None or all(self.parent.is_weight(outer) for outer in self.bindings[name])


class _Rewrite:
    """One ``horizontal`` call: its copy of the top-level weights and what it has fused."""

    def __init__(self, weights: dict[str, np.ndarray] | None, recipes: dict[str, list]):
        self.weights = weights  # top-level arrays, new merged weights added; None: structure only
        self.recipes = dict(recipes)  # how derived top-level weights are made (souffle.recipe)
        self.notes: list[str] = []

    def fuse(self, level: _Level):
        for members in _shared_input_groups(level):
            self._fuse_group(level, members)
        for candidates in _same_shape_groups(level):
            self._batch_all(level, candidates)
        for child in level.children.values():
            self.fuse(child)

    # -- shared activation: one wider dense ----------------------------------------------------
    def _fuse_group(self, level: _Level, members: list[Op]):
        """Replace ``members`` by one dense and a slice per member, at the first member.

        That position is always valid: the fused op reads the shared activation, produced
        before every member, and parameters, defined before any op; the slices define each
        member's output no later than the member did, so all its consumers still follow.
        """
        first = members[0]
        params = tuple(self._derived(level, "concat", tuple(op.inputs[k] for op in members))
                       for k in range(1, len(first.inputs)))
        x = level.specs[first.inputs[0]]
        widths = [level.params[op.inputs[1]].shape[0] for op in members]
        fused = level.define(_merged_name([op.outputs[0] for op in members]), x.shape[:-1] + (sum(widths),), x.dtype)
        replacement = [Op("dense", (first.inputs[0],) + params, (fused,), dict(first.attrs))]
        offset = 0
        for op, width in zip(members, widths):
            replacement.append(Op("slice", (fused,), op.outputs, {"begin": offset, "end": offset + width, "axis": -1}))
            offset += width
        replaced = {id(op) for op in members}
        ops: list[Op | Scan] = []
        for op in level.ops:
            if op is first:
                ops += replacement
            elif id(op) not in replaced:
                ops.append(op)
        level.ops = ops
        shapes = [list(level.params[op.inputs[1]].shape) for op in members]
        self.notes.append(
            f"{level.label}: fused dense {_labels(members)} ({_counted(shapes)}) reading {first.inputs[0]} "
            f"-> one dense {list(level.params[params[0]].shape)}"
        )

    # -- same shapes, different activations: one batch_matmul ----------------------------------
    def _batch_all(self, level: _Level, candidates: list[Op]):
        """Batch ``candidates`` (same shapes, any inputs) in mutually independent groups:
        greedily, in graph order, each group takes every remaining candidate that neither
        depends on nor feeds a member already taken and reads an input no member reads."""
        remaining = list(candidates)
        while len(remaining) > 1:
            taken, rest = [remaining[0]], []
            for op in remaining[1:]:
                inputs = {member.inputs[0] for member in taken}
                if op.inputs[0] not in inputs and all(_independent(level.ops, op, member) for member in taken):
                    taken.append(op)
                else:
                    rest.append(op)
            if len(taken) > 1 and self._batch_group(level, taken):
                remaining = rest
            else:
                remaining = remaining[1:]

    def _batch_group(self, level: _Level, members: list[Op]) -> bool:
        """Replace ``members`` by one batched product; False (nothing changed) if they are not
        mutually independent.

        The batched ops go right after the last producer of any member input. Ops before that
        point that read a member's output (directly or through other ops) move, in their
        order, to just after the batched ops; nothing they feed comes before that point, so
        the order stays topological. A member whose input depends on a member's output makes
        that impossible: the group is left alone.
        """
        order = _placement(level.ops, members)
        if order is None:
            return False
        before, deferred, after = order
        first = members[0]
        x = level.specs[first.inputs[0]]
        weight = level.params[first.inputs[1]]
        count, rows, (n, k) = len(members), math.prod(x.shape[:-1]), weight.shape
        params = tuple(self._derived(level, "stack", tuple(op.inputs[i] for op in members))
                       for i in range(1, len(first.inputs)))
        outputs = [op.outputs[0] for op in members]
        merged = _merged_name(outputs)

        glue: list[Op] = []
        pieces = []
        for op in members:
            piece = level.define(f"{op.outputs[0]}.input", (1, rows, k), x.dtype)
            glue.append(Op("reshape", (op.inputs[0],), (piece,), {"shape": (1, rows, k)}))
            pieces.append(piece)
        stacked = level.define(f"{merged}.input", (count, rows, k), x.dtype)
        glue.append(Op("concat", tuple(pieces), (stacked,), {"axis": 0}))
        if len(params) == 1:
            product = level.define(merged, (count, rows, n), x.dtype)
            glue.append(Op("batch_matmul", (stacked, params[0]), (product,), {"transpose_b": True}))
        else:
            matmul = level.define(f"{merged}.matmul", (count, rows, n), x.dtype)
            glue.append(Op("batch_matmul", (stacked, params[0]), (matmul,), {"transpose_b": True}))
            bias = level.define(f"{params[1]}.rows", (count, 1, n), x.dtype)
            glue.append(Op("reshape", (params[1],), (bias,), {"shape": (count, 1, n)}))
            product = level.define(merged, (count, rows, n), x.dtype)
            glue.append(Op("add", (matmul, bias), (product,)))
        for g, op in enumerate(members):
            out = level.specs[op.outputs[0]]
            piece = level.define(f"{op.outputs[0]}.batched", (1, rows, n), out.dtype)
            glue.append(Op("slice", (product,), (piece,), {"begin": g, "end": g + 1, "axis": 0}))
            glue.append(Op("reshape", (piece,), op.outputs, {"shape": out.shape}))
        level.ops = before + glue + deferred + after
        inputs = ", ".join(op.inputs[0] for op in members)
        self.notes.append(
            f"{level.label}: batched dense {_labels(members)} ({count} x {list(weight.shape)}) reading {inputs} "
            f"-> one batch_matmul {list(level.params[params[0]].shape)}"
        )
        return True

    # -- merged weights -------------------------------------------------------------------------
    def _derived(self, level: _Level, how: str, members: tuple[str, ...]) -> str:
        """A parameter of ``level`` holding ``members`` merged (``how``: "concat" along axis 0
        or "stack" along a new axis 0): at the top a new weight array with its recipe, in a
        scan body a parameter bound per iteration to the merge of that iteration's member
        weights one level up."""
        key = (how, members)
        if key in level.derived:
            return level.derived[key]
        specs = [level.params[name] for name in members]
        if how == "concat":
            shape = (sum(spec.shape[0] for spec in specs),) + specs[0].shape[1:]
        else:
            shape = (len(specs),) + specs[0].shape
        spec = TensorSpec(level.fresh(_merged_name(members)), shape, specs[0].dtype)
        if level.parent is not None:
            per_iteration = zip(*(level.bindings[name] for name in members))
            level.bindings[spec.name] = tuple(self._derived(level.parent, how, outers) for outers in per_iteration)
        else:
            parts = [self.recipes.get(name, recipe.model(name)) for name in members]
            self.recipes[spec.name] = recipe.concat(parts) if how == "concat" else recipe.stack(parts)
            if self.weights is not None:
                arrays = [self.weights[name] for name in members]
                self.weights[spec.name] = np.concatenate(arrays, axis=0) if how == "concat" else np.stack(arrays)
        level.params[spec.name] = spec
        level.specs[spec.name] = spec
        level.retired.update(members)
        level.derived[key] = spec.name
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


def _dense_on_weights(level: _Level, op: Op | Scan) -> bool:
    return isinstance(op, Op) and op.kind == "dense" and all(level.is_weight(name) for name in op.inputs[1:])


def _shared_input_groups(level: _Level) -> list[list[Op]]:
    """Dense ops of ``level`` reading one activation with the same in_features (output widths
    free), bias in all or none, same attributes: in graph order, groups of two or more.

    Members read the same activation and otherwise only parameters, so none can depend on
    another: a data path from one member to another would have to enter through that shared
    activation, which both read and so precedes both. Grouping by input is what makes them
    independent; no separate check is needed.
    """
    groups: dict[tuple, list[Op]] = {}
    for op in level.ops:
        if _dense_on_weights(level, op):
            specs = [level.params[name] for name in op.inputs[1:]]
            key = (op.inputs[0], specs[0].shape[1:], tuple(spec.dtype for spec in specs), repr(sorted(op.attrs.items())))
            groups.setdefault(key, []).append(op)
    return [members for members in groups.values() if len(members) > 1]


def _same_shape_groups(level: _Level) -> list[list[Op]]:
    """Dense ops of ``level`` (after the shared-input fusions) whose inputs have one shape and
    whose weights (and biases) have one shape each, same attributes: candidates for one
    batched product, in graph order, two or more. Their independence is checked when they
    are batched (``_Rewrite._batch_all``)."""
    groups: dict[tuple, list[Op]] = {}
    for op in level.ops:
        if _dense_on_weights(level, op):
            specs = [level.specs[op.inputs[0]]] + [level.params[name] for name in op.inputs[1:]]
            key = (tuple((spec.shape, spec.dtype) for spec in specs), repr(sorted(op.attrs.items())))
            groups.setdefault(key, []).append(op)
    return [members for members in groups.values() if len(members) > 1]


def _downstream(ops: list[Op | Scan], sources: list[Op | Scan]) -> set[int]:
    """ids of the ops that read an output of ``sources``, directly or through other ops."""
    ids = {id(op) for op in sources}
    tainted = {name for op in sources for name in op.outputs}
    found: set[int] = set()
    for op in ops:  # in order: a tensor's readers come after its producer
        if id(op) not in ids and any(name in tainted for name in op.inputs):
            found.add(id(op))
            tainted.update(op.outputs)
    return found


def _independent(ops: list[Op | Scan], a: Op, b: Op) -> bool:
    """Whether neither of ``a`` and ``b`` reads the other's output, directly or not."""
    return id(b) not in _downstream(ops, [a]) and id(a) not in _downstream(ops, [b])


def _placement(ops: list[Op | Scan], members: list[Op]):
    """(ops before the batched op, ops deferred to just after it, ops after it), members
    left out, or None if a member's input depends on a member's output."""
    members_ids = {id(op) for op in members}
    late = _downstream(ops, members) | members_ids
    inputs = {op.inputs[0] for op in members}
    producers = [i for i, op in enumerate(ops) if inputs.intersection(op.outputs)]
    if any(id(ops[i]) in late for i in producers):
        return None
    cut = max(producers) + 1 if producers else 0  # graph inputs and parameters: at the top
    before = [op for op in ops[:cut] if id(op) not in late]
    deferred = [op for op in ops[:cut] if id(op) in late and id(op) not in members_ids]
    after = [op for op in ops[cut:] if id(op) not in members_ids]
    return before, deferred, after


def _labels(members: list[Op]) -> str:
    return ", ".join(op.inputs[1].removesuffix(".weight") for op in members)


def _counted(shapes: list[list[int]]) -> str:
    """``3 x [4, 10] + 2 x [3, 10]``: the members' weight shapes, runs of equal ones counted."""
    runs: list[list] = []
    for shape in shapes:
        if runs and runs[-1][1] == shape:
            runs[-1][0] += 1
        else:
            runs.append([1, shape])
    return " + ".join(f"{count} x {shape}" for count, shape in runs)


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
