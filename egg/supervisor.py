"""The launcher of a several-process run's share: it runs this process's run.py as a child and
stands by. When a process is lost (silent for --heartbeat_timeout s), JAX terminates every other
one, printing a C++ stack trace (JAX offers no setting to do otherwise: docs/design.org); the
supervisor keeps JAX's log of it in a file and says instead, in one line, what was lost, the
newest complete checkpoint and the command that resumes, exiting EXIT_PROCESS_LOST."""

from __future__ import annotations

import ctypes
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from egg.checkpoints import checkpoints_in
from egg.cluster import SUPERVISED
from egg.files import write_atomic
from egg.record import Folders

EXIT_PROCESS_LOST = (
    75  # EX_TEMPFAIL: a process of the run was lost; resuming (--resume auto) will do
)

PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process receives when its parent ends
GLOG_ERROR = re.compile(r"[EF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\]")  # JAX's errors
JAX_TERMINATES = "Terminating process because the JAX distributed service detected fatal errors"


def supervised() -> bool:
    """Whether this process is a supervisor's child; if so, it is bound to die with it: killed
    (SIGKILL) when the supervisor ends, however it ends, so a launcher killed by a scheduler or a
    user leaves no process behind holding a device (Linux's PR_SET_PDEATHSIG; where the supervisor
    ended before the binding took, this process ends now)."""
    if SUPERVISED not in os.environ:
        return False
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ[SUPERVISED]):
        os._exit(EXIT_PROCESS_LOST)
    return True


def lost_processes(log: str) -> str:
    """The processes JAX's log names as lost: 'Task N heartbeat timeout', the unhealthy tasks'
    list, or the coordinator itself when it is the one that stopped answering."""
    named = re.findall(r"Task (\d+) heartbeat timeout", log) + re.findall(
        r"heartbeats\):\s*(\d+)", log
    )
    if named:
        return "process " + ", ".join(map(str, sorted({int(n) for n in named})))
    return "process 0, the coordinator," if "coordination service" in log else "a process"


HOLD_SECONDS = 3.0  # a held block of JAX's errors the child writes nothing after is passed on then


def relay_stderr(child) -> list[str]:
    """Pass the child's stderr through as it comes, a progress bar's updates too. From an error
    line of JAX's (the coordinator's, a heartbeat's; glog's E and F lines, even one cut into a
    progress bar's line) what the child writes is held: passed on, in order, once the child shows
    it goes on (a progress bar's update) or after HOLD_SECONDS without more (the error was not
    fatal); returned where the child ends first (JAX's account of a lost process, which the
    supervisor says in one line instead). Once JAX says it terminates the process, everything is
    held to the child's end: a slow death (a loaded machine) or a progress bar's update from the
    training thread before JAX ends it does not set the account free."""
    held, pending, ended = [], b"", True  # ended: the last line written has its newline

    def release():
        sys.stderr.buffer.write("".join(f"{text}\n" for text in held).encode())
        held.clear()

    def fatal() -> bool:  # JAX ends the child: hold everything to its end
        return any(JAX_TERMINATES in text for text in held)

    while True:
        wait = HOLD_SECONDS if held and not fatal() else None
        if not select.select([child.stderr], [], [], wait)[0]:
            release()  # nothing after it: not fatal
            sys.stderr.flush()
            continue
        chunk = os.read(child.stderr.fileno(), 1 << 16)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            text = line.decode(errors="replace")
            error = GLOG_ERROR.search(text)
            if error and not held and error.start() > 0:  # after a progress bar's update
                sys.stderr.write(text[: error.start()] + "\n")
                text, ended = text[error.start() :], True
            jax_error = error is not None and text.startswith(error.group(0))
            if held and text.startswith("\r") and not jax_error and not fatal():  # it goes on
                release()
            if held or jax_error:
                held.append(text)
                continue
            sys.stderr.buffer.write(line + b"\n")
            ended = True
        if pending.startswith(b"\r") and not fatal():  # a progress bar's update: it goes on
            release()
            sys.stderr.buffer.write(pending)
            pending, ended = b"", False
        sys.stderr.flush()
    if pending:
        held.append(pending.decode(errors="replace"))
    if not ended:
        sys.stderr.write("\n")
    return held


def resume_command(script: Path, argv: list[str], folders: Folders) -> str:
    """The command that resumes: argv with --resume and its value replaced by the run's own
    (Folders.resume_target), whose newest checkpoint it continues with the run's flags (argv's
    override them); argv itself where no checkpoint is saved yet."""
    if not checkpoints_in(folders.checkpoints):
        return shlex.join(["python", script.name, *argv])
    flags, skip = [], False
    for word in argv:
        if not skip and not word.startswith("--resume"):
            flags.append(word)
        skip = word in ("--resume", "--resume_")
    return shlex.join(["python", script.name, *flags, "--resume", str(folders.resume_target())])


def report_lost_process(script: Path, argv: list[str], log: str, folders: Folders, process: int):
    """The supervisor's one line: what JAX says was lost, where its log went, the newest complete
    checkpoint and the command that resumes. `process`: this process's index, as given."""
    folder, save_dir = folders.run, folders.checkpoints
    process = os.environ.get("SLURM_PROCID", process)  # under SLURM it is not given
    record = (folder if folder.is_dir() else Path(".")) / f"process-{process}-lost.log"
    write_atomic(record, log.encode())
    saved = checkpoints_in(save_dir)
    newest = (
        f"the newest complete checkpoint is {saved[-1]}"
        if saved
        else f"no checkpoint in {save_dir} yet"
    )
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    print(
        f"error: {lost_processes(log)} stopped answering (JAX ended this one at {when}; its log: "
        f"{record}); {newest}; resume with: {resume_command(script, argv, folders)}",
        file=sys.stderr,
    )


def supervise(script: Path, argv: list[str], folders: Folders, process: int) -> int:
    """Run `script` with argv as a child and stand by; return the exit code (`folders`: where the
    run writes; `process`: its index, as given). The child's output, exit code and the stop signals
    this process is sent pass through, and the child dies with it; JAX's account of a lost process
    is kept in <run folder>/process-N-lost.log and said in one line (EXIT_PROCESS_LOST)."""
    env, command = (
        {**os.environ, SUPERVISED: str(os.getpid())},
        [sys.executable, str(script), *argv],
    )
    # it binds itself: supervised()
    child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    for sig in (signal.SIGTERM, signal.SIGINT):  # the child saves and stops; this waits for it
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    log = "\n".join(relay_stderr(child))
    code = child.wait()
    if JAX_TERMINATES not in log:
        sys.stderr.write(log + ("\n" if log else ""))
        return 128 - code if code < 0 else code
    report_lost_process(script, argv, log, folders, process)
    return EXIT_PROCESS_LOST
