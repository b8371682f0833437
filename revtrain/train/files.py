"""Files of a run folder: atomic writes with the usual permissions, and clean-up after killed writes.

Every file revtrain writes into a run folder is written to a temporary file in the same folder,
flushed and fsync'ed, then ``os.replace``'d over the old one, so a crash, a kill or a full disk
mid-write leaves the previous file as it was. Temporary files are named
``.<name>.<pid>.<random>.tmp``: a later run can tell those of a killed process (its pid is gone)
from those of a live one and remove only the former.

Files are created with mode ``0o666`` minus the process's umask, like ``open(path, "w")`` (the
``0o600`` of :func:`tempfile.mkstemp` would give checkpoints other permissions than the JSON files
next to them).
"""

from __future__ import annotations

import errno
import glob
import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO

from revtrain.errors import RevtrainError
from revtrain.memory import format_bytes

__all__ = ["NO_SPACE", "DiskFullError", "atomic_write", "atomic_write_text", "remove_stale_temp_files"]

_FILE_MODE = 0o666  # minus the umask, as open() does
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
"""The errno values of a full disk or quota."""


class DiskFullError(RevtrainError, OSError):
    """The disk (or quota) filled up during a write; the previous file is untouched."""


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], None], *, what: str = "file") -> Path:
    """Call ``write(f)`` on a temporary file next to ``path``, then move it over ``path``.

    On any failure (``KeyboardInterrupt`` included) the temporary file is removed and the old
    ``path``, if any, is untouched. A full disk raises :class:`DiskFullError` with a one-line
    message naming ``path`` (``what`` says what it is: ``"checkpoint"``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), _FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        if _disk_full(err):
            kept = (f"the previous {what} {path} is kept unchanged; free some space, then resume" if path.exists()
                    else f"no {what} was written; free some space, then start again")
            raise DiskFullError(
                f"no space left on device while writing {what} {path} ({_free_space(path.parent)} free); {kept}"
            ) from None
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str, *, what: str = "file") -> Path:
    """:func:`atomic_write` for UTF-8 text."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")), what=what)


def _disk_full(err: BaseException) -> bool:
    """Whether ``err`` comes from a full disk or quota. ``torch.save`` reports a failed write as
    ``RuntimeError: [enforce fail at inline_container.cc...]``; the ``OSError`` that says ENOSPC
    is its context, so the chain is searched."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno in NO_SPACE:
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def remove_stale_temp_files(folder: str | os.PathLike[str], names: Iterable[str]) -> list[Path]:
    """Remove the temporary files that killed writers of ``names`` left in ``folder``; returns them.

    A temporary file of ``name`` is ``.<name>.<pid>.<random>.tmp`` (older revtrain wrote
    ``.<name>.<random>.tmp`` and ``<name>.tmp``). It is stale when the process named in it no
    longer runs, or is this one (a folder is cleaned before this process writes to it), or no
    process is named. Files of other live processes, and every other file, stay.
    """
    removed = []
    folder = Path(folder)
    candidates = [p for name in names for p in folder.glob(f".{glob.escape(name)}.*.tmp")]
    candidates += [folder / f"{name}.tmp" for name in names if (folder / f"{name}.tmp").is_file()]
    for tmp in candidates:
        parts = tmp.name.split(".")  # ["", name..., pid, random, "tmp"]
        pid = parts[-3] if len(parts) >= 4 else ""
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        with suppress(FileNotFoundError):
            tmp.unlink()
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:
        return True  # someone else's process, or we cannot tell: keep its file
    return True


def _free_space(folder: Path) -> str:
    try:
        return format_bytes(shutil.disk_usage(folder).free)
    except OSError:
        return "unknown"


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
