"""Benchmarks of kernelgen's attention kernels against their peers (docs/design.md).

Pure modules (no GPU, no torch, no CuPy): :mod:`bench.shapes`, :mod:`bench.metrics`,
:mod:`bench.candidates`, :mod:`bench.report`. The GPU layer is :mod:`bench.gpu`; the command
line is ``python -m bench.attention``; :mod:`bench.plot` needs matplotlib.
"""
