"""The CPU scheduler's rules: each representative block computes the right numbers, and the
intended structure (register tile, parallel and vector loops, layouts, inlining) is applied."""

import numpy as np
import pytest
import tvm
from tvm import te, topi

from analysis.device import local_cpu
from codegen.cpu_math import register_llvm_math
from codegen.llvm import host_target, use_every_core
from codegen.schedule_cpu import schedule_cpu
from souffle.ops.packed import conv2d_packed, dense_packed, pack_rows

use_every_core()
register_llvm_math()


def _build(tensors, n_inputs, arrays):
    """Schedule and compile ``te.create_prim_func(tensors)``; run it on ``arrays``.
    Returns (the scheduled TVMScript text, the outputs)."""
    scheduled = schedule_cpu(te.create_prim_func(tensors), local_cpu())
    lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=host_target())
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    outs = [tvm.runtime.empty([int(d) for d in t.shape], "float32", dev) for t in tensors[n_inputs:]]
    lib(*args, *outs)
    return scheduled.script(), [o.numpy() for o in outs]


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype("float32")


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_packed_dense_is_register_tiled_with_bias_in_the_write_back():
    rng = np.random.default_rng(0)
    x, w, b = _rand(rng, 96, 64), _rand(rng, 48, 64), _rand(rng, 48)
    X, W, B = te.placeholder(x.shape, name="x"), te.placeholder((3, 64, 16), name="wp"), te.placeholder((48,), name="b")
    text, (y,) = _build([X, W, B, dense_packed([X, W, B])], 3, [x, pack_rows(w, 16), b])
    _close(y, x @ w.T + b)
    assert "T.parallel(" in text
    assert "T.vectorized(16)" in text  # two AVX2 registers per tile row
    assert "T.unroll(6)" in text  # six rows: 12 accumulators
    assert "dense_packed_local_global = T.sblock_alloc_buffer((96, 48))" in text  # the accumulator tile, on the stack
    assert 'T.sblock("dense_packed_bias")' not in text  # the bias add is folded into the tile's write-back


def test_gemv_unrolls_more_of_the_vector_axis_and_stays_serial_when_small():
    rng = np.random.default_rng(1)
    x, w = _rand(rng, 1, 32), _rand(rng, 256, 32)
    X, W = te.placeholder(x.shape, name="x"), te.placeholder((16, 32, 16), name="wp")
    text, (y,) = _build([X, W, dense_packed([X, W])], 2, [x, pack_rows(w, 16)])
    _close(y, x @ w.T)
    assert "T.unroll(4)" in text and "T.vectorized(16)" in text
    assert "T.parallel(" not in text  # 8K multiply-adds: waking a thread costs more


def test_unpacked_dense_vectorizes_the_contiguous_reduction_with_rfactor():
    rng = np.random.default_rng(2)
    x, w = _rand(rng, 8, 96), _rand(rng, 10, 96)
    X, W = te.placeholder(x.shape, name="x"), te.placeholder(w.shape, name="w")
    text, (y,) = _build([X, W, topi.nn.dense(X, W)], 2, [x, w])
    _close(y, x @ w.T)
    assert "_rf" in text and "T.vectorized(8)" in text


def test_batch_matmul_nt_on_a_parameter_copies_it_transposed():
    rng = np.random.default_rng(3)
    a, b = _rand(rng, 2, 48, 16), _rand(rng, 2, 64, 16)
    A, B = te.placeholder(a.shape, name="a"), te.placeholder(b.shape, name="b")
    text, (y,) = _build([A, B, topi.nn.batch_matmul(A, B, transpose_b=True)], 2, [a, b])
    _close(y, a @ b.transpose(0, 2, 1))
    assert "b_global = T.sblock_alloc_buffer((2, 16, 64))" in text  # k-major copy of b
    assert "T.vectorized(16)" in text


def test_batch_matmul_nt_on_an_intermediate_lays_out_its_producer():
    rng = np.random.default_rng(4)
    a, k = _rand(rng, 2, 48, 16), _rand(rng, 64, 2, 16)
    A, K = te.placeholder(a.shape, name="a"), te.placeholder(k.shape, name="k")
    heads_first = topi.transpose(K * 2.0, (1, 0, 2))  # like BERT's key projection
    text, (y,) = _build([A, K, topi.nn.batch_matmul(A, heads_first, transpose_b=True)], 2, [a, k])
    _close(y, a @ (2 * k).transpose(1, 2, 0))
    copies = [line for line in text.splitlines() if "_global = T.sblock_alloc_buffer" in line and "_local_global" not in line]
    assert copies == []  # no extra copy: the producer writes the k-major layout
    assert "T.vectorized(16)" in text


def test_batch_matmul_nn_tiles_the_output_columns():
    rng = np.random.default_rng(5)
    a, b = _rand(rng, 3, 24, 40), _rand(rng, 3, 40, 32)
    A, B = te.placeholder(a.shape, name="a"), te.placeholder(b.shape, name="b")
    text, (y,) = _build([A, B, topi.nn.batch_matmul(A, B, transpose_b=False)], 2, [a, b])
    _close(y, a @ b)
    assert "T.vectorized(16)" in text and "T.unroll(6)" in text


def _conv_reference(x, w, stride, padding, groups):
    import torch

    return torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), stride=stride,
                                      padding=padding, groups=groups).numpy()


@pytest.mark.parametrize(
    "channels, out_channels, size, kernel, stride, groups",
    [(16, 16, 16, 3, 1, 4), (32, 32, 14, 3, 2, 4), (16, 32, 7, 1, 1, 1), (3, 16, 19, 7, 2, 1)],
    ids=["grouped", "grouped-strided", "pointwise-7px", "stem-7x7"],
)
def test_packed_conv2d(channels, out_channels, size, kernel, stride, groups):
    rng = np.random.default_rng(6)
    x = _rand(rng, 1, channels, size, size)
    w = _rand(rng, out_channels, channels // groups, kernel, kernel)
    block = 16 if out_channels % 16 == 0 else 8
    X = te.placeholder(x.shape, name="x")
    W = te.placeholder(pack_rows(w, block).shape, name="wp")
    y_te = conv2d_packed([X, W], stride=stride, padding=kernel // 2, dilation=1, groups=groups)
    text, (y,) = _build([X, W, y_te], 2, [x, pack_rows(w, block)])
    _close(y, _conv_reference(x, w, stride, kernel // 2, groups))
    assert "T.vectorized(" in text
    if kernel > 1:  # padding is materialized, never a conditional inside the multiply-add loop
        update = text[text.index('T.sblock("conv2d_packed_update")'):]
        assert "if_then_else" not in update.split("T.sblock(")[1]


def test_softmax_row_reductions_are_vectorized_and_exp_is_computed_once():
    rng = np.random.default_rng(7)
    x = _rand(rng, 4, 6, 64)
    X = te.placeholder(x.shape, name="x")
    text, (y,) = _build([X, topi.nn.softmax(X, axis=2)], 1, [x])
    e = np.exp(x - x.max(axis=2, keepdims=True))
    _close(y, e / e.sum(axis=2, keepdims=True))
    assert text.count("_rf") >= 2  # max and sum as vector partial results
    assert text.count("T.exp(") == 1  # materialized once, not inlined into the sum and the division


def test_gelu_is_not_inlined_into_the_next_gemm():
    rng = np.random.default_rng(8)
    x, w = _rand(rng, 12, 32), _rand(rng, 32, 32)
    X, W = te.placeholder(x.shape, name="x"), te.placeholder((2, 32, 16), name="wp")
    act = te.compute(X.shape, lambda i, j: X[i, j] * (1.0 + te.erf(X[i, j] * 0.7071067811865476)) * 0.5, name="gelu")
    text, (y,) = _build([X, W, dense_packed([act, W])], 2, [x, pack_rows(w, 16)])
    from math import erf

    g = x * (1 + np.vectorize(erf)(x / np.sqrt(2))).astype("float32") / 2
    _close(y, g @ w.T)
    update = text[text.index('T.sblock("dense_packed_update")'):].split("T.sblock(")[1]
    assert "erf" not in update


def test_injective_chain_is_one_parallel_vectorized_loop():
    rng = np.random.default_rng(9)
    x, b = _rand(rng, 64, 8, 32), _rand(rng, 32)
    X, B = te.placeholder(x.shape, name="x"), te.placeholder(b.shape, name="b")
    y_te = topi.transpose(topi.nn.relu(topi.add(X, B)), (1, 0, 2))
    text, (y,) = _build([X, B, y_te], 2, [x, b])
    _close(y, np.maximum(x + b, 0).transpose(1, 0, 2))
    blocks = [line for line in text.splitlines() if line.strip().startswith("with T.sblock(")]
    assert len(blocks) == 1  # add and relu inlined into the transpose
    assert "T.parallel(" in text and "T.vectorized(8)" in text


@pytest.mark.parametrize("extent", [1000, 7])
def test_reductions_with_awkward_extents(extent):
    rng = np.random.default_rng(10)
    x = _rand(rng, 16, extent)
    X = te.placeholder(x.shape, name="x")
    k = te.reduce_axis((0, extent), name="k")
    text, (y,) = _build([X, te.compute((16,), lambda i: te.sum(X[i, k] * X[i, k], axis=k), name="sq")], 1, [x])
    _close(y, (x.astype(np.float64) ** 2).sum(axis=1))


def test_dense_with_1000_outputs_packs_by_8():
    rng = np.random.default_rng(11)
    x, w = _rand(rng, 2, 64), _rand(rng, 1000, 64)
    X, W = te.placeholder(x.shape, name="x"), te.placeholder((125, 64, 8), name="wp")
    text, (y,) = _build([X, W, dense_packed([X, W])], 2, [x, pack_rows(w, 8)])
    _close(y, x @ w.T)
    assert "T.vectorized(8)" in text
