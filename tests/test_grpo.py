"""baselines/grpo.py and the float models' writing (baselines/backprop.py): the group advantages,
the completions and the clipped surrogate against references computed another way; a run on a
user's task and reward, and compare.py reading its rewards."""

import dataclasses
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CACHE, ROOT, cli, one_line_error

sys.path.insert(0, str(ROOT))
import compare  # noqa: E402
from baselines import backprop, grpo  # noqa: E402


def test_advantages_are_each_reward_against_its_own_group():
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.2, 0.4, 0.6, 0.8])
    got = grpo.advantages(rewards, 4)
    for g in range(3):
        group = rewards[4 * g : 4 * g + 4]
        mean = sum(group) / 4
        sd = math.sqrt(sum((r - mean) ** 2 for r in group) / 4)
        for k in range(4):
            assert got[4 * g + k] == pytest.approx((group[k] - mean) / (sd + 1e-4))
    assert np.all(got[4:8] == 0)  # a group whose rewards tie teaches nothing


def test_completions_end_at_the_stop_byte_or_byte_0():
    buffer = np.array([[0, 7, 49, 50, 10, 51], [0, 7, 49, 0, 52, 10], [0, 7, 49, 50, 51, 52]])
    assert backprop.completions_of(buffer, 2, 10) == [b"12", b"1", b"1234"]


def tiny(network: str) -> backprop.Args:
    """A float model 8 wide, one layer, a 16-byte window."""
    model = dataclasses.replace(backprop.Args().model, n_embd=8, n_layer=1)
    return dataclasses.replace(backprop.Args(), network=network, window=16, model=model)


@pytest.mark.parametrize("network", ["mingru", "transformer"])
def test_greedy_writing_is_the_argmax_of_each_prefix_read_alone(network):
    """make_writer's completions (a forward over the whole padded buffer for every byte) against a
    reference that reads each prefix alone and appends its most likely byte, stopping where the
    writer must stop."""
    args = tiny(network)
    init, forward = backprop.MODELS[network]
    params = init(jax.random.key(3), args)
    prompts = np.array([[0, 0, 50, 43, 51, 61], [0, 97, 98, 99, 100, 61]], np.uint8)
    write = backprop.make_writer(forward, 5, stop=10)
    buffer, read = write(params, jnp.asarray(prompts), jax.random.key(0), 0.0)
    for row, prompt in enumerate(prompts):
        text, ended, marks = list(prompt), False, []
        for _ in range(5):
            state = backprop.zero_state(params, 1)
            logits = forward(params, state, jnp.asarray([text], jnp.uint8))[0][0, -1]
            byte = int(jnp.argmax(logits))
            marks.append(not ended)
            ended = ended or byte in (10, 0)
            text.append(byte)
        assert list(np.asarray(buffer)[row]) == text
        assert list(np.asarray(read)[row]) == marks


def test_the_surrogate_is_reinforce_at_ratio_1_and_clipped_beyond():
    """At p = p_old, the clipped surrogate's gradient is REINFORCE's with the group baseline:
    -sum A grad log p / bytes read. Where p_old makes the ratio exceed 1 + clip for a positive
    advantage, that byte adds nothing to the gradient."""
    args = tiny("mingru")
    init, forward = backprop.MODELS["mingru"]
    params = init(jax.random.key(1), args)
    buffer = jnp.asarray(
        [[0, 49, 43, 50, 61, 51, 10, 0], [0, 49, 43, 50, 61, 52, 53, 10]], jnp.uint8
    )
    read = jnp.asarray([[True, True, False], [True, True, True]])
    advantage = jnp.asarray([1.0, -1.0])
    old = grpo.log_probs(forward, params, buffer, 5)

    def reinforce(params):
        logp = grpo.log_probs(forward, params, buffer, 5)
        return -jnp.sum(advantage[:, None] * logp * read) / jnp.sum(read)

    def loss(params, old):
        return grpo.surrogate(forward, params, buffer, read, advantage, old, 5, 0.2)

    got, want = jax.grad(loss)(params, old), jax.grad(reinforce)(params)
    for name in params:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6)
    clipped = old.at[0].add(-1.0)  # row 0's ratios e > 1.2, its advantage positive: clipped
    got = jax.grad(loss)(params, clipped)

    def row_1_alone(params):
        logp = grpo.log_probs(forward, params, buffer, 5)
        ratio = jnp.exp(logp - clipped)
        return jnp.sum(ratio[1] * read[1]) / jnp.sum(read)  # A = -1 and unclipped: -(-ratio)

    want = jax.grad(row_1_alone)(params)
    for name in params:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6)


REWARD = """
def exact(prompts, completions, answer, completion_ids, **columns):
    assert len(prompts) == len(completions) == len(answer) == len(completion_ids)
    assert all(isinstance(c, str) for c in completions) and "level" in columns
    return [float(c == a) for c, a in zip(completions, answer)]
"""


def test_a_user_task_and_reward_train_and_compare_reads_the_rewards(tmp_path):
    """GRPO on a JSON lines task with a TRL-style reward file (the same call as run.py's), through
    compare.py's @grpo: every step scores batch x group completions, the table reads val/reward,
    and a run continued from the first one's params.npz starts where it ended."""
    rows = [{"prompt": f"{w}=", "answer": w[-1], "level": 1} for w in ("ab", "cd", "ef", "gh") * 5]
    (tmp_path / "task.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "reward.py").write_text(REWARD)
    common = (
        f"--task {tmp_path / 'task.jsonl'} --reward {tmp_path / 'reward.py'}:exact "
        f"--completion_bytes 2 --n_embd 8 --n_layer 1 --validation_batch_size 4 --dir_path {CACHE}"
    )
    args = compare.CompareArgs(
        variants=("grpo=@grpo --network mingru --batch_size 3 --group_size 4",),
        data=("stdlib",),  # not read: GRPO reads the task
        seeds=(0,),
        num_epochs=4,
        report_at=(4,),
        validate_every=2,
        completions=24,
        metric="reward",
        flags=common,
        runs_dir=str(tmp_path / "runs"),
    )
    text = compare.compare(args)
    (folder,) = (tmp_path / "runs").iterdir()
    run_folder = folder / "grpo-stdlib-seed0"
    lines = [json.loads(x) for x in (run_folder / "metrics.jsonl").read_text().splitlines()]
    assert [x["perf/completions"] for x in lines] == [12] * 4
    assert all(0 <= x["train/reward"] <= 1 for x in lines)
    cells = text.splitlines()[1].split()
    assert cells[1] == f"{lines[3]['val/reward']:.3f}"  # generation 4
    assert cells[2] == f"{lines[1]['val/reward']:.3f}"  # 24 completions: generation 2's
    again = cli(
        *common.split(),
        "--network",
        "mingru",
        "--init_from",
        str(run_folder),
        "--num_epochs",
        "1",
        "--runs_dir",
        str(tmp_path),
        "--run_name",
        "again",
        script="baselines/grpo.py",
    )
    assert again.returncode == 0, again.stderr[-2000:]
    first = json.loads((tmp_path / "again" / "metrics.jsonl").read_text())
    with np.load(run_folder / "params.npz") as saved:
        assert set(saved.files) == set(backprop.init_mingru(jax.random.key(0), tiny("mingru")))
    assert "val/reward" in first


def test_grpo_refuses_a_run_without_a_task_and_a_start_of_another_shape(tmp_path):
    one_line_error(cli("--num_epochs", "1", script="baselines/grpo.py"), "give --task")
    (tmp_path / "start").mkdir()
    np.savez(tmp_path / "start" / "params.npz", emb=np.zeros((256, 4)))
    done = cli(
        "--task",
        "addition",
        "--init_from",
        str(tmp_path / "start"),
        "--n_embd",
        "8",
        "--n_layer",
        "1",
        "--num_epochs",
        "1",
        "--runs_dir",
        str(tmp_path),
        script="baselines/grpo.py",
    )
    one_line_error(done, "its parameters are not a mingru of --n_embd 8 --n_layer 1")


def test_a_reward_that_fails_stops_grpo_in_one_line_with_run_pys_code(tmp_path):
    rows = [{"prompt": f"{w}=", "answer": w[-1]} for w in ("ab", "cd") * 4]
    (tmp_path / "task.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "reward.py").write_text(
        "def broken(prompts, completions, **kw):\n    return [1.0]\n"
    )
    done = cli(
        "--task", str(tmp_path / "task.jsonl"), "--reward", f"{tmp_path / 'reward.py'}:broken",
        "--n_embd", "8", "--n_layer", "1", "--batch_size", "2", "--group_size", "2",
        "--num_epochs", "1", "--runs_dir", str(tmp_path), script="baselines/grpo.py",
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 65 and len(lines) == 1 and "broken" in lines[0], done.stderr
