"""Offline compilation through NVRTC (cuda-bindings): cubin, ptxas resource report, SASS facts.

No GPU is needed. The CUDA headers and tools are located with cuda-pathfinder; nothing is a
hard-coded path. (cupy_backends' nvrtc.getCUBIN drops the cubin's last byte, so the offline path
uses cuda-bindings' NVRTC, which does not.)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from kernelgen.errors import CompileError, ToolchainMissingError
from kernelgen.fileio import create_new_file, private_dir, user_cache_home
from kernelgen.kernels import compile_cache as compile_cache

log = logging.getLogger(__name__)

COMMON_OPTIONS: tuple[str, ...] = ("-std=c++17", "--use_fast_math", "-default-device")


@dataclass(frozen=True)
class Resources:
    """What ptxas reported for one kernel on one architecture."""

    arch: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    static_smem_bytes: int
    sass_instructions: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    arch: str
    cubin: bytes
    log: str
    resources: Resources | None  # None when compiled without the ptxas report


@cache
def cuda_include_dir() -> str:
    """Directory holding cuda_fp16.h and friends (from the nvidia-cuda-runtime wheel or a CTK)."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError as exc:
        raise ToolchainMissingError(
            "cuda-pathfinder is not installed; install kernelgen[nvrtc] or kernelgen[cuda]"
        ) from exc
    path = find_nvidia_header_directory("cudart")
    if path is None:
        raise ToolchainMissingError(
            "CUDA headers (cuda_fp16.h) not found; install nvidia-cuda-runtime (kernelgen[nvrtc])"
        )
    return path


def nvrtc_options(arch: str) -> list[str]:
    return [f"-arch={arch}", *COMMON_OPTIONS, f"-I{cuda_include_dir()}"]


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise ToolchainMissingError(
            "cuda-bindings (NVRTC) is not installed; install kernelgen[nvrtc]"
        ) from exc
    try:
        nvrtc.nvrtcVersion()
    except Exception as exc:  # the library itself failed to load
        raise ToolchainMissingError(f"NVRTC could not be loaded: {exc}") from exc
    return nvrtc


def nvrtc_version() -> str:
    """The loaded NVRTC's version, e.g. "13.2" (ToolchainMissingError without one)."""
    _, major, minor = _nvrtc().nvrtcVersion()
    return f"{major}.{minor}"


def nvrtc_available() -> bool:
    try:
        _nvrtc()
        cuda_include_dir()
    except ToolchainMissingError:
        return False
    return True


def _check(nvrtc, result) -> None:
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainMissingError(f"NVRTC call failed: {result}")


def failed_sources_dir() -> Path:
    """``$KERNELGEN_FAILED_DIR/kernelgen``, else ``$XDG_CACHE_HOME/kernelgen/failed``
    (``~/.cache/kernelgen/failed``): private to the user (0700), refused when it is not."""
    explicit = os.environ.get("KERNELGEN_FAILED_DIR")
    base = Path(explicit) / "kernelgen" if explicit else user_cache_home() / "kernelgen" / "failed"
    return private_dir(base)


def save_failed_source(name: str, source: str) -> str | None:
    """Keep a source NVRTC rejected where the user can open it: a new file
    ``<name>-<random>.failed.cu`` (mode 0600, never through a symbolic link) in
    :func:`failed_sources_dir`. None, with a warning, when it cannot be saved: the compile
    error matters more than its copy."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:100].lstrip(".") or "kernel"
    try:
        return str(create_new_file(failed_sources_dir(), stem, ".failed.cu", source.encode()))
    except OSError as exc:  # UnsafeFolderError included
        log.warning("could not save the source NVRTC rejected: %s", exc)
        return None


def report_options(nvrtc_version: tuple[int, int]) -> list[str]:
    """NVRTC options that make ptxas print its resource report into the program log. NVRTC 12.9
    and later keep a compile cache; a hit skips ptxas and with it the report (seen on an H100:
    the second compile of a source had none), so those versions also get ``--no-cache``."""
    return ["--ptxas-options=-v", *(["--no-cache"] if nvrtc_version >= (12, 9) else [])]


def compile_offline(
    source: str,
    name: str,
    arch: str,
    *,
    sass: bool = True,
    report: bool = True,
    cache: bool = True,
) -> CompiledKernel:
    """Compile ``source`` for ``arch`` (e.g. ``sm_90``) and, with ``report``, parse ptxas'
    resource report (with ``sass``, also count SASS instructions where cuobjdump is installed).
    Without ``report`` (a launch that only needs the cubin) ``resources`` is None. With
    ``cache`` the cubin and log come from, or go to, the on-disk compile cache
    (:mod:`kernelgen.kernels.compile_cache`); an entry made without the report does not serve a call
    that needs it."""
    nvrtc = _nvrtc()
    _, major, minor = nvrtc.nvrtcVersion()
    entry = (
        compile_cache.entry_path(source, name, arch, nvrtc_options(arch), f"{major}.{minor}")
        if cache
        else None
    )
    hit = compile_cache.load(entry) if entry else None
    if hit is not None and (hit.has_report or not report):
        cubin, program_log = hit.cubin, hit.log
    else:
        cubin, program_log = _nvrtc_compile(nvrtc, source, name, arch, (major, minor), report)
        if entry:
            compile_cache.store(entry, compile_cache.CachedCompile(cubin, program_log, report))
    if not report:
        return CompiledKernel(name, arch, cubin, program_log, None)
    resources = parse_ptxas_report(program_log, name, arch)
    counts = sass_instruction_counts(cubin) if sass else {}
    if counts:
        resources = Resources(**{**resources.as_dict(), "sass_instructions": counts})
    return CompiledKernel(name, arch, cubin, program_log, resources)


def _nvrtc_compile(
    nvrtc, source: str, name: str, arch: str, version: tuple[int, int], report: bool
) -> tuple[bytes, str]:
    """One NVRTC compile: (cubin, program log); CompileError with the log on failure."""
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(nvrtc, err)
    try:
        options = [*nvrtc_options(arch), *(report_options(version) if report else [])]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check(nvrtc, err)
        log_buf = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, log_buf)[0])
        log = log_buf.rstrip(b"\x00 ").decode(errors="replace")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(name, log, save_failed_source(name, source))
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(nvrtc, err)
        cubin = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin)[0])
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, log


_FUNCTION = re.compile(r"Compiling entry function '(?P<name>\w+)' for '(?P<arch>\w+)'")
_FRAME = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<store>\d+) bytes spill stores, "
    r"(?P<load>\d+) bytes spill loads"
)
_USAGE = re.compile(r"Used (?P<regs>\d+) registers(?P<rest>.*)")
_SMEM = re.compile(r"(?P<smem>\d+) bytes smem")


def parse_ptxas_report(log: str, name: str, arch: str) -> Resources:
    """Pull registers, spills, stack and static shared memory of ``name`` out of a ptxas -v log."""
    current = None
    found: dict[str, int] = {}
    for line in log.splitlines():
        if m := _FUNCTION.search(line):
            current = m["name"]
            continue
        if current != name:
            continue
        if m := _FRAME.search(line):
            found.update(stack=int(m["stack"]), store=int(m["store"]), load=int(m["load"]))
        elif m := _USAGE.search(line):
            found["regs"] = int(m["regs"])
            smem = _SMEM.search(m["rest"])
            found["smem"] = int(smem["smem"]) if smem else 0
    if "regs" not in found or "stack" not in found:
        raise ValueError(f"ptxas report for {name} on {arch} not found in the NVRTC log:\n{log}")
    return Resources(
        arch=arch,
        registers=found["regs"],
        spill_store_bytes=found["store"],
        spill_load_bytes=found["load"],
        stack_bytes=found["stack"],
        static_smem_bytes=found["smem"],
    )


# ---- SASS (optional: needs the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels) --------
SASS_OPCODES: tuple[str, ...] = (
    "HMMA",
    "HGMMA",
    "QGMMA",  # wgmma with fp8 operands
    "UTMALDG",
    "LDSM",
    "LDGSTS",
    "LDS",
    "STS",
    "LDG",
    "STG",
    "LDL",
    "STL",
)


@cache
def cuobjdump_path() -> str | None:
    """cuobjdump, with nvdisasm beside it (cuobjdump needs nvdisasm on PATH)."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
    except ImportError:
        return shutil.which("cuobjdump")
    tool = find_nvidia_binary_utility("cuobjdump")
    if tool and find_nvidia_binary_utility("nvdisasm"):
        return tool
    return None


def _tool_env(tool: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(tool) + os.pathsep + env.get("PATH", "")
    return env


@cache
def _cuobjdump_version(tool: str) -> str:
    """The disassembler's identity in the SASS cache's keys: cuobjdump's version banner (which
    names its CUDA release) and its path."""
    done = subprocess.run(
        [tool, "--version"], capture_output=True, text=True, env=_tool_env(tool), check=False
    )
    return f"{tool}\n{done.stdout}"


def disassemble(cubin: bytes) -> str | None:
    """SASS text of a cubin, or None when cuobjdump/nvdisasm are not installed; kept in the
    compile cache (:func:`kernelgen.kernels.compile_cache.sass_path`), since the same cubins'
    SASS is read again and again (model, check, the compile tier)."""
    tool = cuobjdump_path()
    if tool is None:
        return None
    kept = compile_cache.sass_path(cubin, _cuobjdump_version(tool))
    sass = compile_cache.load_sass(kept) if kept else None
    if sass is not None:
        return sass
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        done = subprocess.run(
            [tool, "-sass", handle.name],
            capture_output=True,
            text=True,
            env=_tool_env(tool),
            check=False,
        )
    if done.returncode != 0:
        return None
    if kept:
        compile_cache.store_sass(kept, done.stdout)
    return done.stdout


def sass_instruction_counts(cubin: bytes) -> dict[str, int]:
    """How often each opcode family of interest appears in the SASS ({} without the tools)."""
    sass = disassemble(cubin)
    return {} if sass is None else count_opcodes(sass)


@dataclass(frozen=True)
class SassInstruction:
    """One executable line of cuobjdump's SASS: address, opcode family (text before the first
    dot, e.g. STG), operands and the whole opcode with its modifiers (e.g. STG.E.128)."""

    address: int
    family: str
    operands: str
    opcode: str = ""
    # The stall count of the instruction's control bits (bits 41-44 of its upper 64 bits on
    # sm_70 and later): cycles the warp waits before its next instruction; 0 when the text
    # lacks the encoding.
    stall: int = 0


_SASS_LINE = re.compile(
    r"^\s+/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?P<pred>@!?U?P\w+\s+)?"
    r"(?P<op>[A-Z][A-Z0-9_.]*)(?P<operands>[^;]*);"
    r"(?:[ \t]*/\* 0x[0-9a-f]{16} \*/[ \t]*\n[ \t]*/\* (?P<upper>0x[0-9a-f]{16}) \*/)?",
    re.M,
)
STALL_SHIFT, STALL_MASK = 41, 0xF  # of the upper 64 bits of an instruction's encoding


def sass_instructions(sass: str) -> list[SassInstruction]:
    """The instructions of SASS text in order (any address width). `@!PT` lines never execute
    (ptxas pads with them, e.g. `@!PT LDS RZ, [RZ]`) and are left out."""
    return [
        SassInstruction(
            int(m["addr"], 16),
            m["op"].split(".")[0],
            m["operands"],
            m["op"],
            (int(m["upper"], 16) >> STALL_SHIFT) & STALL_MASK if m["upper"] else 0,
        )
        for m in _SASS_LINE.finditer(sass)
        if (m["pred"] or "").strip() != "@!PT"
    ]


_BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")


def branch_target(row: SassInstruction) -> int | None:
    """The address a BRA jumps to (None for any other instruction)."""
    target = _BRANCH_TARGET.search(row.operands) if row.family == "BRA" else None
    return None if target is None else int(target.group(1), 16)


def backward_target(row: SassInstruction) -> int | None:
    """The target of a branch to an earlier address (a loop's back edge), else None."""
    target = branch_target(row)
    return target if target is not None and target < row.address else None


def sass_loops(rows: list[SassInstruction]) -> Iterator[list[SassInstruction]]:
    """The instructions of each loop of a kernel's SASS: from a backward branch's target to
    the branch, one list per backward branch (ptxas's out-of-line wait blocks branch back from
    below the kernel's exits: such a range holds an EXIT)."""
    for end in rows:
        start = backward_target(end)
        if start is not None:
            yield [row for row in rows if start <= row.address <= end.address]


def function_sass(sass: str, name: str) -> str:
    """The part of cuobjdump's SASS text that belongs to the kernel ``name`` ('' if absent)."""
    sections = re.split(r"^\s*Function : ", sass, flags=re.M)
    for section in sections[1:]:
        if section.split(None, 1)[0] == name:
            return section
    return ""


def count_opcodes(sass: str) -> dict[str, int]:
    """Occurrences of each of SASS_OPCODES in cuobjdump's SASS text."""
    counts = dict.fromkeys(SASS_OPCODES, 0)
    for instruction in sass_instructions(sass):
        if instruction.family in counts:
            counts[instruction.family] += 1
    return counts
