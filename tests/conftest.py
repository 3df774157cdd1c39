"""Test tiers (docs/design.md): CPU always; compile always in CI (fails, never skips, when CI=true);
GPU (`-m gpu`) skipped where there is no CUDA device."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from kernelgen.families import family_of, load_any_spec
from kernelgen.specs.forward import KernelSpec, load_spec

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a folder of the repository, not of the package
    sys.path.insert(0, str(ROOT))
# Every spec file (build and its --check take them all); the forward family's, which most tiers
# run; the backward family's (test_emulated_backward.py, test_gpu_backward.py).
ALL_SPEC_PATHS = sorted((ROOT / "specs").glob("*.yaml"))
BACKWARD_SPEC_PATHS = [p for p in ALL_SPEC_PATHS if family_of(load_any_spec(p)) == "backward"]
SPEC_PATHS = [p for p in ALL_SPEC_PATHS if p not in BACKWARD_SPEC_PATHS]
# The Hopper (sm_90a) specs take tensor maps instead of pointers: their emulator and GPU tests
# are their own (test_emulated_wgmma.py); the rest run every other spec.
WGMMA_SPEC_PATHS = [p for p in SPEC_PATHS if load_spec(p).mma == "wgmma"]
POINTER_SPEC_PATHS = [p for p in SPEC_PATHS if p not in WGMMA_SPEC_PATHS]

IN_CI = os.environ.get("CI", "").lower() == "true"


def _head_dim_spec(index: int, head_dim: int) -> KernelSpec:
    """Tensor-core spec number ``index`` of the head-dim sweep: dtype, stages, layout and the
    causal mask vary along it (swizzled where the padded row holds whole groups of 8 chunks)."""
    padded = -(-head_dim // 16) * 16
    return KernelSpec(
        loop_order="v2",
        mma="mma_sync",
        dtype="bfloat16" if index % 2 == 0 else "float16",
        head_dim=head_dim,
        block_m=64,
        block_n=32,
        num_warps=4,
        stages=2 + index % 2,
        smem_layout="swizzled" if padded % 64 == 0 and index % 2 else "padded",
        causal=index % 3 == 0,
    )


# The tensor-core path takes every head dim from 32 to 256 in steps of 8.
HEAD_DIM_SWEEP = [_head_dim_spec(i, d) for i, d in enumerate(range(32, 257, 8))]


@cache
def cuda_device_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def require_toolchain(available: bool, what: str) -> None:
    """Skip outside CI when a tool is missing; in CI a missing tool is a failure."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is missing in CI (CI=true): the tier must run, not skip")
    pytest.skip(f"{what} is not installed")


def pytest_collection_modifyitems(config, items):
    if cuda_device_count() > 0:
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def install_fake_libraries(monkeypatch, launch, backed: bool = False) -> None:
    """CuPy and torch replaced by kernelgen.testing's host-only fakes (host memory behind every
    array with ``backed``), every runtime kernel calling ``launch(symbol, grid, block, args,
    shared_mem)`` instead of a GPU, the heuristic specs (no tuning), no remembered call
    plans or kernels. Fixtures that use it call ``clear_kernel_cache()`` when they end."""
    from kernelgen.calls import attention as api
    from kernelgen.runtime import launch as launch_module
    from kernelgen.runtime.launch import RuntimeKernel, clear_kernel_cache
    from kernelgen.testing import fake_cupy, fake_torch
    from kernelgen.tuning import gpu

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy.module(backed=backed))
    monkeypatch.setitem(sys.modules, "torch", fake_torch.module(backed=backed))
    monkeypatch.setattr(RuntimeKernel, "_compile", fake_cupy.stub_compile(launch))
    monkeypatch.setattr(
        RuntimeKernel, "encode_tensor_map", staticmethod(fake_cupy.encode_tensor_map)
    )
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    monkeypatch.setattr(api, "_CALL_PLANS", {})
    # the devices' facts are read afresh (a test may set fake_cupy.COMPUTE_CAPABILITY)
    monkeypatch.setattr(gpu, "_device", cache(gpu._device.__wrapped__))
    limits = cache(launch_module._device_limits.__wrapped__)
    monkeypatch.setattr(launch_module, "_device_limits", limits)
    clear_kernel_cache()


@pytest.fixture
def fake_runtime(monkeypatch):
    """:func:`install_fake_libraries` with launches that do nothing; the kernel cache is
    cleared afterwards."""
    from kernelgen.runtime.launch import clear_kernel_cache

    install_fake_libraries(monkeypatch, lambda *args: None)
    yield
    clear_kernel_cache()


def launched_kernel(symbol: str) -> tuple[KernelSpec, tuple]:
    """The spec of a compiled (faked) kernel symbol, main kernel or combine, and its parameter
    list, as the launch that used it saw them."""
    from kernelgen.kernels.render import combine_params, kernel_params
    from kernelgen.runtime.launch import _KERNELS

    spec = next(s for s, _ in _KERNELS if symbol in (s.uri, s.combine_uri))
    return spec, kernel_params(spec) if symbol == spec.uri else combine_params(spec)


@pytest.fixture(scope="session")
def spec_paths() -> list[Path]:
    return SPEC_PATHS


@pytest.fixture
def tuning_sandbox(tmp_path, monkeypatch):
    """A fresh tuning cache under tmp_path, default controls, an empty memo."""
    from kernelgen.tuning import clear_memo
    from kernelgen.tuning.db import _WARNED_CORRUPT, _WARNED_READ_ONLY

    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KERNELGEN_AUTOTUNE", raising=False)
    monkeypatch.delenv("KERNELGEN_PRINT_AUTOTUNING", raising=False)
    clear_memo()
    _WARNED_READ_ONLY.clear()
    _WARNED_CORRUPT.clear()
    yield
    clear_memo()


# ---- the CPU backend (attention() and its siblings on host arrays, through the emulator) ----
CPU_BACKEND_MARKS = [
    pytest.mark.emulate,
    pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning"),
    pytest.mark.usefixtures("cpu_backend_only"),
]


@pytest.fixture
def one_off_emulator_builds(tmp_path, monkeypatch):
    """An empty emulator build cache whose builds compile the shim as part of each kernel: no
    precompiled shim and no runtime library, which pay off only when later builds reuse them
    (a mutated emulator header changes their keys, so each mutation test built both for one
    kernel: about twice the g++ time)."""
    from kernelgen.emulator import kernel

    monkeypatch.setenv("KG_EMULATOR_CACHE", str(tmp_path / "emulator-cache"))
    monkeypatch.setattr(kernel, "_runtime_library", lambda *args: None)
    monkeypatch.setattr(kernel, "_precompiled_shim", lambda *args: None)


@pytest.fixture(autouse=True)
def _emulator_compiler(request):
    """Tests marked ``emulate`` need the emulator's C++ compiler: a failure in CI, a skip
    elsewhere."""
    if request.node.get_closest_marker("emulate") is not None:
        from kernelgen.emulator.kernel import compiler_available

        require_toolchain(compiler_available(), "g++ (for the CUDA emulator)")


@pytest.fixture
def cpu_backend_only(monkeypatch):
    """Nothing may reach the tuner or a GPU: the CPU backend takes the heuristic spec."""
    from kernelgen.calls import attention as api

    def refuse(*args, **kwargs):
        raise AssertionError("the CPU backend asked for a GPU or the tuner")

    monkeypatch.setattr(api, "device_arch", refuse)
    monkeypatch.setattr(api, "runtime_kernel", refuse)
    monkeypatch.setattr(api, "_CALL_PLANS", {})


def host_dtype(dtype: str):
    """The NumPy dtype of ``dtype`` (bfloat16 through ml_dtypes, skipped without it)."""
    if dtype == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(dtype)


@contextlib.contextmanager
def templates_at(monkeypatch, folder: Path) -> Iterator[None]:
    """Render (and emulate) from the templates in ``folder`` ($KERNELGEN_TEMPLATE_DIR) for the
    block: the caches of the templates' folder, hash, Jinja environment and built emulated
    kernels start afresh on entry and again on exit."""
    render = importlib.import_module("kernelgen.kernels.render")  # the package exports a render()
    launches = importlib.import_module("kernelgen.runtime.emulated_launch")
    caches = (render.environment, render.template_dir, render.template_hash, launches.spec_kernels)
    monkeypatch.setenv(render.TEMPLATE_DIR_ENV, str(folder))
    for cached in caches:
        cached.cache_clear()
    try:
        yield
    finally:
        monkeypatch.delenv(render.TEMPLATE_DIR_ENV, raising=False)
        for cached in caches:
            cached.cache_clear()
