"""The command line around a script's work: its flags as given (tyro's forms, nano-egg's, the
sweeps', the --algorithm upstream preset, a resumed run's own flags under those given), the
variants that were tried and retired, the checks every flag's value passes before anything is
compiled, and how the work ends: bad input, a full disk or a stop before anything was saved each
as one line and an exit code, never a traceback; a run of several processes launched under a
supervisor. The flags are a flags dataclass (egg/flags.py); this module knows them by name."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from egg import UserError, cluster, pbt, record, resume, supervisor, tasks
from egg.files import EX_IOERR, NoRoom
from egg.flags import (
    check_range,
    check_ranges,
    facts_of,
    flag_given,
    flat,
    given_value,
    group_of,
    parse,
    replace,
    since,
    upstream_preset,
    value,
)

EX_DATAERR = 65  # sysexits.h: a reward failed on what the model wrote (docs/design.org: exit codes)

# Variants measured and not adopted (docs/results.org, "Tried, not adopted"): their code left after
# commit RETIRED_AFTER, which has it. A run (or a checkpoint) that asks for one is refused in one
# line.
RETIRED_AFTER = "13a656d"
RETIRED_FLAGS = ("mlp_relu", "scale_shift")  # flags that went with their variant
RETIRED_SETTINGS = {"optimizer": "adam", "mlp_relu": True}  # a setting's value that went


def retired(name: str, setting=None) -> UserError:
    """The refusal of a variant that was tried and not adopted."""
    what = f"--{name}" + ("" if setting is None or setting is True else f" {setting}")
    return UserError(
        f'{what}: tried and not adopted (docs/results.org, "Tried, not adopted"); its code left '
        f"after commit {RETIRED_AFTER}, which has it"
    )


def parse_args(
    cls: type,
    argv: list[str],
    model_settings: Callable | None = None,
    preset: Callable | None = None,
):
    """The flags dataclass `cls` from the command line (egg/flags.py: tyro's forms, the sweeps'
    booleans, nano-egg's --fast_fitness, the --algorithm upstream preset), a retired variant
    refused. With --resume PATH, over that run's flags: all but those a flag's facts say are not
    carried, a flag the run predates at the value it trained with (its facts' `before`), writing
    where the checkpoint lies (beside it, and in its run folder where it is
    <runs_dir>/<run_name>/checkpoints). With --init_from RUN, over the settings of that run's
    model (model_settings(its training settings) names them): one given that contradicts them is
    refused. A run that does not continue another's takes preset(its flags) {flag: value} where
    the command line does not give the flag (and --algorithm upstream does not set it)."""
    for name in RETIRED_FLAGS:
        if any(flag_given(argv, f"{no}{name}") for no in ("", "no-", "no_")):
            raise retired(name)
    start = given_value(argv, "init_from")
    if start and given_value(argv, "resume") not in (None, "", "auto"):
        raise UserError(
            f"--init_from {start} starts a new run, --resume continues one: give one of them"
        )
    recorded, folder = resume.recorded_flags(given_value(argv, "resume") or "")
    for name, setting in RETIRED_SETTINGS.items():
        if recorded.get(name) == setting:
            raise retired(name, setting)
    if start and model_settings is not None:
        given = initialised(cls, argv, start, model_settings)
    else:
        given = parse(cls, argv, resumed_settings(cls, recorded, folder))
    if preset is not None and not recorded:
        given = preset_given(cls, given, argv, preset(given))
    settings = flat(given)
    for name, setting in RETIRED_SETTINGS.items():
        if settings.get(name) == setting:
            raise retired(name, setting)
    return given


def preset_given(cls: type, given, argv: list[str], preset: dict):
    """The flags with a preset's values where the command line does not give them, nor does
    --algorithm upstream set them (its preset stands: upstream's algorithm, one flag away)."""
    upstream = upstream_preset(cls) if value(given, "algorithm") == "upstream" else {}
    spelt = ("", "no-", "no_")
    chosen = {
        name: setting
        for name, setting in preset.items()
        if name not in upstream and not any(flag_given(argv, f"{no}{name}") for no in spelt)
    }
    return replace(given, **chosen) if chosen else given


def resumed_settings(cls: type, recorded: dict, folder: Path | None) -> dict:
    """The flags a run continued by --resume PATH takes from its record (`recorded`, its
    checkpoint's in `folder`): those carried, a flag it predates at the value it trained with, and
    where it writes."""
    if not recorded:
        return {}
    facts = facts_of(cls)
    recorded = {k: v for k, v in recorded.items() if k not in facts or facts[k].carried}
    recorded = since(cls) | recorded  # a setting that came later: as that run trained
    recorded["save_dir"] = str(folder.parent)
    # <runs_dir>/<run_name>/checkpoints: that run folder
    if folder.parent.name == "checkpoints":
        run_folder = folder.parent.parent
        recorded |= {
            "runs_dir": str(run_folder.parent),
            "run_name": run_folder.name,
            "save_dir": "",
        }
    return recorded


def initialised(cls: type, argv: list[str], start: str, model_settings: Callable):
    """The flags of a run started --init_from `start`: the command line's, over the settings of
    that run's model (resume.initial finds it); a setting given that contradicts them refused."""
    chosen = resume.initial(start, model_settings, since(cls))
    model = {name: chosen.training[name] for name in model_settings(chosen.training)}
    given = parse(cls, argv, model)
    for name, setting in model.items():
        mine = flat(given)[name]
        if flag_given(argv, name) and mine != setting:
            raise UserError(
                f"--{name} {mine}: --init_from {start} holds a model of --{name} {setting} "
                f"({chosen.folder}); leave --{name} out or give {setting}"
            )
    return given


def check_flags(given, replicas_of: Callable[..., list[pbt.Replica]]) -> None:
    """Refuse a bad configuration in one line naming the flag: a value outside its range or
    choices, a population that is not whole pairs and groups of members, a width that is not a
    multiple of 4, a process outside the run; per-replica lists of another length, and each
    replica's settings (replicas_of(given), egg/pbt.py) outside their flags' ranges."""
    check_ranges(given)
    settings = flat(given)
    members, group = settings["parallel_generations_per_gpu"], settings["group_size"]
    distinct, width = settings["num_perturbations"], settings["n_embd"]
    process, processes = settings["proc_id"], settings["num_procs"]
    refusals = [
        (
            members % 2,
            f"--parallel_generations_per_gpu must be even (antithetic pairs), got {members}",
        ),
        (
            group % 2 or members % group,
            f"--group_size must be even and divide the population {members}, got {group}",
        ),
        (
            distinct and (distinct % 2 or members % distinct),
            f"--num_perturbations must be even and divide the population {members}, got {distinct}",
        ),
        (width % 4, f"--n_embd must be a multiple of 4, got {width}"),
        (
            process >= processes,
            f"--proc_id must be below --num_procs, got {process} of {processes}",
        ),
    ]
    for refused, text in refusals:
        if refused:
            raise UserError(text)
    pbt.check(group_of(given, pbt.Flags))
    replicas = replicas_of(given)
    for k, replica in enumerate(replicas):
        which = f" (replica {k})" if len(replicas) > 1 else ""
        for name in pbt.EXPLORED:
            check_range(type(given), name, getattr(replica, name), which)


def main(
    argv: list[str] | None, script: Path, parse_flags: Callable, work: Callable, folders: Callable
) -> None:
    """The command line of `script`: parse_flags(argv) its flags, work(flags) what it does,
    folders(flags) where a run writes (record.Folders). A run of several processes (their cluster
    flags) runs its work under a supervisor (egg/supervisor.py), which launches `script` again.
    Bad input ends in one line and exit code 2; a write the run needs that fails for room in one
    line saying what is saved and how to go on (EX_IOERR); a stop signal before anything was saved
    in one line (docs/design.org: exit codes)."""
    argv = sys.argv[1:] if argv is None else argv
    given = None
    try:
        with cluster.early_stops():
            given = parse_flags(argv)
            hosts = group_of(given, cluster.Flags)
            if cluster.several_processes(hosts) and not supervisor.supervised():
                raise SystemExit(supervisor.supervise(script, argv, folders(given), hosts.proc_id))
            with cluster.compilation_cache_watched():
                work(given)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except NoRoom as error:  # a write the run needs failed: say what is saved, and how to go on
        print(f"error: {error}; {record.after_a_failed_write(folders(given))}", file=sys.stderr)
        raise SystemExit(EX_IOERR) from None
    except tasks.RewardFailed as error:  # the user's reward, mid-run: what is saved, how to go on
        after = record.after_a_failed_write(folders(given), "mend the reward")
        print(f"error: {error}; {after}", file=sys.stderr)
        raise SystemExit(EX_DATAERR) from None
    except cluster.Stopped as stopped:  # before anything was saved (docs/design.org: exit codes)
        raise SystemExit(stopped.say()) from None
