"""The LSTM wavefront: one scan of T + L - 1 steps, numerically torch.nn.LSTM."""

import json
from dataclasses import replace

import numpy as np
import pytest

import souffle
from codegen.wavefront import wavefront
from souffle import models, recipe
from souffle.graph import Graph, GraphBuilder, Scan
from souffle.models import lstm

TINY = lstm.CONFIGS["tiny"]
CONFIGS = {
    "tiny": TINY,
    "wide_input": dict(TINY, input_size=24, hidden_size=8, num_layers=2, steps=4, batch=2),
    "same_width": dict(TINY, input_size=8, hidden_size=8, num_layers=4, steps=3, batch=2),
}


def _scans(graph):
    """Every scan in the graph, nested ones included."""
    found = []
    for op in graph.ops:
        if isinstance(op, Scan):
            found += [op] + _scans(op.body)
    return found


def _check_against_torch(graph, cfg, weights, target):
    inputs = lstm.make_inputs(cfg, seed=1)
    got = souffle.compile(graph, target=target).run(inputs)
    rtol, atol = models.tolerance("lstm")
    for name, value, want in zip(graph.outputs, got, lstm.torch_reference(cfg, weights)(inputs)):
        np.testing.assert_allclose(value, want, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("name", CONFIGS)
def test_wavefront_is_one_scan_and_matches_torch(name):
    cfg = CONFIGS[name]
    weights = lstm.init_weights(cfg, seed=0)
    graph = lstm.build_graph(cfg, weights)
    before = str(graph)
    transformed, report = wavefront(graph)
    assert str(graph) == before and all(np.array_equal(graph.weights[k], v) for k, v in weights.items())
    layers, steps = cfg["num_layers"], cfg["steps"]
    assert [scan.length for scan in _scans(transformed)] == [steps + layers - 1]
    (scan,) = _scans(transformed)
    state = (layers, cfg["batch"], cfg["hidden_size"], 2)  # h and c of a hidden unit adjacent
    assert [transformed.tensors[init].shape for _, _, init, _ in scan.carry] == [state]
    assert report[0].startswith(f"lstm: {layers} layers x {steps} steps -> one wavefront scan of {steps + layers - 1}")
    gates, width = 4 * cfg["hidden_size"], max(cfg["input_size"], cfg["hidden_size"]) + cfg["hidden_size"]
    assert report[1].startswith(f"lstm: {4 * layers} per-layer weights -> wavefront.weight {[layers, gates, width]}, "
                                f"wavefront.bias {[layers, 1, gates]} ")
    assert "wavefront.weight_ih" not in transformed.params and "wavefront.weight_hh" not in transformed.params
    assert (transformed.inputs, transformed.output_specs()) == (graph.inputs, graph.output_specs())
    assert not set(transformed.params) & set(graph.params)
    _check_against_torch(transformed, cfg, weights, "llvm")


def test_tiny_persistent_program_matches_torch():
    weights = lstm.init_weights(TINY, seed=0)
    transformed, _ = wavefront(lstm.build_graph(TINY, weights))
    _check_against_torch(transformed, TINY, weights, "llvm-persistent")


def test_one_step_lstm_output_is_the_final_state():
    """T == 1: no per-step output survives the slice; the output is the final state's h."""
    cfg = dict(TINY, steps=1)
    weights = lstm.init_weights(cfg, seed=0)
    transformed, _ = wavefront(lstm.build_graph(cfg, weights))
    assert [scan.length for scan in _scans(transformed)] == [cfg["num_layers"]]
    _check_against_torch(transformed, cfg, weights, "llvm")


def test_tiny_persistent_wavefront_step_has_one_grid_barrier():
    """The per-step output reads the carried state's slot while the gate product writes the
    other one, so at O4 the two share a barrier phase: one grid barrier per wavefront step."""
    from codegen.staged import Stage

    transformed, _ = wavefront(lstm.build_graph(TINY, lstm.init_weights(TINY, seed=0)))
    m = souffle.compile(transformed, target="llvm-persistent", threads=256)
    (loop,) = [item for item in m.plan.items if type(item).__name__ == "Loop"]
    assert loop.trips == TINY["steps"] + TINY["num_layers"] - 1
    stages = [item for item in loop.items if isinstance(item, Stage)]
    assert len(stages) == len(loop.items) >= 2  # the gate product (with the state update) and h_top
    assert sum(s.barrier is not None for s in stages) == 1, m.plan.table()  # per step
    outside = sum(item.barrier is not None for item in m.plan.items)  # the loop's own one runs once, before it
    assert m.plan.barrier_count(executed=True) == loop.trips + outside, m.plan.table()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_narrow_precision_lstm_is_one_wavefront_scan_too(precision):
    """The wavefront runs before the precision pass: a float16 cell (casts around its float32
    gates) is no pattern the rewrite knows, and paper LSTM fp16 ran on an H100 as 2014 barrier
    phases of per-layer cells (5.46 ms) where fp32's wavefront has 112 (1.51 ms, gpu_h100.md)."""
    from souffle.compiler import run_passes

    run = run_passes(models.build("lstm", "tiny"), "llvm-persistent", stop="plan_arena", precision=precision)
    assert any(line.startswith("lstm: 3 layers x 5 steps -> one wavefront scan of 7 steps")
               for line in run.notes("transform")), run.notes("transform")
    (loop,) = [item for item in run.ir.items if type(item).__name__ == "Loop"]
    assert loop.trips == TINY["steps"] + TINY["num_layers"] - 1
    assert run.ir.barrier_count(executed=True) == loop.trips + sum(i.barrier is not None for i in run.ir.items)


@pytest.mark.parametrize("name", ["tiny", "wide_input"])
def test_weights_are_stacked_with_each_units_gates_adjacent(name):
    """One weight [L, 4H, K + H]: row 4j + k is torch gate k of unit j; its columns are W_ih's
    (zero-padded to K) and then W_hh's, so one product of [layer_in, h] gives the gates."""
    cfg = CONFIGS[name]
    weights = lstm.init_weights(cfg, seed=0)
    transformed, _ = wavefront(lstm.build_graph(cfg, weights))
    stacked, hidden, inputs = transformed.weights, cfg["hidden_size"], cfg["input_size"]
    width = max(inputs, hidden)
    weight = stacked["wavefront.weight"]
    assert weight.shape == (cfg["num_layers"], 4 * hidden, width + hidden)
    unit, gate = 3, 2
    row = weight[:, 4 * unit + gate]
    np.testing.assert_array_equal(row[0, :inputs], weights["weight_ih_l0"][gate * hidden + unit])
    np.testing.assert_array_equal(row[1, :hidden], weights["weight_ih_l1"][gate * hidden + unit])
    assert not weight[0, :, inputs:width].any() and not weight[1, :, hidden:width].any()
    for layer in range(cfg["num_layers"]):
        np.testing.assert_array_equal(row[layer, width:], weights[f"weight_hh_l{layer}"][gate * hidden + unit])
    np.testing.assert_allclose(stacked["wavefront.bias"][0, 0, 4 * unit + gate],
                               weights["bias_ih_l0"][gate * hidden + unit] + weights["bias_hh_l0"][gate * hidden + unit])
    if name == "wide_input":
        mask = stacked["wavefront.mask"][:, :, 0, 0]
        np.testing.assert_array_equal(mask, [[1, 0], [1, 1], [1, 1], [1, 1], [0, 1]])


# The tiny LSTM's gate product reduces over K + H = 32 < WARP_REDUCE_MIN_EXTENT (64), so it is
# tiled "thread_reduce", and staging has a shared-memory epilogue only for "warp_reduce" tiles
# (the state TE [L, B, H, 2] is not the product's shape [L, B, 4H], so no "register" epilogue).
TINY_NOT_FUSED = ("tiny: gate product reduces over K + H = 32 < WARP_REDUCE_MIN_EXTENT = 64 -> thread_reduce; "
                  "epilogue_mode allows 'shared' only for warp_reduce and 'register' only for equal shapes")
FUSED_CONFIGS = {
    "tiny": TINY,
    "gemv64": dict(TINY, input_size=24, hidden_size=32, num_layers=2, steps=3, batch=2),  # K + H = 64
}


@pytest.mark.parametrize("name", FUSED_CONFIGS)
def test_o3_persistent_program_fuses_the_gate_product_with_the_state_update(name):
    """At O3 the staged program's wavefront loop has a stage that is the gate GEMV with the
    state update as its epilogue, and the program computes torch.nn.LSTM."""
    from codegen.staged import Loop

    cfg = FUSED_CONFIGS[name]
    weights = lstm.init_weights(cfg, seed=0)
    transformed, _ = wavefront(lstm.build_graph(cfg, weights))
    m = souffle.compile(transformed, target="llvm-persistent", opt_level=3)
    inputs = lstm.make_inputs(cfg, seed=1)
    rtol, atol = models.tolerance("lstm")
    for output, value, want in zip(transformed.outputs, m.run(inputs), lstm.torch_reference(cfg, weights)(inputs)):
        np.testing.assert_allclose(value, want, rtol=rtol, atol=atol, err_msg=output)
    (loop,) = [item for item in m.plan.items if isinstance(item, Loop)]
    fused = [stage for stage in loop.items if not isinstance(stage, Loop) and stage.epilogue is not None]
    if not fused and name == "tiny":
        pytest.xfail(TINY_NOT_FUSED)
    assert [(stage.name, stage.epilogue) for stage in fused] == [("wavefront_step_r0/gate_product+state_next",
                                                                  "shared")], m.plan.table()


def _gate_products(program):
    """The wavefront loop body's region and its reductions (the batched gate GEMV)."""
    from souffle.lower import LoopRegion

    (loop,) = [region for region in program.regions if isinstance(region, LoopRegion)]
    (body,) = loop.body.regions
    return body, [stage for stage in body.stages() if stage.op.reduce_axis]


@pytest.mark.parametrize("name", CONFIGS)
def test_the_one_gate_product_has_one_consumer_the_new_state(name):
    """What lets the persistent kernel fuse the GEMV with its consumer into one stage: after
    vertical inlining the step has ONE reduction (input and recurrent products as one), the
    only TE that reads it is the one computing the carried state, and the step's output reads
    the state the step started from (so it need not wait for the product)."""
    from codegen.vertical import vertical
    from souffle.lower import lower_graph

    cfg = CONFIGS[name]
    transformed, _ = wavefront(lstm.build_graph(cfg, None))
    program = vertical(lower_graph(transformed))
    body, products = _gate_products(program)
    assert len(products) == 1  # [layer_in, h] times [W_ih, W_hh], batched over the layers
    state = body.tensors["state_next"]
    assert state.op.num_outputs == 1 and not state.op.reduce_axis
    readers = {}
    for stage in body.stages():
        for producer in stage.op.input_tensors:
            readers.setdefault(producer.op, []).append(stage.op)
    for product in products:
        assert [c.op for c in program.consumers(product)] == [state.op]
        assert readers[product.op] == [state.op]
    assert set(body.outputs) == {"state_next", "h_top"}
    assert [t.op for t in body.tensors["h_top"].op.input_tensors] == [body.tensors["state"].op]


@pytest.mark.parametrize("name", ["tiny", "wide_input"])
def test_every_new_weight_has_a_recipe_from_the_model_weights(name):
    cfg = CONFIGS[name]
    weights = lstm.init_weights(cfg, seed=0)
    graph = lstm.build_graph(cfg, weights)
    transformed, _ = wavefront(graph)
    new = set(transformed.params) - set(graph.params)
    assert new and set(transformed.recipes) == new
    for weight in new:
        made = transformed.recipe(weight)
        assert json.loads(json.dumps(made)) == made
        assert recipe.sources(made) <= set(weights)
        np.testing.assert_array_equal(recipe.evaluate(made, weights), transformed.weights[weight], err_msg=weight)


def test_recipes_compose_with_the_input_graphs_recipes():
    """A graph whose weights are themselves derived (here weight_hh_l1 doubled) gets recipes
    from the model's own weights, through the graph's recipes."""
    weights = lstm.init_weights(TINY, seed=0)
    doubled = dict(weights, weight_hh_l1=2 * weights["weight_hh_l1"])
    derived = lstm.build_graph(TINY, doubled)
    twice = recipe.add([recipe.model("weight_hh_l1"), recipe.model("weight_hh_l1")])
    derived = Graph(derived.name, derived.inputs, derived.params.values(), derived.ops, derived.outputs,
                    derived.weights, {"weight_hh_l1": twice})
    transformed, _ = wavefront(derived)
    for name in set(transformed.params) - set(derived.params):
        np.testing.assert_array_equal(recipe.evaluate(transformed.recipe(name), weights), transformed.weights[name],
                                      err_msg=name)
    width = max(TINY["input_size"], TINY["hidden_size"])
    np.testing.assert_array_equal(transformed.weights["wavefront.weight"][1, 4 * 3 + 2, width:],
                                  2 * weights["weight_hh_l1"][2 * TINY["hidden_size"] + 3])


def test_paper_structure_becomes_a_109_step_scan():
    transformed, report = wavefront(models.structure("lstm", "paper"))
    assert transformed.weights is None
    assert [scan.length for scan in _scans(transformed)] == [109]
    assert set(transformed.recipes) == set(transformed.params)  # artifacts need recipes without arrays
    assert report[0] == "lstm: 10 layers x 100 steps -> one wavefront scan of 109 steps, cells of all layers batched per step"


def test_other_graphs_are_left_alone():
    bert = models.structure("bert", "tiny")
    assert wavefront(bert) == (bert, [])
    single = lstm.build_graph(dict(TINY, num_layers=1), None)
    assert wavefront(single) == (single, [])


def _with_cells(graph, change):
    """``graph`` with ``change(body)`` for the body of every innermost scan (its LSTM cells)."""
    ops = []
    for op in graph.ops:
        if isinstance(op, Scan):
            nested = any(isinstance(inner, Scan) for inner in op.body.ops)
            op = replace(op, body=_with_cells(op.body, change) if nested else change(op.body))
        ops.append(op)
    return Graph(graph.name, graph.inputs, graph.params.values(), ops, graph.outputs, graph.weights, graph.recipes)


def _tanh_as_sigmoid(cell):
    ops = [replace(op, kind="sigmoid") if op.kind == "tanh" else op for op in cell.ops]
    return Graph(cell.name, cell.inputs, cell.params.values(), ops, cell.outputs)


def test_a_graph_that_differs_from_the_lstm_is_left_alone():
    graph = models.structure("lstm", "tiny")
    other = _with_cells(graph, _tanh_as_sigmoid)
    assert wavefront(other) == (other, [])


def test_the_lstm_layers_after_a_different_first_layer_are_rewritten():
    """Layer 0 computes something else, so the stack starts at layer 1 and reads layer 0's
    sequence as its input; h_n and c_n read layer 0's final state and the stack's."""
    weights = lstm.init_weights(TINY, seed=0)
    graph = lstm.build_graph(TINY, weights)
    layer0 = graph.ops[1]
    other = Graph(graph.name, graph.inputs, graph.params.values(),
                  [replace(layer0, body=_tanh_as_sigmoid(layer0.body)) if op is layer0 else op for op in graph.ops],
                  graph.outputs, graph.weights)
    transformed, report = wavefront(other)
    layers, steps = TINY["num_layers"] - 1, TINY["steps"]
    assert [scan.length for scan in _scans(transformed)] == [steps, steps + layers - 1]
    assert report[0] == f"lstm: {layers} layers x {steps} steps -> one wavefront scan of {steps + layers - 1} steps, " \
                        "cells of all layers batched per step"
    assert {"weight_ih_l0", "bias_hh_l0"} <= set(transformed.params)
    assert not {"weight_ih_l1", "bias_hh_l2"} & set(transformed.params)
    _check_same_outputs(other, transformed, lstm.make_inputs(TINY, seed=1))


def _check_same_outputs(graph, transformed, inputs, reference=None):
    """``transformed`` computes what ``graph`` does (both compiled for the CPU, which applies no
    wavefront itself), and what ``reference`` says, output by output."""
    got = souffle.compile(transformed, target="llvm").run(inputs)
    wanted = [souffle.compile(graph, target="llvm").run(inputs)]
    if reference is not None:
        wanted.append(reference(inputs))
    for want in wanted:
        for name, value, expected in zip(graph.outputs, got, want, strict=True):
            np.testing.assert_allclose(value, expected, rtol=1e-4, atol=1e-4, err_msg=name)


# -- a stacked LSTM as an importer writes it ---------------------------------------------------------
# Four layers, each a time scan of its own with its own cell variant (how an importer such as
# torch.export or ONNX spells torch's LSTM cell), chained by their sequences; a projection
# before the stack and a classifier on the last layer's final h after it.
IMPORTED = {"features": 6, "input_size": 10, "hidden_size": 8, "num_layers": 4, "steps": 5, "batch": 2,
            "classes": 3}
MUTANTS = ("gate_order", "tanh_for_sigmoid", "nonzero_state", "inner_sequence_read")


def _imported_weights(seed: int) -> dict[str, np.ndarray]:
    """Layer 0 has two biases, layers 1 and 2 one combined bias, layer 3 none."""
    cfg = IMPORTED
    rng = np.random.default_rng(seed)
    hidden, gates = cfg["hidden_size"], 4 * cfg["hidden_size"]

    def uniform(*shape):
        return rng.uniform(-1 / np.sqrt(hidden), 1 / np.sqrt(hidden), shape).astype(np.float32)

    weights = {"proj.weight": uniform(cfg["input_size"], cfg["features"]), "proj.bias": uniform(cfg["input_size"]),
               "head.weight": uniform(cfg["classes"], hidden), "head.bias": uniform(cfg["classes"])}
    for layer in range(cfg["num_layers"]):
        inputs = cfg["input_size"] if layer == 0 else hidden
        weights[f"rnn.{layer}.w_ih"] = uniform(gates, inputs)
        weights[f"rnn.{layer}.w_hh"] = uniform(gates, hidden)
    weights["rnn.0.b_ih"], weights["rnn.0.b_hh"] = uniform(gates), uniform(gates)
    weights["rnn.1.bias"], weights["rnn.2.bias"] = uniform(gates), uniform(gates)
    return weights


def _imported_cell(layer: int, inputs: int, change: str | None) -> Graph:
    """Layer ``layer``'s cell: h and c carried in either order, the gate product's biases as
    separate adds, as dense's operand, as one add or absent, the gates cut by ``split`` or
    ``slice`` in several spellings, the operands of the adds and muls in either order."""
    batch, hidden = IMPORTED["batch"], IMPORTED["hidden_size"]
    b = GraphBuilder(f"cell{layer}")
    x = b.input("xt", (batch, inputs))
    if layer % 2:
        h, c = b.input("h_prev", (batch, hidden)), b.input("c_prev", (batch, hidden))
    else:
        c, h = b.input("c_prev", (batch, hidden)), b.input("h_prev", (batch, hidden))
    gates = 4 * hidden
    weight = b.param if layer == 2 else b.input  # layer 2's weights are bound as body parameters
    w_ih, w_hh = weight("w_ih", (gates, inputs)), weight("w_hh", (gates, hidden))
    if layer == 0:
        b_ih, b_hh = b.input("b_ih", (gates,)), b.input("b_hh", (gates,))
        z = b.op("add", b.op("add", b.op("dense", x, w_ih), b_ih), b.op("add", b.op("dense", h, w_hh), b_hh))
        chunks = b.op("split", z, sections=4, axis=-1)
    elif layer == 1:
        z = b.op("add", b.op("dense", h, w_hh), b.op("dense", x, w_ih, b.input("bias", (gates,))))
        chunks = [b.op("slice", z, begin=k * hidden, end=(k + 1) * hidden, axis=-1) for k in range(4)]
    elif layer == 2:
        z = b.op("add", weight("bias", (gates,)), b.op("add", b.op("dense", x, w_ih), b.op("dense", h, w_hh)))
        chunks = [b.op("slice", z, begin=(0, k * hidden), end=(batch, (k + 1) * hidden)) for k in range(4)]
    else:
        z = b.op("add", b.op("dense", x, w_ih), b.op("dense", h, w_hh))
        chunks = b.op("split", z, sizes=[hidden] * 4, axis=1)
    i, f, g, o = chunks
    if change == "gate_order":
        g, o = o, g  # the tanh on the output gate's chunk
    forget = b.op("tanh" if change == "tanh_for_sigmoid" else "sigmoid", f)
    if layer % 2:
        c_next = b.op("add", b.op("mul", b.op("sigmoid", i), b.op("tanh", g)), b.op("mul", c, forget), name="c_next")
        h_next = b.op("mul", b.op("tanh", c_next), b.op("sigmoid", o), name="h_next")
    else:
        c_next = b.op("add", b.op("mul", forget, c), b.op("mul", b.op("sigmoid", i), b.op("tanh", g)), name="c_next")
        h_next = b.op("mul", b.op("sigmoid", o), b.op("tanh", c_next), name="h_next")
    return b.build(h_next, c_next)


def _imported_graph(weights: dict[str, np.ndarray], change: str | None = None) -> Graph:
    """Outputs: the classifier's logits, the last layer's sequence, h_n (every layer's final h
    stacked) and layer 1's final c. ``change``: one of ``MUTANTS``, or "two_stacks" (a relu on
    layer 1's sequence before layer 2, so layers 0-1 and 2-3 are two stacks)."""
    cfg = IMPORTED
    steps, batch, hidden = cfg["steps"], cfg["batch"], cfg["hidden_size"]
    b = GraphBuilder("imported")
    projection = [b.param(name, weights[name]) for name in ("proj.weight", "proj.bias")]
    sequence = b.op("dense", b.input("input", (steps, batch, cfg["features"])), *projection, name="projected")
    sequences, h_finals, c_finals = [], [], []
    for layer in range(cfg["num_layers"]):
        names = [name for name in weights if name.startswith(f"rnn.{layer}.")]
        inner = ["w_ih", "w_hh", "b_ih", "b_hh"] if layer == 0 else ["w_ih", "w_hh", "bias"][:len(names)]
        outer = [b.param(name, weights[name]) for name in names]
        state = b.op("full", shape=(batch, hidden), value=0.5 if change == "nonzero_state" else 0.0,
                     name=f"rnn.{layer}.state0")
        carry = [("h_prev", "h_next", state), ("c_prev", "c_next", state)]
        if change == "two_stacks" and layer == 2:
            sequence = b.op("relu", sequence)
        bound = {"params": {p: [o] * steps for p, o in zip(inner, outer)}} if layer == 2 else \
            {"invariants": list(zip(inner, outer))}
        (h, c), (sequence,) = b.scan(
            _imported_cell(layer, cfg["input_size"] if layer == 0 else hidden, change), steps,
            name=f"rnn.{layer}", carry=carry[::-1] if layer % 2 == 0 else carry, xs=[("xt", sequence)],
            ys=["h_next"], **bound)
        if layer % 2 == 0:
            h, c = c, h
        sequences.append(sequence)
        h_finals.append(h)
        c_finals.append(c)
    head = [b.param(name, weights[name]) for name in ("head.weight", "head.bias")]
    logits = b.op("dense", h_finals[-1], *head, name="logits")
    h_n = b.op("concat", *[b.op("reshape", h, shape=(1, batch, hidden)) for h in h_finals], axis=0, name="h_n")
    outputs = [logits, sequences[-1], h_n, c_finals[1]]
    if change == "inner_sequence_read":
        outputs.append(sequences[1])
    return b.build(*outputs)


def _imported_reference(weights: dict[str, np.ndarray]):
    """The same model in PyTorch: nn.Linear, nn.LSTM (a combined bias as its b_ih, b_hh zero),
    nn.Linear on h_n[-1]."""
    import torch

    cfg = IMPORTED
    layers, hidden = cfg["num_layers"], cfg["hidden_size"]
    rnn = torch.nn.LSTM(cfg["input_size"], hidden, layers)
    biases = [("rnn.0.b_ih", "rnn.0.b_hh"), ("rnn.1.bias", None), ("rnn.2.bias", None), (None, None)]
    zeros = np.zeros(4 * hidden, np.float32)
    state = {}
    for layer in range(layers):
        state[f"weight_ih_l{layer}"] = weights[f"rnn.{layer}.w_ih"]
        state[f"weight_hh_l{layer}"] = weights[f"rnn.{layer}.w_hh"]
        b_ih, b_hh = (zeros if name is None else weights[name] for name in biases[layer])
        state[f"bias_ih_l{layer}"], state[f"bias_hh_l{layer}"] = b_ih, b_hh
    rnn.load_state_dict({name: torch.from_numpy(array) for name, array in state.items()})
    tensor = {name: torch.from_numpy(array) for name, array in weights.items()}

    def run(inputs):
        with torch.no_grad():
            linear = torch.nn.functional.linear
            x = linear(torch.from_numpy(inputs["input"]), tensor["proj.weight"], tensor["proj.bias"])
            output, (h_n, c_n) = rnn(x)
            logits = linear(h_n[-1], tensor["head.weight"], tensor["head.bias"])
        return [logits.numpy(), output.numpy(), h_n.numpy(), c_n[1].numpy()]

    return run


def test_an_imported_stacked_lstm_inside_a_larger_graph_becomes_one_wavefront_scan():
    weights = _imported_weights(seed=0)
    graph = _imported_graph(weights)
    before = str(graph)
    transformed, report = wavefront(graph)
    assert str(graph) == before
    layers, steps = IMPORTED["num_layers"], IMPORTED["steps"]
    assert [scan.length for scan in _scans(transformed)] == [steps + layers - 1]
    assert report[0] == (f"imported: {layers} layers x {steps} steps -> one wavefront scan of {steps + layers - 1} "
                         "steps, cells of all layers batched per step")
    assert report[1].startswith(f"imported: {2 * layers + 4} per-layer weights -> wavefront.weight ")
    assert (transformed.inputs, transformed.output_specs()) == (graph.inputs, graph.output_specs())
    assert [op.kind for op in transformed.ops if op.kind == "dense"] == ["dense", "dense"]  # projection, classifier
    assert {"proj.weight", "proj.bias", "head.weight", "head.bias"} <= set(transformed.params)
    assert not any(name.startswith("rnn.") for name in transformed.params)
    assert not any(op.kind == "full" and op.outputs[0].startswith("rnn.") for op in transformed.ops)
    for name in set(transformed.params) - set(graph.params):
        np.testing.assert_array_equal(recipe.evaluate(transformed.recipe(name), weights), transformed.weights[name])
    inputs = {"input": np.random.default_rng(1).standard_normal((steps, IMPORTED["batch"], IMPORTED["features"]))
              .astype(np.float32)}
    _check_same_outputs(graph, transformed, inputs, _imported_reference(weights))


@pytest.mark.parametrize("mutant", MUTANTS)
def test_an_imported_graph_that_is_no_stacked_lstm_is_left_alone(mutant):
    """Each mutant changes every layer (or, for the inner sequence, reads what the wavefront
    cannot give back); the unchanged graph is the proof that the recognizer refused it."""
    graph = _imported_graph(_imported_weights(seed=0), mutant)
    assert wavefront(graph) == (graph, [])


def test_two_stacks_become_two_wavefront_scans():
    """Layers 0-1 and 2-3 with a relu between: each stack is rewritten, the second with names of
    its own; h_n stacks final states from both."""
    weights = _imported_weights(seed=0)
    graph = _imported_graph(weights, "two_stacks")
    transformed, report = wavefront(graph)
    steps = IMPORTED["steps"]
    assert [scan.length for scan in _scans(transformed)] == [steps + 1, steps + 1]
    stacks = f"imported: 2 layers x {steps} steps"
    assert [line.split(" -> ")[0] for line in report] == [stacks, "imported: 7 per-layer weights",
                                                          stacks, "imported: 5 per-layer weights"]
    assert {"wavefront.weight", "wavefront:2.weight"} <= set(transformed.params)
    inputs = {"input": np.random.default_rng(1).standard_normal((steps, IMPORTED["batch"], IMPORTED["features"]))
              .astype(np.float32)}
    _check_same_outputs(graph, transformed, inputs)
