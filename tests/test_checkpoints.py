"""Checkpoints, exact resume after SIGKILL, SIGTERM, bad input and int32 ranges."""

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import (
    ROOT,
    TINY,
    checkpoint_digest,
    cli,
    devices_env,
    in_process,
    init_params,
    one_line_error,
    one_model_step,
    run_here,
    thresholds,
)

import run
from egg import checkpoints, cluster, corpus, files, flags, resume


def start(*flags, runs):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *TINY, "--runs_dir", str(runs), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ran(*flags, runs) -> tuple:
    """The tiny run with these flags to its end in this process (helpers.run_here): (exit code,
    stdout, stderr), as finish gives a process's."""
    return run_here(*TINY, "--runs_dir", str(runs), *flags)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def params_hash(folder: Path) -> str:
    with np.load(folder / "params.npz") as f:
        assert all(f[k].dtype == np.int8 for k in f.files)
        return hashlib.sha256(b"".join(f[k].tobytes() for k in sorted(f.files))).hexdigest()


def checkpoint_dir(runs: Path) -> Path:
    (folder,) = runs.iterdir()
    return folder / "checkpoints"


def wait_for(predicate, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError


LONG = ["--num_epochs", "150", "--save_every", "3", "--validate_every", "50"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final checkpoint of an uninterrupted run with LONG flags, shared by the resume tests."""
    runs = tmp_path_factory.mktemp("uninterrupted")
    code, _, err = ran(*LONG, runs=runs)
    assert code == 0, err[-2000:]
    return checkpoint_dir(runs) / "gen-00000150"


def kill_once_saved(proc, runs: Path, generation: int) -> str:
    """SIGKILL proc once LATEST in runs names a checkpoint at `generation` or later; its stdout."""

    def saved():
        pointers = list(runs.glob("*/checkpoints/LATEST"))
        return pointers and int(pointers[0].read_text().split("-")[1]) >= generation

    wait_for(saved)
    proc.send_signal(signal.SIGKILL)
    _, out, _ = finish(proc)
    assert proc.returncode == -signal.SIGKILL
    return out


def test_resume_after_sigkill_is_bit_identical(tmp_path, uninterrupted):
    flags, full = LONG, uninterrupted

    kill_once_saved(start(*flags, runs=tmp_path / "b"), tmp_path / "b", 6)
    saved = sorted(p.name for p in checkpoint_dir(tmp_path / "b").glob("gen-*"))
    assert saved[-1] < "gen-00000150"  # a save cut short may leave a hidden .gen-*.tmpPID folder

    code, out, err = ran(*flags, "--resume", "auto", runs=tmp_path / "b")
    assert code == 0, err[-2000:]
    assert f"resuming from {checkpoint_dir(tmp_path / 'b') / saved[-1]}" in out  # the latest one
    assert not list(checkpoint_dir(tmp_path / "b").glob(".*tmp*"))  # leftovers of the kill removed
    resumed = checkpoint_dir(tmp_path / "b") / "gen-00000150"
    print(
        "uninterrupted",
        params_hash(full),
        "resumed",
        params_hash(resumed),
        "killed after",
        saved[-1],
    )
    assert params_hash(resumed) == params_hash(full)
    with np.load(resumed / "states.npz") as a, np.load(full / "states.npz") as b:
        np.testing.assert_array_equal(a["states"], b["states"])
    lines = [
        json.loads(x)
        for x in (tmp_path / "b").glob("*/metrics.jsonl").__next__().read_text().splitlines()
    ]
    assert [x["generation"] for x in lines] == list(range(1, 151))  # no duplicated generations


def logged(runs: Path) -> list[int]:
    """The generations of a run's metrics.jsonl, its whole lines, in order."""
    paths = list(runs.glob("*/metrics.jsonl"))
    text = paths[0].read_text() if paths else ""
    return [json.loads(line)["generation"] for line in text.splitlines(True) if line.endswith("\n")]


def test_a_sigkill_at_any_moment_then_a_resume_records_every_generation_once(tmp_path):
    """Six kills, each at another moment of a generation (a few milliseconds after another line
    of metrics.jsonl, a checkpoint every generation), each followed by --resume auto: the record
    holds every generation once, in order, and the parameters are an uninterrupted run's."""
    flags = ["--num_epochs", "30", "--save_every", "1", "--keep_checkpoints", "2"]
    runs = tmp_path / "killed"
    for kill, delay in enumerate((0.0, 0.004, 0.009, 0.015, 0.022, 0.03)):
        proc = start(*flags, *(["--resume", "auto"] if kill else []), runs=runs)
        seen = len(logged(runs))
        wait_for(
            lambda seen=seen, proc=proc: len(logged(runs)) > seen + 1 or proc.poll() is not None
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        finish(proc)
    code, _, err = ran(*flags, "--resume", "auto", runs=runs)
    assert code == 0, err[-2000:]
    assert logged(runs) == list(range(1, 31))
    code, _, err = ran(*flags, runs=tmp_path / "whole")
    assert code == 0, err[-2000:]
    final = [checkpoint_dir(tmp_path / x) / "gen-00000030" for x in ("killed", "whole")]
    assert params_hash(final[0]) == params_hash(final[1])


def test_corrupt_latest_is_set_aside_and_the_run_still_ends_bit_identical(tmp_path, uninterrupted):
    """Corrupt the latest checkpoint, resume, kill, resume again: the same parameters as a run
    never interrupted, and the corrupt folder kept aside, shadowing no later save."""
    runs = tmp_path / "b"
    code, _, err = ran("--num_epochs", "6", "--save_every", "3", runs=runs)
    assert code == 0, err[-2000:]
    folder = checkpoint_dir(runs)
    (folder / "gen-00000006" / "params.npz").write_bytes(b"not a zip file")
    out = kill_once_saved(start(*LONG, "--resume", "auto", runs=runs), runs, 9)
    assert out.count("unreadable") == 1  # tried once, not again from the folder listing
    assert (
        "set aside as corrupt-gen-00000006" in out
        and f"resuming from {folder / 'gen-00000003'}" in out
    )
    assert (folder / "corrupt-gen-00000006" / "params.npz").read_bytes() == b"not a zip file"
    # gen-00000006 saved again: the corrupt one shadowed nothing
    for saved in checkpoints.checkpoints_in(folder):
        params_hash(saved)
    assert (folder / (folder / "LATEST").read_text()).is_dir()
    code, out, err = ran(*LONG, "--resume", "auto", runs=runs)
    assert code == 0 and "unreadable" not in out, err[-2000:]
    print(
        "uninterrupted", params_hash(uninterrupted), "corrupted, resumed, killed, resumed", end=" "
    )
    print(params_hash(folder / "gen-00000150"))
    assert params_hash(folder / "gen-00000150") == params_hash(uninterrupted)


def test_extended_run_continues_as_if_the_longer_run_had_been_asked_for(tmp_path):
    """--num_epochs 6, then --num_epochs 12 --resume auto: bit-identical to --num_epochs 12,
    with an alpha schedule that is still decaying (T = 4) and noise and data at every generation,
    and the update rule's running sums carried over."""
    schedule = ["--alpha", "3", "--alpha_decay_timestep", "4", "--save_every", "6"]
    code, _, err = ran(*schedule, "--num_epochs", "12", runs=tmp_path / "a")
    assert code == 0, err[-2000:]
    code, _, err = ran(*schedule, "--num_epochs", "6", runs=tmp_path / "b")
    assert code == 0, err[-2000:]
    code, out, err = ran(*schedule, "--num_epochs", "12", "--resume", "auto", runs=tmp_path / "b")
    assert code == 0 and "resuming from" in out and "generation 6" in out, err[-2000:]
    final = [checkpoint_dir(tmp_path / x) / "gen-00000012" for x in "ab"]
    print("12 at once", params_hash(final[0]), "6 then extended to 12", params_hash(final[1]))
    assert params_hash(final[0]) == params_hash(final[1])
    assert checkpoint_digest(final[0]) == checkpoint_digest(final[1])  # states and running sums too


def test_resume_refuses_changed_training_settings_unless_allowed(tmp_path, capsys):
    code, _, err = ran("--num_epochs", "4", "--save_every", "2", "--run_name", "r", runs=tmp_path)
    assert code == 0, err[-2000:]
    base = [
        *TINY,
        "--runs_dir",
        str(tmp_path),
        "--run_name",
        "r",
        "--num_epochs",
        "6",
        "--resume",
        "auto",
    ]
    other = tmp_path.with_name(f"{tmp_path.name}-other.txt")  # beside the runs folder
    other.write_bytes(b"other training bytes, not the standard library " * 2000)
    for given, listed in (
        (["--alpha", "0.3", "--sigma_shift", "2"], "--alpha 0.2 -> 0.3, --sigma_shift 3 -> 2"),
        (["--seed", "1", "--no-use_clt"], "--seed 0 -> 1, --use_clt True -> False"),
        (
            ["--tokens_per_update", "9", "--group_size", "8"],
            "--group_size 4 -> 8, --tokens_per_update 8 -> 9",
        ),
        (["--parallel_generations_per_gpu", "32"], "population 16 -> 32"),
        (
            ["--data", str(other)],
            "training data ",
        ),  # then its size (99% of 94,000) and hash, old -> new
        (
            ["--alpha_decay_timestep", "7", "--rank", "2"],
            "--alpha_decay_timestep 1000 -> 7, --rank 1 -> 2",
        ),
        (
            ["--fast_fitness", "--noise_reuse", "2"],
            "--shaping normalised -> sign, --noise_reuse 1 -> 2",
        ),
        (
            ["--num_perturbations", "8", "--segments", "2"],
            "--segments 0 -> 2, --num_perturbations 0 -> 8",
        ),
        (
            ["--optimizer", "ztest", "--momentum_shift", "3", "--max_step", "2"],
            # --momentum_shift and --max_step act under momentum only: not this run's rule
            "--optimizer momentum -> ztest",
        ),
        (
            ["--no-shared_pair_state", "--shaping", "sign"],
            "--shaping normalised -> sign, --shared_pair_state True -> False",
        ),
        # --null_from_scores acts under ztest only, not the checkpoint's rule: the rule's change
        # says it
        (["--optimizer", "ztest", "--null_from_scores"], "--optimizer momentum -> ztest"),
    ):
        result = in_process(capsys, *base, *given)
        one_line_error(result, f"gen-00000004 was trained with other settings: {listed}")
        assert (
            "-> 93,060 bytes #" in result.stderr
            if "--data" in given
            else f"{listed}; " in result.stderr
        )
        assert "--allow_changes" in result.stderr
    assert len(list(tmp_path.iterdir())) == 1  # the refused runs wrote nothing
    # a checkpoint of an older format is refused naming the commit that reads it
    meta_path = checkpoint_dir(tmp_path) / "gen-00000004" / "meta.json"
    written = meta_path.read_text()
    meta = json.loads(written)
    meta_path.write_text(json.dumps({**meta, "format": 2}))
    older = (
        "was written by an older egg-jax (format 2); continue it with the code of commit 5423dfc"
    )
    one_line_error(in_process(capsys, *base), older)
    # one from before a flag its training reads is refused naming it and --allow_changes, which
    # continues it
    meta["training"].pop("max_step")
    meta_path.write_text(json.dumps(meta))
    predates = "gen-00000004 predates --max_step, which its training would read: give --allow_"
    result = in_process(capsys, *base)
    one_line_error(result, predates)
    assert "changes to continue it with --max_step (not recorded) -> 1" in result.stderr
    meta_path.write_text(json.dumps({**meta, "format": 4}))
    one_line_error(in_process(capsys, *base), "is of format 4, newer than this egg-jax's")
    meta_path.write_text(written)
    # a setting that came later (its facts' `before`) reads as the value every checkpoint without
    # it had
    meta = json.loads(written)
    meta["training"].pop("residual_shift")
    meta_path.write_text(json.dumps(meta))
    result = in_process(capsys, *base, "--residual_shift", "1")
    one_line_error(result, "was trained with other settings: --residual_shift 0 -> 1")
    # and where its flags record none either, it continues with that value, not today's default
    del meta["args"]["residual_shift"]
    meta_path.write_text(json.dumps(meta))
    assert run.parse_args(["--resume", str(meta_path.parent)]).model.residual_shift == 0
    assert run.parse_args([]).model.residual_shift == -1
    meta_path.write_text(written)
    # the device count alone is no change: the same population on 2 devices resumes
    flags = [*base, "--parallel_generations_per_gpu", "8", "--num_epochs", "5"]
    result = cli(*flags, env=devices_env(2))
    assert result.returncode == 0 and "changed settings" not in result.stdout, result.stderr[-2000:]
    # a flag that does not act under the checkpoint's rule, nor this run's, is no change; nor is
    # one that came after the checkpoint (recorded none), where its training does not read it
    newest = checkpoint_dir(tmp_path) / "gen-00000005" / "meta.json"
    meta = json.loads(newest.read_text())
    meta["training"].pop("null_from_scores")
    newest.write_text(json.dumps(meta))
    result = in_process(capsys, *base, "--null_from_scores", "--momentum_shift", "2")
    assert result.returncode == 0 and "changed: nothing" in result.stdout, result.stderr[-2000:]
    result = in_process(capsys, *base, "--alpha", "0.3", "--allow_changes", "--num_epochs", "7")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "at generation 6; changed: --alpha 0.2 -> 0.3" in result.stdout
    lines = [json.loads(x) for x in next(tmp_path.glob("*/metrics.jsonl")).read_text().splitlines()]
    assert {"generation": 6, "resume/changed": "--alpha 0.2 -> 0.3"} in lines
    meta = json.loads((checkpoint_dir(tmp_path) / "gen-00000007" / "meta.json").read_text())
    assert meta["training"]["alpha"] == 0.3 and meta["training"]["population"] == 16


# the sha256 of TINY's sorted parameters after 3 generations with the defaults, as commit 5423dfc
# computed it
DEFAULTS_AFTER_THREE = "cfbdced9c38b3015983e7b8614268f6dc25caa4b8231b8900c211cdc13693c6d"


def test_resume_auto_with_no_checkpoint_starts_a_fresh_run(tmp_path, capsys):
    flags = [*TINY, "--num_epochs", "3"]
    fresh = in_process(capsys, *flags, "--runs_dir", str(tmp_path / "a"))
    auto = in_process(capsys, *flags, "--runs_dir", str(tmp_path / "b"), "--resume", "auto")
    assert fresh.returncode == auto.returncode == 0, auto.stderr[-2000:]
    assert "no checkpoint in" in auto.stdout and "starting a new run" in auto.stdout
    assert "resuming" not in auto.stdout
    final = [checkpoint_dir(tmp_path / x) / "gen-00000003" for x in "ab"]
    assert params_hash(final[0]) == params_hash(final[1]) == DEFAULTS_AFTER_THREE


def test_resume_with_another_population_restarts_the_states_at_zero(tmp_path, capsys):
    """End to end: a population-16 checkpoint of the Z-test continued at population 32 with momentum
    equals its parameters stepped once from zero states and a zero running sum at population 32,
    computed here in-process."""
    first = [*TINY, "--num_epochs", "4", "--runs_dir", str(tmp_path), "--optimizer", "ztest"]
    assert in_process(capsys, *first).returncode == 0
    folder = checkpoint_dir(tmp_path)
    wider = ["--parallel_generations_per_gpu", "32", "--num_epochs", "5", "--allow_changes"]
    result = in_process(
        capsys,
        *TINY,
        *wider,
        "--runs_dir",
        str(tmp_path),
        "--save_dir",
        str(folder),
        "--resume",
        "auto",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "another population layout: hidden states restart at zero" in result.stdout
    assert "holds no state of this run's update rule: it starts afresh" in result.stdout
    assert f"resuming from {folder / 'gen-00000004'} at generation 4" in result.stdout
    args = run.parse_args([*TINY, *wider])
    cfg = run.make_config(args)
    train_bytes, _ = corpus.open_data(args.corpus, 2 * args.validation_batch_size)
    batch = run.batch_at(train_bytes, run.make_stream(len(train_bytes), cfg), cfg, 4)
    expected = run.expected_arrays(run.make_config(run.parse_args([*TINY, "--optimizer", "ztest"])))
    params = checkpoints.load_checkpoint(folder / "gen-00000004", expected).params
    params = {k: v[0] for k, v in params.items()}  # the replica axis of one
    step = run.make_generation_step(cfg, cluster.population_mesh(run.POP, jax.devices()[:1]))
    states = np.zeros((cfg.population, cfg.n_layer, cfg.n_embd), np.int8)
    params, opt, states, _, _ = one_model_step(
        step, (params, run.init_state(cfg), states), batch, 4, thresholds(args, cfg, 4), 0, 3
    )
    with np.load(folder / "gen-00000005" / "params.npz") as f:
        for name in run.parameters_of(cfg):
            np.testing.assert_array_equal(f[name], params[name], err_msg=name)
    with np.load(folder / "gen-00000005" / "states.npz") as f:
        np.testing.assert_array_equal(f["states"], states)
    with np.load(folder / "gen-00000005" / "optimizer.npz") as f:
        assert sorted(f.files) == sorted(opt) and f["m/Wf"].dtype == np.int16
        for key in f.files:
            np.testing.assert_array_equal(f[key], opt[key], err_msg=key)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_saves_every_generation_run_and_exits(tmp_path, sig, code):
    """SIGTERM (what schedulers send) exits 143, SIGINT (Ctrl-C) 130, both after saving: a job
    script tells a stopped run, to requeue, from a finished one (0)."""
    proc = start("--num_epochs", "100000", "--save_every", "0", runs=tmp_path)
    wait_for(
        lambda: (
            any(tmp_path.glob("*/metrics.jsonl"))
            and len(next(tmp_path.glob("*/metrics.jsonl")).read_text().splitlines()) >= 3
        )
    )
    proc.send_signal(sig)
    returncode, out, err = finish(proc)
    assert returncode == code, err[-2000:]
    logged = len(next(tmp_path.glob("*/metrics.jsonl")).read_text().splitlines())
    assert f"stopped by signal after generation {logged}" in out
    folder = checkpoint_dir(tmp_path)
    latest = (folder / "LATEST").read_text()
    meta = json.loads((folder / latest / "meta.json").read_text())
    assert meta["generation"] == logged  # every generation run is in the checkpoint: no work lost
    assert meta["args"]["n_embd"] == 8 and meta["format"] == checkpoints.CHECKPOINT_FORMAT


def tiny_model():
    """(cfg, params, opt, states) of one fresh tiny model, momentum's sums moved off zero."""
    cfg = run.make_config(
        flags.replace(run.Args(), n_embd=8, n_layer=2, parallel_generations_per_gpu=16)
    )
    params = jax.tree.map(np.asarray, init_params(cfg, 0))
    opt = jax.tree.map(lambda x: np.asarray(x) + 3, run.init_state(cfg))
    return cfg, params, opt, np.zeros((cfg.population, cfg.n_layer, cfg.n_embd), np.int8)


def with_axis(*trees):
    """The arrays of one model with the replica axis of a run of one."""
    return jax.tree.map(lambda x: x[None], trees)


def load(folder: Path, cfg):
    return checkpoints.load_checkpoint(folder, run.expected_arrays(cfg))


def test_checkpoint_files_are_plain_numpy_and_json(tmp_path):
    cfg, params, opt, states = tiny_model()
    checkpoints.save_checkpoint(tmp_path / "c", params, opt, states, {"generation": 5})
    with np.load(tmp_path / "c" / "params.npz") as f:  # no run.py needed to read it
        assert sorted(f.files) == sorted(run.parameters_of(cfg)) and f["Wf"].dtype == np.int8
        np.testing.assert_array_equal(f["emb"], params["emb"])
    assert json.loads((tmp_path / "c" / "meta.json").read_text()) == {"generation": 5}
    loaded, loaded_states, loaded_opt, _ = load(tmp_path / "c", cfg)
    with np.load(tmp_path / "c" / "optimizer.npz") as f:
        assert (
            sorted(f.files) == sorted(f"m/{k}" for k in run.parameters_of(cfg))
            and f["m/Wf"].dtype == np.int16
        )
    # a single model's file comes back with the run's replica axis of 1
    for got, want in ((loaded, params), (loaded_opt, opt), ({"s": loaded_states}, {"s": states})):
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value[None], err_msg=key)
    ztest = run.make_config(
        flags.replace(
            run.Args(), n_embd=8, n_layer=2, parallel_generations_per_gpu=16, optimizer="ztest"
        )
    )
    assert load(tmp_path / "c", ztest).rule_state == {}  # a rule that keeps no state
    # the Z-test's
    checkpoints.save_checkpoint(tmp_path / "z", params, {}, states, {"generation": 5})
    assert load(tmp_path / "z", cfg).rule_state is None  # no state of this rule: started afresh
    other = run.make_config(
        flags.replace(run.Args(), n_embd=8, n_layer=2, parallel_generations_per_gpu=32)
    )
    assert load(tmp_path / "c", other).states is None  # other population: fresh states


# gen-4 checkpoints written by commit 5423dfc
CURRENT = ROOT / "tests" / "data" / "checkpoints-5423dfc"
WORDS = [*TINY, "--data", str(ROOT / "tests" / "data" / "words.txt")]
THREE = "--replicas 3 --replica_alpha 0.2 4 3 --replica_sigma_shift 3 4 5".split()
# checkpoint_digest of WORDS (with THREE) after 6 generations, trained by the code of commit 5423dfc
AFTER_SIX = {"single": "bb84da4994d3fef0", "replicas": "d34348d250163b1f"}


@pytest.mark.parametrize("name, flags", [("single", []), ("replicas", THREE)])
def test_a_checkpoint_written_by_earlier_code_resumes_bit_for_bit(tmp_path, capsys, name, flags):
    """Its generation-4 checkpoint, continued here to 6, equals that code's own 6 generations."""
    save = ["--save_dir", str(tmp_path / "save"), "--runs_dir", str(tmp_path), "--num_epochs", "6"]
    result = in_process(capsys, *WORDS, *flags, *save, "--resume", str(CURRENT / name))
    assert result.returncode == 0 and "changed settings" not in result.stdout, result.stderr[-2000:]
    assert checkpoint_digest(tmp_path / "save" / "gen-00000006") == AFTER_SIX[name]


def test_a_save_killed_midway_leaves_previous_checkpoints_intact(tmp_path, monkeypatch):
    _, params, _, states = tiny_model()
    saver = checkpoints.Checkpointer(tmp_path, {}, keep=2)
    saver.save(1, with_axis(params, {}, states), 9.0, {})
    before = params_hash(tmp_path / "gen-00000001")

    def dies(*a, **k):
        raise KeyboardInterrupt  # as if the process died while writing

    monkeypatch.setattr(np, "savez", dies)
    with pytest.raises(KeyboardInterrupt):
        saver.save(2, with_axis(params, {}, states), 9.0, {})
    assert not (tmp_path / "gen-00000002").exists()
    assert (tmp_path / "LATEST").read_text() == "gen-00000001"
    assert params_hash(tmp_path / "gen-00000001") == before


def test_a_kill_between_the_checkpoint_and_latest_renames_loses_no_save(tmp_path):
    """Killed after gen-6 was renamed into place but before LATEST was: resumes take gen-6."""
    _, params, _, states = tiny_model()
    saver = checkpoints.Checkpointer(tmp_path, {}, keep=3)
    saver.save(3, with_axis(params, {}, states), 9.0, {})
    checkpoints.save_checkpoint(tmp_path / "gen-00000006", params, {}, states, {"generation": 6})
    assert (tmp_path / "LATEST").read_text() == "gen-00000003"
    assert resume.find_checkpoints("auto", tmp_path) == [
        tmp_path / "gen-00000006",
        tmp_path / "gen-00000003",
    ]
    assert resume.find_checkpoints(str(tmp_path), tmp_path / "elsewhere") == [
        tmp_path / "gen-00000006"
    ]
    assert resume.find_checkpoints(str(tmp_path / "gen-00000003"), tmp_path) == [
        tmp_path / "gen-00000003"
    ]


def test_a_folder_has_one_owner_and_its_leftovers_go_when_it_is_owned(tmp_path):
    """own(): a dead run's temporaries go (the folder is the owner's alone); a second claim, from
    another process, is refused in one line naming the owner; the owner's death ends its claim."""
    dead = tmp_path / ".gen-00000005.tmp999999999"
    dead.mkdir()
    (dead / "params.npz").write_bytes(b"half")
    (tmp_path / ".LATEST.tmp12").write_text("gen-00000005")
    (tmp_path / "gen-00000004").mkdir()
    claim = files.own(tmp_path, "checkpoints to --save_dir", "--save_dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".owner", "gen-00000004"]
    assert (tmp_path / ".owner").read_text() == f"host {socket.gethostname()}, PID {os.getpid()}\n"
    other = (
        f"from egg import files; files.own(__import__('pathlib').Path({str(tmp_path)!r}), 'x', "
        "'--save_dir')"
    )
    refused = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import egg, sys\ntry:\n    {other}\nexcept egg.UserError as e:\n    sys.exit(str(e))",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert refused.returncode == 1 and refused.stderr == (
        f"{tmp_path} is in use by another run (host {socket.gethostname()}, PID {os.getpid()}): "
        "wait for it to end, or give this run another --save_dir\n"
    )
    claim.close()  # as the process's end would
    taken = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, cwd=ROOT)
    assert taken.returncode == 0, taken.stderr


def test_keeps_the_last_k_and_the_best(tmp_path):
    _, params, _, states = tiny_model()
    saver = checkpoints.Checkpointer(tmp_path, {}, keep=2)
    for generation, score in ((1, 5.0), (2, 4.0), (3, 4.5), (4, 4.2)):
        saver.save(generation, with_axis(params, {}, states), score, {})
        saver.offer_best(generation, (params, {}, states), score, {})
    assert sorted(p.name for p in tmp_path.glob("gen-*")) == ["gen-00000003", "gen-00000004"]
    assert [p.name for p in tmp_path.glob("best-*")] == ["best-4.0000-gen-00000002"]
    assert (tmp_path / "BEST").read_text() == "best-4.0000-gen-00000002"
    assert (tmp_path / "LATEST").read_text() == "gen-00000004"


def test_checkpoint_bad_input(tmp_path, capsys):
    code, _, err = ran("--num_epochs", "4", "--save_every", "2", runs=tmp_path)
    assert code == 0, err[-2000:]
    folder = checkpoint_dir(tmp_path)
    base = [*TINY, "--runs_dir", str(tmp_path)]
    # a fresh run would mix with (and could overwrite) the existing checkpoints
    one_line_error(in_process(capsys, *base, "--num_epochs", "6"), "--resume auto")
    # another model shape
    result = in_process(capsys, *base, "--n_embd", "16", "--resume", str(folder))
    one_line_error(
        result, "holds a egg 8D-2L model; this run is egg 16D-2L: pass the same --model,"
    )
    # a corrupt checkpoint: named explicitly it is an error; with auto an older one is used
    latest = folder / (folder / "LATEST").read_text()
    (latest / "params.npz").write_bytes(b"not a zip file")
    result = in_process(capsys, *base, "--num_epochs", "6", "--resume", str(latest))
    one_line_error(result, f"checkpoint {latest} is unreadable (")
    result = in_process(capsys, *base, "--num_epochs", "6", "--resume", "auto")
    assert result.returncode == 0 and "trying an older one" in result.stdout, result.stderr[-1000:]
    assert f"resuming from {folder / 'gen-00000002'} at generation 2" in result.stdout
    # no checkpoint at an explicit path
    one_line_error(
        in_process(capsys, *base, "--resume", str(tmp_path / "nothing")),
        "no such path; give a run folder",
    )
    # an unwritable save_dir or runs_dir (a path below a regular file)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = in_process(capsys, *base, "--save_dir", str(blocker / "ckpt"))
    one_line_error(result, "cannot write checkpoints to --save_dir")
    result = in_process(
        capsys, *TINY, "--runs_dir", str(blocker / "runs"), "--save_dir", str(tmp_path / "s")
    )
    one_line_error(result, "cannot write metrics to --runs_dir")
    aside = folder / f"corrupt-{latest.name}"  # set aside by --resume auto, kept as it was
    assert (blocker.read_text(), (aside / "params.npz").read_bytes()) == ("x", b"not a zip file")


def test_atomic_file_leaves_nothing_half_written(tmp_path):
    target = tmp_path / "x.bin"
    with pytest.raises(RuntimeError), files.atomic_file(target) as f:
        f.write(b"half")
        raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary
    files.write_atomic(target, b"whole")
    assert target.read_bytes() == b"whole" and list(tmp_path.iterdir()) == [target]
