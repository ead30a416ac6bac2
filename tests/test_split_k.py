"""codegen.split_k: a GEMM too narrow for the grid as partial GEMMs over slices of K, then a sum."""

import shutil

import numpy as np
import pytest

import souffle
from codegen.split_k import mean_parts_for, parts_for
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder

NOTE = "narrow/y: 96 x 80 over K = 1024 has 4 tiles of 64 x 64 for 132 SMs -> 2 partial GEMMs over K = 512"


@pytest.mark.parametrize("gemm, parts", [
    ((384, 768, 3072), 4),  # paper BERT's FFN2: 72 tiles, 3 rounds of a quarter K on 132 SMs
    ((384, 768, 768), 1),  # its attention output: a slice would be under MIN_CHUNK
    ((384, 3072, 768), 1),  # FFN1: 288 tiles fill the grid
    ((196, 512, 2048), 4),  # Swin-B stage 3's second MLP GEMM
    ((49, 1024, 4096), 8),  # stage 4's
    ((1, 1000, 1280), 1),  # a classifier's GEMV
    ((196, 1024, 1024), 2),  # paper ResNeXt's layer-3 1x1 convolutions: 64 tiles
    ((49, 2048, 2048), 4),  # its layer-4 ones: 32 tiles
])
def test_parts_follow_the_rounds_of_tiles_on_132_sms(gemm, parts):
    assert parts_for(*gemm, sms=132) == parts


def _narrow_gemm(seed: int = 0):
    """relu(x @ W.T + b) with 4 tiles of output and K = 1024: split in two at O4."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("narrow")
    x = b.input("x", (96, 1024))
    b.param("w", (rng.standard_normal((80, 1024)) / 32).astype(np.float32))
    b.param("bias", rng.standard_normal(80).astype(np.float32))
    graph = b.build(b.op("relu", b.op("dense", x, "w", "bias", name="y")))
    inputs = {"x": rng.standard_normal((96, 1024)).astype(np.float32)}
    expected = np.maximum(inputs["x"].astype(np.float64) @ graph.weights["w"].T + graph.weights["bias"], 0)
    return graph, inputs, expected


def test_a_narrow_gemm_is_two_stages_at_o4_and_one_below():
    graph, _, _ = _narrow_gemm()
    o4 = run_passes(graph, "cuda", stop="plan_arena", opt_level=4)
    assert [n for n in o4.notes("transform") if n.startswith("narrow/y")] == [
        NOTE + " (8 tiles, 0.50 of the rounds of tiles), then their sum"]
    stages = {s.name: s for s in o4.ir.stages()}
    (part,) = [s for name, s in stages.items() if "T_matmul_NT_part" in name]
    assert tuple(int(d) for d in part.tensor.shape) == (2, 96, 80)
    # the sum of the parts, with the bias and relu inlined into it, is the next stage
    (total,) = [s for s in stages.values() if any(ref.base == part.write.base for ref in s.reads)]
    assert total.barrier is not None and "T_matmul_NT_part" not in total.name  # reads other blocks' parts
    o3 = run_passes(graph, "cuda", stop="plan_arena", opt_level=3)
    assert not [s for s in o3.ir.stages() if "T_matmul_NT_part" in s.name]


@pytest.mark.slow  # 28 s; by default the same split GEMM at O4 is checked on emulated threads (below)
def test_the_split_gemm_matches_numpy_on_the_cpu():
    graph, inputs, expected = _narrow_gemm()
    model = souffle.compile(graph, target="llvm-persistent", opt_level=4)
    np.testing.assert_allclose(model.run(inputs)[0], expected, rtol=1e-5, atol=1e-4)


# two parts with -m slow: 62 s, its llvm-persistent build (four and eight parts take a second each)
@pytest.mark.parametrize("parts", [pytest.param(2, marks=pytest.mark.slow), 4, 8])
def test_the_ops_split_k_is_the_same_product_on_the_cpu(parts):
    """``dense``'s ``split_k`` on the CPU targets: llvm packs the weight and drops the split,
    llvm-persistent at O3 (no split_k pass) lowers it as it is."""
    graph, inputs, expected = _narrow_gemm()
    b = GraphBuilder("explicit")
    x = b.input("x", (96, 1024))
    for name in ("w", "bias"):
        b.param(name, graph.weights[name])
    explicit = b.build(b.op("relu", b.op("dense", x, "w", "bias", split_k=parts)))
    for model in (souffle.compile(explicit, target="llvm"), souffle.compile(explicit, target="llvm-persistent", opt_level=3)):
        np.testing.assert_allclose(model.run(inputs)[0], expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")
def test_the_split_gemm_matches_numpy_on_emulated_threads():
    graph, inputs, expected = _narrow_gemm()
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    assert any("T_matmul_NT_part" in s.name for s in model.kernel_plan.staged.stages())
    for order in ("ascending", "descending"):
        np.testing.assert_allclose(model.schedule(order, None, seed=5).run(inputs)[0], expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_narrow_partial_sums_stay_float32(precision):
    """The partial products keep their float32 accumulators until the sum rounds once."""
    graph, inputs, expected = _narrow_gemm()
    run = run_passes(graph, "llvm-persistent", stop="plan_arena", opt_level=4, precision=precision)
    (part,) = [s for s in run.ir.stages() if "T_matmul_NT_part" in s.name]
    assert str(part.tensor.dtype) == "float32"
    model = souffle.compile(graph, target="llvm-persistent", opt_level=4, precision=precision)
    np.testing.assert_allclose(model.run(inputs)[0], expected, rtol=5e-2, atol=5e-2)


def test_a_split_that_does_not_divide_k_is_refused_by_name():
    b = GraphBuilder("bad")
    x = b.input("x", (4, 1024))
    b.param("w", np.zeros((8, 1024), np.float32))
    with pytest.raises(Exception, match="split_k must be a positive integer dividing in_features 1024, got 3"):
        b.op("dense", x, "w", split_k=3)


def _narrow_pointwise_conv(seed: int = 0, kernel: int = 1):
    """relu(conv2d(x, W) + b), a 1x1 convolution of 2 x 48 pixels into 80 channels over 1024
    input channels (4 tiles): split in two at O4, as ``_narrow_gemm``; ``kernel`` 3 (padded) is
    no GEMM as it stands."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("pointwise")
    x = b.input("x", (2, 1024, 6, 8))
    b.param("w", (rng.standard_normal((80, 1024, kernel, kernel)) / 32 / kernel).astype(np.float32))
    b.param("bias", rng.standard_normal(80).astype(np.float32))
    graph = b.build(b.op("relu", b.op("conv2d", x, "w", "bias", padding=kernel // 2, name="y")))
    inputs = {"x": rng.standard_normal((2, 1024, 6, 8)).astype(np.float32)}
    torch = pytest.importorskip("torch")
    x, w, bias = (torch.tensor(a, dtype=torch.float64) for a in (inputs["x"], graph.weights["w"], graph.weights["bias"]))
    conv = torch.nn.functional.conv2d(x, w, bias, padding=kernel // 2)
    return graph, inputs, torch.relu(conv).numpy()


def test_a_narrow_pointwise_convolution_is_split_like_a_gemm():
    graph, _, _ = _narrow_pointwise_conv()
    o4 = run_passes(graph, "cuda", stop="plan_arena", opt_level=4)
    assert [n for n in o4.notes("transform") if n.startswith("pointwise/y")] == [
        "pointwise/y: 96 x 80 over K = 1024 has 4 tiles of 64 x 64 for 132 SMs -> 2 partial GEMMs over K = 512 "
        "(8 tiles, 0.50 of the rounds of tiles), then their sum"]
    (part,) = [s for s in o4.ir.stages() if "conv2d_part" in s.name]
    assert tuple(int(d) for d in part.tensor.shape) == (2, 2, 80, 6, 8)


def test_a_convolution_that_is_no_gemm_as_it_stands_is_not_split():
    graph, _, _ = _narrow_pointwise_conv(kernel=3)
    o4 = run_passes(graph, "cuda", stop="plan_arena", opt_level=4)
    assert not [n for n in o4.notes("transform") if "partial GEMMs" in n]
    assert not [s for s in o4.ir.stages() if "conv2d_part" in s.name]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")
def test_the_split_pointwise_convolution_matches_torch_on_the_cpu_and_on_emulated_threads():
    graph, inputs, expected = _narrow_pointwise_conv()
    np.testing.assert_allclose(souffle.compile(graph, target="llvm-persistent", opt_level=4).run(inputs)[0],
                               expected, rtol=1e-5, atol=1e-4)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    assert any("conv2d_part" in s.name for s in model.kernel_plan.staged.stages())
    np.testing.assert_allclose(model.schedule("descending", None, seed=3).run(inputs)[0], expected, rtol=1e-5, atol=1e-4)


@pytest.mark.slow  # 25 s; the split convolution stays checked by default on the CPU and emulated threads
@pytest.mark.parametrize("parts", [2, 8])
def test_the_convolutions_split_k_is_the_same_product_on_the_cpu(parts):
    graph, inputs, expected = _narrow_pointwise_conv()
    b = GraphBuilder("explicit")
    x = b.input("x", (2, 1024, 6, 8))
    for name in ("w", "bias"):
        b.param(name, graph.weights[name])
    explicit = b.build(b.op("relu", b.op("conv2d", x, "w", "bias", split_k=parts)))
    for model in (souffle.compile(explicit, target="llvm"), souffle.compile(explicit, target="llvm-persistent", opt_level=3)):
        np.testing.assert_allclose(model.run(inputs)[0], expected, rtol=1e-5, atol=1e-4)


def test_a_split_of_a_convolution_that_is_no_gemm_is_refused_by_name():
    b = GraphBuilder("bad")
    x = b.input("x", (1, 64, 8, 8))
    b.param("w", np.zeros((8, 64, 3, 3), np.float32))
    with pytest.raises(Exception, match=r"split_k applies to a 1x1, stride-1, unpadded, ungrouped convolution .* "
                                        r"this one has a 3x3 kernel"):
        b.op("conv2d", x, "w", padding=1, split_k=2)
    b.param("w1", np.zeros((8, 64, 1, 1), np.float32))
    with pytest.raises(Exception, match="split_k must be a positive integer dividing the input channels 64, got 3"):
        b.op("conv2d", x, "w1", split_k=3)


@pytest.mark.parametrize("mean, parts", [
    ((32, 12544), 16),  # paper EfficientNet's first squeeze: 4 tiles -> 64
    ((96, 3136), 4),  # its second and third: 12 and 18 tiles
    ((144, 3136), 4),
    ((144, 784), 1),  # runs of 392 would be under MIN_RUN
    ((1152, 49), 1),
    ((2048, 4096), 1),  # 256 tiles fill the grid at two blocks an SM
])
def test_mean_parts_follow_the_rounds_of_tiles_on_132_sms(mean, parts):
    assert mean_parts_for(*mean, sms=132) == parts


def _squeeze(side: int = 32, seed: int = 0):
    """A squeeze-and-excitation's first half: the mean of each of 32 channels over a side x side
    map, then a 1 x 1 convolution to 8 channels and a SiLU."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("squeeze")
    x = b.input("x", (1, 32, side, side))
    w = b.param("w", (rng.standard_normal((8, 32, 1, 1)) / 4).astype(np.float32))
    squeezed = b.op("mean", x, axes=[-1, -2], keepdims=True, name="squeezed")
    graph = b.build(b.op("silu", b.op("conv2d", squeezed, w, stride=1, padding=0, groups=1)))
    inputs = {"x": rng.standard_normal((1, 32, side, side)).astype(np.float32)}
    z = np.einsum("oc,c->o", graph.weights["w"][:, :, 0, 0], inputs["x"].astype(np.float64).mean((2, 3))[0])
    return graph, inputs, (z / (1 + np.exp(-z))).reshape(1, 8, 1, 1)


def test_a_mean_of_few_outputs_is_partial_sums_then_their_sum_in_the_excitation_s_block():
    """32 means of 1024 elements: 4 tiles, in two runs of 512 each 8; the sum of the two is one tile,
    which the excitation's one tile reads a __syncthreads after, as it read the mean before."""
    graph, _, _ = _squeeze()
    o4 = run_passes(graph, "cuda", stop="plan_arena", opt_level=4)
    assert [n for n in o4.notes("transform") if n.startswith("squeeze/squeezed")] == [
        "squeeze/squeezed: 32 means of 1024 elements have 4 tiles of 8 for 132 SMs -> 2 partial sums of 512 "
        "each (8 tiles, 0.50 of the rounds of tiles), then their sum"]
    partial, total, excitation = o4.ir.stages()
    assert "partial_sums" in partial.name and partial.schedule.n_tiles == 8
    assert total.barrier is not None and total.schedule.n_tiles == 1
    assert excitation.barrier is None and excitation.block_barrier is not None
    o3 = run_passes(graph, "cuda", stop="plan_arena", opt_level=3)
    assert not [s for s in o3.ir.stages() if "partial_sums" in s.name]


def test_a_short_mean_is_not_split():
    graph, _, _ = _squeeze(side=16)  # 256 elements a mean
    assert not [n for n in run_passes(graph, "cuda", stop="split_k", opt_level=4).notes("transform")
                if n.startswith("squeeze/")]


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("fp16", 1e-2)])
def test_the_split_mean_matches_numpy_on_emulated_threads(precision, tolerance):
    graph, inputs, expected = _squeeze()
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    (partial,) = [s for s in model.kernel_plan.staged.stages() if "partial_sums" in s.name]
    assert str(partial.tensor.dtype) == "float32"  # the partial sums of a float16 map stay float32
    for order in ("ascending", "descending"):
        np.testing.assert_allclose(model.schedule(order, None, seed=5).run(inputs)[0], expected,
                                   rtol=tolerance, atol=tolerance)


def test_a_mean_over_one_axis_given_as_an_int_is_split():
    b = GraphBuilder("rows")
    graph = b.build(b.op("mean", b.input("x", (16, 8192)), axes=-1, name="means"))
    notes = run_passes(graph, "cuda", stop="split_k", opt_level=4).notes("transform")
    assert notes == ["rows/means: 16 means of 8192 elements have 2 tiles of 8 for 132 SMs -> 16 partial sums of 512 "
                     "each (32 tiles, 0.06 of the rounds of tiles), then their sum"]
