"""Pretrain, then train on a reward: for each seed, run.py on a task's worked examples (likelihood),
then run.py --init_from that run's best checkpoint with --objective reward on the same task; one
table of held-out reward and accuracy (greedy completions of the held-out prompts, as run.py
validates them): of the pretrained model, at the reward run's first and last validations, with the
population's training reward at its start and end, beside what writing the training prompts'
most frequent answer for every prompt earns.

    python scripts/rewards.py --task addition --seeds 0 1 2 \\
        --pretrain="--n_embd 32 --n_layer 1 --num_epochs 1500 --validate_every 250" \\
        --reward="--num_epochs 1500 --validate_every 250 --parallel_generations_per_gpu 2048 \\
                  --group_size 8 --completion_bytes 3"

Every run is `python run.py ...` in runs/ under --folder (reused where it has finished: delete the
folder to run again); the table is printed and written there as table.txt.
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import run  # noqa: E402
from egg import cluster, tasks  # noqa: E402


@dataclass(frozen=True)
class Args:
    task: str = "addition"
    """the task (run.py's --task): its worked examples to pretrain on, its prompts and reward"""
    reward_flags: str = ""
    """--reward and any other flag of the task (e.g. '--reward my.py:f'), for both stages"""
    seeds: tuple[int, ...] = (0, 1, 2)
    """seeds of both stages"""
    pretrain: str = "--n_embd 32 --n_layer 1 --num_epochs 1500 --validate_every 250"
    """run.py flags of the pretraining (likelihood of the task's worked examples)"""
    reward: str = "--num_epochs 1500 --validate_every 250"
    """run.py flags of the reward run (--objective reward, --init_from the pretraining's best)"""
    folder: str = "runs/rewards"
    """where the runs and the table go"""


def train(flags: list[str], folder: Path) -> None:
    """python run.py FLAGS into `folder` (its record), unless it has already finished."""
    if (folder / "checkpoints" / "LATEST").exists():
        return
    command = [sys.executable, str(ROOT / "run.py"), *flags]
    print("$ " + shlex.join(command), flush=True)
    subprocess.run(command, check=True)


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def held_out(checkpoint: Path, args: Args, mesh) -> dict:
    """val/reward and val/accuracy of a checkpoint's model, as run.py validates a reward run (on
    this process's `mesh`)."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    model = {k: meta["training"][k] for k in run.model_settings(meta["training"])}
    given = ["--objective", "reward", "--task", args.task, *shlex.split(args.reward_flags)]
    flags = run.single_run(run.parse_args([*given, *shlex.split(args.reward)]), **model)
    cfg = run.mesh_config(flags, mesh)
    data = run.read_data(flags, cfg, mesh)
    with np.load(checkpoint / "params.npz") as saved:
        params = {k: saved[k][None] for k in saved.files}
    return run.validate(cfg, run.make_completer(cfg, mesh), params, data).metrics[0]


def constant_answer(args: Args) -> dict:
    """What writing the training prompts' most frequent answer for every held-out prompt earns."""
    task = tasks.open_task(
        run.parse_args(["--task", args.task, *shlex.split(args.reward_flags)]).tasks
    )
    answer = Counter(task.train.columns["completion"]).most_common(1)[0][0]
    valid = range(len(task.valid.prompts))
    rewards = tasks.score(task, task.valid, valid, [answer.encode()] * len(valid))
    return {"answer": answer, "val/reward": float(np.mean(rewards))}


def summary(values: list[float]) -> str:
    mean = statistics.mean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3f} +- {spread:.3f}"


def main(args: Args) -> str:
    base, rows = Path(args.folder), []
    run.prepare_jax(run.parse_args(["--cpu_devices", "1"]))  # this process reads on one device
    mesh = cluster.population_mesh(run.POP)
    common = ["--task", args.task, *shlex.split(args.reward_flags), "--runs_dir", str(base)]
    for seed in args.seeds:
        pre, rewarded = base / f"pretrain-seed{seed}", base / f"reward-seed{seed}"
        own = [*common, "--seed", str(seed)]
        train([*own, *shlex.split(args.pretrain), "--run_name", pre.name], pre)
        best = pre / "checkpoints" / (pre / "checkpoints" / "BEST").read_text().strip()
        reward = ["--objective", "reward", "--init_from", f"{pre}:best", *shlex.split(args.reward)]
        train([*own, *reward, "--run_name", rewarded.name], rewarded)
        lines = records(rewarded)
        validated = [x for x in lines if "val/reward" in x]
        start, end = (
            np.mean([x["train/reward"] for x in part]) for part in (lines[:100], lines[-100:])
        )
        rows.append(
            {
                "seed": seed,
                "pretrained": held_out(best, args, mesh),
                "first": validated[0],
                "last": validated[-1],
                "train": (float(start), float(end)),
            }
        )
    constant = constant_answer(args)
    said = [
        f"task {args.task}: held-out reward (accuracy) of greedy completions; train: the "
        "population's reward over its first and last 100 generations",
        f"{'seed':>4} {'pretrained':>16} {'first report':>24} {'last report':>24} {'train':>15}",
    ]
    for r in rows:
        shown = [
            f"{r['pretrained']['val/reward']:7.3f} ({r['pretrained']['val/accuracy']:.3f})",
            *(
                f"{x['val/reward']:7.3f} ({x['val/accuracy']:.3f}) at {x['generation']:>5}"
                for x in (r["first"], r["last"])
            ),
            f"{r['train'][0]:6.3f} -> {r['train'][1]:.3f}",
        ]
        said.append(f"{r['seed']:>4} " + " ".join(shown))
    for name, pick in (
        ("pretrained", lambda r: r["pretrained"]["val/reward"]),
        ("first report", lambda r: r["first"]["val/reward"]),
        ("last report", lambda r: r["last"]["val/reward"]),
    ):
        said.append(f"mean +- sd, {name}: {summary([pick(r) for r in rows])}")
    said.append(
        f"the training prompts' most frequent answer ({constant['answer']!r}) for every held-out "
        f"prompt: {constant['val/reward']:.3f}"
    )
    text = "\n".join(said)
    print(text)
    base.mkdir(parents=True, exist_ok=True)
    (base / "table.txt").write_text(text + "\n")
    return text


if __name__ == "__main__":
    main(tyro.cli(Args))
