"""Training bytes. A corpus is a read-only memory-mapped uint8 array (never loaded whole); documents
are separated by byte 0. minipile, Python's standard library and folders are converted once into a
cache folder; a file (raw bytes, or a 1-D uint8 .npy array) is read as it is. Beside them, what
classical models reach on the very bytes the model is validated on (the baselines).

Every cache carries a check written when it was built (its length and fingerprint), and is read
back only if it still matches: one cut short or changed since is built again (or refused, naming
the cache, where its source cannot be had). A cache the disk has no room for is a warning: the
bytes are held in memory for the run instead."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import tyro

from egg import UserError
from egg.files import atomic_file, out_of_room, size_text, write_atomic
from egg.flags import flag

MINIPILE = "JeanKaddour/minipile"
MINIPILE_SPLITS = ("train", "validation", "test")
BESIDE_RUN = Path(__file__).resolve().parent.parent / "cached_files"  # the default cache
VALID_HINT = "(default: minipile's validation split, else the last --valid_fraction of --data)"


@dataclass(frozen=True)
class Flags:
    data: str = "minipile"
    """training bytes: 'minipile', 'stdlib' (Python's own sources, offline), a file or a folder"""
    valid_data: Annotated[
        str | None, tyro.conf.arg(metavar="PATH", help_behavior_hint=VALID_HINT)
    ] = None
    """a separate validation file or folder"""
    valid_fraction: Annotated[float, *flag("(0, 0.5)")] = 0.01
    """share of --data held out for validation when --valid_data is not given"""
    dir_path: Annotated[
        str, tyro.conf.arg(help_behavior_hint="(default: cached_files/ beside run.py)")
    ] = str(BESIDE_RUN)
    """folder for cached corpora and baselines (minipile and folders are converted here once)"""


def stdlib_folder() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(folder: Path, suffix: str = "") -> list[Path]:
    """Every regular file under `folder`, hidden ones and installed packages skipped (sorted, so the
    corpus is the same on every run)."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("."))
        files += [
            Path(root) / f for f in sorted(names) if f.endswith(suffix) and not f.startswith(".")
        ]
    return [f for f in files if f.is_file()]


def fingerprint(data: np.ndarray, samples: int = 64, size: int = 4096) -> str:
    """Identity of a run of bytes, cheap on any size: their length and the SHA-256 of `samples`
    pieces of `size` bytes at evenly spaced places (the whole of a small corpus)."""
    starts = np.linspace(0, max(len(data) - size, 0), samples).astype(np.int64)
    digest = hashlib.sha256(np.int64(len(data)).tobytes())
    for start in starts:
        digest.update(np.asarray(data[start : start + size]).tobytes())
    return f"{len(data):,} bytes #{digest.hexdigest()[:12]}"


def check_file(cache: Path) -> Path:
    """Where a cache's check lies: beside it, NAME.check.json."""
    return cache.with_name(cache.name + ".check.json")


def mapped(path: Path) -> np.ndarray:
    """A file's bytes as a read-only memory map (an empty file: an empty array)."""
    if path.stat().st_size == 0:
        return np.zeros(0, np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


def checked_cache(path: Path) -> np.ndarray | None:
    """A cache's bytes if it is whole: as long as, and of the fingerprint, its check says it was
    built with; else None (it is missing, has no check, or changed since)."""
    try:
        check = json.loads(check_file(path).read_text())
        data = mapped(path)
    except (OSError, ValueError):
        return None
    return data if check == {"fingerprint": fingerprint(data)} else None


def build_cache(path: Path, write, what: str) -> np.ndarray:
    """A cache built by write(sink), atomically, then its check; read back as a memory map. Where
    the disk has no room for it (or fails), a warning, and the bytes held in memory instead."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as sink:
            write(sink)
        write_atomic(
            check_file(path), json.dumps({"fingerprint": fingerprint(mapped(path))}).encode()
        )
        return mapped(path)
    except OSError as error:
        if not out_of_room(error):
            raise
        path.unlink(missing_ok=True)
        check_file(path).unlink(missing_ok=True)
        sink = io.BytesIO()
        write(sink)
        data = np.frombuffer(sink.getvalue(), np.uint8)
        room = f"{error.strerror}; it needs {size_text(len(data))}"
        print(
            f"warning: cannot write {what} {path} ({room}): the bytes are held in memory this run"
        )
        return data


def concatenate_files(files: list[Path], cache_dir: Path, name: str) -> np.ndarray:
    """Files, each prefixed by byte 0, concatenated once into a cache file (streamed, never whole in
    memory; written atomically, so a kill never leaves a broken cache), named by the files' paths,
    sizes and times; a cache that fails its check is built again."""
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    digest = hashlib.sha256(repr(stats).encode()).hexdigest()[:16]
    out = cache_dir / f"{name}-{digest}.bin"
    if (data := checked_cache(out)) is not None:
        return data
    if out.exists():
        print(f"warning: the corpus cache {out} is not as it was built (cut short?): built again")

    def write(sink):
        for f in files:
            sink.write(b"\0")
            with open(f, "rb") as source:
                shutil.copyfileobj(source, sink, 1 << 20)

    return build_cache(out, write, "the corpus cache")


def convert_splits(splits, cache_dir: Path, name: str) -> dict[str, np.ndarray]:
    """Convert a datasets.DatasetDict (or any {split: Dataset}) with a 'text' column to one uint8
    cache file per split, NAME_SPLIT.bin, batch by batch (the corpus is never held as a Python
    list), each document prefixed by byte 0; {split: its bytes}."""
    converted = {}
    for split, dataset in splits.items():

        def write(sink, dataset=dataset):
            for batch in dataset.iter(batch_size=1024):
                for text in batch["text"]:
                    sink.write(b"\0" + text.encode("utf-8"))

        path = cache_dir / f"{name}_{split}.bin"
        converted[split] = build_cache(path, write, f"{name}'s {split} split to")
    return converted


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hugging Face hub answers (checked first, so an offline machine fails in
    seconds instead of retrying for minutes)."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_minipile(cache_dir: str) -> dict[str, np.ndarray]:
    """minipile's splits as memory maps, downloaded and converted on the first use only, and again
    where a split's cache fails its check (refused in one line, naming it, where the hub cannot be
    reached). A split cached before caches carried checks is taken as it is, and given one."""
    folder = Path(cache_dir)
    paths = {split: folder / f"minipile_{split}.bin" for split in MINIPILE_SPLITS}
    found = {split: checked_cache(path) for split, path in paths.items()}
    for split, path in paths.items():
        if found[split] is None and path.exists() and not check_file(path).exists():
            data = mapped(path)  # converted before caches carried checks
            write_atomic(check_file(path), json.dumps({"fingerprint": fingerprint(data)}).encode())
            found[split] = data
    if all(data is not None for data in found.values()):
        return found
    damaged = [str(path) for split, path in paths.items() if path.exists() and found[split] is None]
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "")
    if not offline and not hub_reachable():
        if damaged:
            raise UserError(
                f"the minipile cache {damaged[0]} is not as it was built (cut short or changed), "
                "and the Hugging Face hub cannot be reached to build it again; train offline with "
                "--data stdlib or --data PATH meanwhile"
            )
        raise UserError(
            "cannot reach the Hugging Face hub to download minipile; train offline on Python's "
            "own sources with --data stdlib, or on your own text with --data PATH"
        )
    import datasets

    again = f" again ({', '.join(damaged)} not as built)" if damaged else " (once)"
    print(f"downloading {MINIPILE} and converting it to bytes in {folder}{again}")
    return convert_splits(datasets.load_dataset(MINIPILE), folder, "minipile")


def load_npy(path: Path, spec: str, flag: str) -> np.ndarray:
    """A 1-D uint8 .npy array (e.g. upstream nano-egg's cached_files/minipile_train.npy), mapped."""
    try:
        array = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as error:
        raise UserError(f"{flag} {spec}: not a readable .npy array ({error})") from None
    if array.dtype != np.uint8 or array.ndim != 1:
        raise UserError(
            f"{flag} {spec}: holds a {array.dtype} array of shape {array.shape}, "
            "not 1-D uint8 bytes"
        )
    return array


def load_corpus(spec: str, cache_dir: str, flag: str = "--data") -> np.ndarray:
    """Bytes of a corpus: 'stdlib', a file (raw bytes, or a uint8 .npy array) or a folder, as a
    read-only memory map. `flag` names the flag it came from in errors."""
    if spec == "stdlib":
        files = corpus_files(stdlib_folder(), ".py")
        version = f"py{sys.version_info[0]}{sys.version_info[1]}"
        return concatenate_files(files, Path(cache_dir), f"stdlib-{version}")
    source = Path(spec).expanduser()
    if not source.exists():
        raise UserError(
            f"{flag} {spec}: no such path; give a file, a folder, 'stdlib' or 'minipile'"
        )
    if source.is_dir():
        files = [f for f in corpus_files(source) if f.stat().st_size]
        if not files:
            raise UserError(
                f"{flag} {spec}: the folder holds no file with bytes in it (hidden ones skipped)"
            )
        return concatenate_files(files, Path(cache_dir), source.resolve().name or "root")
    if source.stat().st_size == 0:
        raise UserError(f"{flag} {spec}: the file is empty; give a file with some text")
    if source.suffix == ".npy":
        return load_npy(source, spec, flag)
    return mapped(source)


def open_data(flags: Flags, least_held_out: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) bytes of --data: validation is --valid_data if given, else minipile's
    validation split, else the last --valid_fraction of the data (at least least_held_out bytes)."""
    data, valid_data, cache_dir, valid = flags.data, flags.valid_data, flags.dir_path, None
    if data == "minipile":
        splits = load_minipile(cache_dir)
        train, valid = splits["train"], splits["validation"]
    else:
        train = load_corpus(data, cache_dir)
    if valid_data is not None:
        return train, load_corpus(valid_data, cache_dir, "--valid_data")
    if valid is not None:
        return train, valid
    held_out = max(least_held_out, int(len(train) * flags.valid_fraction))
    if held_out >= len(train) // 2:
        raise UserError(
            f"--data has {len(train)} bytes: too few to hold out {held_out} for validation; "
            "give more data, a smaller --validation_batch_size, or --valid_data"
        )
    return train[:-held_out], train[-held_out:]


# ------------------------------------------------------------------------------------------------
# Baselines: what a unigram and a bigram model of the training bytes and gzip -9 reach, in
# bits/byte, on the validation rows.


def unigram_bigram_counts(train: np.ndarray, chunk: int = 1 << 22) -> tuple[np.ndarray, np.ndarray]:
    """Byte and byte-pair counts of the training data, read through the memory map in chunks."""
    unigram = np.zeros(256, np.int64)
    bigram = np.zeros(256 * 256, np.int64)
    for start in range(0, len(train), chunk):
        piece = np.asarray(train[start : start + chunk + 1])
        unigram += np.bincount(piece[:chunk], minlength=256)
        bigram += np.bincount(piece[:-1].astype(np.int64) * 256 + piece[1:], minlength=256 * 256)
    return unigram, bigram.reshape(256, 256)


def measure_baselines(train: np.ndarray, rows: np.ndarray) -> dict[str, float]:
    """Bits/byte on the validation rows' targets (rows[:, 1:]) of: a unigram and a bigram model
    estimated on train (add-one smoothing), and gzip -9 of the rows' bytes."""
    unigram, bigram = unigram_bigram_counts(train)
    targets, contexts = rows[:, 1:].ravel(), rows[:, :-1].ravel()
    log_unigram = np.log2(unigram + 1) - np.log2(unigram.sum() + 256)
    log_bigram = np.log2(bigram + 1) - np.log2(bigram.sum(1, keepdims=True) + 256)
    text = rows.tobytes()
    return {
        "unigram": float(-log_unigram[targets].mean()),
        "bigram": float(-log_bigram[contexts, targets].mean()),
        "gzip": 8 * len(gzip.compress(text, compresslevel=9)) / len(text),
    }


def cached_baselines(train: np.ndarray, rows: np.ndarray, cache_dir: str) -> dict[str, float]:
    """measure_baselines, computed once per (training bytes, validation rows) and kept as JSON with
    its check; computed again where the file fails it, and not kept where the disk has no room."""
    digest = hashlib.sha256(fingerprint(train).encode() + rows.tobytes()).hexdigest()[:16]
    path = Path(cache_dir) / f"baselines-{digest}.json"
    try:
        kept = json.loads(path.read_text())
        if kept["check"] == hashlib.sha256(json.dumps(kept["values"]).encode()).hexdigest():
            return kept["values"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    values = measure_baselines(train, rows)
    check = hashlib.sha256(json.dumps(values).encode()).hexdigest()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"values": values, "check": check}).encode())
    except OSError as error:
        if not out_of_room(error):
            raise
        print(f"warning: cannot keep the baselines in {path} ({error.strerror}): computed each run")
    return values


def describe_baselines(values: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.3f}" for name, value in values.items())
