"""CPU tests of the serving benchmark's pure parts (bench/serving.py): the shapes, the useful
and padded FLOPs, the padded layout's row placement and the table. No torch, CuPy or GPU."""

from __future__ import annotations

import numpy as np
import pytest

from bench import report, serving


def test_flops_count_real_tokens_only():
    causal = serving.VarlenShape("one-long", "bfloat16", True, heads=2, kv_heads=1, head_dim=8)
    full = serving.VarlenShape("one-long", "bfloat16", False, heads=2, kv_heads=1, head_dim=8)
    lengths = serving.MIXES["one-long"]
    assert serving.useful_flops(full) == 4 * 2 * 8 * sum(n * n for n in lengths)
    assert serving.useful_flops(causal) == 4 * 2 * 8 * sum(n * (n + 1) // 2 for n in lengths)
    assert serving.padded_flops(full) == 4 * 2 * 8 * len(lengths) * max(lengths) ** 2
    equal = serving.VarlenShape("equal", "float16", False)
    assert serving.useful_flops(equal) == serving.padded_flops(equal)  # nothing to save


def test_padded_rows_put_queries_at_the_bottom_and_keys_at_the_top():
    """Front-padded queries: query i of a sequence of n keys sits at padded row S_max - n + i,
    so bottom-right causal alignment (j <= row + n - S_max) is the sequence's own (j <= i)."""
    lengths = [3, 5, 1]
    q_rows, k_rows = serving.padded_rows(lengths)
    assert q_rows == [2, 5, 14] and k_rows == [0, 5, 10]
    longest = max(lengths)
    for b, n in enumerate(lengths):
        for i in range(n):
            row = q_rows[b] - b * longest + i
            visible = [j for j in range(n) if j <= row + n - longest]
            assert visible == list(range(i + 1))
    assert np.all(np.diff(q_rows) >= 0)


def test_grid_and_keys():
    quick = serving.grid(quick=True)
    assert len(quick) == 4 and {s.dtype for s in quick} == {"bfloat16"}
    assert len(serving.grid(quick=False)) == 2 * len(serving.MIXES) * 2
    assert quick[0].key == "bf16-one-long-h32kv8-d128-causal"
    assert quick[0].as_dict()["lengths"] == list(serving.MIXES["one-long"])


def test_markdown_table_and_list(capsys):
    s = serving.VarlenShape("spread", "float16", True)
    rows = [
        serving._row(s, "kg-varlen", report.OK, median_ms=1.0, tflops=300.0),
        serving._row(s, "kg-padded", report.OK, median_ms=1.5, tflops=200.0),
    ]
    lines = serving.markdown_table(rows).splitlines()
    assert lines[2].split("|")[1:-1] == [
        " fp16-spread-h32kv8-d128-causal ", " 1 (300) ", " 1.5 (200) ", " 1.50x "
    ]  # fmt: skip
    wrong = [rows[0], serving._row(s, "kg-padded", report.WRONG, rel_err=0.5)]
    assert serving.markdown_table(wrong).splitlines()[2].endswith("| WRONG 5.0e-01 | - |")
    assert serving.main(["--list", "--quick"]) == 0
    assert "padding" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--help"]])
def test_help_needs_no_gpu(argv):
    with pytest.raises(SystemExit) as exit_info:
        serving.main(argv)
    assert exit_info.value.code == 0


@pytest.mark.emulate
@pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning")
@pytest.mark.usefixtures("cpu_backend_only")
def test_the_padded_baseline_computes_each_sequence_alone():
    """The padded peer's layout (queries padded at the front, keys at the back, seqlens_k), run
    by the CPU backend: its real rows equal the per-sequence float64 reference, causal too."""
    from attention_cases import check_varlen, packed_varlen, varlen_reference

    import kernelgen

    lengths = [3, 5, 1]
    q, k, v, cu, _ = packed_varlen(lengths, lengths, 4, 2, "float16", seed=3)
    batch, longest = len(lengths), max(lengths)
    q_rows, k_rows = serving.padded_rows(lengths)
    pq = np.zeros((batch * longest, *q.shape[1:]), np.float16)
    pk, pv = (np.zeros((batch * longest, *k.shape[1:]), np.float16) for _ in range(2))
    for b, n in enumerate(lengths):
        pq[q_rows[b] : q_rows[b] + n] = q[cu[b] : cu[b + 1]]
        pk[k_rows[b] : k_rows[b] + n] = k[cu[b] : cu[b + 1]]
        pv[k_rows[b] : k_rows[b] + n] = v[cu[b] : cu[b + 1]]
    shape = (batch, longest)
    out = kernelgen.attention(
        *(t.reshape(*shape, *t.shape[1:]) for t in (pq, pk, pv)),
        layout="bshd",
        seqlens_k=lengths,
        causal=True,
    )
    real = np.concatenate(
        [out.reshape(-1, *out.shape[2:])[r : r + n] for r, n in zip(q_rows, lengths, strict=True)]
    )
    check_varlen(real, None, *varlen_reference(q, k, v, cu, cu, True), "float16")
