"""Scaled operands (codegen.vertical's ``_scaled_operands``, codegen.schedule's
``gathered_operands``): a tensor scaled by a smaller one, read by a 1 x 1 convolution alone, is
computed as the GEMM copies its operand, not stored as a stage of its own.

EfficientNet's squeeze-and-excitation scales the depthwise convolution's output by each
channel's gate before the projection. Checked on a block as torchvision writes it (depthwise
convolution and SiLU, the squeeze, the excitation, the scale, the projection and its batch norm):
no stage stores the product, the gate is the excitation's epilogue, and the kernel matches
PyTorch on emulated threads on tensor cores (fp16) and on dlight's SIMT matmul (fp32), scratch
poisoned; on the graph, where it must not apply (the product read by another op too, or by a
depthwise convolution); and in the latency model's count of the copy's loads.
"""

import numpy as np
import pytest
import torch

import souffle
from analysis.device import H100
from codegen.latency import stage_estimate
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder
from souffle.importers.torch_export import from_torch


class _Excited(torch.nn.Module):
    """The end of an MBConv block: a depthwise convolution, its squeeze-and-excitation, the
    scale, the projection."""

    def __init__(self, channels=64, squeezed=16, outputs=48):
        super().__init__()
        self.depthwise = torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.fc1 = torch.nn.Conv2d(channels, squeezed, 1)
        self.fc2 = torch.nn.Conv2d(squeezed, channels, 1)
        self.project = torch.nn.Conv2d(channels, outputs, 1, bias=False)
        self.norm = torch.nn.BatchNorm2d(outputs)

    def forward(self, x):
        y = torch.nn.functional.silu(self.depthwise(x))
        gate = torch.sigmoid(self.fc2(torch.nn.functional.silu(self.fc1(y.mean((2, 3), keepdim=True)))))
        return self.norm(self.project(y * gate))


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    module = _Excited().eval()
    with torch.no_grad():
        module.norm.running_mean.normal_()
        module.norm.running_var.uniform_(0.5, 2.0)
    x = torch.randn(1, 64, 14, 14)
    return module, x, from_torch(module, (x,))


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
@pytest.mark.parametrize("precision, projection, tolerance",
                         [("fp16", "tensor_core", 1e-2), ("fp32", "matmul", 1e-5)])
def test_the_scaled_input_of_a_projection_is_computed_as_it_is_copied(block, precision, projection, tolerance):
    module, x, graph = block
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    stages = [(stage.name.split("/")[-1].split("+")[-1], stage.schedule.template) for stage in model.plan.stages()]
    # the squeeze, the excitation with the gate as its epilogue, then the projection: no product
    assert stages[-3:] == [("silu_1", "warp_reduce"), ("sigmoid", "thread_reduce"),
                           ("_native_batch_norm_legit_no_training", projection)], stages
    assert not any(name.startswith(("mul", "T_multiply")) for name, _ in stages)
    with torch.no_grad():
        expected = module(x).numpy()
    for order in ("ascending", "descending"):
        (got,) = model.schedule(order).run({graph.inputs[0].name: x.numpy()})
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


def _scaled(read_also=None, depthwise=False, channels=32, outputs=16, side=8, scaled=True):
    """x scaled by the sigmoid of g, channel by channel (or not ``scaled``), then a 1 x 1
    convolution (or a depthwise one); ``read_also``: another op that reads the product too."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("scaled")
    x, g = b.input("x", (1, channels, side, side)), b.input("g", (1, channels, 1, 1))
    product = b.op("mul", x, b.op("sigmoid", g, name="gate"), name="product") if scaled else x
    groups, shape = (channels, (channels, 1, 1, 1)) if depthwise else (1, (outputs, channels, 1, 1))
    w = b.param("w", (rng.standard_normal(shape) * 0.1).astype(np.float32))
    out = b.op("conv2d", product, w, stride=1, padding=0, groups=groups, name="out")
    return b.build(out, b.op(read_also, product, name="other")) if read_also else b.build(out)


def _stored(graph) -> list[str]:
    staged = run_passes(graph, "cuda", stop="stage", opt_level=4, device="h100", precision="fp16").ir
    return [stage.name.split("/")[-1] for stage in staged.stages()]


def test_a_scaled_tensor_that_only_a_1_x_1_convolution_reads_is_not_stored():
    assert _stored(_scaled()) == ["gate", "conv2d_nchw+out"]


@pytest.mark.parametrize("graph, stored", [(_scaled(read_also="relu"), "product"), (_scaled(depthwise=True), "product")],
                         ids=["read by a ReLU too", "read by a depthwise convolution"])
def test_a_scaled_tensor_read_otherwise_is_stored(graph, stored):
    assert any(name.split("+")[0] == stored for name in _stored(graph)), _stored(graph)


def test_the_latency_model_counts_the_scale_once_for_each_vector():
    """Paper EfficientNet's projection from 672 channels at 14 x 14, as the transposed GEMM in 64 x
    64 tiles: the scaled input, kept [channels, hw], is copied 4 elements a lane (the scale, the
    same for the four, is read once: nvcc loads one address once), the input's four in one
    instruction, TVM having simplified its index [c, hw // 14, hw % 14] to 196 c + hw before
    vectorizing. The first warp copies channels 0 and 1 (16 lanes each, the tile's 64 columns) of
    the graph's float32 input (cast to half as it is read): channel 0's 256 bytes in 8 sectors,
    channel 1's from byte 784 in 9, and both scales in 1."""
    (stage,) = _projections(scaled=True)
    tile = stage.schedule.tensor_core_tile
    weights, scaled = tile.warp_copies
    assert (scaled.width, scaled.loads) == (4, 2)
    assert scaled.sectors == 8 + 9 + 1
    assert not tile.copies_async  # a cp.async copies, it does not multiply


def test_the_latency_model_counts_a_scaled_projection_s_flops_as_the_product_s():
    """The scale is multiplied once for each element the tile copies, not for each term."""
    (scaled,), (plain,) = _projections(scaled=True), _projections(scaled=False)
    flops = [stage_estimate(stage, H100).work.flops for stage in (scaled, plain)]
    assert flops[0] == flops[1] == 2 * 112 * 196 * 672


def _projections(scaled: bool) -> list:
    """The tensor-core stages of paper EfficientNet's projection from 672 channels at 14 x 14, its
    input scaled by a gate or not."""
    graph = _scaled(channels=672, outputs=112, side=14, scaled=scaled)
    staged = run_passes(graph, "cuda", stop="stage", opt_level=4, device="h100", precision="fp16").ir
    return [stage for stage in staged.stages() if stage.schedule.tensor_core_tile]
