"""Souffle: compile a whole DNN into as few kernels as the hardware allows."""

from souffle import models
from souffle.compiler import CompiledModel, Report, compile
from souffle.errors import (
    GraphError,
    InputError,
    SouffleError,
    TargetError,
    UnknownModelError,
    UnknownOpError,
    WeightError,
)
from souffle.graph import Graph, GraphBuilder, Op, Scan, TensorSpec

__all__ = [
    "CompiledModel", "Graph", "GraphBuilder", "GraphError", "InputError", "Op", "Report", "Scan",
    "SouffleError", "TargetError", "TensorSpec", "UnknownModelError", "UnknownOpError", "WeightError",
    "compile", "models",
]
