"""The command line end to end: every bad input refused in one line with exit code 2, before
anything is created; every update rule learning below unigram; JAX's own choice of platform."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
import tyro
from helpers import CACHE, TINY, cli, in_process, one_line_error, optimised_env
from test_flags import range_cases

import run
from egg import corpus

BAD_INPUT = [
    *range_cases(),
    (["--data", "/no/such/file"], "--data /no/such/file: no such path"),
    # conftest.py sets the device count through XLA_FLAGS, as a user may
    (
        ["--cpu_devices", "2"],
        "--cpu_devices 2: XLA_FLAGS or JAX_NUM_CPU_DEVICES set the device count",
    ),
    (["--data", "EMPTY"], "--data EMPTY: the file is empty"),
    (["--data", "FOLDER"], "--data FOLDER: the folder holds no file with bytes in it"),
    (["--data", "EMPTIES"], "--data EMPTIES: the folder holds no file with bytes in it"),
    (["--rank", "9999"], "--rank must be in [0, 64] (0: full-rank noise), got 9999"),
    (["--data", "INT32.npy"], "--data INT32.npy: holds a int32 array"),
    (["--data", "BROKEN.npy"], "--data BROKEN.npy: not a readable .npy array"),
    (
        ["--data", "SHORT", "--valid_data", "/no/such/file"],
        "--valid_data /no/such/file: no such path",
    ),
    (["--data", "SHORT", "--valid_data", "EMPTY"], "--valid_data EMPTY: the file is empty"),
    (
        ["--data", "SHORT", "--validation_batch_size", "1"],
        "training data has 238 bytes: too short for 32 sequences",
    ),
    (["--group_size", "3"], "--group_size must be even"),
    (["--group_size", "6"], "--group_size must be even and divide the population 64"),
    (
        ["--parallel_generations_per_gpu", "7", "--group_size", "7"],
        "--parallel_generations_per_gpu must be even",
    ),
    (["--num_perturbations", "6"], "--num_perturbations must be even and divide"),
    (["--n_embd", "6"], "--n_embd must be a multiple of 4"),
    (["--alpha", "1e-70"], "--alpha 1e-70 at population 64: the test's threshold"),
    (["--sigma_shift", "7"], "every bias and gain perturbation rounds to 0"),
    (
        ["--optimizer", "ztest", "--alpha", "1e-70"],
        "is beyond the largest |Z| a matrix entry can reach",
    ),
    (["--alpha", "1e-70"], "is beyond the largest running sum |m| a matrix entry can reach (508)"),
    (["--num_procs", "2", "--proc_id", "2"], "--proc_id must be below --num_procs, got 2 of 2"),
    (["--parallel_generations_per_gpu", "2097152", "--group_size", "2"], "Z of a matrix entry"),
    (["--no-fast_fitness", "--parallel_generations_per_gpu", "270336"], "or --shaping sign"),
    (["--shaping", "ranks"], "--shaping must be one of sign, normalised, standardised, got ranks"),
    (["--optimizer", "adam"], "--optimizer adam: tried and not adopted"),
    (["--mlp_relu"], "--mlp_relu: tried and not adopted (docs/results.org"),
    (["--tokens_per_update", "400000"], "use a smaller --tokens_per_update"),
    (["--n_embd", "65536"], "use a smaller --n_embd"),
]


def bad_input_files(folder):
    """The files the bad-input cases name, by placeholder."""
    (folder / "empty.txt").write_bytes(b"")
    (folder / "short.txt").write_bytes(b"tiny corpus " * 20)
    (folder / "nothing").mkdir()
    (folder / "nothing" / ".hidden").write_bytes(b"skipped")
    (folder / "empties").mkdir()
    (folder / "empties" / "empty.txt").write_bytes(b"")
    np.save(folder / "int32.npy", np.arange(1000, dtype=np.int32))
    (folder / "broken.npy").write_bytes(b"not an array")
    names = {
        "EMPTY": "empty.txt",
        "SHORT": "short.txt",
        "FOLDER": "nothing",
        "EMPTIES": "empties",
        "INT32.npy": "int32.npy",
        "BROKEN.npy": "broken.npy",
    }
    return {placeholder: str(folder / name) for placeholder, name in names.items()}


@pytest.mark.parametrize("flags, message", BAD_INPUT)
def test_bad_input_is_one_line_naming_the_flag_and_exit_code_2(
    tmp_path, monkeypatch, capsys, flags, message
):
    files = bad_input_files(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for placeholder, path in files.items():
        message = message.replace(placeholder, path)
    monkeypatch.chdir(tmp_path)  # the default --runs_dir is relative to it
    small = "--n_embd 8 --n_layer 1 --parallel_generations_per_gpu 64 --group_size 2".split()
    result = in_process(
        capsys, "--dir_path", str(tmp_path / "cache"), *small, *[files.get(f, f) for f in flags]
    )
    one_line_error(result, message)
    # refused before anything was created: no run folder, no checkpoints, no cache
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_bad_input_in_a_new_process_is_one_line_on_stderr_and_exit_code_2(tmp_path):
    one_line_error(
        cli("--data", "/no/such/file", cwd=tmp_path), "--data /no/such/file: no such path"
    )
    assert list(tmp_path.iterdir()) == []


def unigram_cross_entropy(train, rows):
    """Bits/byte of a unigram model estimated on the training bytes, scored on the rows."""
    counts = np.bincount(np.asarray(train), minlength=256).astype(np.float64) + 1
    targets = np.bincount(rows[:, 1:].ravel(), minlength=256)
    return float(-(targets * np.log2(counts / counts.sum())).sum() / targets.sum())


@pytest.mark.parametrize("rule", [["--optimizer", "momentum"], ["--algorithm", "upstream"]])
def test_every_update_rule_learns_below_unigram_on_word_salad(tmp_path, rule):
    """Random words from a vocabulary of 17: what follows a letter is mostly fixed, so a model
    that learns anything beats the unigram quickly. 200 generations of a 16D-1L model end near
    2.9-3.9 bits/byte (momentum 2.86, upstream's Z-test 3.91; unigram 4.21). In a process of its
    own with XLA's optimisations: its 200 generations run 5 times faster than conftest.py's
    compile-bound settings run them."""
    words = (
        "the quick brown fox jumps over the lazy dog and a cat sat on the mat while birds sing"
    ).split()
    rng = np.random.default_rng(0)
    (tmp_path / "words.txt").write_text(" ".join(rng.choice(words, 40_000)))
    flags = [
        "--data",
        str(tmp_path / "words.txt"),
        "--dir_path",
        str(tmp_path),
        "--runs_dir",
        str(tmp_path),
    ]
    flags += (
        "--n_embd 16 --n_layer 1 --parallel_generations_per_gpu 64 --group_size 64 "
        "--num_epochs 200 --tokens_per_update 64 --validation_batch_size 16 "
        "--validation_tokens 256 --save_every 0"
    ).split()
    result = cli(*flags, *rule, env=optimised_env())
    assert result.returncode == 0, result.stderr[-2000:]
    score = float(re.findall(r"validation bits/byte ([0-9.]+)", result.stdout)[-1])
    args = run.parse_args([*flags, *rule])
    train, valid = corpus.open_data(args.corpus, 2 * args.validation_batch_size)
    baseline = unigram_cross_entropy(train, run.validation_rows(valid, args))
    print(f"{' '.join(rule)}: {score:.4f} bits/byte, unigram {baseline:.4f}")
    assert score < baseline - 0.2


def test_the_first_runs_flags_learn_below_unigram_entropy_on_the_offline_corpus(tmp_path):
    """README's first run (32D-1L, population 1024, 100 bytes a member, every other flag its
    default) for 60 of its 1,300 generations, on one CPU device: 4.382 bits/byte on 64 rows of 512
    held-out bytes, whose unigram is 4.646 (4.513 at 40 generations, too thin a margin)."""
    flags = ["--data", "stdlib", "--dir_path", CACHE, "--runs_dir", str(tmp_path / "runs")]
    flags += (
        "--n_embd 32 --n_layer 1 --parallel_generations_per_gpu 1024 --tokens_per_update 100 "
        "--num_epochs 60 --validation_batch_size 64 --validation_tokens 512"
    ).split()
    result = cli(*flags, env=optimised_env())
    assert result.returncode == 0, result.stderr[-2000:]
    scores = [float(x) for x in re.findall(r"validation bits/byte ([0-9.]+)", result.stdout)]
    args = tyro.cli(run.Args, args=flags)
    train, valid = corpus.open_data(args.corpus, 2 * args.validation_batch_size)
    rows = run.validation_rows(valid, args)
    corpus_entropy = unigram_cross_entropy(train, np.asarray(train[None, :]))
    baseline = unigram_cross_entropy(train, rows)
    print(
        f"model {scores[-1]:.4f}, unigram on the same rows {baseline:.4f}, "
        f"corpus {corpus_entropy:.4f}"
    )
    assert scores[-1] < min(baseline, corpus_entropy)
    (cache,) = Path(CACHE).glob("stdlib-*.bin")
    assert os.path.getsize(cache) > 10_000_000


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a machine with an NVIDIA device")
def test_the_platform_is_jaxs_own_choice_and_a_missing_one_is_one_line(tmp_path):
    """No JAX_PLATFORMS and no --platform: JAX chooses (the CPU here, where jax[cuda12]'s plugin
    cannot start) without printing the plugin's traceback; --platform cuda is refused in one
    line."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    flags = [*TINY, "--runs_dir", str(tmp_path), "--num_epochs", "1", "--save_every", "0"]
    result = cli(*flags, env=env)
    assert result.returncode == 0 and "population 16 on 1 cpu device(s)" in result.stdout, (
        result.stderr[-2000:]
    )
    assert "Traceback" not in result.stderr and "plugin" not in result.stderr
    one_line_error(cli(*flags, "--platform", "cuda", env=env), "JAX cannot start platform cuda")
    backprop = cli(  # the float baseline beside it, as quiet
        *flags, "--batch_size", "2", "--window", "8", env=env, script="baselines/backprop.py"
    )
    assert backprop.returncode == 0, backprop.stderr[-2000:]
    assert "Traceback" not in backprop.stderr and "plugin" not in backprop.stderr
