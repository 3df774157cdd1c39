"""``kernelgen emulate SPEC``: run a spec's kernels on the CPU emulator against float64.

Fresh random inputs (rounded to the spec's dtype), the spec's launch plan through
:func:`kernelgen.calls.emulated.emulate_attention`, and a table: the error against the
float64 reference with its tolerance, hazards, ldmatrix wavefronts against the conflict-free
ideal, cp.async global bytes against reading q, k and v once, and the key tiles visited.
Exit 1 on an error over tolerance, a NaN, a hazard or a failed launch; bad input prints one line
and exits 2. A spec with variants (docs/variants.md) runs with ``--window``/``--softcap`` or
example values; one with user expressions (docs/expressions.md) with ``--mod-input NAME=FILE.npy``
arrays or, for the shipped specs' input names, example arrays
(:mod:`kernelgen.references.example_inputs`), and a block-sparse one with the block mask of its
mask_mod. An fp8 spec runs on e4m3 inputs with descales (:mod:`kernelgen.cli.emulate_fp8`).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kernelgen.cli.console import err_console, fail, out_console
from kernelgen.cli.emulate_table import Row, memory_rows, table
from kernelgen.errors import (
    CPUBackendWarning,
    EmulatorCompileError,
    EmulatorError,
    EmulatorLaunchError,
    HazardError,
    KernelgenError,
    SpecError,
)
from kernelgen.specs.forward import KernelSpec

DEFAULT_SHAPE = "1,2,1,100,160"  # partial query and key tiles, GQA


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``B,H,HKV,SQ,SK`` -> five positive integers with H a multiple of HKV."""
    parts = text.replace(" ", "").split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 5 or any(v < 1 for v in values):
        raise ValueError(f"--shape {text!r}: expected B,H,HKV,SQ,SK, five positive integers")
    b, h, hkv, sq, sk = values
    if h % hkv:
        raise ValueError(f"--shape {text!r}: H={h} must be a multiple of HKV={hkv}")
    return b, h, hkv, sq, sk


def _random_inputs(spec: KernelSpec, shape: tuple[int, ...], seed: int):
    from kernelgen.runtime.emulated_launch import from_device_dtype, to_device_dtype

    b, h, hkv, sq, sk = shape
    rng = np.random.default_rng(seed)

    def draw(*dims: int) -> np.ndarray:
        x = rng.standard_normal((*dims, spec.head_dim)).astype(np.float32)
        return from_device_dtype(to_device_dtype(x, spec.dtype), spec.dtype)  # dtype-exact

    return draw(b, h, sq), draw(b, hkv, sk), draw(b, hkv, sk)


def parse_window(text: str) -> tuple[int, int]:
    """``LEFT,RIGHT`` -> two integers >= -1 (-1: unbounded)."""
    parts = text.replace(" ", "").split(",")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"--window {text!r}: expected LEFT,RIGHT, two integers >= -1 (-1: unbounded)"
        ) from None
    if min(left, right) < -1:
        raise ValueError(f"--window {text!r}: LEFT and RIGHT must be >= -1 (-1: unbounded)")
    return left, right


def variant_values(
    spec: KernelSpec, shape: tuple[int, ...], window: str | None, softcap: float | None
) -> dict:
    """attention()'s variant arguments for the spec's flags (docs/variants.md): ``--window`` and
    ``--softcap`` where given, else a window of SK/4 keys to the left and none to the right and
    a cap of 5; ALiBi's geometric slopes 2^(-8 (h + 1) / H); sinks 1, 1.5, 2, ... per head."""
    heads, seqlen_k = shape[1], shape[4]
    if window is not None and not spec.window:
        raise ValueError(f"--window needs a spec with window: true; {spec.uri} has none")
    if softcap is not None and not spec.softcap:
        raise ValueError(f"--softcap needs a spec with softcap: true; {spec.uri} has none")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"--softcap {softcap}: use a finite number > 0")
    values: dict = {}
    if spec.window:
        values["window_size"] = parse_window(window) if window else (seqlen_k // 4, 0)
    if spec.softcap:
        values["softcap"] = 5.0 if softcap is None else softcap
    if spec.alibi:
        exponents = -8.0 * (np.arange(heads, dtype=np.float32) + 1) / heads
        values["alibi_slopes"] = (2.0**exponents).astype(np.float32)
    if spec.sinks:
        values["sinks"] = (1.0 + 0.5 * np.arange(heads)).astype(np.float32)
    return values


MAX_SEED = 2**63 - 1


def check_seed(seed: int) -> int:
    """``--seed``: an integer from 0 to 2**63 - 1 (what NumPy's generators take)."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"--seed {seed}: use an integer from 0 to {MAX_SEED}")
    return seed


def read_mod_inputs(spec: KernelSpec, given: list[str]) -> dict[str, np.ndarray]:
    """``--mod-input NAME=FILE.npy`` values -> {name: array}; each name must be one the spec
    declares, each file a NumPy .npy file (no pickles)."""
    declared = [entry.split(":")[0] for entry in spec.mod_inputs]
    arrays: dict[str, np.ndarray] = {}
    for text in given:
        name, sep, file = text.partition("=")
        name = name.strip()
        if not sep or not name or not file:
            raise ValueError(f"--mod-input {text!r}: expected NAME=FILE.npy")
        if name not in declared:
            allowed = ", ".join(declared) or "none (the spec has no user expressions)"
            raise ValueError(f"--mod-input {text!r}: {spec.uri} declares no input {name!r}; "
                             f"its inputs: {allowed}")  # fmt: skip
        try:
            arrays[name] = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"--mod-input {text!r}: cannot read {file} as a .npy array: {exc}"
            ) from None
    return arrays


def expression_values(
    spec: KernelSpec, shape: tuple[int, ...], given: dict[str, np.ndarray], seed: int
) -> tuple[dict, dict]:
    """attention()'s expression arguments for a spec with user expressions, and the float64
    reference's hooks: the spec's mod inputs from ``given`` or, for the names of the shipped
    specs, :data:`kernelgen.references.example_inputs.EXAMPLE_MOD_INPUTS`; a block-sparse spec also
    gets the block mask of its mask_mod. Two empty dicts for a spec without expressions."""
    if not spec.has_expressions:
        if given:
            raise ValueError(f"--mod-input needs a spec with user expressions; {spec.uri} has none")
        return {}, {}
    from kernelgen.references.example_inputs import (
        EXAMPLE_MOD_INPUTS,
        ProblemSizes,
        expression_arguments,
    )

    b, h, _, sq, sk = shape
    sizes = ProblemSizes(b, h, sq, sk)
    rng = np.random.default_rng(seed + 13)
    inputs = dict(given)
    for entry in spec.mod_inputs:
        name = entry.split(":")[0]
        if name in inputs:
            continue
        if name not in EXAMPLE_MOD_INPUTS:
            raise ValueError(
                f"{spec.uri} reads the input {name!r}, which has no example array; pass "
                f"--mod-input {name}=FILE.npy"
            )
        inputs[name] = EXAMPLE_MOD_INPUTS[name](sizes, rng)
    return expression_arguments(spec, sizes, inputs)


def _error_rows(spec: KernelSpec, run, q, k, v, variants: dict) -> list[Row]:
    from kernelgen.references.attention import (
        LSE_TOLERANCE,
        OUT_TOLERANCE,
        naive_attention,
        relative_error,
    )

    ref_out, ref_lse = naive_attention(q, k, v, causal=spec.causal, **variants)
    tol = OUT_TOLERANCE[spec.dtype]
    nan = bool(np.isnan(run.out).any() or np.isnan(run.lse).any())
    error = relative_error(run.out, ref_out)
    seen = np.isfinite(ref_lse)
    same_empty = bool(np.array_equal(np.isneginf(run.lse), ~seen))
    lse_error = float(np.max(np.abs(run.lse[seen] - ref_lse[seen]))) if seen.any() else 0.0
    return [
        Row("out: relative Frobenius error", f"{error:.3g}", f"<= {tol:g}", error <= tol),
        Row(
            "lse: max absolute error",
            f"{lse_error:.3g}",
            f"<= {LSE_TOLERANCE:g}",
            lse_error <= LSE_TOLERANCE and same_empty,
        ),
        Row("NaN in out or lse", "yes" if nan else "no", "no", not nan),
    ]


def emulate(
    spec: Annotated[Path, typer.Argument(help="A spec YAML file.", show_default=False)],
    shape: Annotated[
        str, typer.Option("--shape", help="Problem size B,H,HKV,SQ,SK.")
    ] = DEFAULT_SHAPE,
    causal: Annotated[
        bool | None,
        typer.Option("--causal/--no-causal", help="Override the spec's causal mask."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random inputs.")] = 0,
    window: Annotated[
        str | None,
        typer.Option("--window", help="LEFT,RIGHT of a window spec (default SK/4,0)."),
    ] = None,
    softcap: Annotated[
        float | None, typer.Option("--softcap", help="The cap of a softcap spec (default 5).")
    ] = None,
    mod_input: Annotated[
        list[str] | None,
        typer.Option(
            "--mod-input",
            help="NAME=FILE.npy: an array a spec's user expressions read (repeat per input); "
            "default: example arrays for the shipped specs' inputs.",
        ),
    ] = None,
) -> None:
    """Run SPEC's kernels on the CPU emulator on random inputs; print the error against float64
    with its tolerance, hazards, ldmatrix wavefronts, global bytes read and key tiles visited.
    Exit 1 when the error is over tolerance or a hazard is found."""
    from kernelgen.calls.emulated import emulate_attention
    from kernelgen.families import load_any_spec

    try:
        dims = parse_shape(shape)
        check_seed(seed)
        loaded = load_any_spec(spec)
        if causal is not None and causal != loaded.causal:
            loaded = type(loaded)(**{**loaded.model_dump(), "causal": causal})
        variants = variant_values(loaded, dims, window, softcap)
        given = read_mod_inputs(loaded, mod_input or [])
        expressions, hooks = expression_values(loaded, dims, given, seed)
    except SpecError as exc:
        raise fail(str(exc).splitlines()) from None
    except (KernelgenError, ValueError) as exc:  # e.g. an input its expression cannot read
        raise fail(str(exc).splitlines()[:1]) from None
    if not isinstance(loaded, KernelSpec):  # the backward family
        _emulate_backward(loaded, dims, seed, variants, expressions, hooks)
        return
    if loaded.fp8:  # e4m3 inputs with descales, against the stated fp8 bound
        from kernelgen.cli.emulate_fp8 import emulate_fp8

        emulate_fp8(loaded, dims, seed, {**variants, **expressions}, hooks)
        return
    q, k, v = _random_inputs(loaded, dims, seed)
    rows: list[Row] = []
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} launches"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as progress:
        task = progress.add_task(f"emulating {loaded.uri}", total=2 if loaded.split_kv else 1)
        try:
            run = emulate_attention(
                loaded,
                q,
                k,
                v,
                on_step=lambda done, total: progress.update(task, completed=done, total=total),
                **variants,
                **expressions,
            )
        except HazardError as exc:
            run = None
            rows.append(Row("hazards (race check)", "1", "0", False))
            hazard = exc.message
        except (EmulatorCompileError, EmulatorLaunchError) as exc:
            raise fail([str(exc)], 1) from None
        except EmulatorError as exc:
            raise fail([str(exc)]) from None
        except KernelgenError as exc:  # the shape does not fit the spec, e.g. a grid limit
            raise fail([str(exc)]) from None
    if run is None:
        out_console.print(table(loaded, dims, rows))
        raise fail([f"hazard: {hazard}"], 1)
    rows = [
        *_error_rows(loaded, run, q, k, v, {**variants, **hooks}),
        Row("hazards (race check)", "0", "0", True),
        *memory_rows(loaded, run, dims, expressions.get("block_mask")),
    ]
    out_console.print(table(loaded, dims, rows))
    failed = [r.what for r in rows if r.ok is False]
    if failed:
        raise fail([f"{loaded.uri}: failed: {', '.join(failed)}"], 1)


def _emulate_backward(spec, dims, seed: int, variants: dict, expressions: dict, hooks: dict):
    """``kernelgen emulate`` of a backward spec: the forward (the policy's spec) then the spec's
    backward kernels on random inputs and a random dout; each gradient's error against the
    float64 analytic gradients (:func:`kernelgen.references.attention.attention_backward`)."""
    from kernelgen.calls.attention import attention
    from kernelgen.calls.backward import attention_backward
    from kernelgen.references.attention import OUT_TOLERANCE, relative_error
    from kernelgen.references.attention import attention_backward as reference_backward
    from kernelgen.specs.expression_grad import score_mod_grad_callable

    q, k, v = _random_inputs(spec, dims, seed)
    (dout,) = _random_inputs(spec, (dims[0], dims[1], dims[1], dims[3], dims[3]), seed + 1)[:1]
    device = [_in_dtype(x, spec.dtype) for x in (q, k, v, dout)]
    options = {"causal": spec.causal, **variants, **expressions}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CPUBackendWarning)
            out, lse = attention(*device[:3], return_lse=True, **options)
            grads = attention_backward(
                device[3], *device[:3], out, lse, spec=spec, deterministic=spec.deterministic,
                **options,
            )  # fmt: skip
    except HazardError as exc:
        raise fail([f"hazard: {exc.message}"], 1) from None
    except (EmulatorCompileError, EmulatorLaunchError) as exc:
        raise fail([str(exc)], 1) from None
    except KernelgenError as exc:
        raise fail([str(exc)]) from None
    score_mod = spec.expressions[0]
    if score_mod is not None:
        hooks = {**hooks, "score_mod_grad": score_mod_grad_callable(
            score_mod, expressions.get("mod_inputs"))}  # fmt: skip
    wide = [np.asarray(x, np.float64) for x in (dout, q, k, v)]
    ref = reference_backward(*wide, causal=spec.causal, **variants, **hooks)
    tol = OUT_TOLERANCE[spec.dtype]
    names = ["dq", "dk", "dv"] + (["dsinks"] if ref.dsinks is not None else [])
    rows = []
    for name, got in zip(names, grads, strict=True):
        got = np.asarray(got, np.float64)
        error = relative_error(got, getattr(ref, name))
        ok = bool(np.isfinite(got).all()) and error <= tol
        rows.append(Row(f"{name} rel. error", f"{error:.2e}", f"<= {tol:.0e}", ok))
    rows.append(Row("hazards (race check)", "0", "0", True))
    out_console.print(table(spec, dims, rows))
    failed = [r.what for r in rows if r.ok is False]
    if failed:
        raise fail([f"{spec.uri}: failed: {', '.join(failed)}"], 1)


def _in_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values (exact in ``dtype``) as a NumPy array of ``dtype`` (bfloat16: ml_dtypes)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


def register(app: typer.Typer) -> None:
    """Add ``emulate`` to the ``kernelgen`` command."""
    app.command("emulate")(emulate)
