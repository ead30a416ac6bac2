"""EfficientNet-b0 (torchvision's architecture and state_dict names) through both importers:
from_torch (how ``models.build`` makes it) and an ONNX file from torch.onnx.export, each equal to
PyTorch in ONE llvm function and in the persistent kernel's staged program; the cuda kernel builds
and the thread-level validator accepts it. The cuda-emulated target at O0 and O4 runs it with the
other models in tests/test_cuda_emulated.py; the paper configuration is the slow test at the end."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

import souffle  # noqa: E402
from souffle import models  # noqa: E402
from souffle.cli import main  # noqa: E402
from souffle.models import efficientnet  # noqa: E402

# torchvision's efficientnet_b0: its documented parameter count and a sample of its state_dict
B0_PARAMETERS = 5_288_548
B0_SHAPES = {
    "features.0.0.weight": (32, 3, 3, 3),
    "features.0.1.running_var": (32,),
    "features.1.0.block.0.0.weight": (32, 1, 3, 3),  # depthwise, no expansion in stage 1
    "features.1.0.block.1.fc1.weight": (8, 32, 1, 1),
    "features.1.0.block.1.fc2.bias": (32,),
    "features.1.0.block.2.0.weight": (16, 32, 1, 1),
    "features.2.0.block.0.0.weight": (96, 16, 1, 1),  # expansion x6
    "features.2.1.block.3.1.bias": (24,),
    "features.6.3.block.1.0.weight": (1152, 1, 5, 5),
    "features.6.3.block.2.fc1.weight": (48, 1152, 1, 1),
    "features.7.0.block.3.0.weight": (320, 1152, 1, 1),
    "features.8.0.weight": (1280, 320, 1, 1),
    "classifier.1.weight": (1000, 1280),
}


@pytest.fixture(scope="module")
def tiny():
    """The tiny graph with seeded weights, its inputs and PyTorch's logits."""
    graph = models.build("efficientnet", "tiny", seed=0)
    inputs = models.make_inputs("efficientnet", "tiny", seed=1)
    (expected,) = models.reference("efficientnet", "tiny", graph.weights)(inputs)
    return graph, inputs, expected


def _assert_matches(compiled, inputs, expected):
    rtol, atol = models.tolerance("efficientnet", "tiny")
    (got,) = compiled.run(inputs)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)


def test_paper_module_has_torchvision_b0_names_and_shapes():
    state = efficientnet.torch_module(models.config("efficientnet", "paper")).state_dict()
    assert {name: tuple(state[name].shape) for name in B0_SHAPES} == B0_SHAPES
    parameters = {k: v for k, v in state.items() if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    assert sum(v.numel() for v in parameters.values()) == B0_PARAMETERS
    assert len(state) == 360 and sum(k.endswith("num_batches_tracked") for k in state) == 49


def test_graph_weights_are_the_state_dict_and_activations_stay_order_one(tiny):
    graph, _, expected = tiny
    state = efficientnet.torch_module(models.config("efficientnet", "tiny")).state_dict()
    assert set(graph.params) == {k for k in state if not k.endswith("num_batches_tracked")}
    assert [spec.name for spec in graph.inputs] == ["x"] and graph.output_specs()[0].shape == (1, 10)
    assert {"conv2d", "batch_norm", "silu", "sigmoid", "mean", "mul", "add", "dense"} <= {op.kind for op in graph.ops}
    assert 0.1 < float(np.std(expected)) < 10  # logits neither vanish nor explode, so atol 1e-4 means something


def test_a_state_dict_with_its_buffers_loads_by_name():
    """A module's own state_dict (num_batches_tracked included) builds the graph, and the graph
    computes what that module computes."""
    cfg = models.config("efficientnet", "tiny")
    torch.manual_seed(2)
    module = efficientnet.torch_module(cfg)
    for norm in module.modules():
        if isinstance(norm, torch.nn.BatchNorm2d):
            norm.running_mean.uniform_(-0.2, 0.2)
            norm.running_var.uniform_(0.5, 1.5)
    graph = models.build("efficientnet", "tiny", weights=module.state_dict())
    x = models.make_inputs("efficientnet", "tiny", seed=3)
    with torch.no_grad():
        expected = module(torch.from_numpy(x["x"])).numpy()
    _assert_matches(souffle.compile(graph, target="llvm"), x, expected)


@pytest.mark.parametrize("target", ["llvm", "llvm-persistent"])
def test_from_torch_matches_pytorch_in_one_function(tiny, target):
    graph, inputs, expected = tiny
    compiled = souffle.compile(graph, target=target)
    assert compiled.report().kernels == 1
    _assert_matches(compiled, inputs, expected)


@pytest.mark.parametrize("target", ["llvm", "llvm-persistent"])
def test_from_onnx_matches_pytorch_in_one_function(tiny, tmp_path, target):
    graph, inputs, expected = tiny
    module = efficientnet.torch_module(models.config("efficientnet", "tiny"), graph.weights)
    path = tmp_path / "efficientnet.onnx"
    torch.onnx.export(module, (torch.from_numpy(inputs["x"]),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"])
    imported = souffle.from_onnx(path)
    assert [spec.name for spec in imported.inputs] == ["x"]
    compiled = souffle.compile(imported, target=target)
    assert compiled.report().kernels == 1
    _assert_matches(compiled, inputs, expected)


def test_cuda_kernel_builds_and_the_validator_accepts_it(tiny):
    graph, _, _ = tiny
    compiled = souffle.compile(graph, target="cuda")
    assert compiled.kernel_count == 1 and compiled.cubin[:4] == b"\x7fELF"
    (validation,) = [record for record in compiled.passes.records if record.name == "validate_threads"]
    assert validation.notes[-1].startswith("1 kernels validated")


def test_command_line_check(capsys):
    assert main(["compile", "efficientnet", "--check"]) == 0
    out = capsys.readouterr().out
    assert "check          PASS" in out and "kernels        1" in out


@pytest.mark.slow
def test_paper_config_passes_in_one_kernel(capsys):
    assert main(["compile", "efficientnet", "--config", "paper", "--check"]) == 0
    out = capsys.readouterr().out
    assert "check          PASS" in out and "kernels        1" in out
