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
state, and ``h_n`` and ``c_n`` from the final one. The per-step output ``h_top`` is the last
layer's h of the CARRIED state (the one the step starts from), not the new one: it then reads
the slot the gate product reads while the product writes the other, so the persistent kernel
runs both in one barrier phase (one grid barrier per step). Step s thus outputs the last
layer's h after step s - 1, and the output sequence is ``ys[L:]`` followed by the last layer's
h of the final state.

Every weight the rewrite creates carries a recipe (``souffle.recipe``) composed with the input
graph's own, so a machine without TVM rebuilds it from the model's weights.

``wavefront(graph)`` recognises the stacked LSTM that ``souffle.models.lstm`` builds by
comparing the graph op for op with the model's own graph for the sizes read from the graph's
shapes, so any graph computing exactly that LSTM is rewritten, whatever its tensor names.
"""

from __future__ import annotations

import numpy as np

from souffle import recipe
from souffle.graph import Graph, GraphBuilder, Op, Scan, TensorSpec
from souffle.models import lstm

GATES = 4  # torch's gate order along the 4H rows: input, forget, cell (g), output
STACKED_WEIGHTS = ("wavefront.weight", "wavefront.bias", "wavefront.mask", "wavefront.keep")


def wavefront(graph: Graph) -> tuple[Graph, list[str]]:
    """``graph`` with its stacked LSTM as one wavefront scan, and report lines saying so.

    A graph that is not a stacked LSTM of two or more layers comes back unchanged with no
    report (a single layer is already one time scan). The input graph is not modified; the
    result keeps its input and output names and dtypes, and has weights iff it had.
    """
    cfg = _lstm_config(graph)
    if cfg is None or cfg["num_layers"] < 2:
        return graph, []
    roles = _match_lstm(graph, lstm.build_graph(cfg, None))
    if roles is None:
        return graph, []
    layers, steps = cfg["num_layers"], cfg["steps"]
    stacked = _stacked_specs(cfg)
    kept = [spec for spec in graph.params.values() if spec.name not in roles.values()]
    stacked_recipes = _stacked_recipes(cfg)  # in terms of the torch weight names (the roles)
    weights = None
    if graph.weights is not None:
        weights = {spec.name: graph.weights[spec.name] for spec in kept}
        role_weights = {role: graph.weights[name] for role, name in roles.items()}
        weights.update({name: recipe.evaluate(r, role_weights) for name, r in stacked_recipes.items()})
    recipes = {spec.name: graph.recipes[spec.name] for spec in kept if spec.name in graph.recipes}
    recipes.update({name: _compose(r, lambda role: graph.recipe(roles[role])) for name, r in stacked_recipes.items()})
    rewritten = Graph(
        graph.name, graph.inputs, kept + stacked, _wavefront_ops(cfg, graph.inputs[0].name, graph.outputs),
        graph.outputs, weights, recipes,
    )
    wave = f"one wavefront scan of {steps + layers - 1} steps, cells of all layers batched per step"
    weight_shapes = ", ".join(f"{spec.name} {list(spec.shape)}" for spec in stacked[:2])
    report = [
        f"{graph.name}: {layers} layers x {steps} steps -> {wave}",
        f"{graph.name}: {len(roles)} per-layer weights -> {weight_shapes} (W_ih and W_hh side by side for one gate product, gates of each hidden unit adjacent)",
    ]
    return rewritten, report


# -- recognising the LSTM --------------------------------------------------------------------------
def _lstm_config(graph: Graph) -> dict | None:
    """The model config a stacked LSTM graph would have: sizes from x [T, B, I] and h_n [L, B, H]."""
    if len(graph.inputs) != 1 or len(graph.outputs) != 3:
        return None
    x, h_n = graph.inputs[0], graph.tensors[graph.outputs[1]]
    if len(x.shape) != 3 or len(h_n.shape) != 3:
        return None
    steps, batch, input_size = x.shape
    layers, _, hidden = h_n.shape
    return {"input_size": input_size, "hidden_size": hidden, "num_layers": layers, "steps": steps, "batch": batch}


def _match_lstm(graph: Graph, pattern: Graph) -> dict[str, str] | None:
    """torch weight name (``weight_ih_l0``, ...) -> the graph's parameter playing that role, if
    ``graph`` computes exactly ``pattern`` (the model's LSTM); None if it does not."""
    top = _Names(graph, pattern)
    if not all(top.define(p.name, g.name) for p, g in zip(pattern.inputs, graph.inputs)):
        return None
    if not _match(top):
        return None
    return {name: top.names[name] for name in pattern.params}


class _Names:
    """Pattern tensor -> graph tensor, for one graph level (a scan body is a level of its own)."""

    def __init__(self, graph: Graph, pattern: Graph):
        self.graph, self.pattern, self.names = graph, pattern, {}

    def define(self, pattern_name: str, graph_name: str) -> bool:
        """Pair two tensors first seen here (inputs, op outputs), if their specs agree."""
        if pattern_name in self.names or graph_name not in self.graph.tensors:
            return False
        self.names[pattern_name] = graph_name
        want, got = self.pattern.tensors[pattern_name], self.graph.tensors[graph_name]
        return (want.shape, want.dtype) == (got.shape, got.dtype)

    def read(self, pattern_name: str, graph_name: str) -> bool:
        """Check an op's operand; a parameter is paired on first use, so parameter order and
        names do not matter."""
        if pattern_name in self.names:
            return self.names[pattern_name] == graph_name
        if pattern_name not in self.pattern.params or graph_name not in self.graph.params:
            return False
        return self.define(pattern_name, graph_name)


def _match(level: _Names) -> bool:
    """Whether ``level.graph`` has ``level.pattern``'s ops, attributes, dataflow and outputs."""
    graph, pattern = level.graph, level.pattern
    if len(graph.ops) != len(pattern.ops) or len(graph.outputs) != len(pattern.outputs):
        return False
    for op, want in zip(graph.ops, pattern.ops):
        if isinstance(want, Scan):
            if not (isinstance(op, Scan) and _match_scan(level, op, want)):
                return False
            continue
        if isinstance(op, Scan) or (op.kind, dict(op.attrs)) != (want.kind, dict(want.attrs)):
            return False
        if len(op.inputs) != len(want.inputs) or len(op.outputs) != len(want.outputs):
            return False
        if not all(level.read(p, g) for p, g in zip(want.inputs, op.inputs)):
            return False
        if not all(level.define(p, g) for p, g in zip(want.outputs, op.outputs)):
            return False
    return all(level.names.get(p) == g for p, g in zip(pattern.outputs, graph.outputs))


def _match_scan(outer: _Names, scan: Scan, want: Scan) -> bool:
    """Same length, bindings and body; then the scan's outputs are paired."""
    fields = ("carry", "xs", "ys", "invariants", "params")
    if scan.length != want.length or any(len(getattr(scan, f)) != len(getattr(want, f)) for f in fields):
        return False
    inner = _Names(scan.body, want.body)
    bound = [
        inner.define(pi, gi) and outer.read(p_init, g_init)
        for (pi, _, p_init, _), (gi, _, g_init, _) in zip(want.carry, scan.carry)
    ]
    bound += [
        inner.define(pi, gi) and outer.read(po, go)
        for (pi, po), (gi, go) in zip(want.xs + want.invariants, scan.xs + scan.invariants)
    ]
    bound += [
        inner.define(pi, gi) and len(pos) == len(gos) and all(outer.read(p, g) for p, g in zip(pos, gos))
        for (pi, pos), (gi, gos) in zip(want.params, scan.params)
    ]
    if not (all(bound) and _match(inner)):
        return False
    body_outputs = [(w[1], g[1]) for w, g in zip(want.carry, scan.carry)]
    body_outputs += [(w[0], g[0]) for w, g in zip(want.ys, scan.ys)]
    if not all(inner.names.get(p) == g for p, g in body_outputs):
        return False
    return all(outer.define(p, g) for p, g in zip(want.outputs, scan.outputs))


# -- the wavefront graph ---------------------------------------------------------------------------
def _sizes(cfg: dict) -> tuple[int, int, int, int, int, int]:
    """(L, T, B, H, I, K): K = max(I, H) is the width every layer's input is padded to."""
    hidden, inputs = cfg["hidden_size"], cfg["input_size"]
    return cfg["num_layers"], cfg["steps"], cfg["batch"], hidden, inputs, max(inputs, hidden)


def _stacked_specs(cfg: dict) -> list[TensorSpec]:
    layers, steps, _, hidden, _, width = _sizes(cfg)
    wave = steps + layers - 1
    shapes = ((layers, GATES * hidden, width + hidden), (layers, 1, GATES * hidden), (wave, layers, 1, 1),
              (wave, layers, 1, 1))
    return [TensorSpec(name, shape) for name, shape in zip(STACKED_WEIGHTS, shapes)]


def _stacked_recipes(cfg: dict) -> dict[str, list]:
    """How each new weight is made from the per-layer torch weights (``model("weight_ih_l0")``
    and so on): stacked over layers, gate rows interleaved per hidden unit (row 4j + k is gate
    k of unit j, so a tile of rows holds whole units), W_ih's layer inputs zero-padded to width
    K and W_hh's columns after them (``weight`` [L, 4H, K + H], the stacks concatenated along
    the reduction axis), the two biases summed (``bias`` [L, 1, 4H], broadcast over the batch); plus the constant masks: ``mask[s, l]`` is 1 where layer l is at a real
    time step s - l, ``keep`` its complement."""
    layers, steps, _, hidden, inputs, width = _sizes(cfg)
    rows = np.arange(GATES * hidden).reshape(GATES, hidden).T.reshape(-1)

    def weight_ih(layer: int) -> list:
        columns = inputs if layer == 0 else hidden
        return recipe.take(recipe.pad(recipe.model(f"weight_ih_l{layer}"), [(0, 0), (0, width - columns)]), rows)

    def bias(layer: int) -> list:
        return recipe.take(recipe.add([recipe.model(f"bias_ih_l{layer}"), recipe.model(f"bias_hh_l{layer}")]), rows)

    time = np.arange(steps + layers - 1)[:, None] - np.arange(layers)[None, :]
    mask = ((time >= 0) & (time < steps)).astype(np.float32).reshape(-1, layers, 1, 1)
    recipes = (
        recipe.concat([
            recipe.stack([weight_ih(layer) for layer in range(layers)]),
            recipe.stack([recipe.take(recipe.model(f"weight_hh_l{layer}"), rows) for layer in range(layers)]),
        ], axis=2),
        recipe.stack([recipe.stack([bias(layer)]) for layer in range(layers)]),
        recipe.const(mask),
        recipe.const(1.0 - mask),
    )
    return dict(zip(STACKED_WEIGHTS, recipes))


def _compose(r: list, source) -> list:
    """``r`` with each ``model(name)`` leaf replaced by ``source(name)``."""
    if r[0] == "model":
        return source(r[1])
    if r[0] == "const":
        return r
    if r[0] in ("stack", "concat", "add"):
        return [*r[:-1], [_compose(part, source) for part in r[-1]]]
    return [*r[:-1], _compose(r[-1], source)]


def _wavefront_ops(cfg: dict, x: str, outputs: tuple[str, ...]) -> list[Op | Scan]:
    """x padded to [T + L - 1, B, K], the wavefront scan from a zero state, the output as the
    last layer's per-step outputs from step L on (each the h of the step before) followed by
    the last layer's h of the final state, and h_n and c_n sliced from the final state."""
    layers, steps, batch, hidden, inputs, width = _sizes(cfg)
    weight, bias, mask, keep = STACKED_WEIGHTS
    output, h_n, c_n = outputs
    ops: list[Op | Scan] = []

    def emit(kind: str, *operands: str, out: str, **attrs) -> str:
        ops.append(Op(kind, operands, (out,), attrs))
        return out

    if inputs < width:
        features = emit("full", out="wavefront.x_feature_pad", shape=(steps, batch, width - inputs), value=0.0)
        x = emit("concat", x, features, out="wavefront.x_wide", axis=2)
    tail = emit("full", out="wavefront.x_step_pad", shape=(layers - 1, batch, width), value=0.0)
    sequence = emit("concat", x, tail, out="wavefront.x_steps", axis=0)
    zeros = emit("full", out="wavefront.zeros", shape=(layers, batch, hidden, 2), value=0.0)
    ops.append(Scan(
        "wavefront", _step_body(cfg), steps + layers - 1,
        carry=(("state", "state_next", zeros, "wavefront.state"),),
        xs=(("x_s", sequence), ("mask", mask), ("keep", keep)),
        ys=(("h_top", "wavefront.h_top"),),
        invariants=(("weight", weight), ("bias", bias)),
    ))
    # ys[s] is the last layer's h after step s - 1 (read from the carried state), so the
    # output is ys[L:] (T - 1 steps) followed by the last layer's h of the final state.
    last = emit("slice", "wavefront.state", out="wavefront.h_final4", begin=(layers - 1, 0), end=(layers, 1),
                axis=(0, 3))
    if steps == 1:
        emit("reshape", last, out=output, shape=(1, batch, hidden))
    else:
        final = emit("reshape", last, out="wavefront.h_final", shape=(1, batch, hidden))
        earlier = emit("slice", "wavefront.h_top", out="wavefront.h_earlier", begin=layers, end=steps + layers - 1,
                       axis=0)
        emit("concat", earlier, final, out=output, axis=0)
    for part, name in enumerate((h_n, c_n)):
        final = emit("slice", "wavefront.state", out=f"{name}.state", begin=part, end=part + 1, axis=3)
        emit("reshape", final, out=name, shape=(layers, batch, hidden))
    return ops


def _step_body(cfg: dict) -> Graph:
    """One wavefront step: every layer's cell at once, batched over a leading layer axis.

    The gates are one batched product of ``[layer_in, h]`` (width K + H) with the stacked
    weight, and reach the step's results only through ``state_next``, so after inlining the
    gate product's one consumer is the state TE. The per-step output ``h_top`` is the last
    layer's h sliced from the carried ``state`` (the previous step's), so it does not wait
    for the gate product."""
    layers, _, batch, hidden, _, width = _sizes(cfg)
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
