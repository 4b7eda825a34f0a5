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

Upstream's numbers are reported as it prints them. Its validation metric reads about 0.03 bits/byte
lower than exact (its integer log-softmax truncates). It prints a generation's throughput every 10th
generation only (0, 10, 20, ...; validation excluded): its s/generation is the mean over those,
without generation 0. Ours come from its metrics.jsonl (every generation but the first, which
compiles). The median s/generation is printed too: on a shared machine it moves less than the mean.
Peak RSS is each run's own (os.wait4), not the machine's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import tyro
from tyro.conf import Positional, arg

ROOT = Path(__file__).resolve().parent.parent  # the repository root, where our run.py is

VALIDATION_BATCH = 64  # both scripts validate on this many parallel streams


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
    wall_seconds: float
    log: Path


def run_logged(
    command: list[str], cwd: Path, log: Path, env: dict[str, str]
) -> tuple[float, float]:
    """Run `command`, its output to `log`. (Wall seconds, peak RSS in GiB): os.wait4 gives this
    child's own resource use, where RUSAGE_CHILDREN would be the maximum over every child so far."""
    print(f"running (in {cwd}) {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    with open(log, "wb") as out:
        child = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not wait on it again
    wall = time.perf_counter() - start
    if child.returncode:
        raise SystemExit(
            f"error: {command[1]} in {cwd} failed (exit {child.returncode}); see {log}"
        )
    return wall, usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


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


def upstream_source(args: Args) -> bytes:
    """Upstream's run.py at --revision of the --nano_egg clone, or one line and exit."""
    shown = subprocess.run(
        ["git", "-C", args.nano_egg, "show", f"{args.revision}:run.py"], capture_output=True
    )
    if shown.returncode:
        why = shown.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["git failed"]
        raise SystemExit(
            f"error: --nano_egg {args.nano_egg} --revision {args.revision}: no run.py there "
            f"({why[0]})"
        )
    return shown.stdout


def run_upstream(args: Args, work: Path, common: list[str]) -> Side:
    """Upstream's run.py from a temporary folder, its data as the .npy files it reads."""
    folder = work / "upstream"
    (folder / "cached_files").mkdir(parents=True)
    (folder / "run.py").write_bytes(upstream_source(args))
    train, valid = np.fromfile(args.train, np.uint8), np.fromfile(args.valid, np.uint8)
    for split, data in (("train", train), ("valid", valid), ("test", valid)):
        np.save(folder / "cached_files" / f"minipile_{split}.npy", data)
    # HF_HOME: upstream keeps its compilation cache under it; offline and no W&B, whatever is set
    env = os.environ | {
        "HF_HOME": str(work / "hf"),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }
    log = work / "upstream.log"
    wall, rss = run_logged([sys.executable, "-u", "run.py", *common], folder, log, env)

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
        wall,
        log,
    )


def run_ours(args: Args, work: Path, common: list[str]) -> Side:
    """Our run.py, its runs and caches in the temporary folder (nothing written to the project)."""
    log = work / "ours.log"
    command = [
        sys.executable,
        "-u",
        str(ROOT / "run.py"),
        "--data",
        args.train,
        "--valid_data",
        args.valid,
    ]
    command += [
        *common,
        "--save_every",
        "0",
        "--runs_dir",
        str(work / "runs"),
        "--run_name",
        "ours",
    ]
    command += ["--dir_path", str(work / "cache")]
    wall, rss = run_logged(command, ROOT, log, dict(os.environ))
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
    return Side(
        "ours", validation, mean, statistics.median(seconds), tokens / sum(seconds), rss, wall, log
    )


# ------------------------------------------------------------------------------------------------
# Report


def describe(side: Side) -> str:
    curve = "  ".join(f"{g}: {v:.4f}" for g, v in sorted(side.validation.items()))
    return (
        f"{side.name:9} {side.tokens_per_second:>10,.0f} tokens/s"
        f"  {side.seconds_per_generation:.4f} s/generation"
        f" (median {side.median_seconds_per_generation:.4f})"
        f"  peak RSS {side.peak_rss_gib:.2f} GiB"
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
            "perf/wall_seconds": side.wall_seconds,
        }
        f.write(json.dumps(tag | {"summary": True} | summary) + "\n")


def main(args: Args) -> None:
    for path in (args.train, args.valid):
        if not Path(path).is_file():
            raise SystemExit(f"error: {path}: no such file")
    population_and_tokens(shlex.split(args.flags))  # fail now, not after upstream's run
    if args.only in ("both", "upstream"):
        upstream_source(args)
    common = [
        "--validation_batch_size",
        str(VALIDATION_BATCH),
        "--num_epochs",
        str(args.num_epochs),
    ]
    common += ["--validate_every", str(args.validate_every), *shlex.split(args.flags)]
    work = Path(tempfile.mkdtemp(prefix="side-by-side-"))
    runners = {"upstream": run_upstream, "ours": run_ours}
    for name, runner in runners.items():
        if args.only in ("both", name):
            side = runner(args, work, common)  # a failure exits, keeping the folder and its logs
            print(describe(side), flush=True)
            if args.jsonl:
                write_jsonl(args.jsonl, side, args)
    if args.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
