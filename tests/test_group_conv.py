"""Grouped convolutions on tensor cores: the group an axis of the TE (``souffle.ops.nn``), so that
dlight's GEMM rules see a batched matmul; the padding inlined and gathered into the input's
shared-memory slice element by element (``codegen.schedule.gathered_operands``), not stored;
narrow tiles for a group's few output channels (``codegen.tensor_core.NARROW_TILES``). Checked
against PyTorch on emulated CUDA threads, by the thread-level validator with mutants, and in the
latency model's count of the gathered copies."""

from __future__ import annotations

import dataclasses
import importlib
import shutil
import sys
from pathlib import Path

import islpy as isl
import numpy as np
import pytest
import torch
import tvm
from tvm import te, tirx

import souffle
from analysis.characterize import is_gemm
from analysis.device import H100
from codegen.latency import stage_works
from codegen.schedule import gathered_factors, gathered_operands, tensor_core_stages
from codegen.tensor_core import NARROW_TILES
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder
from souffle.ops import lower_op

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
mutants = importlib.import_module("scripts.validate_mutants")

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")

GROUPS, GROUP_CHANNELS, GROUP_OUTPUTS, SIZE = 4, 16, 16, 14


def _group_conv(stride: int = 1, size: int = SIZE):
    """A 3 x 3 grouped convolution (padding 1) of 4 groups of 16 channels, as paper ResNeXt's
    third stage has them (64 groups there), its ReLU, and a reduction that reads it (ResNeXt's
    next is a 1 x 1 convolution; here a global average pooling, quicker to build): the ReLU is
    stored in the convolution's [N, groups, O / groups, H, W] shape, its epilogue (``vertical``)."""
    rng = np.random.default_rng(0)
    builder = GraphBuilder("group_conv")
    x = builder.input("x", (1, GROUPS * GROUP_CHANNELS, size, size))
    w = builder.param("w", (rng.standard_normal((GROUPS * GROUP_OUTPUTS, GROUP_CHANNELS, 3, 3)) * 0.1)
                      .astype(np.float32))
    conv = builder.op("conv2d", x, w, stride=stride, padding=1, groups=GROUPS)
    graph = builder.build(builder.op("global_avg_pool2d", builder.op("relu", conv)))
    return graph, {"x": rng.standard_normal((1, GROUPS * GROUP_CHANNELS, size, size)).astype(np.float32)}


def _reduction(tensor: te.Tensor) -> te.Tensor:
    while not tensor.op.reduce_axis:
        tensor = tensor.op.input_tensors[0]
    return tensor


def test_a_grouped_convolution_is_a_batched_gemm_over_its_groups(run_op):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((1, 8, 6, 6)).astype(np.float32), rng.standard_normal((6, 4, 3, 3)).astype(np.float32)
    placeholders = [te.placeholder(a.shape, "float32", name=n) for n, a in (("x", x), ("w", w))]
    (y,) = lower_op("conv2d", placeholders, {"stride": 2, "padding": 1, "dilation": 1, "groups": 2, "split_k": 1})
    grouped = _reduction(y)
    assert [int(d) for d in grouped.shape] == [1, 2, 3, 3, 3]  # [N, groups, O / groups, H, W]
    assert is_gemm(grouped) and is_gemm(grouped, batched=True)
    expected = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), stride=2, padding=1, groups=2).numpy()
    np.testing.assert_allclose(run_op("conv2d", [x, w], stride=2, padding=1, groups=2), expected, rtol=1e-5, atol=1e-5)


def _padded_group_conv(group_outputs: int):
    """4 groups of 16 channels, 14 x 14, its padding inlined as the ``vertical`` pass leaves it."""
    x = te.placeholder((1, 64, 14, 14), "float16", name="x")
    w = te.placeholder((4 * group_outputs, 16, 3, 3), "float16", name="w")
    rc, ry, rx = te.reduce_axis((0, 16), "rc"), te.reduce_axis((0, 3), "ry"), te.reduce_axis((0, 3), "rx")

    def padded(b, c, h, v):
        inside = tirx.all(h >= 1, h < 15, v >= 1, v < 15)
        return tirx.if_then_else(inside, x[b, c, h - 1, v - 1], tirx.const(0, "float16"))

    conv = te.compute((1, 4, group_outputs, 14, 14), lambda b, g, j, i, k: te.sum(
        padded(b, g * 16 + rc, i + ry, k + rx).astype("float32")
        * w[g * group_outputs + j, rc, ry, rx].astype("float32"), axis=[rc, ry, rx]), name="conv")
    return x, w, conv


def test_the_padded_input_is_gathered_by_a_te_of_the_axes_it_varies_with():
    x, w, conv = _padded_group_conv(16)
    assert gathered_factors(conv) == (True, False)
    gathered = gathered_operands(conv)
    (operand,) = [t for t in gathered.op.input_tensors if t.op.name == "conv_gathered0"]
    assert [int(d) for d in operand.shape] == [1, 4, 14, 14, 16, 3, 3]  # no axis for the output channel
    assert [t.op.name for t in gathered.op.input_tensors] == ["conv_gathered0", "w"]
    func = te.create_prim_func([x, w, gathered])
    stages = tensor_core_stages(func)
    # 16 columns: the wide tiles are idle; the weights, read at k // 9, k % 9 // 3 and k % 3, copied
    # four elements at a time (``test_the_latency_model_counts_the_gathered_slice_an_element_per_copy``)
    assert [s.tensor_core_tile for _, s in stages] == [dataclasses.replace(t, copy_vector=4) for t in NARROW_TILES]
    assert [s.n_tiles for _, s in stages] == [4 * 2, 4 * 4]  # each group's 196 rows in tiles of 128, of 64
    unpadded = _reduction(lower_op("conv2d", [x, w], {"groups": 4, "stride": 1, "padding": 0, "dilation": 1,
                                                      "split_k": 1})[0])
    assert gathered_factors(unpadded) == (False, False) and gathered_operands(unpadded) is unpadded


def test_eight_channels_per_group_take_a_narrow_tile_half_full_and_four_none():
    """A narrow tile may be a quarter full (``NARROW_MIN_USE``): 8 output channels per group fill
    half its 16 columns, and it writes only those; 4 (with the rows' padding) fill less."""
    x, w, conv = _padded_group_conv(8)
    ((_, schedule),) = tensor_core_stages(te.create_prim_func([x, w, gathered_operands(conv)]))
    assert schedule.tensor_core_tile == dataclasses.replace(NARROW_TILES[0], copy_vector=4)
    assert schedule.n_tiles == 4 * 2
    assert isl.Map(schedule.tile_relation).range().is_equal(isl.Set(
        "{ [0, g, j, i, k] : 0 <= g < 4 and 0 <= j < 8 and 0 <= i < 14 and 0 <= k < 14 }"))
    x, w, conv = _padded_group_conv(4)
    assert tensor_core_stages(te.create_prim_func([x, w, gathered_operands(conv)])) == []


def _stages(graph, precision: str) -> list[str]:
    plan = run_passes(graph, "cuda", stop="kernel_plan", opt_level=4, precision=precision).ir
    return [s.schedule.template for s in plan.staged.stages()]


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_a_grouped_convolution_reads_its_padding_inside_its_tensor_core_stage():
    """No stage stores the padded input: the convolution and its ReLU on tensor cores, then the pooling."""
    graph, _ = _group_conv()
    assert _stages(graph, "fp16") == ["elementwise", "tensor_core", "warp_reduce"]  # cast in, GEMM, pooling
    assert "tensor_core" not in _stages(graph, "fp32")  # float32 operands take no tensor cores


def _kernel(graph) -> mutants.Kernel:
    plan = run_passes(graph, "cuda", stop="kernel_plan", opt_level=4, precision="fp16").ir
    (kernel,) = [mutants.Kernel("grouped", name, func, {}, 1, plan.staged.threads)
                 for name, func in mutants.device_functions(mutants.device_module(plan.funcs, "sm_90")).items()]
    return kernel


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_the_validator_catches_the_padding_read_without_its_condition():
    """The gathered slice's loads are under the padding's condition: without it, the validator
    finds reads outside the input."""
    kernel = _kernel(_group_conv()[0])
    assert mutants.validate(kernel).violations == ()
    unguarded = kernel.func.with_body(mutants.rewrite(
        kernel.func.body, lambda s: s,
        lambda e: e.args[1] if isinstance(e, tvm.ir.Call) and e.op.name == "prim.if_then_else" else e))
    assert any("outside" in v for v in mutants.validate(kernel, unguarded).violations)


@needs_gxx
@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
# TF32 at stride 2 with -m slow: each emulated build takes a minute on a cold cache
@pytest.mark.parametrize("precision, stride, size", [("fp16", 1, SIZE),
                                                     pytest.param("tf32", 2, 2 * SIZE, marks=pytest.mark.slow)])
def test_a_grouped_convolution_on_tensor_cores_matches_pytorch_on_emulated_threads(precision, stride, size):
    graph, inputs = _group_conv(stride, size)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    assert [s.schedule.template for s in model.kernel_plan.staged.stages()].count("tensor_core") == 1
    narrow = torch.float16 if precision == "fp16" else torch.float32
    torch.backends.cudnn.allow_tf32 = False
    x, w = (torch.tensor(a).to(narrow).float() for a in (inputs["x"], graph.weights["w"]))
    conv = torch.nn.functional.conv2d(x, w, stride=stride, padding=1, groups=GROUPS).to(narrow).float()
    expected = torch.relu(conv).mean(dim=(2, 3), keepdim=True).numpy()
    for order in ("ascending", "descending"):
        (output,) = model.schedule(order, model.emulator.sms, seed=5).run(inputs)
        np.testing.assert_allclose(output, expected, rtol=1e-2, atol=1e-2, err_msg=order)


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_the_latency_model_counts_the_gathered_slice_an_element_per_copy():
    plan = run_passes(_group_conv()[0], "cuda", stop="kernel_plan", opt_level=4, precision="fp16").ir
    (work,) = [w for w in stage_works(plan.staged, H100) if w.template == "tensor_core"]
    copies = {(a.tensor, a.kind): a for a in work.accesses}
    tile = NARROW_TILES[0]
    chunks = -(-GROUP_CHANNELS * 9 // tile.depth)
    gathered, weights = copies["first operand slices", "load"], copies["second operand slices", "load"]
    assert gathered.per_tile == tile.rows * chunks * tile.depth // 32  # one element per lane
    # four per lane: the weights, [O, C, 3, 3] read at k // 9, k % 9 // 3 and k % 3, are consecutive
    # but not a ramp to TVM's vectorizer, which would print eight lanes as code nvcc refuses; it loads
    # the four lane by lane: four instructions a vector, each of 32 elements 8 bytes apart (8 sectors),
    # and stores them into the slice as one vector
    (stage,) = [s for s in plan.staged.stages() if s.schedule.tensor_core_tile]
    assert stage.schedule.tensor_core_tile.copy_vector == 4
    assert weights.per_tile == tile.columns * chunks * tile.depth // 32
    assert weights.sectors == 32 * 4 * 2 // 32
    assert copies["second operand slices", "store"].per_tile == tile.columns * chunks * tile.depth // (32 * 4)
    assert 1 < gathered.sectors < 32  # a warp's 32 terms of one row: runs of 3 along the window's rows
