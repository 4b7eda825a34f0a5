"""Faults a run meets and how it ends: a second run on a folder in use, a stop signal in each phase,
bytes that are not UTF-8, an aside (a sample, the record) failing, a population that cannot fit,
and a run continued from its folder alone. Each ends in its exit code and one line, no traceback,
and leaves every checkpoint written before it as it was."""

import gc
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, TINY, checkpoint_digest, in_process

import run
from egg import checkpoints, cluster, record

FOUR = [*TINY, "--num_epochs", "4", "--save_every", "2", "--run_name", "r"]


def snapshot(folder: Path) -> dict[str, str]:
    """{path: sha256} of every file under a folder but its lock file, which names its owner."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".owner"
    }


def start(*flags, cwd: Path):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *flags],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def wait_for(condition, proc, seconds=240):
    deadline = time.time() + seconds
    while not condition():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1].decode()[
            -2000:
        ]
        time.sleep(0.05)


def test_a_second_run_on_a_folder_in_use_is_refused_and_the_first_is_untouched(tmp_path):
    """Two runs of the same name: the second is refused at once in one line naming the owner's
    host and PID, exit 2, and touches nothing of the first; a SIGKILLed owner's lock dies with it,
    so its own resume is never blocked."""
    first = start(
        *TINY, "--run_name", "r", "--num_epochs", "100000", "--save_every", "2", cwd=tmp_path
    )
    checkpoints_dir = tmp_path / "runs" / "r" / "checkpoints"
    wait_for(lambda: len(checkpoints.checkpoints_in(checkpoints_dir)) >= 2, first)
    first.send_signal(signal.SIGSTOP)  # held still, so that its folder can be compared
    before = snapshot(tmp_path / "runs")
    second = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *TINY, "--run_name", "r", "--resume", "auto"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert second.returncode == 2 and "Traceback" not in second.stderr
    owner = f"host {socket.gethostname()}, PID {first.pid}"
    assert second.stderr == (
        f"error: runs/r is in use by another run ({owner}): wait for it to end, or give this run "
        "another --run_name\n"
    )
    assert snapshot(tmp_path / "runs") == before
    first.send_signal(signal.SIGKILL)
    first.communicate()
    resumed = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "--resume", "runs/r", "--num_epochs", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0 and "nothing to do" in resumed.stdout, resumed.stderr[-2000:]


def signal_within(target, name: str, sig=signal.SIGINT, times: int = 1):
    """`target` (a module) with its function `name` sending this process `sig` on its first call
    (as if it arrived then), then doing its work; `times` signals: a second stops at once."""
    real, sent = getattr(target, name), []

    def wrapped(*args, **kwargs):
        if not sent:
            sent.append(True)
            for _ in range(times):
                os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    return wrapped


BASE = [*TINY, "--run_name", "r", "--num_epochs", "1000", "--save_every", "2"]
PHASES = [  # where the signal arrives, the flags, what the run says, the newest checkpoint after it
    (run, "read_data", BASE, "stopped by SIGINT while reading the data: nothing saved", None),
    (run, "compile_now", BASE, "stopped by SIGINT before generation 1: nothing saved", None),
    (run, "Dispatched", BASE, "stopped by signal after generation 1: saved", 1),  # just dispatched
    # the validation after generation 3 is finished, then generation 4 is run and saved
    (
        run,
        "validate",
        [*BASE, "--validate_every", "3"],
        "stopped by signal after generation 4: saved",
        4,
    ),
    # the checkpoint of generation 2 is finished, then generation 3 is run and saved
    (checkpoints, "save_checkpoint", BASE, "stopped by signal after generation 3: saved", 3),
]


@pytest.mark.parametrize("target, name, flags, said, saved", PHASES, ids=[p[1] for p in PHASES])
def test_a_stop_signal_in_each_phase_ends_in_one_line_after_saving_what_ran(
    tmp_path, monkeypatch, capsys, target, name, flags, said, saved
):
    """SIGINT while the data is read (at once), while the step compiles (once it has: never inside
    JAX), in the first generation, in a validation and in a checkpoint's write (each finished and
    saved first): exit 130, the line that says so, no traceback. The checkpoints, where there are
    any, hold every generation run, and no half-written one is left."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(target, name, signal_within(target, name))
    result = in_process(capsys, *flags)
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert said in result.stdout + result.stderr
    folder = tmp_path / "runs" / "r" / "checkpoints"
    saved_now = [int(p.name.split("-")[1]) for p in checkpoints.checkpoints_in(folder)]
    assert (saved_now[-1] if saved_now else None) == saved
    assert [p.name for p in folder.glob(".*")] in ([], [".owner"])


def test_two_signals_stop_at_once(tmp_path):
    """The second stop signal ends the process at once, by that signal, after one line."""
    proc = start(*TINY, "--run_name", "r", "--num_epochs", "100000", cwd=tmp_path)
    wait_for(lambda: any((tmp_path / "runs" / "r").glob("metrics.jsonl")), proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    # at once, or the first's save won
    assert proc.returncode in (
        -signal.SIGTERM,
        128 + signal.SIGTERM,
    )
    assert b"Traceback" not in err


def test_sigint_from_the_start_on_never_crashes(tmp_path):
    """Ctrl-C at moments spread over a run's start (the data's, the compile's, the first
    generations'): exit 130, one line that says what was saved, never a traceback or a crash
    (inside JAX's compiler an exception once ended in a segmentation fault)."""
    for delay in (2.5, 3.5, 4.5, 6.0):  # from when Python has imported JAX (about a second here) on
        runs = tmp_path / str(delay)
        runs.mkdir()
        proc = start(*TINY, "--num_epochs", "100000", "--save_every", "0", cwd=runs)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        text = (out + err).decode()
        print(f"SIGINT after {delay} s: exit {proc.returncode}, {text.strip().splitlines()[-1]}")
        assert proc.returncode == 130 and "Traceback" not in text, text[-2000:]
        assert re.search(r"stopped by SIGINT|stopped by signal after generation \d+: saved", text)


def test_a_prompt_of_any_bytes_samples_during_training_shown_escaped(tmp_path):
    """A prompt of any bytes samples during training, shown escaped (no raw ESC or BEL reaches the
    terminal); the run ends as usual and saves."""
    runs = tmp_path / "runs"
    flags = [*FOUR, "--runs_dir", str(runs), "--sample_every", "2", "--max_new_bytes", "8"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *flags, "--prompt", b"\xff\xfe\x1b\x07 "],
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    samples = [
        x for x in done.stdout.decode().splitlines() if re.match(r"generation \d+ sample: ", x)
    ]
    assert len(samples) == 2 and all(
        x.split(" sample: ")[1].startswith("\\xff\\xfe\\x1b\\x07 ") for x in samples
    )
    assert b"\x1b" not in done.stdout and b"\x07" not in done.stdout
    assert (runs / "r" / "checkpoints" / "gen-00000004").is_dir()


def test_a_failing_sample_or_record_is_a_warning_and_the_run_saves(tmp_path, monkeypatch, capsys):
    """A sample that fails (twice) and W&B that fails (from the first generation on: it is then
    dropped) are each said in one warning; the run trains to its end and saves."""
    full = "(OSError: [Errno 28] No space left on device)"

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(run, "sample_text", broken)
    monkeypatch.setattr(record.RunRecord, "log_wandb", broken)
    result = in_process(
        capsys, *FOUR, "--runs_dir", str(tmp_path), "--sample_every", "2", "--track"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [x for x in result.stdout.splitlines() if x.startswith("warning:")]
    assert warnings == [
        f"warning: recording generation 1 failed {full}; training goes on",
        f"warning: generation 2's sample failed {full}; training goes on",
        f"warning: generation 4's sample failed {full}; training goes on",
    ]
    assert (tmp_path / "r" / "checkpoints" / "gen-00000004").is_dir()
    assert len((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) == 4  # the file went on


def test_a_population_that_cannot_fit_is_refused_naming_one_that_does(
    tmp_path, monkeypatch, capsys
):
    """The compiled step's temporaries against the memory left, before the first generation: where
    they cannot fit, one line names about the largest population that does, and that population
    then trains in the same memory."""
    big = [
        *TINY,
        "--runs_dir",
        str(tmp_path),
        "--num_epochs",
        "1",
        "--parallel_generations_per_gpu",
        "2048",
    ]
    needs = []
    real = cluster.check_memory
    monkeypatch.setattr(
        cluster,
        "check_memory",
        lambda mesh, mib, *rest: needs.append(mib) or real(mesh, mib, *rest),
    )
    assert in_process(capsys, *big, "--run_name", "measure").returncode == 0
    left = needs[0] * 2**20 / 3  # a third of what population 2048 needs
    monkeypatch.setattr(cluster, "memory_left", lambda mesh: (left, 1))
    result = in_process(capsys, *big, "--run_name", "refused")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    fits = int(re.search(r"use --parallel_generations_per_gpu (\d+) or less$", line)[1])
    assert line.startswith("error: population 2048: the generation step needs ")
    assert "GiB free on the host" in line and 2048 * 0.9 / 3 - 4 <= fits <= 2048 * 0.9 / 3
    assert not checkpoints.checkpoints_in(tmp_path / "refused" / "checkpoints")
    big[big.index("2048")] = str(fits)
    assert in_process(capsys, *big, "--run_name", "fits").returncode == 0


def test_a_run_continues_from_its_folder_alone_with_its_own_flags(tmp_path, capsys):
    """--resume RUN_FOLDER and nothing else: the run's flags (its data and model included) from its
    checkpoint, bit for bit the run that was never stopped; a flag given overrides its own. The end
    names the folder, the newest checkpoint and the commands that sample and continue."""
    os.chdir(tmp_path)
    try:
        assert in_process(capsys, *FOUR).returncode == 0
        six = [*TINY, "--num_epochs", "6", "--save_every", "2", "--run_name", "whole"]
        assert in_process(capsys, *six).returncode == 0
        result = in_process(capsys, "--resume", "runs/r", "--num_epochs", "6")
    finally:
        os.chdir(ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resuming from runs/r/checkpoints/gen-00000004 at generation 4" in result.stdout
    runs = tmp_path / "runs"
    assert checkpoint_digest(runs / "r" / "checkpoints" / "gen-00000006") == checkpoint_digest(
        runs / "whole" / "checkpoints" / "gen-00000006"
    )
    assert json.loads((runs / "r" / "config.json").read_text())["num_epochs"] == 6
    assert result.stdout.strip().splitlines()[-1] == (
        "the run's record: runs/r; its newest checkpoint: runs/r/checkpoints/gen-00000006; "
        "sample: python run.py --sample --resume runs/r; continue: python run.py --resume runs/r "
        "--num_epochs 12"
    )


@pytest.mark.parametrize(
    "resume, said",
    [
        (
            "missing",
            "--resume missing: no such path; "
            "give a run folder, its checkpoints folder or one checkpoint",
        ),
        ("a-file", "--resume a-file: a file, not a checkpoint; give a run folder"),
        ("empty", "--resume empty: no checkpoint there; give a run folder"),
    ],
)
def test_resume_of_what_is_no_checkpoint_says_what_it_is(
    tmp_path, monkeypatch, capsys, resume, said
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    result = in_process(capsys, "--resume", resume)
    assert (
        result.returncode == 2
        and result.stderr == f"error: {said}" + result.stderr.split(said, 1)[1]
    )
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_save_dir_that_is_a_file_is_refused_in_words(tmp_path, capsys):
    (tmp_path / "taken").write_text("mine")
    result = in_process(
        capsys, *TINY, "--runs_dir", str(tmp_path), "--save_dir", str(tmp_path / "taken")
    )
    assert result.returncode == 2
    assert (
        result.stderr
        == f"error: cannot write checkpoints to --save_dir {tmp_path / 'taken'}: it is a file\n"
    )
    assert (tmp_path / "taken").read_text() == "mine"


def test_a_stop_signal_in_the_last_generation_lets_the_run_finish(tmp_path, monkeypatch, capsys):
    """The generation a signal interrupts is the last: the run has finished, exit 0, its end
    said."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run, "Dispatched", signal_within(run, "Dispatched"))
    result = in_process(capsys, *TINY, "--run_name", "r", "--num_epochs", "1")
    assert result.returncode == 0 and "validation bits/byte" in result.stdout, result.stderr[-2000:]
    assert (
        checkpoints.checkpoints_in(tmp_path / "runs" / "r" / "checkpoints")[-1].name
        == "gen-00000001"
    )


def test_a_run_folder_that_is_also_its_save_dir_is_owned_once(tmp_path, capsys):
    result = in_process(
        capsys, *FOUR, "--runs_dir", str(tmp_path), "--save_dir", str(tmp_path / "r")
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert checkpoints.checkpoints_in(tmp_path / "r")[-1].name == "gen-00000004"


def test_resuming_an_older_checkpoint_into_its_own_folder_is_refused(tmp_path, capsys):
    """Later checkpoints in the folder it would write to would mix with the new run's: refused, the
    folder untouched; into another run's folder it continues."""
    base = [*FOUR, "--runs_dir", str(tmp_path)]
    assert in_process(capsys, *base).returncode == 0
    before, older = snapshot(tmp_path / "r"), tmp_path / "r" / "checkpoints" / "gen-00000002"
    result = in_process(capsys, "--resume", str(older), "--num_epochs", "6")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(
        f"error: --resume {older}: {tmp_path / 'r' / 'checkpoints'} holds later "
    )
    assert snapshot(tmp_path / "r") == before
    branch = in_process(capsys, "--resume", str(older), "--num_epochs", "6", "--run_name", "branch")
    assert branch.returncode == 0, branch.stderr[-2000:]
    assert "at generation 2" in branch.stdout


ECHOED = """
import os, signal, sys, time
os.environ[sys.argv[1]] = "1"
from egg.cluster import StopSignal
with StopSignal() as stop:
    os.kill(os.getpid(), signal.SIGTERM)  # from the terminal or SLURM, and through the supervisor
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
    print(stop.received)
"""


def test_a_supervised_child_takes_one_signal_twice_over_for_one(tmp_path):
    """A supervisor's child receives a terminal's or SLURM's signal itself and again through its
    supervisor: the echo is not a second signal, which would end it unsaved."""
    child = subprocess.run(
        [sys.executable, "-c", ECHOED, cluster.SUPERVISED], cwd=ROOT, capture_output=True, text=True
    )
    assert (child.returncode, child.stdout.strip()) == (0, str(int(signal.SIGTERM))), child.stderr
    assert (
        "stopping at once" not in child.stderr
        and child.stderr.count("SIGTERM: stopping safely") == 1
    )


def test_a_folder_on_a_filesystem_without_locks_is_refused_in_one_line(tmp_path, monkeypatch):
    import errno
    import fcntl

    from egg import UserError, files

    def no_locks(*args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(
        UserError, match=r"^cannot lock .*/r \(No locks available\): give --run_name on a local"
    ):
        files.own(tmp_path / "r", "metrics to --runs_dir", "--run_name")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the drop itself
def test_a_stop_signal_whose_exception_python_drops_still_stops_the_run(monkeypatch):
    """A signal whose exception is raised inside a garbage-collection callback (JAX has one) is
    dropped by Python: the run it came to stop must stop all the same (Ctrl-C so placed once left a
    run training on), and without the traceback Python would print of it (which once broke the
    one line of a Ctrl-C); another exception so dropped is still reported."""

    def collecting(phase, info):
        if phase == "start":
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))  # Python code: where the handler runs, and raises

    reported = []  # what Python's hook for dropped exceptions is given to report
    monkeypatch.setattr(sys, "unraisablehook", lambda report: reported.append(report.exc_value))
    with cluster.early_stops():
        gc.callbacks.append(collecting)
        try:
            gc.collect()  # the handler's exception is dropped here
        finally:
            gc.callbacks.remove(collecting)
        with cluster.StopSignal() as stop, pytest.raises(cluster.Stopped) as stopped:
            stop.check("while reading the data: nothing saved")
        assert reported == []

        def failing(phase, info):
            if phase == "start":
                raise ValueError("a fault of another kind")

        gc.callbacks.append(failing)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(failing)
        assert [type(e) for e in reported] == [ValueError]
    assert stopped.value.signum == signal.SIGINT
    assert cluster.StopSignal().received is None  # the early signal ended with early_stops
