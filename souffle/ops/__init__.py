"""Op kinds, their TE lowerings and ONNX export rules. Importing this package registers them all."""

from souffle.ops.registry import (
    REGISTRY,
    OpRule,
    export_rule,
    get_export_rule,
    get_rule,
    infer_outputs,
    lower_op,
    register_op,
)
from souffle.ops import elementwise, logical, math, nn, packed, shape  # noqa: F401  (registration side effects)

__all__ = [
    "REGISTRY", "OpRule", "export_rule", "get_export_rule", "get_rule", "infer_outputs", "lower_op", "register_op",
]
