"""Tasks for the reward objective: prompts a model continues, and rewards that score what it wrote.

A task's prompts come from a built-in task (addition, addition2, countdown, reverse: generated
here, offline, each from a seed of its own), a JSON lines, CSV or Parquet file, or a Hugging Face
dataset (the hub, or a local folder); each prompt is rendered from its row's columns by
--prompt_template. A reward has the signature of TRL's GRPO rewards, f(prompts, completions,
**columns) -> list[float], so that a reward written for TRL runs here unchanged: it receives the
rendered prompts, the completions as text, their raw bytes (completion_ids) and every column of
the rows as keyword arguments.

A row's `completion` column (TRL's prompt-completion datasets, and every built-in task) is a worked
example: prompt, completion and the stop byte make a document of a likelihood corpus to pretrain
on. A built-in task may name an in-step scorer (SCORERS): its reward written in JAX with integers
alone, computed inside the compiled step instead of on the host."""

from __future__ import annotations

import csv
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import json
import math
import numbers
import os
import re
import string
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Annotated, NamedTuple

import jax.numpy as jnp
import numpy as np
import tyro

from egg import UserError, corpus
from egg.flags import flag

VALID_HINT = "(default: the last --held_out share of --task's prompts)"
FULL_HINT = "(default: the built-in task's, else 1.0)"
OFFLINE = "a file (JSON lines, CSV, Parquet), a folder or a built-in task"


@dataclass(frozen=True)
class Flags:
    task: Annotated[str, *flag(training=True, before="")] = ""
    """prompts: a built-in task (addition: sums of 2-3 digits; addition2: of two 2-digit numbers;
    countdown; reverse), a JSON lines, CSV or Parquet file with a 'prompt' column, or a Hugging Face
    dataset NAME[:CONFIG][@SPLIT] (a local folder too)"""
    valid_task: Annotated[
        str | None, tyro.conf.arg(metavar="TASK", help_behavior_hint=VALID_HINT)
    ] = None
    """held-out prompts, never trained on, given as --task's are"""
    reward: Annotated[tuple[str, ...], *flag(training=True, before=())] = ()
    """FILE.py:NAME or MODULE:NAME, a function f(prompts, completions, **columns) -> list[float] as
    TRL's GRPO rewards; several are summed; none given: the built-in task's own"""
    prompt_template: Annotated[str, *flag(training=True, before="{prompt}")] = "{prompt}"
    """each prompt from its row's columns (str.format), e.g. 'Q: {question}\\nA:'"""
    held_out: Annotated[float, *flag("(0, 0.5]", training=True, before=0.1)] = 0.1
    """share of --task's prompts held out (the last ones) when --valid_task is not given"""
    stop: Annotated[str, *flag(training=True, before="\\n")] = "\\n"
    """the byte a completion stops at, backslash escapes allowed ('\\n'; '\\x00': byte 0 alone)"""
    full_reward: Annotated[
        float | None, tyro.conf.arg(metavar="FLOAT", help_behavior_hint=FULL_HINT)
    ] = None
    """a completion with at least this reward counts as correct in val/accuracy"""


class Rows(NamedTuple):
    prompts: list[str]  # each rendered from its row by --prompt_template
    columns: dict[str, list]  # every column of the source ('prompt' too), aligned with prompts


class Reward(NamedTuple):
    name: str  # a built-in task's name, else the --reward spec as given ("my.py:f")
    function: Callable  # f(prompts, completions, **columns) -> list[float], as TRL's


class Task(NamedTuple):
    name: str  # --task as given
    train: Rows
    valid: Rows
    rewards: tuple[Reward, ...]  # summed
    stop: int  # the byte a completion stops at (0..255)
    full_reward: float  # a completion rewarded this much or more is correct
    scorer: str | None  # the in-step scorer (a key of SCORERS) computing the reward, if any


class RewardFailed(Exception):
    """A reward raised or returned something other than one real number per completion: said in
    one line naming the reward, the prompt and the completion (not bad input: its own exit code)."""


# ------------------------------------------------------------------------------------------------
# Rewards of the built-in tasks, with TRL's signature.


def match_reward(prompts, completions, answer, completion_ids=None, **kwargs) -> list[float]:
    """Half the share of the answer's bytes the completion has at their places, plus half if it is
    the answer exactly: in [0, 1]. Bytes are compared, not text: a completion's are its
    completion_ids where given (the bytes the model wrote), else its text in UTF-8. An empty answer
    has all of its (no) places right."""
    rewards = []
    for k, expected in enumerate(answer):
        got = bytes(completion_ids[k]) if completion_ids is not None else completions[k].encode()
        want = str(expected).encode()
        right = sum(a == b for a, b in zip(got, want, strict=False)) if want else 1
        rewards.append((right / max(len(want), 1) + (got == want)) / 2)
    return rewards


MAX_EXPRESSION = 64  # characters of a countdown answer at most...
MAX_NESTING = 16  # ...and parentheses within parentheses: the parser's recursion stays shallow
EXPRESSION = re.compile(r"(?:\s*(?:[0-9]+|[-+*/()]))*\s*")
TOKEN = re.compile(r"[0-9]+|[-+*/()]")


class Invalid(Exception):
    """Not an arithmetic expression arithmetic() accepts."""


def arithmetic(text: str) -> tuple[Fraction, list[int]] | None:
    """(value, the numbers it uses) of an expression of non-negative integers, + - * / and
    parentheses (spaces anywhere between them), read with the usual precedence, left to right;
    None for anything else: another character, a unary minus, a division by zero, more than
    MAX_EXPRESSION characters or parentheses nested deeper than MAX_NESTING. Exact (fractions);
    never Python's eval."""
    if len(text) > MAX_EXPRESSION or not EXPRESSION.fullmatch(text):
        return None
    tokens = TOKEN.findall(text)[::-1]  # popped from the end: the next token is the last
    used = []

    def peek() -> str:
        return tokens[-1] if tokens else ""

    def factor(depth: int) -> Fraction:
        token = tokens.pop() if tokens else ""
        if token.isdigit():
            used.append(int(token))
            return Fraction(int(token))
        if token != "(" or depth == MAX_NESTING:
            raise Invalid
        value = expression(depth + 1)
        if peek() != ")":
            raise Invalid
        tokens.pop()
        return value

    def term(depth: int) -> Fraction:
        value = factor(depth)
        while peek() in ("*", "/"):
            operator, right = tokens.pop(), factor(depth)
            if operator == "/" and right == 0:
                raise Invalid
            value = value * right if operator == "*" else value / right
        return value

    def expression(depth: int) -> Fraction:
        value = term(depth)
        while peek() in ("+", "-"):
            operator, right = tokens.pop(), term(depth)
            value = value + right if operator == "+" else value - right
        return value

    try:
        value = expression(0)
    except Invalid:
        return None
    return None if tokens else (value, used)


def countdown_reward(prompts, completions, nums, target, **kwargs) -> list[float]:
    """1 for an expression (arithmetic()) of exactly the given numbers, each once, that equals the
    target; 0.1 for one of exactly those numbers that misses it; else 0. Surrounding whitespace is
    ignored."""
    rewards = []
    for completion, given, wanted in zip(completions, nums, target, strict=True):
        found = arithmetic(completion.strip())
        if found is None or Counter(found[1]) != Counter(int(n) for n in given):
            rewards.append(0.0)
        else:
            rewards.append(1.0 if found[0] == int(wanted) else 0.1)
    return rewards


# ------------------------------------------------------------------------------------------------
# The built-in tasks: rows generated offline from each one's seed; every row's `completion` a
# correct answer (a worked example).

PROBLEMS = 10_000  # rows of countdown and reverse (addition2 has every pair: 10,000 too)


def sums(terms: list[tuple[int, ...]], rng: np.random.Generator) -> dict[str, list]:
    """'a+b+...=' for each tuple of terms, shuffled; the answer is their sum."""
    terms = [terms[i] for i in rng.permutation(len(terms))]
    answers = [str(sum(t)) for t in terms]
    prompts = ["+".join(map(str, t)) + "=" for t in terms]
    return {"prompt": prompts, "answer": answers, "completion": answers}


def addition_rows(rng: np.random.Generator) -> dict[str, list]:
    """Every sum of two or three one-digit numbers, 1,100 of them: a running total, which a small
    int8 model learns in part (docs/results.org, "Rewards")."""
    terms = [t for n in (2, 3) for t in itertools.product(range(10), repeat=n)]
    return sums(terms, rng)


def addition2_rows(rng: np.random.Generator) -> dict[str, list]:
    """Every sum of two numbers in [0, 99], 10,000 of them: each answer digit from digits read
    several bytes apart, with a carry."""
    return sums(list(itertools.product(range(100), repeat=2)), rng)


def countdown_expression(operands: list[int], operators: str) -> tuple[str, int] | None:
    """The numbers combined left to right by the operators, as text with parentheses only where
    precedence needs them ((3+4)*2, not 3+4*2), and its value; None where a division is not exact
    (every step stays an integer)."""
    value, text, additive = operands[0], str(operands[0]), False
    for operator, number in zip(operators, operands[1:], strict=True):
        if operator == "/" and value % number:
            return None
        if operator in "*/" and additive:
            text = f"({text})"
        text += f"{operator}{number}"
        steps = {"+": value + number, "-": value - number, "*": value * number}
        value = steps.get(operator, value // number)
        additive = operator in "+-"
    return text, value


def countdown_rows(rng: np.random.Generator) -> dict[str, list]:
    """PROBLEMS distinct problems (the numbers as a multiset, and the target): 3 or 4 numbers in
    [1, 9] and a target in [1, 999] that a random expression of them, each used once, reaches."""
    seen, columns = set(), {"prompt": [], "nums": [], "target": [], "completion": []}
    while len(seen) < PROBLEMS:
        nums = rng.integers(1, 10, size=rng.choice([3, 4])).tolist()
        order = [nums[i] for i in rng.permutation(len(nums))]
        operators = "".join("+-*/"[i] for i in rng.integers(0, 4, size=len(nums) - 1))
        made = countdown_expression(order, operators)
        if made is None or not 1 <= made[1] <= 999 or (tuple(sorted(nums)), made[1]) in seen:
            continue
        expression, target = made
        seen.add((tuple(sorted(nums)), target))
        columns["prompt"].append(f"{' '.join(map(str, nums))} -> {target}: ")
        columns["nums"].append(nums)
        columns["target"].append(target)
        columns["completion"].append(expression)
    return columns


def reverse_rows(rng: np.random.Generator) -> dict[str, list]:
    """PROBLEMS distinct words of 3 to 6 random lowercase letters; the answer: the word reversed."""
    words = {}  # a dict keeps the order they were drawn in
    while len(words) < PROBLEMS:
        letters = rng.integers(0, 26, size=rng.integers(3, 7))
        words["".join(chr(ord("a") + int(i)) for i in letters)] = None
    answers = [word[::-1] for word in words]
    return {"prompt": [f"{w} reversed: " for w in words], "answer": answers, "completion": answers}


class BuiltIn(NamedTuple):
    rows: Callable[[np.random.Generator], dict[str, list]]  # its columns, 'prompt' included
    seed: int  # of the generator its rows are drawn with (the same rows on every machine)
    reward: Callable  # TRL's signature
    reads: tuple[str, ...]  # the columns its reward reads (held-out rows must have them too)
    full_reward: float  # the reward of a correct completion
    scorer: str | None  # its in-step scorer, a key of SCORERS (the reward in JAX), or None
    stop: int  # the byte its completions end with (--stop's default)


NEWLINE = ord("\n")
MATCH = dict(reward=match_reward, reads=("answer",), full_reward=1.0, scorer="match", stop=NEWLINE)
BUILT_IN = {
    "addition": BuiltIn(rows=addition_rows, seed=1, **MATCH),
    "addition2": BuiltIn(rows=addition2_rows, seed=4, **MATCH),
    "countdown": BuiltIn(
        rows=countdown_rows,
        seed=2,
        reward=countdown_reward,
        reads=("nums", "target"),
        full_reward=1.0,
        scorer=None,
        stop=NEWLINE,
    ),
    "reverse": BuiltIn(rows=reverse_rows, seed=3, **MATCH),
}


def built_in_columns(name: str) -> dict[str, list]:
    """A built-in task's columns, drawn afresh (a fraction of a second)."""
    entry = BUILT_IN[name]
    return entry.rows(np.random.default_rng(entry.seed))


# ------------------------------------------------------------------------------------------------
# Reading prompts: files, datasets, the hub; --prompt_template.

HUB_NAME = re.compile(  # OWNER/NAME[:CONFIG][@SPLIT]
    r"(?P<name>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<config>[^@]+))?(?:@(?P<split>.+))?"
)


def read_json_lines(path: Path, spec: str, flag_name: str) -> dict[str, list]:
    """A JSON lines file's columns: one object a line (lines end at '\\n' alone; blank lines
    skipped), every key a column; a row without a key has None there."""
    rows = []
    for number, line in enumerate(read_text(path, spec, flag_name).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise UserError(
                f"{flag_name} {spec}: line {number} is not JSON ({said(error)})"
            ) from None
        if not isinstance(row, dict):
            raise UserError(
                f"{flag_name} {spec}: line {number} is a JSON {type(row).__name__}, not an object "
                "(JSON lines: one object a line)"
            )
        rows.append(row)
    names = list(dict.fromkeys(key for row in rows for key in row))
    return {name: [row.get(name) for row in rows] for name in names}


def read_csv(path: Path, spec: str, flag_name: str) -> dict[str, list]:
    """A CSV file's columns, named by its first row (values are text; blank lines skipped)."""
    rows = []
    with open(path, newline="", encoding="utf-8-sig") as source:
        reader = csv.reader(source)
        try:
            header = next(reader, [])
            for row in reader:
                if row and len(row) != len(header):
                    raise UserError(
                        f"{flag_name} {spec}: line {reader.line_num} has {len(row)} fields, the "
                        f"header {len(header)}"
                    )
                rows += [row] if row else []
        except (UnicodeDecodeError, csv.Error) as error:
            raise UserError(f"{flag_name} {spec}: not readable CSV ({said(error)})") from None
    return {name: [row[i] for row in rows] for i, name in enumerate(header)}


def read_parquet(path: Path, spec: str, flag_name: str) -> dict[str, list]:
    import pyarrow
    import pyarrow.parquet

    try:
        return pyarrow.parquet.read_table(path).to_pydict()
    except (pyarrow.ArrowException, OSError) as error:
        raise UserError(
            f"{flag_name} {spec}: not a readable Parquet file ({said(error)})"
        ) from None


def read_text(path: Path, spec: str, flag_name: str) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise UserError(f"{flag_name} {spec}: not UTF-8 text ({said(error)})") from None


READERS = {".jsonl": read_json_lines, ".json": read_json_lines}
READERS |= {".csv": read_csv, ".parquet": read_parquet}


def read_folder(folder: Path, split: str, spec: str, flag_name: str) -> dict[str, list]:
    """A local dataset: a folder datasets.save_to_disk wrote (a Dataset, or a DatasetDict whose
    `split` is taken), else a folder of data files (datasets.load_dataset reads it)."""
    import datasets

    try:
        if (folder / "dataset_dict.json").exists():
            saved = datasets.load_from_disk(str(folder))
            if split not in saved:
                raise UserError(
                    f"{flag_name} {spec}: has no split {split!r} (its splits: "
                    f"{', '.join(saved)}); give FOLDER@SPLIT"
                )
            return saved[split].to_dict()
        if (folder / "state.json").exists():
            return datasets.load_from_disk(str(folder)).to_dict()
        return datasets.load_dataset(str(folder), split=split).to_dict()
    except UserError:
        raise
    except Exception as error:  # datasets says why in many types of its own
        raise UserError(
            f"{flag_name} {spec}: cannot read it as a dataset ({said(error)})"
        ) from None


def read_hub(name: str, config: str | None, split: str, spec: str, flag_name: str) -> dict:
    """A Hugging Face hub dataset's split (the hub is asked first whether it answers, so that an
    offline machine fails in seconds)."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "")
    if not offline and not corpus.hub_reachable():
        raise UserError(
            f"{flag_name} {spec}: no such file or folder, and the Hugging Face hub cannot be "
            f"reached to load it as a dataset; offline, give {OFFLINE} "
            f"({', '.join(BUILT_IN)})"
        )
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as error:  # datasets says why in many types of its own
        raise UserError(
            f"{flag_name} {spec}: cannot load it from the hub ({said(error)})"
        ) from None
    return dataset.to_dict()


def source_columns(spec: str, flag_name: str) -> dict[str, list]:
    """The columns of a task spec: a built-in task, a file, a folder (FOLDER[@SPLIT]) or a hub
    dataset (OWNER/NAME[:CONFIG][@SPLIT], split 'train' unless given)."""
    if spec in BUILT_IN:
        return built_in_columns(spec)
    whole, (before, at, split) = Path(spec).expanduser(), spec.rpartition("@")
    if whole.is_file():
        reader = READERS.get(whole.suffix.lower())
        if reader is None:
            raise UserError(
                f"{flag_name} {spec}: give a file ending in {', '.join(READERS)}, or a folder"
            )
        return reader(whole, spec, flag_name)
    if whole.is_dir():
        return read_folder(whole, "train", spec, flag_name)
    if at and Path(before).expanduser().is_dir():
        return read_folder(Path(before).expanduser(), split, spec, flag_name)
    hub = HUB_NAME.fullmatch(spec)
    if hub and Path(hub["name"]).suffix.lower() not in READERS and not spec.startswith("."):
        return read_hub(hub["name"], hub["config"], hub["split"] or "train", spec, flag_name)
    if "/" in spec or Path(spec).suffix.lower() in READERS:
        raise UserError(f"{flag_name} {spec}: no such file or folder")
    raise UserError(
        f"{flag_name} {spec}: not a built-in task ({', '.join(BUILT_IN)}), a file or folder, "
        "nor a hub dataset OWNER/NAME"
    )


def rendered(columns: dict[str, list], template: str, spec: str, flag_name: str) -> Rows:
    """Rows whose prompts are the template filled in (str.format) with each row's columns."""
    count = len(next(iter(columns.values()), []))
    if count == 0:
        raise UserError(f"{flag_name} {spec}: holds no rows")
    try:
        fields = [
            field for _, field, _, _ in string.Formatter().parse(template) if field is not None
        ]
    except ValueError as error:
        raise UserError(
            f"--prompt_template {template!r}: not a str.format template ({said(error)})"
        ) from None
    names = ", ".join(columns) or "none"
    for field in fields:
        column = re.split(r"[.\[]", field, maxsplit=1)[0]
        if column == "prompt" and column not in columns:
            raise UserError(
                f"{flag_name} {spec}: has no 'prompt' column (its columns: {names}); say how a "
                "prompt is made of them with --prompt_template, e.g. 'Q: {question}\\nA:'"
            )
        if column not in columns:
            why = "a positional field" if not column else f"the column {column!r}"
            raise UserError(
                f"--prompt_template {template!r} names {why}, which {flag_name} {spec} lacks "
                f"(its columns: {names})"
            )
    prompts = []
    for k in range(count):
        try:
            prompt = template.format_map({name: values[k] for name, values in columns.items()})
        except (LookupError, AttributeError, TypeError, ValueError) as error:
            raise UserError(
                f"--prompt_template {template!r} fails on row {k + 1} of {flag_name} {spec} "
                f"({said(error)})"
            ) from None
        if "\0" in prompt:
            raise UserError(
                f"{flag_name} {spec}: the prompt of row {k + 1} holds byte 0, the separator of "
                "documents; remove it"
            )
        prompts.append(prompt)
    return Rows(prompts, columns)


def read_rows(spec: str, flag_name: str, template: str) -> Rows:
    if not spec:
        raise UserError(
            f"{flag_name}: give a task: a built-in one ({', '.join(BUILT_IN)}), a JSON lines, "
            "CSV or Parquet file, a folder or a hub dataset OWNER/NAME"
        )
    return rendered(source_columns(spec, flag_name), template, spec, flag_name)


def sliced(rows: Rows, part: slice) -> Rows:
    return Rows(rows.prompts[part], {name: v[part] for name, v in rows.columns.items()})


# ------------------------------------------------------------------------------------------------
# Rewards given by --reward.


def said(error: BaseException) -> str:
    """An exception in one line, 'Type: message' (its type alone where it has no message)."""
    message = " ".join(str(error).splitlines())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def imported_file(path: Path, spec: str) -> object:
    """A Python file run as a module of its own (named by its path, so that two files of one name
    do not meet), kept in sys.modules as an imported module is (dataclasses look for it there)."""
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    name = f"egg_reward_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    found = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module
    try:
        found.loader.exec_module(module)
    except Exception as error:  # whatever the user's file raises
        del sys.modules[name]
        raise UserError(
            f"--reward {spec}: {path} raised {said(error)} while being imported"
        ) from None
    return module


def load_reward(spec: str) -> Reward:
    """--reward FILE.py:NAME or MODULE:NAME: the function NAME of that file or module."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UserError(f"--reward {spec}: give FILE.py:NAME or MODULE:NAME")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise UserError(f"--reward {spec}: no such file {where}")
        module = imported_file(path, spec)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as error:  # not found, or whatever the module raises
            raise UserError(
                f"--reward {spec}: cannot import the module {where} ({said(error)}); give "
                "FILE.py:NAME, or put the module on PYTHONPATH"
            ) from None
    if not hasattr(module, name):
        public = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise UserError(
            f"--reward {spec}: {where} has no {name} (its functions: {', '.join(public) or 'none'})"
        )
    function = getattr(module, name)
    if not callable(function):
        kind = type(function).__name__
        raise UserError(f"--reward {spec}: {name} is not a function (of type {kind})")
    return Reward(spec, function)


# ------------------------------------------------------------------------------------------------
# The task.


def stop_byte(flags: Flags) -> int:
    """--stop's byte: its backslash escapes decoded ('\\n', '\\x00'), one character below 256."""
    text = flags.stop
    try:
        decoded = text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as error:
        raise UserError(f"--stop {text!r}: a broken backslash escape ({error.reason})") from None
    if len(decoded) != 1 or ord(decoded) > 255:
        got = f"code {ord(decoded)}" if len(decoded) == 1 else f"{len(decoded)} characters"
        raise UserError(f"--stop {text!r}: must be one byte, e.g. '\\n', ';' or '\\x00', got {got}")
    return ord(decoded)


def scorer(flags: Flags) -> str | None:
    """The in-step scorer (a key of SCORERS) computing the task's reward: a built-in task's, where
    no --reward replaces its own; else None (the rewards are computed on the host). Known from the
    flags alone, before the task is read."""
    built_in = BUILT_IN.get(flags.task)
    return built_in.scorer if built_in is not None and not flags.reward else None


def open_task(flags: Flags, rewarded: bool = True) -> Task:
    """--task's prompts split into training and held-out rows (--valid_task's, else the last
    --held_out share, at least one row each side), its rewards and its settings; bad input refused
    in one line. Not `rewarded` (its worked examples read as a likelihood corpus): no reward
    needed, none loaded."""
    stop = stop_byte(flags)
    built_in = BUILT_IN.get(flags.task)
    rows = read_rows(flags.task, "--task", flags.prompt_template)
    if flags.valid_task is not None:
        train, valid = rows, read_rows(flags.valid_task, "--valid_task", flags.prompt_template)
    else:
        held = max(1, int(len(rows.prompts) * flags.held_out))
        if held >= len(rows.prompts):
            raise UserError(
                f"--task {flags.task}: {len(rows.prompts)} prompts are too few to hold out "
                f"{held} and train on the rest; give more, or --valid_task"
            )
        train, valid = sliced(rows, slice(None, -held)), sliced(rows, slice(-held, None))
    if not rewarded:  # a likelihood corpus: no reward read
        return Task(flags.task, train, valid, (), stop, 1.0, None)
    rewards = tuple(load_reward(spec) for spec in flags.reward)
    if not rewards and built_in is None:
        raise UserError(
            f"--task {flags.task}: not a built-in task, so it has no reward of its own; give one "
            "with --reward FILE.py:NAME"
        )
    if not rewards:
        rewards = (Reward(flags.task, built_in.reward),)
        parts = (("--task", flags.task, train), ("--valid_task", flags.valid_task, valid))
        for flag_name, spec, part in parts:
            missing = [name for name in built_in.reads if name not in part.columns]
            if missing:
                raise UserError(
                    f"{flag_name} {spec}: lacks the column {missing[0]!r} that the reward of "
                    f"{flags.task} reads; give rows with it, or --reward"
                )
    for reward in rewards:
        takes_the_columns(reward, (train, valid))
    full_reward = flags.full_reward
    if full_reward is None:
        full_reward = built_in.full_reward if built_in is not None else 1.0
    return Task(flags.task, train, valid, rewards, stop, full_reward, scorer(flags))


def takes_the_columns(reward: Reward, parts: tuple[Rows, ...]) -> None:
    """Refuse, before anything runs, a reward that could not be called as score() will call it
    with these rows' columns: its signature bound to the arguments' names, nothing called (a
    function whose signature Python cannot read is taken as it is)."""
    try:
        signature = inspect.signature(reward.function)
    except (TypeError, ValueError):
        return
    for rows in parts:
        columns = [name for name in rows.columns if name not in PASSED_AS_ARGUMENTS]
        try:
            signature.bind(**dict.fromkeys([*PASSED_AS_ARGUMENTS, *columns], []))
        except TypeError as error:
            raise UserError(
                f"--reward {reward.name} cannot take the task's columns ({', '.join(columns)}) "
                f"as TRL passes them: {error}"
            ) from None


# ------------------------------------------------------------------------------------------------
# Scoring completions on the host.

PASSED_AS_ARGUMENTS = ("prompts", "completions", "completion_ids")  # columns never passed


def clipped(value, most: int = 60) -> str:
    """repr of a value, cut to about `most` characters (a text is cut before its repr)."""
    if isinstance(value, str):
        return repr(value[:most]) + ("..." if len(value) > most else "")
    shown = repr(value)
    return shown[:most] + ("..." if len(shown) > most else "")


def failed(reward: Reward, prompt: str, completion: str, why: str) -> RewardFailed:
    message = f"the reward {reward.name} failed on prompt {clipped(prompt)} and completion "
    message += f"{clipped(completion)} ({why})"
    return RewardFailed(" ".join(message.splitlines()))


def number(value) -> float | None:
    """A reward's value as a float if it is a finite real number (bool included), else None."""
    if not isinstance(value, numbers.Real | np.bool_):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def rewarded(reward: Reward, prompts: list[str], texts: list[str], ids: list, columns: dict):
    """One reward's values of a batch (float64, (n,)), or RewardFailed naming a row."""

    def call(rows: Sequence[int]):
        picked = {name: [values[k] for k in rows] for name, values in columns.items()}
        return reward.function(
            prompts=[prompts[k] for k in rows],
            completions=[texts[k] for k in rows],
            completion_ids=[ids[k] for k in rows],
            **picked,
        )

    try:
        returned = call(range(len(prompts)))
    except Exception as error:  # whatever the user's reward raises
        for k in range(len(prompts)):  # the first row that fails alone
            try:
                call([k])
            except Exception as alone:
                raise failed(reward, prompts[k], texts[k], said(alone)) from alone
        raise failed(reward, prompts[0], texts[0], said(error)) from error
    if isinstance(returned, np.ndarray) and returned.ndim == 1:
        returned = list(returned)
    if not isinstance(returned, Sequence) or isinstance(returned, str | bytes):
        why = f"it returned a {type(returned).__name__}, not a list of numbers"
        raise failed(reward, prompts[0], texts[0], why)
    if len(returned) != len(prompts):
        why = f"it returned {len(returned)} values for {len(prompts)} completions"
        raise failed(reward, prompts[0], texts[0], why)
    values = [number(value) for value in returned]
    for k, (value, given) in enumerate(zip(values, returned, strict=True)):
        if value is None:
            why = f"it returned {clipped(given)} for it, not a finite number"
            raise failed(reward, prompts[k], texts[k], why)
    return np.asarray(values, np.float64)


def score(task: Task, rows: Rows, indices: Sequence[int], completions: list[bytes]) -> np.ndarray:
    """The rewards (float64, (n,)) of completions (the bytes written, the stop byte cut off) of
    rows.prompts[indices[k]]: every reward of the task called once on the whole batch, as TRL calls
    them: prompts, completions (text: UTF-8, undecodable bytes replaced), completion_ids (the bytes
    as lists of ints) and every column of the rows, a keyword each (but one named as one of those
    three: the call's own takes its place); their sum. A reward that raises, or returns other than
    one finite number a completion, raises RewardFailed."""
    if len(indices) != len(completions):
        raise ValueError(f"{len(completions)} completions of {len(indices)} prompts")
    prompts = [rows.prompts[i] for i in indices]
    texts = [c.decode("utf-8", errors="replace") for c in completions]
    ids = [list(c) for c in completions]
    columns = {
        name: [values[i] for i in indices]
        for name, values in rows.columns.items()
        if name not in PASSED_AS_ARGUMENTS
    }
    total = np.zeros(len(prompts), np.float64)
    for reward in task.rewards:
        total += rewarded(reward, prompts, texts, ids, columns)
    return total


# ------------------------------------------------------------------------------------------------
# Bytes for the device: prompts and answers as padded arrays, worked examples as a corpus.


def longest(texts: list[str]) -> int:
    """The most UTF-8 bytes of any of the texts (0 for none)."""
    return max((len(text.encode()) for text in texts), default=0)


def left_padded(texts: list[str], length: int) -> np.ndarray:
    """(n, length) uint8: each text's UTF-8 bytes at the right end, byte 0 before (a longer text:
    its last `length` bytes), so that every prompt ends where the completion starts."""
    out = np.zeros((len(texts), length), np.uint8)
    for k, text in enumerate(texts):
        data = text.encode()
        data = data[len(data) - length :] if len(data) > length else data
        out[k, length - len(data) :] = np.frombuffer(data, np.uint8)
    return out


def right_padded(texts: list[str], length: int) -> np.ndarray:
    """(n, length) uint8: each text's UTF-8 bytes from the left, zeros after (cut at `length`)."""
    out = np.zeros((len(texts), length), np.uint8)
    for k, text in enumerate(texts):
        data = text.encode()[:length]
        out[k, : len(data)] = np.frombuffer(data, np.uint8)
    return out


WORKED_SEED = 7  # the order of the worked examples, folded with the pass


def worked_examples(rows: Rows, stop: int, least: int) -> np.ndarray | None:
    """The rows as a likelihood corpus (uint8): each a document b'\\0' + prompt + completion + the
    stop byte (UTF-8), in an order shuffled afresh each pass, passes repeated until there are at
    least `least` bytes (one at least); None where the rows have no 'completion' column."""
    if "completion" not in rows.columns or not rows.prompts:
        return None
    documents = [
        b"\0" + prompt.encode() + str(completion).encode() + bytes([stop])
        for prompt, completion in zip(rows.prompts, rows.columns["completion"], strict=True)
    ]
    size = sum(len(document) for document in documents)
    pieces = []
    for repeat in range(max(1, -(-least // size))):
        order = np.random.default_rng([WORKED_SEED, repeat]).permutation(len(documents))
        pieces += [documents[i] for i in order]
    return np.frombuffer(b"".join(pieces), np.uint8)


# ------------------------------------------------------------------------------------------------
# In-step scorers: a built-in reward in JAX, integers alone, inside the compiled step.


def match_scores(completions, answers, frac: int):
    """match_reward in fixed point, (M,) int32 = rint(reward * 2**frac), exactly: completions
    (M, C) uint8 (the bytes written, zeros after: a completion ends at its first byte 0), answers
    (M, A) uint8 (right_padded; an answer's length is its count of non-zero bytes). The answer's
    places beyond C are wrong. The value (right + exact * length) * 2**frac / (2 * length) rounds
    half up, as a floor division: np.rint rounds a tie to even, but none occurs for a length below
    2**frac (a tie needs right * 2**frac / length odd). int32 holds it for C < 2**(30 - frac)."""
    completions = jnp.asarray(completions).astype(jnp.int32)
    answers = jnp.asarray(answers).astype(jnp.int32)
    length = jnp.sum(answers != 0, axis=1, dtype=jnp.int32)  # (M,)
    written = jnp.sum(jnp.cumprod(completions != 0, axis=1), axis=1, dtype=jnp.int32)  # (M,)
    both = min(completions.shape[1], answers.shape[1])
    places = jnp.arange(both) < length[:, None]  # (M, both)
    same = (completions[:, :both] == answers[:, :both]) & places
    right = jnp.sum(same, axis=1, dtype=jnp.int32)  # (M,)
    exact = (written == length) & (right == length)
    right = jnp.where(length == 0, 1, right)  # an empty answer: all of its places right
    length = jnp.maximum(length, 1)
    scaled = (right + exact.astype(jnp.int32) * length) * 2**frac  # the reward * 2 * length
    return (scaled + length) // (2 * length)  # floor(scaled / (2 length) + 1/2)


SCORERS = {"match": match_scores}  # BuiltIn.scorer names one


def scored_against(task: Task) -> np.ndarray:
    """(n, A) uint8: what the in-step scorer compares each training row's completions with, the
    column its built-in's reward reads, right_padded (A >= 1); (n, 0) where there is no scorer."""
    if task.scorer is None:
        return np.zeros((len(task.train.prompts), 0), np.uint8)
    (column,) = BUILT_IN[task.name].reads
    values = task.train.columns[column]
    return right_padded(values, max(longest(values), 1))
