// Included by TVM's CUDA source; souffle_emulated.h (included first) defines what the emulated build needs.
#pragma once
#define CUDART_INF_F __builtin_huge_valf()
#define CUDART_NAN_F __builtin_nanf("")
#define CUDART_INF __builtin_huge_val()
#define CUDART_NAN __builtin_nan("")
