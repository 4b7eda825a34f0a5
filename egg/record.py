"""Where a run's metrics go: always one JSON line per logged generation in
<run folder>/metrics.jsonl (beside config.json, the run's flags); with --track also Weights &
Biases. And the metric names of a run of several replicas."""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NamedTuple

import numpy as np
import tyro

from egg.checkpoints import checkpoints_in
from egg.files import NoRoom, out_of_room, size_text, write_atomic


@dataclass(frozen=True)
class Flags:
    track: bool = False
    """log this run to Weights & Biases"""
    wandb_project: str = "egg-jax"
    """W&B project"""
    wandb_entity: Annotated[
        str | None, tyro.conf.arg(metavar="NAME", help_behavior_hint="(default: yours)")
    ] = None
    """W&B entity (team or user)"""
    tag: str = ""
    """a tag for the W&B run, also appended to the run name"""
    runs_dir: str = "runs"
    """folder holding one output folder per run (metrics.jsonl, config.json)"""
    run_name: Annotated[
        str, tyro.conf.arg(help_behavior_hint="(default: built from the configuration)")
    ] = ""
    """name of the run and of its output folder"""


class Folders(NamedTuple):
    """Where a run writes: its record (metrics.jsonl, config.json) and its checkpoints."""

    run: Path  # <runs_dir>/<run_name>
    checkpoints: Path  # --save_dir, by default <run>/checkpoints

    def resume_target(self) -> Path:
        """What --resume names to continue the run: its run folder, or its --save_dir if
        elsewhere."""
        return self.run if self.checkpoints == self.run / "checkpoints" else self.checkpoints


def folders(runs_dir: str, run_name: str, save_dir: str) -> Folders:
    """A run's Folders: <runs_dir>/<run_name>, and --save_dir or by default its checkpoints
    folder."""
    run = Path(runs_dir) / run_name
    return Folders(run, Path(save_dir or run / "checkpoints"))


def logged_before(line: str, generation: int) -> bool:
    """Whether a metrics.jsonl line is a whole record of a generation <= `generation` (a kill
    while writing can leave a last line cut short)."""
    try:
        return line.endswith("\n") and json.loads(line)["generation"] <= generation
    except (ValueError, KeyError):
        return False


WANDB_ROOM = 2**20  # bytes free below which W&B's own record of a run may have been cut short


class RunRecord:
    """A run's record in `folder` (its name the W&B run's), from `generation` on (a resumed run
    drops what was logged after its checkpoint). Only the writer (process 0) records; the other
    processes' record is a no-op. `flags`: with --track, the W&B run's project, entity and tag."""

    def __init__(
        self, folder: Path, config: dict, summary: dict, generation: int, writer=True, flags=None
    ):
        self.lines, self.wandb, self.samples = None, None, []
        if not writer:
            return
        path, text = folder / "metrics.jsonl", (json.dumps(config, indent=1) + "\n").encode()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(folder / "config.json", text)
            if path.exists() and generation:  # resumed: drop what was logged after the checkpoint
                lines = path.read_text().splitlines(True)
                text = "".join(x for x in lines if logged_before(x, generation)).encode()
                write_atomic(path, text)
            elif path.exists():  # a new run under an old name: keep the old record aside
                path.rename(path.with_name(f"metrics-{int(path.stat().st_mtime)}.jsonl"))
            self.lines = open(path, "ab", buffering=0)  # each line written whole, or not at all
        except OSError as error:
            if not out_of_room(error):
                raise
            raise NoRoom(f"the run's record in {folder}", len(text), error) from None
        self.path = path
        if flags is not None and flags.track:
            with tolerated(
                "starting Weights & Biases", print, "the run records to metrics.jsonl alone"
            ):
                import wandb

                tags = [flags.tag] if flags.tag else None
                project, entity = flags.wandb_project, flags.wandb_entity
                self.wandb = wandb.init(
                    project=project, entity=entity, name=folder.name, config=config, tags=tags
                )
                self.wandb.summary.update(summary)

    def log(self, metrics: dict, generation: int) -> None:
        """A generation's metrics, to metrics.jsonl and W&B. A line the file has no room for is
        NoRoom, what was written of it taken back; should W&B fail, it is dropped (the error raised
        once, for the caller to say) and the file goes on."""
        if self.lines is None:
            return
        line = (json.dumps({"generation": generation, **metrics}) + "\n").encode()
        start = self.lines.seek(0, os.SEEK_END)
        try:
            written = 0
            while written < len(line):  # a write may take part of it
                written += self.lines.write(line[written:])
        except OSError as error:
            if not out_of_room(error):
                raise
            self.lines.truncate(start)
            what = f"generation {generation}'s line of {self.path}"
            raise NoRoom(what, len(line), error) from None
        if self.wandb is not None:
            try:
                self.log_wandb(metrics, generation)
            except Exception:
                self.wandb = None
                raise

    def log_wandb(self, metrics: dict, generation: int) -> None:
        if self.wandb is not None:
            if "samples/text" in metrics:  # every sample so far, as one table
                import wandb

                self.samples.append([generation, metrics["samples/text"]])
                metrics = {
                    **metrics,
                    "samples/text": wandb.Table(["generation", "text"], self.samples),
                }
            # PBT's lineage (a list of records) as its JSON text: W&B would read a list as a
            # histogram
            metrics = {k: json.dumps(v) if isinstance(v, list) else v for k, v in metrics.items()}
            self.wandb.log(metrics, step=generation)

    def close(self) -> None:
        """Close the file and W&B's run; say in a warning where W&B could not keep its record."""
        if self.lines is not None:
            self.lines.close()
        if self.wandb is not None:
            sync = Path(self.wandb.settings.sync_file)
            self.wandb.finish()
            free = shutil.disk_usage(sync.parent).free if sync.parent.exists() else 0
            if not sync.is_file() or sync.stat().st_size == 0 or free < WANDB_ROOM:
                print(
                    f"warning: Weights & Biases may not have kept its record of this run in "
                    f"{sync.parent} ({size_text(free)} free there); the run's record is "
                    f"{self.path}"
                )


def train_metrics(
    fitness: np.ndarray, moved: np.ndarray, alpha: float | None, value, size: int, metric: str
) -> dict:
    """A replica's train/ metrics of a generation: the mean, best (most fitness) and worst of its
    members' fitness in the objective's metric (`value` turns one into it: bits/byte, reward), its
    update's moved counts (of `size` parameters) and its alpha (None: its update rule reads
    none)."""
    metrics = {
        f"train/{metric}": value(fitness.mean()),
        f"train/best_{metric}": value(fitness.max()),
        f"train/worst_{metric}": value(fitness.min()),
        "train/moved_fraction": int(np.sum(moved, dtype=np.int64)) / size,
    }
    return metrics if alpha is None else metrics | {"train/alpha": alpha}


def replica_metrics(
    per_replica: list[dict],
    settings: list[dict],
    metric: str = "bits_per_byte",
    higher: bool = False,
    summary: bool = True,
) -> dict:
    """A single run's metrics as they are; with replicas, each replica's as replica/K/NAME with its
    settings (a series of its own in W&B; `settings`: each replica's, by name, its seed left out),
    and with `summary` the best replica's value of each metric named ...`metric` (the highest where
    `higher`, else the lowest) under the plain names (what sweeps and the progress bar read)."""
    if len(per_replica) == 1:
        return per_replica[0]
    out = {}
    for k, (values, setting) in enumerate(zip(per_replica, settings, strict=True)):
        out.update({f"replica/{k}/{name}": v for name, v in values.items()})
        out.update({f"replica/{k}/{name}": v for name, v in setting.items() if name != "seed"})
    if summary:
        best = max if higher else min
        names = [name for name in per_replica[0] if name.endswith(metric)]
        out.update({name: best(x[name] for x in per_replica) for name in names})
    return out


def describe_spread(scores: list[float], higher: bool = False) -> str:
    """' (best of K replicas, median M, worst W)', or nothing for a single run."""
    if len(scores) == 1:
        return ""
    worst = min(scores) if higher else max(scores)
    return (
        f" (best of {len(scores)} replicas, median {statistics.median(scores):.3f}, "
        f"worst {worst:.3f})"
    )


def describe_end(
    scores: list[float],
    leader: int,
    setting: str,
    epochs: int,
    metric: str = "bits_per_byte",
    higher: bool = False,
) -> str:
    """A finished run's validation: the best replica's (`setting`: its settings, with replicas)."""
    which = (
        f" (replica {leader} of {len(scores)}, {setting}){describe_spread(scores, higher)}"
        if setting
        else ""
    )
    name = metric.replace("_per_", "/")  # bits/byte
    return f"validation {name} {scores[leader]:.4f} after {epochs} generations{which}"


def describe_validation(scores: list[float], leader: int) -> str:
    """The best replica's last validation, and with replicas which one and their median."""
    text = f"{scores[leader]:.3f}"
    return text + (
        f" (replica {leader}, median {statistics.median(scores):.3f})" if len(scores) > 1 else ""
    )


class Console:
    """What a run shows and keeps of its generations: lines above a progress bar (process 0 alone
    shows them), and for each generation a record line, a step of the bar (train and validation
    bits/byte, tokens/s) and its seconds: from its dispatch, or the reading of the generation before
    it if later, to the reading of its numbers (the first, which warms up, is not timed)."""

    def __init__(
        self, total: int, start: int, writer: bool, started: float, metric: str = "bits_per_byte"
    ):
        from tqdm import tqdm

        self.log = tqdm.write if writer else (lambda *a, **k: None)  # above the bar, not inside it
        self.bar = None  # shown from the first generation on
        self.new_bar = lambda: tqdm(
            total=total, initial=start, dynamic_ncols=True, disable=not writer
        )
        self.start, self.started, self.read, self.timed = start, started, started, []
        self.record = None  # the RunRecord, once opened
        self.metric = metric  # the train/ metric the bar shows

    def lap(self, generation: int, dispatched: float) -> float:
        """The seconds of a generation whose numbers were read just now."""
        now, before = time.time(), self.read
        seconds, self.read = now - max(before, dispatched), now
        if generation == self.start:
            self.log(f"first generation done {now - self.started:.1f} s after start")
        else:
            self.timed.append(seconds)
        return seconds

    def show(self, metrics: dict, done: int, scores: list[float], leader: int) -> None:
        with tolerated(f"recording generation {done}", self.log):
            self.record.log(metrics, done)
        self.bar = self.bar or self.new_bar()
        self.bar.update(1)
        shown = {"train": f"{metrics[f'train/{self.metric}']:.3f}"}
        if not math.isnan(scores[leader]):  # validated at least once
            shown["val"] = describe_validation(scores, leader)
        self.bar.set_postfix(**shown, tok_s=f"{metrics['perf/tokens_per_s']:,.0f}")

    @contextmanager
    def ends_with_the_bar(self):
        """Within: an error closes the progress bar first, so that the line saying why stands
        alone."""
        try:
            yield
        except BaseException:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            raise

    def close(self, tokens: int, what: str = "tokens") -> None:
        """The mean throughput of the timed generations of `tokens` tokens (or `what`) each; the bar
        and record closed."""
        if self.bar is not None:
            self.bar.close()
        if self.record is not None:
            with tolerated("closing the record", self.log):
                self.record.close()
        if self.timed:
            rate = tokens * len(self.timed) / sum(self.timed)
            self.log(
                f"mean training throughput {rate:,.0f} {what}/s (first generation, which compiles, "
                "excluded)"
            )


@contextmanager
def tolerated(what: str, log, after: str = "training goes on"):
    """An aside of the run (a sample, diagnostics, the record, W&B): an error in it is said in one
    line, `after` saying what follows, and the run goes on to train and save as it would have."""
    try:
        yield
    except NoRoom:  # a write the run needs: not an aside
        raise
    except Exception as error:  # whatever it is: an aside never ends a run unsaved
        log(f"warning: {what} failed ({type(error).__name__}: {error}); {after}")


def after_a_failed_write(folders: Folders, remedy: str = "make room") -> str:
    """What a run stopped by a failed write (or another fault the user mends: `remedy`) has left
    and how to go on: its newest checkpoint and the command that continues from it."""
    saved = checkpoints_in(folders.checkpoints)
    if not saved:
        return f"nothing was saved: {remedy}, then run the same command again"
    resume = shlex.quote(str(folders.resume_target()))
    return (
        f"the last whole checkpoint is {saved[-1]}: {remedy}, then continue with: python run.py "
        f"--resume {resume}"
    )


def where_it_went(folders: Folders, epochs: int, stopped: bool) -> str:
    """A run's last line: its folder, its newest checkpoint and the commands that sample from it and
    continue it (a finished run of `epochs` generations: to twice as many)."""
    saved = checkpoints_in(folders.checkpoints)
    if not saved:
        return f"the run's record: {folders.run} (no checkpoint)"
    more = "" if stopped else f" --num_epochs {2 * epochs}"
    resume = shlex.quote(str(folders.resume_target()))
    return (
        f"the run's record: {folders.run}; its newest checkpoint: {saved[-1]}; sample: python "
        f"run.py --sample --resume {resume}; continue: python run.py --resume {resume}{more}"
    )
