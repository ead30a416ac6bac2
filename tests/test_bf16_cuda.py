"""bfloat16 on the CUDA side, independent of the front end: a GEMM-shaped stage of bfloat16
operands on tensor cores (codegen/tensor_core.py registers TVM's wmma intrinsics for them), built
by nvcc for sm_80 and sm_90 without spills and run alone on emulated threads against ml_dtypes;
the emulator's cuda_bf16.h rounding as the GPU rounds; and the bfloat16 code TVM emits
(arithmetic, math functions, casts, reductions) on emulated threads against ml_dtypes, where
TVM's bfloat16 reduction across lanes, a race the emulator refuses, is never scheduled."""

from __future__ import annotations

import dataclasses
import shutil

import ml_dtypes
import numpy as np
import pytest
from tvm import s_tir, te, tirx, topi

from codegen.cuda import cuda_source
from codegen import schedule as schedule_module
from codegen.schedule import WARP, schedule_stage, tensor_core_stages
from codegen.tensor_core import TILES, wmma_intrinsics
from souffle.runtime.cuda import compile_cubin
from souffle.runtime.emulated import EmulatedDevice, EmulationError, kernel_signature

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

BF16 = ml_dtypes.bfloat16
# A (M x K) times W (N x K) transposed, on 8 warps a tile: four 128 x 128 tiles (padded past the
# rows and columns), four 96 x 128 (padded past the columns), six 64 x 128, nine 64 x 64; on 4
# warps four 128 x 128, four 96 x 96, nine 64 x 64
M, N, K = 192, 192, 128


def _dense(m: int, n: int, k: int, accumulator: str = "float32"):
    """A dense of bfloat16 operands accumulating in ``accumulator``, rounded to bfloat16 on the
    way out (what the precision pass makes of one, as for float16)."""
    a, w = te.placeholder((m, k), "bfloat16", name="A"), te.placeholder((n, k), "bfloat16", name="W")
    product = topi.nn.dense(a, w, out_dtype=accumulator)
    return te.create_prim_func([a, w, te.compute(product.shape, lambda i, j: product[i, j].astype("bfloat16"),
                                                 name="C")])


# Each stage is compiled alone here, outside the kernel's pool of shared memory, where TVM's
# lowering cannot take a software-pipelined stage (its CompactBufferAllocation divides by zero;
# codegen.schedule._compacted): these stages are unpipelined. The pipelined ones, which the kernel runs, are
# checked through the kernel at bfloat16 in tests/test_tensor_core.py (emulated threads, each
# tile) and tests/test_precision.py (paper BERT, no spills).
UNPIPELINED = tuple(dataclasses.replace(tile, pipelined=False) for tile in TILES)


@pytest.fixture(scope="module")
def stages():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schedule_module, "TILES", UNPIPELINED)
        return tensor_core_stages(_dense(M, N, K))


def _emulate(func, schedule, arrays: dict[str, np.ndarray], outputs: dict[str, tuple], order: str) -> dict:
    """``func``'s kernel alone on emulated threads, a block of ``schedule.threads`` per tile; each
    output (name -> (shape, dtype)) starts poisoned."""
    source = cuda_source(func, "sm_80")
    device = EmulatedDevice(schedule.n_tiles, order, seed=5)
    kernel = device.load_kernels(source, {}, ("main_kernel",), schedule.shared_bytes)["main_kernel"]
    buffers = {name: device.upload(array) for name, array in arrays.items()}
    buffers |= {name: device.alloc(int(np.prod(shape)) * np.dtype(dtype).itemsize)
                for name, (shape, dtype) in outputs.items()}
    args = [buffers[name.removesuffix("_ptr")] for _, name in kernel_signature(source)]
    kernel.launch(schedule.n_tiles, (WARP, schedule.threads // WARP), args, shared_bytes=schedule.shared_bytes)
    return {name: buffers[name].download(dtype, shape) for name, (shape, dtype) in outputs.items()}


def test_a_bfloat16_dense_is_scheduled_on_tensor_cores_with_bfloat16_fragments(stages):
    assert [s.box for _, s in stages] == [(128, 128), (96, 128), (64, 128), (64, 64), (128, 128), (96, 96), (64, 64)]
    assert [s.tensor_core_tile for _, s in stages] == list(UNPIPELINED)
    for name in wmma_intrinsics("bfloat16").values():
        assert s_tir.TensorIntrin.get(name, allow_missing=True) is not None, name
    for func, schedule in stages:
        assert schedule.template == "tensor_core" and schedule.n_tiles == -(-M // schedule.box[0]) * -(-N // schedule.box[1])
        text = func.script()
        for intrinsic in ("tvm_fill_fragment", "tvm_load_matrix_sync", "tvm_mma_sync", "tvm_store_matrix_sync"):
            assert f"T.{intrinsic}(" in text, intrinsic
        assert '"bfloat16", scope="wmma.matrix_a"' in text and '"bfloat16", scope="wmma.matrix_b"' in text
    # the slices are of 2-byte elements as float16's: the 64 x 64 tile's shared memory is the same,
    # its float32 accumulators (64 x 64 x 4 bytes) in the slices' bytes
    assert stages[-1][1].shared_bytes == (64 * 72 + 63 * 72 + 64) * 2 > 64 * 64 * 4


def test_bfloat16_accumulators_are_not_tensor_core_stages():
    assert tensor_core_stages(_dense(M, N, K, accumulator="bfloat16")) == []


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_bfloat16_tensor_core_stages_build_without_spills(stages, arch):
    for func, _ in stages:
        source = cuda_source(func, arch)
        assert "nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, nv_bfloat16" in source
        assert "nvcuda::wmma::mma_sync" in source
        _, resources = compile_cubin(source, arch)
        assert (resources.spill_bytes, resources.stack_bytes) == (0, 0), resources


@needs_gxx
@pytest.mark.parametrize("tile", range(len(TILES)))
def test_bfloat16_tensor_core_stages_match_ml_dtypes_on_emulated_threads(stages, tile):
    rng = np.random.default_rng(tile)
    a, w = rng.standard_normal((M, K)).astype(BF16), rng.standard_normal((N, K)).astype(BF16)
    # float32 sums of exact products, rounded once to bfloat16: only the order of the sums differs
    expected = (a.astype(np.float32) @ w.astype(np.float32).T).astype(BF16).astype(np.float32)
    func, schedule = stages[tile]
    for order in ("ascending", "descending"):
        output = _emulate(func, schedule, {"A": a, "W": w}, {"C": ((M, N), BF16)}, order)["C"].astype(np.float32)
        np.testing.assert_allclose(output, expected, rtol=2 ** -7, atol=1e-5, err_msg=order)  # an ulp
        assert np.mean(output == expected) > 0.99, order


# float32 bit patterns -> the bfloat16 CUDA rounds them to (ties to even)
ROUNDINGS = {
    0x3F808000: 0x3F80,  # 1 + 2^-8: a tie, down to the even 1
    0x3F818000: 0x3F82,  # 1 + 3 x 2^-8: a tie, up to the even 1 + 2^-6
    0x3F808001: 0x3F81,  # just above a tie
    0x3F817FFF: 0x3F81,  # just below one
    0xBF808000: 0xBF80,  # negative ties round the magnitude
    0x7F7F7FFF: 0x7F7F,  # just under the largest bfloat16's rounding boundary
    0x7F7F8000: 0x7F80,  # a tie between the largest bfloat16 (odd) and infinity
    0x7F7FFFFF: 0x7F80,  # the largest float
    0x00008000: 0x0000,  # subnormal ties
    0x00018000: 0x0002,
    0x80000000: 0x8000,  # -0
    0x7F800000: 0x7F80,  # inf
    0xFF800000: 0xFF80,  # -inf
}
NANS = (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF)
# int -> bfloat16 rounds once, as __int2bfloat16_rn (ml_dtypes rounds through float32: 2^24 for the third)
INT_ROUNDINGS = {257: 256.0, 259: 260.0, 2 ** 24 + 2 ** 16 + 1: 2 ** 24 + 2 ** 17,
                 -(2 ** 24 + 2 ** 16 + 1): -(2 ** 24 + 2 ** 17), 2 ** 31 - 1: 2.0 ** 31}

CONVERSIONS = """#include <cuda_bf16.h>
extern "C" __global__ void __launch_bounds__(64) main_kernel(float* __restrict__ x_ptr, int* __restrict__ i_ptr,
    nv_bfloat16* __restrict__ y_ptr, nv_bfloat16* __restrict__ cast_ptr, float* __restrict__ back_ptr,
    nv_bfloat16* __restrict__ from_int_ptr) {
  int e = blockIdx.x * 64 + threadIdx.x;
  y_ptr[e] = __float2bfloat16_rn(x_ptr[e]);
  cast_ptr[e] = (nv_bfloat16)x_ptr[e];
  back_ptr[e] = (float)y_ptr[e];
  from_int_ptr[e] = (nv_bfloat16)i_ptr[e];
}
"""


@needs_gxx
def test_the_emulators_bfloat16_rounds_floats_to_nearest_even_as_ml_dtypes_and_ints_once():
    bits = np.array([*ROUNDINGS, *NANS], np.uint32)
    bits = np.concatenate([bits, np.random.default_rng(0).integers(0, 2 ** 32, 256 - bits.size, dtype=np.uint32)])
    x = bits.view(np.float32)
    ints = np.resize(np.array(list(INT_ROUNDINGS), np.int32), x.size)
    device = EmulatedDevice(4, "random", seed=2)
    kernel = device.load_kernels(CONVERSIONS, {}, ("main_kernel",), 0)["main_kernel"]
    outputs = {name: device.alloc(x.size * 4) for name in ("y", "cast", "back", "from_int")}
    kernel.launch(4, (64, 1, 1), [device.upload(x), device.upload(ints), *outputs.values()])
    y, cast = (outputs[name].download(np.uint16, x.shape) for name in ("y", "cast"))
    np.testing.assert_array_equal(cast, y)
    nan = np.isnan(x)
    np.testing.assert_array_equal(y[~nan], x[~nan].astype(BF16).view(np.uint16))
    assert (y[nan] == 0x7FFF).all()  # CUDA's canonical NaN (ml_dtypes keeps the sign: 0x7fc0, 0xffc0)
    assert [int(b) for b in y[:len(ROUNDINGS)]] == list(ROUNDINGS.values())
    back = outputs["back"].download(np.float32, x.shape)
    np.testing.assert_array_equal(back[~nan], y[~nan].view(BF16).astype(np.float32))
    from_int = outputs["from_int"].download(BF16, x.shape).astype(np.float64)
    np.testing.assert_array_equal(from_int, [INT_ROUNDINGS[int(i)] for i in ints])


X, Y = te.placeholder((4096,), "bfloat16", name="x"), te.placeholder((4096,), "bfloat16", name="y")
XF = te.placeholder((4096,), "float32", name="xf")
ZERO = tirx.const(0, "bfloat16")
# (TE body, its inputs, numpy on ml_dtypes' bfloat16 (each operation rounded, as CUDA's), ulps allowed)
ELEMENTWISE = {
    "arithmetic": (lambda i: (X[i] - Y[i]) * X[i] / Y[i] + -X[i], (X, Y), lambda x, y: (x - y) * x / y + -x, 0),
    "exp": (lambda i: te.exp(X[i]), (X,), np.exp, 1),  # expf of glibc and of numpy may differ by a float ulp
    "relu_select": (lambda i: tirx.Select(X[i] > Y[i], te.max(X[i], ZERO), Y[i]), (X, Y),
                    lambda x, y: np.where(x > y, np.maximum(x, BF16(0)), y), 0),
    "casts": (lambda i: (XF[i] + X[i].astype("float32")).astype("bfloat16"), (XF, X),
              lambda xf, x: (xf + x.astype(np.float32)).astype(BF16), 0),
}


@needs_gxx
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_tvm_bfloat16_elementwise_code_matches_ml_dtypes_on_emulated_threads(name):
    body, inputs, reference, ulps = ELEMENTWISE[name]
    rng = np.random.default_rng(1)
    arrays = {t.op.name: (rng.uniform(0.5, 2, 4096) * rng.choice([-1, 1], 4096)).astype(
        BF16 if str(t.dtype) == "bfloat16" else np.float32) for t in inputs}
    out = te.compute((4096,), body, name="T")
    func, schedule = schedule_stage(te.create_prim_func([*inputs, out]), gpu=True)
    output = _emulate(func, schedule, arrays, {"T": ((4096,), BF16)}, "descending")["T"].astype(np.float32)
    expected = reference(*arrays.values()).astype(np.float32)
    np.testing.assert_allclose(output, expected, rtol=ulps * 2 ** -7, atol=0)


def _row_max(accumulator: str, template: str = "warp_reduce"):
    """The max of each row of a bfloat16 (64, 1024) matrix in ``accumulator``: a warp per row
    where the reduction may be split across lanes."""
    m = te.placeholder((64, 1024), "bfloat16", name="m")
    k = te.reduce_axis((0, 1024), "k")
    row_max = te.compute((64,), lambda i: te.max(m[i, k].astype(accumulator), axis=k), name="S")
    func, schedule = schedule_stage(te.create_prim_func([m, row_max]), gpu=True)
    assert schedule.template == template
    return func, schedule


@needs_gxx
def test_a_bfloat16_row_reduced_in_float32_by_warp_shuffles_matches_ml_dtypes_on_emulated_threads():
    values = np.random.default_rng(3).standard_normal((64, 1024)).astype(BF16)
    func, schedule = _row_max("float32")
    assert "__shfl_down_sync" in cuda_source(func, "sm_80")
    output = _emulate(func, schedule, {"m": values}, {"S": ((64,), np.float32)}, "random")["S"]
    np.testing.assert_array_equal(output, values.astype(np.float32).max(axis=1))


@needs_gxx
def test_a_bfloat16_reduction_is_not_split_across_lanes_where_tvm_would_race(monkeypatch):
    """TVM's cross-thread reduction shuffles only the types it counts as float, not bfloat16: a
    bfloat16 one is reduced in shared memory by the warp's first 16 lanes through volatile
    pointers with no __syncwarp, warp-synchronous code that races under the independent thread
    scheduling of sm_70 and later. So each thread reduces its own row (``thread_reduce``), and
    matches; with that guard removed (a mutant), the emulator refuses the race."""
    values = np.random.default_rng(3).standard_normal((64, 1024)).astype(BF16)
    func, schedule = _row_max("bfloat16", template="thread_reduce")
    output = _emulate(func, schedule, {"m": values}, {"S": ((64,), BF16)}, "random")["S"]
    np.testing.assert_array_equal(output, values.max(axis=1))
    monkeypatch.setattr(schedule_module, "lanes_can_reduce", lambda sch, block: True)
    func, schedule = _row_max("bfloat16")
    assert "volatile nv_bfloat16*" in cuda_source(func, "sm_80")
    with pytest.raises(EmulationError, match="data race on shared memory"):
        _emulate(func, schedule, {"m": values}, {"S": ((64,), BF16)}, "random")
