"""Horizontal transformation: which dense ops fuse, the rewritten graph's shape, and that the
fused models still compute what PyTorch computes."""

import numpy as np
import pytest

import souffle
from codegen.horizontal import horizontal
from souffle import models, recipe
from souffle.graph import Graph, GraphBuilder, Scan

TARGETS = ("llvm", "llvm-persistent")


def check_transformed_against_torch(name: str, transform=horizontal, config: str = "tiny") -> tuple[Graph, Graph, list[str]]:
    """Like ``model_checks.check_against_torch``, for ``transform`` of model ``name``'s graph:
    compile the transformed graph for LLVM and for the persistent kernel's staged program on
    the CPU (which transforms it again at its default opt level), and compare every output
    with the PyTorch reference on the same weights and inputs. Returns (original graph,
    transformed, notes)."""
    model, cfg = models.get(name), models.config(name, config)
    weights = model.init_weights(cfg, seed=0)
    graph = model.build_graph(cfg, weights)
    transformed, notes = transform(graph)
    inputs = model.make_inputs(cfg, seed=1)
    expected = model.torch_reference(cfg, weights)(inputs)
    assert transformed.outputs == graph.outputs and len(expected) == len(graph.outputs)
    rtol, atol = models.tolerance(name, config)
    for target in TARGETS:
        got = souffle.compile(transformed, target=target).run(inputs)
        assert len(got) == len(expected)
        for output, value, want in zip(graph.outputs, got, expected):
            np.testing.assert_allclose(value, want, rtol=rtol, atol=atol, err_msg=f"{output} ({target})")
    return graph, transformed, notes


def run(graph: Graph, inputs: dict[str, np.ndarray], target: str = "llvm") -> list[np.ndarray]:
    return souffle.compile(graph, target=target).run(inputs)


def check_same_outputs(fused: Graph, graph: Graph, inputs: dict[str, np.ndarray], tol: float = 1e-5):
    """``fused``, compiled for every target, computes what ``graph`` computes on LLVM."""
    want = run(graph, inputs)
    for target in TARGETS:
        got = run(fused, inputs, target)
        assert len(got) == len(want)
        for name, value, expected in zip(graph.outputs, got, want):
            np.testing.assert_allclose(value, expected, rtol=tol, atol=tol, err_msg=f"{name} ({target})")


def check_recipes(fused: Graph, original: Graph) -> list[str]:
    """Every weight the transformation made is rebuilt exactly, by its recipe, from the
    original graph's weights alone. Returns the made weights' names."""
    derived = [w for w in fused.weights if w not in original.weights]
    for w in derived:
        assert recipe.sources(fused.recipe(w)) <= set(original.weights), w
        np.testing.assert_array_equal(recipe.evaluate(fused.recipe(w), original.weights), fused.weights[w], err_msg=w)
    return derived


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


def test_mmoe_experts_and_gates_become_one_dense_and_the_towers_one_batch_matmul_per_layer():
    graph, fused, notes = check_transformed_against_torch("mmoe")
    assert notes == [
        ("mmoe: fused dense experts.0, experts.1, experts.2, gates.0, gates.1 (3 x [4, 10] + 2 x [3, 10]) "
         "reading x -> one dense [18, 10]"),
        ("mmoe: batched dense towers.0.0, towers.1.0 (2 x [8, 4]) reading task_0.mix_2, task_1.mix_2 "
         "-> one batch_matmul [2, 8, 4]"),
        ("mmoe: batched dense towers.0.2, towers.1.2 (2 x [1, 8]) reading tower_0.hidden, tower_1.hidden "
         "-> one batch_matmul [2, 1, 8]"),
    ]
    assert kinds(graph).count("dense") == 9
    assert kinds(fused).count("dense") == 1 and kinds(fused).count("batch_matmul") == 2
    # 5 dense -> 1 dense + 5 slices; per tower layer 2 dense -> 2 reshapes, concat, batch_matmul,
    # bias reshape, add, 2 slices and 2 reshapes.
    assert fused.op_count() == graph.op_count() + 1 + 2 * 8
    assert kinds(fused)[:6] == ["dense"] + ["slice"] * 5
    ops = [str(op) for op in fused.ops]
    assert ops[1:6] == [
        f"{member} = slice({{experts.0,experts.1,experts.2,gates.0,gates.1}}; begin={begin}, end={end}, axis=-1)"
        for member, begin, end in [("experts.0", 0, 4), ("experts.1", 4, 8), ("experts.2", 8, 12),
                                   ("gates.0", 12, 15), ("gates.1", 15, 18)]
    ]
    # Tower 0's first layer now waits for task 1's mixture; its consumers moved after it.
    first = ops.index("towers.0.0.input = reshape(task_0.mix_2; shape=(1, 1, 4))")
    assert ops[first:first + 10] == [
        "towers.0.0.input = reshape(task_0.mix_2; shape=(1, 1, 4))",
        "towers.1.0.input = reshape(task_1.mix_2; shape=(1, 1, 4))",
        "towers.{0,1}.0.input = concat(towers.0.0.input, towers.1.0.input; axis=0)",
        "towers.{0,1}.0.matmul = batch_matmul(towers.{0,1}.0.input, towers.{0,1}.0.weight; transpose_b=True)",
        "towers.{0,1}.0.bias.rows = reshape(towers.{0,1}.0.bias; shape=(2, 1, 8))",
        "towers.{0,1}.0 = add(towers.{0,1}.0.matmul, towers.{0,1}.0.bias.rows)",
        "towers.0.0.batched = slice(towers.{0,1}.0; begin=0, end=1, axis=0)",
        "towers.0.0 = reshape(towers.0.0.batched; shape=(1, 8))",
        "towers.1.0.batched = slice(towers.{0,1}.0; begin=1, end=2, axis=0)",
        "towers.1.0 = reshape(towers.1.0.batched; shape=(1, 8))",
    ]
    assert ops.index("task_1.mix_2 = add(task_1.mix_1, task_1.expert_2)") == first - 1
    assert ops[-2:] == ["task_0 = sigmoid(towers.0.2)", "task_1 = sigmoid(towers.1.2)"]
    assert {name: spec.shape for name, spec in fused.params.items()} == {
        "{experts.0,experts.1,experts.2,gates.0,gates.1}.weight": (18, 10),
        "{experts.0,experts.1,experts.2,gates.0,gates.1}.bias": (18,),
        "towers.{0,1}.0.weight": (2, 8, 4),
        "towers.{0,1}.0.bias": (2, 8),
        "towers.{0,1}.2.weight": (2, 1, 8),
        "towers.{0,1}.2.bias": (2, 1),
    }
    assert set(fused.weights) == set(fused.params)
    np.testing.assert_array_equal(fused.weights["towers.{0,1}.0.weight"],
                                  np.stack([graph.weights["towers.0.0.weight"], graph.weights["towers.1.0.weight"]]))
    assert fused.recipe("towers.{0,1}.2.bias") == recipe.stack([recipe.model("towers.0.2.bias"),
                                                               recipe.model("towers.1.2.bias")])


def test_mmoe_paper_fusions():
    """The paper's MMoE: 8 experts and 2 gates, one dense; each tower layer, one batch_matmul."""
    fused, notes = horizontal(models.structure("mmoe", "paper"))
    experts = ", ".join(f"experts.{e}" for e in range(8))
    assert notes == [
        f"mmoe: fused dense {experts}, gates.0, gates.1 (8 x [16, 100] + 2 x [8, 100]) reading x -> one dense [144, 100]",
        ("mmoe: batched dense towers.0.0, towers.1.0 (2 x [8, 16]) reading task_0.mix_7, task_1.mix_7 "
         "-> one batch_matmul [2, 8, 16]"),
        ("mmoe: batched dense towers.0.2, towers.1.2 (2 x [1, 8]) reading tower_0.hidden, tower_1.hidden "
         "-> one batch_matmul [2, 1, 8]"),
    ]
    assert kinds(fused).count("dense") == 1 and kinds(fused).count("batch_matmul") == 2


@pytest.mark.slow
def test_mmoe_paper_matches_torch():
    graph, fused, notes = check_transformed_against_torch("mmoe", config="paper")
    assert len(notes) == 3
    assert check_recipes(fused, graph)


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
    check_same_outputs(fused, graph, inputs, tol=1e-6)


@pytest.mark.parametrize("through", [None, "relu"])
def test_dependent_dense_ops_are_not_fused(through):
    """Same shapes, but the second reads the first's output (directly or through a relu):
    neither one wider dense (different inputs) nor one batch (not independent)."""
    b = GraphBuilder("chain")
    x = b.input("x", (2, 4))
    _square_weights(b, "first", "second")
    hidden = b.op("dense", x, "first.weight")
    if through is not None:
        hidden = b.op(through, hidden)
    graph = b.build(b.op("dense", hidden, "second.weight"))

    fused, notes = horizontal(graph)

    assert notes == []
    assert str(fused) == str(graph)


def test_independent_same_shaped_dense_ops_are_batched_after_their_inputs():
    """a reads x, b reads tanh(y) produced after a's consumer: one batch_matmul right after
    tanh, a's consumer moved after it; c (reading relu(a)) depends on a, so stays."""
    b = GraphBuilder("pair")
    x, y = b.input("x", (2, 4)), b.input("y", (2, 4))
    _square_weights(b, "a", "b", "c")
    a = b.op("dense", x, "a.weight", name="a")
    a_relu = b.op("relu", a, name="a_relu")
    y_tanh = b.op("tanh", y, name="y_tanh")
    out_b = b.op("dense", y_tanh, "b.weight", name="b")
    graph = b.build(out_b, b.op("dense", a_relu, "c.weight", name="c"))

    fused, notes = horizontal(graph)

    assert notes == ["pair: batched dense a, b (2 x [4, 4]) reading x, y_tanh -> one batch_matmul [2, 4, 4]"]
    assert [str(op) for op in fused.ops] == [
        "y_tanh = tanh(y)",
        "a.input = reshape(x; shape=(1, 2, 4))",
        "b.input = reshape(y_tanh; shape=(1, 2, 4))",
        "{a,b}.input = concat(a.input, b.input; axis=0)",
        "{a,b} = batch_matmul({a,b}.input, {a,b}.weight; transpose_b=True)",
        "a.batched = slice({a,b}; begin=0, end=1, axis=0)",
        "a = reshape(a.batched; shape=(2, 4))",
        "b.batched = slice({a,b}; begin=1, end=2, axis=0)",
        "b = reshape(b.batched; shape=(2, 4))",
        "a_relu = relu(a)",
        "c = dense(a_relu, c.weight)",
    ]
    assert list(fused.params) == ["c.weight", "{a,b}.weight"]
    assert check_recipes(fused, graph) == ["{a,b}.weight"]
    rng = np.random.default_rng(1)
    inputs = {name: rng.standard_normal((2, 4)).astype(np.float32) for name in ("x", "y")}
    check_same_outputs(fused, graph, inputs)


def test_batched_ops_wait_for_the_last_input_and_keep_bias():
    """Three towers, biased, reading inputs made at different points; the third's input is
    made last, so the batch goes after it and the first two towers' consumers follow it."""
    b = GraphBuilder("towers")
    x = b.input("x", (3, 5))
    rng = np.random.default_rng(0)
    outputs = []
    source = x
    for t in range(3):
        b.param(f"t{t}.weight", rng.standard_normal((2, 5)).astype(np.float32))
        b.param(f"t{t}.bias", rng.standard_normal(2).astype(np.float32))
        source = b.op("tanh", source, name=f"in{t}")  # in2 = tanh(tanh(tanh(x)))
        dense = b.op("dense", source, f"t{t}.weight", f"t{t}.bias", name=f"t{t}")
        outputs.append(b.op("sigmoid", dense, name=f"out{t}"))
    graph = b.build(*outputs)

    fused, notes = horizontal(graph)

    assert notes == ["towers: batched dense t0, t1, t2 (3 x [2, 5]) reading in0, in1, in2 -> one batch_matmul [3, 2, 5]"]
    assert kinds(fused)[:3] == ["tanh"] * 3
    assert kinds(fused)[3:8] == ["reshape", "reshape", "reshape", "concat", "batch_matmul"]
    assert kinds(fused)[-3:] == ["sigmoid"] * 3
    assert sorted(check_recipes(fused, graph)) == ["{t0,t1,t2}.bias", "{t0,t1,t2}.weight"]
    assert fused.weights["{t0,t1,t2}.bias"].shape == (3, 2)
    inputs = {"x": np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)}
    check_same_outputs(fused, graph, inputs)


def test_shared_input_dense_ops_of_different_widths_become_one():
    """a and b (widths 3 and 5, both biased) read x: one dense of width 8, sliced at 0 and 3.
    c reads x too but has no bias, so it is left alone."""
    b = GraphBuilder("widths")
    x = b.input("x", (2, 4))
    rng = np.random.default_rng(0)
    for name, width in (("a", 3), ("b", 5), ("c", 2)):
        b.param(f"{name}.weight", rng.standard_normal((width, 4)).astype(np.float32))
    for name, width in (("a", 3), ("b", 5)):
        b.param(f"{name}.bias", rng.standard_normal(width).astype(np.float32))
    graph = b.build(b.op("dense", x, "a.weight", "a.bias", name="a"), b.op("dense", x, "b.weight", "b.bias", name="b"),
                    b.op("dense", x, "c.weight", name="c"))

    fused, notes = horizontal(graph)

    assert notes == ["widths: fused dense a, b (1 x [3, 4] + 1 x [5, 4]) reading x -> one dense [8, 4]"]
    assert [str(op) for op in fused.ops] == [
        "{a,b} = dense(x, {a,b}.weight, {a,b}.bias)",
        "a = slice({a,b}; begin=0, end=3, axis=-1)",
        "b = slice({a,b}; begin=3, end=8, axis=-1)",
        "c = dense(x, c.weight)",
    ]
    assert sorted(check_recipes(fused, graph)) == ["{a,b}.bias", "{a,b}.weight"]
    inputs = {"x": np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)}
    check_same_outputs(fused, graph, inputs)


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
    check_same_outputs(fused, graph, inputs)


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


def _layered_graph() -> Graph:
    """Two layers (per-layer weights and biases p.l, q.l), each adding a projection of its
    carried state h and one of the invariant x: two same-shaped dense ops on different inputs."""
    body = GraphBuilder("layer")
    h, x = body.input("h", (2, 4)), body.input("x", (2, 4))
    for name in ("p", "q"):
        body.param(f"{name}.weight", (4, 4))
        body.param(f"{name}.bias", (4,))
    body = body.build(body.op("relu", body.op("add", body.op("dense", h, "p.weight", "p.bias", name="p_proj"),
                                              body.op("dense", x, "q.weight", "q.bias", name="q_proj")), name="h_next"))
    b = GraphBuilder("layered")
    x = b.input("x", (2, 4))
    rng = np.random.default_rng(0)
    for name in ("p", "q"):
        for layer in range(2):
            b.param(f"{name}.{layer}.weight", rng.standard_normal((4, 4)).astype(np.float32))
            b.param(f"{name}.{layer}.bias", rng.standard_normal(4).astype(np.float32))
    params = {f"{name}.{kind}": [f"{name}.{layer}.{kind}" for layer in range(2)]
              for name in ("p", "q") for kind in ("weight", "bias")}
    (out,), _ = b.scan(body, 2, name="layers", carry=[("h", "h_next", x)], invariants=[("x", x)], params=params)
    return b.build(out)


def test_scan_body_batch_binds_stacked_weights_per_iteration():
    graph = _layered_graph()

    fused, notes = horizontal(graph)

    assert notes == ["layered/layers: batched dense p, q (2 x [4, 4]) reading h, x -> one batch_matmul [2, 4, 4]"]
    layers = only_scan(fused)
    assert kinds(layers.body).count("batch_matmul") == 1 and "dense" not in kinds(layers.body)
    assert dict(layers.params) == {
        "{p,q}.weight": ("{p,q}.0.weight", "{p,q}.1.weight"),
        "{p,q}.bias": ("{p,q}.0.bias", "{p,q}.1.bias"),
    }
    assert sorted(fused.weights) == ["{p,q}.0.bias", "{p,q}.0.weight", "{p,q}.1.bias", "{p,q}.1.weight"]
    assert fused.weights["{p,q}.1.weight"].shape == (2, 4, 4)
    assert fused.recipe("{p,q}.1.weight") == recipe.stack([recipe.model("p.1.weight"), recipe.model("q.1.weight")])
    check_recipes(fused, graph)
    inputs = {"x": np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)}
    check_same_outputs(fused, graph, inputs)


def test_merged_weights_carry_recipes_from_the_model_weights():
    """A TVM-free machine rebuilds every concatenated or stacked weight from the model's own
    weights."""
    for name, config in (("bert", "tiny"), ("mmoe", "tiny"), ("mmoe", "paper")):
        graph = models.build(name, config)
        fused, _ = horizontal(graph)
        derived = check_recipes(fused, graph)
        assert derived
        assert all(fused.recipe(w)[0] in ("concat", "stack") for w in derived)
    graph = _nested_graph()
    assert check_recipes(horizontal(graph)[0], graph)
