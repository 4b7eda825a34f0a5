"""Tasks of the reward objective (egg/tasks.py): prompts read from every kind of source with their
columns, each bad input refused in one line, the built-in tasks and their rewards, the in-step
scorer against the host's reward, TRL-style rewards called as TRL calls them and their failures
named by row, and the worked examples as a corpus. Everything here is offline and takes seconds."""

import functools
import itertools
import json
import math
import sys
from collections import Counter
from fractions import Fraction

import datasets
import jax
import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
import tyro

from egg import UserError, corpus, tasks

ROWS = [
    {"prompt": "12+5=", "answer": "17", "extra": 1},
    {"prompt": "caf\u00e9 ", "answer": "\u00e9", "extra": 2},
    {"prompt": "3+4=", "answer": "7", "extra": 3},
    {"prompt": "9+9=", "answer": "18", "extra": 4},
]
MATCH = "egg.tasks:match_reward"  # a reward given as MODULE:NAME


def write_jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def refused(flags: tasks.Flags) -> str:
    """open_task's one-line refusal of these flags."""
    with pytest.raises(UserError) as caught:
        tasks.open_task(flags)
    message = str(caught.value)
    assert message and "\n" not in message
    return message


@functools.cache
def built_in(name: str) -> tasks.Task:
    return tasks.open_task(tasks.Flags(task=name))


# ------------------------------------------------------------------------------------------------
# Sources


def test_json_lines_csv_and_parquet_are_read_with_their_columns(tmp_path):
    write_jsonl(tmp_path / "rows.jsonl")
    (tmp_path / "rows.csv").write_text(
        'prompt,answer,extra\n12+5=,17,1\n\n"caf\u00e9 ",\u00e9,2\n3+4=,7,3\n9+9=,18,4\n'
    )
    columns = {name: [row[name] for row in ROWS] for name in ROWS[0]}
    pyarrow.parquet.write_table(pyarrow.table(columns), tmp_path / "rows.parquet")
    prompts = [row["prompt"] for row in ROWS]
    as_text = dict(columns, extra=["1", "2", "3", "4"])  # CSV has no types
    for name, want in (("jsonl", columns), ("csv", as_text), ("parquet", columns)):
        rows = tasks.read_rows(str(tmp_path / f"rows.{name}"), "--task", "{prompt}")
        assert rows.prompts == prompts and rows.columns == want
    flags = tasks.Flags(task=str(tmp_path / "rows.jsonl"), held_out=0.25, reward=(MATCH,))
    task = tasks.open_task(flags)
    assert task.train.prompts == prompts[:3] and task.valid.prompts == prompts[3:]
    assert task.train.columns["answer"] == ["17", "\u00e9", "7"]
    assert task.valid.columns == {"prompt": ["9+9="], "answer": ["18"], "extra": [4]}
    assert (task.stop, task.full_reward, task.scorer) == (10, 1.0, None)


def test_json_lines_rows_missing_a_key_have_none(tmp_path):
    path = tmp_path / "ragged.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "hint": "x"}\n')
    rows = tasks.read_rows(str(path), "--task", "{prompt}")
    assert rows == tasks.Rows(["a", "b"], {"prompt": ["a", "b"], "hint": [None, "x"]})


def test_valid_task_is_read_as_the_task_is(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl")
    valid = tmp_path / "valid.csv"
    valid.write_text("prompt,answer\n1+1=,2\n")
    task = tasks.open_task(tasks.Flags(task=train, valid_task=str(valid), reward=(MATCH,)))
    assert task.train.prompts == [row["prompt"] for row in ROWS]
    assert task.valid == tasks.Rows(["1+1="], {"prompt": ["1+1="], "answer": ["2"]})


def test_prompt_template_renders_each_row_from_its_columns(tmp_path):
    path = write_jsonl(
        tmp_path / "q.jsonl", [{"question": "2+2", "n": 4}, {"question": "1", "n": 1}]
    )
    anything = reward_file(tmp_path, "def f(prompts, completions, **kw):\n    return [0.0]\n")
    template = "Q: {question} ({n:03d})\nA:"
    task = tasks.open_task(
        tasks.Flags(task=path, prompt_template=template, reward=(f"{anything}:f",))
    )
    assert task.train.prompts == ["Q: 2+2 (004)\nA:"] and task.valid.prompts == ["Q: 1 (001)\nA:"]
    assert task.train.columns == {"question": ["2+2"], "n": [4]}
    built = tasks.open_task(tasks.Flags(task="addition", prompt_template="Sum: {prompt}"))
    assert built.train.prompts[0] == "Sum: " + built.train.columns["prompt"][0]


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """datasets' cache in the test's folder, not the home folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def test_local_dataset_folders(tmp_path, datasets_cache):
    files = tmp_path / "files"
    files.mkdir()
    write_jsonl(files / "train.jsonl")
    write_jsonl(files / "test.jsonl", ROWS[:1])
    rows = tasks.read_rows(str(files), "--task", "{prompt}")
    assert rows.prompts == [row["prompt"] for row in ROWS]
    assert rows.columns == {name: [row[name] for row in ROWS] for name in ROWS[0]}
    assert tasks.read_rows(f"{files}@test", "--task", "{prompt}").prompts == ["12+5="]
    table = {"prompt": ["x", "y"], "nums": [[1, 2], [3]]}
    datasets.Dataset.from_dict(table).save_to_disk(str(tmp_path / "saved"))
    assert tasks.read_rows(str(tmp_path / "saved"), "--task", "{prompt}").columns == table
    held = {"prompt": ["z"], "nums": [[4]]}
    splits = {"train": datasets.Dataset.from_dict(table), "test": datasets.Dataset.from_dict(held)}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
    assert tasks.read_rows(str(tmp_path / "dict"), "--task", "{prompt}").prompts == ["x", "y"]
    assert tasks.read_rows(f"{tmp_path / 'dict'}@test", "--task", "{prompt}").columns == held
    with pytest.raises(UserError, match=r"no split 'dev' \(its splits: train, test\)"):
        tasks.read_rows(f"{tmp_path / 'dict'}@dev", "--task", "{prompt}")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(UserError, match="cannot read it as a dataset"):
        tasks.read_rows(str(tmp_path / "nothing"), "--task", "{prompt}")


def test_hub_datasets_load_by_name_config_and_split(monkeypatch):
    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict({"prompt": ["p1", "p2"], "answer": ["a1", "a2"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(corpus, "hub_reachable", lambda: True)
    rows = tasks.read_rows("owner/name", "--task", "{prompt}")
    assert rows == tasks.Rows(["p1", "p2"], {"prompt": ["p1", "p2"], "answer": ["a1", "a2"]})
    tasks.read_rows("owner/name:main@test", "--valid_task", "{prompt}")
    tasks.read_rows("owner/na.me-2@train[:10]", "--task", "{prompt}")
    assert calls == [
        ("owner/name", None, "train"),
        ("owner/name", "main", "test"),
        ("owner/na.me-2", None, "train[:10]"),
    ]

    def missing(name, config=None, split=None):
        raise FileNotFoundError(f"Dataset '{name}' doesn't exist\non the Hub")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    message = refused(tasks.Flags(task="owner/gone"))
    assert "--task owner/gone: cannot load it from the hub (FileNotFoundError" in message


def test_an_unreachable_hub_is_one_line_naming_the_offline_alternatives(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(corpus, "hub_reachable", lambda: False)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("asked the hub"))
    message = refused(tasks.Flags(task="owner/name@test"))
    assert "cannot be reached" in message and "a file" in message and "addition" in message


# ------------------------------------------------------------------------------------------------
# Refusals: one line each, naming the flag and what to do


def reward_file(tmp_path, source: str, name: str = "rewards.py") -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def test_every_bad_input_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "hub_reachable", lambda: pytest.fail("asked the hub"))
    good = write_jsonl(tmp_path / "good.jsonl")

    def with_file(name: str, text: str | bytes, **flags) -> str:
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return refused(tasks.Flags(task=str(path), reward=(MATCH,), **flags))

    message = refused(tasks.Flags(task="additon"))
    assert "--task additon" in message and "addition, addition2, countdown, reverse" in message
    assert "give a task" in refused(tasks.Flags())
    assert "no such file or folder" in refused(tasks.Flags(task=str(tmp_path / "gone.jsonl")))
    assert "no such file or folder" in refused(tasks.Flags(task="data/gone.csv"))
    message = with_file("bad.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": \n')
    assert "line 3 is not JSON" in message
    message = with_file("list.jsonl", '{"prompt": "a"}\n\n["prompt"]\n')
    assert "line 3 is a JSON list, not an object" in message
    message = with_file("bad.csv", "prompt,answer\na,1\nb,2,3\n")
    assert "line 3 has 3 fields, the header 2" in message
    assert "not a readable Parquet file" in with_file("bad.parquet", b"PAR1 not really")
    assert "not UTF-8" in with_file("latin.jsonl", b'{"prompt": "caf\xe9"}\n')
    assert "ending in .jsonl, .json, .csv, .parquet" in with_file("notes.txt", "prompt\n")
    message = with_file("q.jsonl", '{"question": "a", "answer": "b"}\n{"question": "c"}\n')
    assert "has no 'prompt' column (its columns: question, answer)" in message
    assert "--prompt_template" in message
    message = with_file("q2.jsonl", '{"question": "a"}\n', prompt_template="{question} {hint}")
    assert "names the column 'hint'" in message and "its columns: question" in message
    assert "positional" in with_file("q3.jsonl", '{"question": "a"}\n', prompt_template="{}")
    assert "not a str.format template" in refused(
        tasks.Flags(task=good, prompt_template="{prompt", reward=(MATCH,))
    )
    assert "holds no rows" in with_file("empty.jsonl", "\n")
    assert "holds no rows" in with_file("header.csv", "prompt,answer\n")
    message = with_file("zero.jsonl", '{"prompt": "a"}\n{"prompt": "b\\u0000"}\n')
    assert "row 2 holds byte 0" in message
    message = with_file("one.jsonl", '{"prompt": "a"}\n')
    assert "1 prompts are too few to hold out 1" in message and "--valid_task" in message
    for stop, words in (("ab", "one byte"), ("\\", "broken backslash escape"), ("\u20ac", "8364")):
        assert words in refused(tasks.Flags(task="addition", stop=stop))
    message = refused(tasks.Flags(task=good))
    assert "not a built-in task" in message and "--reward FILE.py:NAME" in message
    valid = tmp_path / "valid.jsonl"
    valid.write_text('{"prompt": "1+1="}\n')
    message = refused(tasks.Flags(task="addition", valid_task=str(valid)))
    assert "--valid_task" in message and "'answer'" in message


def test_every_bad_reward_is_one_line(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl")

    def reward_refused(spec: str) -> str:
        return refused(tasks.Flags(task=good, reward=(spec,)))

    assert "give FILE.py:NAME or MODULE:NAME" in reward_refused("rewards.py")
    assert "no such file" in reward_refused(f"{tmp_path / 'gone.py'}:f")
    message = reward_refused("egg_no_such_module_here:f")
    assert "cannot import the module egg_no_such_module_here (ModuleNotFoundError" in message
    path = reward_file(tmp_path, "import math\nx = 1 / 0\n", "raises.py")
    message = reward_refused(f"{path}:f")
    assert "raised ZeroDivisionError: division by zero while being imported" in message
    path = reward_file(tmp_path, "def f(prompts, completions, **kw):\n    return []\nn = 3\n")
    message = reward_refused(f"{path}:g")
    assert f"{path} has no g (its functions: f)" in message
    assert "n is not a function (of type int)" in reward_refused(f"{path}:n")
    assert "egg.tasks has no nope" in reward_refused("egg.tasks:nope")
    path = reward_file(tmp_path, "def f(prompts, completions, hint, **kw):\n    1 / 0\n", "hint.py")
    message = reward_refused(f"{path}:f")  # refused by its signature, never called
    assert (
        "cannot take the task's columns (prompt, answer, extra)" in message and "'hint'" in message
    )
    path = reward_file(tmp_path, "def f(prompts, completions):\n    1 / 0\n", "narrow.py")
    assert "unexpected keyword argument" in reward_refused(f"{path}:f")


# ------------------------------------------------------------------------------------------------
# Built-in tasks


def problem(task_name: str, rows: tasks.Rows, k: int):
    """What makes a built-in problem itself: the numbers as a multiset and the target for
    countdown, the prompt for the others."""
    if task_name == "countdown":
        return tuple(sorted(rows.columns["nums"][k])), rows.columns["target"][k]
    return rows.prompts[k]


@pytest.mark.parametrize("name", list(tasks.BUILT_IN))
def test_built_in_tasks_are_fixed_and_hold_out_other_problems(name):
    task, entry = built_in(name), tasks.BUILT_IN[name]
    again = tasks.built_in_columns(name)
    assert task.train.prompts + task.valid.prompts == again["prompt"]
    assert {k: v + task.valid.columns[k] for k, v in task.train.columns.items()} == again
    rows = len(again["prompt"])  # 1,100 of addition, 10,000 of the others
    held = rows // 10
    assert len(task.valid.prompts) == held and len(task.train.prompts) == rows - held
    train = {problem(name, task.train, k) for k in range(len(task.train.prompts))}
    valid = {problem(name, task.valid, k) for k in range(len(task.valid.prompts))}
    assert len(train) == rows - held and len(valid) == held and not train & valid
    # the table's facts
    assert task.rewards == (tasks.Reward(name, entry.reward),)
    assert task.scorer == entry.scorer and (entry.scorer is None or entry.scorer in tasks.SCORERS)
    assert task.full_reward == entry.full_reward
    assert tasks.stop_byte(tasks.Flags()) == entry.stop == task.stop
    assert set(entry.reads) <= set(task.train.columns) and "completion" in task.train.columns


@pytest.mark.parametrize("name", list(tasks.BUILT_IN))
def test_worked_examples_earn_the_full_reward_and_wrong_ones_less(name):
    task = built_in(name)
    for rows in (task.train, task.valid):
        indices = range(len(rows.prompts))
        right = [c.encode() for c in rows.columns["completion"]]
        assert (tasks.score(task, rows, indices, right) == task.full_reward).all()
        wrong = [c[:-1] + (b"8" if c.endswith(b"9") else b"9") for c in right]
        assert (tasks.score(task, rows, indices, wrong) < task.full_reward).all()


def test_built_in_problems_are_as_described():
    for name, every in (
        ("addition", {t for n in (2, 3) for t in itertools.product(range(10), repeat=n)}),
        ("addition2", {(a, b) for a in range(100) for b in range(100)}),
    ):
        addition = tasks.built_in_columns(name)
        terms = [tuple(map(int, p[:-1].split("+"))) for p in addition["prompt"]]
        assert len(terms) == len(every) and set(terms) == every
        assert all(
            str(sum(t)) == a == c
            for t, a, c in zip(terms, addition["answer"], addition["completion"], strict=True)
        )
    reverse = tasks.built_in_columns("reverse")
    for prompt, answer in zip(reverse["prompt"], reverse["answer"], strict=True):
        word = prompt.removesuffix(" reversed: ")
        assert 3 <= len(word) <= 6 and word.isascii() and word.islower() and answer == word[::-1]
    countdown = tasks.built_in_columns("countdown")
    for prompt, nums, target, completion in zip(*countdown.values(), strict=True):
        assert prompt == f"{' '.join(map(str, nums))} -> {target}: "
        assert len(nums) in (3, 4) and all(1 <= n <= 9 for n in nums) and 1 <= target <= 999
        assert " " not in completion
        value, used = tasks.arithmetic(completion)
        assert value == target and Counter(used) == Counter(nums)
    assert Counter(len(nums) for nums in countdown["nums"]).keys() == {3, 4}


COUNTDOWN = [  # (completion, nums, target, reward)
    ("3*5+7", [3, 5, 7], 22, 1.0),
    (" 3 * 5 + 7\n", [7, 3, 5], 22, 1.0),
    ("(3+5)*7", [3, 5, 7], 56, 1.0),
    ("3+5*7", [3, 5, 7], 38, 1.0),
    ("8/3*3", [8, 3, 3], 8, 1.0),  # exact: 8/3 is not rounded
    ("7/2", [7, 2], 3, 0.1),  # 3.5
    ("03*5+7", [3, 5, 7], 22, 1.0),  # a leading zero: its value
    ("3*5-7", [3, 5, 7], 22, 0.1),  # the numbers, not the target
    ("3*5+8", [3, 5, 7], 23, 0.0),  # another number
    ("3*5+7+7", [3, 5, 7], 29, 0.0),  # a number used twice
    ("3*5", [3, 5, 7], 15, 0.0),  # a number left out
    ("7/(5-5)+3", [7, 5, 5, 3], 3, 0.0),  # division by zero
    ("3x5+7", [3, 5, 7], 22, 0.0),
    ("3*5+7;", [3, 5, 7], 22, 0.0),
    ("3**5+7", [3, 5, 7], 22, 0.0),
    ("-3+5*7", [3, 5, 7], 32, 0.0),  # unary minus
    ("3*(-5)+7", [3, 5, 7], -8, 0.0),
    ("3.0*5+7", [3, 5, 7], 22, 0.0),
    ("(3*5+7", [3, 5, 7], 22, 0.0),
    ("3*5+7)", [3, 5, 7], 22, 0.0),
    ("()", [], 0, 0.0),
    ("", [3], 3, 0.0),
    ("\u0663*5+7", [3, 5, 7], 22, 0.0),  # an Arabic-Indic 3: digits are 0-9 alone
    ("(" * 16 + "3" + ")" * 16 + "*5+7", [3, 5, 7], 22, 1.0),  # as deep as allowed
    ("(" * 17 + "3" + ")" * 17 + "*5+7", [3, 5, 7], 22, 0.0),  # too deep
    ("1" + " " * 62 + "*2", [1, 2], 2, 0.0),  # too long: 65 characters
    ("1" + " " * 61 + "*2", [1, 2], 2, 1.0),
    ("(" * 1000 + "1" + ")" * 1000, [1], 1, 0.0),  # no recursion error
]


@pytest.mark.parametrize(("completion", "nums", "target", "want"), COUNTDOWN)
def test_countdown_reward(completion, nums, target, want):
    got = tasks.countdown_reward(["p"], [completion], nums=[nums], target=[target])
    assert got == [want]


def test_arithmetic_reads_precedence_left_to_right():
    assert tasks.arithmetic("8-3-2") == (Fraction(3), [8, 3, 2])
    assert tasks.arithmetic("8/4/2") == (Fraction(1), [8, 4, 2])
    assert tasks.arithmetic("2+3*4-6/3") == (Fraction(12), [2, 3, 4, 6, 3])
    assert tasks.arithmetic("((2))") == (Fraction(2), [2])
    assert tasks.arithmetic("1/3") == (Fraction(1, 3), [1, 3])
    assert tasks.arithmetic("2 3") is None


def test_match_reward_compares_bytes():
    answers = ["17", "17", "17", "17", "\u00e9", "\u00e9", ""]
    completions = ["17", "1", "170", "27", "\u00e9", "\ufffd", ""]
    ids = [b"17", b"1", b"170", b"27", b"\xc3\xa9", b"\xc3\xff", b""]
    got = tasks.match_reward(None, completions, answers, completion_ids=[list(c) for c in ids])
    assert got == [1.0, 0.25, 0.5, 0.25, 1.0, 0.25, 1.0]
    assert tasks.match_reward(None, completions, answers) == [1.0, 0.25, 0.5, 0.25, 1.0, 0.0, 1.0]


# ------------------------------------------------------------------------------------------------
# The in-step scorer against the host's reward

FRAC = 16
match_scores = jax.jit(tasks.match_scores, static_argnums=2)


def host_scores(completions: list[bytes], answers: list[str]) -> np.ndarray:
    """rint(match_reward * 2**FRAC), the reference match_scores must equal."""
    ids = [list(c) for c in completions]
    texts = [c.decode(errors="replace") for c in completions]
    rewards = tasks.match_reward([""] * len(ids), texts, answers, completion_ids=ids)
    return np.rint(np.array(rewards) * 2**FRAC).astype(np.int64)


def device_scores(completions: list[bytes], answers: list[str], width: int) -> np.ndarray:
    written = np.zeros((len(completions), width), np.uint8)
    for k, completion in enumerate(completions):
        written[k, : len(completion)] = np.frombuffer(completion, np.uint8)
    wanted = tasks.right_padded(answers, tasks.longest(answers))
    return np.asarray(match_scores(written, wanted, FRAC))


def test_match_scores_equal_the_host_reward_at_every_length_and_count():
    completions, answers = [], []
    for length in range(0, 65):
        for right in range(length + 1):
            answers += ["a" * length] * 2
            completions.append(b"a" * right + b"b" * (length - right))
            completions.append(b"a" * right + b"b" * (length - right) + b"c")  # one byte more
    got = device_scores(completions, answers, 65)
    np.testing.assert_array_equal(got, host_scores(completions, answers))
    exact = [a.encode() for a in answers]
    np.testing.assert_array_equal(device_scores(exact, answers, 65), 2**FRAC)


def test_match_scores_equal_the_host_reward_on_random_and_edge_completions():
    rng = np.random.default_rng(0)
    pieces = ["a", "b", "1", "\u00e9"]
    answers = ["".join(rng.choice(pieces, rng.integers(0, 8))) for _ in range(3000)]
    alphabet = np.frombuffer(b"ab1\xc3\xa9\xff", np.uint8)
    width = 10  # a long answer (up to 16 bytes) has places beyond the completion's room
    completions = []
    for answer in answers:
        draw = rng.integers(4)
        if draw == 0:  # the answer, cut to the room, or with bytes after
            completions.append((answer.encode() + b"ab"[: rng.integers(3)])[:width])
        elif draw == 1:  # the answer with one byte changed
            data = bytearray(answer.encode()[:width] or b"a")
            data[rng.integers(len(data))] = rng.choice(alphabet)
            completions.append(bytes(data))
        else:
            completions.append(rng.choice(alphabet, rng.integers(0, width + 1)).tobytes())
    edges = [
        (b"", "17"),
        (b"", ""),
        (b"17", ""),
        (b"1", "17"),
        (b"177", "17"),
        (b"\xc3\xa9", "\u00e9"),
    ]
    edges += [(b"\xc3\xff", "\u00e9"), (b"\xc3", "\u00e9"), (b"a" * width, "a" * 30)]
    completions += [c for c, _ in edges]
    answers += [a for _, a in edges]
    got = device_scores(completions, answers, width)
    np.testing.assert_array_equal(got, host_scores(completions, answers))
    assert got.dtype == np.int32 and len(set(got.tolist())) > 20


# ------------------------------------------------------------------------------------------------
# score(): TRL-style rewards


REWARDS = """
import math

calls = []


def r(prompts, completions, answer, **kwargs):
    calls.append(dict(kwargs, prompts=prompts, completions=completions, answer=answer))
    return [float(c == a) for c, a in zip(completions, answer)]


def raises_on_b(prompts, completions, **kwargs):
    if any("b" in c for c in completions):
        raise ValueError("no b\\nplease")
    return [0.0] * len(prompts)


def batch_only(prompts, completions, **kwargs):
    if len(prompts) > 1:
        raise RuntimeError("too many")
    return [0.0]


def short(prompts, completions, **kwargs):
    return [0.0] * (len(prompts) - 1)


def mapping(prompts, completions, **kwargs):
    return {"reward": 1.0}


def none_at_1(prompts, completions, **kwargs):
    return [1.0, None, 1.0][: len(prompts)]


def text_at_1(prompts, completions, **kwargs):
    return [1.0, "1.0", 1.0][: len(prompts)]


def nan_at_1(prompts, completions, **kwargs):
    return [1.0, math.nan, 1.0][: len(prompts)]


def inf_at_2(prompts, completions, **kwargs):
    return [1.0, 1.0, -math.inf][: len(prompts)]

"""


def test_rewards_from_a_file_and_a_module_get_trl_arguments_and_are_summed(tmp_path, monkeypatch):
    rows = [dict(row, completions="a column", completion_ids=[0]) for row in ROWS]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    path = reward_file(tmp_path, REWARDS)
    module = tmp_path / "modules"
    module.mkdir()
    (module / "egg_test_length_reward.py").write_text(
        "def length(prompts, completions, completion_ids, **kwargs):\n"
        "    return [len(ids) / 10 for ids in completion_ids]\n"
    )
    monkeypatch.syspath_prepend(str(module))
    monkeypatch.delitem(sys.modules, "egg_test_length_reward", raising=False)
    try:
        specs = (f"{path}:r", "egg_test_length_reward:length")
        task = tasks.open_task(tasks.Flags(task=data, reward=specs, valid_task=data))
        assert [reward.name for reward in task.rewards] == list(specs)
        completions = [b"\xc3\xa9", b"17", b"\xff7"]
        got = tasks.score(task, task.train, [1, 0, 2], completions)
    finally:
        sys.modules.pop("egg_test_length_reward", None)
    np.testing.assert_allclose(got, [1.2, 1.2, 0.2])
    assert got.dtype == np.float64
    (call,) = task.rewards[0].function.__globals__["calls"]
    assert call == {
        "prompts": ["caf\u00e9 ", "12+5=", "3+4="],
        "completions": ["\u00e9", "17", "\ufffd7"],
        "completion_ids": [[0xC3, 0xA9], [ord("1"), ord("7")], [0xFF, ord("7")]],
        "prompt": ["caf\u00e9 ", "12+5=", "3+4="],
        "answer": ["\u00e9", "17", "7"],
        "extra": [2, 1, 3],
    }
    assert tasks.open_task(tasks.Flags(task=data, reward=(f"{path}:r",))).rewards[0].function is (
        task.rewards[0].function
    )  # the file is run once


def failure(tmp_path, name: str, completions: list[bytes]) -> str:
    data = write_jsonl(tmp_path / "rows.jsonl")
    task = tasks.open_task(tasks.Flags(task=data, reward=(f"{tmp_path / 'rewards.py'}:{name}",)))
    with pytest.raises(tasks.RewardFailed) as caught:
        tasks.score(task, task.train, list(range(len(completions))), completions)
    assert not isinstance(caught.value, UserError)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(
        f"the reward {tmp_path / 'rewards.py'}:{name}"
    )
    return message


def test_a_failing_reward_is_named_with_its_row(tmp_path):
    reward_file(tmp_path, REWARDS)
    abc = [b"a", b"b\nb", b"c"]
    message = failure(tmp_path, "raises_on_b", abc)
    assert "on prompt 'caf\u00e9 ' and completion 'b\\nb' (ValueError: no b please)" in message
    message = failure(tmp_path, "batch_only", abc)
    assert "on prompt '12+5=' and completion 'a' (RuntimeError: too many)" in message
    message = failure(tmp_path, "short", abc)
    assert "prompt '12+5=' and completion 'a' (it returned 2 values for 3 completions)" in message
    assert "it returned a dict, not a list of numbers" in failure(tmp_path, "mapping", abc)
    for name, value in (("none_at_1", "None"), ("text_at_1", "'1.0'"), ("nan_at_1", "nan")):
        message = failure(tmp_path, name, abc)
        assert "completion 'b\\nb'" in message and f"returned {value} for it" in message
    assert "prompt '3+4=' and completion 'c'" in failure(tmp_path, "inf_at_2", abc)
    long = [b"x" * 100, b"b", b"c"]
    message = failure(tmp_path, "batch_only", long)
    assert f"completion {'x' * 60!r}..." in message


def test_numbers_of_any_real_kind_are_rewards(tmp_path):
    reward_file(
        tmp_path,
        "import numpy as np\n"
        "def f(prompts, completions, **kwargs):\n"
        "    return np.array([1.5, 2.0, 0.25])[: len(prompts)]\n"
        "def g(prompts, completions, **kwargs):\n"
        "    return (True, np.float32(0.5), np.int64(2))[: len(prompts)]\n",
    )
    data = write_jsonl(tmp_path / "rows.jsonl")
    specs = (f"{tmp_path / 'rewards.py'}:f", f"{tmp_path / 'rewards.py'}:g")
    task = tasks.open_task(tasks.Flags(task=data, reward=specs))
    got = tasks.score(task, task.train, [0, 1, 2], [b"a", b"b", b"c"])
    np.testing.assert_array_equal(got, [2.5, 2.5, 2.25])


# ------------------------------------------------------------------------------------------------
# Bytes: padding and the worked examples


def test_padding_and_lengths():
    texts = ["ab", "\u00e9", "", "abcdef"]
    assert tasks.longest(texts) == 6 and tasks.longest([]) == 0
    left = tasks.left_padded(texts, 4)
    assert left.dtype == np.uint8 and left.shape == (4, 4)
    assert [row.tobytes() for row in left] == [b"\0\0ab", b"\0\0\xc3\xa9", b"\0" * 4, b"cdef"]
    right = tasks.right_padded(texts, 4)
    assert [row.tobytes() for row in right] == [b"ab\0\0", b"\xc3\xa9\0\0", b"\0" * 4, b"abcd"]
    assert tasks.left_padded(texts, 0).shape == (4, 0)


def test_worked_examples_are_shuffled_passes_of_documents():
    prompts = [f"q{i} \u00e9=" for i in range(20)]
    rows = tasks.Rows(prompts, {"prompt": prompts, "completion": [str(i * i) for i in range(20)]})
    documents = {b"\0" + f"q{i} \u00e9={i * i};".encode() for i in range(20)}
    size = sum(map(len, documents))

    def passes(data: np.ndarray) -> list[list[bytes]]:
        found = [b"\0" + d for d in data.tobytes().split(b"\0")[1:]]
        return [found[i : i + 20] for i in range(0, len(found), 20)]

    one = tasks.worked_examples(rows, ord(";"), 0)
    assert one.dtype == np.uint8 and len(one) == size
    (first,) = passes(one)
    assert set(first) == documents and first != sorted(first)
    three = tasks.worked_examples(rows, ord(";"), 2 * size + 1)
    assert len(three) == 3 * size and three[:size].tobytes() == one.tobytes()
    orders = passes(three)
    assert all(set(order) == documents for order in orders) and orders[1] != orders[0]
    np.testing.assert_array_equal(tasks.worked_examples(rows, ord(";"), 2 * size + 1), three)
    assert tasks.worked_examples(tasks.Rows(prompts, {"prompt": prompts}), 10, 100) is None


def test_flags_parse_from_the_command_line():
    given = tyro.cli(
        tasks.Flags,
        args=["--task", "a.jsonl", "--reward", "f.py:r", "m:g", "--stop", "\\x00"],
    )
    assert given.reward == ("f.py:r", "m:g") and tasks.stop_byte(given) == 0
    assert math.isclose(given.held_out, 0.1) and given.valid_task is None
    for stop, byte in (("\n", 10), ("\\n", 10), (";", 59), ("\\xff", 255), ("\u00e9", 0xE9)):
        assert tasks.stop_byte(tasks.Flags(stop=stop)) == byte


def test_the_in_step_scorer_is_known_from_the_flags():
    assert tasks.scorer(tasks.Flags(task="addition")) == "match"
    assert tasks.scorer(tasks.Flags(task="addition", reward=(MATCH,))) is None
    assert tasks.scorer(tasks.Flags(task="countdown")) is None
    assert tasks.scorer(tasks.Flags()) is None
    task = tasks.open_task(tasks.Flags(task="reverse", reward=(MATCH,), full_reward=0.75))
    assert task.scorer is None and task.full_reward == 0.75
    assert task.rewards == (tasks.Reward(MATCH, tasks.match_reward),)


def test_a_file_tasks_worked_examples_need_no_reward_to_be_read(tmp_path):
    """Read as a likelihood corpus (not rewarded), a file task without --reward opens; rewarded,
    it is refused for want of one."""
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}=", "completion": "x"}) + "\n" for i in range(9))
    )
    task = tasks.open_task(tasks.Flags(task=str(path)), rewarded=False)
    assert task.rewards == () and len(task.train.prompts) == 8
    with pytest.raises(UserError, match="no reward of its own"):
        tasks.open_task(tasks.Flags(task=str(path)))
