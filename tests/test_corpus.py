"""The bytes a run reads (egg/corpus.py and run.py's data stream): minipile converted once and read
from its cache, folders, .npy arrays and the standard library, the split into training and
validation, the sequences each generation reads, and the baselines beside every validation."""

import gzip
import math
import os
from collections import Counter

import datasets
import numpy as np
import pytest
from helpers import cli

import run
from egg import corpus, flags


def local_minipile():
    """A DatasetDict shaped like minipile, built here (no download)."""
    texts = {
        "train": ["first document", "zweites Dokument \u00e9", ""] * 50,
        "validation": ["held out text"] * 40,
        "test": ["test"],
    }
    return datasets.DatasetDict(
        {k: datasets.Dataset.from_dict({"text": v}) for k, v in texts.items()}
    )


def test_minipile_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    calls = []

    def fake_load_dataset(name):
        calls.append(name)
        return local_minipile()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(corpus, "hub_reachable", lambda: True)
    splits = corpus.load_minipile(str(tmp_path))
    assert calls == [corpus.MINIPILE]
    want = b"".join(b"\0" + t.encode() for t in local_minipile()["train"]["text"])
    assert bytes(splits["train"]) == want and isinstance(splits["train"], np.memmap)
    assert bytes(splits["test"]) == b"\0test"
    corpus.load_minipile(str(tmp_path))
    assert calls == [corpus.MINIPILE]  # second time: the cache, no hub
    monkeypatch.setattr(corpus, "hub_reachable", lambda: pytest.fail("touched the network"))
    train, valid = corpus.open_data(corpus.Flags(data="minipile", dir_path=str(tmp_path)), 2048)
    assert bytes(train) == want and bytes(valid) == b"\0held out text" * 40
    assert not list(tmp_path.glob("*.tmp*"))


def test_conversion_streams_batches(tmp_path):
    class Batches:
        """A dataset that can only be iterated in batches: no random access, no full list."""

        def iter(self, batch_size):
            for i in range(3):
                yield {"text": [f"doc{i}-{j}" for j in range(2)]}

    corpus.convert_splits({"train": Batches()}, tmp_path, "mini")
    assert (
        tmp_path / "mini_train.bin"
    ).read_bytes() == b"\0doc0-0\0doc0-1\0doc1-0\0doc1-1\0doc2-0\0doc2-1"


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
    got = corpus.measure_baselines(train, rows)
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
    first = corpus.cached_baselines(train, rows, str(tmp_path))
    monkeypatch.setattr(corpus, "measure_baselines", lambda *a: pytest.fail("recomputed"))
    assert corpus.cached_baselines(train, rows, str(tmp_path)) == first
    assert len(list(tmp_path.glob("baselines-*.json"))) == 1


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
    data = corpus.load_corpus(str(folder), str(tmp_path / "cache"))
    assert bytes(data) == b"\0first\0second\0third"
    assert isinstance(data, np.memmap)
    cached = list((tmp_path / "cache").glob("*.bin"))  # beside it, its check
    assert len(cached) == 1 and corpus.check_file(cached[0]).exists()
    stamp = cached[0].stat().st_mtime_ns
    corpus.load_corpus(str(folder), str(tmp_path / "cache"))
    assert cached[0].stat().st_mtime_ns == stamp  # reused, not rewritten
    edited = folder / "sub" / "c.txt"
    before = edited.stat().st_mtime_ns
    # same size, new contents: rebuilt (its time moved on, as in an edit)
    edited.write_bytes(b"THIRD")
    os.utime(edited, ns=(before + 10**9, before + 10**9))
    assert (
        bytes(corpus.load_corpus(str(folder), str(tmp_path / "cache"))) == b"\0first\0second\0THIRD"
    )
    (folder / "a.txt").unlink()
    assert bytes(corpus.load_corpus(str(folder), str(tmp_path / "cache"))) == b"\0second\0THIRD"


def test_uint8_npy_data_is_read_as_bytes(tmp_path):
    data = np.frombuffer(b"\0an array of bytes, as upstream caches minipile", np.uint8)
    np.save(tmp_path / "train.npy", data)
    data = corpus.load_corpus(str(tmp_path / "train.npy"), str(tmp_path / "cache"))
    assert data.dtype == np.uint8 and bytes(data) == data.tobytes()
    assert not (tmp_path / "cache").exists()  # read in place, nothing converted


def test_stdlib_corpus_is_python_source():
    files = corpus.corpus_files(corpus.stdlib_folder(), ".py")
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
    train, valid = corpus.open_data(args.corpus, 2 * args.validation_batch_size)
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
    train2, valid2 = corpus.open_data(corpus.Flags(data=str(data), valid_data=str(other)), 2048)
    assert len(train2) == 10240 and bytes(valid2) == b"xy" * 100
