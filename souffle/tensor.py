"""A tensor's static description, shared by the graph IR and the op rules.

It lives apart from ``souffle.graph`` so that ``souffle.ops`` (whose rules check ``TensorSpec``s)
does not import the graph, which itself calls the ops' rules to validate every op.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np

from souffle.errors import GraphError

SUPPORTED_DTYPES = ("float32", "float16", "int32", "int64")

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
