"""Composing chains of data-movement TEs into one index map (analysis.affine)."""

import time

import islpy as isl
import numpy as np
import pytest
import tvm
from tvm import te, tirx, topi
from tvm_ffi import structural_equal

from analysis import affine
from analysis.affine import (
    NotComposable,
    compose,
    find_chains,
    moves_data,
    rebuild,
    rebuild_chain,
)
from analysis.dependence import dependences
from souffle.errors import SouffleError
from souffle.lower import lower_graph
from souffle.models import build
from souffle.ops import lower_op

# LLVM's optimizer would take most of the test time; the values are the same without it.
_UNOPTIMIZED_CPU = {"kind": "llvm", "opt-level": 0}


def _placeholders(outputs) -> list[te.Tensor]:
    """Every placeholder the outputs depend on, each once."""
    found, seen = [], set()

    def visit(t):
        if t.op in seen:
            return
        seen.add(t.op)
        if isinstance(t.op, te.PlaceholderOp):
            found.append(t)
        for producer in getattr(t.op, "input_tensors", []):
            visit(producer)

    for out in outputs:
        visit(out)
    return found


def _evaluate(outputs, rng, arrays=None) -> list[np.ndarray]:
    """Compile one PrimFunc computing ``outputs`` and run it on random (or given) inputs."""
    inputs = _placeholders(outputs)
    arrays = dict(arrays or {})
    for p in inputs:
        shape = tuple(int(d) for d in p.shape)
        if p.op not in arrays:
            arrays[p.op] = (rng.standard_normal(shape) if "float" in str(p.dtype) else rng.integers(0, 2, shape)).astype(str(p.dtype))
    module = tvm.IRModule({"main": te.create_prim_func(inputs + list(outputs))})
    executable = tvm.compile(module, target=_UNOPTIMIZED_CPU)
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(arrays[p.op], dev) for p in inputs]
    args += [tvm.runtime.tensor(np.empty([int(d) for d in t.shape], str(t.dtype)), dev) for t in outputs]
    executable["main"](*args)
    return [a.numpy() for a in args[len(inputs):]]


def _reads(stage: te.Tensor) -> set:
    return {t.op for t in stage.op.input_tensors}


# -- hand-built chains ------------------------------------------------------------------------
def test_reshape_transpose_slice_add_reads_the_source_directly(rng):
    x = te.placeholder((6, 8), "float32", name="x")
    bias = te.placeholder((4,), "float32", name="bias")
    reshaped = lower_op("reshape", [x], {"shape": [6, 2, 4]})[0]
    transposed = lower_op("transpose", [reshaped], {"axes": [1, 0, 2]})[0]
    sliced = lower_op("slice", [transposed], {"begin": [1], "end": [5], "axis": [1]})[0]
    added = lower_op("add", [sliced, bias], {})[0]
    chain = [x, reshaped, transposed, sliced]

    composed = compose(chain)
    expected = isl.Map("{ T_strided_slice_with_axes[a, b, c] -> x[b + 1, 4a + c] : 0 <= a < 2 and 0 <= b < 4 and 0 <= c < 4 }")
    assert composed.map.is_equal(expected)
    assert composed.total and composed.pieces == 1
    a, b, c = composed.axes
    assert structural_equal(list(composed.source_indices), [b + 1, a * 4 + c])
    assert str(composed).startswith("T_strided_slice_with_axes[ax0, ax1, ax2] = x[ax1 + 1, ax0 * 4 + ax2]")

    direct = rebuild(added, chain)
    assert _reads(direct) == {x.op, bias.op}
    original, rebuilt = _evaluate([added, direct], rng)
    assert np.array_equal(original, rebuilt)
    xs = rng.standard_normal((6, 8)).astype("float32")
    bs = rng.standard_normal(4).astype("float32")
    (value,) = _evaluate([direct], rng, {x.op: xs, bias.op: bs})
    assert np.array_equal(value, xs.reshape(6, 2, 4).transpose(1, 0, 2)[:, 1:5] + bs)


def test_split_heads_is_multiply_add():
    seq, heads, dim = 8, 4, 16
    x = te.placeholder((seq, heads * dim), "float32", name="x")
    split = lower_op("reshape", [x], {"shape": [seq, heads, dim]})[0]
    per_head = lower_op("transpose", [split], {"axes": [1, 0, 2]})[0]
    composed = compose([x, split, per_head])
    h, s, d = composed.axes
    assert structural_equal(list(composed.source_indices), [s, h * dim + d])
    i, j, k = (tirx.Var(n, "int32") for n in "ijk")
    assert structural_equal(composed.indices([i, j, k]), [j, i * dim + k])


def test_merge_heads_is_floordiv_floormod():
    seq, heads, dim = 8, 4, 16
    x = te.placeholder((heads, seq, dim), "float32", name="x")
    per_seq = lower_op("transpose", [x], {"axes": [1, 0, 2]})[0]
    merged = lower_op("reshape", [per_seq], {"shape": [seq, heads * dim]})[0]
    composed = compose([x, per_seq, merged])
    s, j = composed.axes
    assert structural_equal(list(composed.source_indices),
                                   [tirx.floordiv(j, dim), s, tirx.floormod(j, dim)])
    assert str(composed).splitlines()[0] == "T_reshape[ax0, ax1] = x[ax1 // 16, ax0, ax1 % 16]"


def test_windowed_merge_heads_of_paper_swin_composes_in_milliseconds(rng):
    """Paper Swin's 64 windows x 4 heads of 49 tokens merged back to 3136 x 128: isl's
    ``as_pw_multi_aff`` ran for minutes on this map; the lexicographic minimum is the map."""
    windows, heads, tokens, dim = 64, 4, 49, 32
    x = te.placeholder((windows * heads, tokens, dim), "float32", name="x")
    split = lower_op("reshape", [x], {"shape": [windows, heads, tokens, dim]})[0]
    per_token = lower_op("transpose", [split], {"axes": [0, 2, 1, 3]})[0]
    merged = lower_op("reshape", [per_token], {"shape": [windows * tokens, heads * dim]})[0]
    start = time.perf_counter()
    composed = compose([x, split, per_token, merged])
    assert time.perf_counter() - start < 5
    t, c = composed.axes
    assert structural_equal(list(composed.source_indices),
                            [t // tokens * heads + c // dim, tirx.floormod(t, tokens), tirx.floormod(c, dim)])
    original, direct = _evaluate([merged, te.compute(merged.shape, lambda *axes: composed.load(axes))], rng)
    assert np.array_equal(original, direct)


def test_a_chain_isl_gives_up_on_is_left_with_the_reason(monkeypatch):
    monkeypatch.setattr(affine, "ISL_OPERATIONS", 1)
    x = te.placeholder((6, 8), "float32", name="x")
    reshaped = lower_op("reshape", [x], {"shape": [2, 3, 8]})[0]
    flipped = lower_op("transpose", [reshaped], {"axes": [1, 0, 2]})[0]
    with pytest.raises(NotComposable, match="composing x -> T_reshape -> T_transpose: isl gave up after 1 operations"):
        compose([x, reshaped, flipped])
    chains = find_chains(dependences(lower_graph(build("bert", config="tiny"))))
    assert chains and all(c.composed is None and "isl gave up" in c.left_because for c in chains)
    assert "left as it is, composing" in str(chains[0])
    monkeypatch.undo()
    assert compose([x, reshaped, flipped]).total  # the bound is lifted afterwards


def test_consumer_reading_through_other_indices_and_reducing(rng):
    """A transposing consumer and a matmul consumer pass their own index expressions through."""
    x = te.placeholder((2, 8, 4), "float32", name="x")
    per_seq = lower_op("transpose", [x], {"axes": [1, 0, 2]})[0]
    merged = lower_op("reshape", [per_seq], {"shape": [8, 8]})[0]
    chain = [x, per_seq, merged]
    flipped = te.compute((8, 8), lambda i, j: merged[j, i] * 2.0, name="flipped")
    w = te.placeholder((8, 3), "float32", name="w")
    k = te.reduce_axis((0, 8), "k")
    product = te.compute((8, 3), lambda i, n: te.sum(merged[i, k] * w[k, n], axis=k), name="product")
    direct_flipped, direct_product = rebuild(flipped, chain), rebuild(product, chain)
    assert _reads(direct_flipped) == {x.op} and _reads(direct_product) == {x.op, w.op}
    outputs = _evaluate([flipped, product, direct_flipped, direct_product], rng)
    assert np.array_equal(outputs[0], outputs[2])
    assert np.array_equal(outputs[1], outputs[3])


def test_pixel_shuffle_and_its_inverse(rng):
    """Axes split, interleaved and merged again: each index keeps one floordiv / floormod per split."""
    channels, r, height, width = 3, 2, 4, 5
    x = te.placeholder((channels * r * r, height, width), "float32", name="x")
    split = lower_op("reshape", [x], {"shape": [channels, r, r, height, width]})[0]
    interleaved = lower_op("transpose", [split], {"axes": [0, 3, 1, 4, 2]})[0]
    shuffled = lower_op("reshape", [interleaved], {"shape": [channels, height * r, width * r]})[0]
    to_space = compose([x, split, interleaved, shuffled])
    c, h, w = to_space.axes
    assert structural_equal(list(to_space.source_indices), [
        c * 4 + tirx.floormod(h, 2) * 2 + tirx.floormod(w, 2), tirx.floordiv(h, 2), tirx.floordiv(w, 2)])

    split_back = lower_op("reshape", [shuffled], {"shape": [channels, height, r, width, r]})[0]
    gathered = lower_op("transpose", [split_back], {"axes": [0, 2, 4, 1, 3]})[0]
    unshuffled = lower_op("reshape", [gathered], {"shape": [channels * r * r, height, width]})[0]
    to_depth = compose([shuffled, split_back, gathered, unshuffled])
    c, h, w = to_depth.axes
    assert structural_equal(list(to_depth.source_indices), [
        tirx.floordiv(c, 4), h * 2 + tirx.floordiv(tirx.floormod(c, 4), 2), w * 2 + tirx.floormod(c, 2)])
    round_trip = compose([x, split, interleaved, shuffled, split_back, gathered, unshuffled])
    assert round_trip.map.is_equal(isl.Map("{ T_reshape[c, h, w] -> x[c, h, w] : 0 <= c < 12 and 0 <= h < 4 and 0 <= w < 5 }"))
    assert structural_equal(list(round_trip.source_indices), list(round_trip.axes))

    values = rng.standard_normal((channels * r * r, height, width)).astype("float32")
    original, direct = _evaluate([shuffled, rebuild_chain([x, split, interleaved, shuffled])], rng, {x.op: values})
    assert np.array_equal(original, direct)


def test_roll_through_a_concat_is_piecewise(rng):
    a = te.placeholder((4, 6), "float32", name="a")
    doubled = lower_op("concat", [a, a], {"axis": 1})[0]
    rolled = lower_op("slice", [doubled], {"begin": [2], "end": [8], "axis": [1]})[0]
    flipped = lower_op("transpose", [rolled], {"axes": [1, 0]})[0]
    chain = [a, doubled, rolled, flipped]
    composed = compose(chain)
    expected = isl.Map("{ T_transpose[i, j] -> a[j, i + 2] : 0 <= i < 4 and 0 <= j < 4; "
                       "T_transpose[i, j] -> a[j, i - 4] : 4 <= i < 6 and 0 <= j < 4 }")
    assert composed.map.is_equal(expected)
    assert composed.total and composed.pieces == 2
    i, j = composed.axes
    assert structural_equal(list(composed.source_indices), [j, tirx.Select(tirx.LE(4, i), i - 4, i + 2)])
    assert moves_data(doubled)

    direct = rebuild_chain(chain)
    assert _reads(direct) == {a.op}
    values = rng.standard_normal((4, 6)).astype("float32")
    original, rebuilt = _evaluate([flipped, direct], rng, {a.op: values})
    assert np.array_equal(original, rebuilt)
    assert np.array_equal(rebuilt, np.roll(values, -2, axis=1).T)


def test_padding_makes_a_partial_map(rng):
    a = te.placeholder((4, 6), "float32", name="a")
    padded = topi.nn.pad(a, [1, 2], [1, 0])
    flipped = lower_op("transpose", [padded], {"axes": [1, 0]})[0]
    chain = [a, padded, flipped]
    composed = compose(chain)
    assert composed.map.is_equal(isl.Map("{ T_transpose[i, j] -> a[j - 1, i - 2] : 2 <= i < 8 and 1 <= j < 5 }"))
    assert not composed.total
    assert composed.domain.is_equal(isl.Set("{ T_transpose[i, j] : 2 <= i < 8 and 1 <= j < 5 }"))
    assert str(composed.defined) == "2 <= ax0 and ax1 <= 4 and 1 <= ax1"
    assert str(composed.condition([tirx.Var("row", "int32"), 3])) == "2 <= row"

    guarded = te.compute(flipped.shape, lambda *axes: tirx.if_then_else(
        composed.condition(axes), composed.load(axes), tirx.const(0, "float32")), name="guarded")
    original, rebuilt = _evaluate([flipped, guarded], rng)
    assert np.array_equal(original, rebuilt)
    with pytest.raises(NotComposable, match="PadInput computes values .*constant"):
        rebuild_chain(chain)


# -- refusals ---------------------------------------------------------------------------------
def test_a_reduction_in_the_chain_is_refused():
    x = te.placeholder((4, 8), "float32", name="x")
    w = te.placeholder((8, 8), "float32", name="w")
    product = topi.nn.matmul(x, w)
    reshaped = lower_op("reshape", [product], {"shape": [32]})[0]
    with pytest.raises(NotComposable, match=r"step 1 \(T_matmul_NN reading x\) is not one-relies-on-one") as error:
        compose([x, product, reshaped])
    assert isinstance(error.value, SouffleError) and isinstance(error.value, ValueError)


def test_a_gather_in_the_chain_is_refused():
    table = te.placeholder((10, 4), "float32", name="table")
    ids = te.placeholder((3,), "int64", name="ids")
    rows = lower_op("embedding", [table, ids], {})[0]
    with pytest.raises(NotComposable, match=r"T_take reading table.*gather"):
        compose([table, rows])


def test_a_computing_te_cannot_be_skipped():
    x = te.placeholder((4, 8), "float32", name="x")
    reshaped = lower_op("reshape", [x], {"shape": [8, 4]})[0]
    activated = te.compute(reshaped.shape, lambda i, j: te.exp(reshaped[i, j]), name="activated")
    flipped = lower_op("transpose", [activated], {"axes": [1, 0]})[0]
    chain = [x, reshaped, activated, flipped]
    assert compose(chain).total  # the map composes; skipping the TEs would drop the exp
    with pytest.raises(NotComposable, match="activated computes values .*tirx.exp.* inline activated"):
        rebuild_chain(chain)


def test_a_broken_chain_is_refused():
    x = te.placeholder((4, 8), "float32", name="x")
    y = te.placeholder((4, 8), "float32", name="y")
    flipped = lower_op("transpose", [y], {"axes": [1, 0]})[0]
    with pytest.raises(NotComposable, match="T_transpose does not read x"):
        compose([x, flipped])
    with pytest.raises(NotComposable, match="a source and at least one TE"):
        compose([x])
    with pytest.raises(NotComposable, match="2 axes, but 1 indices"):
        compose([y, flipped]).indices([0])


# -- BERT -------------------------------------------------------------------------------------
def _shape(t) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def test_bert_data_movement_chains_rebuild_exactly(rng):
    chains = find_chains(dependences(lower_graph(build("bert", config="tiny"))))
    by_names = {c.names: c for c in chains}
    split_heads = [by_names[(f"encoder/dense_{n}", f"encoder/reshape_{n + 1}", f"encoder/transpose_{n + 2}")]
                   for n in (1, 4, 7)]  # query, key, value: dense's [1, S, H*D] view, [S, H, D], [H, S, D]
    for chain in split_heads:
        h, s, d = chain.composed.axes
        assert structural_equal(list(chain.composed.source_indices), [s, h * 16 + d])
    merge_heads = by_names[("encoder/transpose_14", "encoder/reshape_15", "encoder/dense_16.T_reshape")]
    assert merge_heads.source == "encoder/batch_matmul_13"
    s, j = merge_heads.composed.axes
    assert structural_equal(list(merge_heads.composed.source_indices), [tirx.floordiv(j, 16), s, tirx.floormod(j, 16)])
    assert "reads encoder/batch_matmul_13[ax1 // 16, ax0, ax1 % 16]" in str(merge_heads)

    def direct(composed):
        return te.compute(composed.target.shape, lambda *axes: composed.load(axes))

    rebuilt = [direct(c.composed) for c in chains]
    for chain, read_directly in zip(chains, rebuilt):
        assert _reads(read_directly) == {chain.composed.source.op}
    values = _evaluate([c.composed.target for c in chains] + rebuilt, rng)
    assert len(chains) == 22
    for original, direct in zip(values[: len(chains)], values[len(chains):]):
        assert np.array_equal(original, direct)
