"""Souffle: compile a whole DNN into as few kernels as the hardware allows.

The compiler (TVM) is imported on first use, so ``souffle.runtime`` loads and launches a
compiled kernel on a machine with only numpy and cuda-python.
"""

from souffle.errors import (
    GraphError,
    InputError,
    ModelImportError,
    SouffleError,
    TargetError,
    UnknownModelError,
    UnknownOpError,
    UnsupportedOpError,
    WeightError,
)
from souffle.graph import Graph, GraphBuilder, Op, Scan, TensorSpec

_LAZY = {"compile": "souffle.compiler", "CompiledModel": "souffle.compiler", "Report": "souffle.compiler",
         "stage_workloads": "souffle.compiler",
         "models": "souffle.models", "from_torch": "souffle.importers.torch_export",
         "from_onnx": "souffle.importers.onnx_import"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name])
        return module if name == "models" else getattr(module, name)
    raise AttributeError(f"module 'souffle' has no attribute {name!r}")

__all__ = [
    "CompiledModel", "Graph", "GraphBuilder", "GraphError", "InputError", "ModelImportError", "Op", "Report",
    "Scan", "SouffleError", "TargetError", "TensorSpec", "UnknownModelError", "UnknownOpError",
    "UnsupportedOpError", "WeightError", "compile", "from_onnx", "from_torch", "models", "stage_workloads",
]
