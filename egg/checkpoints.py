"""Checkpoints. One folder per checkpoint, readable without egg-jax:
  params.npz    the int8 parameters, one array per name (numpy's own format)
  states.npz    the states the members carry (population, ...) int8: EGG's (population, n_layer,
                n_embd), a model's without one (population, 0)
  optimizer.npz the update rule's state, one array per 'SLOT/NAME' (momentum: int16 m; none for
                a rule that keeps no state, ztest)
  meta.json     generation, validation score, format, the model ("egg 8D-2L") and its replicas,
                every flag of the run, and the settings that decide its training (compared on
                resume); of several replicas, their settings ("replica_settings", each a dict),
                last validations ("replica_val_bits_per_byte") and the best ("best_replica"); of
                the best replica of several, which ("replica") and its settings
                ("replica_setting")
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
from egg.files import NoRoom, atomic_file, out_of_room, temporary, write_atomic
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
    resume: Annotated[str, *flag(carried=False)] = ""
    """continue a run: PATH (a run folder, its checkpoints folder or one checkpoint) with that run's
    own flags, those given here overriding them; or 'auto': the newest checkpoint in --save_dir,
    with the flags given"""
    allow_changes: Annotated[bool, *flag(carried=False)] = False
    """with --resume: continue although training flags differ from the checkpoint's (logged)"""
    init_from: Annotated[str, *flag(carried=False)] = ""
    """start a new run from another run's model: RUN (a run folder, its checkpoints folder or one
    checkpoint) its newest checkpoint, RUN:best its best; the model's settings come from it, the
    update rule's state and the members' states start afresh"""


CHECKPOINT_FORMAT = 3  # the one format read: meta["training"] records every training setting
LAST_READER_OF_OLDER = "5423dfc"  # the last commit that reads checkpoints of an older format


class UnreadableCheckpoint(UserError):
    """A checkpoint whose files are missing or corrupt."""

    def __init__(self, folder: Path, reason: str):
        super().__init__(f"checkpoint {folder} is unreadable ({reason}): resume from another one")
        self.folder, self.reason = folder, reason


def save_checkpoint(folder: Path, params, rule_state, states, meta: dict) -> None:
    """Write a checkpoint folder atomically (nothing happens if it already exists). Where the
    device has no room for it (files.NoRoom), what was written of it is removed."""
    if folder.exists():
        return
    tmp = temporary(folder)
    files = {"params.npz": params, "states.npz": {"states": states}, "optimizer.npz": rule_state}
    text = (json.dumps(meta, indent=1) + "\n").encode()
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, arrays in files.items():
            if arrays:  # no optimizer.npz for a rule that keeps no state
                with atomic_file(tmp / name) as f:
                    np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})
        write_atomic(tmp / "meta.json", text)
        os.replace(tmp, folder)
    except OSError as error:
        if not out_of_room(error):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        arrays = [np.asarray(v) for group in files.values() for v in (group or {}).values()]
        raise NoRoom(
            f"checkpoint {folder}", sum(a.nbytes for a in arrays) + len(text), error
        ) from None


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint folder without ever leaving part of one under a real name: renamed to
    its temporary name first (which the next start removes, should a kill cut this short)."""
    tmp = temporary(folder)
    os.replace(folder, tmp)
    shutil.rmtree(tmp)


class Expected(NamedTuple):
    """What a run reads from a checkpoint: every array's (shape without the replica axis, dtype)."""

    params: dict  # {name: (shape, dtype)}
    rule_state: dict  # {'SLOT/NAME': (shape, dtype)} of this run's update rule
    states: tuple  # ((population, ...), dtype)
    replicas: int
    model: str  # e.g. "egg 256D-6L", for the refusal of another model


def expected(params: dict, slots: dict, states: tuple, replicas: int, model: str) -> Expected:
    """The Expected of a run: its int8 parameters {name: shape}, its update rule's slots {slot:
    dtype} (each parameter's shape, stored as 'SLOT/NAME'), each member's int8 state's shape with
    the population first, its replicas and its model's name."""
    rule_state = {
        f"{slot}/{name}": (shape, np.dtype(dtype))
        for slot, dtype in slots.items()
        for name, shape in params.items()
    }
    int8 = {name: (shape, np.dtype(np.int8)) for name, shape in params.items()}
    return Expected(int8, rule_state, (states, np.dtype(np.int8)), replicas, model)


class Loaded(NamedTuple):
    """A checkpoint's arrays, each with the replica axis, and its meta.json."""

    params: dict
    states: np.ndarray | None  # None: another population layout, the states restart
    rule_state: dict | None  # None: no state of this run's update rule, it starts afresh
    meta: dict


def read_arrays(folder: Path):
    """(params, states, rule_state, meta) of a checkpoint folder as stored."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        with np.load(folder / "params.npz") as f:
            params = {k: f[k] for k in f.files}
        with np.load(folder / "states.npz") as f:
            states = f["states"]
        rule_state = {}
        if (folder / "optimizer.npz").exists():
            with np.load(folder / "optimizer.npz") as f:
                rule_state = {k: f[k] for k in f.files}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise UnreadableCheckpoint(folder, type(error).__name__) from None
    return params, states, rule_state, meta


def matches(arrays: dict, expected: dict, stored: tuple) -> bool:
    """Whether arrays have the expected names, shapes (after the `stored` axes) and dtypes."""
    found = {k: (v.shape, v.dtype) for k, v in arrays.items()}
    return found == {k: (stored + shape, np.dtype(dtype)) for k, (shape, dtype) in expected.items()}


def load_checkpoint(folder: Path, expected: Expected) -> Loaded:
    """A checkpoint folder's arrays, checked against what this run expects, every array with the
    replica axis. States come back as None when the population layout differs (they cannot carry
    over), the rule state as None when the checkpoint holds none of this run's update rule."""
    params, states, rule_state, meta = read_arrays(folder)
    # the leading axis of this run's files
    stored = (expected.replicas,) if expected.replicas > 1 else ()
    if not matches(params, expected.params, stored):
        held, mine = meta.get("replicas"), expected.replicas
        model = f"a {meta['model']} model" if "model" in meta else "a model of another shape"
        holds = f"{held} replicas of {model}" if held and held > 1 else model
        runs = f"{mine} replicas of {expected.model}" if mine > 1 else expected.model
        also = " and --replicas" if held != mine else ""
        raise UserError(
            f"checkpoint {folder} holds {holds}; this run is {runs}: pass the same --model, "
            f"--n_embd and --n_layer{also}, or another checkpoint"
        )
    if not matches({"states": states}, {"states": expected.states}, stored):
        states = None
    # what this rule keeps
    rule_state = {k: v for k, v in rule_state.items() if k in expected.rule_state}
    if not matches(rule_state, expected.rule_state, stored):
        rule_state = None
    if not stored:  # a single model's file: give it the run's replica axis of 1
        params, states, rule_state = jax.tree.map(lambda x: x[None], (params, states, rule_state))
    return Loaded(params, states, rule_state, meta)


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
    every meta.json; `training`: what decides its training, compared on resume; `model`: its name
    ("8D-2L"); `replicas`: how many it trains."""

    def __init__(
        self,
        save_dir: Path,
        flags: dict,
        keep: int,
        training: dict | None = None,
        writer: bool = True,
        model: str = "",
        replicas: int = 1,
        metric: str = "bits_per_byte",
        higher: bool = False,
    ):
        self.dir, self.flags, self.keep, self.writer = save_dir, flags, keep, writer
        self.training, self.model, self.replicas = training, model, replicas
        self.metric, self.higher = metric, higher  # what validation gives, and its better way
        self.best = -math.inf if higher else math.inf

    def improves(self, value: float) -> bool:
        """Whether a validation's value beats the best so far."""
        return value > self.best if self.higher else value < self.best

    def write(
        self, name: str, arrays: tuple, generation: int, value: float, extra: dict, pointer: str
    ) -> Path:
        """Save (params, rule_state, states) as folder `name`, and name it in `pointer`."""
        folder = self.dir / name
        if self.writer:
            meta = {
                "format": CHECKPOINT_FORMAT,
                "generation": generation,
                f"val_{self.metric}": value,
                f"best_val_{self.metric}": self.best,
                "model": self.model,
                "replicas": self.replicas if pointer == "LATEST" else 1,
                "args": self.flags,
                "training": self.training,
                **extra,
            }
            save_checkpoint(folder, *arrays, meta)
            try:
                write_atomic(self.dir / pointer, name.encode())
            except OSError as error:
                if not out_of_room(error):
                    raise
                raise NoRoom(
                    f"the pointer {self.dir / pointer} to {name}", len(name), error
                ) from None
        return folder

    def save(self, generation: int, arrays: tuple, value: float, extra: dict) -> Path:
        """A periodic checkpoint of every replica (arrays with the replica axis; one model's alone
        is stored without it), the oldest beyond `keep` removed."""
        if self.replicas == 1:
            arrays = jax.tree.map(lambda x: x[0], arrays)
        folder = self.write(f"gen-{generation:08d}", arrays, generation, value, extra, "LATEST")
        if self.writer:
            for old in checkpoints_in(self.dir)[: -self.keep]:
                remove_checkpoint(old)
        return folder

    def offer_best(self, generation: int, model: tuple, value: float, extra: dict) -> None:
        """Keep one model (params, rule_state, states without the replica axis) if its validation
        score is the best so far: the best replica's, as a single run's checkpoint, `extra` saying
        which."""
        if not self.improves(value):
            return
        self.best = value
        folder = self.write(
            f"best-{value:.4f}-gen-{generation:08d}", model, generation, value, extra, "BEST"
        )
        if self.writer:
            for old in self.dir.glob("best-*"):
                if old != folder and old.is_dir():
                    remove_checkpoint(old)
