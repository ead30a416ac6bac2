"""Where lowered device code accumulates in global memory.

A reduction whose running value lives in a global buffer loads and stores it at every step:
``C[i] = C[i] + a[k] * b[k]`` inside the ``k`` loop, with ``C[i]`` at an index that does not
move with ``k``. nvcc cannot keep it in a register, since the kernel's buffers may alias (the
arena's views all hang off one pointer), so each step is a round trip to L2. The GPU schedules
accumulate in registers (``local``) or shared memory and store once; this reader finds the
stores that break that, in the TIR that TVM hands to its CUDA code generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad builds
from tvm_ffi import structural_equal

_SERIAL = (tirx.ForKind.SERIAL, tirx.ForKind.UNROLLED)


@dataclass(frozen=True)
class GlobalAccumulation:
    """A store that reads back its own global element across iterations of ``loop``."""

    kernel: str
    buffer: str
    loop: str

    def __str__(self):
        return f"{self.kernel}: {self.buffer} is loaded and stored at every iteration of loop {self.loop}"


def global_accumulations(func: tirx.PrimFunc, kernel: str = "main") -> list[GlobalAccumulation]:
    """The read-modify-writes of a global element inside a serial loop whose variable its index
    does not use, each with the innermost such loop (one per buffer and loop). A loop whose body
    first stores the element unconditionally (an initialization run at every iteration, as
    in a reduction of one term) carries nothing across its iterations and does not count; the
    initialization of an in-place reduction runs under ``if (k == 0)`` and does not hide it."""
    found: dict = {}

    def visit(s, loops: tuple, unconditional: tuple):
        if isinstance(s, tirx.SeqStmt):
            for child in s.seq:
                visit(child, loops, unconditional)
        elif isinstance(s, tirx.For):
            if s.kind in _SERIAL:
                loop = _Loop(s.loop_var)
                loops, unconditional = loops + (loop,), unconditional + (loop,)
            visit(s.body, loops, unconditional)
        elif isinstance(s, tirx.IfThenElse):
            visit(s.then_case, loops, ())
            if s.else_case is not None:
                visit(s.else_case, loops, ())
        elif isinstance(s, tirx.BufferStore):
            if s.buffer.scope() != "global":
                return
            element = (s.buffer, list(s.indices))
            if not _loads_element(s.value, s.buffer, s.indices):
                for loop in unconditional:
                    loop.initialized.append(element)
                return
            used = [v for i in s.indices for v in tirx.analysis.undefined_vars(i)]
            steps = [loop for loop in loops if not any(loop.var.same_as(v) for v in used)
                     and not any(b.same_as(s.buffer) and structural_equal(i, element[1]) for b, i in loop.initialized)]
            if steps:
                name = steps[-1].var.name
                found.setdefault((s.buffer.name, name), GlobalAccumulation(kernel, s.buffer.name, name))
        elif hasattr(s, "body"):
            visit(s.body, loops, unconditional)

    visit(func.body, (), ())
    return list(found.values())


class _Loop:
    """A serial loop being walked, with the global elements its body has stored unconditionally."""

    def __init__(self, var: tirx.Var):
        self.var = var
        self.initialized: list = []


def _loads_element(e, buffer: tirx.Buffer, indices) -> bool:
    """Whether ``e`` loads ``buffer`` at ``indices`` (the same data, the same index expressions)."""
    if isinstance(e, TensorLoad):
        if e.source.same_as(buffer) and structural_equal(list(e.indices), list(indices)):
            return True
        return any(_loads_element(i, buffer, indices) for i in e.indices)
    if isinstance(e, tvm.ir.Call):
        return any(_loads_element(a, buffer, indices) for a in e.args)
    if isinstance(e, tirx.Let):
        return _loads_element(e.value, buffer, indices) or _loads_element(e.body, buffer, indices)
    return any(_loads_element(getattr(e, name), buffer, indices)
               for name in ("a", "b", "value", "condition", "true_value", "false_value", "base", "stride")
               if isinstance(getattr(e, name, None), tirx.Expr))
