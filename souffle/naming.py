"""Names: unique names within one scope, and C identifiers.

Every pass that invents tensors, stages or values (graph rewrites, the ONNX export, the staged
program, the analysis' names for TEs inside an op's lowering) takes its names from one
``UniqueNames``, and every name that reaches generated code goes through ``c_name``.
"""

from __future__ import annotations

from collections.abc import Iterable


def c_name(name: str) -> str:
    """``name`` as a C identifier: each character other than an ASCII letter, a digit or ``_``
    becomes ``_``, and one that would start with a digit (a scan body's ``0.norm1.weight``)
    starts with ``_``."""
    name = "".join(c if (c.isascii() and c.isalnum()) or c == "_" else "_" for c in name)
    return f"_{name}" if not name or name[0].isdigit() else name


class UniqueNames:
    """Hands out names not taken yet in one scope: ``base`` itself while it is free, else
    ``base<separator>k`` for the smallest free k from 2 (the second ``x`` is ``x:2``)."""

    def __init__(self, taken: Iterable[str] = (), separator: str = ":"):
        self.taken = set(taken)
        self.separator = separator

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}{self.separator}{k}"
        self.taken.add(name)
        return name

    def __contains__(self, name: str) -> bool:
        return name in self.taken

    def reserve(self, name: str) -> None:
        """Mark ``name`` as taken (a name chosen elsewhere, such as one the user gave)."""
        self.taken.add(name)
