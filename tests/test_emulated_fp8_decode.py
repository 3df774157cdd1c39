"""fp8 decode on the emulator: ``kernelgen.attention_with_kvcache`` on e4m3 caches with
per-(batch, kv head) descales (docs/hopper.md, "fp8 decode"), against the float64 reference of
the decoded inputs (kernelgen.references.fp8) and its stated bound.

The default spec (kernelgen.model.policy.fp8_decode_spec, the shipped
specs/v2_wg_e4m3_d128_m64_n128_s2_vk_gqa_split.yaml at d128) reads the cache in place, V
transposed in the kernel, split-KV (fp32 partials, the combine) with packed GQA; a paged cache
(pages of a multiple of 64 keys, each key tile one TMA copy) as well; other page sizes (row
copies by cp.async): tests/test_emulated_fp8_paged_rows.py. The cache's rows past each entry's
length hold NaN. Mutation: the partials without v's descale.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_emulated_fp8 import fp8_spec, problem
from test_emulated_fp8_variants import NAN, assert_within_bound

import kernelgen
from kernelgen.errors import InputError, SpecError
from kernelgen.kernels.render import render
from kernelgen.model.policy import fp8_decode_spec
from kernelgen.references.fp8 import fp8_reference
from kernelgen.runtime.emulated_launch import recording
from kernelgen.specs.forward import load_spec

pytestmark = [
    pytest.mark.emulate,
    pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning"),
]

SPEC_FILE = "specs/v2_wg_e4m3_d128_m64_n128_s2_vk_gqa_split.yaml"


def bshd(x: np.ndarray) -> np.ndarray:
    """(B, H, S, D) e4m3 bits as a (B, S, H, D) ml_dtypes array."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).view(ml_dtypes.float8_e4m3fn)


def cache_case(seed: int, lengths: list[int], heads: int, kv_heads: int, seqlen_q: int):
    """q and a 300-key cache whose rows past each entry's length hold NaN: (q, k, v, descales)."""
    q, k, v, descales = problem(seed, len(lengths), heads, kv_heads, seqlen_q, 300)
    for b, length in enumerate(lengths):
        k[b, :, length:] = NAN
        v[b, :, length:] = NAN
    return q, k, v, descales


def decode(q, k, v, lengths, descales, source: str | None = None, **kwargs):
    """(out as (B, H, Sq, D) float32, lse, the recording) of one decode step."""
    with recording(source) as recorded:
        out, lse = kernelgen.attention_with_kvcache(
            bshd(q), bshd(k), bshd(v), lengths, causal=True, return_lse=True, **descales,
            **kwargs,
        )  # fmt: skip
    assert out.dtype == ml_dtypes.bfloat16
    return out.astype(np.float32).transpose(0, 2, 1, 3), lse, recorded


def test_the_decode_default_is_the_shipped_spec():
    assert fp8_decode_spec(128, False, 4) == load_spec(SPEC_FILE)
    spec = fp8_decode_spec(128, True, 3)  # a group that does not divide 64: not packed
    assert spec.split_kv and not spec.pack_gqa and spec.fp8_v_layout == "kernel"


def test_split_packed_decode_with_nan_rows_past_the_lengths_within_the_bound():
    """GQA 4 (packed), one query, lengths off the tiles and off 16, 3 key chunks."""
    lengths = [170, 259]
    q, k, v, descales = cache_case(4, lengths, 8, 2, 1)
    out, lse, recorded = decode(q, k, v, lengths, descales, num_splits=3)
    assert recorded.problem.num_splits == 3
    assert fp8_decode_spec(128, True, 4).uri in recorded.stats
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, seqlens_k=lengths)
    assert_within_bound(out, lse, ref)


def test_appending_new_keys_then_decoding_within_the_bound():
    """Two new tokens per entry written at each entry's length (in place), causal among them;
    MQA with a group of 3 (not packed), d64 (64-byte rows both ways)."""
    lengths = [100, 41]
    q, k, v, descales = cache_case(6, lengths, 3, 1, 2)
    k_new, v_new = (x[:, :, :2].copy() for x in problem(7, 2, 1, 1, 2, 2, head_dim=128)[1:3])
    q, k, v = (x[..., :64].copy() for x in (q, k, v))
    k_new, v_new = k_new[..., :64], v_new[..., :64]
    k_cache, v_cache = bshd(k), bshd(v)
    out, lse = kernelgen.attention_with_kvcache(
        bshd(q), k_cache, v_cache, lengths, k_new=bshd(k_new), v_new=bshd(v_new), causal=True,
        return_lse=True, num_splits=2, **descales,
    )  # fmt: skip
    for b, length in enumerate(lengths):  # the cache now holds the new rows
        k[b, :, length : length + 2] = k_new[b]
        v[b, :, length : length + 2] = v_new[b]
    np.testing.assert_array_equal(k_cache.view(np.uint8), bshd(k).view(np.uint8))
    new_lengths = [n + 2 for n in lengths]
    ref = fp8_reference(q, k, v, descales, causal=True, scale=64**-0.5, seqlens_k=new_lengths)
    assert_within_bound(out.astype(np.float32).transpose(0, 2, 1, 3), lse, ref)


def test_partials_without_the_v_descale_break_the_bound():
    lengths = [170, 259]
    q, k, v, descales = cache_case(4, lengths, 8, 2, 1)
    source = render(fp8_decode_spec(128, True, 4))
    old = "const float inv_l = inverse_sum(row_l) * out_factor;\n    float* o_row"
    assert source.count(old) == 1
    mutated = source.replace(old, "const float inv_l = inverse_sum(row_l);\n    float* o_row")
    out, _, _ = decode(q, k, v, lengths, descales, source=mutated, num_splits=3)
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, seqlens_k=lengths)
    assert ref.bound_ratio(np.asarray(out, np.float64)) > 2.0


def test_fp8_decode_refusals_name_what_is_allowed():
    lengths = [10]
    q, k, v, _ = cache_case(1, lengths, 2, 1, 1)
    for field in ("split_kv", "pack_gqa", "paged_kv"):
        with pytest.raises(SpecError, match=rf"{field}=True is not allowed with .* use fp8_v_l"):
            fp8_spec(block_m=64, **{field: True})
    named = fp8_spec(block_m=64, split_kv=True, fp8_v_layout="kernel")  # not paged
    k_pool, v_pool, table = paged_pool(k, v, 64, seed=3)
    f8 = ml_dtypes.float8_e4m3fn
    with pytest.raises(InputError, match="has paged_kv=False but the call needs paged_kv=True"):
        kernelgen.attention_with_kvcache(
            bshd(q), k_pool.view(f8), v_pool.view(f8), lengths, block_table=table, spec=named
        )


def test_torch_cpu_cache_with_appending_then_tensor_lengths():
    """CPU torch float8_e4m3fn tensors (GQA 2, packed), int32 tensor lengths with validate:
    appending writes the cache in place; the next call on the updated lengths (no append)
    gives the same out."""
    torch = pytest.importorskip("torch")
    lengths = [100, 41]
    q, k, v, descales = cache_case(6, lengths, 4, 2, 2)
    _, k_new, v_new, _ = problem(7, 2, 2, 2, 2, 2)

    def tensor(x):
        return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).view(
            torch.float8_e4m3fn
        )

    k_cache, v_cache = tensor(k), tensor(v)
    scales = {name: torch.from_numpy(x) for name, x in descales.items()}
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = kernelgen.attention_with_kvcache(
        tensor(q), k_cache, v_cache, seqlens, k_new=tensor(k_new), v_new=tensor(v_new),
        causal=True, return_lse=True, validate=True, **scales,
    )  # fmt: skip
    assert out.dtype == torch.bfloat16
    for b, length in enumerate(lengths):
        k[b, :, length : length + 2] = k_new[b]
        v[b, :, length : length + 2] = v_new[b]
    np.testing.assert_array_equal(v_cache.view(torch.uint8).numpy(), bshd(v).view(np.uint8))
    new_lengths = [n + 2 for n in lengths]
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, seqlens_k=new_lengths)
    assert_within_bound(out.float().numpy().transpose(0, 2, 1, 3), lse.numpy(), ref)
    again = kernelgen.attention_with_kvcache(
        tensor(q), k_cache, v_cache, seqlens + 2, causal=True, validate=True, **scales
    )
    assert torch.equal(again, out)


def paged_pool(k: np.ndarray, v: np.ndarray, page_size: int, seed: int):
    """k and v (B, Hkv, S, D) as shuffled pages of a pool with 3 spare pages, every row no
    entry maps (and the caller's NaN rows) NaN: (k pool, v pool, block table)."""
    batch, kv_heads, keys, dim = k.shape
    per_entry = -(-keys // page_size)
    table = np.random.default_rng(seed).permutation(batch * per_entry + 3)[: batch * per_entry]
    table = table.reshape(batch, per_entry).astype(np.int32)
    pools = []
    for x in (k, v):
        pool = np.full((batch * per_entry + 3, page_size, kv_heads, dim), NAN, np.uint8)
        padded = np.full((batch, kv_heads, per_entry * page_size, dim), NAN, np.uint8)
        padded[:, :, :keys] = x
        for b, j in np.ndindex(batch, per_entry):
            rows = padded[b, :, j * page_size : (j + 1) * page_size]
            pool[table[b, j]] = rows.transpose(1, 0, 2)
        pools.append(pool)
    return pools[0], pools[1], table


def test_paged_cache_with_shuffled_pages_and_appending_within_the_bound():
    """Pages of 64 keys in shuffled order with NaN in the spare pages and past the lengths,
    one new token appended per entry into its page, GQA 4 (packed), 3 key chunks."""
    lengths = [169, 258]
    q, k, v, descales = cache_case(8, lengths, 8, 2, 1)
    _, k_new, v_new, _ = problem(9, 2, 2, 2, 1, 1)
    k_pool, v_pool, table = paged_pool(k, v, 64, seed=1)
    f8 = ml_dtypes.float8_e4m3fn
    with recording(None) as recorded:
        out, lse = kernelgen.attention_with_kvcache(
            bshd(q), k_pool.view(f8), v_pool.view(f8), lengths, block_table=table,
            k_new=bshd(k_new), v_new=bshd(v_new), causal=True, return_lse=True, num_splits=3,
            **descales,
        )  # fmt: skip
    assert recorded.problem.num_splits == 3 and recorded.problem.page_size == 64
    assert fp8_decode_spec(128, True, 4, paged_kv=True).uri in recorded.stats
    for b, length in enumerate(lengths):
        k[b, :, length] = k_new[b, :, 0]
        v[b, :, length] = v_new[b, :, 0]
        page, row = table[b, length // 64], length % 64
        np.testing.assert_array_equal(v_pool[page, row], v_new[b, :, 0])
    new_lengths = [n + 1 for n in lengths]
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, seqlens_k=new_lengths)
    assert_within_bound(out.astype(np.float32).transpose(0, 2, 1, 3), lse, ref)
