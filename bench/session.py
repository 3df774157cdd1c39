"""One GPU session in one command: a fixed plan of stages, each with its own time budget, in
priority order, that fits a short window on a borrowed GPU (8 minutes in all).

    python -m bench.session stamp            # here, on a clean commit: bench/.session-stamp.json
    python -m bench.session --dry-run        # here: the plan, each stage checked without a GPU
    python -m bench.session [--out DIR] [STAGE ...]   # on the GPU host

Priorities (docs: bench/README.md): correctness on hardware of every engine first (the GPU
test tier's subset and compute-sanitizer on one call per engine), then prefill against torch's
flash and cuDNN backends, the backward pass, long prefill, then decode. Each stage runs under
``timeout`` (SIGINT, so pytest and the benchmarks print what they have; SIGKILL after a grace
period); logs and result files are written to a work folder and bundled into
``DIR/session.tgz`` after every stage, so a session cut short still returns what it finished.
``DIR/summary.txt`` holds the GPU, the clocks before and after, the commit and one line per
stage.

The stamp records the commit and the SHA-256 of every tracked file. A GPU host may receive the
working tree without trustworthy git metadata; there the session checks the files against the
stamp instead and tells the benchmarks the commit (``KERNELGEN_SESSION_COMMIT``); a tree that
differs is refused unless ``--allow-dirty``, which records it as dirty.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP = ROOT / "bench" / ".session-stamp.json"
WINDOW_S = 480  # the plan's budgets must sum to at most this
GRACE_S = 10  # after SIGINT, before SIGKILL
COMMIT_ENV, DIRTY_ENV = "KERNELGEN_SESSION_COMMIT", "KERNELGEN_SESSION_DIRTY"

# The GPU test tier's part that comes first: the Hopper kernels, the serving APIs (KV caches,
# paged, varlen), the tuner's choices and the default specs of every dtype and head dim.
CORRECTNESS_SELECTION = (
    "wgmma or serving or tuned or default_spec or default_decode or backward or fp8"
)
SANITIZED_ENGINES = ("simt", "mma_sync", "wgmma")
SANITIZER = ("compute-sanitizer", "--tool")
# the CUDA libraries' own probes (cuGetProcAddress) are API errors, not kernel faults
SANITIZER_FLAGS = ("--report-api-errors", "no", "--error-exitcode", "3")


@dataclass(frozen=True)
class Stage:
    """One step of the plan: a command with its time budget (seconds)."""

    name: str
    budget_s: int
    purpose: str
    command: tuple[str, ...]
    # Same command with flags that make it check itself without a GPU (None: not checkable).
    dry_command: tuple[str, ...] | None = None
    outputs: tuple[str, ...] = field(default=())


def python(*args: str) -> tuple[str, ...]:
    return (sys.executable, *args)


def plan(results: str = "{results}") -> list[Stage]:
    """The stages in priority order; ``results`` is the folder the benchmarks write to."""
    pytest_gpu = ("-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider")
    prefill = (
        "-m", "bench.attention", "--peers", "torch-flash,torch-cudnn,kg-wgmma",
        "--dtype", "bf16", "--head-dim", "128", "--head-dim", "256",
        "--seqlen", "4096", "--budget-ms", "100", "--tag", "session", "--out", results,
    )  # fmt: skip
    # the fp8 loops (kg-wgmma-fp8) at the prefill stage's bf16 d128 shape; kernelgen's bf16 rows
    # come from that stage, on the same machine
    fp8 = (
        "-m", "bench.attention", "--peers", "torch-cudnn,kg-wgmma-fp8",
        "--dtype", "bf16", "--head-dim", "128", "--seqlen", "4096", "--budget-ms", "100",
        "--rounds", "2", "--tag", "fp8", "--out", results,
    )  # fmt: skip
    prefill_long = (
        "-m", "bench.attention", "--peers", "torch-flash,torch-cudnn,kg-wgmma",
        "--dtype", "fp16", "--head-dim", "128", "--seqlen", "16384", "--budget-ms", "100",
        "--tag", "session-long", "--out", results,
    )  # fmt: skip
    decode = ("-m", "bench.decode", "--quick", "--fp8", "--budget-ms", "100", "--out", results)
    # the host NVRTC's cubins of the d128 loops the static readings compare (issue 33: the
    # runs' compiler is not this machine's; bench/dump_cubins.py)
    causal = "specs/v2_wg_bf16_d128_m128_n128_s2_causal.yaml"
    plain = "specs/v2_wg_bf16_d128_m128_n128_s2.yaml"
    cubins = (
        "-m", "bench.dump_cubins", "--out", f"{results}/cubins", f"plain={plain}",
        f"plain_causal={causal}", f"qr={plain},q_in_registers=true",
        f"qr_causal={causal},q_in_registers=true",
        f"ovl_pp_causal={causal},overlap=true,pingpong=true,stages=3",
    )  # fmt: skip
    sanitize = ("-m", "kernelgen.selfcheck", "--engines", ",".join(SANITIZED_ENGINES))
    return [
        Stage(
            "correctness",
            150,  # run 8: 314 tests in 119 s; the 24 more fp8 tests took 27 s alone
            "GPU test tier: wgmma, serving, tuned, default and fp8 specs against float64",
            python(*pytest_gpu, "-k", CORRECTNESS_SELECTION, "--junitxml", f"{results}/gpu.xml"),
            python(*pytest_gpu, "--collect-only", "-k", CORRECTNESS_SELECTION),
        ),
        *(
            Stage(
                tool,
                {"memcheck": 20, "racecheck": 30}[tool],  # runs 6-7: 12-13 s and 26-28 s
                f"compute-sanitizer {tool}: one call per engine",
                (*SANITIZER, tool, *SANITIZER_FLAGS, *python(*sanitize)),
                python(*sanitize, "--dry-run"),
            )
            for tool in ("memcheck", "racecheck")
        ),
        Stage(
            "cubins",
            10,  # five offline compiles, cached by content: about 5 s (not yet run on a GPU host)
            "the host NVRTC's cubins of the d128 loops, for reading their SASS offline",
            python(*cubins),
            python(*cubins, "--dry-run"),
        ),
        Stage(
            "prefill",
            100,  # run 8: 76 s with 28 wgmma candidates at d128; 33 since (n144)
            "bf16 d128/d256 4k, causal or not: wgmma against flash and cuDNN",
            python(*prefill),
            python(*prefill, "--list"),
        ),
        Stage(
            "fp8-prefill",
            55,  # run 8 by hand: 46 s for cuDNN and the 14 fp8 loops
            "bf16-shape d128 4k, causal or not: the fp8 loops against cuDNN",
            python(*fp8),
            python(*fp8, "--list"),
        ),
        Stage(
            "prefill-long",
            70,  # run 8: cut at 40 s compiling the fp16 kernels cold; 40 s warm
            "fp16 d128 16k, causal or not: wgmma against flash and cuDNN",
            python(*prefill_long),
            python(*prefill_long, "--list"),
        ),
        Stage(
            "decode",
            45,  # run 8: 35 s with the fp8 peers
            "split-KV decode (B 1/8, GQA, 4k/32k keys; bf16 and fp8 caches) against the copy floor",
            python(*decode),
            python(*decode, "--list"),
        ),
    ]


def extras(results: str = "{results}") -> list[Stage]:
    """Stages outside the plan, run only when named (``python -m bench.session profile``): for
    a second call on a machine the plan left time on."""
    causal = "specs/v2_wg_bf16_d128_m128_n128_s2_causal.yaml"
    # ncu of the 128 x 128 loop with Q in shared memory and in registers, causal (issue 33's
    # open question: bench/NOTES.md, run 8): each kernel's details and per-instruction stalls
    # and the overlap with ping-pong (run 8's fastest loop without a mask, 1.03x the plain one,
    # short of FlashAttention 3's 12-14 %: where its warps wait says why)
    profile = (
        "-m", "bench.ncu_pair", "--out", f"{results}/ncu", f"plain={causal}",
        f"qr={causal},q_in_registers=true",
        f"ovl_pp={causal},overlap=true,pingpong=true,stages=3",
    )  # fmt: skip
    # the quick grid (bf16 d128 2k, causal or not, and the document and softcap variants);
    # FlexAttention (torch.compile, the slowest to start) on the variant cases only
    backward = (
        "-m", "bench.backward", "--quick", "--peers", "torch-flash,torch-cudnn,kg-atomic,kg-det",
        "--budget-ms", "100", "--min-reps", "4", "--rounds", "2", "--tag", "session",
        "--out", results,
    )  # fmt: skip
    return [
        Stage(
            "profile",
            150,  # run 8 by hand: 17-19 s per kernel recorded and exported; 3 kernels
            "ncu: the plain loop, Q in registers, the overlap with ping-pong; bf16 d128 4k causal",
            python(*profile),
            python(*profile, "--dry-run"),
        ),
        Stage(
            "backward",
            65,  # runs 4-5: 48-51 s; run 8: 57 s (unchanged since run 5: out of the plan)
            "backward and fwd+bwd bf16 d128 2k, variants: kernelgen against flash, cuDNN, flex",
            python(*backward),
            python(*backward, "--dry-run"),
        ),
    ]


# ---- the stamp: which commit the files are ----------------------------------------------------
def tracked_files(root: Path = ROOT) -> list[str]:
    done = subprocess.run(
        ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True
    ).stdout.decode()
    return sorted(p for p in done.split("\0") if p)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"


def write_stamp(root: Path = ROOT, stamp: Path = STAMP) -> dict:
    """Record HEAD and the digest of every tracked file; refuses a tree with changes."""
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if status:
        raise SystemExit(
            f"session stamp: the tree has uncommitted changes; commit first:\n{status}"
        )
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()
    record = {"commit": commit, "files": {p: file_digest(root / p) for p in tracked_files(root)}}
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=0, sort_keys=True))
    os.replace(tmp, stamp)
    return record


def check_stamp(root: Path = ROOT, stamp: Path = STAMP) -> tuple[str, list[str]]:
    """(commit, the files that differ from it); ("unknown", [why]) without a stamp."""
    if not stamp.is_file():
        return "unknown", [
            f"no stamp ({stamp.relative_to(root)}): run `python -m bench.session stamp`"
        ]
    record = json.loads(stamp.read_text())
    changed = [p for p, digest in record["files"].items() if file_digest(root / p) != digest]
    return record["commit"], changed


# ---- running ---------------------------------------------------------------------------------
def run_stage(stage: Stage, work: Path, results: Path) -> tuple[int, float]:
    """Run one stage under its budget: exit status (124 when cut at the budget) and seconds."""
    command = [c.replace("{results}", str(results)) for c in stage.command]
    start = time.monotonic()
    with open(work / f"{stage.name}.log", "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        try:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        except FileNotFoundError as exc:
            log.write(f"cannot start: {exc}\n")
            return 127, 0.0
        try:
            rc = proc.wait(timeout=stage.budget_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(2)  # SIGINT: pytest and the benchmarks report what they have
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = 124
    return rc, time.monotonic() - start


def gpu_facts() -> str:
    query = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
        return done.stdout.strip() or done.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi: {exc}"


def bundle(work: Path, out: Path) -> None:
    """Everything in ``work`` into ``out/session.tgz`` (replaced atomically)."""
    tmp = out / "session.tgz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work, arcname="session")
    os.replace(tmp, out / "session.tgz")


def run(stages: list[Stage], out: Path, allow_dirty: bool) -> int:
    commit, changed = check_stamp()
    if changed and not allow_dirty:
        print(f"session: the tree is not the stamped commit {commit[:12]}: {changed[:5]}")
        print("session: commit and stamp it (python -m bench.session stamp), or --allow-dirty")
        return 2
    os.environ[COMMIT_ENV], os.environ[DIRTY_ENV] = commit, "1" if changed else "0"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kg-session-"))
    results = work / "results"
    results.mkdir()
    os.environ.setdefault("KERNELGEN_CACHE_DIR", str(Path(tempfile.mkdtemp()) / "cache"))
    lines = [f"commit {commit}{' (dirty: ' + ', '.join(changed[:5]) + ')' if changed else ''}",
             f"gpu before: {gpu_facts()}"]  # fmt: skip
    failed = 0
    for stage in stages:
        rc, seconds = run_stage(stage, work, results)
        failed += rc != 0
        tail = (work / f"{stage.name}.log").read_text(errors="replace").strip().splitlines()
        last = tail[-1][:100] if tail else ""
        lines.append(f"{stage.name:13} rc={rc:<3} {seconds:5.0f} s of {stage.budget_s} s  {last}")
        (work / "summary.txt").write_text("\n".join(lines) + "\n")
        bundle(work, out)
    lines.append(f"gpu after:  {gpu_facts()}")
    text = "\n".join(lines) + "\n"
    (work / "summary.txt").write_text(text)
    (out / "summary.txt").write_text(text)
    bundle(work, out)
    shutil.rmtree(work, ignore_errors=True)
    print(text, end="")
    return 1 if failed else 0


def dry_run(stages: list[Stage]) -> int:
    """Print the plan and check each stage here: budgets, the stamp, and each command's own
    no-GPU form (pytest's collection, the benchmarks' --list, selfcheck's --dry-run)."""
    total = sum(s.budget_s for s in stages)
    print(f"plan: {len(stages)} stages, {total} s of {WINDOW_S} s")
    problems = [] if total <= WINDOW_S else [f"budgets sum to {total} s > {WINDOW_S} s"]
    commit, changed = check_stamp()
    print(f"stamp: {commit[:12]}, {'clean' if not changed else f'{len(changed)} files differ'}")
    checked: dict[tuple[str, ...], subprocess.CompletedProcess] = {}  # a command runs once
    for stage in stages:
        status = "not checkable here"
        if stage.dry_command is not None:
            if stage.dry_command not in checked:
                checked[stage.dry_command] = subprocess.run(
                    list(stage.dry_command), cwd=ROOT, capture_output=True, text=True, check=False
                )
            done = checked[stage.dry_command]
            ok = done.returncode == 0 and not _empty_selection(done.stdout)
            status = "ok" if ok else f"FAILED (exit {done.returncode})"
            if not ok:
                tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
                problems.append(f"{stage.name}: {' | '.join(tail)}")
        print(f"  {stage.name:13} {stage.budget_s:4d} s  {status:18} {stage.purpose}")
    for p in problems:
        print(f"problem: {p}")
    return 1 if problems else 0


def _empty_selection(stdout: str) -> bool:
    """pytest's collection selected nothing (a typo in -k)."""
    return "no tests collected" in stdout or "0 selected" in stdout


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.session", description=__doc__.split("\n")[0])
    p.add_argument("stages", nargs="*", help="'stamp', or a subset of the plan's stages")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "gpu-out")))
    p.add_argument("--dry-run", action="store_true", help="check the plan here, no GPU needed")
    p.add_argument("--allow-dirty", action="store_true", help="run on a tree that differs")
    args = p.parse_args(argv)
    if args.stages == ["stamp"]:
        record = write_stamp()
        print(f"stamped {record['commit'][:12]}: {len(record['files'])} files -> {STAMP}")
        return 0
    stages, optional = plan(), extras()
    names = [s.name for s in stages + optional]
    unknown = [n for n in args.stages if n not in names]
    if unknown:
        print(f"session: unknown stage {unknown[0]!r}; stages: {', '.join(names)}, or stamp")
        return 2
    chosen = [s for s in stages + optional if s.name in args.stages] if args.stages else stages
    return dry_run(chosen) if args.dry_run else run(chosen, args.out, args.allow_dirty)


if __name__ == "__main__":
    sys.exit(main())
