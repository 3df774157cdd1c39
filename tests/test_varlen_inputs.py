"""CPU tier: attention_varlen's input checks raise typed errors naming the argument, the value
and what is allowed, before anything is launched; and its plan of runs."""

from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen.calls import attention as api
from kernelgen.calls.varlen import sequence_runs
from kernelgen.errors import InputError, InputTypeError

D = 32


@pytest.fixture(autouse=True)
def _no_launch(monkeypatch):
    """A bad call must fail before any attention() launch."""

    def refuse(*args, **kwargs):
        raise AssertionError("attention() was called on bad input")

    monkeypatch.setattr("kernelgen.calls.varlen.attention", refuse)
    monkeypatch.setattr(api, "device_arch", refuse)


def _qkv(total_q=5, total_k=7, heads=4, kv_heads=2, dtype=np.float16):
    q = np.zeros((total_q, heads, D), dtype)
    k = np.zeros((total_k, kv_heads, D), dtype)
    return q, k, k.copy()


GOOD = dict(cu_seqlens_q=[0, 2, 5], cu_seqlens_k=[0, 3, 7], max_seqlen_q=3, max_seqlen_k=4)


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (dict(cu_seqlens_q=[1, 2, 5]), InputError, ["cu_seqlens_q[0] is 1", "start at 0"]),
        (dict(cu_seqlens_k=[0, 5, 4, 7]), InputError, ["cu_seqlens_k"]),
        (dict(cu_seqlens_q=[0, 4, 2, 5], cu_seqlens_k=[0, 3, 3, 7]), InputError,
         ["cu_seqlens_q decreases at index 2", "4 then 2", "non-decreasing"]),
        (dict(cu_seqlens_q=[0, 2, 6]), InputError, ["cu_seqlens_q[-1] is 6", "5 rows"]),
        (dict(cu_seqlens_k=[0, 3, 8]), InputError, ["cu_seqlens_k[-1] is 8", "7 rows"]),
        (dict(cu_seqlens_k=[0, 7]), InputError, ["cu_seqlens_q has 3 entries", "has 2"]),
        (dict(cu_seqlens_q=[]), InputError, ["cu_seqlens_q has shape (0,)", "(B + 1,)"]),
        (dict(cu_seqlens_q=[[0, 2, 5]]), InputError, ["cu_seqlens_q has shape (1, 3)"]),
        (dict(cu_seqlens_q=[0.0, 2.0, 5.0]), InputTypeError, ["cu_seqlens_q", "integers"]),
        (dict(cu_seqlens_k=np.array([0, 3, 7], np.int64)), InputTypeError,
         ["cu_seqlens_k has dtype int64", "int32"]),
        (dict(cu_seqlens_k="0,3,7"), InputTypeError, ["cu_seqlens_k has type str"]),
        (dict(max_seqlen_q=2), InputError, ["sequence 1", "length of 3", "max_seqlen_q=2"]),
        (dict(max_seqlen_k=-1), InputError, ["max_seqlen_k=-1"]),
        (dict(max_seqlen_k=4.0), InputTypeError, ["max_seqlen_k has type float"]),
        (dict(max_seqlen_q=True), InputTypeError, ["max_seqlen_q has type bool"]),
    ],
)  # fmt: skip
def test_bad_offsets_and_lengths(change, error, words):
    with pytest.raises(error) as caught:
        kernelgen.attention_varlen(*_qkv(), **{**GOOD, **change})
    for word in words:
        assert word in str(caught.value)


def test_bad_tensors():
    q, k, v = _qkv()
    with pytest.raises(InputError, match=r"q has rank 4 .* expected rank 3, \(total_q, H, D\)"):
        kernelgen.attention_varlen(q[None], k, v, **GOOD)
    with pytest.raises(InputTypeError, match="k has dtype float32 but q has float16"):
        kernelgen.attention_varlen(q, k.astype(np.float32), v, **GOOD)
    with pytest.raises(InputError, match="not divisible by the 3 key/value heads"):
        kernelgen.attention_varlen(q, *_qkv(kv_heads=3)[1:], **GOOD)
    with pytest.raises(InputError, match=r"k has shape .* but v has"):
        kernelgen.attention_varlen(q, k, v[:6], **GOOD)
    with pytest.raises(InputError, match="head_dim"):
        kernelgen.attention_varlen(q[..., :20], k[..., :20], v[..., :20], **GOOD)


def test_offsets_on_another_device_are_refused():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.zeros(x.shape, dtype=torch.float16) for x in _qkv())
    with pytest.raises(InputTypeError, match="cu_seqlens_q has type"):
        kernelgen.attention_varlen(q, k, v, object(), [0, 3, 7], 3, 4)
    with pytest.raises(InputTypeError, match="cu_seqlens_k has dtype int64"):
        kernelgen.attention_varlen(q, k, v, [0, 2, 5], torch.tensor([0, 3, 7]), 3, 4)


def test_runs_group_equal_lengths_and_skip_empty_sequences():
    starts_q = np.array([0, 3, 3, 4, 9, 14, 15, 17])
    starts_k = np.array([0, 7, 11, 11, 16, 21, 22, 52])
    # lengths q [3, 0, 1, 5, 5, 1, 2], k [7, 4, 0, 5, 5, 1, 30]
    assert sequence_runs(starts_q, starts_k) == [
        (0, 1, 3, 7), (2, 1, 1, 0), (3, 2, 5, 5), (5, 1, 1, 1), (6, 1, 2, 30),
    ]  # fmt: skip
    assert sequence_runs(np.array([0]), np.array([0])) == []
