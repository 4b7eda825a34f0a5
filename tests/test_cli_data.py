"""Data loading, the command line, and learning end to end."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
import tyro
from helpers import cli, one_line_error

import run


def test_upstream_flag_names_parse():
    args = tyro.cli(
        run.Args,
        args=[
            "--parallel_generations_per_gpu",
            "64",
            "--num_epochs",
            "3",
            "--alpha",
            "0.5",
            "--sigma_shift",
            "3",
            "--no-use_clt",
            "--no-fast_fitness",
            "--alpha_decay_timestep",
            "7",
            "--n_layer",
            "2",
            "--n_embd",
            "16",
            "--noise_reuse",
            "0",
            "--tokens_per_update",
            "9",
            "--num_perturbations",
            "8",
            "--group_size",
            "4",
            "--validate_every",
            "2",
            "--validation_batch_size",
            "8",
            "--seed",
            "5",
            "--rank",
            "2",
            "--data",
            "x",
            "--valid_data",
            "y",
        ],
    )
    assert (args.use_clt, args.fast_fitness, args.noise_reuse, args.rank) == (False, False, 0, 2)
    assert (args.data, args.valid_data, args.parallel_generations_per_gpu) == ("x", "y", 64)


def test_help_spells_flags_with_underscores_and_both_spellings_parse(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--num_epochs", "--parallel_generations_per_gpu", "--no_use_clt", "--valid_data PATH"):
        assert flag in text, flag
    assert "--num-epochs" not in text and "{None}" not in text
    (line,) = [x for x in text.splitlines() if "--valid_data PATH" in x]
    assert "a separate validation file or folder (default: minipile's validation split, else" in line
    dashes = run.parse_args(["--num-epochs", "5", "--no-use-clt", "--parallel-generations-per-gpu=8"])
    underscores = run.parse_args(["--num_epochs", "5", "--no-use_clt", "--parallel_generations_per_gpu=8"])
    assert dashes == underscores and (dashes.num_epochs, dashes.use_clt) == (5, False)


def test_folder_corpus_is_concatenated_with_separators_and_cached(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_bytes(b"second")
    (folder / "a.txt").write_bytes(b"first")
    (folder / "sub" / "c.txt").write_bytes(b"third")
    (folder / ".hidden").write_bytes(b"never")
    corpus = run.load_corpus(str(folder), str(tmp_path / "cache"))
    assert bytes(corpus) == b"\0first\0second\0third"
    assert isinstance(corpus, np.memmap)
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    run.load_corpus(str(folder), str(tmp_path / "cache"))
    assert cached[0].stat().st_mtime_ns == stamp  # reused, not rewritten


def test_stdlib_corpus_is_python_source():
    files = run.corpus_files(run.stdlib_folder(), ".py")
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)


def test_split_batches_and_validation_rows(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    args = run.Args(
        data=str(data),
        validation_batch_size=8,
        parallel_generations_per_gpu=8,
        group_size=2,
        tokens_per_update=10,
        dir_path=str(tmp_path),
    )
    train, valid = run.open_data(args)
    assert len(valid) == int(10240 * 0.01) and len(train) + len(valid) == 10240
    c = run.make_config(args)
    stream = run.make_stream(len(train), c)
    assert stream.stride == len(train) // 4
    for g in (0, 1, stream.windows, stream.windows + 3):
        batch = run.batch_at(train, stream, c, g)
        assert batch.shape == (4, 11)
        for s in range(4):
            start = s * stream.stride + (g % stream.windows) * 10
            np.testing.assert_array_equal(batch[s], train[start : start + 11])
    rows = run.validation_rows(valid, args)
    assert rows.shape == (8, len(valid) // 8)
    other = tmp_path / "valid.bin"
    other.write_bytes(b"xy" * 100)
    train2, valid2 = run.open_data(run.Args(data=str(data), valid_data=str(other)))
    assert len(train2) == 10240 and bytes(valid2) == b"xy" * 100


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data", "/no/such/file"], "does not exist"),
        (["--group_size", "3"], "--group_size"),
        (["--parallel_generations_per_gpu", "7", "--group_size", "7"], "even"),
        (["--num_epochs", "0"], "--num_epochs must be positive"),
        (["--alpha", "0"], "--alpha"),
        (["--sigma_shift", "16"], "--sigma_shift"),
        (["--sigma_shift", "7"], "every bias and gain perturbation rounds to 0"),
        (["--alpha_decay_timestep", "0"], "--alpha_decay_timestep must be positive"),
        (["--alpha", "1e-70"], "nothing would ever move"),
        (["--num_perturbations", "6"], "--num_perturbations"),
        (["--data", "EMPTY"], "empty"),
        (["--data", "SHORT", "--validation_batch_size", "1"], "too short"),
        (["--parallel_generations_per_gpu", "0"], "must be positive"),
        (["--tokens_per_update", "-3"], "must be positive"),
        (["--n_layer", "0"], "must be positive"),
        (["--rank", "65"], "--rank"),
        (["--rank", "-1"], "--rank"),
        (["--sigma_shift", "-1"], "--sigma_shift"),
        (["--alpha", "-1"], "--alpha"),
        (["--group_size", "6"], "divide the population"),
        (["--parallel_generations_per_gpu", "2097152", "--group_size", "2"], "Z of a matrix entry"),
        (["--no-fast_fitness", "--parallel_generations_per_gpu", "32768"], "--fast_fitness"),
        (["--tokens_per_update", "400000"], "--tokens_per_update"),
        (["--save_every", "-1"], "--save_every"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, flags, message):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "short.txt").write_bytes(b"tiny corpus " * 20)
    flags = [
        {"EMPTY": str(tmp_path / "empty.txt"), "SHORT": str(tmp_path / "short.txt")}.get(f, f) for f in flags
    ]
    result = cli(
        "--runs_dir",
        str(tmp_path / "runs"),
        "--dir_path",
        str(tmp_path / "cache"),
        "--n_embd",
        "8",
        "--n_layer",
        "1",
        "--parallel_generations_per_gpu",
        "64",
        "--group_size",
        "2",
        *flags,
        cwd=tmp_path,
    )
    one_line_error(result, message)
    # refused before anything was created: no run folder, no checkpoints, no cache
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "short.txt"]


def unigram_cross_entropy(train, rows):
    """Bits/byte of a unigram model estimated on the training bytes, scored on the rows."""
    counts = np.bincount(np.asarray(train), minlength=256).astype(np.float64) + 1
    targets = np.bincount(rows[:, 1:].ravel(), minlength=256)
    return float(-(targets * np.log2(counts / counts.sum())).sum() / targets.sum())


def test_tiny_model_learns_below_unigram_entropy_on_the_offline_corpus(tmp_path):
    flags = ["--data", "stdlib", "--dir_path", str(tmp_path), "--runs_dir", str(tmp_path / "runs")]
    flags += (
        "--n_embd 32 --n_layer 1 --parallel_generations_per_gpu 128 --group_size 128 --alpha 3 "
        "--sigma_shift 3 --num_epochs 800 --tokens_per_update 100 --validation_batch_size 64 "
        "--validation_tokens 512 --validate_every 400"
    ).split()
    result = cli(*flags)
    assert result.returncode == 0, result.stderr[-2000:]
    scores = [float(x) for x in re.findall(r"validation bits/byte ([0-9.]+)", result.stdout)]
    args = tyro.cli(run.Args, args=flags)
    train, valid = run.open_data(args)
    rows = run.validation_rows(valid, args)
    corpus_entropy = unigram_cross_entropy(train, np.asarray(train[None, :]))
    baseline = unigram_cross_entropy(train, rows)
    print(f"model {scores[-1]:.4f}, unigram on the same rows {baseline:.4f}, corpus {corpus_entropy:.4f}")
    assert scores[-1] < min(baseline, corpus_entropy)
    (cache,) = Path(tmp_path).glob("stdlib-*.bin")
    assert os.path.getsize(cache) > 10_000_000
