// Included by TVM's CUDA source; souffle_emulated.h (included first) defines what the emulated build needs.
#pragma once
