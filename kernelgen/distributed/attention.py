"""``context_parallel_attention``: attention over a sequence sharded across a process group."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

import torch

from kernelgen.calls.attention import check_flags, check_inputs, describe
from kernelgen.calls.variant_inputs import VariantArgs
from kernelgen.distributed.allgather import AllGatherAttention
from kernelgen.distributed.blocks import Visibility
from kernelgen.distributed.calls import Options
from kernelgen.distributed.comm import Group
from kernelgen.distributed.positions import RESERVED_PREFIX, globalize
from kernelgen.distributed.ring import RingAttention
from kernelgen.distributed.schedule import Setup
from kernelgen.distributed.sharding import Sharding
from kernelgen.distributed.ulysses import UlyssesAttention
from kernelgen.errors import InputError
from kernelgen.specs.expressions import Expression

__all__ = ["SCHEDULES", "context_parallel_attention"]

Schedule = Literal["ring", "allgather", "ulysses"]
SCHEDULES: dict[str, type] = {
    "ring": RingAttention,
    "allgather": AllGatherAttention,
    "ulysses": UlyssesAttention,
}

# Arguments of attention() that context parallelism does not take, and why.
_REFUSED = {
    "mask": "a dense additive mask is (S, S) of the whole sequence; write it as a mask_mod",
    "block_mask": "block masks index one call's tiles; a mask_mod alone is supported",
    "seqlens_k": "K/V lengths of a padded cache do not apply to a sharded sequence",
    "num_splits": "split-KV is a decode form; shard the sequence instead",
}


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    schedule: Schedule = "ring",
    sharding: Sharding | None = None,
    group: Any = None,
    causal: bool = False,
    scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: str | Expression | None = None,
    mask_mod: str | Expression | None = None,
    mod_inputs: Mapping[str, torch.Tensor] | None = None,
    return_lse: bool = False,
    layout: Literal["bhsd", "bshd"] = "bhsd",
    **refused: Any,
) -> Any:
    """Attention of this rank's queries over the whole sharded sequence, differentiable.

    q (B, H, L, D) and k, v (B, Hkv, L, D) (``layout="bshd"``: (B, L, H, D)) are this rank's
    shards: the global positions ``sharding.positions(rank)`` of a sequence of
    ``sharding.total`` tokens, the same for queries and keys (self-attention; the default
    sharding is contiguous with equal lengths). Every rank of ``group`` calls it with the same
    options. ``schedule``: ``"ring"`` (K/V passed around the ring, overlapped with compute),
    ``"allgather"`` (K/V gathered whole, llama3 form) or ``"ulysses"`` (all-to-all over heads;
    H % W == 0). The options are attention()'s, meant for the global sequence: ``causal``,
    ``scale``, ``window_size``, ``softcap``, ``alibi_slopes`` (float32 (H,) or (B, H)) and
    ``sinks`` (float32 (H,), differentiable), and the expressions ``score_mod`` / ``mask_mod``
    with their ``mod_inputs``, which see GLOBAL positions and heads: ``q_idx`` and ``kv_idx``
    index the whole sequence and the input arrays are the whole sequence's, the same on every
    rank (docs/distributed.md). Returns out (q's layout and dtype; its gradient flows to q, k,
    v and sinks) and with ``return_lse`` the fp32 log-sum-exp (B, H, L), which carries no
    gradient. The gradient of ``sinks`` is this rank's share (sum it over the group, as for any
    replicated parameter). Not supported (InputError): ``mask``, ``block_mask``,
    ``seqlens_k``, ``num_splits``.
    """
    check_flags(causal=causal, return_lse=return_lse)
    for name, value in refused.items():
        if name not in _REFUSED:
            raise TypeError(f"context_parallel_attention() got an unexpected argument {name!r}")
        if value is not None:
            raise InputError(
                f"{name}: not supported by context-parallel attention ({_REFUSED[name]})"
            )
    if schedule not in SCHEDULES:
        raise InputError(f"schedule={schedule!r} is not allowed; use one of {', '.join(SCHEDULES)}")
    if layout not in ("bhsd", "bshd"):
        raise InputError(f"layout={layout!r} is not allowed; use 'bhsd' or 'bshd'")
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    group_info = Group.of(group)
    variants = VariantArgs(window_size, softcap, alibi_slopes, sinks, score_mod, mask_mod,
                           mod_inputs)  # fmt: skip
    setup = _setup(q, k, v, group_info, sharding, schedule, causal, scale, variants)
    out, lse = SCHEDULES[schedule].apply(setup, q, k, v, sinks)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def _setup(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    sharding: Sharding | None,
    schedule: str,
    causal: bool,
    scale: float | None,
    variants: VariantArgs,
) -> Setup:
    """The call's checked setup: attention()'s own checks on the shards' metadata, then the
    sharding's."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            raise InputError(f"{name}: expected a rank-4 torch tensor, got {_what(x)}")
    length = q.shape[2]
    if sharding is None:
        sharding = Sharding.contiguous(length * group.world, group.world)
    if not isinstance(sharding, Sharding):
        raise InputError(f"sharding has type {type(sharding).__name__}; expected a Sharding")
    if sharding.world != group.world:
        raise InputError(f"sharding is for {sharding.world} ranks, the group has {group.world}")
    want = sharding.length(group.rank)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.shape[2] != want:
            raise InputError(
                f"{name} holds {x.shape[2]} positions on rank {group.rank}; the {sharding.name} "
                f"sharding gives it {want}"
            )
    # attention()'s checks, on shards with at least one position (a rank may hold none)
    infos = [describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    infos = [replace(t, shape=(*t.shape[:2], max(1, t.shape[2]), t.shape[3])) for t in infos]
    call = check_inputs(
        *infos, None, layout="bhsd", scale=scale, spec=None, causal=bool(causal),
        variants=variants,
    )  # fmt: skip
    reserved = [n for n in variants.mod_inputs or {} if n.startswith(RESERVED_PREFIX)]
    if reserved:
        raise InputError(
            f"mod_inputs[{reserved[0]!r}]: names starting with {RESERVED_PREFIX!r} are reserved "
            "for the block positions context parallelism adds"
        )
    found = call.expressions
    batch, heads = q.shape[:2]
    if schedule == "ulysses" and heads % group.world:
        raise InputError(
            f"schedule='ulysses' splits the {heads} query heads over {group.world} ranks; they "
            "must divide evenly (use 'ring' or 'allgather')"
        )
    slopes, sinks = variants.alibi_slopes, variants.sinks
    options = Options(
        scale=call.scale,
        softcap=call.variants.softcap,
        alibi=None if slopes is None else slopes.expand(batch, heads),
        sinks=None if sinks is None else sinks.detach(),
        score_mod=None if found.score_mod is None else globalize(found.score_mod.text),
        mask_mod=None if found.mask_mod is None else globalize(found.mask_mod.text),
        mod_inputs=dict(found.arrays),
    )
    rule = Visibility.of(bool(causal), variants.window_size)
    return Setup(group, sharding, rule, options, kv_heads=k.shape[1])


def _what(x: Any) -> str:
    shape = getattr(x, "shape", None)
    return f"{type(x).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else "")
