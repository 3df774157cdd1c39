"""Expressions over global positions, rewritten for one block's local call.

A user's ``score_mod`` / ``mask_mod`` under context parallelism reads global indices: ``q_idx``
and ``kv_idx`` are positions in the whole sequence and ``h`` a head of the whole model, and the
arrays of ``mod_inputs`` are global (every rank passes the same). A block call sees local ones,
so each is rewritten to ``q_idx + cp_pos[0]``, ``kv_idx + cp_pos[1]`` and ``h + cp_pos[2]``,
where ``cp_pos`` (int32, 3) is one more input holding the block's first query position, first
key position and first head (Ulysses runs a slice of the heads). One kernel then serves every
block: the expression is the same, only ``cp_pos`` changes. ALiBi off the diagonal takes the
same input (:data:`ALIBI_SCORE_MOD`). Names of mod inputs starting with ``cp_`` are reserved.
"""

from __future__ import annotations

import ast

__all__ = ["ALIBI_INPUT", "ALIBI_SCORE_MOD", "POSITIONS_INPUT", "RESERVED_PREFIX", "globalize"]

RESERVED_PREFIX = "cp_"
POSITIONS_INPUT = "cp_pos"
ALIBI_INPUT = "cp_alibi"
# ALiBi of a block whose diagonal is not the global one: |qg - kg| from the block's positions.
ALIBI_SCORE_MOD = f"score - {ALIBI_INPUT}[b, h] * abs(q_idx - kv_idx + cp_pos[0] - cp_pos[1])"
_SHIFTED = {"q_idx": 0, "kv_idx": 1, "h": 2}


class _Shift(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id not in _SHIFTED:
            return node
        offset = ast.Subscript(
            ast.Name(POSITIONS_INPUT, ast.Load()), ast.Constant(_SHIFTED[node.id]), ast.Load()
        )
        return ast.BinOp(ast.Name(node.id, ast.Load()), ast.Add(), offset)


def globalize(text: str) -> str:
    """``text`` (a checked expression's canonical text) with ``q_idx``, ``kv_idx`` and ``h``
    shifted by the block's ``cp_pos``."""
    tree = ast.parse(text, mode="eval")
    return ast.unparse(ast.fix_missing_locations(_Shift().visit(tree)))


def with_alibi(score_mod: str | None) -> str:
    """The block's score_mod with ALiBi from global positions after it (the kernels' order:
    score_mod, then ALiBi)."""
    if score_mod is None:
        return ALIBI_SCORE_MOD
    return ALIBI_SCORE_MOD.replace("score", f"({score_mod})", 1)
