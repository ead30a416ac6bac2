"""The LSTM wavefront: one scan of T + L - 1 steps, numerically torch.nn.LSTM."""

import json
from dataclasses import replace

import numpy as np
import pytest

import souffle
from codegen.wavefront import wavefront
from souffle import models, recipe
from souffle.graph import Graph, Scan
from souffle.models import lstm

TINY = lstm.CONFIGS["tiny"]
CONFIGS = {
    "tiny": TINY,
    "wide_input": {"input_size": 24, "hidden_size": 8, "num_layers": 2, "steps": 4, "batch": 2},
    "same_width": {"input_size": 8, "hidden_size": 8, "num_layers": 4, "steps": 3, "batch": 2},
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
    from codegen.staging import Stage

    transformed, _ = wavefront(lstm.build_graph(TINY, lstm.init_weights(TINY, seed=0)))
    m = souffle.compile(transformed, target="llvm-persistent", threads=256)
    print(m.plan)
    (loop,) = [item for item in m.plan.items if type(item).__name__ == "Loop"]
    assert loop.trips == TINY["steps"] + TINY["num_layers"] - 1
    stages = [item for item in loop.items if isinstance(item, Stage)]
    assert len(stages) == len(loop.items) >= 2  # the gate product (with the state update) and h_top
    assert sum(s.barrier is not None for s in stages) == 1, m.plan.table()  # per step
    outside = sum(item.barrier is not None for item in m.plan.items)  # the loop's own one runs once, before it
    assert m.plan.barrier_count(executed=True) == loop.trips + outside, m.plan.table()


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
    "gemv64": {"input_size": 24, "hidden_size": 32, "num_layers": 2, "steps": 3, "batch": 2},  # K + H = 64
}


@pytest.mark.parametrize("name", FUSED_CONFIGS)
def test_o3_persistent_program_fuses_the_gate_product_with_the_state_update(name):
    """At O3 the staged program's wavefront loop has a stage that is the gate GEMV with the
    state update as its epilogue, and the program computes torch.nn.LSTM."""
    from codegen.staging import Loop

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
    from codegen.transform import vertical
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


def test_a_graph_that_differs_from_the_lstm_is_left_alone():
    graph = models.structure("lstm", "tiny")
    layer0 = graph.ops[1]
    cell = layer0.body
    ops = [replace(op, kind="sigmoid") if op.kind == "tanh" else op for op in cell.ops]
    other_cell = Graph(cell.name, cell.inputs, cell.params.values(), ops, cell.outputs)
    other = Graph(graph.name, graph.inputs, graph.params.values(),
                  [replace(layer0, body=other_cell) if op is layer0 else op for op in graph.ops], graph.outputs)
    assert wavefront(other) == (other, [])
