"""The shape grid of the attention benchmark, and the work each shape implies.

Every shape of the full grid holds ``batch * seqlen = 16384`` tokens. Heads: 32 for head dim 64
and 16 for head dims 128 and 256, so that a head-dim-64 and a head-dim-128 model have the same
width (heads * head_dim = 2048); head dim 256 keeps 16 heads (width 4096). Sq = Sk throughout.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

TOKENS = 16384
SEQLENS: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
DTYPES: tuple[str, ...] = ("bfloat16", "float16")
CAUSAL: tuple[bool, ...] = (False, True)

QUICK_SEQLENS: tuple[int, ...] = (1024, 4096)
QUICK_HEAD_DIMS: tuple[int, ...] = (64, 128)
QUICK_DTYPES: tuple[str, ...] = ("bfloat16",)

DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "float16": "float16",
}
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3": "e4m3"}
ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3": 1}
# Element bytes of out where it is not the inputs' type: fp8 (e4m3) inputs write bf16.
OUT_ELEM_BYTES = {"float8_e4m3": 2}


def heads_for(head_dim: int) -> int:
    """Query heads used for a head dim: 32 for 64 and below, else 16."""
    return 32 if head_dim <= 64 else 16


@dataclass(frozen=True, order=True)
class Shape:
    """One benchmark problem, (B, H, S, D) layout, as many key/value heads as query heads."""

    dtype: str
    head_dim: int
    causal: bool
    seqlen_q: int
    seqlen_k: int
    batch: int
    heads: int

    @property
    def key(self) -> str:
        """Stable identifier, e.g. ``bf16-d128-s4096-causal``."""
        causal = "-causal" if self.causal else ""
        if self.seqlen_q == self.seqlen_k:
            seq = f"s{self.seqlen_q}"
        else:
            seq = f"q{self.seqlen_q}-k{self.seqlen_k}"
        return f"{DTYPE_SHORT.get(self.dtype, self.dtype)}-d{self.head_dim}-{seq}{causal}"

    @property
    def kv_heads(self) -> int:
        """Key/value heads: as many as query heads in the prefill grid."""
        return self.heads

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def make_shape(dtype: str, head_dim: int, causal: bool, seqlen: int, tokens: int = TOKENS) -> Shape:
    """A square (Sq = Sk) shape with ``batch = tokens // seqlen`` (at least 1)."""
    return Shape(
        dtype=normalize_dtype(dtype),
        head_dim=head_dim,
        causal=causal,
        seqlen_q=seqlen,
        seqlen_k=seqlen,
        batch=max(1, tokens // seqlen),
        heads=heads_for(head_dim),
    )


def normalize_dtype(name: str) -> str:
    """``bf16``/``fp16``/... to the full dtype name; ValueError for anything else."""
    try:
        return DTYPE_ALIASES[name.lower()]
    except KeyError:
        raise ValueError(
            f"dtype {name!r} is not benchmarked; use one of bf16, fp16 (or bfloat16, float16)"
        ) from None


def grid(
    *,
    quick: bool = False,
    dtypes: Iterable[str] | None = None,
    head_dims: Iterable[int] | None = None,
    seqlens: Iterable[int] | None = None,
    causal: bool | None = None,
    tokens: int = TOKENS,
) -> list[Shape]:
    """The shapes to run: the full or quick grid, narrowed by any filter given.

    Filters replace the grid's own axis values (so ``--seqlen 8192`` works with ``--quick``);
    ``causal=None`` keeps both. Ordered by dtype, head dim, causal, then seqlen."""
    dts: Sequence[str] = QUICK_DTYPES if quick else DTYPES
    hds: Sequence[int] = QUICK_HEAD_DIMS if quick else HEAD_DIMS
    sls: Sequence[int] = QUICK_SEQLENS if quick else SEQLENS
    if dtypes:
        dts = tuple(dict.fromkeys(normalize_dtype(d) for d in dtypes))
    if head_dims:
        hds = tuple(dict.fromkeys(head_dims))
    if seqlens:
        sls = tuple(dict.fromkeys(seqlens))
    causals = CAUSAL if causal is None else (causal,)
    return [
        make_shape(d, h, c, s, tokens)
        for d in dts
        for h in hds
        for c in causals
        for s in sorted(sls)
    ]
