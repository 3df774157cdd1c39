"""Example arrays for the user expressions of the shipped specs (specs/*.yaml,
docs/expressions.md), by input name: what ``kernelgen emulate`` runs a spec with when the
command line gives no ``--mod-input``, and what the test tiers run those specs with.

Each maker takes the problem's sizes (anything with ``batch``, ``heads``, ``seqlen_q`` and
``seqlen_k``) and a NumPy generator and returns a host array of the declared dtype and rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np


class ProblemSizes(NamedTuple):
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int


ExampleMaker = Callable[[Any, np.random.Generator], np.ndarray]

EXAMPLE_MOD_INPUTS: dict[str, ExampleMaker] = {
    # document ids per key, 3 documents per sequence; queries aligned with the last keys
    "doc": lambda c, rng: np.sort(
        rng.integers(0, 3, (c.batch, max(c.seqlen_q, c.seqlen_k)))
    ).astype(np.int32),
    # a relative-position bias per head and clipped distance (-128..127, shifted by 128)
    "bias": lambda c, rng: (0.5 * rng.standard_normal((c.heads, 256))).astype(np.float32),
    # a prefix length per batch entry, 0 to seqlen_k
    "prefix": lambda c, rng: rng.integers(0, c.seqlen_k + 1, c.batch).astype(np.int32),
    # a tree mask: key j visible to query i, per batch entry
    "anc": lambda c, rng: rng.random((c.batch, c.seqlen_q, c.seqlen_k)) < 0.6,
}


def expression_arguments(spec: Any, sizes: Any, inputs: dict[str, Any]) -> tuple[dict, dict]:
    """For a spec with user expressions and its mod ``inputs`` (host arrays): attention()'s
    expression arguments (a block-sparse spec also gets the block mask of its mask_mod, from the
    NumPy builder) and the float64 reference's hooks (the expressions' evaluator)."""
    from kernelgen.calls.block_mask import block_mask_reference
    from kernelgen.references.expressions import evaluate

    score_mod, mask_mod = spec.expressions
    kernel: dict = {"score_mod": spec.score_mod, "mask_mod": spec.mask_mod, "mod_inputs": inputs}
    hooks: dict = {}
    if score_mod is not None:
        hooks["score_mod"] = lambda s, b, h, q, k: evaluate(
            score_mod, score=s, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        )
    if mask_mod is not None:
        hooks["mask_mod"] = lambda b, h, q, k: evaluate(
            mask_mod, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        )
    if spec.block_sparse:
        kernel["block_mask"] = block_mask_reference(
            mask_mod, sizes.batch, sizes.heads, sizes.seqlen_q, sizes.seqlen_k,
            block_m=spec.block_m, block_n=spec.block_n, mod_inputs=inputs,
        )  # fmt: skip
    return kernel, hooks
