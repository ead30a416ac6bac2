"""Run compiled kernels on real hardware: nvcc compilation and the CUDA driver, without TVM."""
