"""The LSTM wavefront: a stacked LSTM as ONE scan whose steps run the cells of all layers.

Cell (layer l, step t) needs only cell (l, t - 1) and cell (l - 1, t), so all cells with the
same l + t are independent. Wavefront step s runs them together: layer l at time s - l, its
input the h that layer l - 1 produced at step s - 1. The L x T cells of a stacked LSTM become
T + L - 1 steps, each one batched matrix product over the layer axis instead of L small ones
in sequence, which is what lets one persistent kernel keep the whole GPU busy. Layers outside
their time range (s - l < 0 or s - l >= T) still compute, on zeros or stale state, and a
constant 0/1 mask keeps their state instead.

The gates are ONE batched matrix product per step: each layer's input and its h are
concatenated along the reduction axis (``[layer_in, h]``, width K + H) and multiplied by one
stacked weight whose columns are W_ih's (padded to K) followed by W_hh's. The recurrent state
is ONE carried tensor ``state`` [L, B, H, 2], h at ``[..., 0]`` and c at ``[..., 1]``, and the
gate pre-activations are read only by the ops that end in the new state (one ``concat`` of the
blended h and c): after vertical inlining the one gate product has a single consumer, the
state TE, so the persistent kernel can fuse the reduction with its consumer into one stage
(two products read by one TE could not be). The next step's layer inputs are sliced from the
state, and the final h and c of every layer from the final one. The per-step output ``h_top``
is the last layer's h of the CARRIED state (the one the step starts from), not the new one: it
then reads the slot the gate product reads while the product writes the other, so the
persistent kernel runs both in one barrier phase (one grid barrier per step). Step s thus
outputs the last layer's h after step s - 1, and the output sequence is ``ys[L:]`` followed by
the last layer's h of the final state.

Every weight the rewrite creates carries a recipe (``souffle.recipe``) composed with the input
graph's own, so a machine without TVM rebuilds it from the model's weights.

``wavefront(graph)`` recognises a stacked LSTM by its structure, whatever its tensor names and
wherever it sits in the graph. A layer is a time scan whose body is an LSTM cell (torch's gates
i, f, g, o from ``dense`` products of x_t and h, zero initial state, weights that are model
parameters); layers are stacked as time scans chained by their sequences (as an importer writes
them) or as a scan over layers whose body is one time scan (``souffle.models.lstm``). The chain
of scans is replaced in place: what the rest of the graph reads from it (the last layer's
sequence, final states, stacks of them such as h_n) is produced again under its own name from
the wavefront's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from souffle import recipe
from souffle.graph import Graph, GraphBuilder, Op, Scan, TensorSpec
from souffle.naming import UniqueNames

GATES = 4  # torch's gate order along the 4H rows: input, forget, cell (g), output
STATE_PARTS = {"h": 0, "c": 1}  # where h and c sit on the last axis of the wavefront state

# The cell, as patterns over the body's ops (``_unify``): a string is a tensor, the same
# string the same tensor; the operands of ``add`` and ``mul`` match in either order.
NEW_C = ("add", ("mul", ("sigmoid", "f"), "c"), ("mul", ("sigmoid", "i"), ("tanh", "g")))
NEW_H = ("mul", ("sigmoid", "o"), ("tanh", "c_next"))

Role = tuple[str, int, int]  # ("h" | "c" | "sequence", first layer, stop layer)


def wavefront(graph: Graph) -> tuple[Graph, list[str]]:
    """``graph`` with each stacked LSTM as one wavefront scan, and report lines saying so.

    A graph without a stacked LSTM of two or more layers comes back unchanged with no report
    (a single layer is already one time scan). The input graph is not modified; the result
    keeps its input and output names and dtypes, and has weights iff it had.
    """
    report: list[str] = []
    while True:  # one stack at a time: each rewrite changes the graph the next one is found in
        done = next(filter(None, (_rewrite(graph, chain) for chain in _chains(graph))), None)
        if done is None:
            return graph, report
        graph, lines = done
        report += lines


# -- recognising a layer ---------------------------------------------------------------------------
class _Layer(NamedTuple):
    """An LSTM layer's time scan, by the tensors one level up that it reads and writes."""

    sequence: str  # the input sequence [T, B, I]
    initial: tuple[str, str]  # h and c before step 0
    final: tuple[str, str]  # h and c after the last step
    outputs: str  # h of every step [T, B, H]
    weights: tuple[str, ...]  # W_ih, W_hh, then the gate biases (none, one or more)
    shape: tuple[int, int, int]  # (T, B, H)


def _lstm_layer(scan: Scan) -> _Layer | None:
    """``scan`` as an LSTM layer, or None: it carries h and c (in either order), scans one
    input x_t, outputs the new h of each step, and its body is an LSTM cell whose weights are
    the same tensors one level up in every step."""
    if (len(scan.carry), len(scan.xs), len(scan.ys)) != (2, 1, 1):
        return None
    body = scan.body
    ((x_t, sequence),), ((h_next, outputs),) = scan.xs, scan.ys
    # the h carry (the one whose new value is the per-step output) first
    (h, h_out, h0, h_final), (c, c_next, c0, c_final) = sorted(scan.carry, key=lambda carry: carry[1] != h_next)
    shape = body.tensors[h].shape
    if h_out != h_next or len(shape) != 2 or body.tensors[c].shape != shape or body.tensors[h].dtype != "float32":
        return None
    batch, hidden = shape
    cell = _unify(body, h_next, NEW_H, {"c": c, "c_next": c_next})
    cell = None if cell is None else _unify(body, c_next, NEW_C, cell)
    if cell is None:
        return None
    chunks = [_chunk(body, cell[gate], hidden) for gate in "ifgo"]
    gates = chunks[0] and chunks[0][0]
    if chunks != [(gates, k) for k in range(GATES)] or body.tensors[gates].shape != (batch, GATES * hidden):
        return None
    weights = _gate_weights(body, gates, x_t, h)
    outer = [_bound(scan, name) for name in weights or ()]
    if weights is None or any(names is None or len(set(names)) != 1 for names in outer):
        return None
    weights = tuple(names[0] for names in outer)
    return _Layer(sequence, (h0, c0), (h_final, c_final), outputs, weights, (scan.length, batch, hidden))


def _unify(body: Graph, name: str, pattern, bound: dict[str, str]) -> dict[str, str] | None:
    """``bound`` extended so that tensor ``name`` of ``body`` is ``pattern`` (``NEW_C``), or None.

    Commuted operands are tried in both orders and the first full match is kept: no pair in
    the cell's patterns can match both ways (its two sides need different ops), so a match
    that fails later could not have succeeded with the other order either."""
    if isinstance(pattern, str):
        if pattern in bound:
            return bound if bound[pattern] == name else None
        return {**bound, pattern: name}
    kind, *operands = pattern
    op = body.producer.get(name)
    if not isinstance(op, Op) or op.kind != kind or len(op.inputs) != len(operands):
        return None
    for inputs in (op.inputs, op.inputs[::-1]) if kind in ("add", "mul") else (op.inputs,):
        found = bound
        for operand, part in zip(inputs, operands):
            found = _unify(body, operand, part, found)
            if found is None:
                break
        else:
            return found
    return None


def _chunk(body: Graph, name: str, hidden: int) -> tuple[str, int] | None:
    """(G, k) if tensor ``name`` is the k-th ``hidden``-wide chunk of the last axis of a
    [..., 4H] tensor G: one of a ``split``'s equal pieces, or a ``slice`` of those columns;
    None otherwise. Only the last axis differs between G and the chunk, so only its bounds
    need reading."""
    op = body.producer.get(name)
    if not isinstance(op, Op) or op.kind not in ("slice", "split"):
        return None
    source = body.tensors[op.inputs[0]].shape
    if source[-1] != GATES * hidden or body.tensors[name].shape != source[:-1] + (hidden,):
        return None
    if op.kind == "split":
        if any(body.tensors[piece].shape != body.tensors[name].shape for piece in op.outputs):
            return None
        return op.inputs[0], op.outputs.index(name)
    begins, ends = _ints(op.attrs["begin"]), _ints(op.attrs["end"])
    axis = op.attrs.get("axis")
    axes = range(len(begins)) if axis is None else [a % len(source) for a in _ints(axis)]
    strides = _ints(op.attrs.get("strides") or (1,) * len(begins))
    begin, end, stride = dict(zip(axes, zip(begins, ends, strides)))[len(source) - 1]
    start, _, step = slice(begin, end, stride).indices(source[-1])
    return (op.inputs[0], start // hidden) if step == 1 and start % hidden == 0 else None


def _ints(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _gate_weights(body: Graph, gates: str, x_t: str, h: str) -> tuple[str, ...] | None:
    """(W_ih, W_hh, biases...) if ``gates`` is x_t·W_ihᵀ + h·W_hhᵀ plus biases: a sum (``add``s
    in any order and grouping) of one ``dense`` of x_t and one of h, each with or without its
    bias operand, and [4H] bias tensors; None otherwise."""
    shape = body.tensors[gates].shape
    weights: dict[str, str] = {}
    biases: list[str] = []
    for term in _summands(body, gates):
        op = body.producer.get(term)
        if isinstance(op, Op) and op.kind == "dense" and op.inputs[0] in {x_t, h} - set(weights) \
                and body.tensors[term].shape == shape:
            weights[op.inputs[0]] = op.inputs[1]
            biases += op.inputs[2:]
        else:
            biases.append(term)
    if set(weights) != {x_t, h} or any(body.tensors[bias].shape != shape[-1:] for bias in biases):
        return None
    return (weights[x_t], weights[h], *biases)


def _summands(graph: Graph, name: str) -> list[str]:
    """The terms of the ``add`` tree that computes ``name`` (``name`` itself if it is no sum)."""
    op = graph.producer.get(name)
    if isinstance(op, Op) and op.kind == "add":
        return [term for operand in op.inputs for term in _summands(graph, operand)]
    return [name]


def _bound(scan: Scan, name: str) -> tuple[str, ...] | None:
    """The tensor one level up that body tensor ``name`` is in each iteration (an invariant, or
    a body parameter bound to per-iteration weights); None for any other tensor."""
    bindings = {inner: (outer,) * scan.length for inner, outer in scan.invariants}
    bindings.update(scan.params)
    return bindings.get(name)


def _zero(graph: Graph, name: str) -> bool:
    op = graph.producer.get(name)
    return isinstance(op, Op) and op.kind == "full" and op.attrs.get("value", 0.0) == 0


# -- recognising the stack -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Group:
    """Consecutive layers of a stack that one top-level scan computes."""

    op: Scan
    sequence: str  # the first layer's input sequence
    output: str  # the last layer's output sequence
    weights: tuple[tuple[str, ...], ...]  # per layer: W_ih, W_hh, biases, all model parameters
    finals: dict[str, Role]  # final states the scan outputs, layers counted from its first
    shape: tuple[int, int, int]  # (T, B, H)


def _group(graph: Graph, op: Op | Scan) -> _Group | None:
    """``op`` as layers of a stacked LSTM, or None: a layer's time scan, or a scan over layers
    (``souffle.models.lstm``) that carries the sequence from layer to layer through one time
    scan, binds each iteration's weights (as body parameters, or invariants all layers share)
    and may stack the layers' final h and c. Each layer starts from zeros; its weights must be
    model parameters, known at compile time, so they can be stacked."""
    if not isinstance(op, Scan):
        return None
    layer = _lstm_layer(op)
    if layer is not None:
        level, layers, per_layer = graph, 1, lambda name: (name,)
        finals = {final: (part, 0, 1) for final, part in zip(layer.final, STATE_PARTS)}
        sequence, output = layer.sequence, layer.outputs
    else:
        if len(op.carry) != 1 or op.xs:
            return None
        ((sequence_in, sequence_out, sequence, output),) = op.carry
        inner = op.body.producer.get(sequence_out)
        layer = _lstm_layer(inner) if isinstance(inner, Scan) else None
        if layer is None or (layer.sequence, layer.outputs) != (sequence_in, sequence_out):
            return None
        parts = dict(zip(layer.final, STATE_PARTS))
        if any(name not in parts for name, _ in op.ys):
            return None
        level, layers, per_layer = op.body, op.length, lambda name: _bound(op, name)
        finals = {stacked: (parts[name], 0, layers) for name, stacked in op.ys}
    columns = [per_layer(name) for name in layer.weights]
    if not all(_zero(level, name) for name in layer.initial) or any(
            names is None or not set(names) <= set(graph.params) for names in columns):
        return None
    return _Group(op, sequence, output, tuple(zip(*columns)), finals, layer.shape)


def _chains(graph: Graph) -> list[list[_Group]]:
    """The stacked LSTMs of ``graph``: runs of groups of one (T, B, H), each reading the
    sequence the one before outputs, with two or more layers in all, in graph order."""
    groups = [group for group in (_group(graph, op) for op in graph.ops) if group is not None]
    reader: dict[str, _Group] = {}
    for group in groups:
        reader.setdefault(group.sequence, group)
    chains, taken = [], set()
    for group in groups:
        if id(group) in taken:
            continue
        chain = [group]
        while (after := reader.get(chain[-1].output)) is not None and after.shape == group.shape:
            chain.append(after)
        taken.update(id(member) for member in chain)
        if sum(len(member.weights) for member in chain) >= 2:
            chains.append(chain)
    return chains


def _roles(graph: Graph, chain: list[_Group]) -> tuple[dict[str, Role], set[int]]:
    """What each tensor the chain makes is in the wavefront's terms (a layer's sequence, or the
    final h or c of a range of layers), and the ops (ids) that make them: the chain's scans,
    then the reshapes and concats that only stack final states (h_n = concat(reshape(h_0),
    ...)), which one slice of the wavefront's state gives back."""
    roles: dict[str, Role] = {}
    absorbed: set[int] = set()
    first = 0
    for group in chain:
        stop = first + len(group.weights)
        roles[group.output] = ("sequence", stop - 1, stop)
        roles.update({name: (part, first + a, first + b) for name, (part, a, b) in group.finals.items()})
        absorbed.add(id(group.op))
        first = stop
    for op in graph.ops:
        if isinstance(op, Op) and op.inputs and all(name in roles for name in op.inputs):
            role = _stacking(graph, op, [roles[name] for name in op.inputs], chain[0].shape)
            if role is not None:
                roles[op.outputs[0]] = role
                absorbed.add(id(op))
    return roles, absorbed


def _stacking(graph: Graph, op: Op, parts: list[Role], shape: tuple[int, int, int]) -> Role | None:
    """The layers' final h (or c) that ``op`` gives from those in ``parts``: a reshape between
    the shapes such a stack has, or a concat of consecutive stacks along the layer axis."""
    if any(part[0] not in STATE_PARTS for part in parts):
        return None
    if op.kind == "reshape":
        role = parts[0]
    elif op.kind == "concat" and op.attrs.get("axis", 0) in (0, -3) \
            and all(len(graph.tensors[name].shape) == 3 for name in op.inputs) \
            and all(a[0] == b[0] and a[2] == b[1] for a, b in zip(parts, parts[1:])):
        role = (parts[0][0], parts[0][1], parts[-1][2])
    else:
        return None
    return role if _stack_shape(graph.tensors[op.outputs[0]].shape, role, shape) else None


def _stack_shape(got: tuple[int, ...], role: Role, shape: tuple[int, int, int]) -> bool:
    """Whether a tensor of shape ``got`` can hold the final states ``role``: [layers, B, H], or
    [B, H] for one layer (every such shape has the same row-major layout)."""
    _, batch, hidden = shape
    layers = role[2] - role[1]
    return got == (layers, batch, hidden) or (layers == 1 and got == (batch, hidden))


# -- the rewrite -----------------------------------------------------------------------------------
class _Sizes(NamedTuple):
    """(L, T, B, H, I, K): K = max(I, H) is the width every layer's input is padded to."""

    layers: int
    steps: int
    batch: int
    hidden: int
    inputs: int
    width: int


def _rewrite(graph: Graph, chain: list[_Group]) -> tuple[Graph, list[str]] | None:
    """``graph`` with ``chain``'s scans replaced by the wavefront and what the rest of the graph
    reads from them produced again under its own name, then ops and LSTM weights nothing
    reads dropped; None if the rest reads what the wavefront cannot give (a sequence of a
    layer other than the last)."""
    layer_weights = [weights for group in chain for weights in group.weights]
    steps, batch, hidden = chain[0].shape
    inputs = graph.tensors[chain[0].sequence].shape[-1]
    size = _Sizes(len(layer_weights), steps, batch, hidden, inputs, max(inputs, hidden))
    roles, absorbed = _roles(graph, chain)
    read = {name for op in graph.ops if id(op) not in absorbed for name in op.inputs} | set(graph.outputs)
    order = [name for op in graph.ops for name in op.outputs if name in read and name in roles]
    if any(roles[name][0] == "sequence" and roles[name][1] != size.layers - 1 for name in order):
        return None

    new = UniqueNames([*graph.tensors, *(op.name for op in graph.ops if isinstance(op, Scan))])
    prefix = new("wavefront")
    stacked = [TensorSpec(new(f"{prefix}.{what}"), shape) for what, shape in _stacked_shapes(size)]
    wave, state, h_top = _wavefront_ops(size, chain[0].sequence, [spec.name for spec in stacked], prefix, new)
    for name in order:
        wave += _read_back(size, name, graph.tensors[name].shape, roles[name], state, h_top, prefix, new)
    ops: list[Op | Scan] = []
    for op in graph.ops:  # the wavefront where the chain starts: its input is ready there
        if op is chain[0].op:
            ops += wave
        elif id(op) not in absorbed:
            ops.append(op)
    ops = _live(ops, graph.outputs)

    used = {name for op in ops for name in op.inputs} | set(graph.outputs)
    lstm = {name for weights in layer_weights for name in weights}
    kept = [spec for spec in graph.params.values() if spec.name in used or spec.name not in lstm]
    weights, recipes = _weights(graph, kept, stacked, _stacked_recipes(size, layer_weights))
    rewritten = Graph(graph.name, graph.inputs, kept + stacked, ops, graph.outputs, weights, recipes)

    scan = f"one wavefront scan of {steps + size.layers - 1} steps, cells of all layers batched per step"
    weight_shapes = ", ".join(f"{spec.name} {list(spec.shape)}" for spec in stacked[:2])
    report = [
        f"{graph.name}: {size.layers} layers x {steps} steps -> {scan}",
        f"{graph.name}: {len(lstm)} per-layer weights -> {weight_shapes} (W_ih and W_hh side by side for one gate product, gates of each hidden unit adjacent)",
    ]
    return rewritten, report


def _weights(graph: Graph, kept: list[TensorSpec], stacked: list[TensorSpec], made: list[list]):
    """(weight arrays or None, recipes) of the rewritten graph: the kept parameters' own, and the
    stacked ones' evaluated from ``graph``'s arrays by ``made`` (recipes in terms of ``graph``'s
    parameters) and composed with ``graph``'s recipes, so they start from the model's weights."""
    weights = None
    if graph.weights is not None:
        weights = {spec.name: graph.weights[spec.name] for spec in kept}
        weights.update({spec.name: recipe.evaluate(r, graph.weights) for spec, r in zip(stacked, made)})
    recipes = {spec.name: graph.recipes[spec.name] for spec in kept if spec.name in graph.recipes}
    recipes.update({spec.name: _compose(r, graph.recipe) for spec, r in zip(stacked, made)})
    return weights, recipes


def _live(ops: list[Op | Scan], outputs: tuple[str, ...]) -> list[Op | Scan]:
    """``ops`` without those whose outputs nothing reads, directly or through other ops."""
    read, live = set(outputs), []
    for op in reversed(ops):
        if read.intersection(op.outputs):
            live.append(op)
            read.update(op.inputs)
    return live[::-1]


# -- the wavefront graph ---------------------------------------------------------------------------
def _stacked_shapes(size: _Sizes) -> list[tuple[str, tuple[int, ...]]]:
    layers, steps, _, hidden, _, width = size
    wave = steps + layers - 1
    return [("weight", (layers, GATES * hidden, width + hidden)), ("bias", (layers, 1, GATES * hidden)),
            ("mask", (wave, layers, 1, 1)), ("keep", (wave, layers, 1, 1))]


def _stacked_recipes(size: _Sizes, layer_weights: list[tuple[str, ...]]) -> list[list]:
    """How each new weight is made from the graph's per-layer weights (W_ih, W_hh, biases):
    stacked over layers, gate rows interleaved per hidden unit (row 4j + k is gate k of unit j,
    so a tile of rows holds whole units), W_ih's layer inputs zero-padded to width K and W_hh's
    columns after them (``weight`` [L, 4H, K + H], the stacks concatenated along the reduction
    axis), the biases summed (``bias`` [L, 1, 4H], broadcast over the batch; zeros for a layer
    without); plus the constant masks: ``mask[s, l]`` is 1 where layer l is at a real time
    step s - l, ``keep`` its complement."""
    layers, steps, _, hidden, inputs, width = size
    rows = np.arange(GATES * hidden).reshape(GATES, hidden).T.reshape(-1)

    def weight_ih(layer: int, name: str) -> list:
        columns = inputs if layer == 0 else hidden
        return recipe.take(recipe.pad(recipe.model(name), [(0, 0), (0, width - columns)]), rows)

    def bias(names: tuple[str, ...]) -> list:
        if not names:
            return recipe.const(np.zeros(GATES * hidden, np.float32))
        parts = [recipe.model(name) for name in names]
        return recipe.take(parts[0] if len(parts) == 1 else recipe.add(parts), rows)

    time = np.arange(steps + layers - 1)[:, None] - np.arange(layers)[None, :]
    mask = ((time >= 0) & (time < steps)).astype(np.float32).reshape(-1, layers, 1, 1)
    return [
        recipe.concat([
            recipe.stack([weight_ih(layer, weights[0]) for layer, weights in enumerate(layer_weights)]),
            recipe.stack([recipe.take(recipe.model(weights[1]), rows) for weights in layer_weights]),
        ], axis=2),
        recipe.stack([recipe.stack([bias(weights[2:])]) for weights in layer_weights]),
        recipe.const(mask),
        recipe.const(1.0 - mask),
    ]


def _compose(r: list, source) -> list:
    """``r`` with each ``model(name)`` leaf replaced by ``source(name)``."""
    if r[0] == "model":
        return source(r[1])
    if r[0] == "const":
        return r
    if r[0] in ("stack", "concat", "add"):
        return [*r[:-1], [_compose(part, source) for part in r[-1]]]
    return [*r[:-1], _compose(r[-1], source)]


def _wavefront_ops(size: _Sizes, x: str, stacked: list[str], prefix: str, new: UniqueNames):
    """(ops, final state, per-step outputs): x padded to [T + L - 1, B, K] and the wavefront
    scan from a zero state, its tensors named ``prefix.*``."""
    layers, steps, batch, hidden, inputs, width = size
    weight, bias, mask, keep = stacked
    ops: list[Op | Scan] = []

    def emit(kind: str, *operands: str, out: str, **attrs) -> str:
        ops.append(Op(kind, operands, (new(f"{prefix}.{out}"),), attrs))
        return ops[-1].outputs[0]

    if inputs < width:
        features = emit("full", out="x_feature_pad", shape=(steps, batch, width - inputs), value=0.0)
        x = emit("concat", x, features, out="x_wide", axis=2)
    tail = emit("full", out="x_step_pad", shape=(layers - 1, batch, width), value=0.0)
    sequence = emit("concat", x, tail, out="x_steps", axis=0)
    zeros = emit("full", out="zeros", shape=(layers, batch, hidden, 2), value=0.0)
    state, h_top = new(f"{prefix}.state"), new(f"{prefix}.h_top")
    ops.append(Scan(
        prefix, _step_body(size), steps + layers - 1,
        carry=(("state", "state_next", zeros, state),),
        xs=(("x_s", sequence), ("mask", mask), ("keep", keep)),
        ys=(("h_top", h_top),),
        invariants=(("weight", weight), ("bias", bias)),
    ))
    return ops, state, h_top


def _read_back(size: _Sizes, name: str, shape: tuple[int, ...], role: Role, state: str, h_top: str,
               prefix: str, new: UniqueNames) -> list[Op]:
    """Ops that produce tensor ``name`` again from the wavefront's final ``state`` and per-step
    outputs ``h_top``: the last layer's sequence, or the final h or c of a range of layers."""
    layers, steps, batch, hidden, _, _ = size
    part, first, stop = role
    if part in STATE_PARTS:
        k = STATE_PARTS[part]
        if (first, stop) == (0, layers):  # every layer: no bounds on the layer axis
            bounds = {"begin": k, "end": k + 1, "axis": 3}
        else:
            bounds = {"begin": (first, k), "end": (stop, k + 1), "axis": (0, 3)}
        sliced = new(f"{name}.state")
        return [Op("slice", (state,), (sliced,), bounds), Op("reshape", (sliced,), (name,), {"shape": shape})]
    # h_top[s] is the last layer's h after step s - 1 (read from the carried state), so the
    # sequence is h_top[L:] (T - 1 steps) followed by the last layer's h of the final state.
    last = new(f"{prefix}.h_final4")
    ops = [Op("slice", (state,), (last,), {"begin": (layers - 1, 0), "end": (layers, 1), "axis": (0, 3)})]
    if steps == 1:
        return ops + [Op("reshape", (last,), (name,), {"shape": (1, batch, hidden)})]
    final, earlier = new(f"{prefix}.h_final"), new(f"{prefix}.h_earlier")
    return ops + [
        Op("reshape", (last,), (final,), {"shape": (1, batch, hidden)}),
        Op("slice", (h_top,), (earlier,), {"begin": layers, "end": steps + layers - 1, "axis": 0}),
        Op("concat", (earlier, final), (name,), {"axis": 0}),
    ]


def _step_body(size: _Sizes) -> Graph:
    """One wavefront step: every layer's cell at once, batched over a leading layer axis.

    The gates are one batched product of ``[layer_in, h]`` (width K + H) with the stacked
    weight, and reach the step's results only through ``state_next``, so after inlining the
    gate product's one consumer is the state TE. The per-step output ``h_top`` is the last
    layer's h sliced from the carried ``state`` (the previous step's), so it does not wait
    for the gate product."""
    layers, _, batch, hidden, _, width = size
    b = GraphBuilder("wavefront_step")
    x_s = b.input("x_s", (batch, width))
    state = b.input("state", (layers, batch, hidden, 2))
    mask = b.input("mask", (layers, 1, 1))
    keep = b.input("keep", (layers, 1, 1))
    weight = b.input("weight", (layers, GATES * hidden, width + hidden))
    bias = b.input("bias", (layers, 1, GATES * hidden))

    h, c = (
        b.op("reshape", b.op("slice", state, begin=k, end=k + 1, axis=3), shape=(layers, batch, hidden), name=name)
        for k, name in enumerate(("h", "c"))
    )
    below = b.op("slice", state, begin=(0, 0), end=(layers - 1, 1), axis=(0, 3), name="h_below4")
    below = b.op("reshape", below, shape=(layers - 1, batch, hidden), name="h_below")
    if hidden < width:
        pad = b.op("full", shape=(layers - 1, batch, width - hidden), value=0.0, name="h_pad")
        below = b.op("concat", below, pad, axis=2, name="h_below_wide")
    layer_in = b.op("concat", b.op("reshape", x_s, shape=(1, batch, width)), below, axis=0, name="layer_in")
    x_cat = b.op("concat", layer_in, h, axis=2, name="x_cat")  # [L, B, K + H]: one reduction axis
    gates = b.op("add", b.op("batch_matmul", x_cat, weight, transpose_b=True, name="gate_product"), bias,
                 name="gates")
    units = b.op("reshape", gates, shape=(layers, batch, hidden, GATES), name="units")
    i, f, g, o = (
        b.op("reshape", b.op("slice", units, begin=k, end=k + 1, axis=3), shape=(layers, batch, hidden),
             name=f"gate_{gate}")
        for k, gate in enumerate("ifgo")
    )
    c_cell = b.op("add", b.op("mul", b.op("sigmoid", f), c), b.op("mul", b.op("sigmoid", i), b.op("tanh", g)),
                  name="c_cell")
    h_cell = b.op("mul", b.op("sigmoid", o), b.op("tanh", c_cell), name="h_cell")
    # m * new + (1 - m) * old is exactly new or old for m in {0, 1}: idle layers keep their state.
    c_next = b.op("add", b.op("mul", mask, c_cell), b.op("mul", keep, c), name="c_next")
    h_next = b.op("add", b.op("mul", mask, h_cell), b.op("mul", keep, h), name="h_next")
    state_next = b.op(
        "concat",
        b.op("reshape", h_next, shape=(layers, batch, hidden, 1), name="h_next4"),
        b.op("reshape", c_next, shape=(layers, batch, hidden, 1), name="c_next4"),
        axis=3,
        name="state_next",
    )
    top = b.op("slice", state, begin=(layers - 1, 0), end=(layers, 1), axis=(0, 3), name="h_last")
    h_top = b.op("reshape", top, shape=(batch, hidden), name="h_top")
    return b.build(state_next, h_top)
