"""The reward objective: members write completions of a task's prompts inside the step, integers
only (greedy, or drawn at a temperature with a pair's shared draws), and a reward scores them, on
the host (TRL's signature) or in the step (a built-in task's scorer), alike; a reward run resumes
bit for bit; --init_from starts from another run's model; --sample continues a task's prompts; bad
input is one line and exit 2, nothing written; a reward that fails mid-run stops the run in one
line, exit 65, its newest checkpoint whole; a window model that a segment cannot hold is
refused."""

import json
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    CACHE,
    TINY,
    add_entries,
    checkpoint_digest,
    in_process,
    init_params,
    one_line_error,
    run_here,
)
from toys import GRU, PAIR

import run
from egg import cluster, sampling, tasks

# a tiny reward run: 8D-2L, population 16 in groups of 4 writing up to 3 bytes for the addition
# task's prompts, validated on 8 held-out ones
REWARD = (
    f"--objective reward --task addition --dir_path {CACHE} --n_embd 8 --n_layer 2 "
    "--parallel_generations_per_gpu 16 --group_size 4 --completion_bytes 3 "
    "--validation_batch_size 8 --alpha 0.2 --shaping standardised"
).split()


def test_a_drawn_byte_follows_its_temperature_and_zero_is_the_lowest_most_likely():
    """choose_bytes against 2**(logit / (16 t)) normalised, 40,000 draws of random bits; greedy:
    the first of equal logits."""
    tables = run.make_tables(1)
    logits = np.full(256, -40, np.int8)
    logits[[10, 20, 30, 40]] = [0, 16, 32, 48]  # twice as likely each, at t = 1
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**run.GUMBEL_BITS, (40_000, 256), dtype=np.uint16)
    for t in (1.0, 2.0):
        chosen = run.choose_bytes(jnp.asarray(logits), jnp.asarray(bits), round(16 * t), tables)
        counts = np.bincount(np.asarray(chosen), minlength=256)
        weights = 2.0 ** (logits.astype(np.float64) / (16 * t))
        want = len(bits) * weights / weights.sum()
        seen = [counts[i] for i in (10, 20, 30, 40)] + [
            counts.sum() - counts[[10, 20, 30, 40]].sum()
        ]
        expected = [want[i] for i in (10, 20, 30, 40)] + [want.sum() - want[[10, 20, 30, 40]].sum()]
        for got, mean in zip(seen, expected, strict=True):
            assert abs(got - mean) < 4 * np.sqrt(mean) + 0.02 * mean, (t, seen, expected)
    ties = jnp.asarray(np.where(np.isin(np.arange(256), [3, 7]), 5, 0).astype(np.int8))
    assert int(run.choose_bytes(ties, None, 0, tables)) == 3


def one_device():
    return cluster.population_mesh(run.POP, jax.devices()[:1])


@pytest.fixture
def toys(monkeypatch):
    add_entries(monkeypatch, models={"gru": GRU, "pair": PAIR})


@pytest.mark.parametrize("model", [*run.MODELS, "gru", "pair"])
def test_greedy_completions_are_the_models_bytes_read_one_at_a_time(toys, model):
    """make_completer's completions of three prompts (left-padded with byte 0, read at once for
    every member) equal run.sample_text's greedy continuations, read a byte a call on the host,
    each cut at the task's stop byte or at byte 0."""
    given = ["--model", model, "--init_std", "24", "--completion_bytes", "6"]
    args = run.parse_args([*REWARD, *given, *(["--head_width", "4"] * (model == "transformer"))])
    cfg = run.make_config(args)
    params = init_params(cfg, 5)
    prompts = ["12+3=", "7+88=", "x"]
    rows = tasks.left_padded(prompts, 8)
    rows = np.concatenate([rows, rows[:1]])  # an even share
    written = run.make_completer(cfg, one_device())(jax.tree.map(lambda x: x[None], params), rows)
    got = [bytes(c).rstrip(b"\0") for c in np.asarray(written)[0, :3]]
    greedy = sampling.Flags(temperature=0, min_p=0, presence_penalty=0, max_new_bytes=6)
    want = []
    for prompt in prompts:
        text = run.sample_text(params, cfg, replace(greedy, prompt=prompt), 0, cfg.stop)
        want.append(text[len(prompt) :].split(b"\0")[0])
    assert got == want and any(got), (got, want)


def test_both_members_of_a_pair_draw_alike_and_pairs_apart():
    """Members writing at temperature 1 with their noise at zero: both members of each pair write
    the same completion of their group's prompt (the same draws), and pairs that share a prompt
    draw apart."""
    args = run.parse_args([*REWARD, "--init_std", "24", "--completion_temperature", "1"])
    cfg = run.make_config(args)
    params = init_params(cfg, 1)
    noise = jax.tree.map(jnp.zeros_like, run.generation_noise(cfg, 0, jnp.int32(0)))
    prompts = np.repeat(tasks.left_padded(["12+3="] * 4, 8), 4, axis=0)[:, None]  # (16, 1, L)
    draws = run.draw_sources(cfg, 0, jnp.int32(0), 0, 16)
    written = np.asarray(
        run.population_completions(cfg, params, lambda s: noise, prompts, jnp.int32(3), draws)
    )[0]
    assert (written[0::2] == written[1::2]).all()
    assert len({bytes(c) for c in written[0::2]}) > 1


def digest_at(runs, generation: int) -> str:
    (found,) = runs.glob(f"*/checkpoints/gen-{generation:08d}")
    return checkpoint_digest(found)


def records(runs) -> list[dict]:
    (path,) = runs.glob("*/metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_steps_scorer_and_the_same_reward_on_the_host_train_alike(tmp_path):
    """The addition task's match scorer in the step, and the same reward given as a TRL-style
    function (egg.tasks:match_reward) scored on the host between the two calls: the same fitness,
    so the same parameters and validations, generation for generation."""
    runs = {"step": tmp_path / "step", "host": tmp_path / "host"}
    common = [*REWARD, "--num_epochs", "3", "--validate_every", "2"]
    outs = {
        "step": run_here(*common, "--runs_dir", str(runs["step"])),
        "host": run_here(
            *common, "--reward", "egg.tasks:match_reward", "--runs_dir", str(runs["host"])
        ),
    }
    for kind, out in outs.items():
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"scored {'in the step' if kind == 'step' else 'on the host'}" in out.stdout
    assert digest_at(runs["step"], 3) == digest_at(runs["host"], 3)
    rewards = [[r.get("val/reward") for r in records(path)] for path in runs.values()]
    assert rewards[0] == rewards[1]
    record = records(runs["step"])[1]  # generation 2: validated
    assert {"train/reward", "train/best_reward", "val/reward", "val/accuracy"} <= set(record)
    assert record["perf/completions"] == 16  # every member, one prompt (one segment) each


def test_a_reward_run_stopped_at_any_generation_resumes_bit_for_bit(tmp_path):
    """Its prompts, draws and completions are functions of the seed and generation: 2 generations,
    then 2 more resumed, end where 4 at once end (host scoring at a temperature)."""
    common = [*REWARD, "--reward", "egg.tasks:match_reward", "--completion_temperature", "1"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run_here(*common, "--num_epochs", "4", "--runs_dir", str(whole)).returncode == 0
    assert run_here(*common, "--num_epochs", "2", "--runs_dir", str(part)).returncode == 0
    (folder,) = part.glob("*")
    resumed = run_here("--resume", str(folder), "--num_epochs", "4")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-2000:]
    assert digest_at(whole, 4) == digest_at(part, 4)


@pytest.mark.parametrize(
    "case",
    [
        "malformed line",
        "no prompt column",
        "no answer column",
        "unknown task",
        "no reward file",
        "no reward function",
    ],
)
def test_bad_task_or_reward_input_is_one_line_and_nothing_is_written(tmp_path, capsys, case):
    good = tmp_path / "good.jsonl"
    good.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20))
    )
    reward = tmp_path / "mine.py"
    reward.write_text(
        "def exact(prompts, completions, answer, **kwargs):\n    return [1.0] * len(prompts)\n"
    )
    bad = tmp_path / "bad.jsonl"
    flags, message = {
        "malformed line": (["--task", str(bad)], "line 3"),
        "no prompt column": (["--task", str(bad)], "'prompt'"),
        "unknown task": (["--task", "nosuchtask"], "nosuchtask"),
        "no reward file": (["--task", str(good), "--reward", f"{tmp_path}/gone.py:f"], "gone.py"),
        "no reward function": (["--task", str(good), "--reward", f"{reward}:nope"], "nope"),
        "no answer column": (["--task", str(bad)], "missing a required argument: 'answer'"),
    }[case]
    lines = good.read_text().splitlines(True)
    if case == "malformed line":
        bad.write_text("".join(lines[:2]) + "{not json\n" + "".join(lines[2:]))
    if case == "no prompt column":
        bad.write_text(good.read_text().replace('"prompt"', '"question"'))
    if case == "no answer column":
        bad.write_text(good.read_text().replace('"answer"', '"solution"'))
    if "reward" not in case:
        flags += ["--reward", f"{reward}:exact"]
    runs = tmp_path / "runs"
    result = in_process(capsys, *REWARD, *flags, "--runs_dir", str(runs))
    one_line_error(result, message)
    assert not runs.exists()


FAILING = """
from pathlib import Path
CALLS = Path(__file__).with_suffix(".calls")


def flaky(prompts, completions, answer, **kwargs):
    calls = int(CALLS.read_text()) + 1 if CALLS.exists() else 1
    CALLS.write_text(str(calls))
    if calls == 3:
        raise ValueError("no third call")
    return [float(c == a) for c, a in zip(completions, answer)]
"""


def test_a_reward_that_fails_mid_run_stops_it_in_one_line_with_its_checkpoint_whole(
    tmp_path, capsys
):
    """The reward raises at generation 3 (its third call): exit 65, one line naming the reward,
    the prompt, the completion and its message, and the newest checkpoint (generation 2) with the
    command that continues; mended, the run continues from it."""
    reward = tmp_path / "mine.py"
    reward.write_text(FAILING)
    flags = [*REWARD, "--reward", f"{reward}:flaky", "--save_every", "1", "--num_epochs", "4"]
    runs = tmp_path / "runs"
    result = in_process(capsys, *flags, "--runs_dir", str(runs))
    assert result.returncode == 65, result.stderr[-2000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().endswith(said[0])  # the last line, after the progress bar
    assert f"the reward {reward}:flaky failed on prompt " in said[0]
    assert "(ValueError: no third call)" in said[0] and "gen-00000002: mend the reward" in said[0]
    (folder,) = runs.glob("*")
    assert sorted(p.name for p in (folder / "checkpoints").glob("gen-*")) == [
        "gen-00000001",
        "gen-00000002",
    ]
    resumed = in_process(capsys, "--resume", str(folder))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "at generation 2" in resumed.stdout and (folder / "checkpoints/gen-00000004").exists()


def test_init_from_starts_a_new_run_from_another_runs_model(tmp_path, capsys):
    """--init_from RUN: the model of RUN's newest checkpoint (RUN:best, its best), its settings
    taken from it; a flag that contradicts them, or a --resume beside it, refused in one line;
    --sample then continues the task's held-out prompts with their rewards."""
    pre = tmp_path / "pre"
    flags = [*TINY, "--num_epochs", "2", "--runs_dir", str(pre), "--run_name", "pre"]
    assert in_process(capsys, *flags, "--n_embd", "12").returncode == 0
    at = REWARD.index("--n_embd")
    reward = REWARD[:at] + REWARD[at + 2 :]  # the model's settings left out
    runs = tmp_path / "runs"
    started = in_process(
        capsys,
        *reward,
        "--init_from",
        f"{pre}/pre:best",
        "--num_epochs",
        "2",
        "--runs_dir",
        str(runs),
    )
    assert started.returncode == 0, started.stderr[-2000:]
    assert f"starting from the model of {pre}/pre/checkpoints/best-" in started.stdout
    assert "5,520 int8 parameters" not in started.stdout  # 8D's: the 12D model instead
    cfg = run.make_config(run.parse_args([*reward, "--init_from", f"{pre}/pre"]))
    assert cfg.n_embd == 12
    params, folder = run.initial_params(f"{pre}/pre", cfg)
    with np.load(folder / "params.npz") as saved:
        assert all(np.array_equal(params[k][0], saved[k]) for k in saved.files)
    refused = in_process(capsys, *reward, "--init_from", f"{pre}/pre", "--n_embd", "8")
    one_line_error(refused, "--n_embd 8: --init_from")
    both = in_process(capsys, *reward, "--init_from", f"{pre}/pre", "--resume", f"{pre}/pre")
    one_line_error(both, "starts a new run, --resume continues one")
    (folder,) = runs.glob("*")
    sampled = in_process(capsys, "--sample", "--resume", str(folder), "--temperature", "0")
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    lines = sampled.stdout.strip().splitlines()
    assert len(lines) == run.SAMPLED_PROMPTS and all(" (reward " in line for line in lines)


def test_a_window_model_that_a_segment_cannot_hold_is_refused(monkeypatch, capsys):
    """A model that reads 4 bytes at once, at 20 bytes in 10 segments (2 bytes each): refused in
    one line; at 40 bytes it runs."""
    add_entries(monkeypatch, models={"four": PAIR._replace(context=lambda cfg: 4)})
    refused = in_process(capsys, *TINY, "--model", "four", "--tokens_per_update", "20")
    one_line_error(refused, "--model four reads 4 bytes at once, but a member reads 2")
    run.check_args(run.parse_args([*TINY, "--model", "four", "--tokens_per_update", "40"]))


def test_the_reward_objective_trains_with_its_preset_unless_told():
    """--objective reward: --shaping standardised --alpha 0.2 where the command line gives neither;
    a flag given wins; --algorithm upstream's preset stands where it sets one (sign scores); the
    likelihood has no preset."""
    given = run.parse_args(["--objective", "reward", "--task", "addition"])
    assert (given.shaping, given.alpha) == ("standardised", 0.2)
    given = run.parse_args(["--objective", "reward", "--task", "addition", "--alpha", "0.1"])
    assert (given.shaping, given.alpha) == ("standardised", 0.1)
    upstream = run.parse_args(
        ["--objective", "reward", "--task", "addition", "--algorithm", "upstream"]
    )
    assert (upstream.shaping, upstream.alpha) == ("sign", 0.2)
    assert (run.parse_args([]).shaping, run.parse_args([]).alpha) == ("normalised", 4.0)
