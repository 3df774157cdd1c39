"""CPU tier: RuntimeKernel's two ways to a module (a cubin compiled offline, or CuPy's NVRTC),
with a fake CuPy; and the offline compile memo that keeps the cubin (compile tier)."""

from __future__ import annotations

import types

import pytest
from conftest import require_toolchain

from kernelgen.kernels.compile import nvrtc_available
from kernelgen.runtime import launch as launch
from kernelgen.specs.forward import spec_from_dict

SPLIT = spec_from_dict(
    {
        "loop_order": "v2",
        "mma": "mma_sync",
        "dtype": "float16",
        "head_dim": 128,
        "block_m": 16,
        "block_n": 64,
        "num_warps": 1,
        "stages": 3,
        "pack_gqa": True,
        "split_kv": True,
    }
)


class FakeCupy:
    """Records RawModule constructions; ``refuse`` makes loading a cubin fail as a driver would."""

    def __init__(self, refuse: bool = False) -> None:
        self.modules: list[dict] = []
        outer = self

        class CompileError(Exception):
            pass

        class RawModule:
            def __init__(self, **kwargs):
                outer.modules.append(kwargs)
                self.kwargs = kwargs

            def get_function(self, name):
                if "path" in self.kwargs and refuse:
                    raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")
                return types.SimpleNamespace(name=name, source=self.kwargs)

        self.RawModule = RawModule
        compiler = types.SimpleNamespace(CompileException=CompileError)
        self.cuda = types.SimpleNamespace(compiler=compiler)


@pytest.mark.parametrize("refuse", [False, True])
def test_a_cubin_is_loaded_or_the_source_compiled(monkeypatch, tmp_path, refuse, caplog):
    fake = FakeCupy(refuse=refuse)
    monkeypatch.setattr(launch, "import_cupy", lambda: fake)
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(b"\x7fELF")
    kernel = launch.RuntimeKernel(SPLIT, cubin)
    assert set(kernel.functions) == {SPLIT.uri, SPLIT.combine_uri}
    main = kernel.functions[SPLIT.uri]
    assert main.max_dynamic_shared_size_bytes == SPLIT.smem_bytes  # > 48 KiB: opted in
    if refuse:
        assert [sorted(m) for m in fake.modules] == [["path"], ["backend", "code", "options"]]
        assert "cannot load" in caplog.text and SPLIT.uri in caplog.text
        assert 'extern "C" __global__' in main.source["code"]
    else:
        assert fake.modules == [{"path": str(cubin)}]


def test_without_a_cubin_the_source_is_compiled(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setattr(launch, "import_cupy", lambda: fake)
    launch.RuntimeKernel(SPLIT)
    (module,) = fake.modules
    assert module["backend"] == "nvrtc" and "--use_fast_math" in module["options"]


@pytest.mark.compile
def test_offline_resources_keep_the_cubin(monkeypatch, tmp_path):
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings)")
    from kernelgen.tuning import candidates

    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    candidates.clear_resource_memo()
    assert candidates.offline_cubin(SPLIT, "sm_90") is None
    res = candidates.offline_resources(SPLIT, "sm_90")
    cubin = candidates.offline_cubin(SPLIT, "sm_90")
    assert cubin is not None and cubin.read_bytes()[:4] == b"\x7fELF"
    assert res.registers > 0 and res.spill_store_bytes == 0
    assert candidates.offline_cubin(SPLIT, "sm_80") is None  # another arch: not compiled


def _problem(batch: int, heads: int, kv_heads: int, seqlen_q: int, splits: int = 1):
    strides = (heads * seqlen_q * 128, seqlen_q * 128, 128)
    kv_strides = (kv_heads * 4096 * 128, 4096 * 128, 128)
    return launch.Problem(
        batch=batch,
        num_heads=heads,
        num_kv_heads=kv_heads,
        seqlen_q=seqlen_q,
        seqlen_k=4096,
        head_dim=128,
        q_strides=strides,
        k_strides=kv_strides,
        v_strides=kv_strides,
        out_strides=strides,
        num_splits=splits,
    )


PREFILL = spec_from_dict(
    {
        "loop_order": "v2",
        "mma": "mma_sync",
        "dtype": "float16",
        "head_dim": 128,
        "block_m": 64,
        "block_n": 64,
        "num_warps": 4,
        "stages": 2,
        "causal": True,
    }
)
SIMT = spec_from_dict(
    {"loop_order": "v2", "dtype": "float32", "head_dim": 128, "block_m": 64, "block_n": 32}
)


@pytest.mark.parametrize(
    ("spec", "problem", "row_tiles", "heads", "splits"),
    [
        (PREFILL, _problem(2048, 32, 32, 100), 2, 2048 * 32, 1),  # 65536 heads
        (SIMT, _problem(4096, 32, 8, 64), 1, 4096 * 32, 1),
        (SPLIT, _problem(4096, 32, 32, 1, splits=7), 1, 4096 * 32, 7),  # no GQA to pack
        (SPLIT, _problem(8192, 64, 8, 4, splits=3), 2, 8192 * 8, 3),  # packed: 4 x 8 rows
    ],
)
def test_large_batches_stay_within_the_grid_limits(spec, problem, row_tiles, heads, splits):
    # CUDA refuses a launch whose gridDim.y or .z passes 65535: batch x heads must not go there.
    grid, block = launch.launch_geometry(spec, problem)
    assert grid == (row_tiles * heads, splits, 1)
    assert all(n <= limit for n, limit in zip(grid, launch.MAX_GRID, strict=True))
    assert block == (spec.threads, 1, 1)


def test_a_grid_over_the_limit_is_an_input_error():
    from kernelgen.errors import InputError

    with pytest.raises(InputError, match=r"batch=2097152 .* CUDA's limit"):
        launch.launch_geometry(SIMT, _problem(2**21, 64, 64, 1024))
