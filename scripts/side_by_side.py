"""Upstream nano-egg's run.py and this project's run.py, one after the other, on the same bytes with
the same flags: for each, the validation bits/byte at every validation, mean training tokens/s and
s/generation, peak RSS and wall time. For measuring only: upstream's run.py is copied into a
temporary folder, never into the project.

    pip install scipy   # upstream imports it
    python scripts/side_by_side.py NANO_EGG corpora/english_train.bin corpora/english_valid.bin \
        --num_epochs 1000 --validate_every 100 --jsonl sbs.jsonl \
        --flags="--n_embd 64 --n_layer 2 --parallel_generations_per_gpu 256 \
            --tokens_per_update 100 --seed 0"
    python scripts/side_by_side.py NANO_EGG TRAIN VALID --only upstream --flags="..."

NANO_EGG is a clone or a bare snapshot of github ESHyperscale/nano-egg (its run.py at --revision is
used). Both scripts get `--validation_batch_size 64 --num_epochs N --validate_every V FLAGS`; give
FLAGS with names both know (--n_embd, --n_layer, --alpha, --sigma_shift, --seed, ...), and always
--parallel_generations_per_gpu and --tokens_per_update (the two scripts' defaults differ). Upstream
reads its data from cached_files/minipile_{train,valid,test}.npy beside its run.py: they are written
there from TRAIN and VALID (test is VALID). Upstream needs about 17 GiB of memory whatever the
model's size (its 2**28-entry log table is built in float64): run nothing else large beside it.

Where upstream's imports `datasets` and `wandb` are not installed (a GPU image may lack them), it
gets stand-ins that refuse to be used: with its data cached and --track off it uses neither.

Upstream's numbers are reported as it prints them. Its validation metric reads about 0.03 bits/byte
lower than exact (its integer log-softmax truncates). It prints a generation's throughput every 10th
generation only (0, 10, 20, ...; validation excluded): its s/generation is the mean over those,
without generation 0. Ours come from its metrics.jsonl (every generation but the first, which
compiles). The median s/generation is printed too: on a shared machine it moves less than the mean.
Peak RSS is each run's own (os.wait4), not the machine's; on an accelerator, peak device memory is
what JAX's allocator held at most (read as the run exits), not what it reserved up front.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import tyro
from tyro.conf import Positional, arg

ROOT = Path(__file__).resolve().parent.parent  # the repository root, where our run.py is

VALIDATION_BATCH = 64  # both scripts validate on this many parallel streams
# Either script run through this: as it ends, the most device memory JAX's allocator held, in bytes
# (on a CPU: nothing). Read as the script returns or exits, not at interpreter exit: JAX's own exit
# handler has dropped its backends by then, and asking again would start a new one, its peak 0.
MEASURED = """
import runpy, sys

def peak():
    jax = sys.modules.get("jax")
    if jax is None:
        return
    held = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices()]
    if any(held):
        print(f"\\nside_by_side: peak device memory {max(held)} B", file=sys.stderr, flush=True)

sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    peak()
"""
# stand-ins for upstream's imports that it does not use here (its data cached, --track off)
STAND_INS = {
    "datasets": "def load_dataset(*args, **kwargs):\n    raise SystemExit('no datasets here')\n",
    "wandb": "def init(*args, **kwargs):\n    raise SystemExit('no wandb here')\n",
}


@dataclass(frozen=True)
class Args:
    nano_egg: Annotated[Positional[str], arg(metavar="NANO_EGG")]
    """a clone or bare snapshot of github ESHyperscale/nano-egg"""
    train: Annotated[Positional[str], arg(metavar="TRAIN")]
    """training bytes: a raw file (byte 0 between documents)"""
    valid: Annotated[Positional[str], arg(metavar="VALID")]
    """validation bytes: a raw file"""
    flags: str = ""
    """flags given to both run.py scripts (each knows these names), e.g. '--n_embd 64 --seed 0'"""
    num_epochs: int = 1000
    """generations of each run"""
    validate_every: int = 100
    """generations between validations of each run"""
    only: Literal["both", "upstream", "ours"] = "both"
    """run both scripts, or only one of them"""
    revision: str = "HEAD"
    """upstream's revision whose run.py is run"""
    jsonl: str = ""
    """append one JSON line per validation and one summary line per side to this file ('': none)"""
    keep: bool = False
    """keep the temporary folder (logs, upstream's copy and data) and print its path"""


# ------------------------------------------------------------------------------------------------
# Running one side: a child process whose output goes to a log, and whose own peak RSS is read.


@dataclass
class Side:
    name: str  # "upstream" or "ours"
    validation: dict[int, float]  # generation -> validation bits/byte, as printed or logged
    seconds_per_generation: float  # mean over the generations timed
    median_seconds_per_generation: float  # their median: less moved by other load on the machine
    tokens_per_second: float  # tokens evaluated per generation / mean seconds per generation
    peak_rss_gib: float
    peak_device_gib: float | None  # on an accelerator
    wall_seconds: float
    log: Path


class Failed(Exception):
    """A side's run failed or ran out of time: one line saying which, and where its log is."""


def run_logged(
    script: str, flags: list[str], cwd: Path, log: Path, env: dict[str, str], timeout: float
) -> tuple[float, float, float | None]:
    """python SCRIPT FLAGS in `cwd` (through MEASURED), its output to `log`, killed with its
    process group after `timeout` seconds. (Wall seconds, peak RSS in GiB, peak device memory in
    GiB or None): os.wait4 gives this child's own resource use, where RUSAGE_CHILDREN would be the
    maximum over every child so far."""
    command = [sys.executable, "-u", "-c", MEASURED, script, *flags]
    print(f"running (in {cwd}) python {shlex.join([script, *flags])}", flush=True)
    start = time.perf_counter()
    with open(log, "wb") as out:
        child = subprocess.Popen(
            command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        killer = threading.Timer(timeout, os.killpg, (child.pid, signal.SIGKILL))
        if math.isfinite(timeout):
            killer.start()
        try:
            _, status, usage = os.wait4(child.pid, 0)
        finally:
            killer.cancel()
    child.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not wait on it again
    wall = time.perf_counter() - start
    if child.returncode == -signal.SIGKILL and wall >= timeout:
        raise Failed(f"{script} in {cwd} ran past {timeout:.0f} s and was stopped; see {log}")
    if child.returncode:
        raise Failed(f"{script} in {cwd} failed (exit {child.returncode}); see {log}")
    held = re.findall(r"side_by_side: peak device memory (\d+) B", log.read_text(errors="replace"))
    device = int(held[-1]) / 2**30 if held else None
    return wall, usage.ru_maxrss / 2**20, device  # ru_maxrss is in KiB on Linux


def population_and_tokens(flags: list[str]) -> tuple[int, int]:
    """--parallel_generations_per_gpu and --tokens_per_update from the shared flags: both must be
    given, because the two scripts' defaults differ (upstream: 1024 and 100)."""
    values = {}
    for name in ("--parallel_generations_per_gpu", "--tokens_per_update"):
        for i, flag in enumerate(flags):
            if flag == name and i + 1 < len(flags):
                values[name] = int(flags[i + 1])
            elif flag.startswith(name + "="):
                values[name] = int(flag.partition("=")[2])
        if name not in values:
            raise SystemExit(
                f"error: give {name} in --flags, so that both scripts use the same value"
            )
    return values["--parallel_generations_per_gpu"], values["--tokens_per_update"]


def upstream_source(nano_egg: str, revision: str) -> bytes:
    """Upstream's run.py at `revision` of the nano_egg clone; Failed where there is none."""
    shown = subprocess.run(
        ["git", "-C", nano_egg, "show", f"{revision}:run.py"], capture_output=True
    )
    if shown.returncode:
        why = shown.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["git failed"]
        raise Failed(f"--nano_egg {nano_egg} --revision {revision}: no run.py there ({why[0]})")
    return shown.stdout


def upstream_environment(work: Path) -> dict[str, str]:
    """Upstream's environment: offline, no W&B, its compilation cache under `work` (HF_HOME), and
    STAND_INS for its imports that are not installed."""
    missing = [name for name in STAND_INS if importlib.util.find_spec(name) is None]
    env = os.environ | {
        "HF_HOME": str(work / "hf"),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }
    if missing:
        (work / "stand-ins").mkdir(exist_ok=True)
        for name in missing:
            (work / "stand-ins" / f"{name}.py").write_text(STAND_INS[name])
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(work / "stand-ins"), env.get("PYTHONPATH", "")) if p
        )
    return env


def run_upstream(args: Args, work: Path, common: list[str], timeout: float = math.inf) -> Side:
    """Upstream's run.py from a temporary folder, its data as the .npy files it reads."""
    folder = work / "upstream"
    (folder / "cached_files").mkdir(parents=True)
    (folder / "run.py").write_bytes(upstream_source(args.nano_egg, args.revision))
    train, valid = np.fromfile(args.train, np.uint8), np.fromfile(args.valid, np.uint8)
    for split, data in (("train", train), ("valid", valid), ("test", valid)):
        np.save(folder / "cached_files" / f"minipile_{split}.npy", data)
    log = work / "upstream.log"
    wall, rss, device = run_logged(
        "run.py", common, folder, log, upstream_environment(work), timeout
    )

    # tqdm redraws its bar with carriage returns: split on them too
    text = log.read_text(errors="replace").replace("\r", "\n")
    scores = [float(x) for x in re.findall(r"validation score (\S+)", text)]
    # validation k (from 1) follows generation k * validate_every
    validation = {args.validate_every * (k + 1): score for k, score in enumerate(scores)}
    rates = [float(x) for x in re.findall(r"throughput: (\S+)", text)][1:]  # without generation 0
    population, tokens = population_and_tokens(shlex.split(args.flags))
    per_generation = population * tokens  # tokens one generation evaluates (one CPU device)
    seconds = [per_generation / r for r in rates] or [float("nan")]
    mean = statistics.mean(seconds)
    return Side(
        "upstream",
        validation,
        mean,
        statistics.median(seconds),
        per_generation / mean,
        rss,
        device,
        wall,
        log,
    )


def run_ours(args: Args, work: Path, common: list[str], timeout: float = math.inf) -> Side:
    """Our run.py, its runs and caches in the temporary folder (nothing written to the project)."""
    log = work / "ours.log"
    flags = ["--data", args.train, "--valid_data", args.valid, *common, "--save_every", "0"]
    flags += ["--runs_dir", str(work / "runs"), "--run_name", "ours"]
    flags += ["--dir_path", str(work / "cache")]
    wall, rss, device = run_logged(
        str(ROOT / "run.py"), flags, ROOT, log, dict(os.environ), timeout
    )
    lines = [
        json.loads(x) for x in (work / "runs" / "ours" / "metrics.jsonl").read_text().splitlines()
    ]
    validation = {
        x["generation"]: x["val/bits_per_byte"] for x in lines if "val/bits_per_byte" in x
    }
    timed = [x for x in lines if x["generation"] > 1]  # the first generation compiles
    seconds = [x["perf/seconds"] for x in timed]
    # tokens of every timed one
    tokens = sum(x["perf/tokens_per_s"] * x["perf/seconds"] for x in timed)
    mean = statistics.mean(seconds)
    median = statistics.median(seconds)
    return Side("ours", validation, mean, median, tokens / sum(seconds), rss, device, wall, log)


# ------------------------------------------------------------------------------------------------
# Report


def describe(side: Side) -> str:
    curve = "  ".join(f"{g}: {v:.4f}" for g, v in sorted(side.validation.items()))
    device = "" if side.peak_device_gib is None else f"  peak device {side.peak_device_gib:.2f} GiB"
    return (
        f"{side.name:9} {side.tokens_per_second:>10,.0f} tokens/s"
        f"  {side.seconds_per_generation:.4f} s/generation"
        f" (median {side.median_seconds_per_generation:.4f})"
        f"  peak RSS {side.peak_rss_gib:.2f} GiB{device}"
        f"  wall {side.wall_seconds:.0f} s\n"
        f"{'':9} validation bits/byte by generation: {curve}"
    )


def write_jsonl(path: str, side: Side, args: Args) -> None:
    """One line per validation, then one summary line; each names its side, data and flags."""
    tag = {"side": side.name, "train": args.train, "valid": args.valid, "flags": args.flags}
    with open(path, "a") as f:
        for generation, value in sorted(side.validation.items()):
            f.write(json.dumps(tag | {"generation": generation, "val/bits_per_byte": value}) + "\n")
        summary = {
            "perf/seconds_per_generation": side.seconds_per_generation,
            "perf/median_seconds_per_generation": side.median_seconds_per_generation,
            "perf/tokens_per_s": side.tokens_per_second,
            "perf/peak_rss_gib": side.peak_rss_gib,
            "perf/peak_device_gib": side.peak_device_gib,
            "perf/wall_seconds": side.wall_seconds,
        }
        f.write(json.dumps(tag | {"summary": True} | summary) + "\n")


def common_flags(args: Args, validation_batch: int = VALIDATION_BATCH) -> list[str]:
    """The flags both scripts get."""
    common = [
        "--validation_batch_size",
        str(validation_batch),
        "--num_epochs",
        str(args.num_epochs),
    ]
    return common + ["--validate_every", str(args.validate_every), *shlex.split(args.flags)]


def main(args: Args) -> None:
    for path in (args.train, args.valid):
        if not Path(path).is_file():
            raise SystemExit(f"error: {path}: no such file")
    population_and_tokens(shlex.split(args.flags))  # fail now, not after upstream's run
    work = Path(tempfile.mkdtemp(prefix="side-by-side-"))
    runners = {"upstream": run_upstream, "ours": run_ours}
    try:
        if args.only in ("both", "upstream"):
            upstream_source(args.nano_egg, args.revision)
        for name, runner in runners.items():
            if args.only in ("both", name):
                side = runner(args, work, common_flags(args))
                print(describe(side), flush=True)
                if args.jsonl:
                    write_jsonl(args.jsonl, side, args)
    except Failed as failed:  # the folder and its logs are kept
        raise SystemExit(f"error: {failed}") from None
    if args.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
