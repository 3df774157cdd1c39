"""Launching kernels: CuPy/torch/emulator backends, tensor maps, fp8 operands."""
