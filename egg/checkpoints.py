"""Checkpoints. One folder per checkpoint, readable without egg-jax:
  params.npz    the int8 parameters, one array per name (numpy's own format)
  states.npz    the carried hidden states (population, n_layer, n_embd) int8
  optimizer.npz the update rule's int16 state, one array per 'SLOT/NAME' (none for --optimizer ztest)
  meta.json     generation, validation score, format, every flag of the run, and the settings that
                decide its training (compared on resume)
A run of K > 1 replicas stores every array with its leading (K,) axis; a single model, a run of one
or the best replica of several, without it. Folders are written under their temporary name and
renamed into place, and the pointer files LATEST and BEST are replaced by rename too: a kill at any
moment leaves the previous checkpoints intact and never a half-written one under a real name."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NamedTuple

import jax
import numpy as np
import tyro

from egg import UserError
from egg.files import atomic_file, temporary, write_atomic
from egg.flags import flag


@dataclass(frozen=True)
class Flags:
    save_dir: Annotated[
        str, tyro.conf.arg(help_behavior_hint="(default: <runs_dir>/<run_name>/checkpoints)")
    ] = ""
    """folder of this run's checkpoints"""
    save_every: Annotated[int, *flag("[0, inf)")] = 100
    """generations between checkpoints (0: only at the end and when stopped by a signal)"""
    keep_checkpoints: Annotated[int, *flag("[1, inf)")] = 3
    """periodic checkpoints to keep (the best by validation is kept besides)"""
    resume: str = ""
    """continue a run: PATH (a run folder, its checkpoints folder or one checkpoint) with that run's own
    flags, those given here overriding them; or 'auto': the newest checkpoint in --save_dir, with the
    flags given"""
    allow_changes: bool = False
    """with --resume: continue although flags that change training differ from the checkpoint's (logged)"""


CHECKPOINT_FORMAT = 3  # the one format read: meta["training"] records every training setting
LAST_READER_OF_OLDER = "5423dfc"  # the last commit that reads checkpoints of an older format


class UnreadableCheckpoint(UserError):
    """A checkpoint whose files are missing or corrupt."""

    def __init__(self, folder: Path, reason: str):
        super().__init__(f"checkpoint {folder} is unreadable ({reason}): resume from another one")
        self.folder, self.reason = folder, reason


def save_checkpoint(folder: Path, params, opt, states, meta: dict) -> None:
    """Write a checkpoint folder atomically (nothing happens if it already exists)."""
    if folder.exists():
        return
    tmp = temporary(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {"params.npz": params, "states.npz": {"states": states}, "optimizer.npz": opt}
    for name, arrays in files.items():
        if arrays:  # no optimizer.npz for --optimizer ztest
            with atomic_file(tmp / name) as f:
                np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})
    write_atomic(tmp / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    os.replace(tmp, folder)


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint folder without ever leaving part of one under a real name: renamed to
    its temporary name first (which the next start removes, should a kill cut this short)."""
    tmp = temporary(folder)
    os.replace(folder, tmp)
    shutil.rmtree(tmp)


class Expected(NamedTuple):
    """What a run reads from a checkpoint: every array's shape without the replica axis."""

    params: dict  # {name: shape}, int8
    opt: dict  # {'SLOT/NAME': shape} of this run's update rule, int16
    states: tuple  # (population, n_layer, n_embd), int8
    replicas: int
    model: str  # e.g. "256D-6L", for the refusal of another model


def read_arrays(folder: Path):
    """(params, states, opt, meta) of a checkpoint folder as stored."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        with np.load(folder / "params.npz") as f:
            params = {k: f[k] for k in f.files}
        with np.load(folder / "states.npz") as f:
            states = f["states"]
        opt = {}
        if (folder / "optimizer.npz").exists():
            with np.load(folder / "optimizer.npz") as f:
                opt = {k: f[k] for k in f.files}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise UnreadableCheckpoint(folder, type(error).__name__) from None
    return params, states, opt, meta


def load_checkpoint(folder: Path, expected: Expected):
    """(params, states or None, opt or None, meta) of a checkpoint folder, checked against what this
    run expects, every array with the replica axis. States come back as None when the population
    layout differs (they cannot carry over), opt as None when the checkpoint holds no state of this
    run's update rule."""
    params, states, opt, meta = read_arrays(folder)
    stored = (expected.replicas,) if expected.replicas > 1 else ()  # the leading axis of this run's files
    shapes = {k: stored + shape for k, shape in expected.params.items()}
    if {k: v.shape for k, v in params.items()} != shapes or any(v.dtype != np.int8 for v in params.values()):
        flags = meta.get("args", {})
        held, mine = 1 if "replica" in meta else flags.get("replicas", 1), expected.replicas  # best-*: one
        raise UserError(
            f"checkpoint {folder} holds {f'{held} replicas of ' if held > 1 else ''}a "
            f"{flags.get('n_embd')}D-{flags.get('n_layer')}L model; this run is "
            f"{f'{mine} replicas of ' if mine > 1 else ''}{expected.model}: pass the same "
            f"--n_embd and --n_layer{' and --replicas' if held != mine else ''}, or another checkpoint"
        )
    if states.shape != stored + expected.states or states.dtype != np.int8:
        states = None
    want = {k: stored + shape for k, shape in expected.opt.items()}
    opt = {k: v for k, v in opt.items() if k in want}  # e.g. adam's v, resumed as momentum
    if {k: v.shape for k, v in opt.items()} != want or any(v.dtype != np.int16 for v in opt.values()):
        opt = None
    if not stored:  # a single model's file: give it the run's replica axis of 1
        params, states, opt = jax.tree.map(lambda x: x[None], (params, states, opt))
    return params, states, opt, meta


def checkpoint_digest(folder: Path) -> str:
    """SHA-256 (first 16 hex digits) of a checkpoint's parameters, hidden states and update rule
    state, each file's arrays in sorted order: equal digests, bit-identical training."""
    digest = hashlib.sha256()
    for name in ("params.npz", "states.npz", "optimizer.npz"):
        if (folder / name).exists():
            with np.load(folder / name) as f:
                for key in sorted(f.files):
                    digest.update(f[key].tobytes())
    return digest.hexdigest()[:16]


def checkpoints_in(save_dir: Path) -> list[Path]:
    """Periodic checkpoint folders, oldest first."""
    return sorted(p for p in save_dir.glob("gen-*") if p.is_dir())


class Checkpointer:
    """Saves every --save_every generations, keeps the last `keep` plus the best by validation
    bits/byte, and points LATEST and BEST at them. Only the writer (process 0) touches the disk;
    every process takes part in copying the arrays to the host. `flags`: the run's, recorded in
    every meta.json; `training`: what decides its training, compared on resume."""

    def __init__(self, save_dir: Path, flags: dict, keep: int, training: dict | None = None, writer=True):
        self.dir, self.flags, self.keep, self.writer = save_dir, flags, keep, writer
        self.training = training
        self.best = math.inf

    def write(
        self, name: str, arrays: tuple, generation: int, val_bpb: float, extra: dict, pointer: str
    ) -> Path:
        """Save (params, opt, states) as the folder `name` and point `pointer` (LATEST, BEST) at it."""
        folder = self.dir / name
        if self.writer:
            meta = {
                "format": CHECKPOINT_FORMAT,
                "generation": generation,
                "val_bits_per_byte": val_bpb,
                "best_val_bits_per_byte": self.best,
                "args": self.flags,
                "training": self.training,
                **extra,
            }
            save_checkpoint(folder, *arrays, meta)
            write_atomic(self.dir / pointer, name.encode())
        return folder

    def save(self, generation: int, arrays: tuple, val_bpb: float, extra: dict) -> Path:
        """A periodic checkpoint of every replica (arrays with the replica axis; one model's alone
        is stored without it), the oldest beyond `keep` removed."""
        if self.flags.get("replicas", 1) == 1:
            arrays = jax.tree.map(lambda x: x[0], arrays)
        folder = self.write(f"gen-{generation:08d}", arrays, generation, val_bpb, extra, "LATEST")
        if self.writer:
            for old in checkpoints_in(self.dir)[: -self.keep]:
                remove_checkpoint(old)
        return folder

    def offer_best(self, generation: int, model: tuple, val_bpb: float, extra: dict) -> None:
        """Keep one model (params, opt, states without the replica axis) if its validation score
        is the best so far: the best replica's, as a single run's checkpoint, `extra` saying which."""
        if not val_bpb < self.best:
            return
        self.best = val_bpb
        folder = self.write(
            f"best-{val_bpb:.4f}-gen-{generation:08d}", model, generation, val_bpb, extra, "BEST"
        )
        if self.writer:
            for old in self.dir.glob("best-*"):
                if old != folder and old.is_dir():
                    remove_checkpoint(old)
