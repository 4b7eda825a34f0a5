"""minipile conversion and caching, baselines, W&B offline runs, the metrics record and sweeps."""

import gzip
import json
import math
import os
from collections import Counter

import datasets
import numpy as np
import pytest
import yaml
from helpers import CACHE, ROOT, cli

import run
from egg import corpora, flags

TINY = [
    "--n_embd",
    "8",
    "--n_layer",
    "1",
    "--parallel_generations_per_gpu",
    "16",
    "--num_epochs",
    "3",
    "--tokens_per_update",
    "8",
    "--validation_batch_size",
    "8",
    "--validation_tokens",
    "32",
]


def local_minipile():
    """A DatasetDict shaped like minipile, built here (no download)."""
    texts = {
        "train": ["first document", "zweites Dokument \u00e9", ""] * 50,
        "validation": ["held out text"] * 40,
        "test": ["test"],
    }
    return datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in texts.items()})


def test_minipile_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    calls = []

    def fake_load_dataset(name):
        calls.append(name)
        return local_minipile()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(corpora, "hub_reachable", lambda: True)
    splits = corpora.load_minipile(str(tmp_path))
    assert calls == [corpora.MINIPILE]
    want = b"".join(b"\0" + t.encode() for t in local_minipile()["train"]["text"])
    assert bytes(splits["train"]) == want and isinstance(splits["train"], np.memmap)
    assert bytes(splits["test"]) == b"\0test"
    corpora.load_minipile(str(tmp_path))
    assert calls == [corpora.MINIPILE]  # second time: the cache, no hub
    monkeypatch.setattr(corpora, "hub_reachable", lambda: pytest.fail("touched the network"))
    train, valid = run.open_data(flags.replace(run.Args(), data="minipile", dir_path=str(tmp_path)))
    assert bytes(train) == want and bytes(valid) == b"\0held out text" * 40
    assert not list(tmp_path.glob("*.tmp*"))


def test_conversion_streams_batches(tmp_path):
    class Batches:
        """A dataset that can only be iterated in batches: no random access, no full list."""

        def iter(self, batch_size):
            for i in range(3):
                yield {"text": [f"doc{i}-{j}" for j in range(2)]}

    corpora.convert_splits({"train": Batches()}, tmp_path, "mini")
    assert (tmp_path / "mini_train.bin").read_bytes() == b"\0doc0-0\0doc0-1\0doc1-0\0doc1-1\0doc2-0\0doc2-1"


def test_unreachable_hub_is_one_line_naming_the_alternatives(tmp_path):
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="0")
    result = cli("--dir_path", str(tmp_path), env=env, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--data stdlib" in lines[0] and "--data PATH" in lines[0]


def test_baselines_match_direct_counting():
    rng = np.random.default_rng(0)
    train = rng.choice(np.frombuffer(b"aab cd\n", np.uint8), 5000).astype(np.uint8)
    rows = rng.choice(np.frombuffer(b"abcd \n", np.uint8), (4, 30)).astype(np.uint8)
    got = corpora.measure_baselines(train, rows)
    unigram, pairs = (
        Counter(train.tolist()),
        Counter(zip(train[:-1].tolist(), train[1:].tolist(), strict=True)),
    )
    context_totals = Counter(train[:-1].tolist())
    uni = bi = 0.0
    n = 0
    for row in rows.tolist():
        for prev, byte in zip(row[:-1], row[1:], strict=True):
            uni -= math.log2((unigram[byte] + 1) / (len(train) + 256))
            bi -= math.log2((pairs[prev, byte] + 1) / (context_totals[prev] + 256))
            n += 1
    assert got["unigram"] == pytest.approx(uni / n) and got["bigram"] == pytest.approx(bi / n)
    assert got["gzip"] == 8 * len(gzip.compress(rows.tobytes(), 9)) / rows.size


def test_baselines_are_cached_beside_the_data(tmp_path, monkeypatch):
    data = tmp_path / "d.bin"
    data.write_bytes(b"hello world " * 100)
    train = np.memmap(data, np.uint8, mode="r")
    rows = np.asarray(train[:64]).reshape(2, 32)
    first = corpora.cached_baselines(train, rows, str(tmp_path))
    monkeypatch.setattr(corpora, "measure_baselines", lambda *a: pytest.fail("recomputed"))
    assert corpora.cached_baselines(train, rows, str(tmp_path)) == first
    assert len(list(tmp_path.glob("baselines-*.json"))) == 1


def test_offline_wandb_run_and_local_record(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    flags = [
        "--data",
        "stdlib",
        "--dir_path",
        CACHE,
        "--runs_dir",
        str(tmp_path / "runs"),
        "--track",
        "--tag",
        "smoke",
        "--wandb_project",
        "egg-test",
        "--validate_every",
        "2",
        "--sample_every",
        "2",
        "--log_every",
        "3",
        "--debug",
        "--max_new_bytes",
        "16",
        *TINY,
    ]
    result = cli(*flags, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "baselines on the validation bytes" in result.stdout
    assert "(unigram" in result.stdout
    folder = next((tmp_path / "runs").iterdir())
    assert folder.name.endswith("-smoke") and "8D1L" in folder.name
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [line["generation"] for line in lines] == [1, 2, 3]
    assert all(
        key.split("/")[0] in ("train", "val", "perf", "samples", "diag")
        for line in lines
        for key in line
        if key != "generation"
    )
    assert "val/bits_per_byte" in lines[1] and "val/unigram_bits_per_byte" in lines[2]
    assert "generation 2 sample: The " in result.stdout and "samples/text" in lines[1]
    assert "samples/text" not in lines[0] and len(lines[1]["samples/text"]) >= 16
    assert "generation 3 diagnostics:" in result.stdout and "\033[" in result.stdout
    assert (
        "diag/param_emb/moved" in lines[2]
        and "diag/gate0/entropy" in lines[2]
        and "diag/gate0/mean" not in lines[1]
    )
    assert json.loads((folder / "config.json").read_text())["track"] is True
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    raw = log.read_bytes()
    for key in ("train/bits_per_byte", "val/bits_per_byte", "perf/tokens_per_s"):
        assert key.encode() in raw and json.dumps(lines[-1][key]).encode() in raw
    assert folder.name.encode() in raw and b"smoke" in raw
    config = json.loads((folder / "config.json").read_text())
    for key in ("n_embd", "alpha", "wandb_project", "sample_every"):  # the run's config
        assert key.encode() in raw and json.dumps(config[key]).encode() in raw, key
    for name in ("unigram", "bigram"):  # the summary's baselines, as logged beside validation
        value = lines[1][f"val/{name}_bits_per_byte"]
        assert f"baseline/{name}".encode() in raw and json.dumps(value).encode() in raw, name
    (table,) = (tmp_path / "wandb").glob("offline-run-*/files/media/table/samples/text_*.table.json")
    samples = json.loads(table.read_text())
    assert samples == {"columns": ["generation", "text"], "data": [[2, lines[1]["samples/text"]]]}


def agent_command(sweep: dict, values: dict) -> list[str]:
    """The command line a W&B agent runs for one configuration, built with wandb's own code."""
    from wandb.sdk.launch.sweeps import utils

    variables = utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in values.items()}})
    variables.update(env=[], interpreter=[], program=[])
    command = []
    for chunk in utils.create_sweep_command(list(sweep["command"])):
        command += variables[chunk[2:-1]] if chunk.startswith("${") else [chunk]
    return command


def grid(sweep: dict) -> list[dict]:
    """Every point of a sweep's grid: {parameter: value}."""
    points = [{}]
    for name, spec in sweep["parameters"].items():
        points = [{**p, name: v} for p in points for v in spec.get("values", [spec.get("value")])]
    return points


@pytest.mark.parametrize("file", ["sweep.yaml", "sweep_upstream.yaml"])
def test_every_sweep_point_reaches_the_script_as_a_valid_configuration(file):
    sweep = yaml.safe_load((ROOT / file).read_text())
    fields = set(flags.hints_of(run.Args))
    assert set(sweep["parameters"]) <= fields, set(sweep["parameters"]) - fields
    for point in grid(sweep):
        args = run.parse_args(agent_command(sweep, point))
        run.check_args(args)
        assert (
            args.tracking.track is True
            and args.parallel_generations_per_gpu == point["parallel_generations_per_gpu"]
        )
        if point.get("algorithm") == "upstream":  # upstream's algorithm, as the file says
            assert all(flags.value(args, k) == v for k, v in flags.upstream_preset(run.Args).items())
        else:  # egg-jax's defaults for every flag the file does not set
            defaults = run.Args()
            assert all(flags.value(args, k) == flags.value(defaults, k) for k in fields - set(point))


def test_sweep_booleans_reach_the_script():
    sweep = yaml.safe_load((ROOT / "sweep_upstream.yaml").read_text())
    values = {k: v.get("value", v.get("values", [None])[0]) for k, v in sweep["parameters"].items()}
    values.update(use_clt=False, fast_fitness=False)
    command = agent_command(sweep, values)
    args = run.parse_args(command)
    print("agent command:", " ".join(command))
    assert args.use_clt is False and args.fast_fitness is False
    # the upstream macro drops false booleans, so the defaults (True) would silently win
    upstream = agent_command(dict(sweep, command=["${args_no_boolean_flags}"]), values)
    assert run.parse_args(upstream).use_clt is True


@pytest.mark.parametrize(
    "argv, clt, fast, track",
    [
        (["--use_clt=False", "--fast_fitness=true"], False, True, False),
        (["--use_clt", "False", "--track", "--fast_fitness", "True"], False, True, True),
        (["--no-use_clt", "--no-fast_fitness", "--track=True"], False, False, True),
        (["--use-clt", "--fast-fitness=False"], True, False, False),
    ],
)
def test_boolean_forms(argv, clt, fast, track):
    args = run.parse_args(argv)
    assert (args.use_clt, args.fast_fitness, args.tracking.track) == (clt, fast, track)


def test_boolean_with_a_bad_value_is_refused():
    with pytest.raises(run.UserError, match="True or False"):
        run.parse_args(["--use_clt=maybe"])
