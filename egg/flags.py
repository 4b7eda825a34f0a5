"""Flags: what a flags dataclass knows of each flag besides its type, default and help (its Facts),
written once beside the flag; the range and choice checks, the --algorithm upstream preset, --help's
hints, the names older runs recorded and the comparison of a resumed run's settings derive from
them. And the command line in the forms W&B sweep agents pass, and the one flags dataclass that
gathers a script's own flags with those of its tables' entries (a model's, a fitness shaping's, an
update rule's, each declared beside its entry).

A flags dataclass holds flags and groups of flags: a field whose type is a flags dataclass of its
own (a tool's Flags), shown apart in --help under the field's name; every flag is still --name on
the command line. Here a flag is known by its name alone, wherever it sits. Nothing here knows any
particular flag: each function takes the dataclass (or its values) it works on."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import math
import typing
from collections.abc import Callable, Iterable
from typing import Annotated, Any, NamedTuple

import tyro

from egg import UserError


class Facts(NamedTuple):
    """What run.py knows of a flag besides its type, default and help."""

    low: float = -math.inf  # the range of values allowed, low and high...
    high: float = math.inf
    open: tuple[bool, bool] = (False, False)  # ...and whether each end itself is excluded
    why: str = ""  # what the range protects, said when a value outside it is refused
    training: bool = False  # changes what a generation computes: compared when a run resumes
    upstream: Any = (
        None  # upstream nano-egg's value, where it differs from ours (--algorithm upstream)
    )
    choices: Callable[[], Iterable[str]] | None = None  # the values allowed, asked for when needed
    carried: bool = True  # a run continued by --resume PATH takes it from the run's record (else
    # from its own command line alone: what to do now, where and on how many processes)
    alias: tuple[str, tuple] | None = None  # (another name, ((its value, this one's), ...))
    before: Any = None  # the value runs from before this flag trained with, where they record none

    def ranged(self) -> bool:
        return (self.low, self.high) != (-math.inf, math.inf)

    def allowed(self) -> str:
        """The range in words: 'positive', '>= 0', '> 0', 'in [0, 6]', 'in (0, 0.5)', ..."""
        if self.high < math.inf:
            return f"in {'(['[not self.open[0]]}{self.low:g}, {self.high:g}{')]'[not self.open[1]]}"
        if (self.low, self.open[0]) == (1, False):
            return "positive"
        return f"{'>' if self.open[0] else '>='} {self.low:g}"

    def admits(self, value) -> bool:
        above = value > self.low if self.open[0] else value >= self.low
        return above and (value < self.high if self.open[1] else value <= self.high)


def flag(interval: str = "", **facts) -> tuple[Facts, Any]:
    """A flag's Annotated metadata (`Annotated[int, *flag("[0, 6]", training=True)]`): its Facts,
    the range written as an interval, and --help's hint with the range or the choices, upstream's
    value and the alias (made when --help is shown: choices may come from a table defined later)."""
    if interval:
        low, high = (float(x) for x in interval[1:-1].split(","))
        facts.update(low=low, high=high, open=(interval[0] == "(", interval[-1] == ")"))
    known = Facts(**facts)

    def hint(default) -> str:
        parts = [f"default: {default}"]
        if known.ranged():
            parts.append(known.allowed())
        if known.choices is not None:
            parts.append(f"one of: {', '.join(known.choices())}")
        if known.upstream is not None:
            parts.append(f"upstream: {known.upstream}")
        if known.alias is not None:
            name, values = known.alias
            spelt = {True: f"--{name}", False: f"--no-{name}"}
            parts.append(", ".join(f"{spelt[k]}: {v}" for k, v in values))
        return f"({'; '.join(parts)})"

    if known == Facts(carried=known.carried):  # nothing to say beyond tyro's own default
        return (known,)
    return known, tyro.conf.arg(help_behavior_hint=hint)


def section() -> tuple:
    """A group field's Annotated metadata: its flags keep their names (--NAME, no prefix) and show
    in --help under the field's name."""
    return (tyro.conf.OmitArgPrefixes,)


def unwrapped(hint):
    """A type hint without its Annotated metadata."""
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint


def group(hint) -> type | None:
    """The flags dataclass a field's type hint names (a group of flags), else None."""
    base = unwrapped(hint)
    return base if dataclasses.is_dataclass(base) else None


@functools.cache
def hints_of(cls: type) -> dict[str, tuple[str, Any]]:
    """{flag: (its group's field, '' at the top; its type hint with its metadata)} of every flag."""
    found = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        inner = group(hint)
        found.update(
            {k: (name, h) for k, (_, h) in hints_of(inner).items()} if inner else {name: ("", hint)}
        )
    return found


@functools.cache
def facts_of(cls: type) -> dict[str, Facts]:
    """{flag: its Facts} for every flag of a flags dataclass (Facts() where it has none)."""
    found = {
        name: [m for m in getattr(h, "__metadata__", ()) if isinstance(m, Facts)]
        for name, (_, h) in hints_of(cls).items()
    }
    return {name: facts[0] if facts else Facts() for name, facts in found.items()}


def value(args, name: str):
    """A flag's value, wherever it sits."""
    where = hints_of(type(args))[name][0]
    return getattr(getattr(args, where) if where else args, name)


def group_of(args, cls: type):
    """The group of flags of this dataclass (a tool's Flags) that args holds."""
    groups = [getattr(args, field.name) for field in dataclasses.fields(args)]
    return next(found for found in groups if isinstance(found, cls))


def flat(args) -> dict[str, Any]:
    """{flag: value} of every flag."""
    return {name: value(args, name) for name in hints_of(type(args))}


def replace(args, **changes):
    """The flags with these changed, each in its group."""
    where = hints_of(type(args))
    top = {k: v for k, v in changes.items() if not where[k][0]}
    for name in {where[k][0] for k in changes} - {""}:
        inner = {k: v for k, v in changes.items() if where[k][0] == name}
        top[name] = dataclasses.replace(getattr(args, name), **inner)
    return dataclasses.replace(args, **top)


def check_range(cls: type, name: str, given, which: str = "") -> None:
    """Refuse a value outside the flag's range with one line naming it; `which` names a replica."""
    facts = facts_of(cls)[name]
    if not facts.admits(given):
        why = f" ({facts.why})" if facts.why else ""
        raise UserError(f"--{name} must be {facts.allowed()}{why}, got {given}{which}")


def check_ranges(args) -> None:
    """check_range of every flag that has a range, and a refusal of a value outside its choices."""
    for name, facts in facts_of(type(args)).items():
        if facts.ranged():
            check_range(type(args), name, value(args, name))
        if facts.choices is not None and value(args, name) not in facts.choices():
            known = ", ".join(facts.choices())
            raise UserError(f"--{name} must be one of {known}, got {value(args, name)}")


def given_value(argv: list[str], name: str) -> str | None:
    """The value argv gives --name (--name VALUE or --name=VALUE, the last one), else None."""
    found = None
    for i, word in enumerate(argv):
        key, equals, after = word.partition("=")
        if flag_given([key], name):
            found = after if equals else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def flag_given(argv: list[str], name: str) -> bool:
    """Whether --name (spelt with underscores or dashes, with or without =value) is in argv."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    return any(word.partition("=")[0] in spellings for word in argv)


def tyro_booleans(argv: list[str], booleans: set[str]) -> list[str]:
    """argv with --flag=True|False and --flag True|False (the forms W&B sweep agents pass with
    ${args}) rewritten as tyro's --flag / --no-flag."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        name, equals, value = word[2:].partition("=")
        if word.startswith("--") and name.replace("-", "_") in booleans:
            if not equals and i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false"):
                equals, value = "=", argv[i + 1]
                i += 1
            if equals:
                if value.lower() not in ("true", "false"):
                    raise UserError(f"--{name} takes True or False, got {value!r}")
                word = f"--{name}" if value.lower() == "true" else f"--no-{name}"
        out.append(word)
        i += 1
    return out


def aliases(cls: type) -> dict[str, tuple[str, dict]]:
    """{another name: (the flag, {its value: the flag's})} of every flag with an alias."""
    return {f.alias[0]: (name, dict(f.alias[1])) for name, f in facts_of(cls).items() if f.alias}


def spelt_out(argv: list[str], cls: type) -> list[str]:
    """argv with every alias (--NAME, --no-NAME, --NAME=V, --NAME V for V True or False, dashes
    or underscores) written as the flag it stands for: --FLAG VALUE."""
    out, words = [], iter(argv)
    forms = {}
    for other, (name, values) in aliases(cls).items():
        for spelling in {other, other.replace("_", "-")}:
            forms |= {f"--{spelling}": (name, values), f"--no-{spelling}": (name, values, False)}
            forms[f"--no_{spelling}"] = (name, values, False)
    for word in words:
        key, equals, given = word.partition("=")
        found = forms.get(key)
        if found is None:
            out.append(word)
            continue
        if len(found) == 3:  # --no-NAME
            setting = False
        elif equals:
            setting = given
        else:
            following = next(words, None)
            if following is not None and following.lower() not in ("true", "false"):
                out.append(f"--{found[0]}")
                out.append(str(found[1][True]))
                out.append(following)
                continue
            setting = True if following is None else following
        if isinstance(setting, str):
            if setting.lower() not in ("true", "false"):
                raise UserError(f"{key} takes True or False, got {setting!r}")
            setting = setting.lower() == "true"
        out += [f"--{found[0]}", str(found[1][setting])]
    return out


def translated(settings: dict, aliases_: dict[str, tuple[str, dict]]) -> dict:
    """Settings an older run recorded (its flags, its training identity) under today's names: an
    alias of aliases() and its value as the flag it stands for, where the flag itself is absent."""
    out = dict(settings)
    for other, (name, values) in aliases_.items():
        if other in out and name not in out:
            out[name] = values[bool(out.pop(other))]
    return out


def upstream_preset(cls: type) -> dict[str, Any]:
    """--algorithm upstream: upstream nano-egg's value of every flag whose default here differs."""
    return {name: f.upstream for name, f in facts_of(cls).items() if f.upstream is not None}


def parse(cls: type, argv: list[str], recorded: dict | None = None):
    """The flags dataclass `cls` from the command line: tyro's forms and the sweeps' booleans; under
    --algorithm upstream every flag with an upstream value set to it unless given. `recorded`: a
    run's flags as flat() wrote them (JSON), the defaults the command line overrides; the preset is
    in them already (it applies again only where --algorithm is given)."""
    return parsed(cls, tuple(argv), json.dumps(recorded or {}, sort_keys=True))


SOURCE_OF = inspect.getsource


@functools.cache
def class_source(cls: type) -> tuple[str | None, Exception | None]:
    """A class's source, or why it has none (a class made at run time: Args)."""
    try:
        return SOURCE_OF(cls), None
    except (OSError, TypeError) as error:
        return None, error


def kept_source(target) -> str:
    if not isinstance(target, type):
        return SOURCE_OF(target)
    source, error = class_source(target)
    if error is not None:
        raise error
    return source


@contextlib.contextmanager
def sources_kept():
    """While tyro reads the flags: each class's source read once a process. tyro reads the source
    of every flags class (its fields' help) anew at every call, and Python 3.11 finds a class in
    its module by parsing the whole module: 0.1 s for each class of run.py's, and for Args, which
    has no source."""
    inspect.getsource = kept_source
    try:
        yield
    finally:
        inspect.getsource = SOURCE_OF


@functools.lru_cache(maxsize=256)
def parsed(cls: type, argv: tuple[str, ...], recorded_json: str):
    """parse's flags, kept for the same command line and record (frozen: shared safely); tyro reads
    each flags class's source anew at every call, a quarter of a second for run.py's."""
    recorded = json.loads(recorded_json)
    booleans = {
        name
        for name, (_, hint) in hints_of(cls).items()
        if hint is bool or bool in typing.get_args(hint)
    }
    out, defaults = tyro_booleans(spelt_out(argv, cls), booleans), None
    if recorded:
        recorded = translated(recorded, aliases(cls))
        known = {
            k: tuple(v) if isinstance(v, list) else v
            for k, v in recorded.items()
            if k in hints_of(cls)
        }
        defaults = replace(cls(), **known)
    # --help spells flags as upstream does
    with sources_kept():
        args = tyro.cli(cls, args=out, use_underscores=True, default=defaults)
    if getattr(args, "algorithm", "") == "upstream" and (
        not recorded or flag_given(out, "algorithm")
    ):
        preset = upstream_preset(cls)
        given = {k for k in preset if any(flag_given(out, f"{no}{k}") for no in ("", "no-", "no_"))}
        args = replace(args, **{k: v for k, v in preset.items() if k not in given})
    return args


def gathered(name: str, base: type, **tables: dict) -> type:
    """The flags dataclass `name` of base's flags and of every entry's own: `tables` {the flag that
    picks an entry: its table {name: entry}}, an entry's `flags` a frozen flags dataclass declared
    beside it (or None), gathered as a group under the entry's name (--help's section "NAME
    options"; every flag is still --NAME, and a group may share its name with a flag, as --model's
    own). An entry's flags that are not a frozen dataclass, a name of theirs that is a flag's, or
    their group's name that is another group's, are refused here: when the script that declares
    them is imported."""
    taken = set(hints_of(base))  # flags' names
    groups = {field.name for field in dataclasses.fields(base)}  # groups' (a flag's may be one)
    fields = []
    for table in tables.values():
        for name, entry in table.items():
            own = entry.flags
            if own is None:
                continue
            if not (dataclasses.is_dataclass(own) and own.__dataclass_params__.frozen):
                raise TypeError(f"entry {name}: its flags must be a frozen dataclass, got {own!r}")
            if name in groups:
                raise TypeError(f"entry {name}: the name {name} is taken by a group of flags")
            clash = set(hints_of(own)) & taken
            if clash:
                raise TypeError(f"entry {name}: the name {sorted(clash)[0]} is taken by a flag")
            taken |= set(hints_of(own))
            groups.add(name)
            fields.append(
                (name, Annotated[own, *section()], dataclasses.field(default_factory=own))
            )
    gathered_flags = dataclasses.make_dataclass(name, fields, bases=(base,), frozen=True)
    gathered_flags.__doc__, gathered_flags.__module__ = base.__doc__, base.__module__
    return gathered_flags


def entry_flags(settings, table: dict, name: str):
    """The entry `name` of a table: its own flags' values in `settings` (a gathered dataclass), or
    None where it has none."""
    return None if table[name].flags is None else getattr(settings, name)


def conditions(**tables: dict) -> dict[str, tuple[str, tuple[str, ...]]]:
    """{flag: (the flag that picks an entry, the entries under which it acts)}: an entry's own flags
    act under it alone (`tables` as gathered's)."""
    found = {}
    for picker, table in tables.items():
        for name, entry in table.items():
            for flag_name in hints_of(entry.flags) if entry.flags is not None else ():
                found[flag_name] = (picker, (name,))
    return found


def since(cls: type) -> dict[str, Any]:
    """{flag: the value runs from before it trained with} of every flag whose facts say one, as a
    run's record has it (JSON: a tuple as a list)."""
    found = {name: f.before for name, f in facts_of(cls).items() if f.before is not None}
    return {name: list(v) if isinstance(v, tuple) else v for name, v in found.items()}
