"""Data loading, the command line, and learning end to end."""

import dataclasses
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import tyro
from helpers import CACHE, TINY, cli, in_process, one_line_error, optimised_env

import run
from egg import corpora, flags, record


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
    assert (args.corpus.data, args.corpus.valid_data, args.parallel_generations_per_gpu) == ("x", "y", 64)


def test_algorithm_upstream_sets_upstreams_values_of_flags_not_given():
    ours = run.parse_args([])
    preset = flags.upstream_preset(run.Args)
    assert set(preset) == {"alpha_floor", "sigma_shift", "segments", "optimizer", "fast_fitness"} | {
        "shared_pair_state",
        "init_std",
        "max_step",
    }
    changed = {k for k, v in preset.items() if getattr(ours, k) != v}
    assert changed == set(preset)  # each entry is a default that differs
    upstream = run.parse_args(["--algorithm", "upstream"])
    assert {k: getattr(upstream, k) for k in preset} == preset
    assert dataclasses.replace(upstream, algorithm="egg", **{k: getattr(ours, k) for k in changed}) == ours
    for given in (["--mlp_relu"], ["--mlp-relu=True"], ["--mlp_relu", "true"]):
        assert run.parse_args(["--algorithm", "upstream", *given]).mlp_relu is True, given
    # runs apart: the name records upstream's sigma_shift and the preset
    assert (
        record.default_run_name(upstream)
        == record.default_run_name(dataclasses.replace(ours, sigma_shift=4)) + "-upstream"
    )
    both = run.parse_args(["--algorithm", "upstream", "--no-fast_fitness", "--optimizer", "momentum"])
    assert (both.fast_fitness, both.optimizer, both.mlp_relu) == (False, "momentum", False)


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
    for skipped in ("__pycache__", "site-packages", ".git"):
        (folder / "sub" / skipped).mkdir()
        (folder / "sub" / skipped / "x.pyc").write_bytes(b"never")
    corpus = corpora.load_corpus(str(folder), str(tmp_path / "cache"))
    assert bytes(corpus) == b"\0first\0second\0third"
    assert isinstance(corpus, np.memmap)
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    corpora.load_corpus(str(folder), str(tmp_path / "cache"))
    assert cached[0].stat().st_mtime_ns == stamp  # reused, not rewritten
    edited = folder / "sub" / "c.txt"
    before = edited.stat().st_mtime_ns
    edited.write_bytes(b"THIRD")  # same size, new contents: rebuilt (its time moved on, as in an edit)
    os.utime(edited, ns=(before + 10**9, before + 10**9))
    assert bytes(corpora.load_corpus(str(folder), str(tmp_path / "cache"))) == b"\0first\0second\0THIRD"
    (folder / "a.txt").unlink()
    assert bytes(corpora.load_corpus(str(folder), str(tmp_path / "cache"))) == b"\0second\0THIRD"


def test_uint8_npy_data_is_read_as_bytes(tmp_path):
    data = np.frombuffer(b"\0an array of bytes, as upstream caches minipile", np.uint8)
    np.save(tmp_path / "train.npy", data)
    corpus = corpora.load_corpus(str(tmp_path / "train.npy"), str(tmp_path / "cache"))
    assert corpus.dtype == np.uint8 and bytes(corpus) == data.tobytes()
    assert not (tmp_path / "cache").exists()  # read in place, nothing converted


def test_stdlib_corpus_is_python_source():
    files = corpora.corpus_files(corpora.stdlib_folder(), ".py")
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)


def test_split_batches_and_validation_rows(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    args = flags.replace(
        run.Args(),
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
    train2, valid2 = run.open_data(flags.replace(run.Args(), data=str(data), valid_data=str(other)))
    assert len(train2) == 10240 and bytes(valid2) == b"xy" * 100


def outside(end: float, is_open: bool, step: int, kind: type):
    """A value just outside one end of a range: the end itself if it is excluded, else one step
    (an int flag) or half a unit (a float flag) beyond it."""
    return kind(end) if is_open else kind(end + step * (1 if kind is int else 0.5))


def range_cases() -> list[tuple[list[str], str]]:
    """For every flag with a range (its Facts in run.py): a value just outside each finite end,
    and the refusal that names the flag, its range and the value."""
    cases, defaults = [], run.Args()
    for name, facts in flags.facts_of(run.Args).items():
        kind = type(flags.value(defaults, name))
        for end, is_open, step in ((facts.low, facts.open[0], -1), (facts.high, facts.open[1], 1)):
            if math.isfinite(end):
                value = outside(end, is_open, step, kind)
                cases.append(([f"--{name}", str(value)], f"--{name} must be {facts.allowed()}, got {value}"))
    return cases


def test_the_ranges_cover_the_flags_whose_values_are_bounded():
    """Every int or float flag that has a bound has it in its Facts (one place), and the cases
    above reach both kinds of end."""
    ranged = {name for name, facts in flags.facts_of(run.Args).items() if facts.ranged()}
    unbounded = {"presence_penalty", "sample_replica"}  # any value means something
    numbers = {
        name for name in flags.hints_of(run.Args) if type(flags.value(run.Args(), name)) in (int, float)
    }
    assert numbers - ranged == unbounded
    messages = [message for _, message in range_cases()]
    assert any("positive" in m for m in messages) and any("in (0, 0.5)" in m for m in messages)


BAD_INPUT = [
    *range_cases(),
    (["--data", "/no/such/file"], "--data /no/such/file: no such path"),
    # conftest.py sets the device count through XLA_FLAGS, as a user may
    (["--cpu_devices", "2"], "--cpu_devices 2: XLA_FLAGS or JAX_NUM_CPU_DEVICES set the device count"),
    (["--data", "EMPTY"], "--data EMPTY: the file is empty"),
    (["--data", "FOLDER"], "--data FOLDER: the folder holds no files"),
    (["--data", "INT32.npy"], "--data INT32.npy: holds a int32 array"),
    (["--data", "BROKEN.npy"], "--data BROKEN.npy: not a readable .npy array"),
    (["--data", "SHORT", "--valid_data", "/no/such/file"], "--valid_data /no/such/file: no such path"),
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
    (["--alpha", "1e-70"], "--alpha 1e-70 at population 64: the Z-test threshold"),
    (["--sigma_shift", "7"], "every bias and gain perturbation rounds to 0"),
    (["--optimizer", "ztest", "--alpha", "1e-70"], "is beyond the largest |Z| a matrix entry can reach"),
    (["--alpha", "1e-70"], "is beyond the largest running sum |m| a matrix entry can reach (508)"),
    (["--num_procs", "2", "--proc_id", "2"], "--proc_id must be below --num_procs, got 2 of 2"),
    (["--parallel_generations_per_gpu", "2097152", "--group_size", "2"], "Z of a matrix entry"),
    (["--no-fast_fitness", "--parallel_generations_per_gpu", "270336"], "or --fast_fitness"),
    (["--tokens_per_update", "400000"], "use a smaller --tokens_per_update"),
    (["--n_embd", "65536"], "use a smaller --n_embd"),
]


def bad_input_files(folder):
    """The files the bad-input cases name, by placeholder."""
    (folder / "empty.txt").write_bytes(b"")
    (folder / "short.txt").write_bytes(b"tiny corpus " * 20)
    (folder / "nothing").mkdir()
    (folder / "nothing" / ".hidden").write_bytes(b"skipped")
    np.save(folder / "int32.npy", np.arange(1000, dtype=np.int32))
    (folder / "broken.npy").write_bytes(b"not an array")
    names = {
        "EMPTY": "empty.txt",
        "SHORT": "short.txt",
        "FOLDER": "nothing",
        "INT32.npy": "int32.npy",
        "BROKEN.npy": "broken.npy",
    }
    return {placeholder: str(folder / name) for placeholder, name in names.items()}


@pytest.mark.parametrize("flags, message", BAD_INPUT)
def test_bad_input_is_one_line_naming_the_flag_and_exit_code_2(tmp_path, monkeypatch, capsys, flags, message):
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
    one_line_error(cli("--data", "/no/such/file", cwd=tmp_path), "--data /no/such/file: no such path")
    assert list(tmp_path.iterdir()) == []


def unigram_cross_entropy(train, rows):
    """Bits/byte of a unigram model estimated on the training bytes, scored on the rows."""
    counts = np.bincount(np.asarray(train), minlength=256).astype(np.float64) + 1
    targets = np.bincount(rows[:, 1:].ravel(), minlength=256)
    return float(-(targets * np.log2(counts / counts.sum())).sum() / targets.sum())


@pytest.mark.parametrize(
    "rule", [["--optimizer", "momentum"], ["--optimizer", "adam"], ["--algorithm", "upstream"]]
)
def test_every_update_rule_learns_below_unigram_on_word_salad(tmp_path, capsys, rule):
    """Random words from a vocabulary of 17: what follows a letter is mostly fixed, so a model
    that learns anything beats the unigram quickly. 200 generations of a 16D-1L model end near
    3.5-3.9 bits/byte (momentum 3.50, adam 3.62, upstream's Z-test 3.91; unigram 4.21)."""
    words = "the quick brown fox jumps over the lazy dog and a cat sat on the mat while birds sing".split()
    rng = np.random.default_rng(0)
    (tmp_path / "words.txt").write_text(" ".join(rng.choice(words, 40_000)))
    flags = ["--data", str(tmp_path / "words.txt"), "--dir_path", str(tmp_path), "--runs_dir", str(tmp_path)]
    flags += (
        "--n_embd 16 --n_layer 1 --parallel_generations_per_gpu 64 --group_size 64 --num_epochs 200 "
        "--tokens_per_update 64 --validation_batch_size 16 --validation_tokens 256 --save_every 0"
    ).split()
    result = in_process(capsys, *flags, *rule)
    assert result.returncode == 0, result.stderr[-2000:]
    score = float(re.findall(r"validation bits/byte ([0-9.]+)", result.stdout)[-1])
    args = run.parse_args([*flags, *rule])
    train, valid = run.open_data(args)
    baseline = unigram_cross_entropy(train, run.validation_rows(valid, args))
    print(f"{' '.join(rule)}: {score:.4f} bits/byte, unigram {baseline:.4f}")
    assert score < baseline - 0.2


def test_tiny_model_learns_below_unigram_entropy_on_the_offline_corpus(tmp_path):
    """The default rule (--optimizer momentum, normalised scores, shared pair states) on 32D-1L,
    population 128, alpha 3: with one segment, validated every 50 generations, 5.83 bits/byte at
    generation 50, 5.12 at 100, 4.73 at 300, 4.57 at 400 (the first below the rows' unigram 4.65),
    4.71 at 500, 4.48 at 550, 4.43 at 600, 4.36 at 800; with the default 10 segments 4.72 at 300
    and 4.45 at 600. 600 generations pass by 0.2; fewer would pass by too thin a margin."""
    flags = ["--data", "stdlib", "--dir_path", CACHE, "--runs_dir", str(tmp_path / "runs")]
    flags += (
        "--n_embd 32 --n_layer 1 --parallel_generations_per_gpu 128 --group_size 128 --alpha 3 "
        "--sigma_shift 3 --num_epochs 600 --tokens_per_update 100 --validation_batch_size 64 "
        "--validation_tokens 512 --validate_every 300"
    ).split()
    result = cli(*flags, env=optimised_env())
    assert result.returncode == 0, result.stderr[-2000:]
    scores = [float(x) for x in re.findall(r"validation bits/byte ([0-9.]+)", result.stdout)]
    args = tyro.cli(run.Args, args=flags)
    train, valid = run.open_data(args)
    rows = run.validation_rows(valid, args)
    corpus_entropy = unigram_cross_entropy(train, np.asarray(train[None, :]))
    baseline = unigram_cross_entropy(train, rows)
    print(f"model {scores[-1]:.4f}, unigram on the same rows {baseline:.4f}, corpus {corpus_entropy:.4f}")
    assert scores[-1] < min(baseline, corpus_entropy)
    (cache,) = Path(CACHE).glob("stdlib-*.bin")
    assert os.path.getsize(cache) > 10_000_000


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a machine with an NVIDIA device")
def test_the_platform_is_jaxs_own_choice_and_a_missing_one_is_one_line(tmp_path):
    """No JAX_PLATFORMS and no --platform: JAX chooses (the CPU here, where jax[cuda12]'s plugin
    cannot start) without printing the plugin's traceback; --platform cuda is refused in one line."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    flags = [*TINY, "--runs_dir", str(tmp_path), "--num_epochs", "1", "--save_every", "0"]
    result = cli(*flags, env=env)
    assert result.returncode == 0 and "population 16 on 1 cpu device(s)" in result.stdout, result.stderr[
        -2000:
    ]
    assert "Traceback" not in result.stderr and "plugin" not in result.stderr
    one_line_error(cli(*flags, "--platform", "cuda", env=env), "JAX cannot start platform cuda")
