"""Test doubles and test hooks: host-only fakes of CuPy and torch (``fake_cupy``, ``fake_torch``)
for the CPU tests and the host-path benchmark, and NaN-poisoned outputs for correctness checks
on a GPU (``poison``). Nothing in kernelgen's own call path imports this package."""
