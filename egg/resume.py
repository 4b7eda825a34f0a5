"""Continuing a run: which checkpoint (--resume PATH: a run folder, its checkpoints folder or one
checkpoint; --resume auto: the newest complete one in --save_dir, an unreadable one set aside), with
which flags (--resume PATH: the run's own, those given overriding them), and whether the flags that
decide training match the checkpoint's (its training identity), before anything is loaded onto a
device; and the checkpoint --sample reads. Checkpoints themselves: egg/checkpoints.py."""

from __future__ import annotations

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
from egg.flags import translated


def find_checkpoints(resume: str, save_dir: Path, flag: str = "--resume") -> list[Path]:
    """Checkpoints to try, best first: --resume PATH (a run folder, a save_dir: its newest; or one
    checkpoint) or auto (the newest in save_dir, then older ones should it be unreadable). Newest
    means the highest generation, not LATEST: a kill between a checkpoint's rename and LATEST's
    leaves LATEST one save behind, and that complete checkpoint must not be skipped. `flag` names
    the flag that gave the path in a refusal."""
    if resume == "auto":
        return checkpoints_in(save_dir)[::-1]
    path, give = (
        Path(resume).expanduser(),
        "give a run folder, its checkpoints folder or one checkpoint",
    )
    if not path.exists():
        raise UserError(f"{flag} {resume}: no such path; {give}")
    if not path.is_dir():
        raise UserError(f"{flag} {resume}: a file, not a checkpoint; {give}")
    for folder in (path / "checkpoints", path):
        if checkpoints_in(folder):
            return [checkpoints_in(folder)[-1]]
    if not (path / "meta.json").exists():
        raise UserError(f"{flag} {resume}: no checkpoint there; {give}")
    return [path]


def best_checkpoint(run: str, flag: str) -> Path:
    """The best checkpoint by validation of a run (its run folder or its checkpoints folder): the
    one its BEST pointer names."""
    path = Path(run).expanduser()
    for folder in (path / "checkpoints", path):
        pointer = folder / "BEST"
        if pointer.is_file() and (folder / pointer.read_text().strip()).is_dir():
            return folder / pointer.read_text().strip()
    raise UserError(
        f"{flag} {run}:best: no best checkpoint there (a run validated at least once has one); "
        "give a run folder or its checkpoints folder"
    )


def recorded_flags(resume: str) -> tuple[dict, Path | None]:
    """The flags a run continued by --resume PATH recorded (its checkpoint's meta.json), and that
    checkpoint; ({}, None) for no PATH ('', auto) or an unreadable checkpoint (loading it says
    why)."""
    if resume in ("", "auto"):
        return {}, None
    folder = find_checkpoints(resume, Path())[0]
    try:
        return dict(json.loads((folder / "meta.json").read_text())["args"]), folder
    except (OSError, ValueError, KeyError, TypeError):
        return {}, None


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


def check_format(meta: dict, folder: Path) -> None:
    """Refuse a checkpoint of another format than CHECKPOINT_FORMAT, naming the commit that reads an
    older one."""
    found = meta.get("format", 1)
    if found > CHECKPOINT_FORMAT:
        raise UserError(
            f"--resume: {folder} is of format {found}, newer than this egg-jax's: update it"
        )
    if found < CHECKPOINT_FORMAT:
        raise UserError(
            f"--resume: {folder} was written by an older egg-jax (format {found}); continue it "
            f"with the code of commit {LAST_READER_OF_OLDER}, the last that reads it, or start a "
            "new run"
        )


class Sampled(NamedTuple):
    """What --sample reads: a checkpoint, its run's flags, and which of its replicas."""

    folder: Path
    flags: dict  # the run's flags, as its meta.json records them
    training: dict  # its training settings as resolved (meta.json's "training", with `since`)
    replicas: int  # the replicas it holds
    chosen: int  # the one sampled
    setting: dict | None  # its settings, where it holds several


def replicas_held(meta: dict) -> int:
    """The replicas a checkpoint holds (checkpoints.py's meta.json: their settings where
    several)."""
    return 1 if "replica" in meta else len(meta.get("replica_settings") or [None])


def sampled(
    resume: str, save_dir: Path, which: int, needs, since: dict, flag: str = "--resume"
) -> Sampled:
    """The checkpoint --sample --resume reads and the replica of it `which` names (-1: the best by
    its last validation), refused in one line where there is none or where it does not record the
    settings `needs(its training settings)` names (its model's); `since` as Wanted's; `flag`: the
    flag that names it (--init_from reads a model the same way)."""
    if not resume:
        raise UserError(
            "--sample needs --resume PATH: a run folder, its checkpoints folder or one checkpoint"
        )
    found = find_checkpoints(resume, save_dir, flag)
    if not found:
        raise UserError(f"--sample --resume {resume}: no checkpoint in {save_dir}")
    try:
        meta = json.loads((found[0] / "meta.json").read_text())
        flags = meta["args"]
        meta["training"] = {**since, **(meta.get("training") or {})}
    except (OSError, ValueError, KeyError, TypeError):
        raise UnreadableCheckpoint(found[0], "no meta.json with the run's flags") from None
    check_format(meta, found[0])
    missing = [name for name in needs(meta["training"]) if name not in meta["training"]]
    if missing:
        raise UserError(
            f"{flag}: {found[0]} records no --{missing[0]}: it predates the flag, which its "
            "model reads; read it with the code that trained it"
        )
    training, replicas = meta["training"], replicas_held(meta)
    if replicas == 1:
        return Sampled(found[0], flags, training, 1, 0, None)
    chosen = meta.get("best_replica", 0) if which < 0 else which
    if chosen >= replicas:
        raise UserError(f"--sample_replica {chosen}: {found[0]} holds replicas 0 to {replicas - 1}")
    return Sampled(found[0], flags, training, replicas, chosen, meta["replica_settings"][chosen])


def initial(spec: str, needs, since: dict) -> Sampled:
    """The model --init_from starts a new run from: RUN (a run folder, its checkpoints folder or
    one checkpoint) its newest checkpoint, RUN:best its best by validation; of several replicas,
    the best by its last validation; refused in one line where there is none or where it does not
    record its model's settings (`needs`, `since` as sampled's)."""
    if spec.endswith(":best"):
        folder = best_checkpoint(spec.removesuffix(":best"), "--init_from")
        return sampled(str(folder), Path(), -1, needs, since, "--init_from")
    return sampled(spec, Path(), -1, needs, since, "--init_from")


def acts(settings: dict, name: str, conditions: dict) -> bool:
    """Whether a setting acts in these settings: conditions {name: (the setting it depends on, the
    values under which it acts)}; one without a condition always acts."""
    condition = conditions.get(name)
    return condition is None or settings.get(condition[0]) in condition[1]


ABSENT = "(not recorded)"  # a setting's value in a checkpoint from before the setting


def training_changes(old: dict, identity: dict, conditions: dict) -> dict[str, tuple]:
    """{setting: (the checkpoint's value, this run's)} for every setting that differs and acts in
    both (where one acts in one only, the setting deciding that differs, and is listed), and for
    every setting the checkpoint does not record (it predates it) that acts in it: (ABSENT, this
    run's). A setting the checkpoint's own training does not read is no change, recorded or not."""
    absent = [k for k in identity if k not in old and acts(old, k, conditions)]
    both = [k for k in identity if acts(old, k, conditions) and acts(identity, k, conditions)]
    changed = {k: (old[k], identity[k]) for k in both if k in old and old[k] != identity[k]}
    return {k: (ABSENT, identity[k]) for k in absent} | changed


def describe_changes(changes: dict[str, tuple]) -> str:
    names = {"population": "population", "data": "training data"}
    return ", ".join(
        f"{names.get(k, '--' + k)} {old} -> {new}" for k, (old, new) in changes.items()
    )


def refuse_changes(folder: Path, changes: dict[str, tuple]) -> UserError:
    """The refusal of a checkpoint trained otherwise than this run would: the settings it predates
    first (there are no values of its to give), else those that differ."""
    absent = [k for k, (old, _) in changes.items() if old == ABSENT]
    if absent:
        flags = ", ".join(f"--{k}" for k in absent)
        return UserError(
            f"--resume: {folder} predates {flags}, which its training would read: give "
            f"--allow_changes to continue it with {describe_changes(changes)}"
        )
    return UserError(
        f"--resume: {folder} was trained with other settings: {describe_changes(changes)}; "
        "give the checkpoint's values, or --allow_changes to continue with these"
    )


def training_identity(
    settings: dict, facts: dict, resolved: dict, population: int, fingerprint: str
) -> dict:
    """Everything besides the generation counter that decides how a run trains (compared when it
    resumes): its flags whose facts say so (`settings` {flag: value}, `facts` {flag: Facts}), those
    the run chose where a flag let it (`resolved`, as resolved), the total population (members per
    device x devices: the device count alone changes nothing) and the training bytes' fingerprint.
    --num_epochs is not one: the alpha schedule, the noise and the data position depend on the
    generation counter only, so a run may be extended."""
    kept = {k: v for k, v in settings.items() if facts[k].training}
    kept = {k: list(v) if isinstance(v, tuple) else v for k, v in kept.items()}  # as JSON has them
    return {**kept, **resolved, "population": population, "data": fingerprint}


class Wanted(NamedTuple):
    """What a run reads from a checkpoint and holds it against (run.py gives each)."""

    expected: Expected  # its arrays' shapes and dtypes
    identity: dict  # every setting its training depends on (meta.json's "training")
    conditions: dict  # {setting: (the setting it depends on, values under which it acts)}
    aliases: dict  # {an older name: (today's name, {its value: today's})}
    retired: dict  # {setting: a value whose code is gone}: a checkpoint trained with one is refused
    retired_after: str  # the last commit that has their code
    since: dict  # {a setting that came later: the value a checkpoint without it trained with}


class Found(NamedTuple):
    """A checkpoint a run resumes from (load_checkpoint's arrays and meta, and where it is)."""

    params: dict
    states: np.ndarray | None  # None: another population layout, the states restart
    rule_state: dict | None  # None: no state of this run's update rule, it starts afresh
    meta: dict
    folder: Path
    changes: dict  # training changes accepted with --allow_changes (empty otherwise)


def continue_from(how: str, save_dir: Path, wanted: Wanted, allow_changes: bool, writer: bool):
    """The checkpoint to continue from (--resume `how`: a path, or auto), a Found, or None for a
    fresh run: a fresh run is refused where save_dir holds checkpoints; a checkpoint of another
    format, of a variant whose code is gone, or trained with other settings or before a setting
    its training reads (unless allow_changes). Reads only, except that the writer sets aside a
    checkpoint that auto found unreadable and points LATEST at the one used."""
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
            loaded = load_checkpoint(folder, wanted.expected)
        except UnreadableCheckpoint as error:
            if how != "auto" or i == len(candidates) - 1:
                raise
            aside = set_aside(folder) if writer else None
            moved = f"; set aside as {aside.name}" if aside else ""
            print(
                f"warning: checkpoint {folder} is unreadable ({error.reason}){moved}; "
                "trying an older one"
            )
            continue
        meta = {
            **loaded.meta,
            "training": {
                **wanted.since,
                **translated(loaded.meta.get("training") or {}, wanted.aliases),
            },
        }
        for name, value in wanted.retired.items():
            if meta["training"].get(name) == value:
                raise UserError(
                    f"--resume: {folder} was trained with --{name} {value}, tried and not adopted; "
                    f"continue it with the code of commit {wanted.retired_after}, "
                    "the last that has it"
                )
        check_format(meta, folder)
        changes = training_changes(meta["training"], wanted.identity, wanted.conditions)
        if changes and not allow_changes:
            raise refuse_changes(folder, changes)
        if loaded.states is None:
            print(
                f"warning: {folder} was trained with another population layout: "
                "hidden states restart at zero"
            )
        if loaded.rule_state is None:
            print(f"warning: {folder} holds no state of this run's update rule: it starts afresh")
        later = [c for c in checkpoints_in(save_dir) if c.name > folder.name]
        if how != "auto" and later and folder.parent.resolve() == save_dir.resolve():
            raise UserError(
                f"--resume {how}: {save_dir} holds later checkpoints ({later[-1].name}), which "
                f"this run would mix with its own: resume the newest (--resume {save_dir}), "
                "or give this run another --run_name or --save_dir"
            )
        if writer and i > 0:
            write_atomic(save_dir / "LATEST", folder.name.encode())
        return Found(loaded.params, loaded.states, loaded.rule_state, meta, folder, changes)
    print(f"--resume auto: no checkpoint in {save_dir} yet, starting a new run")
    return None
