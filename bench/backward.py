"""``python -m bench.backward``: attention backward (training) TFLOP/s of kernelgen and its peers.

For every case (bf16, fp16 with ``--dtype``; head dim 64 and 128; seqlen 1k..16k with batch *
seqlen = 16384 tokens; causal and not; plus the variant cases: a causal document mask given as
a ``mask_mod`` and a causal softcap, bf16 d128) it makes input sets (q, k, v, dout), computes
fp32 reference gradients (torch autograd in fp32, TF32 off: SDPA's math backend for the plain
cases, the definitions for the variants), checks each peer's dq, dk and dv against them, then
times two things per peer, interleaved in rounds with the case's other peers:

- ``bwd``: the backward alone. torch peers (SDPA forced to FLASH_ATTENTION or CUDNN_ATTENTION,
  FlexAttention compiled) run their forward once per input set outside the timed region, on
  leaf tensors that require grad, and each timed call is ``torch.autograd.grad(out, (q, k, v),
  dout, retain_graph=True)`` on that saved graph: only the backward nodes run (retain_graph
  keeps the saved tensors for the next call). kernelgen's forward (``return_lse=True``) runs
  once per set outside the timed region and each timed call is ``attention_backward``.
- ``fwd+bwd``: forward and backward of one training step (a fresh graph per call).

FLOPs (FlashAttention's convention): the forward's ``4 * B * H * Sq * Sk * D``, halved for
causal (:func:`bench.metrics.attention_flops`); backward ``2.5x`` that (five matrix products
against the forward's two: S recomputed, dP, dV, dK, dQ), forward + backward ``3.5x``. The
deterministic kernel does more arithmetic (S and dP recomputed once more) but is credited the
same useful FLOPs. Writes ``<out>/<date>-<gpu>-backward[-tag].{json,md}`` after every case.
``--help``, ``--list`` and ``--dry-run`` need no GPU; without one a run prints one line and
exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness, metrics, report
from bench.candidates import Peer
from bench.harness import ROOT, Harness, git_info, load_previous, positive_int
from bench.shapes import TOKENS, Shape, grid

SEQLENS: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS: tuple[int, ...] = (64, 128)
DTYPES: tuple[str, ...] = ("bfloat16",)
QUICK_SEQLENS: tuple[int, ...] = (2048,)
QUICK_HEAD_DIMS: tuple[int, ...] = (128,)

BACKWARD_FACTOR = 2.5  # backward FLOPs over forward FLOPs (5 matrix products against 2)
FORWARD_BACKWARD_FACTOR = 1.0 + BACKWARD_FACTOR
BWD, FWD_BWD = "bwd", "fwd+bwd"
FLOP_CONVENTION = (
    "forward FLOPs = 4 * B * H * Sq * Sk * D, halved for causal (visible pairs: a causal block "
    "of n rows counts n^2 / 2); backward = 2.5x forward (S recomputed, dP, dV, dK, dQ against "
    "the forward's S and PV); forward + backward = 3.5x forward. The deterministic kernel's "
    "extra recomputation is not credited"
)
ISOLATION = (
    "bwd: the forward runs once per input set outside the timed region; each timed call is "
    "torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) on that saved graph (torch "
    "peers) or attention_backward on the saved out and lse (kernelgen). fwd+bwd: both, a "
    "fresh graph per call"
)
REFERENCE = (
    "fp32 gradients by torch autograd on upcast inputs (TF32 off): SDPA's math backend for the "
    "plain cases, softmax of the masked or capped scores for the variants; chunked over "
    "(batch, head); relative Frobenius error of dq, dk and dv, the worst one checked"
)

PEERS: tuple[Peer, ...] = (
    Peer("torch-flash", "flash", "torch SDPA FLASH_ATTENTION, autograd backward", "torch"),
    Peer("torch-cudnn", "cudnn", "torch SDPA CUDNN_ATTENTION, autograd backward", "torch"),
    Peer(
        "kg-atomic",
        "kg",
        "kernelgen attention_backward, dQ by fp32 atomics (default_backward_spec)",
        "kernelgen",
    ),
    Peer(
        "kg-det",
        "kg-det",
        "kernelgen attention_backward(deterministic=True), dQ by its own kernel",
        "kernelgen",
    ),
    Peer("flex", "flex", "FlexAttention (torch.compile), autograd backward", "torch"),
)
PEER_NAMES: tuple[str, ...] = tuple(p.name for p in PEERS)
PEERS_BY_NAME: dict[str, Peer] = {p.name: p for p in PEERS}
TORCH_BASELINES = ("torch-flash", "torch-cudnn")
KG_PEERS = ("kg-atomic", "kg-det")

# The variant cases: causal bf16 d128 (16 heads), one per selected seqlen.
VARIANTS: tuple[str, ...] = ("document", "softcap")
VARIANT_PEERS: tuple[str, ...] = ("kg-atomic", "kg-det", "flex")
VARIANT_DTYPE, VARIANT_HEAD_DIM = "bfloat16", 128
DOCUMENTS = 4  # equal documents packed in each sequence
DOC_MASK = "doc[b, q_idx] == doc[b, kv_idx]"  # with causal=True: causal within each document
SOFTCAP = 30.0


@dataclass(frozen=True)
class BackwardCase:
    """One row group: a shape and the variant applied to it (None: plain attention)."""

    shape: Shape
    variant: str | None = None

    @property
    def key(self) -> str:
        return f"{self.variant}-{self.shape.key}" if self.variant else self.shape.key

    # the shape's fields, read by the harness and the report
    dtype = property(lambda self: self.shape.dtype)
    head_dim = property(lambda self: self.shape.head_dim)
    causal = property(lambda self: self.shape.causal)
    seqlen_q = property(lambda self: self.shape.seqlen_q)
    seqlen_k = property(lambda self: self.shape.seqlen_k)
    batch = property(lambda self: self.shape.batch)
    heads = property(lambda self: self.shape.heads)

    def as_dict(self) -> dict[str, object]:
        return {**self.shape.as_dict(), "variant": self.variant}


# ---- pure: cases, FLOPs, bytes, peers ----------------------------------------------------------
def variant_cases(variants: Sequence[str], seqlens: Iterable[int]) -> list[BackwardCase]:
    """Each variant at each seqlen: causal, bf16, head dim 128, batch * seqlen = 16384."""
    return [
        BackwardCase(
            Shape(VARIANT_DTYPE, VARIANT_HEAD_DIM, True, s, s, max(1, TOKENS // s), 16), name
        )
        for name in variants
        for s in sorted(dict.fromkeys(seqlens))
    ]


def parse_names(text: str, known: Sequence[str], what: str) -> list[str]:
    """Comma-separated names of ``known`` in ``known``'s order ("none": none); ValueError."""
    names = {n.strip() for n in text.split(",") if n.strip()} - {"none"}
    unknown = sorted(names - set(known))
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return [n for n in known if n in names]


def select_cases(args: argparse.Namespace) -> list[BackwardCase]:
    """The plain grid and the variant cases the flags select; ValueError for bad flags."""
    parse_names(args.peers, PEER_NAMES, "peer(s)")
    parse_names(args.variant_peers, VARIANT_PEERS, "variant peer(s)")
    seqlens = args.seqlen or (QUICK_SEQLENS if args.quick else SEQLENS)
    shapes = grid(
        quick=False,
        dtypes=args.dtype or DTYPES,
        head_dims=args.head_dim or (QUICK_HEAD_DIMS if args.quick else HEAD_DIMS),
        seqlens=seqlens,
        causal=args.causal,
        tokens=args.tokens,
    )
    plain = [BackwardCase(s) for s in shapes] if parse_names(args.peers, PEER_NAMES, "") else []
    variants = parse_names(args.variants, VARIANTS, "variant(s)")
    if not parse_names(args.variant_peers, VARIANT_PEERS, ""):
        variants = []
    cases = plain + variant_cases(variants, seqlens)
    if not cases:
        raise ValueError("no cases selected")
    return cases


def forward_flops(case: BackwardCase) -> float:
    """The forward's FLOPs: the shape's (causal halved); the document case counts a causal
    block per document (``DOCUMENTS * (S / DOCUMENTS)^2 / 2`` pairs)."""
    s = case.shape
    if case.variant == "document":
        length = s.seqlen_q / DOCUMENTS
        return 4.0 * s.batch * s.heads * s.head_dim * DOCUMENTS * length * length / 2
    return metrics.shape_flops(s)


def mode_flops(case: BackwardCase, mode: str) -> float:
    """FLOPs credited to a timed call: backward alone or forward + backward."""
    factor = {BWD: BACKWARD_FACTOR, FWD_BWD: FORWARD_BACKWARD_FACTOR}[mode]
    return factor * forward_flops(case)


def set_bytes(case: BackwardCase) -> int:
    """Bytes of one input set: q, k, v and dout."""
    sizes = metrics.tensor_bytes(case.shape)
    return sizes["q"] + sizes["k"] + sizes["v"] + sizes["out"]


def grad_bytes(case: BackwardCase) -> int:
    """Bytes of dq, dk and dv."""
    sizes = metrics.tensor_bytes(case.shape)
    return sizes["q"] + sizes["k"] + sizes["v"]


def min_bytes(case: BackwardCase, mode: str) -> int:
    """Fewest bytes moved: the backward reads q, k, v, out, dout and the fp32 lse and writes
    dq, dk, dv; forward + backward adds the forward's (bench.metrics.min_bytes)."""
    sizes = metrics.tensor_bytes(case.shape)
    lse = metrics.lse_bytes(case.shape)
    backward = 4 * sizes["q"] + 2 * (sizes["k"] + sizes["v"]) + lse
    return backward + (metrics.min_bytes(case.shape) if mode == FWD_BWD else 0)


def peers_of(case: BackwardCase, args: argparse.Namespace) -> list[str]:
    """The peers a case runs: ``--peers`` for plain cases, ``--variant-peers`` for variants."""
    if case.variant is None:
        return parse_names(args.peers, PEER_NAMES, "peer(s)")
    return parse_names(args.variant_peers, VARIANT_PEERS, "variant peer(s)")


def sort_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain cases first (grid order), then the variants; peers in :data:`PEER_NAMES` order."""

    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        variant = row.get("variant") or ""
        peer = PEER_NAMES.index(row["peer"]) if row["peer"] in PEER_NAMES else len(PEER_NAMES)
        shape = (row["dtype"], row["head_dim"], row["causal"], row["seqlen_q"], row["seqlen_k"])
        return (bool(variant), variant, *shape, peer)

    return sorted(rows, key=key)


# ---- pure: the report -------------------------------------------------------------------------
LEGEND = (
    "Cells: backward alone / forward + backward TFLOP/s (median time; FLOPs as above). n/a: "
    "the peer refused the case; WRONG e: gradients failed the check with relative error e, not "
    "timed; ERR: raised (reasons below). kg/best: kg-atomic's backward TFLOP/s over the fastest "
    "other timed peer's; det/atomic: kg-det's over kg-atomic's."
)


def cell(row: dict[str, Any] | None) -> str:
    """``bwd / fwd+bwd`` TFLOP/s, or why there is none."""
    if row is None or row["status"] != report.OK:
        return report.cell(row)
    both = row.get("fwd_bwd") or {}
    second = f"{both['tflops']:.1f}" if both.get("tflops") else both.get("status", "?")
    return f"{report.cell(row)} / {second}"


def _ratio(row: dict[str, Any] | None, other: dict[str, Any] | None) -> str:
    value = report.ratio(row, other)
    return f"{value:.2f}x" if value is not None else "-"


def markdown_table(rows: Iterable[dict[str, Any]]) -> str:
    """One line per case: every peer's cell, kg/best and det/atomic."""
    header = ["case", "BxH", *(p.short for p in PEERS), "kg/best", "det/atomic"]
    lines = []
    for key, peers in report.group_by_shape(rows, sort=sort_rows):
        first = next(iter(peers.values()))
        others = [r for p, r in peers.items() if p not in KG_PEERS and r["status"] == report.OK]
        best = max(others, key=lambda r: r.get("tflops") or 0.0, default=None)
        atomic = peers.get("kg-atomic")
        lines.append(
            [
                key,
                f"{first['batch']}x{first['heads']}",
                *(cell(peers.get(p.name)) for p in PEERS),
                _ratio(atomic, best),
                _ratio(peers.get("kg-det"), atomic),
            ]
        )
    align = ["---", "---"] + ["---:"] * (len(PEERS) + 2)
    return report.md_table(header, lines, align)


def matmul_table(rows: Iterable[dict[str, Any]]) -> str:
    """Per timed row: backward alone against the floors (fraction of matmul, gap)."""
    lines = []
    for row in sort_rows(rows):
        if row["status"] != report.OK or not row.get("median_ms"):
            continue
        frac = row.get("frac_of_matmul")
        gap = row.get("gap")
        lines.append(
            [
                row["shape"],
                row["peer"],
                f"{row['median_ms']:.3f}",
                f"{100 * frac:.0f}%" if frac else "-",
                f"{gap:.2f}" if gap else "-",
                f"{row['rel_err']:.1e}" if row.get("rel_err") is not None else "-",
            ]
        )
    header = ["case", "peer", "bwd ms", "of matmul", "gap", "rel. err"]
    return report.md_table(header, lines, ["---", "---", "---:", "---:", "---:", "---:"])


def markdown_document(result: dict[str, Any]) -> str:
    """The .md file: provenance, conventions, the TFLOP/s table, floors, reasons."""
    meta, floors, rows = result["meta"], result.get("floors", {}), result["rows"]
    matmul = floors.get("matmul_tflops", {})
    lines = [
        f"# Attention backward benchmark: {meta.get('gpu_name', '?')} ({meta.get('date', '?')})",
        "",
        *report.provenance(meta),
        f"- FLOPs: {meta.get('flops', FLOP_CONVENTION)}",
        f"- backward alone: {meta.get('isolation', ISOLATION)}",
        f"- reference: {meta.get('reference', REFERENCE)}",
        f"- kernelgen's forward: {meta.get('kernelgen_forward', '?')}",
        "- measured floors: matmul 8192^3 bf16 {bf16} TFLOP/s, fp16 {fp16} TFLOP/s; copy "
        "{copy} GB/s".format(
            bf16=_num(matmul.get("bfloat16")),
            fp16=_num(matmul.get("float16")),
            copy=_num(floors.get("copy_gbps")),
        ),
        "",
        "## TFLOP/s (backward / forward + backward)",
        "",
        markdown_table(rows),
        "",
        LEGEND,
        "",
        "## Backward alone against the floors",
        "",
        matmul_table(rows),
        "",
    ]
    notes = report.reasons(rows, sort=sort_rows)
    if notes:
        lines += ["## Not timed", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)


def _num(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "?"


def progress_line(row: dict[str, Any]) -> str:
    both = row.get("fwd_bwd") or {}
    times = ""
    if row.get("median_ms"):
        times = f"{row['median_ms']:9.3f} ms {row.get('tflops') or 0:7.1f} TFLOP/s"
        if both.get("median_ms"):
            times += f"  fwd+bwd {both['median_ms']:9.3f} ms {both.get('tflops') or 0:7.1f}"
    reason = f"  {str(row.get('reason'))[:70]}" if row["status"] != report.OK else ""
    return f"{row['shape']:34} {row['peer']:11} {row['status']:11} {times}{reason}"


# ---- the GPU layer (torch, CuPy and kernelgen are imported by a run only) ---------------------
def make_sets(env: Any, case: BackwardCase, count: int, seed: int) -> list[tuple[Any, ...]]:
    """``count`` independent (q, k, v, dout) sets in (B, H, S, D): randn in fp32, then cast."""
    torch = env.torch
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = case.shape
    q_shape = (s.batch, s.heads, s.seqlen_q, s.head_dim)
    kv_shape = (s.batch, s.kv_heads, s.seqlen_k, s.head_dim)
    return [
        tuple(
            torch.randn(size, device="cuda", dtype=torch.float32, generator=gen).to(dtype)
            for size in (q_shape, kv_shape, kv_shape, q_shape)
        )
        for _ in range(count)
    ]


def document_ids(env: Any, case: BackwardCase) -> Any:
    """int32 (B, S): :data:`DOCUMENTS` equal documents per sequence."""
    torch = env.torch
    s = case.shape
    ids = torch.arange(s.seqlen_q, device="cuda", dtype=torch.int32) * DOCUMENTS // s.seqlen_q
    return ids.expand(s.batch, s.seqlen_q).contiguous()


def reference_grads(env: Any, case: BackwardCase, inputs: tuple, chunk_bytes: int = 1 << 29):
    """fp32 (dq, dk, dv) of one input set by autograd (see :data:`REFERENCE`), in groups of
    (batch, head) pairs whose fp32 score matrices fit ``chunk_bytes`` (autograd keeps a few)."""
    torch = env.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.gpu import exact_fp32

    q, k, v, dout = inputs
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    flat = [t.reshape(batch * heads, t.shape[2], head_dim) for t in (q, k, v, dout)]
    grads = [torch.empty(t.shape, device=t.device, dtype=torch.float32) for t in flat[:3]]
    group = max(1, chunk_bytes // (seqlen_q * seqlen_k * 4))
    rows = torch.arange(seqlen_q, device="cuda")[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device="cuda")[None, :]
    doc = document_ids(env, case) if case.variant == "document" else None
    scale = head_dim**-0.5
    with exact_fp32(torch), sdpa_kernel(SDPBackend.MATH):
        for start in range(0, batch * heads, group):
            part = slice(start, min(start + group, batch * heads))
            qf, kf, vf = (t[part].float().requires_grad_() for t in flat[:3])
            if case.variant is None:
                out = torch.nn.functional.scaled_dot_product_attention(
                    qf, kf, vf, is_causal=case.causal
                )
            else:
                scores = (qf @ kf.transpose(1, 2)) * scale
                if case.variant == "softcap":
                    scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
                visible = (cols <= rows)[None] if case.causal else None
                if doc is not None:
                    b = torch.arange(part.start, part.stop, device="cuda") // heads
                    same = doc[b][:, rows - (seqlen_k - seqlen_q)] == doc[b][:, None, :]
                    visible = same if visible is None else visible & same
                if visible is not None:
                    scores = scores.masked_fill(~visible, float("-inf"))
                out = torch.softmax(scores, dim=-1) @ vf
            got = torch.autograd.grad(out, (qf, kf, vf), flat[3][part].float())
            for dst, src in zip(grads, got, strict=True):
                dst[part] = src
            del out, got, qf, kf, vf
    return tuple(g.view(t.shape) for g, t in zip(grads, (q, k, v), strict=True))


class GradImpl:
    """One peer bound to the input sets: ``save(i)`` runs set i's forward and keeps what the
    backward needs (untimed), ``backward(i)`` gives (dq, dk, dv) from it, ``forward_backward(i)``
    runs both. ``poison``: a context that NaN-fills the peer's own allocations (None: the
    harness leaves NaN blocks in the allocator pools instead)."""

    spec_uri: str | None = None
    poison: Callable[[], contextlib.AbstractContextManager[None]] | None = None

    def __init__(self, peer: str, sets: list[tuple[Any, ...]]) -> None:
        self.peer, self.sets = peer, sets
        self.saved: dict[int, Any] = {}

    def save(self, i: int) -> None:
        raise NotImplementedError

    def backward(self, i: int) -> tuple[Any, ...]:
        raise NotImplementedError

    def forward_backward(self, i: int) -> tuple[Any, ...]:
        raise NotImplementedError


class AutogradImpl(GradImpl):
    """A torch attention function differentiated by autograd; q, k, v are leaf aliases (same
    storage) that require grad."""

    def __init__(self, env: Any, peer: str, sets: list, attend: Callable[..., Any]) -> None:
        super().__init__(peer, sets)
        self.torch, self.attend = env.torch, attend
        self.leaves = [tuple(t.detach().requires_grad_() for t in s[:3]) for s in sets]

    def save(self, i: int) -> None:
        self.saved[i] = self.attend(*self.leaves[i])

    def backward(self, i: int) -> tuple[Any, ...]:
        grad = self.torch.autograd.grad
        return grad(self.saved[i], self.leaves[i], self.sets[i][3], retain_graph=True)

    def forward_backward(self, i: int) -> tuple[Any, ...]:
        out = self.attend(*self.leaves[i])
        return self.torch.autograd.grad(out, self.leaves[i], self.sets[i][3])


class KernelgenImpl(GradImpl):
    """kernelgen.attention (``return_lse=True``) then kernelgen.attention_backward, on torch's
    current stream; ``options``: the case's causal flag and variant arguments."""

    def __init__(
        self, env: Any, peer: str, sets: list, options: dict[str, Any], spec: Any, det: bool
    ) -> None:
        super().__init__(peer, sets)
        self.env, self.kg, self.options = env, env.kernelgen, options
        self.spec, self.det = spec, det
        self.spec_uri = getattr(spec, "uri", None)
        self.poison = lambda: env.kg_module("testing.poison").poisoned_outputs()

    def _forward(self, i: int) -> tuple[Any, Any]:
        q, k, v, _ = self.sets[i]
        return self.kg.attention(q, k, v, return_lse=True, **self.options)

    def _backward(self, i: int, out: Any, lse: Any) -> tuple[Any, ...]:
        q, k, v, dout = self.sets[i]
        return self.kg.attention_backward(
            dout, q, k, v, out, lse, deterministic=self.det, spec=self.spec, **self.options
        )

    def save(self, i: int) -> None:
        with self.env.stream():
            self.saved[i] = self._forward(i)

    def backward(self, i: int) -> tuple[Any, ...]:
        with self.env.stream():
            return self._backward(i, *self.saved[i])

    def forward_backward(self, i: int) -> tuple[Any, ...]:
        with self.env.stream():
            return self._backward(i, *self._forward(i))


def sdpa_attend(env: Any, backend: str, causal: bool) -> Callable[..., Any]:
    """torch SDPA forced to ``backend`` (its backward is the matching backward kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)
    sdpa = env.torch.nn.functional.scaled_dot_product_attention

    def attend(q: Any, k: Any, v: Any) -> Any:
        with sdpa_kernel(chosen):
            return sdpa(q, k, v, is_causal=causal)

    return attend


def flex_attend(env: Any, case: BackwardCase) -> Callable[..., Any]:
    """FlexAttention compiled for the case (dynamo's caches reset first, so that many shapes
    never exceed its recompile limit and fall back to the unfused eager path): a block mask for
    causality and the documents, a score_mod for softcap."""
    torch = env.torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    with contextlib.suppress(Exception):
        torch._dynamo.reset()
    # The backward-alone timing calls autograd.grad(..., retain_graph=True) on one saved graph,
    # which a compiled backward with donated buffers refuses (torch 2.11 raises on the second
    # call); donation saves memory, not time, so it is switched off for the benchmark.
    with contextlib.suppress(Exception):
        torch._functorch.config.donated_buffer = False
    s = case.shape
    doc = document_ids(env, case) if case.variant == "document" else None

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        causal = kv_idx <= q_idx
        return causal & (doc[b, q_idx] == doc[b, kv_idx]) if doc is not None else causal

    block_mask = None
    if case.causal or doc is not None:
        batch = s.batch if doc is not None else None
        block_mask = create_block_mask(mask_mod, batch, None, s.seqlen_q, s.seqlen_k, device="cuda")
    score_mod = None
    if case.variant == "softcap":

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return SOFTCAP * torch.tanh(score / SOFTCAP)

    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(q: Any, k: Any, v: Any) -> Any:
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)

    return attend


def kernelgen_options(env: Any, case: BackwardCase) -> dict[str, Any]:
    """attention()'s and attention_backward()'s arguments for the case."""
    options: dict[str, Any] = {"causal": case.causal}
    if case.variant == "softcap":
        options["softcap"] = SOFTCAP
    elif case.variant == "document":
        options.update(mask_mod=DOC_MASK, mod_inputs={"doc": document_ids(env, case)})
    return options


def backward_spec(case: BackwardCase, deterministic: bool, mod_inputs: Any = None) -> Any:
    """kernelgen.model.policy.default_backward_spec for the case (its variant flags, and for the
    document case the mask_mod checked against ``mod_inputs``, any arrays of (B, S))."""
    from kernelgen.model.policy import default_backward_spec

    s = case.shape
    expressions = None
    if case.variant == "document":
        from kernelgen.calls.expression_inputs import check_expressions

        expressions = check_expressions(
            score_mod=None, mask_mod=DOC_MASK, mod_inputs=mod_inputs, block_mask=None,
            batch=s.batch, heads=s.heads, seqlen_q=s.seqlen_q, seqlen_k=s.seqlen_k,
        )  # fmt: skip
    variants = ("softcap",) if case.variant == "softcap" else ()
    return default_backward_spec(
        s.dtype, s.head_dim, causal=s.causal, variants=variants, expressions=expressions,
        deterministic=deterministic,
    )  # fmt: skip


# ---- the runner --------------------------------------------------------------------------------
class BackwardRunner(Harness):
    """The harness's timer, rounds and error handling with gradient checks and two timed modes
    (``measure`` here checks dq, dk, dv; a row's own figures are the backward alone, its
    ``fwd_bwd`` dict forward + backward)."""

    def __init__(self, env: Any, args: argparse.Namespace, floors: dict[str, Any]) -> None:
        super().__init__(env, args, floors, list(PEER_NAMES))
        self.interleave = True  # a case's peers (both modes) are timed together

    def figures(self, key: Any, times: list[float]) -> dict[str, Any]:
        """TFLOP/s of one mode, its fraction of the measured matmul, floors and gap."""
        case, mode = key
        stats = metrics.summarize(times)
        flops = mode_flops(case, mode)
        rate = metrics.tflops(flops, stats["median_ms"])
        matmul = self.floors.get("matmul_tflops", {}).get(case.dtype)
        copy_bps = (self.floors.get("copy_gbps") or 0) * 1e9 or None
        compute_ms, memory_ms = metrics.floor_ms(flops, min_bytes(case, mode), matmul, copy_bps)
        floor = max(x for x in (compute_ms, memory_ms, 0.0) if x is not None)
        return {
            **stats,
            "mode": mode,
            "flops": flops,
            "tflops": rate,
            "frac_of_matmul": rate / matmul if rate and matmul else None,
            "compute_floor_ms": compute_ms,
            "memory_floor_ms": memory_ms,
            "gap": stats["median_ms"] / floor if floor else None,
        }

    def check(self, case: BackwardCase, impl: GradImpl, run: Callable[[], tuple], ref: tuple):
        """(worst relative error or None, {gradient: error}, non-finite count) of one call,
        the peer's outputs poisoned with NaN first."""
        gpu, env = self.gpu, self.env
        if impl.poison is not None:
            with impl.poison():
                grads = run()
        else:
            gpu.poison_allocators(env, grad_bytes(case))
            grads = run()
        env.sync()
        errors: dict[str, float | None] = {}
        bad = 0
        for name, got, want in zip(("dq", "dk", "dv"), grads[:3], ref, strict=True):
            errors[name], nonfinite = gpu.relative_error(env, got, want)
            bad += nonfinite
        del grads
        worst = None if bad else max(e for e in errors.values() if e is not None)
        return worst, errors, bad

    def measure(
        self, shape: Any, impl: Any, sets: list, ref: Any, budget_ms: float | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Check forward + backward and the backward from a saved forward (the timed path),
        record the backward's extra memory, then time both modes (pending with interleave)."""
        case: BackwardCase = shape
        tol = metrics.tolerance(case.dtype)
        fields: dict[str, Any] = {"tol": tol}
        if impl.spec_uri:
            fields["spec_uri"] = impl.spec_uri
        impl.save(0)
        fields["grad_errs"] = {}
        for label, run in (
            (FWD_BWD, lambda: impl.forward_backward(0)),
            (BWD, lambda: impl.backward(0)),  # from the saved forward: the timed path
        ):
            worst, errors, bad = self.check(case, impl, run, ref)
            fields["grad_errs"][label] = errors
            fields["rel_err"] = None if worst is None else max(worst, fields.get("rel_err") or 0.0)
            if worst is None or worst >= tol:
                why = f"{bad} non-finite gradient elements"
                if worst is not None:
                    why = f"rel. error {worst:.3g} >= tolerance {tol:g}"
                return report.WRONG, {**fields, "reason": f"{label}: {why}"}
        probe = self.gpu.Impl(impl.peer, lambda *_: impl.backward(0))
        extra = self.gpu.extra_memory(self.env, probe, None, None, None, grad_bytes(case))
        fields["extra_mem_bytes"] = extra
        for i in range(1, len(sets)):
            impl.save(i)
        fields["fwd_bwd"] = {}
        self.rounds.defer(fields, (case, BWD), impl.backward, len(sets), budget_ms)
        self.rounds.defer(
            fields["fwd_bwd"], (case, FWD_BWD), impl.forward_backward, len(sets), budget_ms
        )
        if not self.interleave:
            self.rounds.finish([fields, fields["fwd_bwd"]], self.figures)
        return report.OK, fields

    # -- the peers --
    def torch_row(self, case: BackwardCase, peer: str, sets: list, ref: Any) -> dict[str, Any]:
        """SDPA (flash, cuDNN) or FlexAttention; a refusal on the first call is unavailable."""
        gpu, env = self.gpu, self.env
        with gpu.capture_warnings() as caught:
            try:
                if peer == "flex":
                    attend = flex_attend(env, case)
                else:
                    backends = {v: k for k, v in gpu.BACKEND_PEERS.items()}
                    attend = sdpa_attend(env, backends[peer.split("-", 1)[1]], case.causal)
                impl = AutogradImpl(env, peer, sets, attend)
                impl.forward_backward(0)  # torch.compile's compilation happens here
                env.sync()
            except gpu.FatalGPUError:
                raise
            except Exception as exc:
                env.sync()
                unavailable, reason = gpu.classify_torch_failure(exc, caught)
                unavailable = unavailable or _missing(exc)
                status = report.UNAVAILABLE if unavailable else report.ERROR
                return report.make_row(case, peer, status, reason=reason)
        return self.guarded(case, peer, lambda: impl, sets, ref)

    def kernelgen_row(self, case: BackwardCase, peer: str, sets: list, ref: Any) -> dict:
        """kernelgen's forward (attention() without a spec) and its default backward spec."""
        env = self.env
        if env.kernelgen is None:
            return report.make_row(case, peer, report.UNAVAILABLE, reason=env.kernelgen_error)
        det = peer == "kg-det"
        options = kernelgen_options(env, case)
        try:
            spec = backward_spec(case, det, options.get("mod_inputs"))
        except Exception as exc:  # SpecError: the policy has no spec for the case
            return report.make_row(case, peer, report.UNAVAILABLE, reason=self.gpu.first_line(exc))
        limit = self.args.simt_max_seqlen
        if spec.mma == "simt" and case.seqlen_q > limit:
            reason = f"CUDA-core backward at seqlen {case.seqlen_q} > --simt-max-seqlen {limit}"
            return report.make_row(case, peer, report.SKIPPED, reason=reason, spec_uri=spec.uri)

        def make() -> KernelgenImpl:
            return KernelgenImpl(env, peer, sets, options, spec, det)

        return self.guarded(case, peer, make, sets, ref)

    def peer_row(self, case: BackwardCase, peer: str, sets: list, ref: Any) -> dict[str, Any]:
        gpu = self.gpu
        try:
            if peer in KG_PEERS:
                row = self.kernelgen_row(case, peer, sets, ref)
            else:
                row = self.torch_row(case, peer, sets, ref)
        except gpu.FatalGPUError:
            raise
        except Exception as exc:
            self.env.sync()
            row = report.make_row(case, peer, report.ERROR, reason=gpu.first_line(exc))
        row.setdefault("label", PEERS_BY_NAME[peer].label)
        return row

    def shape_rows(self, shape: Any) -> list[dict[str, Any]]:
        """Every peer of one case: inputs, reference, checks, then the interleaved timing."""
        case: BackwardCase = shape
        env = self.env
        n_sets = metrics.rotation_count(env.info.get("l2_bytes"), set_bytes(case))
        seed = self.args.seed * 1000 + zlib.crc32(case.key.encode()) % 1000
        sets = make_sets(env, case, n_sets, seed)
        ref = reference_grads(env, case, sets[0])
        rows = [self.peer_row(case, peer, sets, ref) for peer in peers_of(case, self.args)]
        nested = [r["fwd_bwd"] for r in rows if isinstance(r.get("fwd_bwd"), dict)]
        self.time_pending(rows + nested)
        for row in rows:
            row["n_sets"] = n_sets
            print(progress_line(row), flush=True)
        del sets, ref
        self.gpu.release(env)
        return rows


def _missing(exc: BaseException) -> bool:
    """An exception that says a library is missing (FlexAttention without triton, an old
    torch without flex_attention), anywhere in its chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ImportError) or "triton installation" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# ---- the command line -------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.backward",
        description="Attention backward benchmark: backward and forward + backward TFLOP/s of "
        "kernelgen (atomic and deterministic dQ) against torch SDPA's flash and cuDNN backward "
        "and FlexAttention, plus variant cases (document mask_mod, softcap) against "
        "FlexAttention. Gradients are checked against fp32 autograd before timing.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="bf16 d128 S=2048, causal and not, and the variants at 2048; 200 ms budget",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="results folder")
    p.add_argument("--dtype", action="append", metavar="bf16|fp16", help="repeatable (bf16)")
    p.add_argument("--head-dim", action="append", type=int, metavar="D", help="repeatable")
    p.add_argument(
        "--seqlen", action="append", type=int, metavar="S", help="repeatable (variants too)"
    )
    p.add_argument(
        "--causal",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plain cases: only causal or only non-causal (default both)",
    )
    p.add_argument("--tokens", type=int, default=TOKENS, help="batch * seqlen (16384)")
    p.add_argument(
        "--peers",
        default=",".join(PEER_NAMES),
        help=f"plain cases' peers, a subset of {','.join(PEER_NAMES)} ('none': no plain cases)",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"variant cases, a subset of {','.join(VARIANTS)} ('none': no variant cases)",
    )
    p.add_argument(
        "--variant-peers",
        default=",".join(VARIANT_PEERS),
        help=f"variant cases' peers, a subset of {','.join(VARIANT_PEERS)}",
    )
    p.add_argument("--budget-ms", type=float, help="time budget per measurement (200 quick, 500)")
    p.add_argument("--min-reps", type=positive_int, default=20, help="timed repetitions, least")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="timing rounds (3): a case's peers and modes interleaved, rotating",
    )
    p.add_argument(
        "--simt-max-seqlen",
        type=int,
        default=4096,
        help="time kernelgen's CUDA-core (simt) backward only up to this seqlen (it is slow)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", help="suffix of the result file names (after -backward)")
    p.add_argument("--merge", action="store_true", help="merge into an existing result file")
    p.add_argument("--list", action="store_true", help="print the cases and peers, then exit")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and build and render kernelgen's backward specs (no GPU), then exit",
    )
    return p.parse_args(argv)


def list_plan(cases: list[BackwardCase], args: argparse.Namespace) -> None:
    print(f"{len(cases)} backward cases (batch x heads x seqlen x head_dim, dtype, causal):")
    for c in cases:
        s = c.shape
        print(
            f"  {c.key:34} B={s.batch:<3} H={s.heads:<2} S={s.seqlen_q:<5} D={s.head_dim:<3} "
            f"bwd {mode_flops(c, BWD) / 1e9:8.1f} GFLOP  fwd+bwd "
            f"{mode_flops(c, FWD_BWD) / 1e9:8.1f} GFLOP  peers {','.join(peers_of(c, args))}"
        )
    print(f"FLOPs: {FLOP_CONVENTION}")


def dry_run(cases: list[BackwardCase], args: argparse.Namespace) -> int:
    """The plan, then each kernelgen backward spec the run would use, built and rendered on
    host arrays (no GPU, no compiler); 1 when one fails."""
    import numpy as np

    from kernelgen.families import backward as family

    list_plan(cases, args)
    failed = 0
    for case in cases:
        for peer in (p for p in peers_of(case, args) if p in KG_PEERS):
            doc = np.zeros((case.batch, case.seqlen_q), np.int32)
            try:
                spec = backward_spec(case, peer == "kg-det", {"doc": doc})
                family.render(spec)
                status = f"ok {spec.uri}"
            except Exception as exc:
                failed += 1
                status = f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            print(f"  {case.key:34} {peer:10} {status}")
    return 1 if failed else 0


def run_meta(env: Any, today: dt.date) -> dict[str, Any]:
    from bench import gpu

    kg = env.kernelgen
    template_hash = None
    if kg is not None:
        with contextlib.suppress(Exception):
            template_hash = env.kg_module("kernels.render").template_hash()
    mode = os.environ.get("KERNELGEN_AUTOTUNE")
    return {
        "date": today.isoformat(),
        "benchmark": "backward",
        **env.info,
        "kernelgen_version": getattr(kg, "__version__", None),
        "kernelgen_error": env.kernelgen_error,
        "template_hash": template_hash,
        **git_info(),
        "clocks_start": harness.gpu_clocks(),
        "python": sys.version.split()[0],
        "autotune_mode": mode,
        "kernelgen_forward": "kernelgen.attention(..., return_lse=True) without a spec, "
        f"KERNELGEN_AUTOTUNE={mode} (0: the heuristic spec, no tuning)",
        "timing": gpu.TIMING_METHOD,
        "memory_method": "torch.cuda.max_memory_allocated delta plus CuPy's requested bytes "
        "during one backward call (saved forward), minus dq, dk and dv",
        "flops": FLOP_CONVENTION,
        "isolation": ISOLATION,
        "reference": REFERENCE,
    }


def write_results(
    paths: dict[str, Path],
    meta: dict[str, Any],
    floors: dict[str, Any],
    rows: list[dict[str, Any]],
    settings: dict[str, Any],
) -> list[Path]:
    """Write the .json and .md (atomically); the paths written."""
    result = report.build_result(meta, floors, rows, settings, sort=sort_rows)
    report.write_atomic(paths["json"], report.to_json(result))
    report.write_atomic(paths["md"], markdown_document(result))
    return [paths["json"], paths["md"]]


def run(args: argparse.Namespace, cases: list[BackwardCase]) -> int:
    from bench import gpu

    env = harness.open_env()
    if env is None:
        return 2
    os.environ.setdefault("KERNELGEN_AUTOTUNE", "0")  # kernelgen's forward: the heuristic spec
    today = dt.date.today()
    meta = run_meta(env, today)
    settings = harness.run_settings(args, cases, timing_rounds=args.rounds)
    runner = BackwardRunner(env, args, floors={})
    print(f"bench.backward: {env.info['gpu_name']}, {len(cases)} cases")
    runner.floors = floors = gpu.measure_floors(env, runner.timer)
    matmul = floors["matmul_tflops"]
    print(
        f"floors: matmul bf16 {matmul['bfloat16']:.0f} / fp16 {matmul['float16']:.0f} TFLOP/s, "
        f"copy {floors['copy_gbps']:.0f} GB/s",
        flush=True,
    )
    tag = f"backward-{args.tag}" if args.tag else "backward"
    paths = report.result_paths(args.out, report.result_stem(today, env.info["gpu_name"], tag))
    previous = load_previous(paths["json"]) if args.merge else []

    def checkpoint(rows: list[dict[str, Any]]) -> None:
        meta["compile_s"] = runner.compile_s
        write_results(paths, meta, floors, report.merge_rows(previous, rows, sort_rows), settings)

    rows, fatal = harness.run_shapes(
        cases, lambda case: harness.shape_or_error(runner, case), checkpoint
    )
    meta["fatal"] = fatal
    meta["clocks_end"] = harness.gpu_clocks()
    all_rows = report.merge_rows(previous, rows, sort_rows)
    for path in write_results(paths, meta, floors, all_rows, settings):
        print(f"wrote {path}")
    print()
    print(markdown_table(all_rows))
    return 1 if fatal else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cases = select_cases(args)
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if args.list:
        list_plan(cases, args)
        return 0
    if args.dry_run:
        return dry_run(cases, args)
    return run(args, cases)


if __name__ == "__main__":
    sys.exit(main())
