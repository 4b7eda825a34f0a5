"""Files written whole or not at all, in folders that have one owner. Each file is written under a
hidden temporary name, .NAME.tmpPID, fsynced and renamed into place, so a kill at any moment never
leaves half of one under its real name. A run owns its folders (own): a lock the kernel drops when
the process ends, however it ends, so a second run is refused while the first lives and a killed
run never blocks its own resume; what temporaries an owned folder holds are a dead run's.

A write that fails for want of room (a full disk, a quota) or by the device's fault is NoRoom where
the run cannot go on without it: one line saying what could not be written and how much room it
needed, exit code EX_IOERR; where it can (a cache), a warning."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import weakref
from contextlib import contextmanager
from pathlib import Path

from egg import UserError

EX_IOERR = 74  # sysexits.h: a write the run needs failed (NoRoom)
ROOM_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EIO)  # no space, over quota, the device failing


def out_of_room(error: BaseException) -> bool:
    """Whether an error is a write's that failed for want of room or by the device (ROOM_ERRORS)."""
    return isinstance(error, OSError) and error.errno in ROOM_ERRORS


def size_text(size: int) -> str:
    """A size in bytes as people read it: 512 B, 12.3 KiB, 4.5 MiB, 1.2 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


class NoRoom(Exception):
    """A write the run cannot go on without failed for want of room or by the device: what it was,
    the room it needed, and why (the OSError). The run stops (exit EX_IOERR) with what was saved."""

    def __init__(self, what: str, needed: int, error: OSError):
        reason = error.strerror or os.strerror(error.errno)
        super().__init__(f"cannot write {what} ({reason}; it needs {size_text(needed)})")


def temporary(path: Path) -> Path:
    """The hidden name under which a file or a folder is written, or removed, before it is
    renamed."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def leftover(path: Path) -> bool:
    """Whether a name is a temporary's (temporary): in a folder this process owns, a dead run's."""
    return re.fullmatch(r"\..+\.tmp\d+", path.name) is not None


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


OWNER = ".owner"  # the lock file of a folder a run owns: "host NAME, PID N" while it is held
HELD = weakref.WeakValueDictionary()  # this process's claims, by folder: a folder is owned once


def own(folder: Path, what: str, flag: str, probe: bool = False):
    """Own `folder` (created if need be) until this process ends: an exclusive lock on its .owner
    file, which names this host and PID. Returns the open file, to be kept (closing it ends the
    claim). A folder another live process owns is refused in one line naming that owner; `what` and
    `flag` say what the folder holds and the flag that would give another. Once owned, the
    temporaries it holds are a dead run's leftovers, and go. `probe`: only refuse a folder in use,
    creating and keeping nothing. The lock is flock(2): local filesystems and NFS v4 honour it, and
    its holder's death, SIGKILL included, ends it. A folder this process owns already (the run
    folder as --save_dir too) returns its claim."""
    if (held := HELD.get(folder.resolve())) is not None:
        return held
    if probe and not (folder / OWNER).is_file():
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        claim = open(folder / OWNER, "a+")
    except OSError as error:
        raise unwritable(folder, what, error) from None
    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        claim.seek(0)
        owner = claim.read().strip() or "a process starting"
        claim.close()
        in_use = f"{folder} is in use by another run ({owner})"
        raise UserError(f"{in_use}: wait for it to end, or give this run another {flag}") from None
    except OSError as error:
        claim.close()  # a filesystem without flock (NFS mounted nolock, Lustre without flock)
        raise UserError(
            f"cannot lock {folder} ({error.strerror}): give {flag} on a local filesystem"
        ) from None
    if probe:
        claim.close()
        return None
    try:
        claim.seek(0)
        claim.truncate()
        claim.write(f"host {socket.gethostname()}, PID {os.getpid()}\n")
        claim.flush()
        write_atomic(folder / ".write-test", b"")  # a file can be written, and renamed into place
        (folder / ".write-test").unlink()
        for path in filter(leftover, folder.iterdir()):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    except OSError as error:
        raise unwritable(folder, what, error) from None
    HELD[folder.resolve()] = claim
    return claim


def unwritable(folder: Path, what: str, error: OSError) -> Exception:
    """The line refusing a folder that cannot be written: cannot write WHAT FOLDER: why (NoRoom
    where the room is wanting: its lock file and a page)."""
    if out_of_room(error):
        return NoRoom(f"{what} {folder}", 4096, error)
    reason = "it is a file" if folder.is_file() else error.strerror
    return UserError(f"cannot write {what} {folder}: {reason}")
