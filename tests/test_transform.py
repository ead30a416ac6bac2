"""The transformations (``codegen.vertical``) against hand-built TE programs, and the persistent
pipelines' opt levels (``codegen.pipelines``) against PyTorch."""

import numpy as np
import pytest
from tvm import te, tirx

import souffle
from analysis.characterize import is_gemm
from codegen.pipelines import CUDA, OPT_LEVELS
from codegen.traffic import memory_traffic
from analysis.dependence import tensor_loads
from codegen.vertical import _in_permuted_order, inlinable, pads, selects_elements, vertical
from souffle.compiler import run_passes
from souffle import models
from souffle.errors import SouffleError
from souffle.graph import GraphBuilder
from souffle.lower import lower_graph
from tests.model_checks import run_poisoned


def _mlp():
    b = GraphBuilder("mlp")
    x = b.input("x", (2, 8))
    w = b.param("w", np.arange(32, dtype="float32").reshape(4, 8) / 32)
    bias = b.param("b", np.ones((4,), "float32"))
    y = b.op("relu", b.op("add", b.op("dense", x, w), bias))
    return b.build(b.op("reshape", b.op("transpose", b.op("reshape", y, shape=(2, 2, 2)), axes=(1, 0, 2)),
                        shape=(2, 4), name="out"))


def _names(program):
    return [t.op.name for t in program.stages()]


def test_vertical_inlines_bias_activation_and_layout_into_one_epilogue():
    program = lower_graph(_mlp())
    assert len(program.stages()) > 3
    inlined = vertical(program)
    # The GEMM stays; bias, relu, reshape, transpose, reshape become one element-wise TE.
    assert [len(t.op.reduce_axis) > 0 for t in inlined.stages()] == [True, False]
    assert inlined.regions[0].outputs == program.regions[0].outputs
    assert _names(program) != _names(inlined) and program.te_count() > inlined.te_count()


def test_vertical_keeps_the_original_program_and_its_values():
    graph = _mlp()
    program = lower_graph(graph)
    before = _names(program)
    vertical(program)
    assert _names(program) == before
    x = np.random.default_rng(0).standard_normal((2, 8)).astype("float32")
    plain = souffle.compile(graph, "llvm-persistent", opt_level=0).run({"x": x})[0]
    fused = souffle.compile(graph, "llvm-persistent", opt_level=2).run({"x": x})[0]
    y = np.maximum(x @ graph.weights["w"].T + 1, 0)
    expected = y.reshape(2, 2, 2).transpose(1, 0, 2).reshape(2, 4)
    np.testing.assert_allclose(plain, expected, rtol=1e-6)
    np.testing.assert_allclose(fused, expected, rtol=1e-6)


def test_arithmetic_is_inlined_only_into_a_reduction_that_reads_it_once():
    x = te.placeholder((4, 8), name="x")
    w = te.placeholder((3, 8), name="w")
    k = te.reduce_axis((0, 8), "k")
    shifted = te.compute((4, 8), lambda i, j: x[i, j] + 1.0, name="shifted")
    padded = te.compute((4, 8), lambda i, j: tirx.if_then_else(j < 7, x[i, j], 0.0), name="padded")
    total = te.compute((4,), lambda i: te.sum(shifted[i, k], axis=k), name="total")
    product = te.compute((4, 3), lambda i, n: te.sum(shifted[i, k] * w[n, k], axis=k), name="product")
    relu = te.compute((4, 8), lambda i, j: te.max(shifted[i, j], 0.0), name="relu")
    assert selects_elements(padded.op.body[0]) and not selects_elements(shifted.op.body[0])
    assert inlinable(padded, [total]) and inlinable(padded, [product])
    assert inlinable(shifted, [total, relu])  # the row sum reads each element once: no add redone
    assert not inlinable(shifted, [product])  # each element read by 3 outputs: its add redone 3 times
    assert inlinable(shifted, [relu])
    assert not inlinable(total, [relu])  # a reduction is never recomputed
    assert not inlinable(shifted, [])
    squares = te.compute((4, 8), lambda i, j: te.sum(x[i, k] * x[j, k], axis=k), name="squares")
    activated = te.compute((4, 8), lambda i, j: te.max(squares[i, j], 0.0), name="activated")
    row_sum = te.compute((4,), lambda i: te.sum(activated[i, k], axis=k), name="row_sum")
    assert not inlinable(activated, [row_sum])  # the epilogue of a reduction of its size stays one


def test_arithmetic_is_inlined_into_a_reduction_whose_short_last_axis_reads_the_same_elements():
    """LayerNorm's moments (d and d^2 side by side, [rows, 2]) read each element of the row once
    per output of their last axis, which indexes no load: one warp computes both, so the sum of a
    split GEMM's parts and the residual is recomputed there, not stored behind a grid barrier.
    An axis of 2 that indexes a load (two weights' products) reads the element for two warps."""
    parts = te.placeholder((2, 4, 8), name="parts")
    residual = te.placeholder((4, 8), name="residual")
    w = te.placeholder((2, 8), name="w")
    k, kd, kw = (te.reduce_axis((0, 8), name) for name in ("k", "kd", "kw"))
    summed = te.compute((4, 8), lambda i, j: parts[0, i, j] + parts[1, i, j] + residual[i, j], name="summed")
    row_sum = te.compute((4,), lambda i: te.sum(summed[i, k], axis=k), name="row_sum")

    def deviation(i):
        return summed[i, kd] - row_sum[i]

    moments = te.compute((4, 2), lambda i, m: te.sum(tirx.Select(m == 0, deviation(i), deviation(i) * deviation(i)),
                                                     axis=kd), name="moments")
    normalized = te.compute((4, 8), lambda i, j: (summed[i, j] - moments[i, 0]) * moments[i, 1], name="normalized")
    assert inlinable(summed, [row_sum, moments, normalized])
    products = te.compute((4, 2), lambda i, n: te.sum(summed[i, kw] * w[n, kw], axis=kw), name="products")
    assert not inlinable(summed, [products])
    wide = te.compute((4, 8), lambda i, m: te.sum(summed[i, kd] * (m + 1.0), axis=kd), name="wide")
    assert not inlinable(summed, [wide])  # an axis of 8: longer than one warp's few outputs


def _query_by_key(halves: int = 2):
    """BERT's self-attention scores, small: a dense with bias (two heads' query and key in one
    [8, 32] product), ``halves`` of whose column halves are reshaped to heads and transposed,
    and the query multiplied by the key (by itself with one half)."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("scores")
    x = b.input("x", (8, 16))
    w = b.param("w", rng.standard_normal((32, 16)).astype("float32"))
    bias = b.param("b", rng.standard_normal(32).astype("float32"))
    projected = b.op("add", b.op("dense", x, w), bias)
    heads = [b.op("transpose", b.op("reshape", b.op("slice", projected, begin=h * 16, end=(h + 1) * 16, axis=-1),
                                    shape=(8, 2, 8)), axes=(1, 0, 2)) for h in range(halves)]
    return b.build(b.op("batch_matmul", heads[0], heads[-1], transpose_b=True, name="scores"))


def _expected_scores(graph, x, halves: int = 2):
    projected = x @ graph.weights["w"].T + graph.weights["b"]
    q, k = (projected[:, h * 16:(h + 1) * 16].reshape(8, 2, 8).transpose(1, 0, 2) for h in (0, halves - 1))
    return q @ k.transpose(0, 2, 1)


def _dense_softmax():
    rng = np.random.default_rng(0)
    b = GraphBuilder("scores")
    x = b.input("x", (64, 32))
    w = b.param("w", rng.standard_normal((48, 32)).astype("float32"))
    return b.build(b.op("softmax", b.op("dense", x, w), name="p"))


def test_a_widened_value_is_stored_narrow(monkeypatch):
    """At fp16 the dense's result is rounded to float16 and widened for the softmax: the vertical
    pass stores the float16 value and widens it where it is read (the same values, half the
    bytes), where it stored the float32 copy: its store and the softmax stage that reads it (once:
    its row-resident stage, codegen.row_resident) move 2 B an element fewer. O1 stores both casts:
    the same bits."""
    import codegen.vertical

    graph = _dense_softmax()
    program = run_passes(graph, "llvm-persistent", stop="vertical", opt_level=4, precision="fp16").ir
    stored = [(t.op.name, str(t.dtype)) for t in program.stages() if not t.op.reduce_axis]
    assert stored == [("compute", "float16"), ("compute", "float16"), ("compute", "float32")]  # x, scores, output

    def moved():
        staged = run_passes(graph, "llvm-persistent", stop="plan_arena", opt_level=4, precision="fp16").ir
        return memory_traffic(staged).total_bytes

    narrow = moved()
    monkeypatch.setattr(codegen.vertical, "_before_widening", lambda tensor: None)
    assert moved() - narrow == 2 * 64 * 48 * 2
    monkeypatch.undo()
    x = {"x": np.random.default_rng(1).standard_normal((64, 32)).astype("float32")}
    o1, o4 = (run_poisoned(souffle.compile(graph, "llvm-persistent", opt_level=level, precision="fp16"), x)[0]
              for level in (1, 4))
    np.testing.assert_array_equal(o4, o1)


def _pre_norm_residuals():
    """Two pre-LayerNorm residual blocks, Swin's MLP halves, small: x + dense(norm(x)), twice."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("residuals")
    x = b.input("x", (64, 32))
    for k in range(2):
        normed = b.op("layer_norm", x, b.param(f"g{k}", rng.standard_normal(32).astype("float32")),
                      b.param(f"beta{k}", rng.standard_normal(32).astype("float32")))
        x = b.op("add", x, b.op("dense", normed, b.param(f"w{k}", rng.standard_normal((32, 32)).astype("float32"))),
                 name="out" if k else None)
    return b.build(x)


def test_a_value_stored_narrow_is_read_not_recomputed():
    """At fp16 a residual sum is rounded to float16 and widened for the LayerNorm after it, which
    stores it narrow (``_before_widening``); the next residual sum reads that stored value. Before,
    it recomputed the first sum from its operands (in Swin, from every GEMM result since the
    stage's first), and the first block's GEMM, read by both sums, fused neither: here each GEMM
    has its residual sum as its epilogue. O1 stores every TE: the same bits."""
    graph = _pre_norm_residuals()
    program = run_passes(graph, "cuda", stop="fuse_epilogues", opt_level=4, precision="fp16", device="h100").ir
    (region,) = program.regions
    gemms = [t for t in region.stages() if t.op.reduce_axis and is_gemm(t)]
    epilogues = {producer.op: consumer for consumer, (producer, mode) in region.epilogues.items() if mode == "register"}
    assert len(gemms) == 2 and all(g.op in epilogues for g in gemms)
    first_sum, second_sum = (next(t for t in region.stages() if t.op.same_as(epilogues[g.op])) for g in gemms)
    assert str(first_sum.dtype) == "float16"
    assert first_sum.op in [t.op for t in second_sum.op.input_tensors]
    assert gemms[0].op not in [t.op for t in second_sum.op.input_tensors]
    x = {"x": np.random.default_rng(1).standard_normal((64, 32)).astype("float32")}
    o1, o4 = (run_poisoned(souffle.compile(graph, "llvm-persistent", opt_level=level, precision="fp16"), x)[0]
              for level in (1, 4))
    np.testing.assert_array_equal(o4, o1)


def _windowed_residual():
    """Swin's attention half, small: x + reverse(dense(partition(norm(x)))), 4 x 4 windows of an
    8 x 8 map, then a LayerNorm."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("windows")
    x = b.input("x", (1, 8, 8, 16))

    def norm(t, k):
        return b.op("layer_norm", t, b.param(f"g{k}", rng.standard_normal(16).astype("float32")),
                    b.param(f"beta{k}", rng.standard_normal(16).astype("float32")))

    windows = b.op("reshape", b.op("transpose", b.op("reshape", norm(x, 0), shape=(1, 2, 4, 2, 4, 16)),
                                   axes=(0, 1, 3, 2, 4, 5)), shape=(64, 16))
    projected = b.op("dense", windows, b.param("w", rng.standard_normal((16, 16)).astype("float32")))
    reverse = b.op("reshape", b.op("transpose", b.op("reshape", projected, shape=(1, 2, 2, 4, 4, 16)),
                                   axes=(0, 1, 3, 2, 4, 5)), shape=(1, 8, 8, 16))
    return b.build(norm(b.op("add", x, reverse), 1))


def _expected_windowed(graph, x):
    def norm(t, k):
        mean = t.mean(-1, keepdims=True)
        return (t - mean) / np.sqrt(t.var(-1, keepdims=True) + 1e-5) * graph.weights[f"g{k}"] + graph.weights[f"beta{k}"]

    windows = norm(x, 0).reshape(1, 2, 4, 2, 4, 16).transpose(0, 1, 3, 2, 4, 5).reshape(64, 16)
    reverse = (windows @ graph.weights["w"].T).reshape(1, 2, 2, 4, 4, 16).transpose(0, 1, 3, 2, 4, 5)
    return norm(x + reverse.reshape(1, 8, 8, 16), 1)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_sum_read_through_a_permutation_is_stored_in_its_gemms_order(precision):
    """The residual sum reads the dense's result through the window reverse (a bijective affine
    map, TVM's ``detect_iter_map``): it is stored in the dense's [64, 16] order, as the dense's
    epilogue, and the LayerNorm reads it back through the reverse. Before, it was a stage of its
    own in the map's order, behind a grid barrier. Against NumPy, and O1 (every TE stored) the
    same bits."""
    graph = _windowed_residual()
    program = run_passes(graph, "cuda", stop="fuse_epilogues", opt_level=4, precision=precision, device="h100").ir
    (region,) = program.regions
    (dense,) = [t for t in region.stages() if t.op.reduce_axis and is_gemm(t)]
    fused = [(consumer, mode) for consumer, (producer, mode) in region.epilogues.items() if producer.op.same_as(dense.op)]
    assert len(fused) == 1, "the dense has no epilogue"
    ((consumer, mode),) = fused
    summed = next(t for t in region.stages() if t.op.same_as(consumer))
    assert mode == "register" and [int(d) for d in summed.shape] == [64, 16]
    x = {"x": np.random.default_rng(1).standard_normal((1, 8, 8, 16)).astype("float32")}
    o1, o4 = (run_poisoned(souffle.compile(graph, "llvm-persistent", opt_level=level, precision=precision), x)[0]
              for level in (1, 4))
    np.testing.assert_array_equal(o4, o1)
    tolerance = 1e-4 if precision == "fp32" else 2e-2
    np.testing.assert_allclose(o4, _expected_windowed(graph, x["x"]), rtol=tolerance, atol=tolerance)


def test_only_a_bijective_map_onto_the_reduction_is_inverted():
    """``_in_permuted_order`` stores a sum in its reduction's order where it reads the reduction
    at one place through a one-to-one map onto all of it (a transpose), not through a map that
    skips elements, nor at two places (a roll's two pieces)."""
    a, b = te.placeholder((8, 4), name="a"), te.placeholder((4, 8), name="b")
    k = te.reduce_axis((0, 4), "k")
    product = te.compute((8, 8), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="product")
    residual = te.placeholder((8, 8), name="residual")
    transposed = te.compute((8, 8), lambda i, j: product[j, i] + residual[i, j], name="transposed")
    stored, view = _in_permuted_order(transposed)
    assert [int(d) for d in stored.shape] == [8, 8]
    loads = tensor_loads(stored.op.body[0])
    assert [(load.tensor.op.name, [str(i) for i in load.indices]) for load in loads] == \
        [("product", [ax.var.name for ax in stored.op.axis]),
         ("residual", [ax.var.name for ax in reversed(stored.op.axis)])]
    assert [load.tensor.op.name for load in tensor_loads(view.op.body[0])] == ["transposed"]
    skipping = te.compute((8, 8), lambda i, j: product[(i * 3) % 8, j] + 1.0, name="skipping")
    assert _in_permuted_order(skipping) is None  # one-to-one, but not affine for TVM's iter maps
    halved = te.compute((8, 8), lambda i, j: product[i // 2, j] + 1.0, name="halved")
    assert _in_permuted_order(halved) is None  # two elements read the same result
    rolled = te.compute((8, 8), lambda i, j: tirx.Select(i < 7, product[i + 1, j], product[0, j]), name="rolled")
    assert _in_permuted_order(rolled) is None
    # one load, one-to-one and affine, but TVM's iter map detects (i + 1) % 8 as i: taken, the sum
    # would be stored a row off
    shifted = te.compute((8, 8), lambda i, j: product[tirx.floormod(i + 1, 8), j] + 1.0, name="shifted")
    assert _in_permuted_order(shifted) is None


def test_arithmetic_before_layout_into_a_gemm_is_stored_in_the_producers_layout():
    """The bias add is stored as the dense's [8, 32] output, and the slices, reshapes and
    transposes become the batched product's operand indices: three TEs, not four (the bias
    carried into each head's transposed copy)."""
    graph = _query_by_key()
    inlined = vertical(lower_graph(graph))
    stages = inlined.stages()
    assert [bool(t.op.reduce_axis) for t in stages] == [True, False, True]
    dense, biased, scores = stages
    assert [int(d) for d in biased.shape] == [8, 32] and list(biased.op.input_tensors[0].shape) == dense.shape
    assert [t.op for t in scores.op.input_tensors] == [biased.op]  # query and key: two places of one tensor
    x = np.random.default_rng(1).standard_normal((8, 16)).astype("float32")
    for level in (2, 4):
        (out,) = run_poisoned(souffle.compile(graph, "llvm-persistent", opt_level=level), {"x": x})
        np.testing.assert_allclose(out, _expected_scores(graph, x), rtol=1e-5, atol=1e-5, err_msg=f"O{level}")


def test_arithmetic_is_not_stored_where_no_one_reads_all_of_it():
    """Only the first half of the product is read: storing the bias add in the dense's layout
    would compute 16 columns no one reads, so it is carried into the slice, which is read whole
    and stored; the reshape and transpose after it become the product's operand indices."""
    graph = _query_by_key(halves=1)
    stages = vertical(lower_graph(graph)).stages()
    assert [bool(t.op.reduce_axis) for t in stages] == [True, False, True]
    assert [int(d) for d in stages[1].shape] == [8, 16]
    x = np.random.default_rng(1).standard_normal((8, 16)).astype("float32")
    (out,) = run_poisoned(souffle.compile(graph, "llvm-persistent", opt_level=4), {"x": x})
    np.testing.assert_allclose(out, _expected_scores(graph, x, halves=1), rtol=1e-5, atol=1e-5)


def test_opt_levels_are_checked():
    assert [CUDA.check_level(level) for level in OPT_LEVELS] == [0, 1, 2, 3, 4]
    assert CUDA.check_level(None) == 4
    for bad in (5, -1, "4", True, 2.0):
        with pytest.raises(SouffleError, match="opt level must be one of 0, 1, 2, 3, 4"):
            CUDA.check_level(bad)


def test_each_level_reports_what_its_transformations_did():
    graph = models.structure("bert", "tiny")

    def transforms(level):
        run = run_passes(graph, "cuda", stop="vertical", opt_level=level)
        return run, run.notes("transform", prefixed=True)

    assert transforms(0)[1] == []
    one, one_notes = transforms(1)
    assert one_notes == [("horizontal: bert/encoder: fused dense attention.self.query, attention.self.key, "
                          "attention.self.value (3 x [32, 32]) reading hidden_states -> one dense [96, 32]")]
    two, two_notes = transforms(2)
    assert two_notes[:1] == one_notes and two_notes[1].startswith("vertical: ")
    assert two.irs["te"].te_count() < one.irs["te"].te_count()


# ResNeXt's sweep takes a minute of the default suite's 20; its O0 and O4 kernels are checked by
# default on emulated threads (test_cuda_emulated), the sweep with -m slow
@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.slow) if m == "resnext" else m
                                  for m in models.MODELS])
def test_every_level_matches_pytorch_on_the_cpu(name):
    """The acceptance check: each level's staged program, its arena full of NaN, against PyTorch."""
    graph = models.build(name, "tiny")
    inputs = models.make_inputs(name, "tiny")
    expected = models.reference(name, "tiny", graph.weights)(inputs)
    rtol, atol = models.tolerance(name, "tiny")
    moved = []
    for level in OPT_LEVELS:
        model = souffle.compile(graph, "llvm-persistent", opt_level=level)
        for got, want in zip(run_poisoned(model, inputs), expected):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{name} O{level}")
        moved.append(memory_traffic(model.plan).total_bytes)
    assert moved[4] < moved[0], f"{name}: static bytes moved at O0..O4: {moved}"


def _windowed_attention():
    """Swin's attention probabilities, small: a batched product over windows x heads (16 = 4 x 4),
    read through a reshape to (windows, heads, S, S) by the relative position bias add, then the
    softmax."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("windows")
    q = b.input("q", (16, 32, 16))
    k = b.param("k", rng.standard_normal((16, 32, 16)).astype("float32"))
    bias = b.param("bias", rng.standard_normal((1, 4, 32, 32)).astype("float32"))
    scores = b.op("batch_matmul", q, k, transpose_b=True)
    return b.build(b.op("softmax", b.op("add", b.op("reshape", scores, shape=(4, 4, 32, 32)), bias, name="biased")))


@pytest.mark.parametrize("target", ["llvm-persistent", "cuda-emulated"])
def test_a_gemm_read_through_a_reshape_takes_its_reader_as_epilogue(target):
    """The bias add reads each score at its own row-major position: stored in the scores' shape
    (``codegen.vertical``), with the softmax reading it through the reshape, it runs in the
    product's tiles, its result stored once, on the CPU and on the GPU's threads."""
    graph = _windowed_attention()
    q = np.random.default_rng(1).standard_normal((16, 32, 16)).astype("float32")
    scores = (q @ graph.weights["k"].transpose(0, 2, 1)).reshape(4, 4, 32, 32) + graph.weights["bias"]
    expected = np.exp(scores - scores.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    model = souffle.compile(graph, target, opt_level=4)
    stages = (model.kernel_plan.staged if target == "cuda-emulated" else model.plan).stages()
    product = stages[0]
    assert product.epilogue is not None and [int(d) for d in product.tensor.shape] == [16, 32, 32]
    assert not [s.name for s in stages[1:] if "add" in s.name or "biased" in s.name]
    if target == "cuda-emulated":
        (out,) = model.schedule("descending", model.emulator.sms, seed=5).run({"q": q})
    else:
        (out,) = run_poisoned(model, {"q": q})
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def _scaled_queries(reads_twice: bool = False):
    """Swin's scaled attention scores, small: the queries scaled, reshaped and transposed, then
    multiplied with the keys; ``reads_twice``: the scaled queries are also an output."""
    rng = np.random.default_rng(2)
    b = GraphBuilder("attention")
    q = b.input("q", (4, 32, 16))
    k = b.param("k", rng.standard_normal((8, 8, 32)).astype("float32"))
    scaled = b.op("scale", q, factor=0.25, name="scaled")
    heads = b.op("reshape", b.op("transpose", scaled, axes=(0, 2, 1)), shape=(8, 8, 32))
    scores = b.op("batch_matmul", b.op("reshape", heads, shape=(8, 32, 8)), k, transpose_a=False, name="scores")
    return b.build(*([scores, scaled] if reads_twice else [scores]))


def test_a_scale_of_a_matmul_operand_moves_to_its_result():
    """The scale reaches the product through a transpose and reshapes, each read once: the
    product reads the unscaled queries and multiplies its accumulator by the factor (its
    ``alpha``), in one stage; a scale also read elsewhere stays."""
    from codegen.scale_past_matmul import scale_past_matmul

    graph = _scaled_queries()
    moved, notes = scale_past_matmul(graph)
    assert [op.kind for op in moved.ops] == ["transpose", "reshape", "reshape", "batch_matmul"]
    assert moved.ops[0].inputs == ("q",) and moved.ops[3].outputs == ("scores",)
    assert moved.ops[3].attrs == {"transpose_a": False, "alpha": 0.25}
    assert notes == ["attention/scores: the scale by 0.25 of its operand q applied to its product (alpha 0.25)"]
    kept = _scaled_queries(reads_twice=True)
    assert scale_past_matmul(kept) == (kept, [])
    model = souffle.compile(graph, "llvm-persistent", opt_level=4)
    assert len(model.plan.stages()) == 1
    q = np.random.default_rng(3).standard_normal((4, 32, 16)).astype("float32")
    expected = (q * 0.25).transpose(0, 2, 1).reshape(8, 8, 32).reshape(8, 32, 8) @ graph.weights["k"]
    (out,) = run_poisoned(model, {"q": q})
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def _large_product(alpha: float):
    """A batched product of 64 terms of 40 x 40: 102400, past float16's 65504, times ``alpha``."""
    b = GraphBuilder("large")
    a = b.input("a", (1, 4, 64))
    w = b.param("w", np.full((1, 64, 4), 40.0, dtype="float32"))
    return b.build(b.op("batch_matmul", a, w, alpha=alpha, name="product"))


@pytest.mark.parametrize("target", ["llvm", "llvm-persistent"])
def test_a_matmuls_alpha_scales_the_float32_accumulator_before_float16_rounds_it(target):
    a = np.full((1, 4, 64), 40.0, dtype="float32")
    (out,) = souffle.compile(_large_product(1 / 64), target, precision="fp16").run({"a": a})
    np.testing.assert_array_equal(out, np.full((1, 4, 4), 1600.0))
    (unscaled,) = souffle.compile(_large_product(1.0), target, precision="fp16").run({"a": a})
    assert np.isinf(unscaled).all()  # what a scale applied after the rounding would have met


def test_a_matmuls_alpha_exports_to_onnx_as_a_mul():
    import onnx

    from souffle.onnx_export import to_onnx

    model = to_onnx(_large_product(0.5))
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Constant", "Mul"]
    a = np.random.default_rng(4).standard_normal((1, 4, 64)).astype("float32")
    (out,) = souffle.compile(souffle.from_onnx(model), "llvm").run({"a": a})
    np.testing.assert_allclose(out, 0.5 * a @ np.full((1, 64, 4), 40.0), rtol=1e-5)
    assert onnx.checker.check_model(model) is None


def _conv_relu_conv(groups: int):
    """A 1x1 convolution with a bias and its ReLU, then a padded 3x3 convolution of ``groups`` groups."""
    rng = np.random.default_rng(4)
    b = GraphBuilder("padded")
    x = b.input("x", (1, 8, 6, 6))
    w1 = b.param("w1", rng.standard_normal((8, 8, 1, 1)).astype("float32"))
    b1 = b.param("b1", rng.standard_normal((8,)).astype("float32"))
    w2 = b.param("w2", rng.standard_normal((8, 8 // groups, 3, 3)).astype("float32"))
    y = b.op("relu", b.op("conv2d", x, w1, b1))
    return b.build(b.op("conv2d", y, w2, padding=1, groups=groups, name="out"))


@pytest.mark.parametrize("target", ["llvm-persistent", "cuda-emulated"])
def test_a_padding_read_by_a_grouped_convolution_is_read_through(target):
    """A padding is one tensor's elements chosen by index (not a concatenation, which the
    horizontal transformation's stacked inputs stay, nor a ReLU). Before a grouped convolution
    (no GEMM), the bias add and ReLU are stored in the first convolution's
    shape, its epilogue, and the padding is read through: two stages, one grid barrier between
    them. Before a dense one (a GEMM, whose rules take no condition inside an operand), they
    are carried into the padding, which is stored and read unconditionally."""
    import torch
    import torch.nn.functional as F

    x, y = te.placeholder((4, 8), name="x"), te.placeholder((4, 8), name="y")
    padded = te.compute((4, 9), lambda i, j: tirx.if_then_else(j >= 1, x[i, j - 1], 0.0), name="padded")
    joined = te.compute((4, 16), lambda i, j: tirx.if_then_else(j < 8, x[i, j], y[i, j - 8]), name="joined")
    relu = te.compute((4, 8), lambda i, j: tirx.Select(x[i, j] > 0.0, x[i, j], 0.0), name="relu")
    assert pads(padded.op.body[0]) and not pads(joined.op.body[0]) and not pads(relu.op.body[0])
    grouped = vertical(lower_graph(_conv_relu_conv(groups=4))).stages()
    # the last: the output, NCHW, of the convolution's [N, groups, O / groups, H, W] (its epilogue)
    assert [bool(t.op.reduce_axis) for t in grouped] == [True, False, True, False]
    assert [int(d) for d in grouped[1].shape] == [1, 8, 6, 6]
    assert grouped[1].op.input_tensors[0].op.same_as(grouped[0].op)
    assert [t.op for t in grouped[2].op.input_tensors if t.op.same_as(grouped[1].op)]  # the padding read through
    assert [int(d) for d in grouped[2].shape] == [1, 4, 2, 6, 6]
    dense = vertical(lower_graph(_conv_relu_conv(groups=1))).stages()
    assert [bool(t.op.reduce_axis) for t in dense] == [True, False, True]
    assert [int(d) for d in dense[1].shape] == [1, 8, 8, 8]  # the padded ReLU, stored
    for groups, stages in ((4, 2), (1, 3)):
        graph = _conv_relu_conv(groups)
        model = souffle.compile(graph, target, opt_level=4)
        assert len((model.kernel_plan.staged if target == "cuda-emulated" else model.plan).stages()) == stages
        x = np.random.default_rng(5).standard_normal((1, 8, 6, 6)).astype("float32")
        # the emulated device poisons the buffers it allocates
        (out,) = model.run({"x": x}) if target == "cuda-emulated" else run_poisoned(model, {"x": x})
        y = F.relu(F.conv2d(torch.tensor(x), torch.tensor(graph.weights["w1"]),
                            torch.tensor(graph.weights["b1"])))
        expected = F.conv2d(y, torch.tensor(graph.weights["w2"]), padding=1, groups=groups).numpy()
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5, err_msg=f"groups={groups}")
