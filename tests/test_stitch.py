"""The stitcher: one PrimFunc per model, scans as loops, every binding mode checked numerically."""

import numpy as np
import pytest
from model_checks import run_poisoned

import souffle
from analysis.device import local_cpu
from codegen.schedule_cpu import schedule_cpu
from codegen.stitch import stitch
from souffle.errors import GraphError
from souffle.graph import GraphBuilder
from souffle.lower import lower_graph

RNG = np.random.default_rng(7)


def _rand(*shape, scale=0.3):
    return (RNG.standard_normal(shape) * scale).astype("float32")


def _cell_body(features=4):
    """h' = relu(x W.T + h); y = h' + x (carry, a scanned input, a per-step output)."""
    b = GraphBuilder("cell")
    h = b.input("h", (1, features))
    x = b.input("x", (1, features))
    w = b.param("w", (features, features))
    h_next = b.op("relu", b.op("add", b.op("dense", x, w), h), name="h_next")
    return b.build(h_next, b.op("add", h_next, x, name="y"))


def _cell_reference(h, xs, w):
    ys = []
    for x in xs:
        h = np.maximum(x @ w.T + h, 0)
        ys.append(h + x)
    return h, np.stack(ys)


def test_one_function_with_stacked_weights_and_arena():
    b = GraphBuilder("net")
    x = b.input("x", (1, 4))
    ws = [b.param(f"layer.{i}.w", _rand(4, 4)) for i in range(3)]
    body = GraphBuilder("layer")
    h = body.input("h", (1, 4))
    body_graph = body.build(body.op("relu", body.op("dense", h, body.param("w", (4, 4))), name="h2"))
    (final,), _ = b.scan(body_graph, 3, name="layers", carry=[("h", "h2", x)], params={"w": ws})
    graph = b.build(b.op("relu", final, name="out"))
    program = lower_graph(graph)
    stitched = stitch(program, lambda func: schedule_cpu(func, local_cpu()))
    assert [s.name for s, _ in stitched.weights] == ["layers/w"]
    assert stitched.weights[0][1].shape == (3, 4, 4)
    np.testing.assert_array_equal(stitched.weights[0][1][1], graph.weights["layer.1.w"])
    assert program.loop_count() == 1 and program.region_count() == 2
    assert stitched.arena_sizes == {"float32": 8}  # two ping-pong carry slots of 4 floats
    assert len(stitched.func.params) == 1 + 1 + 1 + 1  # input, stacked weight, output, arena


def test_scan_with_carry_xs_ys_and_invariant_weight():
    steps = 5
    b = GraphBuilder("rnn")
    xs = b.input("xs", (steps, 1, 4))
    h0 = b.input("h0", (1, 4))
    w = b.param("w", _rand(4, 4))
    (h_final,), (ys,) = b.scan(_cell_body(), steps, name="time", carry=[("h", "h_next", h0)],
                               xs=[("x", xs)], ys=["y"], params={"w": [w] * steps})
    graph = b.build(h_final, ys)
    model = souffle.compile(graph)
    inputs = {"xs": _rand(steps, 1, 4, scale=1.0), "h0": _rand(1, 4, scale=1.0)}
    got_h, got_ys = run_poisoned(model, inputs)
    want_h, want_ys = _cell_reference(inputs["h0"], inputs["xs"], graph.weights["w"])
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_ys, want_ys, rtol=1e-5, atol=1e-5)
    assert model.plan.weights[0][0].name == "w"  # invariant: not stacked


def test_nested_scans_layers_of_time_steps():
    """Layers x time steps, the LSTM shape: the inner scan reads the outer scan's carry."""
    steps, layers = 4, 3
    inner = GraphBuilder("layer")
    seq = inner.input("seq", (steps, 1, 4))
    h0 = inner.op("full", shape=(1, 4), value=0.0, name="h0")
    w = inner.param("w", (4, 4))
    (h_last,), (ys,) = inner.scan(_cell_body(), steps, name="time", carry=[("h", "h_next", h0)],
                                  xs=[("x", seq)], ys=["y"], params={"w": [w] * steps})
    layer_graph = inner.build(ys, h_last)

    b = GraphBuilder("stack")
    xs = b.input("xs", (steps, 1, 4))
    ws = [b.param(f"layer.{i}.w", _rand(4, 4)) for i in range(layers)]
    (final_seq,), (h_lasts,) = b.scan(layer_graph, layers, name="layers", carry=[("seq", "time.y", xs)],
                                      ys=["time.h"], params={"w": ws})
    graph = b.build(final_seq, h_lasts)
    x = _rand(steps, 1, 4, scale=1.0)
    got_seq, got_h = run_poisoned(souffle.compile(graph), {"xs": x})
    seq_ref, h_ref = x, []
    for i in range(layers):
        h, seq_ref = _cell_reference(np.zeros((1, 4), "float32"), seq_ref, graph.weights[f"layer.{i}.w"])
        h_ref.append(h)
    np.testing.assert_allclose(got_seq, seq_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_h, np.stack(h_ref), rtol=1e-5, atol=1e-5)


def test_outputs_that_are_inputs_weights_or_repeated():
    b = GraphBuilder("aliases")
    x = b.input("x", (2, 3))
    w = b.param("w", _rand(2, 3))
    y = b.op("add", x, w, name="y")
    graph = b.build(y, x, w, y)
    inputs = {"x": _rand(2, 3)}
    got = souffle.compile(graph).run(inputs)
    want = [inputs["x"] + graph.weights["w"], inputs["x"], graph.weights["w"], inputs["x"] + graph.weights["w"]]
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=1e-6)


def test_per_iteration_binding_to_a_non_weight_is_refused():
    inner = GraphBuilder("layer")
    h = inner.input("h", (1, 4))
    inner_graph = inner.build(inner.op("dense", h, inner.param("w", (4, 4)), name="h2"))
    outer = GraphBuilder("outer")
    h = outer.input("h", (1, 4))
    w_a, w_b = outer.param("wa", (4, 4)), outer.param("wb", (4, 4))
    outer.scan(inner_graph, 2, name="inner", carry=[("h", "h2", h)], params={"w": [w_a, w_b]})
    outer_graph = outer.build("inner.h")
    b = GraphBuilder("net")
    x = b.input("x", (1, 4))
    wa = [b.param(f"a{i}", _rand(4, 4)) for i in range(2)]
    wb = [b.param(f"b{i}", _rand(4, 4)) for i in range(2)]
    b.scan(outer_graph, 2, name="outer", carry=[("h", "inner.h", x)], params={"wa": wa, "wb": wb})
    graph = b.build("outer.h")
    with pytest.raises(GraphError, match="varies per iteration"):
        souffle.compile(graph)
