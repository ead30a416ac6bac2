"""Horizontal transformation: which dense ops fuse, the rewritten graph's shape, and that the
fused models still compute what PyTorch computes."""

import numpy as np
import pytest

import souffle
from codegen.horizontal import horizontal
from souffle import models
from souffle.graph import Graph, GraphBuilder, Scan


def check_transformed_against_torch(name: str, transform=horizontal) -> tuple[Graph, Graph, list[str]]:
    """Like ``model_checks.check_against_torch``, for ``transform`` of tiny model ``name``'s
    graph: compile the transformed graph for LLVM and compare every output with the PyTorch
    reference on the same weights and inputs. Returns (original graph, transformed, notes)."""
    model, cfg = models.get(name), models.config(name)
    weights = model.init_weights(cfg, seed=0)
    graph = model.build_graph(cfg, weights)
    transformed, notes = transform(graph)
    inputs = model.make_inputs(cfg, seed=1)
    got = souffle.compile(transformed, target="llvm").run(inputs)
    expected = model.torch_reference(cfg, weights)(inputs)
    assert transformed.outputs == graph.outputs and len(got) == len(expected) == len(graph.outputs)
    rtol, atol = models.tolerance(name)
    for output, value, want in zip(graph.outputs, got, expected):
        np.testing.assert_allclose(value, want, rtol=rtol, atol=atol, err_msg=output)
    return graph, transformed, notes


def run(graph: Graph, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    return souffle.compile(graph, target="llvm").run(inputs)


def kinds(graph: Graph) -> list[str]:
    return [op.kind for op in graph.ops]


def only_scan(graph: Graph) -> Scan:
    (scan,) = [op for op in graph.ops if isinstance(op, Scan)]
    return scan


def test_bert_query_key_value_become_one_dense_per_layer():
    graph, fused, notes = check_transformed_against_torch("bert")
    assert notes == [
        ("bert/encoder: fused dense attention.self.query, attention.self.key, attention.self.value "
         "(3 x [32, 32]) reading hidden_states -> one dense [96, 32]")
    ]
    before, after = only_scan(graph), only_scan(fused)
    assert kinds(before.body).count("dense") == 6 and kinds(after.body).count("dense") == 4
    assert after.body.op_count() == before.body.op_count() + 1  # 3 dense -> 1 dense + 3 slices
    first_ops = [str(op) for op in after.body.ops[:4]]
    assert first_ops == [
        ("{dense_1,dense_4,dense_7} = dense(hidden_states, attention.self.{query,key,value}.weight, "
         "attention.self.{query,key,value}.bias)"),
        "dense_1 = slice({dense_1,dense_4,dense_7}; begin=0, end=32, axis=-1)",
        "dense_4 = slice({dense_1,dense_4,dense_7}; begin=32, end=64, axis=-1)",
        "dense_7 = slice({dense_1,dense_4,dense_7}; begin=64, end=96, axis=-1)",
    ]
    # The six per-projection body parameters become two, each bound to one new weight per layer.
    assert len(after.body.params) == len(before.body.params) - 4
    params = dict(after.params)
    assert params["attention.self.{query,key,value}.weight"] == (
        "encoder.layer.0.attention.self.{query,key,value}.weight",
        "encoder.layer.1.attention.self.{query,key,value}.weight",
    )
    assert "attention.self.query.weight" not in params
    assert len(fused.weights) == len(graph.weights) - 2 * 6 + 2 * 2
    assert not any(".attention.self.query." in name for name in fused.weights)
    layer1 = [graph.weights[f"encoder.layer.1.attention.self.{p}.bias"] for p in ("query", "key", "value")]
    np.testing.assert_array_equal(fused.weights["encoder.layer.1.attention.self.{query,key,value}.bias"],
                                  np.concatenate(layer1))


def test_mmoe_experts_and_gates_each_become_one_dense():
    graph, fused, notes = check_transformed_against_torch("mmoe")
    assert notes == [
        "mmoe: fused dense experts.0, experts.1, experts.2 (3 x [4, 10]) reading x -> one dense [12, 10]",
        "mmoe: fused dense gates.0, gates.1 (2 x [3, 10]) reading x -> one dense [6, 10]",
    ]
    assert kinds(graph).count("dense") == 9 and kinds(fused).count("dense") == 6
    assert fused.op_count() == graph.op_count() + 2  # (3 -> 1 + 3) + (2 -> 1 + 2)
    assert kinds(fused)[:4] == ["dense", "slice", "slice", "slice"]
    assert sorted(n for n in fused.params if not n.startswith("towers.")) == [
        "experts.{0,1,2}.bias", "experts.{0,1,2}.weight", "gates.{0,1}.bias", "gates.{0,1}.weight",
    ]
    assert set(fused.weights) == set(fused.params)


@pytest.mark.parametrize("name", ["lstm", "resnext"])
def test_models_without_shared_input_gemms_are_unchanged(name):
    """LSTM's cell GEMMs read different activations (x_t and h) with weights bound as scan
    invariants; ResNeXt has one dense (fc). So nothing fuses and the graph is the same."""
    graph, fused, notes = check_transformed_against_torch(name)
    assert notes == []
    assert str(fused) == str(graph)
    assert fused.weights.keys() == graph.weights.keys()


def test_structure_only_graph_is_rewritten_like_the_weighted_one():
    fused, notes = horizontal(models.structure("bert"))
    weighted, weighted_notes = horizontal(models.build("bert"))
    assert fused.weights is None
    assert notes == weighted_notes and len(notes) == 1
    assert str(fused) == str(weighted)


def _square_weights(b: GraphBuilder, *names: str, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for name in names:
        b.param(f"{name}.weight", rng.standard_normal((4, 4)).astype(np.float32))


def test_only_the_independent_pair_fuses():
    """a and b read x; c has a weight of the same shape but reads relu(a), so it stays."""
    b = GraphBuilder("three")
    x = b.input("x", (2, 4))
    _square_weights(b, "a", "b", "c")
    a = b.op("dense", x, "a.weight", name="a")
    out_b = b.op("dense", x, "b.weight", name="b")
    out_c = b.op("dense", b.op("relu", a, name="a_relu"), "c.weight", name="c")
    graph = b.build(out_b, out_c)

    fused, notes = horizontal(graph)

    assert notes == ["three: fused dense a, b (2 x [4, 4]) reading x -> one dense [8, 4]"]
    assert [str(op) for op in fused.ops] == [
        "{a,b} = dense(x, {a,b}.weight)",
        "a = slice({a,b}; begin=0, end=4, axis=-1)",
        "b = slice({a,b}; begin=4, end=8, axis=-1)",
        "a_relu = relu(a)",
        "c = dense(a_relu, c.weight)",
    ]
    assert list(fused.params) == ["c.weight", "{a,b}.weight"]
    np.testing.assert_array_equal(fused.weights["{a,b}.weight"],
                                  np.concatenate([graph.weights["a.weight"], graph.weights["b.weight"]]))
    inputs = {"x": np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)}
    for got, want in zip(run(fused, inputs), run(graph, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_dependent_dense_ops_are_not_fused():
    b = GraphBuilder("chain")
    x = b.input("x", (2, 4))
    _square_weights(b, "first", "second")
    graph = b.build(b.op("dense", b.op("dense", x, "first.weight"), "second.weight"))

    fused, notes = horizontal(graph)

    assert notes == []
    assert str(fused) == str(graph)


def test_fused_name_avoids_existing_tensors():
    b = GraphBuilder("clash")
    x = b.input("x", (2, 4))
    _square_weights(b, "a", "b")
    taken = b.op("relu", x, name="{a,b}")
    graph = b.build(taken, b.op("dense", x, "a.weight", name="a"), b.op("dense", x, "b.weight", name="b"))

    fused, _ = horizontal(graph)

    assert [op.outputs[0] for op in fused.ops[:2]] == ["{a,b}", "{a,b}.2"]


def test_body_weights_not_bound_to_model_weights_are_not_fused():
    """A body parameter bound to a computed tensor has no value at compile time to concatenate."""
    body = GraphBuilder("step")
    x_t = body.input("x_t", (1, 4))
    body.param("p", (4, 4))
    body.param("q", (4, 4))
    body = body.build(body.op("add", body.op("dense", x_t, "p"), body.op("dense", x_t, "q"), name="y"))
    b = GraphBuilder("computed")
    x = b.input("x", (3, 1, 4))
    _square_weights(b, "w", "v")
    scaled = b.op("relu", "w.weight", name="w_relu")
    b.scan(body, 3, name="time", xs=[("x_t", x)], ys=["y"],
           params={"p": [scaled] * 3, "q": ["v.weight"] * 3})
    graph = b.build("time.y")

    fused, notes = horizontal(graph)

    assert notes == []
    assert str(fused) == str(graph)


def _nested_graph() -> Graph:
    """Two layers (per-layer weights q.l, k.l) of three steps (the layer's weights every step),
    each step adding two projections of its input: a fusion two scans deep."""
    step = GraphBuilder("step")
    x_t = step.input("x_t", (1, 4))
    step.param("q", (4, 4))
    step.param("k", (4, 4))
    step = step.build(step.op("add", step.op("dense", x_t, "q", name="q_proj"),
                              step.op("dense", x_t, "k", name="k_proj"), name="y"))
    layer = GraphBuilder("layer")
    sequence = layer.input("sequence", (3, 1, 4))
    layer.param("q", (4, 4))
    layer.param("k", (4, 4))
    _, (ys,) = layer.scan(step, 3, name="time", xs=[("x_t", sequence)], ys=["y"],
                          params={"q": ["q"] * 3, "k": ["k"] * 3})
    layer = layer.build(ys)
    b = GraphBuilder("nested")
    x = b.input("x", (3, 1, 4))
    _square_weights(b, "q.0", "k.0", "q.1", "k.1")
    (out,), _ = b.scan(layer, 2, name="layers", carry=[("sequence", ys, x)],
                       params={"q": ["q.0.weight", "q.1.weight"], "k": ["k.0.weight", "k.1.weight"]})
    return b.build(out)


def test_nested_scan_fusion_binds_new_weights_at_every_level():
    graph = _nested_graph()

    fused, notes = horizontal(graph)

    assert notes == ["nested/layers/time: fused dense q, k (2 x [4, 4]) reading x_t -> one dense [8, 4]"]
    layers = only_scan(fused)
    time = only_scan(layers.body)
    assert kinds(time.body) == ["dense", "slice", "slice", "add"]
    assert time.params == (("{q,k}", ("{q,k}",) * 3),)
    assert layers.params == (("{q,k}", ("{q,k}.0.weight", "{q,k}.1.weight")),)
    assert list(layers.body.params) == list(time.body.params) == ["{q,k}"]
    assert sorted(fused.weights) == ["{q,k}.0.weight", "{q,k}.1.weight"]
    np.testing.assert_array_equal(fused.weights["{q,k}.1.weight"],
                                  np.concatenate([graph.weights["q.1.weight"], graph.weights["k.1.weight"]]))
    inputs = {"x": np.random.default_rng(1).standard_normal((3, 1, 4)).astype(np.float32)}
    np.testing.assert_allclose(run(fused, inputs)[0], run(graph, inputs)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["bert", "mmoe"])
def test_input_graph_is_not_changed(name):
    graph = models.build(name)
    text, ops, params = str(graph), graph.ops, dict(graph.params)
    weights = {key: value.copy() for key, value in graph.weights.items()}
    bodies = [(op, op.body, op.params) for op in graph.ops if isinstance(op, Scan)]

    horizontal(graph)

    assert str(graph) == text and graph.ops is ops and graph.params == params
    assert graph.weights.keys() == weights.keys()
    assert all(np.array_equal(graph.weights[key], value) for key, value in weights.items())
    assert all(op.body is body and op.params == bound for op, body, bound in bodies)


def test_concatenated_weights_carry_recipes_from_the_model_weights():
    """A TVM-free machine rebuilds every fused weight from the model's own weights."""
    from souffle import recipe

    for name in ("bert", "mmoe"):
        graph = models.build(name, "tiny")
        fused, _ = horizontal(graph)
        derived = [w for w in fused.weights if w not in graph.weights]
        assert derived
        for w in derived:
            assert recipe.sources(fused.recipe(w)) <= set(graph.weights)
            np.testing.assert_array_equal(recipe.evaluate(fused.recipe(w), graph.weights), fused.weights[w])
