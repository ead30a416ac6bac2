"""TF32 wmma fragments through TVM's CUDA code generator (``precision="tf32"``).

CUDA declares the operand fragments of a float32 product on tensor cores (m16n16k8) with the
element type ``nvcuda::wmma::precision::tf32``, which TVM 0.27's ``CodeGenCUDA`` does not print: it
refuses float32 ``wmma.matrix_a`` and ``wmma.matrix_b`` fragments ("Matrix_a and matrix_b only
support half or ..."). So ``codegen.tensor_core`` declares them float16, a carrier dtype the
generator accepts (``unsafe_set_dtype`` after tensorizing: no element of a fragment is read or
written outside the wmma calls, which load them from the float32 slices), and ``tf32_source``
rewrites what the generator prints:

- ``fragment<matrix_a, 16, 16, 8, half, ...>`` (a shape float16 does not have, so no float16
  fragment is rewritten) becomes ``precision::tf32``;
- every load into such a fragment is followed by ``__float_to_tf32`` on its elements, as CUDA's
  programming guide asks: the tensor cores otherwise drop the 13 low bits (truncation), where
  PyTorch's TF32 and cuBLAS round.
"""

from __future__ import annotations

import re

_HALF_TF32_FRAGMENT = re.compile(r"nvcuda::wmma::fragment<nvcuda::wmma::(matrix_[ab]), 16, 16, 8, half, ")
_DECLARED = re.compile(r"nvcuda::wmma::fragment<nvcuda::wmma::matrix_[ab], 16, 16, 8, nvcuda::wmma::precision::tf32, "
                       r"nvcuda::wmma::\w+> (\w+)\[")


def tf32_source(source: str) -> str:
    """``source`` with the carrier float16 operand fragments of shape m16n16k8 declared TF32,
    each load into one rounding its elements to TF32."""
    source = _HALF_TF32_FRAGMENT.sub(r"nvcuda::wmma::fragment<nvcuda::wmma::\1, 16, 16, 8, "
                                     r"nvcuda::wmma::precision::tf32, ", source)
    fragments = set(_DECLARED.findall(source))
    if not fragments:
        return source
    load = re.compile(r"^(\s*)nvcuda::wmma::load_matrix_sync\(((?:" + "|".join(map(re.escape, sorted(fragments)))
                      + r")\[[^\]]*\]),.*;$", re.MULTILINE)
    return load.sub(lambda m: f"{m.group(0)}\n{m.group(1)}for (int t = 0; t < {m.group(2)}.num_elements; ++t) "
                              f"{m.group(2)}.x[t] = nvcuda::wmma::__float_to_tf32({m.group(2)}.x[t]);", source)
