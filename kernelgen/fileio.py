"""Files and folders kernelgen writes: atomic replacement, the umask, private folders.

Atomic writes: a reader sees the old file or the new one, never half of either. Shared outputs
(generated sources, manifests, tuning records) get the mode the umask gives a new file; what a
private folder holds (emulator builds, failed sources) is for the user alone (docs/security.md).
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
import threading
from pathlib import Path

from kernelgen.errors import UnsafeFolderError

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask (read from /proc where it can be, so that no thread sees it change)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str, *, private: bool = False) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, then ``os.replace`` it."""
    atomic_write_bytes(path, text.encode(), private=private)


def atomic_write_bytes(path: str | Path, data: bytes, *, private: bool = False) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then ``os.replace`` it.

    The file gets the mode a new file gets under the umask (0644 under umask 022), or 0600 with
    ``private``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o600 if private else 0o666 & ~current_umask())
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def user_cache_home() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``: where per-user caches live."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def kernelgen_cache_dir() -> Path:
    """``$KERNELGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kernelgen``, else ``~/.cache/kernelgen``:
    the root of kernelgen's caches (tuning records, offline compiles)."""
    if explicit := os.environ.get("KERNELGEN_CACHE_DIR"):
        return Path(explicit).expanduser()
    return user_cache_home() / "kernelgen"


def _owner_uid() -> int | None:
    """The uid files must belong to (None where the platform has no uids)."""
    return os.getuid() if hasattr(os, "getuid") else None


def check_private_dir(folder: Path) -> None:
    """Raise :class:`UnsafeFolderError` unless ``folder`` is a directory of this user that no
    one else may write to, inside folders that do not let everyone rename it (a folder anyone
    may write to needs the sticky bit, as ``/tmp`` has)."""
    uid = _owner_uid()
    try:
        link = folder.lstat()
        info = folder.stat() if stat.S_ISLNK(link.st_mode) else link
    except OSError as exc:
        raise UnsafeFolderError(folder, f"cannot inspect it ({exc.strerror or exc})") from None
    if stat.S_ISLNK(link.st_mode) and uid is not None and link.st_uid not in (uid, 0):
        raise UnsafeFolderError(folder, f"it is a symbolic link of uid {link.st_uid}")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolderError(folder, "it is not a directory")
    if uid is not None and info.st_uid != uid:
        raise UnsafeFolderError(
            folder, f"it belongs to uid {info.st_uid}, not to this user ({uid})"
        )
    if info.st_mode & 0o022:
        raise UnsafeFolderError(
            folder, f"its mode {stat.S_IMODE(info.st_mode):04o} lets group or others write to it"
        )
    for parent in folder.resolve().parents:
        mode = parent.stat().st_mode
        if mode & 0o002 and not mode & stat.S_ISVTX:
            raise UnsafeFolderError(
                folder,
                f"{parent} (mode {stat.S_IMODE(mode):04o}) lets anyone rename what it holds",
            )


def private_dir(folder: str | Path) -> Path:
    """``folder``, created with mode 0700 if missing (missing parents 0755), after
    :func:`check_private_dir`: a folder whose files kernelgen may load or overwrite."""
    folder = Path(folder).expanduser()
    missing = [folder, *(p for p in folder.parents if not p.exists())]
    for path in reversed(missing):  # parents 0755 (less under the umask), even under umask 0
        try:
            os.mkdir(path, 0o700 if path == folder else 0o755)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UnsafeFolderError(path, f"cannot create it ({exc.strerror or exc})") from None
    check_private_dir(folder)
    return folder


def create_new_file(folder: Path, stem: str, suffix: str, data: bytes) -> Path:
    """Write ``data`` to a new file ``<stem>-<random>.<suffix>`` in ``folder``: created
    exclusively, mode 0600, never through a symbolic link (an existing name is not reused)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(16):
        path = folder / f"{stem}-{secrets.token_hex(4)}{suffix}"
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return path
    raise FileExistsError(f"no free file name for {stem}{suffix} in {folder}")
