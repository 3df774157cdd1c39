"""The on-disk cache of offline compiles: cubin and NVRTC log by content.

An offline compile (NVRTC, then ptxas) of one kernel takes seconds; `kernelgen build`, `model`,
`check` and the compile tier of the tests compile the same sources again and again. An entry is
keyed by everything the result depends on (the source, the kernel's name, the architecture, the
NVRTC options including the header folder, NVRTC's version) and holds the cubin and the full
program log, so a hit gives back ptxas' resource report as the compile printed it. (NVRTC's own
cache, from 12.9, skips ptxas and with it the report; kernelgen turns it off where it needs the
report: :func:`kernelgen.kernels.compile.report_options`.)

Entries live in ``$KERNELGEN_CACHE_DIR/nvrtc`` (default ``$XDG_CACHE_HOME/kernelgen/nvrtc``),
one file each, written atomically; a file that does not read back whole (its checksum) is a
miss with one warning. Beside them, ``sass/`` keeps each cubin's disassembly (cuobjdump takes a
third of a second per kernel, and `model`, `check` and the tests read the same cubins' SASS
again), zlib-compressed, by the cubin's digest and the disassembler's version.
``KERNELGEN_COMPILE_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from kernelgen.errors import UnsafeFolderError
from kernelgen.fileio import atomic_write_bytes, kernelgen_cache_dir, private_dir

log = logging.getLogger(__name__)

FORMAT = 1
_MAGIC = b"kgnvrtc1"
_HEADER_BYTES = 8  # the JSON header's length, little endian, after the magic


@dataclass(frozen=True)
class CachedCompile:
    cubin: bytes
    log: str
    has_report: bool  # whether the log holds ptxas' resource report


def _folder(*parts: str) -> Path | None:
    """The cache's folder (or a subfolder), made private; None where the cache is off, or where
    the folder is unsafe (a warning: the work goes on without the cache)."""
    if os.environ.get("KERNELGEN_COMPILE_CACHE", "1").strip().lower() in ("0", "off", "no"):
        return None
    try:
        folder = private_dir(kernelgen_cache_dir() / "nvrtc")
        for part in parts:
            folder = private_dir(folder / part)
    except UnsafeFolderError as exc:
        log.warning("compile cache off: %s", exc)
        return None
    return folder


def _digest(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:40]


def entry_path(
    source: str, name: str, arch: str, options: list[str], nvrtc_version: str
) -> Path | None:
    """The entry of this compile: a file named by a digest of everything the cubin and the log
    depend on, in the cache folder; None where the cache is off, or where its folder is unsafe
    (a warning: the compile goes on without the cache)."""
    folder = _folder()
    if folder is None:
        return None
    key = _digest(f"format={FORMAT}", name, arch, nvrtc_version, *options, source)
    return folder / f"{key}.bin"


def sass_path(cubin: bytes, tool_version: str) -> Path | None:
    """Where the disassembly of ``cubin`` by the disassembler of ``tool_version`` is kept;
    None where the cache is off or unsafe."""
    folder = _folder("sass")
    return None if folder is None else folder / f"{_digest(tool_version, cubin)}.sass.z"


def load_sass(path: Path) -> str | None:
    """The kept disassembly, or None (missing, or unreadable: a warning, once)."""
    try:
        return zlib.decompress(path.read_bytes()).decode()
    except FileNotFoundError:
        return None
    except (OSError, zlib.error, UnicodeDecodeError) as exc:
        _warn(path, str(exc))
        return None


def store_sass(path: Path, sass: str) -> None:
    """Keep a disassembly (atomically; a folder that cannot be written only logs)."""
    try:
        atomic_write_bytes(path, zlib.compress(sass.encode(), 6), private=True)
    except OSError as exc:
        log.warning("compile cache: cannot write %s (%s)", path.name, exc.strerror or exc)


_WARNED: set[str] = set()


def load(entry: Path) -> CachedCompile | None:
    """The cached compile in ``entry``, or None (missing, or unreadable: a warning, once)."""
    try:
        data = entry.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _warn(entry, f"cannot be read ({exc.strerror or exc})")
        return None
    try:
        if data[: len(_MAGIC)] != _MAGIC:
            raise ValueError("not a kernelgen compile-cache file")
        start = len(_MAGIC) + _HEADER_BYTES
        size = int.from_bytes(data[len(_MAGIC) : start], "little")
        header = json.loads(data[start : start + size])
        cubin = data[start + size :]
        if hashlib.sha256(cubin).hexdigest() != header["cubin_sha256"]:
            raise ValueError("its cubin does not match its checksum")
        return CachedCompile(cubin, str(header["log"]), bool(header["has_report"]))
    except (ValueError, KeyError, TypeError) as exc:
        _warn(entry, str(exc))
        return None


def store(entry: Path, compiled: CachedCompile) -> None:
    """Write ``entry`` atomically; a folder that cannot be written only logs (the compile
    itself succeeded)."""
    header = json.dumps(
        {
            "cubin_sha256": hashlib.sha256(compiled.cubin).hexdigest(),
            "log": compiled.log,
            "has_report": compiled.has_report,
        }
    ).encode()
    blob = _MAGIC + len(header).to_bytes(_HEADER_BYTES, "little") + header + compiled.cubin
    try:
        atomic_write_bytes(entry, blob, private=True)
    except OSError as exc:
        log.warning("compile cache: cannot write %s (%s)", entry.name, exc.strerror or exc)


def _warn(entry: Path, why: str) -> None:
    if entry.name not in _WARNED:
        _WARNED.add(entry.name)
        log.warning("compile cache: entry %s is ignored and rebuilt: %s", entry.name, why)
