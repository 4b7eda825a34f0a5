"""Learning comparison: train named variants of run.py on the same data for several seeds and print
one table of validation bits/byte (mean +- sample standard deviation over the seeds) at fixed
generations and at a fixed wall time, beside the unigram and bigram baselines. A variant that
trains replicas (--replicas) reports its best replica, and in a second row its median replica.

    python compare.py --data english.txt stdlib --variants "egg=" "upstream=--algorithm upstream" \
        --flags="--n_embd 64 --n_layer 2 --parallel_generations_per_gpu 256" --num_epochs 1000

Every run is `python run.py FLAGS --data CORPUS --seed S --num_epochs N ... VARIANT`, one after
another (each uses the whole machine), its metrics read back from its metrics.jsonl; a variant's
flags come last, so they win over the common ones (e.g. its own --num_epochs). A variant whose flags
start with @backprop runs baselines/backprop.py instead (a float32 model trained by backpropagation
on the same bytes, e.g. "gru=@backprop --network mingru --num_epochs 1000": steps, not generations);
@grpo runs baselines/grpo.py (a float32 model trained by GRPO on a --task's reward). --metric picks
what is read: val/bits_per_byte, or a reward run's val/reward or val/accuracy (then the third clock
is completions scored, not bytes).
The wall-time column is the last validation reached within --wall_seconds of training (compilation
and validation excluded), the bytes column the last within --train_bytes bytes trained on, so
validate often (--validate_every) for them to mean much. --plot draws every variant's curves against
generations, training seconds and training bytes (and writes the table beside it, as NAME.txt);
--reuse reads runs an earlier comparison made, refusing any whose command (compare.json beside it)
differs from this comparison's. Each run's progress bar shows as it trains, each start says about
how long is left, and the table is also written to the comparison's folder (table.txt).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent
BASELINES = {
    "@backprop": "baselines/backprop.py",
    "@grpo": "baselines/grpo.py",
}  # a variant's first word


@dataclass(frozen=True)
class CompareArgs:
    variants: tuple[str, ...] = ("egg=", "upstream=--algorithm upstream")
    """NAME=FLAGS, one per variant: the run.py flags that make it (empty for the defaults)"""
    data: tuple[str, ...] = ("stdlib",)
    """corpora, each as run.py's --data takes it; a file NAME_train.bin with a NAME_valid.bin beside
    it is validated on that file"""
    seeds: tuple[int, ...] = (0, 1, 2)
    """seeds of every variant on every corpus"""
    num_epochs: int = 300
    """generations of every run"""
    report_at: tuple[int, ...] = (300,)
    """generations at which the table reports validation (each a multiple of --validate_every)"""
    validate_every: int = 100
    """generations between validations of every run"""
    wall_seconds: float = 0.0
    """also report the last validation within this many seconds of training (0: no such column)"""
    train_bytes: float = 0.0
    """also report the last validation within this many training bytes (0: no such column)"""
    completions: float = 0.0
    """also report the last validation within this many completions scored (reward runs; 0: no
    such column)"""
    plot: str = ""
    """also draw the validation curves into this PNG file (mean line, spread band per variant)"""
    metric: str = "bits_per_byte"
    """what the table and the plot read, val/METRIC: bits_per_byte, or reward or accuracy where the
    runs validate a task's reward (run.py --objective reward, @grpo)"""
    flags: str = ""
    """run.py flags common to every run"""
    runs_dir: str = "runs/compare"
    """folder that gets one subfolder per comparison (its start time), holding the runs' folders"""
    reuse: tuple[str, ...] = ()
    """folders of earlier comparisons: a run whose folder (NAME-CORPUS-seedS) one of them holds is
    read from there, not trained again (so that one table or plot can join several comparisons)"""


def parse_variants(specs: tuple[str, ...]) -> dict[str, list[str]]:
    variants = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name in variants:
            raise SystemExit(f"error: --variants {spec!r}: give NAME=FLAGS with a name used once")
        variants[name] = shlex.split(flags)
    return variants


def data_flags(corpus: str) -> list[str]:
    """--data CORPUS, and --valid_data for a NAME_train.bin with its NAME_valid.bin beside it."""
    valid = Path(corpus.replace("_train.", "_valid."))
    return ["--data", corpus] + (
        ["--valid_data", str(valid)] if "_train." in corpus and valid.exists() else []
    )


def corpus_label(corpus: str) -> str:
    """The corpus's name in the table: its file's stem, less a '_train' suffix."""
    stem = Path(corpus).stem
    return stem.removesuffix("_train")


def read_run(folder: Path, metric: str = "bits_per_byte") -> dict:
    """{generation: validation val/METRIC}, training seconds, bytes and completions scored to each
    generation, and baselines."""
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    seconds, elapsed, validation, median, baselines = 0.0, {}, {}, {}, {}
    trained, tokens, scored, completions = 0.0, {}, 0, {}
    for line in lines:
        seconds += line.get("perf/seconds", 0.0) if line["generation"] > 1 else 0.0  # 1 compiles
        elapsed[line["generation"]] = seconds
        # bytes predicted (or written)
        trained += line.get("perf/tokens_per_s", 0.0) * line.get("perf/seconds", 0.0)
        tokens[line["generation"]] = trained
        scored += line.get("perf/completions", 0)
        completions[line["generation"]] = scored
        if f"val/{metric}" in line:  # with --replicas: the best replica's
            validation[line["generation"]] = line[f"val/{metric}"]
            baselines = {k[4:-14]: v for k, v in line.items() if k.endswith("gram_bits_per_byte")}
            replicas = [
                v
                for k, v in line.items()
                if k.startswith("replica/") and k.endswith(f"/val/{metric}")
            ]
            if replicas:
                median[line["generation"]] = statistics.median(replicas)
    return {
        "validation": validation,
        "median": median,
        "elapsed": elapsed,
        "tokens": tokens,
        "completions": completions,
        "baselines": baselines,
    }


def at_wall_time(
    run: dict, seconds: float, key: str = "validation", clock: str = "elapsed"
) -> float:
    """The last validation reached within `seconds` of training (clock "tokens": within so many
    training bytes; "completions": so many completions scored)."""
    reached = [g for g in run[key] if run[clock][g] <= seconds]
    return run[key][max(reached)] if reached else float("nan")


def summarise(values: list[float]) -> str:
    """Mean +- sample sd of the values reached (a run with no validation in time has none: nan)."""
    values = [v for v in values if v == v]
    if len(values) < 2:
        return f"{values[0]:.3f}" if values else "-"
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}"


def table(args: CompareArgs, results: dict) -> str:
    """One row per variant, one column per corpus and reporting point, baselines below."""
    columns = [f"gen {g}" for g in args.report_at] + (
        [f"{args.wall_seconds:g} s"] * bool(args.wall_seconds)
    )
    columns += [f"{args.train_bytes:.3g} B"] * bool(args.train_bytes)
    columns += [f"{args.completions:.3g} c"] * bool(args.completions)
    header = [f"{'variant':12}"] + [
        f"{corpus_label(c)[:12]} {col:>9}".rjust(22) for c in args.data for col in columns
    ]
    rows = [" ".join(header)]
    for name in parse_variants(args.variants):
        # a variant with --replicas: its best replica, and a second row for the median replica
        with_replicas = any(
            r["median"] for runs in (results[c][name] for c in args.data) for r in runs
        )
        for key, label in (("validation", name), ("median", f"{name}, median")):
            if key == "median" and not with_replicas:
                continue
            cells = []
            for corpus in args.data:
                runs = results[corpus][name]
                for g in args.report_at:
                    cells.append(summarise([r[key][g] for r in runs if g in r[key]]))
                if args.wall_seconds:
                    cells.append(summarise([at_wall_time(r, args.wall_seconds, key) for r in runs]))
                for clock, limit in (
                    ("tokens", args.train_bytes),
                    ("completions", args.completions),
                ):
                    if limit:
                        cells.append(summarise([at_wall_time(r, limit, key, clock) for r in runs]))
            rows.append(" ".join([f"{label:12}"] + [c.rjust(22) for c in cells]))
    for baseline in ("unigram", "bigram"):
        cells = []
        for corpus in args.data:
            first = next(iter(results[corpus].values()))[0]["baselines"].get(baseline, float("nan"))
            cells += [f"{first:.3f}".rjust(22)] * len(columns)
        rows.append(" ".join([f"{baseline:12}"] + cells))
    return "\n".join(rows)


def recorded_flags(command: list[str]) -> list[str]:
    """A run's command as compare.py records it beside the run (compare.json) and checks it on
    --reuse: the script and its flags, less where the run's folder lies (--runs_dir)."""
    at = command.index("--runs_dir")
    return [Path(command[1]).name, *command[2:at], *command[at + 2 :]]


def flag_items(words: list[str]) -> list[str]:
    """A command's words as its items: each flag with its values ("--seeds 0 1"), the script
    alone."""
    items = []
    for word in words:
        if word.startswith("--") or not items:
            items.append(word)
        else:
            items[-1] += f" {word}"
    return items


def reused(earlier: Path, command: list[str], metric: str) -> dict:
    """An earlier run's results, once its recorded command is this comparison's for it (else one
    line and exit 2: a table must never join runs of different flags)."""
    try:
        before = json.loads((earlier / "compare.json").read_text())["command"]
    except (OSError, ValueError, KeyError):
        sys.exit(
            f"error: --reuse {earlier}: it records no compare.json, so its flags cannot be checked"
        )
    if before != recorded_flags(command):
        then, now = flag_items(before), flag_items(recorded_flags(command))
        there = ", ".join(w for w in then if w not in now) or "none"
        here = ", ".join(w for w in now if w not in then) or "none"
        said = f"its own: {there}; this comparison's: {here}"
        sys.exit(f"error: --reuse {earlier}: trained with other flags ({said})")
    print(f"reading {earlier}", flush=True)
    return read_run(earlier, metric)


def train(command: list[str], log: Path) -> None:
    """Run one command: its progress bar (stderr) shown as it comes, its lines (stdout) kept in
    `log`; a failure ends the comparison in one line (exit 2)."""
    with open(log, "wb") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE)
        tail = b""
        while chunk := os.read(child.stderr.fileno(), 1 << 16):
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
            tail = (tail + chunk)[-4096:]
    if child.wait():
        last = tail.decode(errors="replace").strip().splitlines() or ["(no message)"]
        sys.exit(
            f"error: {log.stem} failed (exit {child.returncode}): {last[-1]}; its output: {log}"
        )


def compare(args: CompareArgs) -> str:
    """Train (or with --reuse read) every run, saying which and about how long is left; print the
    table and write it beside the plot and in the comparison's folder."""
    variants = parse_variants(args.variants)
    if any(g % args.validate_every or g > args.num_epochs for g in args.report_at):
        sys.exit(
            "error: every --report_at must be a multiple of --validate_every, at most --num_epochs"
        )
    results, runs_dir = {}, Path(args.runs_dir) / time.strftime("%Y%m%d-%H%M%S")
    todo, durations = len(args.data) * len(variants) * len(args.seeds), []
    for corpus in args.data:
        results[corpus] = {}
        for name, flags in variants.items():
            results[corpus][name] = []
            for seed in args.seeds:
                run_name = f"{name}-{Path(corpus).stem}-seed{seed}"
                script, own = BASELINES.get(flags[0] if flags else "", "run.py"), flags
                own = own[1:] if script != "run.py" else own
                command = [
                    sys.executable,
                    str(ROOT / script),
                    *shlex.split(args.flags),
                    *data_flags(corpus),
                ]
                command += ["--seed", str(seed), "--num_epochs", str(args.num_epochs)]
                command += [
                    "--validate_every",
                    str(args.validate_every),
                    "--runs_dir",
                    str(runs_dir),
                ]
                # last: a variant's win
                command += [
                    "--run_name",
                    run_name,
                    "--save_every",
                    "0",
                    *own,
                ]
                todo -= 1
                earlier = [
                    Path(d) / run_name
                    for d in args.reuse
                    if (Path(d) / run_name / "metrics.jsonl").exists()
                ]
                if earlier:
                    results[corpus][name].append(reused(earlier[0], command, args.metric))
                    continue
                left = (
                    f"; about {statistics.mean(durations) * (todo + 1) / 60:.0f} min left"
                    if durations
                    else ""
                )
                print(f"running {shlex.join(command[1:])}{left}", flush=True)
                runs_dir.mkdir(parents=True, exist_ok=True)
                tick = time.time()
                train(command, runs_dir / f"{run_name}.log")
                durations.append(time.time() - tick)
                record = {"command": recorded_flags(command)}
                (runs_dir / run_name / "compare.json").write_text(
                    json.dumps(record, indent=1) + "\n"
                )
                results[corpus][name].append(read_run(runs_dir / run_name, args.metric))
    text = table(args, results)
    print(text)
    if runs_dir.exists():
        (runs_dir / "table.txt").write_text(text + "\n")
    if args.plot:
        plot(args, results).savefig(args.plot, dpi=100)
        Path(args.plot).with_suffix(".txt").write_text(text + "\n")
    return text


def curve(runs: list[dict], clock: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, sd) of the seeds' validations, at the generations every seed validated; x the mean
    over the seeds of the clock there (generations, training seconds or bytes)."""
    shared = sorted(set.intersection(*(set(r["validation"]) for r in runs)))
    ys = np.array([[r["validation"][g] for g in shared] for r in runs])
    xs = np.array([[g if clock == "generation" else r[clock][g] for g in shared] for r in runs])
    return xs.mean(0), ys.mean(0), ys.std(0, ddof=1) if len(runs) > 1 else np.zeros(len(shared))


def plot(args: CompareArgs, results: dict):
    """A figure: one row per corpus, validation bits/byte against generations (steps for the
    backprop variants), training seconds and training bytes; per variant its mean over the seeds
    and a band of one standard deviation; unigram and bigram as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clocks = {
        "generation": "generations (backprop: steps)",
        "elapsed": "training seconds",
        **(
            {"tokens": "training bytes"}
            if args.metric == "bits_per_byte"
            else {"completions": "completions scored"}
        ),
    }
    figure, axes = plt.subplots(len(args.data), 3, figsize=(15, 4 * len(args.data)), squeeze=False)
    for row, corpus in zip(axes, args.data, strict=True):
        baselines = next(iter(results[corpus].values()))[0]["baselines"]
        for ax, (clock, label) in zip(row, clocks.items(), strict=True):
            for name, runs in results[corpus].items():
                x, mean, sd = curve(runs, clock)
                (line,) = ax.plot(x, mean, label=name)
                ax.fill_between(x, mean - sd, mean + sd, color=line.get_color(), alpha=0.2)
            for baseline, style in (("unigram", ":"), ("bigram", "--")):
                if baseline in baselines:
                    ax.axhline(baselines[baseline], color="gray", linestyle=style, label=baseline)
            ylabel = f"validation {args.metric.replace('_per_', '/')}"
            ax.set(xlabel=label, ylabel=ylabel, title=corpus_label(corpus))
            if clock != "generation":
                ax.set_xscale("log")
            ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


if __name__ == "__main__":
    compare(tyro.cli(CompareArgs))
