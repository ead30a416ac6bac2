"""A tensor's static description, shared by the graph IR and the op rules.

It lives apart from ``souffle.graph`` so that ``souffle.ops`` (whose rules check ``TensorSpec``s)
does not import the graph, which itself calls the ops' rules to validate every op.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np

try:  # registers numpy's "bfloat16" dtype (TVM's arrays use it); absent where only kernels run
    import ml_dtypes  # noqa: F401
except ImportError:  # the GPU machine's Python: numpy, torch and cuda-bindings, no bfloat16 models
    ml_dtypes = None

from souffle.errors import GraphError

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16", "int32", "int64")
# what the importers take; a bfloat16 model is a float32 one compiled at precision="bf16"
IMPORTED_DTYPES = ("float32", "float16", "int32", "int64")
NARROW_FLOATS = ("float16", "bfloat16")  # computed in float32 where their arithmetic would lose the answer


def numpy_dtype(name: str) -> np.dtype:
    """numpy's dtype for the dtype ``name``: bfloat16 is ml_dtypes' where it is installed, else
    uint16 holding its bits (the GPU machine runs kernels, it computes nothing in bfloat16)."""
    if name == "bfloat16" and ml_dtypes is None:
        return np.dtype(np.uint16)
    return np.dtype(name)


def converted(array, name: str) -> np.ndarray:
    """``array`` converted to the dtype ``name``, floats rounded to nearest even; to bfloat16
    without ml_dtypes, as its bits (``numpy_dtype``), rounded as ml_dtypes and the GPU round."""
    array = np.asarray(array)
    if name != "bfloat16" or ml_dtypes is not None:
        return array.astype(name)
    bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | 0x40).astype(np.uint16)  # a NaN stays a NaN: its sign and top bits, made quiet
    return np.where(np.isnan(array), quiet_nan, rounded)


def largest_finite(dtype) -> float:
    """The largest finite value of the float ``dtype`` (numpy's finfo, ml_dtypes' for bfloat16)."""
    return float((ml_dtypes or np).finfo(dtype).max)


def is_float(dtype) -> bool:
    """Whether ``dtype`` (a name, or TVM's or numpy's dtype) is floating-point: bfloat16's name
    does not start with "float"."""
    return str(dtype).startswith(("float", "bfloat"))

# TVM indexes a buffer whose size fits in int32 with 32-bit integers, and every tensor is one flat
# buffer (or a slot of an arena, reached through a 64-bit pointer offset): an element index past
# this overflows in the generated code (LLVM refuses the literal; CUDA would wrap silently).
MAX_ELEMENTS = 2**31 - 1


def dimension(value, what: str) -> int:
    """``value`` as a Python int if it is an integer (a numpy integer included), else a GraphError:
    ``int()`` would truncate 1.5 to 1 and read True as 1 or "3" as 3."""
    if isinstance(value, (bool, np.bool_)):
        raise GraphError(f"{what}: {value!r} is a bool, not an integer")
    try:
        return operator.index(value)
    except TypeError:
        raise GraphError(f"{what}: {value!r} is a {type(value).__name__}, not an integer") from None


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, static shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self):
        try:
            dims = tuple(self.shape)
        except TypeError:
            raise GraphError(f"tensor {self.name!r}: shape {self.shape!r} is not a sequence of ints") from None
        shape = tuple(dimension(d, f"tensor {self.name!r}: shape {self.shape!r} is not a sequence of ints") for d in dims)
        object.__setattr__(self, "shape", shape)
        if self.dtype not in SUPPORTED_DTYPES:
            raise GraphError(
                f"tensor {self.name!r}: dtype {self.dtype!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_DTYPES)})"
            )
        if any(d <= 0 for d in self.shape):
            raise GraphError(f"tensor {self.name!r}: shape {self.shape} has a non-positive dimension")
        elements = math.prod(self.shape)
        if elements > MAX_ELEMENTS:
            raise GraphError(
                f"tensor {self.name!r}: shape {self.shape} has {elements} elements, more than the "
                f"{MAX_ELEMENTS} (2**31 - 1) the generated code can index (it indexes tensors with 32-bit integers)"
            )

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __str__(self):
        return f"{self.name}: {self.dtype}{list(self.shape)}"
