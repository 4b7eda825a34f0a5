"""Files written whole or not at all: each is written under a hidden temporary name, .NAME.tmpPID,
fsynced and renamed into place, so a kill at any moment never leaves half of one under its real
name, and a later start knows from the PID which leftovers are a dead process's."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path

from egg import UserError


def temporary(path: Path) -> Path:
    """The hidden name under which a file or a folder is written, or removed, before it is renamed."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def leftover_of(path: Path) -> int | None:
    """The PID in a temporary's name (temporary), or None for any other name."""
    match = re.fullmatch(r"\..+\.tmp(\d+)", path.name)
    return int(match.group(1)) if match else None


@contextmanager
def atomic_file(path: Path):
    """Open `path` for binary writing under its temporary name, then fsync it and rename it into
    place (a failed write removes its temporary)."""
    tmp = temporary(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def writable_folder(folder: Path, what: str) -> None:
    """Create `folder` and write a file in it, or refuse with one line: cannot write WHAT FOLDER."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / ".write-test", b"")
        (folder / ".write-test").unlink()
    except OSError as error:
        raise UserError(f"cannot write {what} {folder}: {error.strerror}") from None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return pid > 0
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
