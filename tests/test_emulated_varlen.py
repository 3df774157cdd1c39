"""Emulation tier: ``kernelgen.attention_varlen`` (packed sequences, cu_seqlens) on NumPy inputs
through the CPU backend, against float64 per-sequence references
(kernelgen.references.attention)."""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import check_varlen, packed_varlen, varlen_reference
from conftest import CPU_BACKEND_MARKS, host_dtype

import kernelgen
from kernelgen.runtime import host as host

pytestmark = CPU_BACKEND_MARKS
HEAD_DIM = 32


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
    q, k, v, cu_q, cu_k = packed_varlen(*lengths, heads, kv_heads, dtype, seed=len(lengths[0]))
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
    check_varlen(out, lse, *varlen_reference(q, k, v, cu_q, cu_k, causal), dtype)


def test_varlen_without_lse_host_list_offsets_and_torch():
    """Offsets as host lists; CPU torch tensors in give CPU torch out; lse not asked for."""
    torch = pytest.importorskip("torch")
    lengths_q, lengths_k = [2, 0, 7], [9, 3, 7]
    q, k, v, cu_q, cu_k = packed_varlen(lengths_q, lengths_k, 4, 2, "float16", seed=3)
    out = kernelgen.attention_varlen(
        *(torch.from_numpy(x.astype(np.float16)) for x in (q, k, v)),
        cu_q.tolist(),
        torch.from_numpy(cu_k),
        7,
        9,
        causal=True,
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    ref_out, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, True)
    check_varlen(out.float().numpy(), None, ref_out, ref_lse, "float16")


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
    q, k, v, cu_q, cu_k = packed_varlen(lengths_q, lengths_k, 8, 1, "bfloat16", seed=4)
    bf16 = host_dtype("bfloat16")
    out = kernelgen.attention_varlen(
        q.astype(bf16), k.astype(bf16), v.astype(bf16), cu_q, cu_k, 8, 70, causal=True
    )
    check_varlen(out, None, *varlen_reference(q, k, v, cu_q, cu_k, True), "bfloat16")
    k_bytes = sum(s.cp_async_bytes_by_arg.get("k", 0) for s in stats)
    row_bytes = HEAD_DIM * 2
    assert k_bytes == row_bytes * sum(lk for lq, lk in zip(lengths_q, lengths_k, strict=True) if lq)
