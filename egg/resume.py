"""Continuing a run: which checkpoint (--resume PATH: a run folder, its checkpoints folder or one
checkpoint; --resume auto: the newest complete one in --save_dir, an unreadable one set aside), with
which flags (--resume PATH: the run's own, those given overriding them), and whether the flags that
decide training match the checkpoint's (its training identity), before anything is loaded onto a
device; and the checkpoint --sample reads. Checkpoints themselves: egg/checkpoints.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from egg import UserError
from egg.checkpoints import (
    CHECKPOINT_FORMAT,
    LAST_READER_OF_OLDER,
    Expected,
    UnreadableCheckpoint,
    checkpoints_in,
    load_checkpoint,
)
from egg.files import write_atomic
from egg.flags import facts_of, value


def data_fingerprint(data: np.ndarray, samples: int = 64, size: int = 4096) -> str:
    """Identity of the training bytes, cheap on any size: their length and the SHA-256 of
    `samples` pieces of `size` bytes at evenly spaced places (the whole of a small corpus)."""
    starts = np.linspace(0, max(len(data) - size, 0), samples).astype(np.int64)
    digest = hashlib.sha256(np.int64(len(data)).tobytes())
    for start in starts:
        digest.update(np.asarray(data[start : start + size]).tobytes())
    return f"{len(data):,} bytes #{digest.hexdigest()[:12]}"


def training_identity(args, population: int, max_step: int, data: np.ndarray) -> dict:
    """Everything besides the generation counter that decides how a run trains: the flags whose
    Facts say so (max_step as resolved), the total population (members per device x devices: the
    device count alone changes nothing) and the training bytes. --num_epochs is not one: the alpha
    schedule, the noise and the data position depend on the generation counter only, so a run may
    be extended."""
    identity = {name: value(args, name) for name, facts in facts_of(type(args)).items() if facts.training}
    identity = {k: list(v) if isinstance(v, tuple) else v for k, v in identity.items()}  # as JSON has them
    return {**identity, "max_step": max_step, "population": population, "data": data_fingerprint(data)}


def find_checkpoints(resume: str, save_dir: Path) -> list[Path]:
    """Checkpoints to try, best first: --resume PATH (a run folder, a save_dir: its newest; or one
    checkpoint) or auto (the newest in save_dir, then older ones should it be unreadable). Newest
    means the highest generation, not LATEST: a kill between a checkpoint's rename and LATEST's
    leaves LATEST one save behind, and that complete checkpoint must not be skipped."""
    if resume == "auto":
        return checkpoints_in(save_dir)[::-1]
    path, give = Path(resume).expanduser(), "give a run folder, its checkpoints folder or one checkpoint"
    if not path.exists():
        raise UserError(f"--resume {resume}: no such path; {give}")
    if not path.is_dir():
        raise UserError(f"--resume {resume}: a file, not a checkpoint; {give}")
    for folder in (path / "checkpoints", path):
        if checkpoints_in(folder):
            return [checkpoints_in(folder)[-1]]
    if not (path / "meta.json").exists():
        raise UserError(f"--resume {resume}: no checkpoint there; {give}")
    return [path]


# what a run continued by --resume PATH takes from its own command line alone, not from the run's
# flags: what to do now, and where and on how many processes it runs
NOT_CARRIED = (
    "resume",
    "allow_changes",
    "sample",
    "platform",
    "coord_addr",
    "num_procs",
    "proc_id",
    "cpu_devices",
)


def run_flags(resume: str) -> dict:
    """The flags --resume PATH continues with: its checkpoint's (meta.json's record of the run's
    flags), but NOT_CARRIED, writing where the checkpoint lies: in its folder of checkpoints and,
    where that is <runs_dir>/<run_name>/checkpoints, in that run folder. {} for no PATH ('', auto)
    or an unreadable checkpoint (loading it says why)."""
    if resume in ("", "auto"):
        return {}
    folder = find_checkpoints(resume, Path())[0]
    try:
        flags = json.loads((folder / "meta.json").read_text())["args"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    where = {"save_dir": str(folder.parent)}
    if folder.parent.name == "checkpoints":  # <runs_dir>/<run_name>/checkpoints: that run folder
        run_folder = folder.parent.parent
        where = {"runs_dir": str(run_folder.parent), "run_name": run_folder.name, "save_dir": ""}
    return {k: v for k, v in flags.items() if k not in NOT_CARRIED} | where


def set_aside(folder: Path) -> Path | None:
    """Rename an unreadable checkpoint folder to corrupt-NAME (corrupt-NAME-2, ... if taken): kept
    for inspection, never deleted, and out of the way of the save that will reuse its name.
    None if there is no such folder or it cannot be renamed."""
    for k in range(1, 1000):
        target = folder.with_name(f"corrupt-{folder.name}" + (f"-{k}" if k > 1 else ""))
        if not target.exists():
            break
    try:
        folder.rename(target)
    except OSError:
        return None
    return target


def check_format(meta: dict, folder: Path, identity: dict) -> None:
    """Refuse a checkpoint of another format than CHECKPOINT_FORMAT, or one that does not record a
    setting this run's training depends on (it predates the flag), naming the commit that reads it."""
    found = meta.get("format", 1)
    missing = sorted(set(identity) - set(meta.get("training") or {}))
    if found == CHECKPOINT_FORMAT and not missing:
        return
    if found > CHECKPOINT_FORMAT:
        raise UserError(f"--resume: {folder} is of format {found}, newer than this egg-jax's: update it")
    lacks = f", which records no {', '.join('--' + k for k in missing[:3])}" if missing else ""
    raise UserError(
        f"--resume: {folder} was written by an older egg-jax (format {found}{lacks}); continue it with "
        f"the code of commit {LAST_READER_OF_OLDER}, the last that reads it, or start a new run"
    )


class Sampled(NamedTuple):
    """What --sample reads: a checkpoint, its model's flags, and which of its replicas."""

    folder: Path
    shape: dict  # the model's flags: n_embd, n_layer, mlp_relu
    replicas: int  # the replicas it holds
    chosen: int  # the one sampled
    setting: dict | None  # its settings, where it holds several


def sampled(resume: str, save_dir: Path, which: int) -> Sampled:
    """The checkpoint --sample --resume reads and the replica of it `which` names (-1: the best by
    its last validation), refused in one line where there is none."""
    if not resume:
        raise UserError(
            "--sample needs --resume PATH: a run folder, its checkpoints folder or one checkpoint"
        )
    found = find_checkpoints(resume, save_dir)
    if not found:
        raise UserError(f"--sample --resume {resume}: no checkpoint in {save_dir}")
    try:
        meta = json.loads((found[0] / "meta.json").read_text())
        flags = meta["args"]
    except (OSError, ValueError, KeyError):
        raise UnreadableCheckpoint(found[0], "no meta.json with the run's flags") from None
    shape = ("n_embd", "n_layer", "mlp_relu")
    check_format(meta, found[0], dict.fromkeys(shape))
    replicas = 1 if "replica" in meta else flags.get("replicas", 1)  # a best-* folder holds one
    if replicas == 1:
        return Sampled(found[0], {k: flags[k] for k in shape}, 1, 0, None)
    chosen = meta.get("best_replica", 0) if which < 0 else which
    if chosen >= replicas:
        raise UserError(f"--sample_replica {chosen}: {found[0]} holds replicas 0 to {replicas - 1}")
    return Sampled(found[0], {k: flags[k] for k in shape}, replicas, chosen, meta["replica_settings"][chosen])


def training_changes(meta: dict, identity: dict, acts) -> dict[str, tuple]:
    """{setting: (the checkpoint's value, this run's)} for every setting that differs and acts in
    both (acts(settings, name); where a flag acts in one only, the flag deciding that differs, and
    is listed)."""
    old = meta["training"]
    both = [k for k in identity if acts(old, k) and acts(identity, k)]
    return {k: (old[k], identity[k]) for k in both if old[k] != identity[k]}


def describe_changes(changes: dict[str, tuple]) -> str:
    names = {"population": "population", "data": "training data"}
    return ", ".join(f"{names.get(k, '--' + k)} {old} -> {new}" for k, (old, new) in changes.items())


class Found(NamedTuple):
    """A checkpoint a run resumes from (load_checkpoint's arrays and meta, and where it is)."""

    params: dict
    states: np.ndarray | None  # None: another population layout, the states restart
    opt: dict | None  # None: no state of this run's update rule, it starts afresh
    meta: dict
    folder: Path
    changes: dict  # training changes accepted with --allow_changes (empty otherwise)


def continue_from(
    how: str, save_dir: Path, expected: Expected, identity: dict, acts, allow_changes: bool, writer: bool
):
    """The checkpoint to continue from (--resume `how`: a path, or auto), a Found, or None for a
    fresh run: a fresh run is refused where save_dir holds checkpoints; a checkpoint of another
    format, or trained with other settings (identity; acts(settings, name) says where a flag acts),
    unless allow_changes. Reads only, except that the writer sets aside a checkpoint that auto found
    unreadable and points LATEST at the one used."""
    if not how:
        if checkpoints_in(save_dir) or (save_dir / "LATEST").exists():
            raise UserError(
                f"{save_dir} already holds checkpoints: continue them with --resume auto, "
                "or start another run with --run_name or --save_dir"
            )
        return None
    candidates = find_checkpoints(how, save_dir)
    for i, folder in enumerate(candidates):
        try:
            params, states, opt, meta = load_checkpoint(folder, expected)
        except UnreadableCheckpoint as error:
            if how != "auto" or i == len(candidates) - 1:
                raise
            aside = set_aside(folder) if writer else None
            moved = f"; set aside as {aside.name}" if aside else ""
            print(f"warning: checkpoint {folder} is unreadable ({error.reason}){moved}; trying an older one")
            continue
        check_format(meta, folder, identity)
        changes = training_changes(meta, identity, acts)
        if changes and not allow_changes:
            raise UserError(
                f"--resume: {folder} was trained with other settings: {describe_changes(changes)}; "
                "give the checkpoint's values, or --allow_changes to continue with these"
            )
        if states is None:
            print(
                f"warning: {folder} was trained with another population layout: hidden states restart at zero"
            )
        if opt is None:
            print(f"warning: {folder} holds no --optimizer {identity['optimizer']} state: it starts afresh")
        later = [c for c in checkpoints_in(save_dir) if c.name > folder.name]
        if how != "auto" and later and folder.parent.resolve() == save_dir.resolve():
            raise UserError(
                f"--resume {how}: {save_dir} holds later checkpoints ({later[-1].name}), which this run "
                f"would mix with its own: resume the newest (--resume {save_dir}), or give this run "
                "another --run_name or --save_dir"
            )
        if writer and i > 0:
            write_atomic(save_dir / "LATEST", folder.name.encode())
        return Found(params, states, opt, meta, folder, changes)
    print(f"--resume auto: no checkpoint in {save_dir} yet, starting a new run")
    return None
