"""The cuda-emulated target: the CUDA source nvcc gets, run on the CPU with every GPU thread a fiber.

A checker is tested by the faults it must catch: small hand-written kernels with a dropped
__syncthreads, a dropped grid barrier, a 32-lane read-modify-write of one shared word, a barrier
only some threads reach, and indexes out of bounds; each is run correct first, so that what the
emulator rejects is the fault and nothing else. Then every tiny model through the target, checked
against the PyTorch reference, at opt levels 0 and 4 (the full matrix is marked slow).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import souffle
from souffle import models
from souffle.compiler import run_passes
from souffle.errors import TargetError
from souffle.graph import GraphBuilder
from souffle.runtime.emulated import ORDERS, EmulatedDevice, EmulationError

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")

GRID, THREADS = 2, 64


def _run(source: str, order: str, inputs: list[np.ndarray], outputs: int, grid: int = GRID,
         threads: tuple = (THREADS, 1, 1)) -> list[np.ndarray]:
    """``main_kernel(inputs..., outputs..., grid_size)`` of ``source`` on the emulator; each
    output (float32, ``grid * threads`` elements) starts poisoned."""
    device = EmulatedDevice(grid, order, seed=3)
    kernel = device.load_kernels(source, {}, ("main_kernel",), 0)["main_kernel"]
    size = grid * int(np.prod(threads))
    results = [device.alloc(size * 4) for _ in range(outputs)]
    kernel.launch(grid, threads, [device.upload(x) for x in inputs] + results + [grid])
    return [r.download("float32", (size,)) for r in results]


def _kernel(body: str, params: str = "float* __restrict__ x_ptr, float* __restrict__ y_ptr") -> str:
    return (f'extern "C" __global__ void __launch_bounds__({THREADS}) main_kernel({params}, int grid_size) {{\n'
            f"{body}\n}}\n")


# A block reverses its slice of x through shared memory.
REVERSE = _kernel("""
  __shared__ alignas(64) float tile[64];
  tile[threadIdx.x] = x_ptr[blockIdx.x * 64 + threadIdx.x];
  __syncthreads();
  y_ptr[blockIdx.x * 64 + threadIdx.x] = tile[63 - threadIdx.x];""")

# Every block writes its slice, then reads the other block's, after the grid barrier.
EXCHANGE = '#include <cooperative_groups.h>\n' + _kernel("""
  int i = blockIdx.x * 64 + threadIdx.x;
  x_ptr[i] = x_ptr[i] * 2.0f;
  cooperative_groups::this_grid().sync();
  y_ptr[i] = x_ptr[(i + 64) % (64 * grid_size)];""")

# Warp 0 sums 32 values with shuffles, lane 0 writes the sum for the block.
WARP_SUM = _kernel("""
  __shared__ float total[1];
  float v = x_ptr[blockIdx.x * 64 + threadIdx.x];
  unsigned mask = __activemask();
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(mask, v, offset, 32);
  if (threadIdx.x == 0) total[0] = v;
  __syncthreads();
  y_ptr[blockIdx.x * 64 + threadIdx.x] = total[0];""")

# A sum of 32 lanes into one shared word, initialised by lane 0: the defect of issue 15.
SHARED_SUM = _kernel("""
  __shared__ float total[1];
  if (threadIdx.x == 0) total[0] = 0.0f;
  __syncthreads();
  if (threadIdx.x < 32) total[0] = total[0] + x_ptr[blockIdx.x * 64 + threadIdx.x];
  __syncthreads();
  y_ptr[blockIdx.x * 64 + threadIdx.x] = total[0];""")


# REVERSE through cp.async, in the inline PTX TVM's CUDA code generator prints for it
# (codegen.tensor_core's asynchronous pipeline): copy, commit, wait, __syncthreads, read.
def _cp_async(bytes_: int, cache: str) -> str:
    """TVM's helper for a cp.async of ``bytes_`` bytes (``cache``: ca, or cg for 16), offsets in floats."""
    return f"""
__forceinline__ __device__ void ptx_cp_async_{bytes_}(void* dst, int dst_off, void* src, int src_off) {{
  uint8_t* dst_p = (uint8_t*)dst + dst_off * 4;
  uint8_t* src_p = (uint8_t*)src + src_off * 4;
  unsigned int dst_addr = __cvta_generic_to_shared(dst_p);
  asm volatile("cp.async.{cache}.shared.global [%0], [%1], %2;"
    :: "r"(dst_addr), "l"(src_p), "n"({bytes_}));
}}"""


CP_ASYNC_HELPERS = _cp_async(4, "ca") + """
__forceinline__ __device__ void commit() {
  asm volatile("cp.async.commit_group;" :  : );
}
__forceinline__ __device__ void wait_all() {
  asm volatile("cp.async.wait_group 0;" :  :  : "memory");
}
"""
ASYNC_REVERSE = CP_ASYNC_HELPERS + _kernel("""
  __shared__ alignas(64) float tile[64];
  ptx_cp_async_4(tile, threadIdx.x, x_ptr, blockIdx.x * 64 + threadIdx.x);
  commit();
  wait_all();
  __syncthreads();
  y_ptr[blockIdx.x * 64 + threadIdx.x] = tile[63 - threadIdx.x];""")


def _x(grid: int = GRID) -> np.ndarray:
    return np.arange(grid * THREADS, dtype=np.float32) + 1


@pytest.mark.parametrize("order", ORDERS)
def test_correct_kernels_run_right_in_every_order(order):
    x = _x()
    (y,) = _run(REVERSE, order, [x], 1)
    np.testing.assert_array_equal(y, x.reshape(GRID, THREADS)[:, ::-1].reshape(-1))
    (y,) = _run(EXCHANGE, order, [x], 1)
    np.testing.assert_array_equal(y, np.roll(2 * x, -THREADS))
    (y,) = _run(WARP_SUM, order, [x], 1)
    np.testing.assert_array_equal(y, np.repeat(x.reshape(GRID, THREADS)[:, :32].sum(axis=1), THREADS))


def test_shuffles_up_xor_idx_and_votes():
    source = _kernel("""
      float v = x_ptr[blockIdx.x * 64 + threadIdx.x];
      float up = __shfl_up_sync(0xffffffff, v, 1, 32);
      float across = __shfl_xor_sync(0xffffffff, v, 1, 32);
      float first = __shfl_sync(0xffffffff, v, 0, 32);
      unsigned odd = __ballot_sync(0xffffffff, threadIdx.x % 2);
      y_ptr[blockIdx.x * 64 + threadIdx.x] = up + 10.0f * across + 100.0f * first + (odd == 0xaaaaaaaau ? 1000.0f : 0.0f);""")
    x = _x()
    (y,) = _run(source, "descending", [x], 1)
    lanes = x.reshape(-1, 32)
    up = np.concatenate([lanes[:, :1], lanes[:, :-1]], axis=1)
    across = lanes.reshape(-1, 16, 2)[:, :, ::-1].reshape(-1, 32)
    expected = up + 10 * across + 100 * lanes[:, :1] + 1000
    np.testing.assert_array_equal(y, expected.reshape(-1))


def test_dropped_syncthreads_is_a_race():
    with pytest.raises(EmulationError, match=r"kernel main_kernel: data race on shared memory .*block 0 thread .* "
                                             r"no __syncthreads between them"):
        _run(REVERSE.replace("__syncthreads();", ""), "ascending", [_x()], 1)


@pytest.mark.parametrize("order", ORDERS)
def test_cp_async_lands_by_the_wait_that_retires_it(order):
    (y,) = _run(ASYNC_REVERSE, order, [_x()], 1)
    np.testing.assert_array_equal(y, _x().reshape(GRID, 64)[:, ::-1].reshape(-1))


def test_cp_async_without_its_wait_is_caught():
    """The emulator holds each copy until a wait retires it (the latest a GPU may land it): with
    no wait it never lands, and the thread returns with it pending."""
    with pytest.raises(EmulationError, match=r"block \d thread \(\d+,0,0\) returns with 1 cp.async copies never "
                                             r"waited on"):
        _run(ASYNC_REVERSE.replace("  wait_all();\n  __syncthreads", "  __syncthreads"), "ascending", [_x()], 1)


def test_cp_async_read_before_its_wait_reads_what_was_there():
    """A thread reading its own copy's destination before the wait gets the poison shared memory
    starts with, not the copy."""
    source = ASYNC_REVERSE.replace("  commit();\n  wait_all();\n  __syncthreads();\n  y_ptr[blockIdx.x * 64 + threadIdx.x] = tile[63 - threadIdx.x];",
                                   "  commit();\n  y_ptr[blockIdx.x * 64 + threadIdx.x] = tile[threadIdx.x];\n  wait_all();")
    assert source != ASYNC_REVERSE
    (y,) = _run(source, "ascending", [_x()], 1)
    assert np.isnan(y).all()


def test_cp_async_waited_on_but_not_synchronized_is_a_race():
    """The copy is the issuing thread's write, when the wait lands it: another thread's read of
    it needs a __syncthreads after that wait."""
    with pytest.raises(EmulationError, match=r"data race on shared memory .* no __syncthreads between them"):
        _run(ASYNC_REVERSE.replace("  wait_all();\n  __syncthreads();", "  wait_all();"), "descending", [_x()], 1)


def test_a_cp_async_the_emulator_does_not_model_is_refused():
    source = ASYNC_REVERSE.replace('"cp.async.ca.shared.global [%0], [%1], %2;"',
                                   '"cp.async.ca.shared.global [%0], [%1], %2, %3;"')
    with pytest.raises(TargetError, match=r"does not model this cp.async \(line \d+\)"):
        _run(source, "ascending", [_x()], 1)


# REVERSE in 16-byte copies (cp.async.cg, what codegen.tensor_core's copies of 16-bit operands are):
# 16 threads each copy four floats, from ``SHIFT`` floats into the tile
ASYNC_REVERSE_16 = _cp_async(16, "cg") + CP_ASYNC_HELPERS + _kernel("""
  __shared__ alignas(64) float tile[72];
  if (threadIdx.x < 16) ptx_cp_async_16(tile, 4 * threadIdx.x + SHIFT, x_ptr, blockIdx.x * 64 + 4 * threadIdx.x);
  commit();
  wait_all();
  __syncthreads();
  y_ptr[blockIdx.x * 64 + threadIdx.x] = tile[63 + SHIFT - threadIdx.x];""")


def test_a_16_byte_cp_async_lands_whole():
    (y,) = _run(ASYNC_REVERSE_16.replace("SHIFT", "4"), "descending", [_x()], 1)
    np.testing.assert_array_equal(y, _x().reshape(GRID, 64)[:, ::-1].reshape(-1))


def test_a_cp_async_to_an_address_not_on_its_bytes_is_caught():
    """A GPU raises a misaligned address where a cp.async's addresses are not on a multiple of its
    bytes: two floats into the tile, 8 bytes, is not on 16."""
    with pytest.raises(EmulationError, match=r"block \d thread \(0,0,0\): a cp.async of 16 bytes to 0x[0-9a-f]+, "
                                             r"8 bytes past a multiple of 16: a misaligned address"):
        _run(ASYNC_REVERSE_16.replace("SHIFT", "2"), "ascending", [_x()], 1)


def test_dropped_grid_barrier_is_a_race():
    with pytest.raises(EmulationError, match=r"data race on x byte 256: block 0 thread \(0,0,0\) read it and block 1 thread \(0,0,0\) writes it with no grid barrier"):
        _run(EXCHANGE.replace("cooperative_groups::this_grid().sync();", ""), "ascending", [_x()], 1)


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_32_lanes_adding_into_one_shared_word_is_a_race(order):
    with pytest.raises(EmulationError, match=r"data race on shared memory byte 0: block \d thread \(\d+,0,0\) wrote it"):
        _run(SHARED_SUM, order, [_x()], 1)


def test_a_loop_bound_to_fewer_threads_than_its_iterations_leaves_poison():
    """Issue 15's shared epilogue: a tile of 128 elements walked by 64 threads once, not twice;
    the elements no thread writes keep the poison the emulator starts every buffer with."""
    source = _kernel("""
      for (int i = 0; i < 1; ++i) {
        y_ptr[blockIdx.x * 128 + i * 64 + threadIdx.x] = x_ptr[blockIdx.x * 128 + i * 64 + threadIdx.x];
      }""")
    device = EmulatedDevice(GRID, "descending")
    kernel = device.load_kernels(source, {}, ("main_kernel",), 0)["main_kernel"]
    y = device.alloc(GRID * 128 * 4)
    kernel.launch(GRID, (THREADS, 1, 1), [device.upload(np.ones(GRID * 128, np.float32)), y, GRID])
    tiles = y.download("float32", (GRID, 128))
    np.testing.assert_array_equal(tiles[:, :64], 1.0)
    assert np.isnan(tiles[:, 64:]).all()


def test_barrier_only_some_threads_reach_is_reported_not_hung():
    source = _kernel("""
      if (threadIdx.x < 16) __syncthreads();
      y_ptr[blockIdx.x * 64 + threadIdx.x] = x_ptr[blockIdx.x * 64 + threadIdx.x];""")
    with pytest.raises(EmulationError, match=r"kernel main_kernel: block 0: threads 0-15 wait at __syncthreads "
                                             r"\(line \d+\) that threads 16-63, which have returned, never reach"):
        _run(source, "ascending", [_x()], 1)


def test_shuffle_some_lanes_never_reach_is_a_deadlock():
    source = _kernel("""
      float v = x_ptr[blockIdx.x * 64 + threadIdx.x];
      if (threadIdx.x < 8) v = __shfl_down_sync(0xffffffff, v, 1, 32);
      else __syncthreads();
      y_ptr[blockIdx.x * 64 + threadIdx.x] = v;""")
    with pytest.raises(EmulationError, match=r"deadlock.* block 0: threads 0-7 wait at __shfl_down_sync .*"
                                             r"threads 8-63 wait at __syncthreads"):
        _run(source, "ascending", [_x()], 1)


def test_register_array_out_of_bounds():
    source = _kernel("""
      float local[8];
      for (int i = 0; i < 8; ++i) local[i] = x_ptr[i];
      y_ptr[blockIdx.x * 64 + threadIdx.x] = local[blockIdx.x * 8 + threadIdx.x % 8];""")
    with pytest.raises(EmulationError, match=r"block 1 thread \(0,0,0\) indexes 'float \[8\]' with 8, out of bounds \(line 5\)"):
        _run(source, "ascending", [_x()], 1)


def test_read_past_a_buffer():
    source = _kernel("y_ptr[blockIdx.x * 64 + threadIdx.x] = x_ptr[blockIdx.x * 64 + threadIdx.x + 1];")
    with pytest.raises(EmulationError, match=r"block 1 thread \(63,0,0\) reads 4 bytes .* outside every buffer"):
        _run(source, "ascending", [_x()], 1)


def test_compile_error_shows_the_compiler_error():
    with pytest.raises(TargetError, match=r"emulated build of the CUDA source failed.*\n.*error.*undeclared_name"):
        _run(_kernel("y_ptr[0] = undeclared_name;"), "ascending", [_x()], 1)


def test_missing_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(TargetError, match="needs a host C\\+\\+ compiler"):
        _run(REVERSE, "ascending", [_x()], 1)


def _check(name: str, level: int, orders, more_blocks: tuple[int, ...] = (0,)) -> None:
    """``name`` at ``level`` in each of ``orders``, on the default grid plus each of ``more_blocks``."""
    graph = models.build(name, config="tiny", seed=0)
    inputs = models.make_inputs(name, config="tiny", seed=0)
    expected = models.reference(name, "tiny", graph.weights)(inputs)
    rtol, atol = models.tolerance(name, "tiny")
    model = souffle.compile(graph, target="cuda-emulated", opt_level=level)
    for grid in [model.emulator.sms + extra for extra in more_blocks]:
        for order in orders:
            outputs = model.schedule(order, grid, seed=5).run(inputs)
            for output, reference in zip(outputs, expected):
                np.testing.assert_allclose(output, reference, rtol=rtol, atol=atol,
                                           err_msg=f"{name} O{level} {order} grid {grid}")


@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("name", list(models.MODELS))
def test_tiny_models(name, level):
    _check(name, level, ("ascending", "descending"))


@pytest.mark.slow
@pytest.mark.parametrize("level", range(5))
@pytest.mark.parametrize("name", list(models.MODELS))
def test_tiny_models_every_order_and_two_grids(name, level):
    _check(name, level, ORDERS, (0, 1))


def test_o4_orders_the_threads_of_a_block_where_data_crosses_them():
    """Issue 15: at O4 MMoE had no __syncthreads at all, yet one lane computes a softmax's
    maximum from what threads 0-7 wrote, and threads 0-7 then read it. Barrier placement puts a
    __syncthreads where data stays in the block but crosses its threads."""
    staged = run_passes(models.build("mmoe", "tiny"), "cuda", stop="plan_arena", opt_level=4).ir
    reasons = [stage.block_barrier for stage in staged.stages() if stage.block_barrier]
    assert any("T_softmax_maxelem" in why and "other threads of the block" in why for why in reasons), reasons
    assert "__syncthreads" in staged.table()
    # Neither barrier where each thread reads only what it wrote itself: the tower's bias and
    # activation read the matmul's results at their own index, in the threads that computed them.
    activation = next(stage for stage in staged.stages() if stage.name.endswith("towers.{0,1}.2.input"))
    assert activation.barrier is None and activation.block_barrier is None


def test_command_line_check_prints_order_and_grid(capsys):
    from souffle.cli import main

    assert main(["compile", "mmoe", "--target", "cuda-emulated", "--opt-level", "4", "--check",
                 "--thread-order", "random", "--order-seed", "7", "--grid", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out
    assert "cuda-emulated (2 blocks, random thread order, seed 7), grid 1" in out  # tiny MMoE's stages: one tile


def test_emulation_options_need_the_emulated_target(capsys):
    from souffle.cli import main

    assert main(["compile", "mmoe", "--target", "llvm", "--thread-order", "descending"]) == 2
    assert "need --target cuda-emulated" in capsys.readouterr().err


@pytest.mark.parametrize("keepdims", [True, False])
def test_one_result_of_a_warp_reduction_is_stored_by_one_warp(keepdims):
    """Found by the emulator (fuzz seed 1003): the mean of a whole tensor, one result reduced by
    warp 0, was divided and stored by lane 0 of every warp, seven of eight storing the zero they
    reduced: its epilogue, bound to constant indexes, had no guard."""
    from souffle.graph import GraphBuilder

    builder = GraphBuilder("mean_of_all")
    x = builder.input("x", (5, 16))
    graph = builder.build(builder.op("mean", x, keepdims=keepdims))
    inputs = {"x": np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)}
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    for order in ("ascending", "descending"):
        (mean,) = model.schedule(order).run(inputs)
        np.testing.assert_allclose(mean, inputs["x"].mean(keepdims=keepdims), rtol=1e-5)


@pytest.mark.parametrize("shape", [(2, 32, 3), (4, 8, 6)], ids=str)
def test_a_single_tile_s_reduction_is_reduced_across_its_lanes(shape):
    """Found by the fuzzer (seed 1795869453): the sum of all of a (2, 32, 3) tensor, kept as
    (1, 1, 1) and split, is one tile whose stage is simplified; simplified first, its fused
    reduce loops' bindings were no longer what TVM's cross-thread lowering recognizes, so each
    lane kept its own sum and every lane stored it (the validator refused the kernel). The
    lanes' reduction is lowered before the simplification."""
    from souffle.graph import GraphBuilder

    builder = GraphBuilder("sum_of_all")
    x = builder.input("x", shape)
    graph = builder.build(builder.op("split", builder.op("sum", x, keepdims=True), sections=1, axis=-2))
    inputs = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    assert model.source.count("= __shfl_sync(") == 1  # the warp all-reduce's broadcast of its result
    for order in ("ascending", "descending"):
        (total,) = model.schedule(order).run(inputs)
        np.testing.assert_allclose(total, inputs["x"].sum(keepdims=True), rtol=1e-5, atol=1e-5)


def test_warps_past_the_last_result_write_nothing_back():
    """Found by the emulator (fuzz seed 1035): a layer norm of 4 rows, its statistics reduced by
    a tile of 8 warps: TVM's cross-thread lowering wrote every warp's result back unguarded, so
    warps 4-7 stored past the end of the 4 results in shared memory."""
    from souffle.graph import GraphBuilder

    rng = np.random.default_rng(0)
    builder = GraphBuilder("layer_norm_4_rows")
    x = builder.input("x", (4, 64))
    weight = builder.param("weight", rng.standard_normal(64).astype(np.float32))
    bias = builder.param("bias", rng.standard_normal(64).astype(np.float32))
    graph = builder.build(builder.op("layer_norm", builder.op("gelu", x), weight, bias, eps=1e-3))
    inputs = {"x": rng.standard_normal((4, 64)).astype(np.float32)}
    import torch

    gelu = torch.nn.functional.gelu(torch.from_numpy(inputs["x"]))
    expected = torch.nn.functional.layer_norm(gelu, (64,), torch.tensor(graph.weights["weight"]),
                                              torch.tensor(graph.weights["bias"]), eps=1e-3).numpy()
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    for order in ("ascending", "descending"):
        (y,) = model.schedule(order).run(inputs)
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


def test_a_batched_product_read_with_a_leading_unit_axis_runs_its_epilogue_in_registers():
    """An exported attention scales (1, heads, S, S) scores that its batched product computed as
    (heads, S, S) (Hugging Face's BERT through torch.export or ONNX): the scale reads each result
    at its own index once the unit axis is dropped, so it runs in the thread holding the result,
    as the hand-built BERT's does, instead of as a stage of its own."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("scores")
    q, k = b.input("q", (2, 8, 16)), b.input("k", (2, 8, 16))
    scores = b.op("reshape", b.op("batch_matmul", q, k, transpose_b=True), shape=(1, 2, 8, 8))
    graph = b.build(b.op("softmax", b.op("scale", scores, factor=0.25), axis=-1))
    staged = run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir
    assert any(stage.name.endswith("+scale_3") and stage.epilogue == "register" for stage in staged.stages()), \
        staged.table()
    inputs = {name: rng.standard_normal((2, 8, 16)).astype("float32") for name in ("q", "k")}
    logits = 0.25 * np.einsum("hik,hjk->hij", inputs["q"], inputs["k"])[None]
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    for order in ("ascending", "descending"):
        np.testing.assert_allclose(model.schedule(order, None, seed=5).run(inputs)[0], expected, rtol=1e-5, atol=1e-6)
