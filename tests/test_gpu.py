"""The persistent kernels on a GPU (``-m gpu``): every model's outputs match PyTorch at the tiny
and paper configs, and the cooperative launch uses a co-resident grid.

A lent GPU machine has no TVM, so by default these run the artifacts that
``python benchmarks/gpu_kernels.py export DIR`` wrote (``SOUFFLE_GPU_ARTIFACTS=DIR``); with
TVM installed and no such directory, each model is compiled here first.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from souffle import models

pytestmark = pytest.mark.gpu
CONFIGS = [(name, config) for config in ("tiny", "paper") for name in models.MODELS]


def _prepared(name: str, config: str, tmp_path: Path) -> Path:
    exported = os.environ.get("SOUFFLE_GPU_ARTIFACTS")
    if exported:
        return Path(exported) / f"{name}_{config}"
    import souffle

    graph = models.build(name, config)
    target = souffle.compile(graph, target="cuda").artifact(config=config).save(tmp_path / name)
    inputs = models.make_inputs(name, config, seed=1)
    np.savez(target / "inputs.npz", **inputs)
    np.savez(target / "expected.npz", *models.reference(name, config, graph.weights)(inputs))
    rtol, atol = models.tolerance(name, config)
    (target / "check.json").write_text(json.dumps({"rtol": rtol, "atol": atol}))
    return target


@pytest.mark.parametrize("name,config", CONFIGS)
def test_kernel_matches_pytorch(name, config, tmp_path):
    from souffle.runtime.artifact import KernelArtifact, Launcher

    directory = _prepared(name, config, tmp_path)
    artifact = KernelArtifact.load(directory)
    check = json.loads((directory / "check.json").read_text())
    inputs = dict(np.load(directory / "inputs.npz"))
    launcher = Launcher(artifact)
    assert 1 <= launcher.grid <= launcher.device.sms * launcher.blocks_per_sm
    outputs = launcher.run([np.ascontiguousarray(inputs[s.name]).reshape(-1) for s in artifact.inputs])
    for got, want, slot in zip(outputs, np.load(directory / "expected.npz").values(), artifact.outputs):
        np.testing.assert_allclose(got, want, rtol=check["rtol"], atol=check["atol"], err_msg=slot.name)
