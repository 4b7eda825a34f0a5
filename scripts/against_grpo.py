"""Integer ES against GRPO on tasks' rewards: for each task and seed, each method from its own
pretrained start of one size, then at equal training time and at equal completions scored.

    python scripts/against_grpo.py --tasks addition countdown reverse addition2 --seeds 0 1 2 \\
        --folder runs/against-grpo --plot docs/grpo.png

For each task and seed, every run a command of its own (run.py, baselines/backprop.py,
baselines/grpo.py) into --folder, reused where it has finished (delete a run's folder to run it
again):
1. Pretraining on the task's worked examples (its likelihood): int8 ES (run.py --task, the
   --model flags, --pretrain_generations), then the same network in float32 with Adam
   (baselines/backprop.py --network mingru, EGG's model in float) for as many training seconds as
   the ES run took.
2. From each start, for as many seconds as the ES reward run takes (--generations): int8 ES on the
   reward (run.py --objective reward --init_from, the objective's preset and --es flags), GRPO on
   the same reward, prompts and held-out split (baselines/grpo.py, --grpo flags); and each method
   continued on the likelihood of the worked examples (the answers of the training prompts) for the
   same time: ES (run.py, the generations that take that long at the pretraining's pace) and Adam.
3. From random weights, the same time: ES on the reward and GRPO.

The table: held-out reward (accuracy) of greedy completions of the held-out prompts, mean +- sample
sd over the seeds, of each start, and of each run at the last validation within the ES reward run's
training seconds (1% more: a run given seconds ends at the step that passes them), and within as
many completions scored as the fewer of the two reward methods scored (ES and GRPO from pretrained
starts; "-" where a run scores none; a run from a pretrained start with no validation within reads
as its start). Training seconds exclude compilation and validation, as compare.py counts them.
--plot draws the reward runs' curves against generations (steps), training seconds and completions
(compare.py's plot).
Time is only comparable within one machine and one core: pin the command (taskset -c N).
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import compare  # noqa: E402
import run  # noqa: E402
from egg import cluster, tasks  # noqa: E402
from scripts import rewards  # noqa: E402


@dataclass(frozen=True)
class Args:
    tasks: tuple[str, ...] = ("addition",)
    """tasks (run.py's --task), each compared on its own"""
    reward_flags: str = ""
    """--reward and any other flag of the tasks (e.g. '--reward my.py:f'), for every run"""
    seeds: tuple[int, ...] = (0, 1, 2)
    """seeds of every run"""
    model: str = "--n_embd 64 --n_layer 2"
    """the size, run.py's flags (the float model is built to the same --n_embd and --n_layer)"""
    pretrain_generations: int = 800
    """ES pretraining generations (Adam then trains as many seconds as they took)"""
    pretrain: str = "--parallel_generations_per_gpu 256 --validate_every 100"
    """run.py flags of the ES pretraining"""
    adam: str = "--batch_size 64 --window 128 --learning_rate 2e-3 --validate_every 100"
    """baselines/backprop.py flags of the Adam pretraining and likelihood runs"""
    generations: int = 750
    """ES reward generations (every other run of the stage trains as many seconds as they took)"""
    es: str = "--parallel_generations_per_gpu 2048 --group_size 8 --validate_every 50"
    """run.py flags of the ES reward runs"""
    grpo: str = "--batch_size 32 --group_size 8 --learning_rate 1e-4 --validate_every 100"
    """baselines/grpo.py flags of the GRPO runs"""
    folder: str = "runs/against-grpo"
    """where the runs and the table go"""
    plot: str = ""
    """also draw the reward runs' curves into this PNG file"""


def completion_bytes(task: str, reward_flags: str) -> int:
    """Bytes a completion may take: the longest training answer and its stop byte."""
    given = run.parse_args(["--task", task, *shlex.split(reward_flags)])
    rows = tasks.open_task(given.tasks, rewarded=False).train
    return 1 + max(len(str(a).encode()) for a in rows.columns["completion"])


def train(script: str, flags: list[str], folder: Path, done: str) -> None:
    """python SCRIPT FLAGS into `folder`, unless the file `done` shows it has finished."""
    if (folder / done).exists():
        return
    command = [sys.executable, str(ROOT / script), *flags]
    print("$ " + shlex.join(command), flush=True)
    if subprocess.run(command, stdout=subprocess.DEVNULL).returncode:
        raise SystemExit(f"error: the run into {folder} failed (its command above)")


def total(folder: Path, clock: str = "elapsed") -> float:
    """A run's last reading of a compare.py clock: its training seconds (compilation and validation
    excluded) or its completions scored."""
    counted = compare.read_run(folder)[clock]
    return counted[max(counted)]


def seconds_of(folder: Path) -> float:
    return total(folder)


def held_out_at_end(folder: Path, task: str, args: Args, length: int, mesh) -> dict:
    """val/reward and val/accuracy of a run.py run's newest checkpoint (scripts/rewards.py's)."""
    newest = folder / "checkpoints" / (folder / "checkpoints" / "LATEST").read_text().strip()
    flags = rewards.Args(task, args.reward_flags, reward=f"--completion_bytes {length}")
    return rewards.held_out(newest, flags, mesh)


def last_validation(folder: Path) -> dict:
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "val/reward" in x][-1]


SLACK = 1.01  # a run given --train_seconds ends at the step that reaches them: a step past them


def within(folder: Path, limit: float, clock: str, start=None) -> tuple[float, float]:
    """(reward, accuracy) at the last validation within `limit` (times SLACK) on `clock`; where
    none is, the run's `start` (its pretrained model's), else nan."""
    found = tuple(
        compare.at_wall_time(compare.read_run(folder, m), limit * SLACK, clock=clock)
        for m in ("reward", "accuracy")
    )
    return start if math.isnan(found[0]) and start is not None else found


def summary(pairs: list[tuple[float, float]]) -> str:
    """Reward (accuracy), each mean +- sample sd over the seeds; '-' where none."""
    kept = [p for p in pairs if not math.isnan(p[0])]
    if not kept:
        return "-"
    parts = []
    for values in zip(*kept, strict=True):
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        parts.append(f"{statistics.mean(values):.3f} +- {spread:.3f}")
    return f"{parts[0]} ({parts[1]})"


def compare_task(task: str, args: Args, mesh) -> tuple[str, dict]:
    """The task's runs, trained where they have not finished; its table, and the reward runs'
    results as compare.plot takes them."""
    base, size = Path(args.folder) / Path(task).stem, shlex.split(args.model)
    length = completion_bytes(task, args.reward_flags)
    task_flags = ["--task", task, *shlex.split(args.reward_flags), "--runs_dir", str(base)]
    rewarded = [*task_flags, "--completion_bytes", str(length)]  # where completions are written
    cells, curves = {}, {"ES, reward": [], "GRPO": [], "ES from random": [], "GRPO from random": []}
    for seed in args.seeds:
        own = ["--seed", str(seed)]
        pre, adam = base / f"es-pretrain-seed{seed}", base / f"adam-pretrain-seed{seed}"
        train(
            "run.py",
            [*task_flags, *own, *size, *shlex.split(args.pretrain), "--run_name", pre.name]
            + ["--num_epochs", str(args.pretrain_generations)],
            pre,
            "checkpoints/LATEST",
        )
        pace = seconds_of(pre) / (args.pretrain_generations - 1)  # a generation, the first apart
        float_size = ["--network", "mingru", *size, *shlex.split(args.adam)]
        train(
            "baselines/backprop.py",
            [*rewarded, *own, *float_size, "--run_name", adam.name, "--num_epochs", "10000000"]
            + ["--train_seconds", f"{seconds_of(pre):.3f}"],
            adam,
            "params.npz",
        )
        es = base / f"es-reward-seed{seed}"
        es_flags = ["--objective", "reward", *shlex.split(args.es), "--num_epochs"]
        train(
            "run.py",
            [*rewarded, *own, *es_flags, str(args.generations), "--run_name", es.name]
            + ["--init_from", str(pre)],
            es,
            "checkpoints/LATEST",
        )
        budget = f"{seconds_of(es):.3f}"
        timed = ["--num_epochs", "10000000", "--train_seconds", budget]
        runs = {
            "grpo": (["--init_from", str(adam), *size], "baselines/grpo.py", "params.npz"),
            "adam-likelihood": (
                ["--init_from", str(adam), *float_size],
                "baselines/backprop.py",
                "params.npz",
            ),
            "es-likelihood": (
                ["--init_from", str(pre), *shlex.split(args.pretrain), "--num_epochs"]
                + [str(round(seconds_of(es) / pace) + 1)],
                "run.py",
                "checkpoints/LATEST",
            ),
            "es-random": (
                [*size, *es_flags, str(args.generations)],
                "run.py",
                "checkpoints/LATEST",
            ),
            "grpo-random": ([*size], "baselines/grpo.py", "params.npz"),
        }
        for name, (flags, script, done) in runs.items():
            if script == "baselines/grpo.py":
                flags = [*flags, "--network", "mingru", *shlex.split(args.grpo), *timed]
            elif script == "baselines/backprop.py":
                flags = [*flags, *timed]
            given = task_flags if name == "es-likelihood" else rewarded
            folder = base / f"{name}-seed{seed}"
            train(script, [*given, *own, *flags, "--run_name", folder.name], folder, done)
        folders = {name: base / f"{name}-seed{seed}" for name in runs} | {"es": es}
        scored = min(total(folders[k], "completions") for k in ("es", "grpo"))
        limit = seconds_of(es)
        es_start = held_out_at_end(pre, task, args, length, mesh)
        es_ll = held_out_at_end(folders["es-likelihood"], task, args, length, mesh)
        adam_start = last_validation(adam)
        es_begins = (es_start["val/reward"], es_start["val/accuracy"])
        adam_begins = (adam_start["val/reward"], adam_start["val/accuracy"])
        rows = {
            "ES pretrained (the start)": (es_begins,) * 2,
            "Adam pretrained (the start)": (adam_begins,) * 2,
            "int8 ES, reward": (
                within(es, limit, "elapsed", es_begins),
                within(es, scored, "completions", es_begins),
            ),
            "GRPO, reward": (
                within(folders["grpo"], limit, "elapsed", adam_begins),
                within(folders["grpo"], scored, "completions", adam_begins),
            ),
            "int8 ES, likelihood": (
                (es_ll["val/reward"], es_ll["val/accuracy"]),
                (math.nan, math.nan),
            ),
            "Adam, likelihood": (
                within(folders["adam-likelihood"], limit, "elapsed"),
                (math.nan, math.nan),
            ),
            "int8 ES, reward, from random": (
                within(folders["es-random"], limit, "elapsed"),
                within(folders["es-random"], scored, "completions"),
            ),
            "GRPO, reward, from random": (
                within(folders["grpo-random"], limit, "elapsed"),
                within(folders["grpo-random"], scored, "completions"),
            ),
        }
        for name, pair in rows.items():
            cells.setdefault(name, ([], []))
            cells[name][0].append(pair[0])
            cells[name][1].append(pair[1])
        cells.setdefault("seconds, completions", []).append((limit, scored))
        for name, key in (
            ("ES, reward", "es"),
            ("GRPO", "grpo"),
            ("ES from random", "es-random"),
            ("GRPO from random", "grpo-random"),
        ):
            curves[name].append(compare.read_run(folders[key], "reward"))
    budgets = cells.pop("seconds, completions")
    constant = rewards.constant_answer(rewards.Args(task, args.reward_flags))
    said = [
        f"task {task}: held-out reward (accuracy), mean +- sd over seeds {list(args.seeds)}; "
        f"training seconds {min(b[0] for b in budgets):.1f}-{max(b[0] for b in budgets):.1f}, "
        f"completions {min(b[1] for b in budgets):,}-{max(b[1] for b in budgets):,}",
        f"{'':30} {'equal time':>34} {'equal completions':>34}",
    ]
    for name, (timed_cells, scored_cells) in cells.items():
        said.append(f"{name:30} {summary(timed_cells):>34} {summary(scored_cells):>34}")
    said.append(
        f"the most frequent training answer ({constant['answer']!r}) for every prompt: "
        f"{constant['val/reward']:.3f}"
    )
    return "\n".join(said), curves


def main(args: Args) -> str:
    run.prepare_jax(run.parse_args(["--cpu_devices", "1"]))  # this process reads on one device
    mesh = cluster.population_mesh(run.POP)
    texts, results = [], {}
    for task in args.tasks:
        text, results[task] = compare_task(task, args, mesh)
        print(text, flush=True)
        texts.append(text)
    text = "\n\n".join(texts)
    Path(args.folder).mkdir(parents=True, exist_ok=True)
    (Path(args.folder) / "table.txt").write_text(text + "\n")
    if args.plot:
        shown = compare.CompareArgs(data=args.tasks, metric="reward")
        compare.plot(shown, results).savefig(args.plot, dpi=100)
    return text


if __name__ == "__main__":
    main(tyro.cli(Args))
