"""A tensor's static description, shared by the graph IR and the op rules.

It lives apart from ``souffle.graph`` so that ``souffle.ops`` (whose rules check ``TensorSpec``s)
does not import the graph, which itself calls the ops' rules to validate every op.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from souffle.errors import GraphError

SUPPORTED_DTYPES = ("float32", "float16", "int32", "int64")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, static shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self):
        try:
            shape = tuple(int(d) for d in self.shape)
        except (TypeError, ValueError):
            raise GraphError(f"tensor {self.name!r}: shape {self.shape!r} is not a sequence of ints") from None
        object.__setattr__(self, "shape", shape)
        if self.dtype not in SUPPORTED_DTYPES:
            raise GraphError(
                f"tensor {self.name!r}: dtype {self.dtype!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_DTYPES)})"
            )
        if any(d <= 0 for d in self.shape):
            raise GraphError(f"tensor {self.name!r}: shape {self.shape} has a non-positive dimension")

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __str__(self):
        return f"{self.name}: {self.dtype}{list(self.shape)}"
