"""Compute precision: a float32 model computed in float16, bfloat16 or TF32
(``souffle.compile(..., precision=)``).

``tf32`` leaves every tensor float32 and lets the CUDA targets multiply float32 GEMMs on tensor
cores in TF32, as PyTorch's ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` does: the
operands rounded to 10 bits of significand (float16's), float32's range, products accumulated in
float32 (``codegen.tensor_core``: m16n16k8 fragments). The CPU targets have no TF32 and compute
it in float32. The rest of this module is about ``fp16`` and ``bf16``:

Mixed precision as torch.autocast and cuBLAS do it: the weights are converted once, at
compile time, and every float tensor inside the model is float16 (``fp16``) or bfloat16
(``bf16``: float32's range, 8 bits of significand), while

- GEMM-shaped ops (dense, matmul, batch_matmul, conv2d) multiply narrow operands and
  accumulate in float32 (``out_dtype`` of TVM's topi), then round to the narrow type, the form
  the tensor-core schedules match (``codegen.tensor_core``);
- ops whose narrow arithmetic would lose the answer (softmax, layer and batch norm,
  reductions, exp/log/erf/tanh and the activations built on them) compute in float32 and
  round their outputs (``souffle.ops.registry``: the rules registered ``widen=True``);
- the model's float inputs and outputs stay float32: a cast is the first op that reads an
  input and the last that writes an output, so callers pass and get what they did before.

Integer tensors (token ids, masks given as integers) are left alone.
"""

from __future__ import annotations

import math

import numpy as np

from souffle import recipe
from souffle.errors import SouffleError
from souffle.graph import Graph, Op, Scan
from souffle.tensor import TensorSpec, largest_finite, ml_dtypes

PRECISIONS = {"fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # -> tensor dtype
DEFAULT_PRECISION = "fp32"


def check_precision(precision: str) -> str:
    """``precision`` if this compiler computes in it, else a SouffleError naming the choices."""
    if precision in PRECISIONS:
        if PRECISIONS[precision] == "bfloat16" and ml_dtypes is None:
            raise SouffleError(f"precision {precision!r} needs numpy's bfloat16 from ml_dtypes; install it with "
                               f"`pip install ml_dtypes`")
        return precision
    raise SouffleError(f"unknown precision {precision!r}; available: {', '.join(PRECISIONS)}")


def with_precision(graph: Graph, precision: str) -> tuple[Graph, list[str]]:
    """``graph`` computed in ``precision``, and what was converted (one line per kind of change)."""
    dtype = PRECISIONS[check_precision(precision)]
    if precision == "tf32":
        return graph, ["float32 tensors; GEMM-shaped stages on CUDA tensor cores multiply in TF32 (operands rounded "
                       "to 10 bits of significand) and accumulate in float32; the CPU targets compute float32"]
    if dtype == "float32":
        return graph, []
    floats = [s for s in graph.params.values() if s.dtype == "float32"]
    float_inputs = [s.name for s in graph.inputs if s.dtype == "float32"]
    float_outputs = [n for n in graph.outputs if graph.tensors[n].dtype == "float32"]
    # inside the model, a float input or output is the tensor of its name and the precision
    inner = {n: f"{n}.{precision}" for n in float_inputs + float_outputs}
    entry = [Op("cast", (n,), (inner[n],), {"dtype": dtype}) for n in float_inputs]
    saturated: list[str] = []
    ops = _retyped(graph.ops, dtype, lambda n: inner.get(n, n), saturated)
    exits = [Op("cast", (inner[n],), (n,), {"dtype": "float32"}) for n in float_outputs]
    converted = Graph(graph.name, graph.inputs, [_narrowed(s, dtype) for s in graph.params.values()],
                      entry + ops + exits, graph.outputs,
                      None if graph.weights is None else _converted_weights(graph, dtype),
                      {**graph.recipes, **{s.name: recipe.cast(graph.recipe(s.name), dtype) for s in floats}})
    converted.weight_notes = graph.weight_notes
    notes = [f"{len(floats)} float32 weights converted to {dtype} at compile time (rounded to nearest)",
             f"{len(entry)} float32 inputs and {len(exits)} outputs cast at the model's edge",
             "GEMM-shaped ops accumulate in float32; softmax, norms, reductions and transcendental "
             "functions compute in float32"]
    if saturated:
        notes.append(f"float32 constants beyond {dtype}'s range made its largest finite value, "
                     f"+-{largest_finite(dtype):g}, as torch.finfo({dtype}).min stands for float32's in a model "
                     f"run in {dtype} (an attention mask's): {', '.join(saturated)}")
    return converted, notes


def _narrowed(spec: TensorSpec, dtype: str) -> TensorSpec:
    return TensorSpec(spec.name, spec.shape, dtype) if spec.dtype == "float32" else spec


def _retyped(ops, dtype: str, name, saturated: list[str]) -> list:
    """``ops`` reading and writing ``name(n)``, casts to float32 and float32 constants made
    ``dtype``, scan bodies computing in ``dtype``. A finite constant beyond ``dtype``'s range
    (``torch.finfo(torch.float32).min``, Hugging Face BERT's masked score) becomes its largest
    finite value of that sign, named in ``saturated``: rounded, it would be an infinity."""
    retyped = []
    for op in ops:
        if isinstance(op, Scan):
            retyped.append(_converted_scan(op, dtype, name, saturated))
            continue
        attrs = dict(op.attrs)
        if op.kind in ("cast", "full") and attrs.get("dtype", "float32") == "float32":
            attrs["dtype"] = dtype
            value = attrs.get("value", 0.0)
            if op.kind == "full" and math.isfinite(value) and abs(value) > largest_finite(dtype):
                attrs["value"] = math.copysign(largest_finite(dtype), value)
                saturated.append(op.outputs[0])
        retyped.append(Op(op.kind, tuple(map(name, op.inputs)), tuple(map(name, op.outputs)), attrs))
    return retyped


def _converted_scan(scan: Scan, dtype: str, name, saturated: list[str]) -> Scan:
    """A scan whose body computes in ``dtype``: its float inputs, parameters and outputs are
    the outer graph's inner tensors, so the body keeps its names and converts no edge."""
    body = scan.body
    converted = Graph(body.name, [_narrowed(s, dtype) for s in body.inputs],
                      [_narrowed(s, dtype) for s in body.params.values()],
                      _retyped(body.ops, dtype, lambda n: n, saturated), body.outputs)
    return Scan(scan.name, converted, scan.length,
                tuple((i, o, name(init), name(final)) for i, o, init, final in scan.carry),
                tuple((i, name(outer)) for i, outer in scan.xs),
                tuple((o, name(outer)) for o, outer in scan.ys),
                tuple((i, name(outer)) for i, outer in scan.invariants),
                scan.params)


def _converted_weights(graph: Graph, dtype: str) -> dict[str, np.ndarray]:
    """Every float32 weight rounded to ``dtype``; one that overflows it is refused by name."""
    converted = {}
    with np.errstate(over="ignore"):
        for name, array in graph.weights.items():
            if array.dtype != np.float32:
                converted[name] = array
                continue
            narrow = array.astype(dtype)
            overflow = np.isfinite(array) & ~np.isfinite(narrow)
            if overflow.any():
                first = array.reshape(-1)[np.flatnonzero(overflow)[0]].item()
                raise SouffleError(f"weight {name!r} of {graph.name!r}: {np.count_nonzero(overflow)} values overflow "
                                   f"{dtype}, whose largest is {largest_finite(dtype):g} (the first: {first!r}); "
                                   f"compile it at precision fp32")
            converted[name] = narrow
    return converted
