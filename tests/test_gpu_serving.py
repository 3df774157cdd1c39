"""GPU tier: the serving entry points on real hardware (skipped without a CUDA device):
``attention_varlen`` with offsets on the device and ``attention_with_kvcache`` appending into a
device cache (contiguous or paged), in CuPy and (where torch has CUDA) torch, against float64
references."""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import (
    appended_cache,
    check_kvcache,
    check_varlen,
    example_variants,
    gather_pages,
    kvcache_data,
    kvcache_reference,
    nan_past_lengths,
    packed_varlen,
    paged_cache,
    varlen_reference,
)
from conftest import POINTER_SPEC_PATHS, ROOT, WGMMA_SPEC_PATHS
from test_gpu_attention import device_variants, require_compute_capability_9_0

import kernelgen
from kernelgen.specs.forward import load_spec, spec_from_dict

pytestmark = pytest.mark.gpu

MIXED = ([3, 0, 1, 40, 40, 1, 2, 130], [7, 4, 0, 40, 40, 1, 300, 150])


def to_device(x: np.ndarray, dtype: str, library: str):
    """``x`` (values of ``dtype``) as a device array of ``library``."""
    import cupy

    from kernelgen.tuning.gpu import upload

    array = upload(cupy, np.ascontiguousarray(x, dtype=np.float32), dtype)
    if library == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA")
        return torch.from_dlpack(array)
    return array


def to_host(array) -> np.ndarray:
    """Any device array (CuPy or torch, any float dtype) as float64 NumPy."""
    import cupy

    from kernelgen.tuning.gpu import as_float32

    if not isinstance(array, cupy.ndarray):
        array = cupy.from_dlpack(array)
    return as_float32(cupy, array).get().astype(np.float64)


def offsets_on_device(offsets: np.ndarray, library: str):
    import cupy

    array = cupy.asarray(offsets, dtype=cupy.int32)
    return array if library == "cupy" else pytest.importorskip("torch").from_dlpack(array)


@pytest.mark.parametrize("library", ["cupy", "torch"])
@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "causal"),
    [("float16", 16, 2, True), ("bfloat16", 8, 1, False), ("float16", 4, 4, False)],
)
def test_varlen_on_gpu_with_device_offsets(library, dtype, heads, kv_heads, causal):
    q, k, v, cu_q, cu_k = packed_varlen(*MIXED, heads, kv_heads, dtype, seed=heads, head_dim=128)
    out, lse = kernelgen.attention_varlen(
        *(to_device(x, dtype, library) for x in (q, k, v)),
        offsets_on_device(cu_q, library),
        offsets_on_device(cu_k, library),
        max(MIXED[0]),
        max(MIXED[1]),
        causal=causal,
        return_lse=True,
    )
    lse = to_host(lse).astype(np.float32)
    check_varlen(to_host(out), lse, *varlen_reference(q, k, v, cu_q, cu_k, causal), dtype)


@pytest.mark.parametrize("library", ["cupy", "torch"])
@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "new_len", "lengths", "splits"),
    [
        ("bfloat16", 32, 8, 1, [0, 900, 4000], None),
        ("float16", 16, 1, 4, [7, 2000, 31], 5),
    ],
)
def test_kvcache_append_then_attend_on_gpu(
    library, dtype, heads, kv_heads, new_len, lengths, splits
):
    data = kvcache_data(len(lengths), new_len, new_len, 4100, heads, kv_heads, dtype, 7, 128)
    q, k_cache, v_cache, k_new, v_new = (to_device(x, dtype, library) for x in data)
    out, lse = kernelgen.attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        offsets_on_device(np.asarray(lengths, np.int32), library),
        k_new=k_new,
        v_new=v_new,
        causal=True,
        num_splits=splits,
        return_lse=True,
    )
    want = kvcache_reference(*data, lengths, True)
    check_kvcache(to_host(out), to_host(lse).astype(np.float32), *want, dtype)
    # the caches hold the new rows at lengths[b]:, and nothing else changed
    np.testing.assert_array_equal(to_host(k_cache), appended_cache(data[1], data[3], lengths))
    np.testing.assert_array_equal(to_host(v_cache), appended_cache(data[2], data[4], lengths))


def table_on_device(table: np.ndarray, library: str):
    return offsets_on_device(table, library)  # int32, same route as the offsets


@pytest.mark.parametrize("library", ["cupy", "torch"])
@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "new_len", "lengths", "page_size", "splits"),
    [
        ("bfloat16", 32, 8, 1, [0, 900, 4000, 1], 16, None),  # a lookup per key row
        ("float16", 16, 1, 4, [7, 2000, 31], 64, 5),  # a lookup per 64-key tile
        ("float16", 8, 8, 1, [255, 256, 1000], 256, None),
    ],
)
def test_paged_kvcache_append_then_attend_on_gpu(
    library, dtype, heads, kv_heads, new_len, lengths, page_size, splits
):
    """Device pages (shuffled, spare pages untouched), device block table and lengths: the
    append reads the metadata back once, validate=True checks it on the device."""
    max_keys = -(-(max(lengths) + new_len) // page_size) * page_size
    data = kvcache_data(len(lengths), new_len, new_len, max_keys, heads, kv_heads, dtype, 9, 128)
    k_pool, table, k_logical = paged_cache(data[1], page_size, seed=9)
    v_pool, _, v_logical = paged_cache(data[2], page_size, seed=9)
    q, k_new, v_new = (to_device(x, dtype, library) for x in (data[0], data[3], data[4]))
    k_device, v_device = (to_device(x, dtype, library) for x in (k_pool, v_pool))
    device_table = table_on_device(table, library)
    device_lengths = offsets_on_device(np.asarray(lengths, np.int32), library)
    out, lse = kernelgen.attention_with_kvcache(
        q,
        k_device,
        v_device,
        device_lengths,
        block_table=device_table,
        k_new=k_new,
        v_new=v_new,
        causal=True,
        num_splits=splits,
        return_lse=True,
    )
    want = kvcache_reference(data[0], k_logical, v_logical, data[3], data[4], lengths, True)
    check_kvcache(to_host(out), to_host(lse).astype(np.float32), *want, dtype)
    for pool, logical, new in ((k_device, k_logical, data[3]), (v_device, v_logical, data[4])):
        np.testing.assert_array_equal(
            gather_pages(to_host(pool), table), appended_cache(logical, new, lengths)
        )
    # attending again to the updated lengths, the metadata validated on the device
    totals = offsets_on_device(np.asarray(lengths, np.int32) + new_len, library)
    again = kernelgen.attention_with_kvcache(
        q, k_device, v_device, totals, block_table=device_table, validate=True
    )
    assert np.isfinite(to_host(again)).all()
    bad = table.copy()
    bad[0, 0] = k_pool.shape[0]  # past the last page
    with pytest.raises(kernelgen.InputError, match=r"block_table\[0, 0\]"):
        kernelgen.attention_with_kvcache(
            q, k_device, v_device, totals, block_table=table_on_device(bad, library), validate=True
        )


PAGED_SPEC_PATHS = [p for p in POINTER_SPEC_PATHS + WGMMA_SPEC_PATHS if load_spec(p).paged_kv]


@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
@pytest.mark.parametrize("path", PAGED_SPEC_PATHS, ids=lambda p: p.stem)
def test_paged_specs_on_gpu(path, page_size):
    """Each paged-KV spec of specs/, named explicitly, at pages smaller than its key tile and
    not dividing it, equal to it and a multiple of it: append 3 tokens, then attend (its
    variants with example values). A wgmma spec (9.0 devices) copies a key tile from one page
    by TMA where the page holds whole tiles, else row by row with cp.async."""
    spec = load_spec(path)
    wgmma = spec.engine.warp_specialized
    if wgmma:
        require_compute_capability_9_0()
    lengths, new_len, heads, kv_heads = [0, 1, 777, 3000], 3, 8, 2
    max_keys = -(-(max(lengths) + new_len) // page_size) * page_size
    data = kvcache_data(
        len(lengths), new_len, new_len, max_keys, heads, kv_heads, spec.dtype, page_size,
        spec.head_dim,
    )  # fmt: skip
    k_pool, table, k_logical = paged_cache(data[1], page_size, seed=page_size)
    v_pool, _, v_logical = paged_cache(data[2], page_size, seed=page_size)
    variants = example_variants(spec.variants, len(lengths), heads, page_size, window=(100, 7))
    q, k_new, v_new = (to_device(x, spec.dtype, "cupy") for x in (data[0], data[3], data[4]))
    k_device, v_device = (to_device(x, spec.dtype, "cupy") for x in (k_pool, v_pool))
    out, lse = kernelgen.attention_with_kvcache(
        q, k_device, v_device, lengths, block_table=table, k_new=k_new, v_new=v_new,
        causal=spec.causal, spec=spec, return_lse=True, **device_variants(variants),
    )  # fmt: skip
    want = kvcache_reference(
        data[0], k_logical, v_logical, data[3], data[4], lengths, spec.causal, **variants
    )
    check_kvcache(to_host(out), to_host(lse).astype(np.float32), *want, spec.dtype)


# The wgmma kernel's cp.async copies of pages that are no multiple of block_n (issue 33 "What
# to build"; tests/test_emulated_wgmma_paged_rows.py runs the same cases on the emulator): 64-
# and 128-key tiles, one and two consumer warpgroups.
PAGED_ROW_SPECS = {
    "n64-packed-split-causal": "v2_wg_f16_d128_m64_n64_s2_gqa_split_paged_causal.yaml",
    "n128": dict(block_m=64, block_n=128),
    "m128-n128-packed-split": dict(block_m=128, block_n=128, pack_gqa=True, split_kv=True),
}


@pytest.mark.parametrize("page_size", [16, 48, 80])
@pytest.mark.parametrize("name", PAGED_ROW_SPECS)
def test_wgmma_paged_rows_with_nan_tails_on_gpu(name, page_size):
    """Shuffled pages of 16, 48 and 80 keys, NaN in every row past each entry's keys after the
    append (the pages past them too), spare pages: out and lse finite and equal to float64."""
    require_compute_capability_9_0()
    fields = PAGED_ROW_SPECS[name]
    if isinstance(fields, str):
        spec = load_spec(ROOT / "specs" / fields)
    else:
        base = dict(loop_order="v2", mma="wgmma", dtype="float16", head_dim=128, paged_kv=True)
        spec = spec_from_dict({**base, **fields})
    lengths, new_len, heads, kv_heads = [37, 300, 1000, 1], 2, 8, 2
    max_keys = -(-1024 // page_size) * page_size  # past every length, a multiple of the pages
    data = kvcache_data(
        len(lengths), new_len, new_len, max_keys, heads, kv_heads, spec.dtype, 35, spec.head_dim
    )
    q, k_new, v_new = (to_device(x, spec.dtype, "cupy") for x in (data[0], data[3], data[4]))
    k_cache, v_cache = (nan_past_lengths(c, lengths, new_len) for c in data[1:3])
    k_pool, table, _ = paged_cache(k_cache, page_size, seed=35)
    v_pool, _, _ = paged_cache(v_cache, page_size, seed=35)  # same seed: same table
    k_device, v_device = (to_device(x, spec.dtype, "cupy") for x in (k_pool, v_pool))
    out, lse = kernelgen.attention_with_kvcache(
        q, k_device, v_device, np.asarray(lengths, np.int32), block_table=table, k_new=k_new,
        v_new=v_new, causal=spec.causal, spec=spec, return_lse=True,
        num_splits=3 if spec.split_kv else None,
    )  # fmt: skip
    want = kvcache_reference(data[0], k_cache, v_cache, data[3], data[4], lengths, spec.causal)
    check_kvcache(to_host(out), to_host(lse).astype(np.float32), *want, spec.dtype)


# Issue 33: every d128 bf16 loop (plain, overlapped, Q in registers, ping-pong), split-KV decode
# and the paged spec (tests/test_emulated_wgmma_nan_rows.py runs the same on the emulator).
NAN_ROW_SPECS = [
    "v2_wg_bf16_d128_m128_n128_s2",
    "v2_wg_bf16_d128_m128_n128_s3_ovl",
    "v2_wg_bf16_d128_m128_n128_s2_qr",
    "v2_wg_bf16_d128_m128_n64_s2_pp_causal",
    "v2_wg_bf16_d128_m64_n128_s2_gqa_split",
    "v2_wg_f16_d128_m64_n64_s2_gqa_split_paged_causal",
]


@pytest.mark.parametrize("name", NAN_ROW_SPECS)
def test_wgmma_cache_rows_past_the_lengths_hold_nan_on_gpu(name):
    """The cache rows past each entry's keys after the append hold NaN (never-written
    cupy.empty / torch.empty memory, a freed page; paged: the pages past them too), which a
    wgmma kernel's TMA copies with the last key tile: out and lse must be finite and equal to
    float64 attention of each entry's own keys."""
    require_compute_capability_9_0()
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    lengths, new_len, heads, kv_heads, page_size = [37, 300, 1000, 1], 2, 8, 2, 128
    max_keys = 1152  # past every length, a multiple of the pages
    data = kvcache_data(
        len(lengths), new_len, new_len, max_keys, heads, kv_heads, spec.dtype, 33, spec.head_dim
    )
    q, k_new, v_new = (to_device(x, spec.dtype, "cupy") for x in (data[0], data[3], data[4]))
    k_cache, v_cache = (nan_past_lengths(c, lengths, new_len) for c in data[1:3])
    table = None
    if spec.paged_kv:
        k_pool, table, _ = paged_cache(k_cache, page_size, seed=33)
        v_pool, _, _ = paged_cache(v_cache, page_size, seed=33)  # same seed: same table
        k_device, v_device = (to_device(x, spec.dtype, "cupy") for x in (k_pool, v_pool))
    else:
        k_device, v_device = (to_device(x, spec.dtype, "cupy") for x in (k_cache, v_cache))
    out, lse = kernelgen.attention_with_kvcache(
        q, k_device, v_device, np.asarray(lengths, np.int32), block_table=table, k_new=k_new,
        v_new=v_new, causal=spec.causal, spec=spec, return_lse=True,
        num_splits=3 if spec.split_kv else None,
    )  # fmt: skip
    want = kvcache_reference(data[0], k_cache, v_cache, data[3], data[4], lengths, spec.causal)
    check_kvcache(to_host(out), to_host(lse).astype(np.float32), *want, spec.dtype)
