"""Replicas (--replicas) and population-based training (--pbt_every): a run is one replica, its
pinned results hold bit for bit, each replica of several is the same settings run alone, the
exploit step copies exactly, and a PBT run resumes and spreads over devices bit for bit."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY, cli, in_process, one_line_error
from test_cluster import RunHere, two_processes, wait

import run
from egg import checkpoints, pbt

# three replicas: a fixed share, and two schedules with their own decay, each its own sigma_shift
THREE = (
    "--replicas 3 --replica_alpha 0.2 4 3 --replica_alpha_decay_timestep 1000 5 3 "
    "--replica_sigma_shift 3 4 5"
).split()
FOUR_PBT = (
    "--replicas 4 --replica_alpha 0.05 0.2 3 4 --replica_sigma_shift 2 4 5 4 --pbt_every 2".split()
)


def arrays(folder: Path) -> dict[str, np.ndarray]:
    """Every array of a checkpoint, keyed FILE/NAME."""
    out = {}
    for name in ("params.npz", "states.npz", "optimizer.npz"):
        with np.load(folder / name) as f:
            out.update({f"{name}/{k}": f[k] for k in f.files})
    return out


def records(runs: Path) -> list[dict]:
    (path,) = runs.glob("*/metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def train(capsys, runs: Path, *flags) -> str:
    result = in_process(capsys, *TINY, "--runs_dir", str(runs), "--save_every", "2", *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout + result.stderr


def final(runs: Path, generation: int) -> Path:
    (folder,) = runs.glob(f"*/checkpoints/gen-{generation:08d}")
    return folder


# sha256 (first 16 hex digits) of the sorted parameters after 6 generations of TINY with these
# flags, and the last validation bits/byte, as commit 5423dfc computed them: the default rule with
# one segment, upstream's sigma_shift and start; upstream's algorithm; and a population whose moves
# are of up to two steps (10,000 scored pairs an update). The defaults' and replicas with PBT's are
# pinned where other tests train them (a fresh run in test_checkpoints.py, the PBT test below)
PINNED = {
    ("--segments", "1", "--sigma_shift", "4", "--init_std", "16"): (
        "585fb853352c648f",
        8.686004638671875,
    ),
    ("--algorithm", "upstream"): ("62c67207657ffcd9", 8.52728271484375),
    ("--parallel_generations_per_gpu", "2500"): ("68e5d557289ed14a", 6.80712890625),
}
PBT_AFTER_FOUR = (
    "1e909086b5b6f600"  # checkpoint_digest of FOUR_PBT's generation 4, commit 5423dfc's
)


@pytest.mark.parametrize("flags", list(PINNED))
def test_a_run_holds_its_pinned_results_bit_for_bit(tmp_path, flags):
    given = [*TINY, "--num_epochs", "6", "--save_every", "0", *flags]
    metrics = run.train(run.parse_args([*given, "--runs_dir", str(tmp_path)]))
    params = metrics["params"]
    digest = hashlib.sha256(b"".join(np.asarray(params[k]).tobytes() for k in sorted(params)))
    assert (digest.hexdigest()[:16], metrics["val/bits_per_byte"]) == PINNED[flags]


def test_each_replica_equals_its_settings_run_alone(tmp_path, capsys):
    """With --segments 2: every replica's noise of every segment is its own seed's."""
    flags = ["--segments", "2", "--num_epochs", "4", "--validate_every", "2"]
    train(capsys, tmp_path / "three", *THREE, *flags)
    together = arrays(final(tmp_path / "three", 4))
    logged = records(tmp_path / "three")
    settings = run.replicas_of(run.parse_args([*TINY, *THREE]))
    for k, setting in enumerate(settings):
        alone_flags = [f"--{name}={value}" for name, value in setting._asdict().items()]
        train(capsys, tmp_path / f"alone{k}", *alone_flags, *flags)
        alone = arrays(final(tmp_path / f"alone{k}", 4))
        assert together.keys() == alone.keys()
        for key, value in alone.items():
            assert np.array_equal(together[key][k], value), (k, key)
        alone_val = [
            r["val/bits_per_byte"]
            for r in records(tmp_path / f"alone{k}")
            if "val/bits_per_byte" in r
        ]
        mine = [
            r[f"replica/{k}/val/bits_per_byte"]
            for r in logged
            if f"replica/{k}/val/bits_per_byte" in r
        ]
        assert mine == alone_val and len(mine) == 2
    # the plain names carry the best replica's validation
    assert [r["val/bits_per_byte"] for r in logged if "val/bits_per_byte" in r] == [
        min(r[f"replica/{k}/val/bits_per_byte"] for k in range(3))
        for r in logged
        if "val/bits_per_byte" in r
    ]


def test_pbt_step_ranks_copies_and_explores_deterministically():
    scores = [5.0, 3.0, 4.0, 6.0, 2.0, 7.0, 1.0, 8.0]  # best: 6, 4; worst: 7, 5
    settings = [
        pbt.Replica(seed=10 + k, alpha=4.0 - k / 4, alpha_decay_timestep=1000, sigma_shift=k % 7)
        for k in range(8)
    ]
    sigma = (0, 6)  # --sigma_shift's range
    source, new, lineage = pbt.pbt_step(scores, settings, seed=0, generation=20, sigma_range=sigma)
    assert source.tolist() == [0, 1, 2, 3, 4, 4, 6, 6]
    assert [(x["replica"], x["copied"]) for x in lineage] == [(7, 6), (5, 4)]
    for loser, winner in ((7, 6), (5, 4)):
        old, got = settings[winner], new[loser]
        assert got.seed == settings[loser].seed  # its own noise, never a copy of another's
        assert got.alpha in (round(1 + (old.alpha - 1) * f, 4) for f in pbt.PBT_FACTORS)
        assert got.alpha_decay_timestep in (800, 1250)
        assert got.sigma_shift in {min(max(old.sigma_shift + d, 0), 6) for d in (-1, 0, 1)}
    assert [new[k] for k in (0, 1, 2, 3, 4, 6)] == [settings[k] for k in (0, 1, 2, 3, 4, 6)]
    # the same draw on resume
    assert pbt.pbt_step(scores, settings, seed=0, generation=20, sigma_range=sigma)[1] == new
    # sigma_shift keeps the winner's half the time, else moves one up or down (never two)
    rng = np.random.default_rng(0)
    steps = [pbt.explore(settings[3], rng, sigma).sigma_shift - 3 for _ in range(2000)]
    assert set(steps) == {-1, 0, 1} and abs(steps.count(0) / 2000 - 0.5) < 0.04
    assert abs(steps.count(1) - steps.count(-1)) / 2000 < 0.04
    # ties: the lower index ranks better; fixed shares stay at most 1
    shares = [s._replace(alpha=0.9) for s in settings[:4]]
    source, new, _ = pbt.pbt_step([1.0] * 4, shares, seed=1, generation=2, sigma_range=sigma)
    assert source.tolist() == [0, 1, 2, 0] and new[3].alpha in (0.72, 1.0)
    trees = {
        "w": np.arange(24, dtype=np.int8).reshape(4, 6),
        "m": np.arange(8, dtype=np.int16).reshape(4, 2),
    }
    copied = pbt.copy_replicas(trees, np.array([0, 1, 2, 0], np.int32))
    for k, j in enumerate([0, 1, 2, 0]):
        assert all(np.array_equal(np.asarray(copied[n][k]), trees[n][j]) for n in trees)


def test_pbt_copies_exactly_and_a_resumed_pbt_run_is_bit_identical(tmp_path, capsys):
    out = train(capsys, tmp_path / "whole", *FOUR_PBT, "--num_epochs", "4")
    assert "population-based training: replica" in out
    logged = {r["generation"]: r for r in records(tmp_path / "whole")}
    (copy,) = logged[2]["pbt/lineage"]  # 4 replicas: the worst copies the best
    after = arrays(final(tmp_path / "whole", 2))  # saved after the exploit step
    for key, value in after.items():
        assert np.array_equal(value[copy["replica"]], value[copy["copied"]]), key
    meta = json.loads((final(tmp_path / "whole", 2) / "meta.json").read_text())
    assert meta["replica_settings"][copy["replica"]] == copy["new"]
    train(capsys, tmp_path / "parts", *FOUR_PBT, "--num_epochs", "2")
    train(capsys, tmp_path / "parts", *FOUR_PBT, "--num_epochs", "4", "--resume", "auto")
    assert checkpoints.checkpoint_digest(final(tmp_path / "whole", 4)) == PBT_AFTER_FOUR
    whole, parts = arrays(final(tmp_path / "whole", 4)), arrays(final(tmp_path / "parts", 4))
    assert all(np.array_equal(whole[k], parts[k]) for k in whole)
    metas = [
        json.loads((final(tmp_path / x, 4) / "meta.json").read_text()) for x in ("whole", "parts")
    ]
    assert metas[0]["replica_settings"] == metas[1]["replica_settings"]
    strip = [
        {k: v for k, v in r.items() if not k.startswith("perf/")}
        for r in records(tmp_path / "whole")
    ]
    again = [
        {k: v for k, v in r.items() if not k.startswith("perf/")}
        for r in records(tmp_path / "parts")
    ]
    assert strip == again
    # --sample picks the best replica of the last validation, or the one asked for
    sampled = in_process(
        capsys, "--sample", "--resume", str(final(tmp_path / "whole", 4)), "--max_new_bytes", "8"
    )
    assert f"replica {metas[0]['best_replica']} of 4" in sampled.stdout
    one_line_error(
        in_process(
            capsys,
            "--sample",
            "--resume",
            str(final(tmp_path / "whole", 4)),
            "--sample_replica",
            "4",
        ),
        "--sample_replica 4",
    )


def test_pbt_replicas_on_one_and_two_by_two_devices_agree_bit_for_bit(tmp_path):
    """One device against 2 processes x 2 devices (4 devices in one process is the same sharded
    program without the processes, and test_cluster.py checks it for a single run)."""
    flags = [*FOUR_PBT, "--num_epochs", "4", "--num_perturbations", "8", "--save_every", "0"]
    procs = {"two": two_processes(flags, tmp_path / "two", members=8)}
    procs["one"] = [RunHere([*flags, "--parallel_generations_per_gpu", "32"], tmp_path / "one")]
    outs = {layout: wait(*group)[0] for layout, group in procs.items()}
    assert "4 replicas of" in outs["two"] and "on 4 cpu device(s) in 2 process(es)" in outs["two"]
    got = {layout: arrays(final(tmp_path / layout, 4)) for layout in procs}
    assert all(np.array_equal(got["one"][k], got["two"][k]) for k in got["one"])
    lineage = {
        layout: [r.get("pbt/lineage") for r in records(tmp_path / layout)] for layout in procs
    }
    assert lineage["one"] == lineage["two"] and lineage["one"][1]


BAD = [
    (["--replicas", "0"], "--replicas must be positive, got 0"),
    (
        ["--replicas", "3", "--replica_alpha", "3", "4"],
        "--replica_alpha has 2 value(s): give one per replica",
    ),
    (["--replicas", "2", "--replica_sigma_shift", "4", "9"], "got 9 (replica 1)"),
    (["--replicas", "2", "--replica_alpha", "4", "0"], "--alpha must be > 0"),
    (
        ["--replicas", "2", "--replica_alpha_decay_timestep", "0", "5"],
        "--alpha_decay_timestep must be positive",
    ),
    (["--replicas", "3", "--pbt_every", "5"], "--pbt_every needs --replicas 4 or more"),
    (["--pbt_every", "-1"], "--pbt_every must be >= 0"),
]


@pytest.mark.parametrize("flags, message", BAD)
def test_bad_replica_flags_are_refused_with_one_line(tmp_path, capsys, flags, message):
    one_line_error(in_process(capsys, *TINY, "--runs_dir", str(tmp_path), *flags), message)
    assert not any(tmp_path.iterdir())


def test_each_replica_is_its_own_series_in_wandb_with_lineage_and_diagnostics(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    flags = [*TINY, *FOUR_PBT, "--num_epochs", "2", "--track", "--log_every", "2", "--debug"]
    result = cli(*flags, "--runs_dir", str(tmp_path / "runs"), env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "generation 2 replica 3 diagnostics:" in result.stdout
    assert "(best of 4 replicas, median" in result.stdout
    (line,) = [r for r in records(tmp_path / "runs") if r["generation"] == 2]
    for k in range(4):
        assert f"replica/{k}/diag/param_emb/moved" in line and f"replica/{k}/sigma_shift" in line
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    raw = log.read_bytes()
    for k in range(4):
        key = f"replica/{k}/val/bits_per_byte"
        assert key.encode() in raw and json.dumps(line[key]).encode() in raw
    assert (
        b"pbt/lineage" in raw and json.dumps(json.dumps(line["pbt/lineage"])).encode()[1:-1] in raw
    )
