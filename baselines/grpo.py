"""A policy-gradient baseline on egg-jax's rewards: GRPO (group relative policy optimisation) on the
float32 models of baselines/backprop.py, the same task, prompts, held-out split and reward
functions as run.py --objective reward (egg/tasks.py reads the task and calls the rewards the same
way), so that integer ES and backpropagation's policy gradient are measured on one footing.

    python baselines/grpo.py --task addition --network mingru --n_embd 64 --n_layer 2 \
        --init_from runs/backprop-mingru-addition-seed0 --batch_size 32 --group_size 8 \
        --completion_bytes 3 --num_epochs 500 --validate_every 50

Each step draws --batch_size training prompts (in run.py's order: one fixed shuffle, wrapping), and
--group_size completions of each (up to --completion_bytes bytes, drawn at --policy_temperature,
ending at the task's stop byte); the rewards are scored on the host (tasks.score, TRL's signature),
and each completion's advantage is its reward less its group's mean, over the group's standard
deviation (plus 1e-4: a group whose rewards tie teaches nothing). The loss is PPO's clipped
surrogate, -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) with ratio = p_new / p_old of each byte
written (its stop byte included), averaged over every byte the batch wrote; --iterations Adam steps
are taken on each batch of completions (1, TRL's default: the ratio is 1 and the loss plain
REINFORCE with a group baseline); no KL term (TRL's default, beta = 0). Validation writes greedy
completions of the first --validation_batch_size held-out prompts, as run.py validates: val/reward
and val/accuracy (the share with the task's full reward).

The flags are run.py's and baselines/backprop.py's (--network, --learning_rate, --batch_size:
prompts a step, --train_seconds, --init_from: a baselines/ run's folder, its params.npz) and these
few. A run writes <runs_dir>/<run_name>/metrics.jsonl with run.py's fields (a step is a
"generation"; perf/completions: completions scored that step) and params.npz at its end.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from baselines import backprop  # noqa: E402  (the float models, the writer, the run's folder)
from egg import UserError, tasks  # noqa: E402


@dataclass(frozen=True)
class Args(backprop.Args):
    learning_rate: float = 1e-4
    """Adam's step size (gradients clipped to norm 1; chosen on addition from a pretrained start,
    docs/results.org)"""
    batch_size: int = 32
    """prompts a step, each written --group_size times"""
    policy_temperature: float = 1.0
    """the temperature completions are drawn at while training (validation writes greedily)"""
    clip: float = 0.2
    """PPO's clip: the ratio p_new / p_old counts within [1 - clip, 1 + clip]"""
    iterations: int = 1
    """Adam steps on each batch of completions (TRL's num_iterations)"""


def log_probs(forward, params, buffer, length: int):
    """(N, C) log p of each byte written after the `length` prompt bytes of make_writer's buffer."""
    logits, _ = forward(params, backprop.zero_state(params, buffer.shape[0]), buffer[:, :-1])
    logp = jax.nn.log_softmax(logits[:, length - 1 :].astype(jnp.float32))
    return jnp.take_along_axis(logp, buffer[:, length:, None].astype(jnp.int32), axis=-1)[..., 0]


def advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """Each reward less its group's mean, over the group's standard deviation plus 1e-4; rewards
    (B G,) in groups of G consecutive."""
    grouped = rewards.reshape(-1, group)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    return (centred / (grouped.std(axis=1, keepdims=True) + 1e-4)).reshape(-1)


def surrogate(forward, params, buffer, read, advantage, old, length: int, clip: float):
    """PPO's clipped surrogate loss of a batch of completions: -min(ratio A, clip(ratio) A), ratio =
    p / p_old of each byte written, averaged over the bytes `read` marks. buffer (N, L + C) uint8,
    read (N, C) bool, advantage (N,), old (N, C): the bytes' log p when they were drawn."""
    ratio = jnp.exp(log_probs(forward, params, buffer, length) - old)
    a = advantage[:, None]
    kept = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip, 1 + clip) * a)
    return -jnp.sum(kept * read) / jnp.maximum(jnp.sum(read), 1)


def make_update(forward, optimizer, length: int, clip: float):
    """update(params, opt_state, buffer, read, advantage, old) -> (params, opt_state, loss): one
    Adam step on the clipped surrogate of a batch of completions."""

    @jax.jit
    def update(params, opt_state, buffer, read, advantage, old):
        loss = partial(surrogate, forward, buffer=buffer, read=read, advantage=advantage, old=old)
        value, grads = jax.value_and_grad(loss)(params, length=length, clip=clip)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return update


def train(args: Args) -> dict:
    """GRPO for --num_epochs steps (or until --train_seconds), validating every --validate_every
    and at the end; write the run's metrics.jsonl and params.npz; return the last metrics."""
    if not args.tasks.task:
        raise UserError("give --task: the prompts and the reward GRPO trains on")
    task = tasks.open_task(args.tasks)
    prompts, valid_prompts = backprop.task_prompts(task, args)
    length, group = prompts.shape[1], args.group_size
    backprop.check_window(args, length + args.reward.completion_bytes, "a completion")
    _, forward = backprop.MODELS[args.network]
    write = backprop.make_writer(forward, args.reward.completion_bytes, task.stop)
    params = backprop.start_params(args)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.learning_rate))
    opt_state = optimizer.init(params)
    update = make_update(forward, optimizer, length, args.clip)
    old_log_probs = jax.jit(lambda params, buffer: log_probs(forward, params, buffer, length))
    order = np.random.default_rng(0).permutation(len(prompts))  # run.py's order (read_prompts)
    key, folder = jax.random.key(args.seed), backprop.run_folder(args, "grpo")
    metrics, trained, count = {}, 0.0, args.batch_size * group
    with open(folder / "metrics.jsonl", "w") as record:
        for generation in range(args.num_epochs):
            tick = time.time()
            rows = np.repeat(
                order[(generation * args.batch_size + np.arange(args.batch_size)) % len(order)],
                group,
            )
            buffer, read = write(
                params,
                jnp.asarray(prompts[rows]),
                jax.random.fold_in(key, generation),
                args.policy_temperature,
            )
            written = backprop.completions_of(buffer, length, task.stop)  # sync point
            rewards = tasks.score(task, task.train, rows, written)
            advantage = jnp.asarray(advantages(rewards, group), jnp.float32)
            old = old_log_probs(params, buffer)
            for _ in range(args.iterations):
                params, opt_state, loss = update(params, opt_state, buffer, read, advantage, old)
            loss = float(loss)  # sync point: the step has ended
            seconds, done = time.time() - tick, generation + 1
            trained += seconds if done > 1 else 0.0  # the first step compiles
            timed_out = bool(args.train_seconds) and trained >= args.train_seconds
            metrics = {
                "train/reward": float(np.mean(rewards)),
                "train/reward_std": float(np.std(rewards)),
                "train/loss": loss,
                "perf/seconds": seconds,
                "perf/completions": count,
                "perf/tokens_per_s": float(np.asarray(read).sum()) / seconds,
            }
            if (
                done == args.num_epochs
                or timed_out
                or (args.validate_every and done % args.validate_every == 0)
            ):
                metrics.update(backprop.validate_completions(write, params, task, valid_prompts))
                print(
                    f"step {done}: validation reward {metrics['val/reward']:.3f}, "
                    f"accuracy {metrics['val/accuracy']:.3f}",
                    flush=True,
                )
            record.write(json.dumps({"generation": done, **metrics}) + "\n")
            record.flush()
            if timed_out:
                break
    backprop.save_params(params, folder)
    return metrics


def main(argv: list[str] | None = None) -> None:
    backprop.main(argv, Args, train)


if __name__ == "__main__":
    main()
