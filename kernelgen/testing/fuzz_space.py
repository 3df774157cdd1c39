"""What the forward fuzzer (:mod:`kernelgen.testing.fuzz`) draws: spec fields from the spaces the
validator allows, and problems (shapes, layout, scale, variant values, lengths, pages) for a
valid spec. Every draw comes from a NumPy generator seeded by (seed, case index), so a seed
gives the same cases on every machine. Nothing here runs a kernel.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kernelgen.errors import SpecError
from kernelgen.specs.forward import (
    FP8_BLOCK_N_BY_HEAD_DIM,
    FP8_HEAD_DIMS,
    WGMMA_BLOCK_N,
    WGMMA_HEAD_DIMS,
    KernelSpec,
    spec_from_dict,
)

# --engine all: the share of each engine's cases (wgmma with fp8 gets three in four: the newest
# code gets most of them)
ENGINE_SHARES = {"wgmma": 0.6, "fp8": 0.15, "mma_sync": 0.25}
MAX_ATTEMPTS = 500  # draws per case before giving up (a space that refuses everything)
# A document mask over 2-d document ids (batch entry, position); block-sparse specs list its
# key tiles (kernelgen.block_mask). Queries sit in the document of the key they align with.
DOC_MASK = "qdoc[b, q_idx] == kdoc[b, kv_idx]"
DOC_INPUTS = ("qdoc:int32[2]", "kdoc:int32[2]")
EMPTY_DOC = 99  # a document no key belongs to: its queries see nothing
SCORE_MOD = "score - 0.03 * abs(q_idx - kv_idx)"
MMA_SYNC_HEAD_DIMS = (32, 40, 64, 80, 96, 128, 136)
# The largest problem a case runs: batch x heads x padded Sq x padded Sk x head_dim
# multiply-adds (the emulator runs every CUDA thread on the CPU).
MAX_WORK = 2**24
MAX_SEQLEN = 400
# fp8: the chance of fp8_v_layout=kernel, and the decode forms' (each needs the kernel layout)
FP8_V_KERNEL_P = 0.4
FP8_DECODE_SWITCHES = (("split_kv", 0.15), ("pack_gqa", 0.15), ("paged_kv", 0.15))


@dataclass(frozen=True)
class FuzzProblem:
    """One call: sizes, memory layout, scale (None: 1/sqrt(D)), inputs and variant values."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    layout: str
    data_seed: int
    scale: float | None = None
    wide_range: bool = False  # rows of q, k, v scaled by powers of two from 2^-4 to 2^4
    mask: str | None = None  # additive_mask specs: "broadcast" (with empty rows) or "full"
    seqlens_k: tuple[int, ...] | None = None
    nan_past: bool = False  # k and v rows past seqlens_k hold NaN
    page_size: int | None = None
    num_splits: int | None = None
    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi_per_batch: bool = False  # slopes (B, H), else (H,)
    null_lse: bool = False  # the call asks for no lse (the kernels get a null pointer)
    descales: tuple[str, ...] | None = None  # fp8: the descales given (the others None: 1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FuzzProblem:
        data = dict(data)
        for name in ("seqlens_k", "window", "descales"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}


@dataclass
class DrawStats:
    """Per feature of a drawn spec (``causal``, ``block_n=176``, ...): how often it was drawn
    and how often its spec was refused; and per field a refusal names, how often."""

    drawn: dict[str, int]
    refused: dict[str, int]
    blamed: dict[str, int]

    @classmethod
    def empty(cls) -> DrawStats:
        return cls({}, {}, {})

    def count(self, fields: dict[str, Any], error: SpecError | None) -> None:
        for name in features(fields):
            self.drawn[name] = self.drawn.get(name, 0) + 1
            if error is not None:
                self.refused[name] = self.refused.get(name, 0) + 1
        for problem in error.problems if error is not None else ():
            named = re.match(r"(\w+)=", problem)
            field = named.group(1) if named else " ".join(problem.split()[:2])  # "shared memory"
            self.blamed[field] = self.blamed.get(field, 0) + 1

    def rates(self) -> dict[str, str]:
        """feature -> 'refused/drawn (percent)', most refused first."""
        order = sorted(self.drawn, key=lambda n: -self.refused.get(n, 0) / self.drawn[n])
        return {
            n: f"{self.refused.get(n, 0)}/{self.drawn[n]} "
            f"({100 * self.refused.get(n, 0) / self.drawn[n]:.0f}%)"
            for n in order
        }


def features(fields: dict[str, Any]) -> list[str]:
    """The draw's features for :class:`DrawStats`: every true flag, and the tile and dtype
    values as ``name=value``."""
    names = [f"engine={fields['mma']}"]
    for name, value in fields.items():
        if name in ("mma", "loop_order", "mod_inputs", "score_mod", "mask_mod"):
            continue
        if value is True:
            names.append(name)
        elif value not in (False, None):
            names.append(f"{name}={value}")
    names += ["mask_mod"] * ("mask_mod" in fields) + ["score_mod"] * ("score_mod" in fields)
    return names


def chance(rng: np.random.Generator, p: float) -> bool:
    return bool(rng.random() < p)


def pick(rng: np.random.Generator, values: Any) -> Any:
    values = list(values)
    value = values[int(rng.integers(len(values)))]
    return value.item() if isinstance(value, np.generic) else value


def draw_fp8_fields(rng: np.random.Generator) -> dict[str, Any]:
    """One draw of fp8 (e4m3, wgmma) forward spec fields: head dims and key tiles of
    FP8_BLOCK_N_BY_HEAD_DIM, the loops, causal, the variants, the TMA epilogue, V transposed in
    the kernel, the decode forms (split-KV, packed GQA, paged KV), a document mask and a
    score_mod (the validator decides what fp8 takes; the refusals are counted)."""
    head_dim = pick(rng, FP8_HEAD_DIMS)
    fields: dict[str, Any] = {
        "loop_order": "v2",
        "mma": "wgmma",
        "dtype": "float8_e4m3",
        "head_dim": head_dim,
        "block_m": pick(rng, (64, 128, 128)),
        "block_n": pick(rng, FP8_BLOCK_N_BY_HEAD_DIM[head_dim]),
        "stages": pick(rng, (2, 2, 3, 4)),
    }
    for name, p in (
        ("causal", 0.4), ("overlap", 0.3), ("q_in_registers", 0.3), ("pingpong", 0.08),
        ("window", 0.08), ("softcap", 0.08), ("alibi", 0.08), ("sinks", 0.08),
    ):  # fmt: skip
        if chance(rng, p):
            fields[name] = True
    if chance(rng, 0.3):
        fields["epilogue"] = "tma"
    # The newer forms: V transposed by the producer warps, which the decode forms need (the
    # validator refuses them with the host's V^T), and a document mask (block-sparse mostly).
    if chance(rng, FP8_V_KERNEL_P):
        fields["fp8_v_layout"] = "kernel"
    return draw_switches(rng, fields, FP8_DECODE_SWITCHES, documents=0.1)


def draw_fields(rng: np.random.Generator, engine: str) -> dict[str, Any]:
    """One draw of forward spec fields for ``engine`` (wgmma, mma_sync, or fp8: wgmma with
    float8_e4m3) (not checked: the validator decides)."""
    if engine == "fp8":
        return draw_fp8_fields(rng)
    fields: dict[str, Any] = {
        "loop_order": "v2",
        "mma": engine,
        "dtype": pick(rng, ("bfloat16", "bfloat16", "float16")),
    }
    if engine == "wgmma":
        fields["head_dim"] = pick(rng, (64, 64, 64, 128, *WGMMA_HEAD_DIMS))
        fields["block_m"] = pick(rng, (64, 128))
        common = (32, 64, 128)  # half the draws; the other half any multiple of 16
        fields["block_n"] = pick(rng, common if chance(rng, 0.5) else WGMMA_BLOCK_N)
        fields["stages"] = pick(rng, (2, 2, 3, 4))
        for name, p in (("overlap", 0.2), ("pingpong", 0.2), ("q_in_registers", 0.2)):
            if chance(rng, p):
                fields[name] = True
        if chance(rng, 0.25):
            fields["epilogue"] = "tma"
        if chance(rng, 0.12):
            fields["cluster_m"] = 2
    else:
        fields["head_dim"] = pick(rng, MMA_SYNC_HEAD_DIMS)
        warps = pick(rng, (1, 2, 4, 4, 8))
        fields["num_warps"] = warps
        fields["block_m"] = warps * pick(rng, (16, 32))
        fields["block_n"] = pick(rng, range(16, 129, 16))
        fields["stages"] = pick(rng, (2, 3, 4))
        fields["smem_layout"] = pick(rng, ("swizzled", "padded"))
    switches = (
        ("causal", 0.3), ("window", 0.15), ("softcap", 0.15), ("alibi", 0.15), ("sinks", 0.15),
        ("additive_mask", 0.12), ("split_kv", 0.15), ("pack_gqa", 0.15), ("paged_kv", 0.12),
    )  # fmt: skip
    return draw_switches(rng, fields, switches, documents=0.18)


def draw_switches(
    rng: np.random.Generator,
    fields: dict[str, Any],
    switches: tuple[tuple[str, float], ...],
    documents: float,
) -> dict[str, Any]:
    """``fields`` with each of ``switches`` (name, probability) turned on by chance, then a
    document mask with probability ``documents`` (block-sparse four times in five) and a
    score_mod (6 %): the draws of every family, in this order (a seed's cases depend on it)."""
    for name, p in switches:
        if chance(rng, p):
            fields[name] = True
    if chance(rng, documents):
        fields["mask_mod"] = DOC_MASK
        fields["mod_inputs"] = list(DOC_INPUTS)
        fields["block_sparse"] = chance(rng, 0.8)
    if chance(rng, 0.06):
        fields["score_mod"] = SCORE_MOD
    return fields


def draw_valid(
    draw: Callable[[], dict[str, Any]],
    build: Callable[[dict[str, Any]], Any],
    stats: DrawStats | None,
    what: str,
) -> tuple[dict[str, Any], Any, list[tuple[dict[str, Any], str]]]:
    """``draw()`` fields until ``build`` (a spec constructor) takes them: (fields, spec, the
    refused draws with their first problem), each draw counted in ``stats``. Raises
    RuntimeError after :data:`MAX_ATTEMPTS` refusals of ``what``."""
    refused = []
    for _ in range(MAX_ATTEMPTS):
        fields = draw()
        try:
            spec = build(fields)
        except SpecError as exc:
            if stats is not None:
                stats.count(fields, exc)
            refused.append((fields, exc.problems[0]))
            continue
        if stats is not None:
            stats.count(fields, None)
        return fields, spec, refused
    raise RuntimeError(f"{MAX_ATTEMPTS} {what} were all refused")


def draw_spec(
    rng: np.random.Generator, engine: str, stats: DrawStats | None = None
) -> tuple[dict[str, Any], KernelSpec, list[tuple[dict[str, Any], str]]]:
    """Draw fields until the validator takes them: (fields, spec, the refused draws with their
    first problem). Raises RuntimeError after :data:`MAX_ATTEMPTS` refusals."""
    draw = lambda: draw_fields(rng, engine)  # noqa: E731
    return draw_valid(draw, spec_from_dict, stats, f"draws for engine {engine!r}")


def draw_length(rng: np.random.Generator, tile: int) -> int:
    """A sequence length biased to just off tile multiples (tile x k - 1, + 0, + 1) and to
    1 and 17; else any from 1 to :data:`MAX_SEQLEN`."""
    kind = rng.random()
    if kind < 0.45:
        return max(1, tile * int(rng.integers(1, 4)) + pick(rng, (-1, 0, 1)))
    if kind < 0.6:
        return pick(rng, (1, 17, 2, 16, 33))
    return int(rng.integers(1, MAX_SEQLEN + 1))


def work(spec: Any, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> int:
    """Multiply-adds of Q K^T over whole tiles of ``spec`` (forward or backward: its block_m,
    block_n and head_dim): the emulator's cost of a problem."""
    rows = math.ceil(seqlen_q / spec.block_m) * spec.block_m
    keys = math.ceil(seqlen_k / spec.block_n) * spec.block_n
    return batch * heads * rows * keys * spec.head_dim


def shrink_to_work(
    spec: Any,
    sizes: tuple[int, int, int, int, int],
    min_q: int = 1,
    min_k: int = 1,
    fold_groups: bool = True,
    max_work: int = MAX_WORK,
) -> tuple[int, int, int, int, int]:
    """(batch, heads, kv_heads, seqlen_q, seqlen_k) halved until :func:`work` fits
    ``max_work``: the longer length first (not below ``min_q`` / ``min_k``), then (with
    ``fold_groups``) the GQA group, then one head of one entry; as small as the spec goes else."""
    batch, heads, kv_heads, seqlen_q, seqlen_k = sizes
    while work(spec, batch, heads, seqlen_q, seqlen_k) > max_work:
        if seqlen_k >= seqlen_q and seqlen_k > min_k:
            seqlen_k = max(min_k, (seqlen_k + 1) // 2)
        elif seqlen_q > min_q:
            seqlen_q = max(min_q, (seqlen_q + 1) // 2)
        elif fold_groups and heads > kv_heads:
            heads = kv_heads
        elif batch * heads > 1:
            batch, heads, kv_heads = 1, 1, 1
        else:  # one tile of one head: as small as the spec goes
            break
    return batch, heads, kv_heads, seqlen_q, seqlen_k


def draw_scale(rng: np.random.Generator, head_dim: int) -> float | None:
    """The softmax scale: the default (None) in about two draws of three, else a multiple of
    1 / sqrt(head_dim), negative ones included."""
    if not chance(rng, 0.35):
        return None
    return round(pick(rng, (-1.0, -0.3, 0.5, 1.7, 3.0)) / math.sqrt(head_dim), 6)


def _groups(spec: KernelSpec) -> tuple[int, ...]:
    """Query heads per key/value head to draw: wgmma's packed GQA takes divisors of block_m."""
    if spec.pack_gqa and spec.engine.warp_specialized:
        return (1, 2, 4, 8)
    return (1, 2, 3, 4, 8)


def draw_window(rng: np.random.Generator, spec: KernelSpec) -> tuple[int, int]:
    sides = (-1, 0, 1, 5, 17, spec.block_n - 1, spec.block_n, spec.block_n + 1, 70, 200)
    left = pick(rng, sides)
    right = pick(rng, (-1, 0, 1, 3, spec.block_n) if left != -1 else (0, 1, 3, spec.block_n))
    return left, right


def _page_size(rng: np.random.Generator, spec: KernelSpec) -> int:
    """Pages that are and are not multiples of block_n (wgmma: multiples of 16)."""
    n = spec.block_n
    return pick(rng, (n, 2 * n, 16, 32, 48, n + 16, max(16, n // 2 // 16 * 16)))


def _lengths(rng: np.random.Generator, spec: KernelSpec, batch: int, keys: int) -> tuple[int, ...]:
    choices = (0, 1, keys, keys - 1, spec.block_n - 1, spec.block_n + 1, spec.block_n)
    return tuple(
        min(keys, max(0, pick(rng, choices) if chance(rng, 0.6) else int(rng.integers(keys + 1))))
        for _ in range(batch)
    )


def draw_problem(rng: np.random.Generator, spec: KernelSpec) -> FuzzProblem:
    """A problem for ``spec`` (sizes within :data:`MAX_WORK`, lengths shrunk to fit)."""
    batch = int(rng.integers(1, 3))
    kv_heads = int(rng.integers(1, 3))
    heads = kv_heads * pick(rng, _groups(spec))
    seqlen_q = draw_length(rng, spec.block_m)
    seqlen_k = draw_length(rng, spec.block_n)
    if chance(rng, 0.3):  # the causal diagonal / window offset Sk - Sq just off a tile edge
        shift = pick(rng, (-2, -1, 0, 1, 2, spec.block_n - 2, spec.block_n - 1, spec.block_n + 1))
        seqlen_k = min(MAX_SEQLEN, max(1, seqlen_q + shift))
    if spec.split_kv and chance(rng, 0.5):  # decode: a few queries over many keys
        seqlen_q = pick(rng, (1, 2, 3, 5))
    batch, heads, kv_heads, seqlen_q, seqlen_k = shrink_to_work(
        spec, (batch, heads, kv_heads, seqlen_q, seqlen_k)
    )
    scale = draw_scale(rng, spec.head_dim)
    seqlens_k = None
    if spec.paged_kv or chance(rng, 0.3):
        seqlens_k = _lengths(rng, spec, batch, seqlen_k) if chance(rng, 0.8) else None
    return FuzzProblem(
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        layout=pick(rng, ("bhsd", "bshd")),
        scale=scale,
        data_seed=int(rng.integers(2**31)),
        wide_range=chance(rng, 0.2),
        mask=pick(rng, ("broadcast", "full")) if spec.additive_mask else None,
        seqlens_k=seqlens_k,
        nan_past=seqlens_k is not None and chance(rng, 0.6),
        page_size=_page_size(rng, spec) if spec.paged_kv else None,
        num_splits=pick(rng, (None, 1, 2, 3, 4, 7)) if spec.split_kv else None,
        window=draw_window(rng, spec) if spec.window else None,
        softcap=pick(rng, (0.3, 1.5, 5.0, 20.0)) if spec.softcap else None,
        alibi_per_batch=spec.alibi and chance(rng, 0.5),
        null_lse=chance(rng, 0.1),
    )


def case_rng(seed: int, index: int) -> np.random.Generator:
    """The generator of case ``index`` of ``seed`` (independent of the other cases)."""
    return np.random.default_rng([seed, index])


def case_engine(rng: np.random.Generator, engine: str) -> str:
    """``engine``, or for ``all`` one drawn with the chances of :data:`ENGINE_SHARES`."""
    if engine != "all":
        return engine
    return str(rng.choice(list(ENGINE_SHARES), p=list(ENGINE_SHARES.values())))
