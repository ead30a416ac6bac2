"""The persistent kernels on a GPU (``-m gpu``): every model's outputs match PyTorch at the tiny
and paper configs, and the cooperative launch uses a co-resident grid.

A lent GPU machine has no TVM, so by default these run the O4 bundles that
``python benchmarks/gpu_kernels.py export DIR`` wrote (``SOUFFLE_GPU_ARTIFACTS=DIR``); with
TVM installed and no such directory, each model is compiled here first. Outputs are poisoned
(NaN) before the launch, so an element no thread wrote fails.
"""

import os
from pathlib import Path

import numpy as np
import pytest

from souffle import models

pytestmark = pytest.mark.gpu
CONFIGS = [(name, config) for config in ("tiny", "paper") for name in models.MODELS]


def _bundle(name: str, config: str, tmp_path: Path) -> Path:
    exported = os.environ.get("SOUFFLE_GPU_ARTIFACTS")
    if exported:
        return Path(exported) / f"{name}_{config}_O4"
    from souffle.compiler import export_check

    export_check(name, config, tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("name,config", CONFIGS)
def test_kernel_matches_pytorch(name, config, tmp_path):
    from souffle.runtime.artifact import Launcher
    from souffle.runtime.check import Check

    check = Check.load(_bundle(name, config, tmp_path))
    launcher = Launcher(check.artifact)
    assert 1 <= launcher.grid <= launcher.device.sms * launcher.blocks_per_sm
    outputs = launcher.run(check.inputs, poison=True)
    for got, want, slot in zip(outputs, check.expected, check.artifact.outputs):
        np.testing.assert_allclose(got, want, rtol=check.rtol, atol=check.atol, err_msg=slot.name)
