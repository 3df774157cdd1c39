"""Emulation tier: ``kernelgen.attention_varlen`` (packed sequences, cu_seqlens) on NumPy inputs
through the CPU backend, against float64 per-sequence references (kernelgen.reference)."""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import round_to
from conftest import CPU_BACKEND_MARKS, host_dtype

import kernelgen
from kernelgen import host
from kernelgen.reference import LSE_TOLERANCE, OUT_TOLERANCE, naive_attention, relative_error

pytestmark = CPU_BACKEND_MARKS
HEAD_DIM = 32


def _offsets(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _packed(lengths_q, lengths_k, heads, kv_heads, dtype, seed):
    """Packed q, k, v in ``dtype`` (float32 copies hold the same values) and the offsets."""
    rng = np.random.default_rng(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = round_to(rng.standard_normal((total_q, heads, HEAD_DIM)), dtype)
    k = round_to(rng.standard_normal((total_k, kv_heads, HEAD_DIM)), dtype)
    v = round_to(rng.standard_normal((total_k, kv_heads, HEAD_DIM)), dtype)
    return q, k, v, _offsets(lengths_q), _offsets(lengths_k)


def _reference(q, k, v, cu_q, cu_k, causal):
    """float64 out (total_q, H, D) and lse (H, total_q), one sequence at a time."""
    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop:
            continue
        o, s = naive_attention(
            q[rows].transpose(1, 0, 2)[None],
            k[keys].transpose(1, 0, 2)[None],
            v[keys].transpose(1, 0, 2)[None],
            causal=causal,
        )
        out[rows] = o[0].transpose(1, 0, 2)
        lse[:, rows] = s[0]
    return out, lse


def _check(out, lse, ref_out, ref_lse, dtype):
    out = np.asarray(out, dtype=np.float64)
    assert not np.isnan(out).any()
    error = relative_error(out, ref_out)
    assert error <= OUT_TOLERANCE[dtype], f"relative error {error:.3g} > {OUT_TOLERANCE[dtype]}"
    empty = np.isneginf(ref_lse)  # (H, total_q)
    assert np.all(out.transpose(1, 0, 2)[empty] == 0.0), "rows that see no key give out = 0"
    if lse is None:
        return
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
    assert np.array_equal(np.isneginf(lse), empty), "lse is -inf exactly where no key is seen"
    if (~empty).any():
        assert np.max(np.abs(lse[~empty] - ref_lse[~empty])) <= LSE_TOLERANCE


# (lengths_q, lengths_k): zero-length sequences, one query, a sequence with queries but no keys,
# a run of equal lengths (one launch), one long sequence among short ones
MIXED = ([3, 0, 1, 5, 5, 1, 2], [7, 4, 0, 5, 5, 1, 30])
LONG_AMONG_SHORT = ([1, 90, 2, 1], [3, 120, 2, 9])
CASES = [
    pytest.param("float32", 4, 4, True, MIXED, id="fp32-mha-causal-mixed"),
    pytest.param("float16", 16, 2, False, MIXED, id="fp16-gqa8-mixed"),
    pytest.param("bfloat16", 4, 1, True, MIXED, id="bf16-mqa-causal-mixed"),
    pytest.param("float16", 8, 1, True, LONG_AMONG_SHORT, id="fp16-mqa8-causal-long"),
    pytest.param("bfloat16", 2, 2, False, LONG_AMONG_SHORT, id="bf16-mha-long"),
]


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "causal", "lengths"), CASES)
def test_varlen_matches_float64(dtype, heads, kv_heads, causal, lengths):
    q, k, v, cu_q, cu_k = _packed(*lengths, heads, kv_heads, dtype, seed=len(lengths[0]))
    np_dtype = host_dtype(dtype)
    out, lse = kernelgen.attention_varlen(
        q.astype(np_dtype),
        k.astype(np_dtype),
        v.astype(np_dtype),
        cu_q,
        cu_k,
        max(lengths[0]),
        max(lengths[1]),
        causal=causal,
        return_lse=True,
    )
    assert out.dtype == np_dtype and out.shape == q.shape
    _check(out, lse, *_reference(q, k, v, cu_q, cu_k, causal), dtype)


def test_varlen_without_lse_host_list_offsets_and_torch():
    """Offsets as host lists; CPU torch tensors in give CPU torch out; lse not asked for."""
    torch = pytest.importorskip("torch")
    lengths_q, lengths_k = [2, 0, 7], [9, 3, 7]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, "float16", seed=3)
    out = kernelgen.attention_varlen(
        *(torch.from_numpy(x.astype(np.float16)) for x in (q, k, v)),
        cu_q.tolist(),
        torch.from_numpy(cu_k),
        7,
        9,
        causal=True,
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    ref_out, ref_lse = _reference(q, k, v, cu_q, cu_k, True)
    _check(out.float().numpy(), None, ref_out, ref_lse, "float16")


def test_empty_batch_and_batch_without_keys():
    q = np.ones((0, 2, HEAD_DIM), np.float16)
    out, lse = kernelgen.attention_varlen(q, q, q, [0, 0], [0, 0], 0, 0, return_lse=True)
    assert out.shape == (0, 2, HEAD_DIM) and lse.shape == (2, 0)
    q = np.ones((3, 2, HEAD_DIM), np.float16)
    k = np.ones((0, 1, HEAD_DIM), np.float16)
    out, lse = kernelgen.attention_varlen(q, k, k, [0, 1, 3], [0, 0, 0], 2, 0, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_varlen_does_no_work_on_padding(monkeypatch):
    """Decode-sized sequences of different lengths, MQA with 8 query heads (the packed GQA
    split-KV kernel): the emulator's copy counts show every sequence's keys read once per K/V
    head and nothing else, no key of a neighbour, no padding; one launch per run of equal
    lengths."""
    stats = []

    def counting(self, grid, block, args, shared_mem=0):
        values = [
            (host.array_at(int(a)) if int(a) else None) if type(a) is np.uint64 else a for a in args
        ]
        stats.append(self.kernel(grid=grid, block=block, shared_mem=shared_mem, args=values))

    monkeypatch.setattr(host._EmulatedFunction, "__call__", counting)
    lengths_q, lengths_k = [1, 0, 8, 3, 3, 1], [40, 5, 1, 70, 70, 12]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 1, "bfloat16", seed=4)
    bf16 = host_dtype("bfloat16")
    out = kernelgen.attention_varlen(
        q.astype(bf16), k.astype(bf16), v.astype(bf16), cu_q, cu_k, 8, 70, causal=True
    )
    _check(out, None, *_reference(q, k, v, cu_q, cu_k, True), "bfloat16")
    k_bytes = sum(s.cp_async_bytes_by_arg.get("k", 0) for s in stats)
    row_bytes = HEAD_DIM * 2
    assert k_bytes == row_bytes * sum(lk for lq, lk in zip(lengths_q, lengths_k, strict=True) if lq)
