"""The shape grid of the decode benchmark: a few new tokens against a long KV cache.

Full grid: bf16 and fp16; batch 1, 8, 64; 32 query heads with 32, 8 or 1 key/value heads (MHA,
GQA 4, MQA); head dim 128; one query; Sk from 1k to 128k plus 10007, a length that is no multiple
of any key tile. Non-causal throughout (a single query sees every key either way).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from bench.shapes import DTYPE_SHORT, ELEM_BYTES, normalize_dtype

HEADS = 32
HEAD_DIM = 128
DTYPES: tuple[str, ...] = ("bfloat16", "float16")
BATCHES: tuple[int, ...] = (1, 8, 64)
KV_HEADS: tuple[int, ...] = (32, 8, 1)
SEQLENS_K: tuple[int, ...] = (1024, 4096, 8192, 10007, 16384, 32768, 65536, 131072)
SEQLENS_Q: tuple[int, ...] = (1,)
MAX_SEQLEN_Q = 16

QUICK_DTYPES: tuple[str, ...] = ("bfloat16",)
QUICK_BATCHES: tuple[int, ...] = (1, 8)
QUICK_KV_HEADS: tuple[int, ...] = (8,)
QUICK_SEQLENS_K: tuple[int, ...] = (4096, 32768)


@dataclass(frozen=True, kw_only=True)
class DecodeShape:
    """One decode problem: q (B, H, Sq, D), k and v (B, Hkv, Sk, D), H % Hkv == 0."""

    dtype: str
    batch: int
    heads: int = HEADS
    kv_heads: int
    seqlen_q: int = 1
    seqlen_k: int
    head_dim: int = HEAD_DIM

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} heads are not divisible by {self.kv_heads} kv heads")

    @property
    def key(self) -> str:
        """Stable identifier, e.g. ``bf16-b1-h32kv8-q1-k32768`` (``-d64`` if D is not 128)."""
        dim = "" if self.head_dim == HEAD_DIM else f"-d{self.head_dim}"
        dtype = DTYPE_SHORT.get(self.dtype, self.dtype)
        return (
            f"{dtype}-b{self.batch}-h{self.heads}kv{self.kv_heads}"
            f"-q{self.seqlen_q}-k{self.seqlen_k}{dim}"
        )

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _axis(given: Iterable[int] | None, default: Sequence[int], name: str) -> tuple[int, ...]:
    """A filter's values (deduplicated, each at least 1) or the grid's own."""
    if not given:
        return tuple(default)
    values = tuple(dict.fromkeys(given))
    bad = [v for v in values if v < 1]
    if bad:
        raise ValueError(f"{name} {bad[0]} is not allowed; use a positive integer")
    return values


def grid(
    *,
    quick: bool = False,
    dtypes: Iterable[str] | None = None,
    batches: Iterable[int] | None = None,
    kv_heads: Iterable[int] | None = None,
    seqlens_k: Iterable[int] | None = None,
    seqlens_q: Iterable[int] | None = None,
) -> list[DecodeShape]:
    """The decode shapes to run: the full or quick grid, narrowed by any filter given.

    Filters replace the grid's own axis values (so ``--seqlen-k 131072`` works with ``--quick``).
    Ordered by dtype, batch, kv heads (as given), seqlen_q, then seqlen_k."""
    dts: Sequence[str] = QUICK_DTYPES if quick else DTYPES
    if dtypes:
        dts = tuple(dict.fromkeys(normalize_dtype(d) for d in dtypes))
    bs = _axis(batches, QUICK_BATCHES if quick else BATCHES, "batch")
    kvs = _axis(kv_heads, QUICK_KV_HEADS if quick else KV_HEADS, "kv heads")
    sks = _axis(seqlens_k, QUICK_SEQLENS_K if quick else SEQLENS_K, "seqlen_k")
    sqs = _axis(seqlens_q, SEQLENS_Q, "seqlen_q")
    bad_kv = [h for h in kvs if HEADS % h]
    if bad_kv:
        raise ValueError(f"--kv-heads {bad_kv[0]} does not divide the {HEADS} query heads")
    if max(sqs) > MAX_SEQLEN_Q:
        raise ValueError(f"--seqlen-q {max(sqs)} is not a decode shape; use 1 to {MAX_SEQLEN_Q}")
    return [
        DecodeShape(dtype=d, batch=b, kv_heads=h, seqlen_q=q, seqlen_k=k)
        for d in dts
        for b in bs
        for h in kvs
        for q in sorted(sqs)
        for k in sorted(sks)
    ]
