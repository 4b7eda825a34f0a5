"""The seeds' other models, each an entry of MODELS, tested as EGG is (beside the int64 reference of
test_model_reference.py, the layouts of test_cluster.py and the H100 program of test_bench.py):
each trains, saves and resumes bit for bit, a killed transformer run resumes exactly, each samples
and shows --debug's table, and bench.py times each one's training, fitness and inference."""

import importlib.util
import sys

import numpy as np
import pytest
from helpers import ROOT, TINY, in_process
from test_bench import benchmark_args
from test_checkpoints import checkpoint_dir, kill_once_saved, ran, start

import bench
import run
from egg import checkpoints

# the transformer's heads 4 wide: two a layer at TINY's 8D
MODELS = {
    "mingru": ["--model", "mingru"],
    "transformer": ["--model", "transformer", "--head_width", "4"],
}


def train(capsys, runs, *given):
    result = in_process(capsys, *TINY, "--runs_dir", str(runs), "--save_every", "2", *given)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


@pytest.mark.parametrize("name", MODELS)
def test_each_model_trains_saves_resumes_samples_and_shows_its_activations(tmp_path, capsys, name):
    given = [*MODELS[name], "--log_every", "3", "--debug"]
    whole = train(capsys, tmp_path / "a", *given, "--num_epochs", "6")
    activations = {"mingru": "gate0", "transformer": "attended0"}[name]
    assert "generation 6 diagnostics:" in whole.stdout and activations in whole.stdout
    train(capsys, tmp_path / "b", *given, "--num_epochs", "4")
    resumed = train(capsys, tmp_path / "b", *given, "--num_epochs", "6", "--resume", "auto")
    assert "resuming from" in resumed.stdout
    (a,) = (tmp_path / "a").glob("*/checkpoints/gen-00000006")
    (b,) = (tmp_path / "b").glob("*/checkpoints/gen-00000006")
    with np.load(a / "params.npz") as f, np.load(a.parent / "gen-00000002" / "params.npz") as g:
        assert any(np.any(f[k] != g[k]) for k in f.files)  # it moved parameters
    assert checkpoints.checkpoint_digest(a) == checkpoints.checkpoint_digest(b)
    sample = in_process(capsys, "--sample", "--resume", str(a), "--max_new_bytes", "12")
    assert sample.returncode == 0 and sample.stdout.startswith("The "), sample.stderr[-2000:]
    assert len(sample.stdout.split("\n")[0]) > len("The ")


def test_a_killed_transformer_run_resumes_exactly(tmp_path, capsys):
    """The parameters, the rule's state and the keys and values each member carries are the
    run."""
    given = [*MODELS["transformer"], "--num_epochs", "150", "--save_every", "3"]
    train(capsys, tmp_path / "whole", *given)
    kill_once_saved(start(*given, runs=tmp_path / "b"), tmp_path / "b", 6)
    code, out, err = ran(*given, "--resume", "auto", runs=tmp_path / "b")
    assert code == 0 and "resuming from" in out, err[-2000:]
    (whole,) = (tmp_path / "whole").glob("*/checkpoints/gen-00000150")
    resumed = checkpoint_dir(tmp_path / "b") / "gen-00000150"
    assert checkpoints.checkpoint_digest(resumed) == checkpoints.checkpoint_digest(whole)


@pytest.mark.parametrize("name", MODELS)
def test_the_benchmark_times_each_models_training_fitness_and_inference(capsys, name):
    own = {"transformer": {"head_width": 4}}.get(name, {})
    rate = bench.benchmark(benchmark_args(num_epochs=1, model=name, **own))
    assert set(rate) == {"a", "b", "c", "d"} and all(v > 0 for v in rate.values())
    out = capsys.readouterr().out
    assert all(label in out for label in ("a training", "b fitness only", "c inference"))


def test_the_mingrus_products_over_a_window_give_the_bytes_bits(monkeypatch, capsys):
    """scripts/mingru_window.py's variant, which measured slower in five configurations of six
    (docs/results.org): the same fitness for every member, which the script checks before timing."""
    spec = importlib.util.spec_from_file_location(
        "mingru_window", ROOT / "scripts/mingru_window.py"
    )
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mingru_window", script)  # for its dataclass
    spec.loader.exec_module(script)
    monkeypatch.setattr(run, "MODELS", dict(run.MODELS))  # the script adds its variant
    script.main(script.Args(n_embd=8, n_layer=2, members=8, window=7, rounds=1))
    assert "the same fitness" in capsys.readouterr().out


def test_a_head_width_that_does_not_divide_the_width_is_refused_in_one_line():
    with pytest.raises(run.UserError, match="--head_width 5 does not divide --n_embd 16"):
        run.check_args(
            run.parse_args([*MODELS["transformer"][:2], "--head_width", "5", "--n_embd", "16"])
        )
    too_long = ["--model", "transformer", "--tokens_per_update", "4000", "--segments", "1"]
    with pytest.raises(run.UserError, match="attention's sum of 2\\*\\*\\(-d/16\\)"):
        run.check_args(run.parse_args(too_long))
    carried = ["--model", "transformer", "--carried", "2040"]  # 2,050 bytes with its 10
    with pytest.raises(run.UserError, match="use a smaller --carried or --context"):
        run.check_args(run.parse_args(carried))
    run.check_args(run.parse_args(["--model", "transformer", "--carried", "2037"]))
