"""Benchmark of the attention variants (docs/variants.md) against torch's peers.

```
python -m bench.variants [--quick] [--out bench/results] [--list]
```

For each variant case (a causal sliding window, softcap, ALiBi, sinks, and two user expressions:
a causal document mask over 4 packed documents, run block-sparse from a block mask, and a
relative-position bias score_mod; bf16, head dim 128, 16 heads, batch * seqlen = 16384
tokens) it times kernelgen.attention (the default spec with the variant's flags or
expressions; the document mask on the mma.sync kernel, and as ``kernelgen-wg`` on a 9.0
device on the Hopper wgmma kernel, docs/hopper.md "Block-sparse masks", and as
``kernelgen-wg-fp8`` on its fp8 twin: the bf16 inputs rounded to e4m3 outside the timed region,
checked against the reference of the rounded inputs within the fp8 tolerance) against FlexAttention
(torch.nn.attention.flex_attention: a block mask for the window and the documents, a score_mod
for softcap, ALiBi and the bias, the sink folded in from its lse) and, where the
flash-attn package is installed, FlashAttention 2's own window_size / softcap / alibi_slopes.
Each peer is checked first against an fp32 torch reference of the same semantics (relative
Frobenius error below bench.metrics' tolerance), then timed with bench.gpu.Timer. Without a GPU
it prints one line and exits 2; ``--list`` needs no GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import metrics, report
from bench.harness import git_info, open_env
from bench.shapes import TOKENS, Shape

HEAD_DIM = 128
HEADS = 16
WINDOW = 1024  # keys a query sees with the sliding window: itself and the 1023 before it
SOFTCAP = 30.0
SEQLENS = (4096, 16384)
QUICK_SEQLENS = (4096,)
PEERS = ("kernelgen", "flex", "flash-attn", "kernelgen-wg", "kernelgen-wg-fp8")
FP8_PEER = "kernelgen-wg-fp8"  # takes the sets rounded to e4m3 (bench.gpu.quantize_sets)
BF16 = "bfloat16"
DOC_INPUTS = ("doc:int32[2]",)  # the document mask's mod_inputs, as a spec declares them


@dataclass(frozen=True)
class VariantCase:
    """One benchmark row group: the variant arguments of attention() on a causal shape."""

    name: str
    shape: Shape

    @property
    def key(self) -> str:
        return f"{self.name}-{self.shape.key}"


VARIANTS = ("window", "softcap", "alibi", "sinks", "document", "relbias")
DOCUMENTS = 4  # equal documents packed in each sequence (the "document" case)
DOC_MASK = "doc[b, q_idx] == doc[b, kv_idx]"
REL_BIAS = "score + bias[h, min(max(q_idx - kv_idx, -128), 127) + 128]"


def cases(quick: bool = False, variants: Sequence[str] = VARIANTS) -> list[VariantCase]:
    """Every variant on every sequence length (causal, Sq = Sk, bf16)."""
    return [
        VariantCase(name, Shape("bfloat16", HEAD_DIM, True, s, s, TOKENS // s, HEADS))
        for name in variants
        for s in (QUICK_SEQLENS if quick else SEQLENS)
    ]


def alibi_slopes(heads: int) -> list[float]:
    """The ALiBi paper's geometric slopes 2^(-8 (h + 1) / H)."""
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def sink_values(heads: int) -> list[float]:
    """Fixed per-head sinks around the typical lse (a few units)."""
    return [1.0 + 0.25 * (h % 8) for h in range(heads)]


def visible_flops(case: VariantCase) -> float:
    """Useful FLOPs: 4 D per visible (query, key) pair (the window's, or the causal triangle)."""
    s = case.shape
    if case.name == "window":
        pairs = sum(min(i + 1, WINDOW) for i in range(s.seqlen_q))
    elif case.name == "document":
        length = s.seqlen_q // DOCUMENTS
        pairs = DOCUMENTS * length * (length + 1) / 2
    else:
        pairs = s.seqlen_q * (s.seqlen_q + 1) / 2
    return 4.0 * s.batch * s.heads * s.head_dim * pairs


# ---- the GPU side --------------------------------------------------------------------------
def variant_arguments(env: Any, case: VariantCase) -> dict[str, Any]:
    """attention()'s variant arguments for the case (arrays as CUDA fp32 torch tensors)."""
    torch = env.torch
    heads = case.shape.heads
    if case.name == "document":
        return {"mask_mod": DOC_MASK, "mod_inputs": {"doc": document_ids(env, case)}}
    if case.name == "relbias":
        return {"score_mod": REL_BIAS, "mod_inputs": {"bias": relative_bias(env, case)}}
    return {
        "window": {"window_size": (WINDOW - 1, 0)},
        "softcap": {"softcap": SOFTCAP},
        "alibi": {"alibi_slopes": torch.tensor(alibi_slopes(heads), device="cuda")},
        "sinks": {"sinks": torch.tensor(sink_values(heads), device="cuda")},
    }[case.name]


def document_ids(env: Any, case: VariantCase) -> Any:
    """int32 (B, S): DOCUMENTS equal documents per sequence."""
    torch = env.torch
    s = case.shape
    ids = torch.arange(s.seqlen_q, device="cuda", dtype=torch.int32) * DOCUMENTS // s.seqlen_q
    return ids.expand(s.batch, s.seqlen_q).contiguous()


def relative_bias(env: Any, case: VariantCase) -> Any:
    """fp32 (H, 256): a small learned-looking bias per head and clipped distance."""
    torch = env.torch
    generator = torch.Generator(device="cuda").manual_seed(0)
    return 0.5 * torch.randn(case.shape.heads, 256, device="cuda", generator=generator)


def reference(env: Any, case: VariantCase, q: Any, k: Any, v: Any) -> Any:
    """fp32 attention with the variant, one (batch, head) at a time, from the definitions."""
    torch = env.torch
    args = variant_arguments(env, case)
    batch, heads, sq, d = q.shape
    sk = k.shape[2]
    i = torch.arange(sq, device="cuda")[:, None] + (sk - sq)
    j = torch.arange(sk, device="cuda")[None, :]
    visible = j <= i
    if case.name == "window":
        visible &= j >= i - (WINDOW - 1)
    out = torch.empty(q.shape, device="cuda", dtype=torch.float32)
    from bench.gpu import exact_fp32

    with exact_fp32(torch):
        for b in range(batch):
            for h in range(heads):
                s = (q[b, h].float() @ k[b, h].float().T) / math.sqrt(d)
                if case.name == "softcap":
                    s = SOFTCAP * torch.tanh(s / SOFTCAP)
                if case.name == "alibi":
                    s = s - args["alibi_slopes"][h] * (i - j).abs()
                if case.name == "relbias":
                    distance = (i - j).clamp(-128, 127) + 128
                    s = s + args["mod_inputs"]["bias"][h][distance]
                row_visible = visible
                if case.name == "document":
                    doc = args["mod_inputs"]["doc"][b]
                    row_visible = visible & (doc[i - (sk - sq)] == doc[j])
                s = s.masked_fill(~row_visible, float("-inf"))
                if case.name == "sinks":
                    sink = args["sinks"][h].expand(sq, 1)
                    p = torch.softmax(torch.cat([s, sink], dim=1), dim=1)[:, :-1]
                else:
                    p = torch.softmax(s, dim=1)
                out[b, h] = p @ v[b, h].float()
    return out


def kernelgen_peer(env: Any, case: VariantCase) -> Callable[..., Any]:
    """kernelgen.attention with the case's arguments; the document mask runs block-sparse from a
    block mask built once (as a model would, once per batch for all layers), on the mma.sync
    kernel of the untuned default's tiles for a call with expressions, pinned (a 9.0 device
    would otherwise run wgmma: the kernelgen-wg row)."""
    args = variant_arguments(env, case)
    kg = env.kernelgen
    if case.name == "document":
        tiles = kg.default_spec("bfloat16", case.shape.head_dim, True, env.arch, expressions=True)
        sparse = {"mask_mod": DOC_MASK, "mod_inputs": DOC_INPUTS, "block_sparse": True}
        args["spec"] = kg.KernelSpec(**{**tiles.model_dump(), **sparse})
        args["block_mask"] = document_block_mask(env, case, args["spec"], args["mod_inputs"])
    return _attention_call(env, args)


def kernelgen_wg_peer(env: Any, case: VariantCase) -> Callable[..., Any]:
    """The document mask's block-sparse run on the Hopper (wgmma) kernel: a block mask in the
    untuned Hopper tiles (kernelgen.model.policy.hopper_default_spec, 128 x 128 at head dim
    128), which a call on a 9.0 device runs with wgmma; the same spec, pinned."""
    _require_hopper_document(env, case, "the wgmma twin")
    args = variant_arguments(env, case)
    args["spec"] = wgmma_document_spec(case.shape.head_dim)
    args["block_mask"] = document_block_mask(env, case, args["spec"], args["mod_inputs"])
    return _attention_call(env, args)


def kernelgen_wg_fp8_peer(
    env: Any, case: VariantCase, sets: list[tuple[Any, Any, Any]]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The document mask's block-sparse run on the fp8 (e4m3) wgmma kernel
    (specs/v2_wg_e4m3_d128_m128_n128_s2_causal_docmask_bsparse.yaml at head dim 128), pinned,
    on each set's q, k and v rounded to e4m3 here, before any timing (bench.gpu.quantize_sets;
    no descales), with a block mask in its tiles: (the call on a bf16 set, set 0 in e4m3, whose
    reference the check takes)."""
    from bench import gpu

    _require_hopper_document(env, case, "the fp8 wgmma twin")
    quantized = gpu.quantize_sets(env, sets)
    args = variant_arguments(env, case)
    args["spec"] = wgmma_document_spec(case.shape.head_dim, fp8=True)
    args["block_mask"] = document_block_mask(env, case, args["spec"], args["mod_inputs"])
    fp8_call = _attention_call(env, args)

    def call(q: Any, k: Any, v: Any) -> Any:
        return fp8_call(*quantized[id(q)])

    return call, quantized[id(sets[0][0])]


def _require_hopper_document(env: Any, case: VariantCase, what: str) -> None:
    """The wgmma twins time the document mask on a 9.0 device only (NotImplementedError)."""
    from kernelgen.model.policy import HOPPER_DEVICE_ARCH

    if case.name != "document":
        raise NotImplementedError(f"{what} times the block-sparse document mask only")
    if env.arch != HOPPER_DEVICE_ARCH:
        raise NotImplementedError(
            f"wgmma (sm_90a) runs on compute capability 9.0 only; this GPU is {env.arch}"
        )


def wgmma_document_spec(head_dim: int, fp8: bool = False) -> Any:
    """The block-sparse document mask's wgmma spec: the untuned Hopper tiling with the mask (at
    head dim 128, specs/v2_wg_bf16_d128_m128_n128_s2_causal_docmask_bsparse.yaml), or with
    ``fp8`` the fp8 default's (specs/v2_wg_e4m3_d128_m128_n128_s2_causal_docmask_bsparse.yaml)."""
    from kernelgen.model.policy import fp8_default_spec, hopper_default_spec
    from kernelgen.specs.forward import KernelSpec

    tiles = fp8_default_spec(head_dim, True) if fp8 else hopper_default_spec(BF16, head_dim, True)
    sparse = {"mask_mod": DOC_MASK, "mod_inputs": DOC_INPUTS, "block_sparse": True}
    return KernelSpec(**{**tiles.model_dump(), **sparse})


def document_block_mask(env: Any, case: VariantCase, spec: Any, mod_inputs: Any) -> Any:
    """The document mask's block mask in ``spec``'s tiles (one for every head)."""
    s = case.shape
    return env.kernelgen.block_mask(
        DOC_MASK, s.batch, 1, s.seqlen_q, s.seqlen_k, block_m=spec.block_m,
        block_n=spec.block_n, mod_inputs=mod_inputs,
    )  # fmt: skip


def _attention_call(env: Any, args: dict[str, Any]) -> Callable[..., Any]:
    def call(q: Any, k: Any, v: Any) -> Any:
        with env.stream():
            return env.kernelgen.attention(q, k, v, causal=True, **args)

    return call


def flex_peer(env: Any, case: VariantCase) -> Callable[..., Any]:
    """FlexAttention, compiled; the sink is folded in from the lse afterwards:
    out * sigmoid(lse - sink)."""
    torch = env.torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    shape = case.shape
    args = variant_arguments(env, case)
    window = case.name == "window"

    doc = args["mod_inputs"]["doc"] if case.name == "document" else None

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        causal = kv_idx <= q_idx
        if doc is not None:
            return causal & (doc[b, q_idx] == doc[b, kv_idx])
        return causal & (q_idx - kv_idx < WINDOW) if window else causal

    block_mask = create_block_mask(
        mask_mod, shape.batch if doc is not None else None, None, shape.seqlen_q,
        shape.seqlen_k, device="cuda",
    )  # fmt: skip
    score_mod = None
    if case.name == "softcap":

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return SOFTCAP * torch.tanh(score / SOFTCAP)

    elif case.name == "alibi":
        slopes = args["alibi_slopes"]

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score - slopes[h] * (q_idx - kv_idx).abs()

    elif case.name == "relbias":
        bias = args["mod_inputs"]["bias"]

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score + bias[h, (q_idx - kv_idx).clamp(-128, 127) + 128]

    compiled = torch.compile(flex_attention, dynamic=False)
    sinks = args.get("sinks")

    def call(q: Any, k: Any, v: Any) -> Any:
        if sinks is None:
            return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
        out, lse = compiled(q, k, v, block_mask=block_mask, return_lse=True)
        weight = torch.sigmoid(lse - sinks[None, :, None])  # e^lse / (e^lse + e^sink)
        return (out.float() * weight[..., None]).to(q.dtype)

    return call


def flash_attn_peer(env: Any, case: VariantCase) -> Callable[..., Any]:
    """flash-attn's flash_attn_func ((B, S, H, D) layout) with its own variant arguments; it
    has no sinks (unavailable)."""
    from flash_attn import flash_attn_func

    if case.name in ("sinks", "document", "relbias"):
        raise NotImplementedError(f"flash_attn_func has no {case.name} variant")
    args = variant_arguments(env, case)
    options: dict[str, Any] = {
        "window": {"window_size": (WINDOW - 1, 0)},
        "softcap": {"softcap": SOFTCAP},
        "alibi": {"alibi_slopes": args.get("alibi_slopes")},
    }[case.name]

    def call(q: Any, k: Any, v: Any) -> Any:
        bshd = (t.transpose(1, 2) for t in (q, k, v))
        return flash_attn_func(*bshd, causal=True, **options).transpose(1, 2)

    return call


MAKERS = {
    "kernelgen": kernelgen_peer,
    "flex": flex_peer,
    "flash-attn": flash_attn_peer,
    "kernelgen-wg": kernelgen_wg_peer,
}


def case_rows(env: Any, timer: Any, case: VariantCase) -> list[dict[str, Any]]:
    """Check then time each peer on one case; a peer that cannot run is an unavailable row."""
    from bench import gpu

    shape = case.shape
    sets = gpu.make_sets(env, shape, 2, seed=len(case.key))
    ref = reference(env, case, *sets[0])
    tol = metrics.tolerance(shape.dtype)
    rows = []
    for peer in PEERS:
        fields: dict[str, Any] = {"variant": case.name}
        peer_ref, peer_tol = ref, tol
        try:
            if peer == FP8_PEER:  # checked against the reference of its e4m3 inputs
                call, fp8_set = kernelgen_wg_fp8_peer(env, case, sets)
                peer_ref = reference(env, case, *fp8_set)
                peer_tol = metrics.tolerance("float8_e4m3")
            else:
                call = MAKERS[peer](env, case)
        except Exception as exc:  # not installed, or the variant is not supported
            reason = gpu.first_line(exc)
            rows.append(report.make_row(shape, peer, report.UNAVAILABLE, **fields, reason=reason))
            continue
        try:
            err, bad = gpu.relative_error(env, call(*sets[0]), peer_ref)
            fields.update(rel_err=err, tol=peer_tol)
            if err is None or err >= peer_tol:
                why = f"{bad} non-finite" if err is None else f"rel. error {err:.3g}"
                rows.append(report.make_row(shape, peer, report.WRONG, **fields, reason=why))
                continue
            times, info = timer.measure(lambda i, f=call: f(*sets[i]), len(sets))
        except gpu.FatalGPUError:
            raise
        except Exception as exc:
            env.sync()
            reason = gpu.first_line(exc)
            rows.append(report.make_row(shape, peer, report.ERROR, **fields, reason=reason))
            continue
        stats = metrics.summarize(times)
        rate = metrics.tflops(visible_flops(case), stats["median_ms"])
        fields.update(stats, timing=info, tflops=rate)
        rows.append(report.make_row(shape, peer, report.OK, **fields))
        print(f"{case.key:32} {peer:11} {stats['median_ms']:9.4f} ms", flush=True)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """One line per (variant, shape): each peer's median ms (or its status)."""
    lines = ["| variant | shape | " + " | ".join(PEERS) + " |", "|---|---|" + "---|" * len(PEERS)]
    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["variant"], row["shape"]), {})[row["peer"]] = row
    for (variant, shape), peers in groups.items():
        cells = []
        for peer in PEERS:
            row = peers.get(peer)
            ok = row is not None and row["status"] == report.OK
            cells.append(f"{row['median_ms']:.3f} ms" if ok else (row or {}).get("status", "-"))
        lines.append(f"| {variant} | {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.variants", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="seqlen 4096 only, 200 ms budget")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder")
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU)")
    parser.add_argument(
        "--variant", action="append", choices=VARIANTS, help="only these variants (repeatable)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    selected = cases(args.quick, args.variant or VARIANTS)
    if args.list:
        for case in selected:
            s = case.shape
            print(f"{case.key:32} B={s.batch} H={s.heads} S={s.seqlen_q} D={s.head_dim}")
        print(f"peers: {', '.join(PEERS)}")
        return 0
    env = open_env()
    if env is None:
        return 2
    from bench import gpu

    timer = gpu.Timer(env, 200.0 if args.quick else 1000.0)
    rows: list[dict[str, Any]] = []
    for case in selected:
        rows += case_rows(env, timer, case)
        gpu.release(env)
    stem = report.result_stem(dt.date.today(), env.info["gpu_name"], "variants")
    meta = {"date": dt.date.today().isoformat(), **env.info, **git_info()}
    meta["timing"] = gpu.TIMING_METHOD
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "rows": rows}
    report.write_atomic(args.out / f"{stem}.json", json.dumps(result, indent=1, default=str))
    report.write_atomic(args.out / f"{stem}.md", markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
