"""Compute precision (souffle.precision): float16 and bfloat16 models with float32 accumulation.

The graph conversion is checked structurally (weights, edges, scan bodies, recipes), the op
lowerings by the dtypes of their TEs (a GEMM's float32 accumulator, a widened softmax), and
every tiny model numerically against PyTorch at the same precision (torch.autocast), on the CPU
and through the emulated CUDA kernel. Tolerances: ``models.FP16_TOLERANCE`` (rtol and atol 1e-2;
measured differences 3e-5 to 5e-3) and ``models.BF16_TOLERANCE`` (rtol and atol 5e-2; measured
largest differences 5e-4 (LSTM) to 2.5e-2 (BERT, whose outputs reach 3)); paper EfficientNet at
fp16 has its own (``efficientnet.NARROW_TOLERANCE``: PyTorch's own fp16 is 0.015-0.033 from its fp32).
"""

from __future__ import annotations

import shutil

import ml_dtypes
import numpy as np
import pytest
from tvm import te, tirx

import souffle
from souffle.cli import main
from souffle import models, recipe, tensor
from souffle.errors import SouffleError
from souffle.graph import Graph, GraphBuilder, Scan
from souffle.ops import lower_op
from souffle.ops.packed import pack_rows
from souffle.precision import PRECISIONS, with_precision
from souffle.runtime.emulated import EmulatedDevice, EmulationError

MODELS = ["bert", "lstm", "resnext", "mmoe", "efficientnet", "swin"]
NARROW = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}  # precision -> the numpy type its weights become


def _mlp(weight: np.ndarray | None = None) -> Graph:
    b = GraphBuilder("mlp")
    x = b.input("x", (4, 8))
    ids = b.input("ids", (4,), "int64")
    w = b.param("w", np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32) if weight is None else weight)
    y = b.op("softmax", b.op("gelu", b.op("dense", x, w)))
    return b.build(y, b.op("cast", ids, dtype="float32"))


@pytest.mark.parametrize("precision", NARROW)
def test_narrow_precisions_convert_weights_once_and_keep_the_model_edges_float32(precision):
    graph = _mlp()
    converted, notes = with_precision(graph, precision)
    dtype = PRECISIONS[precision]
    assert converted.params["w"].dtype == dtype
    assert converted.weights["w"].dtype == NARROW[precision]
    np.testing.assert_array_equal(converted.weights["w"], graph.weights["w"].astype(NARROW[precision]))
    assert [s.dtype for s in converted.inputs] == ["float32", "int64"]  # what callers pass is unchanged
    assert [(n, converted.tensors[n].dtype) for n in converted.outputs] == \
        [(n, graph.tensors[n].dtype) for n in graph.outputs]
    entry, *_ = converted.ops
    assert (entry.kind, entry.inputs, entry.attrs) == ("cast", ("x",), {"dtype": dtype})
    exits = converted.ops[-2:]
    assert [(op.kind, op.inputs, op.outputs, op.attrs) for op in exits] == \
        [("cast", (f"{n}.{precision}",), (n,), {"dtype": "float32"}) for n in graph.outputs]
    own_cast = next(op for op in converted.ops if op.inputs == ("ids",))
    assert own_cast.attrs == {"dtype": dtype}  # the model's own cast to float computes in the narrow type
    assert converted.recipe("w") == recipe.cast(["model", "w"], dtype)
    assert recipe.evaluate(converted.recipe("w"), graph.weights).dtype == NARROW[precision]
    assert notes[0] == f"1 float32 weights converted to {dtype} at compile time (rounded to nearest)"


def test_bf16_has_the_range_of_float32():
    """A weight that overflows float16 (see below) is a bfloat16, to 8 bits of significand."""
    large = with_precision(_mlp(np.full((16, 8), 7e4, np.float32)), "bf16")[0]
    assert float(large.weights["w"].reshape(-1)[0]) == 70144.0  # 65536 + 9 * 512


def test_fp32_and_tf32_are_the_graph_itself_and_other_precisions_are_refused_by_name():
    graph = _mlp()
    assert with_precision(graph, "fp32") == (graph, [])
    tf32, notes = with_precision(graph, "tf32")
    assert tf32 is graph and "multiply in TF32" in notes[0] and "the CPU targets compute float32" in notes[0]
    with pytest.raises(SouffleError, match="unknown precision 'half'; available: fp32, tf32, fp16, bf16"):
        souffle.compile(graph, precision="half")


def test_a_weight_that_overflows_float16_is_refused_by_name():
    graph = _mlp(np.full((16, 8), 7e4, np.float32))
    with pytest.raises(SouffleError, match=r"weight 'w' of 'mlp': 128 values overflow float16, whose largest is "
                                           r"65504 \(the first: 70000.0\); compile it at precision fp32"):
        souffle.compile(graph, precision="fp16")


def test_scan_bodies_compute_in_float16():
    graph = models.build("lstm", config="tiny")
    converted, _ = with_precision(graph, "fp16")
    scans = [op for op in converted.ops if isinstance(op, Scan)]
    assert scans
    for scan in scans:
        assert {s.dtype for s in scan.body.tensors.values() if s.dtype.startswith("float")} == {"float16"}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gemms_accumulate_in_float32_and_widened_ops_compute_in_float32(dtype):
    x = te.placeholder((64, 32), dtype, name="x")
    w = te.placeholder((48, 32), dtype, name="w")
    (y,) = lower_op("dense", [x, w], {})
    assert y.dtype == dtype
    accumulation = y.op.input_tensors[0]
    while accumulation.op.input_tensors and accumulation.dtype == dtype:
        accumulation = accumulation.op.input_tensors[0]
    assert accumulation.dtype == "float32" and accumulation.op.reduce_axis  # the sum itself is float32
    product = accumulation.op.body[0].source[0]
    assert isinstance(product, tirx.Mul)
    for factor in (product.a, product.b):  # float32(x[i, k]) * float32(w[j, k])
        assert isinstance(factor, tirx.Cast) and str(factor.ty) == "float32" and str(factor.value.ty) == dtype
    (probabilities,) = lower_op("softmax", [y], {})
    assert probabilities.dtype == dtype
    inner = probabilities.op.input_tensors[0]
    assert inner.dtype == "float32"  # softmax computed in float32, rounded once
    (summed,) = lower_op("add", [y, y], {})
    # no widening where the narrow type is exact enough
    assert summed.dtype == dtype and summed.op.input_tensors[0].same_as(y)


def _accumulation(tensor: te.Tensor) -> te.Tensor:
    """The reduction a GEMM-shaped op's output is computed from (through its bias and rounding)."""
    while not tensor.op.reduce_axis:
        tensor = tensor.op.input_tensors[0]
    return tensor


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_cpus_packed_gemms_accumulate_in_float32_as_the_unpacked_ones_do(dtype, run_op):
    """The llvm target rewrites every dense and conv2d on a weight into its packed form
    (``codegen.cpu_transforms``), so these are the GEMMs a narrow model runs on the CPU. They
    summed float16 products in float16: paper EfficientNet at fp16 was 0.092 from autocast, 4x
    PyTorch's own departure from float32, and each convolution up to 2 ulps off."""
    x = te.placeholder((4, 64), dtype, name="x")
    (y,) = lower_op("dense_packed", [x, te.placeholder((2, 64, 16), dtype), te.placeholder((32,), dtype)], {})
    img = te.placeholder((1, 16, 9, 9), dtype, name="img")
    (z,) = lower_op("conv2d_packed", [img, te.placeholder((2, 16, 3, 3, 8), dtype)], {"padding": 1})
    for out in (y, z):
        assert out.dtype == dtype and _accumulation(out).dtype == "float32"
    rng = np.random.default_rng(0)
    half = lambda shape: rng.standard_normal(shape).astype(np.float16)  # noqa: E731
    x, w, b = half((4, 256)), half((32, 256)), half(32)
    np.testing.assert_array_equal(run_op("dense_packed", [x, pack_rows(w, 16), b]), run_op("dense", [x, w, b]))
    img, k = half((1, 32, 9, 9)), half((16, 32, 3, 3))
    np.testing.assert_array_equal(run_op("conv2d_packed", [img, pack_rows(k, 8)], padding=1),
                                  run_op("conv2d", [img, k], padding=1))


def test_a_deep_models_narrow_tolerance_is_its_own_and_a_dict_config_gets_the_loosest():
    assert models.tolerance("efficientnet", "paper", "fp16") == (1e-2, 4e-2)
    assert models.tolerance("efficientnet", "tiny", "fp16") == models.FP16_TOLERANCE
    assert models.tolerance("efficientnet", "paper", "bf16") == models.BF16_TOLERANCE
    assert models.tolerance("efficientnet", {"image": 64}, "fp16") == (1e-2, 4e-2)
    assert models.tolerance("bert", "paper", "fp16") == models.FP16_TOLERANCE


@pytest.mark.slow
def test_paper_efficientnet_at_fp16_departs_from_float32_as_pytorchs_own_autocast_does():
    """16 MBConv blocks: PyTorch's autocast is 0.0145 from its float32 here (seed 1), above
    FP16_TOLERANCE's atol, and Souffle within twice that (0.0234; 0.065 with float16 accumulation)."""
    graph = models.build("efficientnet", "paper")
    inputs = models.make_inputs("efficientnet", "paper", seed=1)
    (expected,) = models.reference("efficientnet", "paper", graph.weights, "fp16")(inputs)
    (exact,) = models.reference("efficientnet", "paper", graph.weights)(inputs)
    (output,) = souffle.compile(graph, target="llvm", precision="fp16").run(inputs)
    rtol, atol = models.tolerance("efficientnet", "paper", "fp16")
    np.testing.assert_allclose(output, expected, rtol=rtol, atol=atol)
    assert np.abs(output - exact).max() < 2 * np.abs(expected - exact).max()


# Swin at bf16 (20 s) runs with -m slow: Swin at fp16 and the other models at bf16 are checked by
# default, and the suite is at its 20-minute budget (a fresh clone took 18:28).
@pytest.mark.parametrize("name, precision", [
    *((name, precision) for precision in ("fp16", "bf16") for name in MODELS if (name, precision) != ("swin", "bf16")),
    pytest.param("swin", "bf16", marks=pytest.mark.slow)])
def test_tiny_models_match_pytorch_at_narrow_precisions_on_the_cpu(name, precision):
    graph = models.build(name, config="tiny")
    inputs = models.make_inputs(name, config="tiny", seed=1)
    expected = models.reference(name, "tiny", graph.weights, precision)(inputs)
    exact = models.reference(name, "tiny", graph.weights)(inputs)
    rtol, atol = models.tolerance(name, "tiny", precision)
    for target in ("llvm", "llvm-persistent"):
        outputs = souffle.compile(graph, target=target, precision=precision).run(inputs)
        for output, reference, float32 in zip(outputs, expected, exact):
            assert output.dtype == np.float32
            np.testing.assert_allclose(output, reference, rtol=rtol, atol=atol)
            assert not np.array_equal(output, float32)  # it did compute in the narrow type


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")
@pytest.mark.parametrize("name", ["bert", "lstm", "resnext"])
def test_tiny_models_run_the_fp16_cuda_kernel_race_free_and_match_pytorch(name):
    graph = models.build(name, config="tiny")
    inputs = models.make_inputs(name, config="tiny", seed=1)
    expected = models.reference(name, "tiny", graph.weights, "fp16")(inputs)
    model = souffle.compile(graph, target="cuda-emulated", precision="fp16")
    assert "half" in model.source
    rtol, atol = models.tolerance(name, "tiny", "fp16")
    for order, seed in (("ascending", 0), ("random", 3)):
        outputs = model.schedule(order, None, seed).run(inputs)
        for output, reference in zip(outputs, expected):
            np.testing.assert_allclose(output, reference, rtol=rtol, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_paper_bert_runs_its_gemms_on_tensor_cores_in_one_validated_kernel_without_spills(precision):
    """Issue 16's acceptance: QKV, Q.K^T, P.V, attention output, FFN1 and FFN2 on tensor cores
    (wmma fragments fed from shared-memory slices), one kernel, validated, no spills."""
    model = souffle.compile(models.build("bert", config="paper"), target="cuda", precision=precision)
    assert model.kernel_count == 1
    assert sum(s.schedule.template == "tensor_core" for s in model.kernel_plan.staged.stages()) == 6
    assert "nvcuda::wmma::mma_sync" in model.source and "extern __shared__" in model.source
    assert model.resources.spill_bytes == 0


# -- the emulator's memory tracking at the size of a half ---------------------------------------
_HALVES = """#include <cuda_fp16.h>
extern "C" __global__ void main_kernel(half* __restrict__ y, int grid_size) {
  y[blockIdx.x * 64 + INDEX] = __float2half_rn((float)threadIdx.x);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")
def test_threads_writing_neighbouring_halves_do_not_race_and_one_half_twice_does():
    device = EmulatedDevice(2, "random", seed=1)
    kernel = device.load_kernels(_HALVES.replace("INDEX", "threadIdx.x"), {}, ("main_kernel",), 0)["main_kernel"]
    y = device.alloc(128 * 2)
    kernel.launch(2, (64, 1, 1), [y, 2])
    np.testing.assert_array_equal(y.download("float16", (2, 64)), np.tile(np.arange(64, dtype=np.float16), (2, 1)))
    kernel = device.load_kernels(_HALVES.replace("INDEX", "threadIdx.x / 2"), {}, ("main_kernel",), 0)["main_kernel"]
    with pytest.raises(EmulationError, match=r"data race on y byte \d+: block \d thread \(\d+,0,0\) wrote it"):
        kernel.launch(2, (64, 1, 1), [device.alloc(128 * 2), 2])


def test_command_line_fp16_check_compares_with_autocast_at_its_tolerance(capsys):
    assert main(["compile", "bert", "--precision", "fp16", "--check", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "check          PASS (rtol 0.01, atol 0.01)" in out
    assert "precision: 39 float32 weights converted to float16 at compile time" in out


@pytest.mark.parametrize("precision,largest", [("fp16", "65504"), ("bf16", "3.38953e+38")])
def test_a_masked_bert_s_masked_score_saturates_at_the_narrow_type_s_largest(precision, largest, capsys):
    """Hugging Face's masked score is torch.finfo(torch.float32).min: rounded to float16 it is an
    infinity, and TVM refused the constant outright (a stack dump from the model's ``full``). It
    becomes float16's -65504 (bfloat16's own largest, just under float32's), as a model run in
    that dtype masks with torch.finfo(dtype).min, and the masked model matches PyTorch."""
    config = '{"attention_mask": "int64", "batch": 2}'
    assert main(["compile", "bert", "--config", config, "--precision", precision, "--check", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert f"float32 constants beyond {PRECISIONS[precision]}'s range made its largest finite value, +-{largest}, " \
           f"as torch.finfo({PRECISIONS[precision]}).min stands for float32's in a model run in " \
           f"{PRECISIONS[precision]} (an attention mask's): mask_drop" in out
    assert "check          PASS" in out


def test_command_line_tf32_on_the_cpu_computes_float32_and_says_so(capsys):
    assert main(["compile", "bert", "--precision", "tf32", "--check", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "check          PASS (rtol 0.01, atol 0.01)" in out
    assert "the CPU targets compute float32" in out


def test_command_line_bf16_check_compares_with_bfloat16_autocast(capsys):
    assert main(["compile", "mmoe", "--precision", "bf16", "--check", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "check          PASS (rtol 0.05, atol 0.05)" in out
    assert "converted to bfloat16 at compile time" in out


def test_bfloat16_bits_without_ml_dtypes_round_as_ml_dtypes_does(monkeypatch):
    """The GPU machine rebuilds bfloat16 weights without ml_dtypes (``tensor.converted``): to
    nearest even, ties both ways, overflow to infinity, NaN kept, as ml_dtypes rounds."""
    values = np.concatenate([np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 1e3,
                             np.array([1.00390625, 1.01171875, -1.00390625, 3.4e38, np.inf, -np.inf, np.nan, -0.0,
                                       1e-40], np.float32)])
    expected = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    monkeypatch.setattr(tensor, "ml_dtypes", None)
    assert tensor.numpy_dtype("bfloat16") == np.uint16
    bits = tensor.converted(values, "bfloat16")
    np.testing.assert_array_equal(bits[~np.isnan(values)], expected[~np.isnan(values)])
    assert np.isnan((bits[np.isnan(values)].astype(np.uint32) << 16).view(np.float32)).all()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_max_pool_of_a_wide_window_is_reduced_by_each_thread(precision):
    """A window of 49 terms would be reduced across a warp's lanes, but TVM cannot: its NaN-keeping
    max is no combiner TVM's cross-thread lowering knows (it failed), and a bfloat16 reduction
    across lanes races (tests/test_bf16_cuda.py). Each thread reduces its window, race-free."""
    b = GraphBuilder("pool")
    x = b.input("x", (2, 8, 14, 14))
    graph = b.build(b.op("max_pool2d", x, kernel=7, stride=7))
    model = souffle.compile(graph, target="cuda-emulated", precision=precision)
    assert {s.schedule.template for s in model.kernel_plan.staged.stages()} >= {"thread_reduce"}
    assert "warp_reduce" not in {s.schedule.template for s in model.kernel_plan.staged.stages()}
    values = np.random.default_rng(0).standard_normal((2, 8, 14, 14)).astype(np.float32)
    values[0, 0, 3, 3] = np.nan
    narrow = values.astype(ml_dtypes.bfloat16).astype(np.float32) if precision == "bf16" else values
    expected = narrow.reshape(2, 8, 2, 7, 2, 7).max(axis=(3, 5))
    for order, seed in (("ascending", 0), ("random", 3)):
        (output,) = model.schedule(order, None, seed).run({"x": values})
        np.testing.assert_array_equal(output, expected)
