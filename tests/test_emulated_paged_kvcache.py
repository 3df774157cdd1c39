"""Emulation tier: ``kernelgen.attention_with_kvcache`` over a paged KV cache (``block_table``)
on NumPy arrays through the CPU backend: pages shuffled, shared between entries and of 16 to 256
keys, appended into in place, against float64 references over the concatenation; the launch
statistics show each key read once and no tile of padding; bad metadata raises before any
write."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from attention_cases import (
    SPARE_PAGE_VALUE,
    appended_cache,
    check_kvcache,
    gather_pages,
    kvcache_data,
    kvcache_reference,
    paged_cache,
)
from conftest import CPU_BACKEND_MARKS, host_dtype

import kernelgen
from kernelgen.calls.kvcache_checks import PagedLayout, validate_on_device
from kernelgen.errors import InputError, InputTypeError
from kernelgen.runtime import host as host

pytestmark = CPU_BACKEND_MARKS
HEAD_DIM = 32


def _paged_call(dtype, heads, kv_heads, seqlen_q, new_len, lengths, page_size, seed, **options):
    """Runs one paged call; returns (out, lse, the float64 reference, pools, table, logical
    caches before the call, new rows) with the pools already written."""
    shared = options.pop("shared", ())
    pages = -(-(max(lengths) + new_len) // page_size) + 1
    data = kvcache_data(
        len(lengths), seqlen_q, new_len, pages * page_size, heads, kv_heads, dtype, seed
    )
    q, k_cache, v_cache, k_new, v_new = data
    k_pool, table, k_logical = paged_cache(k_cache, page_size, seed, shared)
    v_pool, _, v_logical = paged_cache(v_cache, page_size, seed, shared)  # same seed: same table
    element = host_dtype(dtype)
    k_pool, v_pool = k_pool.astype(element), v_pool.astype(element)
    out, lse = kernelgen.attention_with_kvcache(
        q.astype(element),
        k_pool,
        v_pool,
        np.array(lengths, np.int32),
        block_table=table,
        k_new=k_new.astype(element) if new_len else None,
        v_new=v_new.astype(element) if new_len else None,
        return_lse=True,
        **options,
    )
    reference = kvcache_reference(
        q, k_logical, v_logical, k_new, v_new, lengths, options.get("causal", False)
    )
    return out, lse, reference, (k_pool, v_pool), table, (k_logical, v_logical), (k_new, v_new)


# dtype, heads, kv_heads, Sq, S_new, lengths, page_size, causal, num_splits, shared pages
CASES = [
    pytest.param("float16", 16, 2, 1, 1, [0, 1, 45], 16, False, 3, (), id="fp16-gqa8-p16-split3"),
    pytest.param("bfloat16", 8, 1, 2, 2, [1, 70, 0], 64, True, None, (), id="bf16-mqa-p64"),
    pytest.param("float32", 4, 2, 1, 1, [3, 0, 20], 16, True, 2, (), id="fp32-simt-p16"),
    pytest.param("float16", 8, 1, 1, 1, [0, 40, 260], 256, False, 2, (), id="fp16-mqa-p256"),
    pytest.param("bfloat16", 8, 1, 1, 1, [2, 150, 1, 0], 48, True, 1, (), id="bf16-long-p48"),
    pytest.param(
        "float16", 16, 2, 3, 3, [40, 40, 33], 16, True, 2, ((0, 1, 2), (0, 2, 2)), id="shared"
    ),
    # chunked prefill (24 queries x 4 heads per K/V head: not a decode step): no split-KV, no
    # GQA packing, a lookup per tile (16-key pages under 32-key tiles: per row; fp32: simt)
    pytest.param("float16", 8, 2, 24, 24, [0, 30, 5], 64, True, None, (), id="fp16-prefill-p64"),
    pytest.param("float32", 8, 2, 24, 24, [17, 0, 9], 16, True, None, (), id="fp32-prefill-p16"),
]


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "seqlen_q", "new_len", "lengths", "page_size", "causal",
     "splits", "shared"),
    CASES,
)  # fmt: skip
def test_paged_append_then_attend_equals_attending_to_the_concatenation(
    dtype, heads, kv_heads, seqlen_q, new_len, lengths, page_size, causal, splits, shared
):
    out, lse, reference, pools, table, logical, news = _paged_call(
        dtype, heads, kv_heads, seqlen_q, new_len, lengths, page_size, sum(lengths),
        causal=causal, num_splits=splits, shared=shared,
    )  # fmt: skip
    check_kvcache(out, lse, *reference, dtype)
    for pool, before, new in zip(pools, logical, news, strict=True):
        want = appended_cache(before, new, lengths).astype(pool.dtype)
        assert np.array_equal(gather_pages(pool, table), want), "only the new rows change"
        spare = np.setdiff1d(np.arange(pool.shape[0]), table)
        assert np.all(pool[spare].astype(np.float32) == SPARE_PAGE_VALUE), (
            "unused pages are untouched"
        )


def test_paged_equals_contiguous_without_new_tokens():
    """The same logical cache, contiguous and paged (pages of 16 under 64-key tiles: a lookup
    per row): bitwise equal outputs, LSE included (the same arithmetic in the same order)."""
    lengths = [17, 0, 64, 5]
    data = kvcache_data(4, 1, 0, 64, 8, 1, "bfloat16", seed=3)
    bf16 = host_dtype("bfloat16")
    q, k_cache, v_cache = (x.astype(bf16) for x in data[:3])
    k_pool, table, _ = paged_cache(data[1], 16, seed=3)
    v_pool, _, _ = paged_cache(data[2], 16, seed=3)
    k_pool, v_pool = k_pool.astype(bf16), v_pool.astype(bf16)
    contiguous = kernelgen.attention_with_kvcache(q, k_cache, v_cache, lengths, return_lse=True)
    paged = kernelgen.attention_with_kvcache(
        q, k_pool, v_pool, lengths, block_table=table, return_lse=True
    )
    for a, b in zip(contiguous, paged, strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_decode_reads_each_key_once_and_no_padding(monkeypatch, page_size):
    """GQA 8:1 split-KV decode over mixed lengths: the cp.async statistics of the pool show
    every used key row copied once per K/V head (bytes) and exactly the key tiles the lengths
    need (copies: BLOCK_N x chunks per tile), none for padding or unused pages."""
    stats, specs = [], []

    def counting(self, grid, block, args, shared_mem=0):
        values = [
            (host.array_at(int(a)) if int(a) else None) if type(a) is np.uint64 else a for a in args
        ]
        stats.append(self.kernel(grid=grid, block=block, shared_mem=shared_mem, args=values))

    real_kernel = host.emulated_kernel

    def recording(spec):
        specs.append(spec)
        return real_kernel(spec)

    monkeypatch.setattr(host._EmulatedFunction, "__call__", counting)
    monkeypatch.setattr(kernelgen.calls.attention, "emulated_kernel", recording)
    lengths, new_len, kv_heads = [1, 0, 70, 33], 1, 2
    out, lse, reference, *_ = _paged_call(
        "float16", 16, kv_heads, 1, new_len, lengths, page_size, 5, num_splits=3
    )
    check_kvcache(out, lse, *reference, "float16")
    (spec,) = specs
    assert spec.paged_kv and spec.pack_gqa and spec.split_kv
    totals = np.array(lengths) + new_len
    k_copies = sum(s.cp_async_copies_by_arg.get("k", 0) for s in stats)
    k_bytes = sum(s.cp_async_bytes_by_arg.get("k", 0) for s in stats)
    tiles = kv_heads * int(np.sum(-(-totals // spec.block_n)))
    assert k_copies == tiles * spec.block_n * (spec.head_dim_padded // 8)
    assert k_bytes == kv_heads * int(totals.sum()) * HEAD_DIM * 2


def _bad_paged_call(error, match, lengths=(3, 6), new_len=2, **changes):
    data = kvcache_data(2, 1, new_len, 32, 4, 2, "float16", seed=8)
    q, k_cache, v_cache, k_new, v_new = (x.astype(np.float16) for x in data)
    k_pool, table, _ = paged_cache(k_cache, 16, seed=8)
    v_pool, _, _ = paged_cache(v_cache, 16, seed=8)
    kwargs = {"q": q, "k_cache": k_pool, "v_cache": v_pool, "cache_seqlens": list(lengths)}
    kwargs.update(block_table=table, k_new=k_new, v_new=v_new)
    kwargs.update(changes)
    before = k_pool.copy(), v_pool.copy()
    with pytest.raises(error, match=match):
        kernelgen.attention_with_kvcache(**kwargs)
    assert np.array_equal(k_pool, before[0]) and np.array_equal(v_pool, before[1])


TABLE = np.array([[2, 0], [1, 3]], np.int32)
BAD = [
    pytest.param(
        InputError,
        r"block_table\[1, 0\] is 9; entry b=1 reads 8 keys, so its first 1 entries must be "
        r"page indices from 0 to 6 \(k_cache holds 7 pages\)",
        {"block_table": np.array([[2, 0], [9, 3]], np.int32)},
        id="page-out-of-range",
    ),
    pytest.param(
        InputError,
        r"block_table\[0, 0\] is -1",
        {"block_table": np.array([[-1, 0], [1, 3]], np.int32)},
        id="negative-page",
    ),
    pytest.param(
        InputError,
        r"cache_seqlens\[1\] is 31 and S_new is 2: 33 keys need 3 pages of 16 keys but "
        r"block_table has 2 pages per sequence",
        {"cache_seqlens": [3, 31]},
        id="too-few-pages",
    ),
    pytest.param(
        InputError,
        r"page_size 24 .* a positive multiple of 16",
        {
            "k_cache": np.zeros((4, 24, 2, 32), np.float16),
            "v_cache": np.zeros((4, 24, 2, 32), np.float16),
        },
        id="page-size",
    ),
    pytest.param(
        InputTypeError,
        "block_table has dtype int64; expected int32",
        {"block_table": TABLE.astype(np.int64)},
        id="table-dtype",
    ),
    pytest.param(
        InputTypeError,
        "block_table holds float64 values",
        {"block_table": [[2.0, 0.0], [1.0, 3.0]]},
        id="table-floats",
    ),
    pytest.param(
        InputError,
        r"block_table has shape \(2,\); expected \(2, pages per sequence\)",
        {"block_table": TABLE[:, 0].copy()},
        id="table-rank",
    ),
    pytest.param(
        InputError,
        r"block_table has shape \(3, 2\)",
        {"block_table": np.zeros((3, 2), np.int32)},
        id="table-batch",
    ),
    pytest.param(
        InputTypeError,
        "block_table has type str",
        {"block_table": "pages"},
        id="table-type",
    ),
    pytest.param(
        InputError,
        r"entries \[0, 1\] would all write k_new/v_new into page 2, row 3",
        {"block_table": np.array([[2, 0], [2, 3]], np.int32), "cache_seqlens": [3, 3]},
        id="shared-write",
    ),
    pytest.param(
        InputError,
        r"k_new has shape \(2, 2, 2, 16\)",
        {"k_new": np.zeros((2, 2, 2, 16), np.float16)},
        id="new-head-dim",
    ),
]


@pytest.mark.parametrize(("error", "match", "changes"), BAD)
def test_bad_paged_metadata_raises_before_any_write(error, match, changes):
    _bad_paged_call(error, match, **changes)


def test_entries_past_a_sequence_pages_are_not_read():
    """Unused block-table entries may hold anything (here -1 and a huge index)."""
    data = kvcache_data(2, 1, 1, 32, 4, 2, "float16", seed=12)
    k_pool, table, k_logical = paged_cache(data[1], 16, seed=12)
    v_pool, _, v_logical = paged_cache(data[2], 16, seed=12)
    table[0, 1], table[1, 1] = -1, 1 << 30
    out = kernelgen.attention_with_kvcache(
        data[0].astype(np.float16),
        k_pool.astype(np.float16),
        v_pool.astype(np.float16),
        [3, 15],
        block_table=table,
        k_new=data[3].astype(np.float16),
        v_new=data[4].astype(np.float16),
    )
    reference = kvcache_reference(data[0], k_logical, v_logical, data[3], data[4], [3, 15], False)
    check_kvcache(out, None, *reference, "float16")


def test_specs_must_match_the_cache_layout():
    data = kvcache_data(2, 1, 0, 32, 4, 2, "float16", seed=9)
    q, k_cache, v_cache = (x.astype(np.float16) for x in data[:3])
    k_pool, table, _ = paged_cache(k_cache, 16, seed=9)
    contiguous = kernelgen.default_spec("float16", HEAD_DIM, False, None, decode_rows=2)
    with pytest.raises(InputError, match="has paged_kv=False but the call needs paged_kv=True"):
        kernelgen.attention_with_kvcache(
            q, k_pool, k_pool, [1, 2], block_table=table, spec=contiguous
        )
    paged = contiguous.model_copy(update={"paged_kv": True})
    with pytest.raises(InputError, match="has paged_kv=True but the call needs paged_kv=False"):
        kernelgen.attention_with_kvcache(q, k_cache, v_cache, [1, 2], spec=paged)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_validate_checks_metadata_with_the_arrays_library(library):
    """validate=True's device checks, run here by NumPy and by torch on CPU tensors (the same
    code runs CuPy and CUDA torch arrays on their device): lengths and the block-table entries
    they use, messages as on the host; host lengths with a device table work too."""
    if library == "torch":
        torch = pytest.importorskip("torch")
        convert = torch.from_numpy
    else:
        convert = np.asarray
    layout = PagedLayout(5, 16, 2, None, np.zeros((2, 2), np.int32), 2)
    table = convert(np.array([[4, -1], [0, 5]], np.int32))

    def lengths(*values):
        return convert(np.array(values, np.int32))

    validate_on_device(lengths(16, 3), 0, 32, layout, table)  # unused entries: anything
    validate_on_device(np.array([16, 3]), 0, 32, layout, table)  # host lengths
    with pytest.raises(InputError, match=r"block_table\[1, 1\] is 5; entry b=1 reads 17 keys"):
        validate_on_device(lengths(16, 17), 0, 32, layout, table)
    with pytest.raises(InputError, match=r"block_table\[0, 0\] is 4; entry b=0 reads 1 keys"):
        validate_on_device(lengths(0, 3), 1, 32, replace(layout, num_pages=4), table)
    with pytest.raises(InputError, match=r"cache_seqlens\[0\] is 33 .* 2 pages per sequence"):
        validate_on_device(lengths(33, 1), 0, 32, layout, table)
    with pytest.raises(InputError, match=r"cache_seqlens\[1\] is -2"):
        validate_on_device(lengths(0, -2), 0, 32, None, None)
    validate_on_device(lengths(), 0, 32, None, None)  # an empty batch


def test_paged_decode_loop_with_torch_cpu_metadata():
    """Two decode steps on CPU torch tensors (bf16, MQA), cache_seqlens and block_table as
    int32 torch tensors, the caller advancing the lengths: each step equals attention over
    every token so far; the pages hold them where the table says."""
    torch = pytest.importorskip("torch")
    lengths = [15, 0, 31]
    first = kvcache_data(3, 1, 1, 48, 8, 1, "bfloat16", seed=21)
    second = kvcache_data(3, 1, 1, 48, 8, 1, "bfloat16", seed=22)
    k_pool, table, k_logical = paged_cache(first[1], 16, seed=21)
    v_pool, _, v_logical = paged_cache(first[2], 16, seed=21)
    k_pool, v_pool = (torch.from_numpy(x).to(torch.bfloat16) for x in (k_pool, v_pool))
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    news_k, news_v = [], []
    for step, (q, _, _, k_new, v_new) in enumerate((first, second)):
        out = kernelgen.attention_with_kvcache(
            torch.from_numpy(q).to(torch.bfloat16),
            k_pool,
            v_pool,
            seqlens,
            block_table=torch.from_numpy(table),
            k_new=torch.from_numpy(k_new).to(torch.bfloat16),
            v_new=torch.from_numpy(v_new).to(torch.bfloat16),
            causal=True,
        )
        news_k.append(k_new)
        news_v.append(v_new)
        k_all, v_all = np.concatenate(news_k, axis=1), np.concatenate(news_v, axis=1)
        ref = kvcache_reference(q, k_logical, v_logical, k_all, v_all, lengths, True)
        check_kvcache(out.float().numpy(), None, *ref, "bfloat16")
        seqlens += 1
        for b, length in enumerate(lengths):
            page, row = divmod(length + step, 16)
            assert torch.equal(k_pool[table[b, page], row].float(), torch.from_numpy(k_new[b, 0]))


# ---- mutations of the small-page lookup: each must give a wrong result ------------------------
PAGE_LOOKUP_MUTATIONS = {
    "a row takes the next page's entry": (
        "min(page_of_row - first, PAGES - 1)",
        "min(page_of_row - first + 1, PAGES - 1)",
    ),
    "the next tile's entries are not prefetched": (
        "      entry = table_entry(entry_first);\n      const bool copies",
        "      const bool copies",
    ),
}


@pytest.mark.parametrize("name", PAGE_LOOKUP_MUTATIONS)
def test_mutated_small_page_lookup_fails(tmp_path, monkeypatch, name):
    """Pages smaller than a key tile take their block-table entries from the lane that
    prefetched them; a wrong lane or a stale prefetch must change the output (the unmutated
    templates pass this case: test_paged_multi_tile_chunks_with_small_pages)."""
    import importlib
    import shutil

    from conftest import templates_at

    from kernelgen.runtime import host as host

    render = importlib.import_module("kernelgen.kernels.render")  # the package exports a render()
    original, mutated = PAGE_LOOKUP_MUTATIONS[name]
    folder = tmp_path / "templates"
    shutil.copytree(render.template_dir(), folder)
    path = folder / "fwd_tc_paged_kv.cuh.j2"  # the paged K/V source of the mma.sync kernel
    text = path.read_text()
    assert text.count(original) == 1, original
    path.write_text(text.replace(original, mutated))
    monkeypatch.setattr(host, "_KERNELS", {})
    with templates_at(monkeypatch, folder):
        # chunks of several key tiles, each spanning four or more pages
        out, lse, reference, *_ = _paged_call(
            "float16", 16, 2, 1, 1, [5, 200, 301], 16, 3, num_splits=2
        )
        with pytest.raises(AssertionError):
            check_kvcache(out, lse, *reference, "float16")


def test_paged_multi_tile_chunks_with_small_pages():
    """The mutation tests' case with the real templates: split chunks of several key tiles
    over 16-key pages in shuffled order (each tile's entries prefetched during the one before)."""
    out, lse, reference, *_ = _paged_call(
        "float16", 16, 2, 1, 1, [5, 200, 301], 16, 3, num_splits=2
    )
    check_kvcache(out, lse, *reference, "float16")
