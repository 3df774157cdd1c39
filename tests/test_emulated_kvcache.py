"""Emulation tier: ``kernelgen.attention_with_kvcache`` (a contiguous KV cache, k_new/v_new
appended in place) on NumPy arrays and CPU torch tensors through the CPU backend: appending then
attending equals attending to the concatenation (float64 per-sequence references), the cache
changes only in the appended rows, and bad input raises before any write."""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import appended_cache, check_kvcache, kvcache_data, kvcache_reference
from conftest import CPU_BACKEND_MARKS, host_dtype

import kernelgen
from kernelgen.errors import InputError, InputTypeError

pytestmark = CPU_BACKEND_MARKS
HEAD_DIM = 32


# dtype, heads, kv_heads, Sq, S_new, lengths (cache_seqlens), causal, num_splits
CASES = [
    pytest.param("float32", 4, 4, 1, 1, [0, 9, 38], False, None, id="fp32-mha-decode"),
    pytest.param("float16", 16, 2, 1, 1, [5, 0, 20], True, 3, id="fp16-gqa8-split3"),
    pytest.param("bfloat16", 8, 1, 3, 3, [0, 17, 36], True, 2, id="bf16-mqa-3new-split2"),
    pytest.param("float16", 8, 1, 4, 4, [7, 7, 7], True, None, id="fp16-mqa-4new-equal"),
    pytest.param("bfloat16", 16, 2, 2, 2, [30, 1, 12], False, 1, id="bf16-gqa8-2new-split1"),
]


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "seqlen_q", "new_len", "lengths", "causal", "splits"), CASES
)
def test_append_then_attend_equals_attending_to_the_concatenation(
    dtype, heads, kv_heads, seqlen_q, new_len, lengths, causal, splits
):
    data = kvcache_data(
        len(lengths), seqlen_q, new_len, 40, heads, kv_heads, dtype, seed=sum(lengths)
    )
    q, k_cache, v_cache, k_new, v_new = (x.astype(host_dtype(dtype)) for x in data)
    out, lse = kernelgen.attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        np.array(lengths, np.int32),
        k_new=k_new,
        v_new=v_new,
        causal=causal,
        num_splits=splits,
        return_lse=True,
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    check_kvcache(out, lse, *kvcache_reference(*data, lengths, causal), dtype)
    for cache, new, before in ((k_cache, k_new, data[1]), (v_cache, v_new, data[2])):
        want = appended_cache(before.astype(cache.dtype), new, lengths)
        assert np.array_equal(cache.view(np.uint8), want.view(np.uint8)), "only new rows change"


def test_without_new_tokens_attends_to_the_cache_lengths():
    """No k_new: q sees cache_seqlens[b] keys (an entry with none gives out 0, lse -inf); an int
    length serves every entry; the cache is not written."""
    data = kvcache_data(3, 2, 0, 24, 4, 2, "float16", seed=5)
    q, k_cache, v_cache = (x.astype(np.float16) for x in data[:3])
    before = k_cache.copy(), v_cache.copy()
    out, lse = kernelgen.attention_with_kvcache(
        q, k_cache, v_cache, [4, 0, 24], causal=True, return_lse=True
    )
    check_kvcache(out, lse, *kvcache_reference(*data, [4, 0, 24], True), "float16")
    out = kernelgen.attention_with_kvcache(q, k_cache, v_cache, 11, num_splits=2)
    check_kvcache(out, None, *kvcache_reference(*data, [11] * 3, False), "float16")
    assert np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1])


def test_decode_loop_with_torch_cpu_tensors():
    """Two steps of a decode loop on CPU torch tensors (bf16, GQA 8:1, split-KV), the caller
    advancing cache_seqlens (an int32 torch tensor): each step equals attention over every
    token appended so far; an entry starting empty works."""
    torch = pytest.importorskip("torch")
    lengths = [0, 13, 6]
    first = kvcache_data(3, 1, 1, 16, 8, 1, "bfloat16", seed=6)
    second = kvcache_data(3, 1, 1, 16, 8, 1, "bfloat16", seed=7)
    k_cache, v_cache = (torch.from_numpy(x).to(torch.bfloat16) for x in first[1:3])
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    news_k, news_v = [], []
    for q, _, _, k_new, v_new in (first, second):
        out = kernelgen.attention_with_kvcache(
            torch.from_numpy(q).to(torch.bfloat16),
            k_cache,
            v_cache,
            seqlens,
            k_new=torch.from_numpy(k_new).to(torch.bfloat16),
            v_new=torch.from_numpy(v_new).to(torch.bfloat16),
            causal=True,
            num_splits=2,
        )
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        news_k.append(k_new)
        news_v.append(v_new)
        k_all, v_all = np.concatenate(news_k, axis=1), np.concatenate(news_v, axis=1)
        ref = kvcache_reference(q, first[1], first[2], k_all, v_all, lengths, True)
        check_kvcache(out.float().numpy(), None, *ref, "bfloat16")
        seqlens += 1  # the caller advances the lengths


def _bad_call_leaves_cache_unchanged(error, match, **changes):
    data = kvcache_data(2, 1, 2, 8, 4, 2, "float16", seed=8)
    q, k_cache, v_cache, k_new, v_new = (x.astype(np.float16) for x in data)
    kwargs = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": [3, 6]}
    kwargs.update(k_new=k_new, v_new=v_new)
    kwargs.update(changes)
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(error, match=match):
        kernelgen.attention_with_kvcache(**kwargs)
    assert np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1])


BAD = [
    pytest.param(
        InputError,
        r"cache_seqlens\[1\] is 7 and S_new is 2: 9 keys",
        {"cache_seqlens": [0, 7]},
        id="overflow",
    ),
    pytest.param(
        InputError,
        r"cache_seqlens\[0\] is -1",
        {"cache_seqlens": np.array([-1, 0], np.int32)},
        id="negative",
    ),
    pytest.param(
        InputTypeError,
        "cache_seqlens has dtype float64; expected integers",
        {"cache_seqlens": np.array([1.0, 2.0])},
        id="float-array",
    ),
    pytest.param(
        InputError, r"cache_seqlens has shape \(3,\)", {"cache_seqlens": [1, 2, 3]}, id="shape"
    ),
    pytest.param(
        InputTypeError,
        "cache_seqlens has dtype float64",
        {"cache_seqlens": [1.0, 2.0]},
        id="floats",
    ),
    pytest.param(InputError, "k_new is given but v_new is not", {"v_new": None}, id="k-only"),
    pytest.param(
        InputTypeError,
        "k_new has dtype float32",
        {"k_new": np.zeros((2, 2, 2, 32), np.float32)},
        id="new-dtype",
    ),
    pytest.param(
        InputError,
        r"v_new has shape \(2, 2, 1, 32\)",
        {"v_new": np.zeros((2, 2, 1, 32), np.float16)},
        id="new-heads",
    ),
    pytest.param(
        InputError,
        "k_new has shape .* but v_new has",
        {"v_new": np.zeros((2, 1, 2, 32), np.float16)},
        id="new-lengths",
    ),
    pytest.param(
        InputError,
        "k_cache has shape .* but v_cache",
        {"v_cache": np.zeros((2, 9, 2, 32), np.float16)},
        id="cache-shape",
    ),
    pytest.param(
        InputTypeError,
        "k_cache has dtype float32 but q has float16",
        {"k_cache": np.zeros((2, 8, 2, 32), np.float32)},
        id="cache-dtype",
    ),
    pytest.param(InputError, "num_splits=0", {"num_splits": 0}, id="num-splits"),
    pytest.param(InputError, "rank 3", {"q": np.zeros((2, 4, 32), np.float16)}, id="q-rank"),
]


@pytest.mark.parametrize(("error", "match", "changes"), BAD)
def test_bad_input_raises_before_any_write(error, match, changes):
    _bad_call_leaves_cache_unchanged(error, match, **changes)


def test_read_only_cache_and_spec_mismatch_raise_before_any_write():
    data = kvcache_data(2, 1, 1, 8, 4, 2, "float16", seed=9)
    q, k_cache, v_cache, k_new, v_new = (x.astype(np.float16) for x in data)
    before = k_cache.copy(), v_cache.copy()
    v_cache.flags.writeable = False
    with pytest.raises(InputError, match="v_cache is read-only"):
        kernelgen.attention_with_kvcache(q, k_cache, v_cache, [1, 2], k_new=k_new, v_new=v_new)
    v_cache.flags.writeable = True
    spec = kernelgen.default_spec("float16", HEAD_DIM, False, None, tensor_cores=False)
    with pytest.raises(InputError, match="causal"):
        kernelgen.attention_with_kvcache(
            q, k_cache, v_cache, [1, 2], k_new=k_new, v_new=v_new, causal=True, spec=spec
        )
    assert np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1])
