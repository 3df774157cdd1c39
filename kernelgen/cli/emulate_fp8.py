"""``kernelgen emulate`` of an fp8 (e4m3) spec: random e4m3 inputs and descales through
kernelgen's fp8 call on the CPU backend (:func:`kernelgen.calls.emulated.emulate_fp8_attention`),
checked against the float64 attention of the quantized inputs within the stated fp8 bound
(:mod:`kernelgen.references.fp8`, docs/hopper.md "fp8")."""

from __future__ import annotations

from typing import Any

import numpy as np

from kernelgen.cli.console import fail, out_console
from kernelgen.cli.emulate_table import Row, memory_rows, table
from kernelgen.errors import (
    EmulatorCompileError,
    EmulatorLaunchError,
    HazardError,
    KernelgenError,
)
from kernelgen.specs.forward import KernelSpec

# Spread of the random inputs (before e4m3 rounding) and the descales' range: scores of a few
# units, so the softmax has both large and small weights (the bound's two regimes).
INPUT_STD = {"q": 1.5, "k": 1.5, "v": 2.0}
DESCALE_RANGE = (0.5, 2.0)


def random_fp8_inputs(
    shape: tuple[int, ...], head_dim: int, seed: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """q (B, H, Sq, D), k and v (B, Hkv, Sk, D) as e4m3 bit patterns (uint8: normal values
    rounded to e4m3 by ml_dtypes) and float32 (B, Hkv) descales drawn from DESCALE_RANGE."""
    import ml_dtypes

    from kernelgen.references.fp8 import DESCALE_NAMES

    b, h, hkv, sq, sk = shape
    rng = np.random.default_rng(seed)
    dims = {"q": (b, h, sq, head_dim), "k": (b, hkv, sk, head_dim), "v": (b, hkv, sk, head_dim)}
    bits = {
        name: rng.normal(0.0, INPUT_STD[name], size).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        for name, size in dims.items()
    }
    descales = {
        name: rng.uniform(*DESCALE_RANGE, (b, hkv)).astype(np.float32) for name in DESCALE_NAMES
    }
    return bits, descales


def emulate_fp8(
    spec: KernelSpec,
    dims: tuple[int, ...],
    seed: int,
    variants: dict[str, Any] | None = None,
    hooks: dict[str, Any] | None = None,
) -> None:
    """Run the fp8 spec on random e4m3 inputs with descales and ``variants`` (attention()'s
    arguments for the spec's variants and user expressions: kernelgen.cli.emulate's
    variant_values and expression_values, whose float64 hooks are ``hooks``); print the table
    (the error over its per-element bound, the relative error, the lse, NaN, hazards, the TMA
    bytes and key tiles); exit 1 on a failed check or launch, 2 (one line) on input the spec
    cannot run. A block-sparse spec's ``variants`` hold its block mask: the key tiles row
    expects the tiles it lists."""
    variants = variants or {}
    kernel_only = ("score_mod", "mask_mod", "mod_inputs", "block_mask")  # the hooks stand in
    reference_variants = {
        **{n: x for n, x in variants.items() if n not in kernel_only},
        **(hooks or {}),
    }
    from kernelgen.calls.emulated import emulate_fp8_attention
    from kernelgen.references.attention import LSE_TOLERANCE, relative_error
    from kernelgen.references.fp8 import FP8_TOLERANCE, fp8_reference

    bits, descales = random_fp8_inputs(dims, spec.head_dim, seed)
    scale = spec.head_dim**-0.5
    try:
        run = emulate_fp8_attention(
            spec, bits["q"], bits["k"], bits["v"], scale=scale, **descales, **variants
        )
    except HazardError as exc:
        out_console.print(table(spec, dims, [Row("hazards (race check)", "1", "0", False)]))
        raise fail([f"hazard: {exc.message}"], 1) from None
    except (EmulatorCompileError, EmulatorLaunchError) as exc:
        raise fail([str(exc)], 1) from None
    except KernelgenError as exc:  # the shape does not fit the spec, e.g. a grid limit
        raise fail(str(exc).splitlines()[:1]) from None
    ref = fp8_reference(bits["q"], bits["k"], bits["v"], descales, causal=spec.causal,
                        scale=scale, **reference_variants)  # fmt: skip
    ratio = ref.bound_ratio(run.out)
    error = relative_error(run.out, ref.out)
    seen = np.isfinite(ref.lse)
    same_empty = bool(np.array_equal(np.isneginf(run.lse), ~seen))
    lse_error = float(np.max(np.abs(run.lse[seen] - ref.lse[seen]))) if seen.any() else 0.0
    nan = bool(np.isnan(run.out).any() or np.isnan(run.lse).any())
    rows = [
        Row("out: max error / fp8 bound", f"{ratio:.3g}", "<= 1", ratio <= 1.0),
        Row(
            "out: relative Frobenius error",
            f"{error:.3g}",
            f"<= {FP8_TOLERANCE:g}",
            error <= FP8_TOLERANCE,
        ),
        Row(
            "lse: max absolute error",
            f"{lse_error:.3g}",
            f"<= {LSE_TOLERANCE:g}",
            lse_error <= LSE_TOLERANCE and same_empty,
        ),
        Row("NaN in out or lse", "yes" if nan else "no", "no", not nan),
        Row("hazards (race check)", "0", "0", True),
        *memory_rows(spec, run, dims, variants.get("block_mask")),
    ]
    out_console.print(table(spec, dims, rows))
    failed = [r.what for r in rows if r.ok is False]
    if failed:
        raise fail([f"{spec.uri}: failed: {', '.join(failed)}"], 1)
