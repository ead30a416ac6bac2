"""Swin Transformer (torchvision swin_b's architecture and state_dict) imported by from_torch and
through an ONNX file: equal to PyTorch at fp32 in one function (llvm), as the persistent kernel
(llvm-persistent), and built by nvcc for cuda with the thread-level validator's approval."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

import souffle  # noqa: E402
from model_checks import run_poisoned  # noqa: E402
from souffle import models  # noqa: E402
from souffle.cli import main  # noqa: E402
from souffle.compiler import run_passes  # noqa: E402
from souffle.errors import ConfigError, WeightError  # noqa: E402
from souffle.models import swin  # noqa: E402

CFG = swin.CONFIGS["tiny"]
RTOL, ATOL = swin.TOLERANCE["tiny"]


@pytest.fixture(scope="module")
def reference():
    """The tiny module with init_weights' weights, an input, and PyTorch's logits for it."""
    module = swin.torch_module(CFG, swin.init_weights(CFG, seed=0))
    x = torch.from_numpy(swin.make_inputs(CFG, seed=1)["x"])
    with torch.no_grad():
        return module, x, module(x).numpy()


def _check(graph, reference, target="llvm", **options):
    _, x, expected = reference
    compiled = souffle.compile(graph, target=target, **options)
    (got,) = run_poisoned(compiled, {graph.inputs[0].name: x.numpy()})
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    assert compiled.report().kernels == 1
    return compiled


def test_state_dict_is_torchvisions():
    """swin_b's keys and shapes: torchvision's Swin_B_Weights counts 87,768,224 parameters."""
    module = swin.torch_module(swin.CONFIGS["paper"])
    state = module.state_dict()
    assert sum(p.numel() for p in module.parameters()) == 87_768_224
    expected = {
        "features.0.0.weight": (128, 3, 4, 4), "features.0.2.weight": (128,),
        "features.1.0.attn.qkv.weight": (384, 128), "features.1.0.attn.proj.bias": (128,),
        "features.1.0.attn.relative_position_bias_table": (169, 4),
        "features.1.0.attn.relative_position_index": (2401,),
        "features.1.1.mlp.0.weight": (512, 128), "features.1.1.mlp.3.weight": (128, 512),
        "features.2.reduction.weight": (256, 512), "features.2.norm.weight": (512,),
        "features.5.17.attn.relative_position_bias_table": (169, 16),
        "features.7.1.norm2.bias": (1024,), "norm.weight": (1024,), "head.weight": (1000, 1024), "head.bias": (1000,),
    }
    assert {name: tuple(state[name].shape) for name in expected} == expected
    assert "features.2.reduction.bias" not in state
    assert state["features.1.0.attn.relative_position_index"].dtype == torch.int64
    assert [k for k in state if k.startswith("features.5.") and k.endswith(".norm1.weight")] == [
        f"features.5.{i}.norm1.weight" for i in range(18)]


def test_relative_position_index_pairs_tokens_with_their_offset():
    """Tokens p, q of a window read row (py - qy + w - 1) * (2w - 1) + (px - qx + w - 1) of the table."""
    w = CFG["window"]
    index = swin.init_weights(CFG, seed=0)["features.1.0.attn.relative_position_index"].reshape(w * w, w * w)
    tokens = [(y, x) for y in range(w) for x in range(w)]
    expected = [[(py - qy + w - 1) * (2 * w - 1) + px - qx + w - 1 for qy, qx in tokens] for py, px in tokens]
    assert index.dtype == np.int64 and np.array_equal(index, expected)


def test_tiny_config_has_shifted_windows_and_merges():
    graph = models.build("swin", "tiny")
    kinds = [op.kind for op in graph.ops]
    blocks = sum(CFG["depths"])
    assert kinds.count("take") == blocks  # each block gathers its relative position bias
    assert kinds.count("roll") == 4  # shifted blocks of the first two stages; the last map is one window
    assert kinds.count("conv2d") == 1 and kinds.count("softmax") == blocks
    masks = [name for name in graph.params if not name.startswith(("features.", "norm.", "head."))]
    assert len(masks) == 2 and all(set(np.unique(graph.weights[m])) == {0.0, -100.0} for m in masks)


def test_from_torch_is_one_function_equal_to_torch(reference):
    graph = souffle.from_torch(reference[0], (reference[1],))
    assert [spec.name for spec in graph.inputs] == ["x"]
    assert "features.1.1.attn.relative_position_bias_table" in graph.params
    _check(graph, reference)


def test_the_model_zoos_graph_is_the_persistent_kernel_equal_to_torch(reference):
    graph = models.build("swin", "tiny", weights=reference[0].state_dict())
    _check(graph, reference, "llvm-persistent")


@pytest.mark.slow  # 25 s; Swin from torch and the ONNX importer on the other models stay checked by default
def test_from_onnx_equals_torch(reference, tmp_path):
    module, x, _ = reference
    path = tmp_path / "swin.onnx"
    with warnings.catch_warnings():  # the tracer notes the Python branch on the map's size (the shift)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=17, input_names=["image"])
    graph = souffle.from_onnx(path)
    assert [spec.name for spec in graph.inputs] == ["image"]
    _check(graph, reference)
    _check(graph, reference, "llvm-persistent")


def test_cuda_builds_one_kernel_the_validator_accepts():
    run = run_passes(models.build("swin", "tiny"), "cuda", stop="validate_threads")
    (record,) = [r for r in run.records if r.name == "validate_threads"]
    assert record.notes[-1].startswith("1 kernels validated")
    compiled = souffle.compile(models.build("swin", "tiny"), target="cuda")
    assert compiled.kernel_count == 1 and compiled.cubin[:4] == b"\x7fELF"


def test_weights_are_checked_by_name(reference):
    state = dict(reference[0].state_dict())
    del state["features.3.0.attn.qkv.bias"]
    with pytest.raises(WeightError, match=r"missing 1: 'features\.3\.0\.attn\.qkv\.bias'"):
        models.build("swin", "tiny", weights=state)


def test_command_line_check(capsys):
    assert main(["compile", "swin", "--check"]) == 0
    out = capsys.readouterr().out
    assert "check          PASS" in out and "kernels        1" in out


@pytest.mark.slow
def test_paper_config_command_line_check(capsys):
    assert main(["compile", "swin", "--config", "paper", "--check"]) == 0
    out = capsys.readouterr().out
    assert "check          PASS" in out and "kernels        1" in out


@pytest.mark.parametrize("overrides, reason", [
    ({"heads": [2, 2]}, r"depths \[2, 2, 1\] and heads \[2, 2\] must give one entry per stage"),
    ({"heads": [3, 2, 4]}, r"stage 0 has 2 blocks and 3 heads for width 16"),
    ({"image": 1}, r"the image \(1\) must hold at least one patch \(2\)"),
])
def test_configurations_that_are_not_swin_are_refused(overrides, reason):
    with pytest.raises(ConfigError, match=reason):
        models.build("swin", overrides)
