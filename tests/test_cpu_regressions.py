"""Regressions of the CPU path (target "llvm") that a random-graph fuzzer found (issue 14):
a GEMM whose sole consumer is a slice or a split, a rank-0 reduction, and a graph whose
output is one of its inputs or weights. A case that once corrupted the heap runs in a
subprocess, so an abort fails its test instead of killing pytest."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import s_tir, sym, te, tirx, topi
from tvm.ir import Range

import codegen.schedule_cpu
import souffle
from analysis.device import local_cpu
from codegen.schedule_cpu import schedule_cpu
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder
from souffle.ops.packed import dense_packed

ROOT = Path(__file__).resolve().parent.parent


# -- a GEMM, then a slice or a split -------------------------------------------------------------
def _gemm(b: GraphBuilder, kind: str, x: str, x_value: np.ndarray, features: int, weight: str,
          rng) -> tuple[str, np.ndarray]:
    """A ``kind`` op (dense, matmul or a 3x3 conv2d) of ``x`` with ``features`` outputs and
    a random ``weight``, and its value."""
    inputs = x_value.shape[1]
    if kind == "dense":
        w = rng.standard_normal((features, inputs)).astype("float32")
        return b.op("dense", x, b.param(weight, w)), x_value @ w.T
    if kind == "matmul":
        w = rng.standard_normal((inputs, features)).astype("float32")
        return b.op("matmul", x, b.param(weight, w)), x_value @ w
    w = rng.standard_normal((features, inputs, 3, 3)).astype("float32")
    padded = np.pad(x_value, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))
    return b.op("conv2d", x, b.param(weight, w), padding=1), np.einsum("nchwrs,ocrs->nohw", windows, w)


def _consumers(kind: str, rows: int, features: int) -> list[tuple[str, dict]]:
    """Slices and splits of a GEMM's output: along its output features (the tile's vector axis)
    to fewer of them, at an offset, strided, and along another axis (strided even when that
    axis has one point, which reads it all, but as ``2 * i``)."""
    feature_axis = 1
    other_axis, others = (3, 4) if kind == "conv2d" else (0, rows)
    consumers = [
        ("slice", {"begin": [0], "end": [features // 2], "axis": [feature_axis]}),
        ("slice", {"begin": [0], "end": [1], "axis": [feature_axis]}),
        ("slice", {"begin": [1], "end": [features - 1], "axis": [feature_axis]}),
        ("slice", {"begin": [0], "end": [features], "axis": [feature_axis], "strides": [2]}),
        ("split", {"sections": 2, "axis": feature_axis}),
        ("slice", {"begin": [0], "end": [others], "axis": [other_axis], "strides": [2]}),
    ]
    if others == 4:
        consumers.append(("slice", {"begin": [1], "end": [3], "axis": [other_axis]}))
    return consumers


def _numpy(value: np.ndarray, kind: str, attrs: dict) -> list[np.ndarray]:
    if kind == "split":
        return np.split(value, attrs["sections"], axis=attrs["axis"])
    index = [slice(None)] * value.ndim
    strides = attrs.get("strides") or [1] * len(attrs["axis"])
    for axis, begin, end, stride in zip(attrs["axis"], attrs["begin"], attrs["end"], strides):
        index[axis] = slice(begin, end, stride)
    return [value[tuple(index)]]


def _gemm_then_slices(kind: str, rows: int, features: int, consumers=None):
    """One graph of independent chains ``x -> kind -> consumer`` (each GEMM with that sole
    consumer, so its tile's write-back may take it in), its input and the expected outputs."""
    rng = np.random.default_rng(features)
    b = GraphBuilder(f"{kind}_{rows}x{features}")
    shape = (1, 8, 4, 4) if kind == "conv2d" else (rows, 16)
    x_value = rng.standard_normal(shape).astype("float32")
    x = b.input("x", shape)
    outputs, expected = [], []
    for k, (consumer, attrs) in enumerate(consumers or _consumers(kind, rows, features)):
        y, y_value = _gemm(b, kind, x, x_value, features, f"w{k}", rng)
        out = b.op(consumer, y, **attrs)
        outputs += [out] if isinstance(out, str) else list(out)
        expected += _numpy(y_value, consumer, attrs)
    return b.build(*outputs), x_value, expected


def check_gemm_then_slices(cases):
    """Compile and run each (kind, rows, features) graph of ``_gemm_then_slices``; raise on a
    wrong output. Run in a subprocess by the tests below."""
    for kind, rows, features, consumers in cases:
        graph, x, expected = _gemm_then_slices(kind, rows, features, consumers)
        got = souffle.compile(graph, target="llvm").run({"x": x})
        for name, g, e in zip(graph.outputs, got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4, err_msg=f"{graph.name}: {name}")


def _in_subprocess(cases):
    code = ("import sys\n"
            f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
            "from test_cpu_regressions import check_gemm_then_slices\n"
            f"check_gemm_then_slices({cases!r})\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-3000:]}"


def test_dense_then_a_narrower_slice_runs_and_matches_numpy():
    """The fuzzer's repro: x (1,16) -> dense (16x16) -> columns 0:8 aborted the process
    ("double free or corruption"); 32->8, 8->4, 64->1 too; 16->15 wrote past the output silently."""
    _in_subprocess([("dense", 1, features, [("slice", {"begin": [0], "end": [end], "axis": [1]})])
                    for features, end in [(16, 8), (32, 8), (8, 4), (64, 1), (16, 15)]])


@pytest.mark.parametrize("rows", [4, 1])
def test_dense_then_a_strided_slice_compiles(rows):
    """x (4,16) -> dense -> rows ::2 failed with TVM's CanProveEqual(IntegerAbs(source->scale), 1);
    so did rows 0:1:2 of one row, a copy of them all, read at 2 * i."""
    check_gemm_then_slices([("dense", rows, 16, [("slice", {"begin": [0], "end": [rows], "axis": [0], "strides": [2]})])])


SWEEP = [(kind, rows, features) for kind, rows in [("dense", 1), ("dense", 4), ("matmul", 4), ("conv2d", 1)]
         for features in (8, 16, 24, 64)]


def test_gemms_then_slices_and_splits_sweep():
    """Dense as a GEMV and as a GEMM, matmul and conv2d, then every consumer of ``_consumers``:
    all compile and match numpy (a grid of widths; the whole of ``SWEEP`` is the slow test's)."""
    _in_subprocess([("dense", 1, 8, None), ("dense", 1, 64, None), ("dense", 4, 16, None),
                    ("matmul", 4, 24, None), ("conv2d", 1, 16, None)])


@pytest.mark.slow
def test_gemms_then_slices_and_splits_full_sweep():
    _in_subprocess([(kind, rows, features, None) for kind, rows, features in SWEEP])


# -- the written extents -------------------------------------------------------------------------
def stores_outside(func: tirx.PrimFunc) -> list[str]:
    """Every store of ``func`` whose index can leave its buffer's shape, over the loops
    around it (and the conditions it sits under), as "buffer[shape]: index in [min, max]"."""
    lowered = tvm.transform.Sequential([s_tir.transform.LowerInitBlock(), s_tir.transform.ConvertBlocksToOpaque(),
                                        s_tir.transform.LowerOpaqueBlock()])(tvm.IRModule({"main": func}))["main"]
    analyzer = sym.Analyzer()
    found = []

    def visit(stmt):
        if isinstance(stmt, tirx.SeqStmt):
            for child in stmt.seq:
                visit(child)
        elif isinstance(stmt, tirx.For):
            analyzer.bind(stmt.loop_var, Range.from_min_extent(stmt.min, stmt.extent))
            visit(stmt.body)
        elif isinstance(stmt, tirx.IfThenElse):
            with analyzer.constraint_scope(stmt.condition):
                visit(stmt.then_case)
            if stmt.else_case is not None:
                with analyzer.constraint_scope(tirx.Not(stmt.condition)):
                    visit(stmt.else_case)
        elif isinstance(stmt, tirx.BufferStore):
            for index, dim in zip(stmt.indices, stmt.buffer.shape):
                bound = analyzer.const_int_bound(index)
                if bound.min_value < 0 or bound.max_value >= int(dim):
                    found.append(f"{stmt.buffer.name}{list(stmt.buffer.shape)}: {index} in "
                                 f"[{bound.min_value}, {bound.max_value}]")
        elif getattr(stmt, "body", None) is not None:
            visit(stmt.body)

    visit(lowered.body)
    return found


@pytest.mark.parametrize("kind, rows, features", SWEEP)
def test_every_store_of_a_gemm_then_slices_stays_inside_its_buffer(kind, rows, features):
    graph, _, _ = _gemm_then_slices(kind, rows, features)
    func = run_passes(graph, "llvm", stop="stitch").ir.func
    assert stores_outside(func) == []


def test_the_extents_check_sees_a_store_past_the_end():
    """A 16-wide loop storing into an 8-wide buffer, as the write-back of issue 14 did."""
    out = tirx.decl_buffer((1, 8), "float32", name="out")
    j = tirx.Var("j", "int32")
    store = tirx.BufferStore(out, tirx.const(0.0, "float32"), [tirx.const(0, "int32"), j])
    func = tirx.PrimFunc([out], tirx.For(j, 0, 16, tirx.ForKind.SERIAL, store))
    assert stores_outside(func) == ["out[1, 8]: j in [0, 15]"]
    assert stores_outside(func.with_body(tirx.For(j, 0, 8, tirx.ForKind.SERIAL, store))) == []


def test_a_write_back_that_would_store_outside_its_output_is_refused(monkeypatch):
    """Without the rule that only a consumer reading each element of the tile once is folded
    into it, the slice would be folded and the scheduler's check refuses the result."""
    monkeypatch.setattr(codegen.schedule_cpu, "_reads_each_element_once", lambda *args: True)
    x, w = te.placeholder((1, 16), name="x"), te.placeholder((1, 16, 16), name="w")
    sliced = topi.strided_slice(dense_packed([x, w]), [0], [8], [1], axes=[1])
    with pytest.raises(AssertionError, match=r"write-back 'dense_packed_local' stores .* outside its shape \[1, 8\]"):
        schedule_cpu(te.create_prim_func([x, w, sliced]), local_cpu())


def test_element_wise_epilogues_are_still_folded_into_the_write_back():
    """Bias, activation and a transposing copy read each element of the tile once: folded."""
    x, w, bias = te.placeholder((4, 16), name="x"), te.placeholder((1, 16, 16), name="w"), te.placeholder((16,), name="b")
    y = topi.transpose(topi.nn.relu(dense_packed([x, w, bias])), [1, 0])
    text = schedule_cpu(te.create_prim_func([x, w, bias, y]), local_cpu()).script()
    assert 'T.sblock("T_relu")' not in text and 'T.sblock("T_transpose")' not in text


# -- reductions to one value ---------------------------------------------------------------------
def _single_op(kind, shape, *params, **attrs):
    b = GraphBuilder(kind)
    x = b.input("x", shape)
    return b.build(b.op(kind, x, *(b.param(f"p{k}", p) for k, p in enumerate(params)), **attrs))


@pytest.mark.parametrize("shape", [(64,), (64, 64), (7,), (3, 5)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_mean_of_every_axis_matches_numpy(shape, keepdims):
    """mean with axes=None raised TVM's block_realize == old_block_realize_ in rfactor: the
    division after the sum is a block with no loop, which TVM's rfactor does not expect."""
    x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    got = souffle.compile(_single_op("mean", shape, keepdims=keepdims), target="llvm")(x)
    np.testing.assert_allclose(got, x.mean(keepdims=keepdims), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("length", [64, 7])
def test_softmax_and_layer_norm_of_a_vector_match_torch(length):
    """On a 1-D tensor, softmax raised an IndexError and layer_norm the rfactor error above."""
    import torch

    rng = np.random.default_rng(1)
    x, gamma, beta = (rng.standard_normal(length).astype("float32") for _ in range(3))
    got = souffle.compile(_single_op("softmax", (length,)), target="llvm")(x)
    np.testing.assert_allclose(got, torch.softmax(torch.from_numpy(x), 0).numpy(), rtol=1e-5, atol=1e-6)
    got = souffle.compile(_single_op("layer_norm", (length,), gamma, beta), target="llvm")(x)
    want = torch.nn.functional.layer_norm(torch.from_numpy(x), (length,), torch.from_numpy(gamma),
                                          torch.from_numpy(beta), eps=1e-5)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def test_a_reduction_to_one_value_is_vectorized():
    """The sum of (64, 64) is vector partial sums along the rows, then a sum of the lanes."""
    x = te.placeholder((64, 64), name="x")
    text = schedule_cpu(te.create_prim_func([x, topi.sum(x)]), local_cpu()).script()
    assert "x_red_rf" in text and "T.vectorized(8)" in text


# -- an output that is an input or a weight ------------------------------------------------------
@pytest.mark.parametrize("target", ["llvm", "llvm-persistent"])
@pytest.mark.parametrize("output", ["x", "w"])
def test_a_graph_whose_only_output_is_its_input_or_weight(target, output):
    """On llvm the one statement, a copy, made TVM refuse a SeqStmt of length 1."""
    w = np.arange(12, dtype="float32").reshape(3, 4)
    b = GraphBuilder("alias")
    x = b.input("x", (3, 4))
    b.param("w", w)
    x_value = np.random.default_rng(2).standard_normal((3, 4)).astype("float32")
    got = souffle.compile(b.build(output), target=target)(x_value)
    np.testing.assert_array_equal(got, x_value if output == "x" else w)


def test_a_graph_whose_only_output_is_its_input_compiles_for_cuda():
    b = GraphBuilder("alias")
    model = souffle.compile(b.build(b.input("x", (3, 4))), target="cuda")
    assert model.kernel_count == 1


# -- long chains of exp/erf/tanh/sigmoid ---------------------------------------------------------
CHAIN = ("tanh", "gelu", "sigmoid", "tanh", "silu", "tanh")  # a fuzz graph's that hung the build


def _chain_graph():
    b = GraphBuilder("chain")
    previous = b.input("x", (8, 13))
    for i, kind in enumerate(CHAIN):
        previous = b.op(kind, previous, name=f"t{i}")
    return b.build(previous)


def _chain_reference(x: np.ndarray) -> np.ndarray:
    import torch

    y = torch.from_numpy(x.astype(np.float64))
    for kind in CHAIN:
        y = getattr(torch, kind)(y) if kind in ("tanh", "sigmoid") else getattr(torch.nn.functional, kind)(y)
    return y.numpy()


@pytest.mark.parametrize("target, opt_level", [("llvm", None), ("llvm-persistent", 2), ("llvm-persistent", 4)])
def test_a_chain_of_transcendental_ops_builds_and_matches_torch(target, opt_level):
    """Fused into one expression, six nested calls (each lowered to arithmetic that uses its
    argument tens of times) took TVM's LLVM code generator longer than ten minutes; fusion now
    stops at two, so the chain is three stored expressions and builds in about a second."""
    x = np.random.default_rng(0).standard_normal((8, 13)).astype("float32")
    x[0, :3] = [np.nan, np.inf, -np.inf]
    got = souffle.compile(_chain_graph(), target=target, opt_level=opt_level).run({"x": x})[0]
    want = _chain_reference(x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_vertical_nests_at_most_two_transcendental_calls():
    from codegen.cpu_math import MAX_NESTED_EXPANDED_CALLS, nested_expanded_calls

    program = run_passes(_chain_graph(), "llvm-persistent", stop="vertical", opt_level=2).ir
    depths = [nested_expanded_calls(body) for stage in program.stages() for body in stage.op.body]
    assert max(depths) == MAX_NESTED_EXPANDED_CALLS == 2
    assert len(depths) == 3


@pytest.mark.parametrize("opt_level", [0, 2, 4])
def test_a_flattened_table_looked_up_by_int64_ids_compiles(opt_level):
    """Vertical fusion substitutes the embedding's int64 ids into the flatten's int32 index
    arithmetic (fuzz seed 1795427230); TVM refuses ``floormod(int64, int32)``, so the
    substitution widens the narrower side."""
    b = GraphBuilder("flattened_table")
    b.input("x", (33, 3, 4))
    b.input("ids", (2, 2), "int64")
    b.op("relu", "x", name="table3d")
    b.op("flatten", "table3d", name="table", start_dim=0, end_dim=1)
    b.op("embedding", "table", "ids", name="rows")
    graph = b.build("rows")
    x = np.random.default_rng(0).standard_normal((33, 3, 4)).astype("float32")
    ids = np.array([[0, 98], [50, 7]], dtype="int64")
    got = souffle.compile(graph, target="llvm-persistent", opt_level=opt_level).run({"x": x, "ids": ids})[0]
    np.testing.assert_array_equal(got, np.maximum(x, 0).reshape(99, 4)[ids])


def _stores(stmt) -> list:
    """Every BufferStore under ``stmt``."""
    if isinstance(stmt, tirx.BufferStore):
        return [stmt]
    if isinstance(stmt, tirx.SeqStmt):
        return [store for child in stmt.seq for store in _stores(child)]
    found = []
    for name in ("body", "then_case", "else_case", "block"):
        child = getattr(stmt, name, None)
        if isinstance(child, tirx.Stmt):
            found += _stores(child)
    return found


def test_a_gemm_write_back_nests_at_most_two_transcendental_calls():
    """Fuzz seed 1795427319: a dense followed by silu, silu, gelu_tanh and sigmoid, all folded
    into the GEMM's write-back, nested seven expanded calls and took LLVM over five minutes;
    the write-back fold now stops at the same depth as the element-wise inlining."""
    from codegen.cpu_math import MAX_NESTED_EXPANDED_CALLS, nested_expanded_calls

    rng = np.random.default_rng(0)
    b = GraphBuilder("gemm_then_activations")
    b.input("x", (8, 16))
    b.param("w", rng.standard_normal((8, 16)).astype("float32"))
    b.op("dense", "x", "w", name="y")
    for i, kind in enumerate(("silu", "silu", "gelu_tanh", "sigmoid")):
        b.op(kind, "y" if i == 0 else f"a{i - 1}", name=f"a{i}")
    graph = b.build("a3")
    stitched = run_passes(graph, "llvm", stop="stitch").ir
    depths = [nested_expanded_calls(store.value) for store in _stores(stitched.func.body)]
    assert depths and max(depths) <= MAX_NESTED_EXPANDED_CALLS, depths
    x = rng.standard_normal((8, 16)).astype("float32")
    got = souffle.compile(graph, target="llvm").run({"x": x})[0]
    import torch

    y = torch.from_numpy(x.astype(np.float64)) @ torch.from_numpy(graph.weights["w"].astype(np.float64)).T
    y = torch.sigmoid(torch.nn.functional.gelu(torch.nn.functional.silu(torch.nn.functional.silu(y)),
                                               approximate="tanh"))
    np.testing.assert_allclose(got, y.numpy(), rtol=1e-5, atol=1e-6)


def _nested_where_graph():
    """Fuzz seed 1795437653: ``where`` over comparisons of ``where``, three levels deep."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("nested_where")
    b.input("x", (5,))
    b.param("low", rng.standard_normal((1,)).astype("float32"))
    b.param("high", rng.standard_normal((5,)).astype("float32"))
    b.param("table", rng.standard_normal((5, 5)).astype("float32"))
    b.op("gt", "x", "low", name="above")
    b.op("le", "x", "high", name="below")
    b.op("logical_or", "above", "below", name="either")
    b.op("where", "either", "x", "low", name="first")
    b.op("sum", "first", name="total", axes=-1, keepdims=True)
    b.op("ne", "first", "table", name="differs")
    b.op("where", "differs", "first", "table", name="second")
    b.op("ge", "second", "total", name="larger")
    b.op("where", "larger", "second", "total", name="third")
    return b.build("third")


@pytest.mark.parametrize("target, opt_level", [("llvm", None), ("llvm-persistent", 2), ("llvm-persistent", 4)])
def test_nested_where_builds_and_matches_numpy(target, opt_level):
    """Fused into one expression, three nested selects took TVM's simplifier and LLVM build over
    five minutes (each select's branches are simplified under its condition, which holds the
    next select); fusion now stops at two, like it does for exp/tanh/erf."""
    from codegen.cpu_math import MAX_NESTED_SELECTS, nested_selects

    graph = _nested_where_graph()
    if opt_level is not None:
        program = run_passes(graph, target, stop="vertical", opt_level=opt_level).ir
        assert max(nested_selects(body) for stage in program.stages() for body in stage.op.body) <= MAX_NESTED_SELECTS
    x = np.array([0.3, -1.2, 2.0, -0.1, 0.7], dtype="float32")
    w = graph.weights
    first = np.where((x > w["low"]) | (x <= w["high"]), x, w["low"])
    total = first.sum(-1, keepdims=True)
    second = np.where(first != w["table"], first, w["table"])
    want = np.where(second >= total, second, total)
    got = souffle.compile(graph, target=target, opt_level=opt_level).run({"x": x})[0]
    np.testing.assert_array_equal(got, want)


def test_a_select_on_gathered_values_is_read_as_a_condition_on_data():
    """Fuzz seed 1795441173: at O4 the barrier analysis reads the condition of a ``where`` whose
    operand went through ``take``; an integer cast in it was looked up by a field TVM 0.27 no
    longer has (``dtype``), an AttributeError instead of "not affine"."""
    b = GraphBuilder("select_on_gathered")
    b.input("x", (4, 33, 16))
    b.input("ids", (2,), "int64")
    b.input("y", (18,))
    b.op("pad", "x", name="padded", before=[1, 0, 0], after=[1, 0, 2], value=-1.5)
    b.op("neg", "padded", name="negated")
    b.op("take", "negated", "ids", name="rows")
    b.op("gt", "rows", "y", name="greater")
    b.op("where", "greater", "rows", "y", name="larger")
    graph = b.build("larger")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 33, 16)).astype("float32"), rng.standard_normal(18).astype("float32")
    ids = np.array([5, 0], dtype="int64")
    rows = -np.pad(x, [(1, 1), (0, 0), (0, 2)], constant_values=-1.5).take(ids, axis=0)
    got = souffle.compile(graph, target="llvm-persistent", opt_level=4).run({"x": x, "ids": ids, "y": y})[0]
    np.testing.assert_array_equal(got, np.where(rows > y, rows, y))


@pytest.mark.parametrize("op", ["silu", "where"])
def test_an_expand_of_an_element_wise_result_reads_each_source_row(op):
    """Fuzz seed 1795441933: fused into the expand (llvm-persistent O2), the broadcast read is
    ``x[base + (i & 7)]`` in a loop of 32; LLVM 22's loop vectorizer loaded it as ``x[base + i]``,
    so 3 of every 4 groups of 8 outputs held the wrong rows or memory past the tensor. LLVM's
    loop vectorizer is now off (``codegen.llvm.host_target``)."""
    b = GraphBuilder(f"expand_after_{op}")
    w = np.arange(8, dtype="float32").reshape(1, 8) - 10.0
    b.param("w", w)
    b.input("x", (16, 1, 1, 8))
    if op == "silu":
        b.op("silu", "x", name="y")
    else:
        b.op("where", "x", "w", "x", name="y")
    b.op("expand", "y", name="out", shape=[16, 4, 3, 8])
    graph = b.build("out")
    x = (np.arange(128, dtype="float32") / 10 - 3.0).reshape(16, 1, 1, 8)
    x[3, 0, 0, 2] = 0.0  # a false condition for the where
    y = x / (1 + np.exp(-x)) if op == "silu" else np.where(x != 0, w, x)
    got = souffle.compile(graph, target="llvm-persistent", opt_level=2).run({"x": x})[0]
    np.testing.assert_allclose(got, np.broadcast_to(y, (16, 4, 3, 8)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("target, level", [("llvm", None), ("llvm-persistent", 0), ("llvm-persistent", 4)])
def test_layer_norm_of_a_near_constant_row_matches_float64(target, level):
    """Fuzz seed 1795450603: a row of 65 copies of a float32 sum (3.35...). Its float32 mean is a
    few ulps off the value, so x - mean is ~1e-6 where float64 gives 0, and 1/sqrt(var + eps)
    (316 at eps 1e-5) scaled that to 7e-4 (topi's two-pass form) or 2.6e-4 (plain two-pass);
    the corrected two-pass algorithm takes the mean's rounding back out."""
    import torch

    rng = np.random.default_rng(1795450603)
    gamma, beta = (np.asarray(rng.standard_normal(65) * 0.5, "float32") for _ in range(2))
    b = GraphBuilder("layer_norm_near_constant")
    b.param("gamma", gamma)
    b.param("beta", beta)
    b.input("x", (65,))
    b.op("layer_norm", "x", "gamma", "beta", name="out")
    graph = b.build("out")
    x = np.full(65, np.float32(3.3534682), "float32")
    x[[5, 23, 40]] = np.float32(3.3534677), np.float32(3.353469), np.float32(3.353468)
    want = torch.nn.functional.layer_norm(torch.from_numpy(x).double(), (65,), torch.from_numpy(gamma).double(),
                                          torch.from_numpy(beta).double(), eps=1e-5).numpy()
    kwargs = {} if level is None else {"opt_level": level}
    got = souffle.compile(graph, target=target, **kwargs).run({"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
