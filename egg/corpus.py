"""Training bytes. A corpus is a read-only memory-mapped uint8 array (never loaded whole); documents
are separated by byte 0. minipile, Python's standard library and folders are converted once into a
cache folder; a file (raw bytes, or a 1-D uint8 .npy array) is read as it is. Beside them, what
classical models reach on the very bytes the model is validated on (the baselines)."""

from __future__ import annotations

import gzip
import hashlib
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
from egg.files import atomic_file, write_atomic
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


def concatenate_files(files: list[Path], cache_dir: Path, name: str) -> Path:
    """Concatenate files, each prefixed by byte 0, into one cached file (streamed, never whole in
    memory; written atomically, so a kill never leaves a broken cache)."""
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    digest = hashlib.sha256(repr(stats).encode()).hexdigest()[:16]
    out = cache_dir / f"{name}-{digest}.bin"
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as sink:
        for f in files:
            sink.write(b"\0")
            with open(f, "rb") as source:
                shutil.copyfileobj(source, sink, 1 << 20)
    return out


def write_documents(texts, path: Path) -> None:
    """Stream texts to `path` as UTF-8 bytes, each document prefixed by byte 0 (atomically)."""
    with atomic_file(path) as sink:
        for text in texts:
            sink.write(b"\0" + text.encode("utf-8"))


def convert_splits(splits, cache_dir: Path, name: str) -> None:
    """Convert a datasets.DatasetDict (or any {split: Dataset}) with a 'text' column to one uint8
    file per split, batch by batch: the corpus is never held as a Python list."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    for split, dataset in splits.items():
        batches = dataset.iter(batch_size=1024)
        write_documents(
            (text for batch in batches for text in batch["text"]), cache_dir / f"{name}_{split}.bin"
        )


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
    """minipile's splits as memory maps, downloaded and converted on the first use only."""
    folder = Path(cache_dir)
    paths = {split: folder / f"minipile_{split}.bin" for split in MINIPILE_SPLITS}
    if not all(p.exists() for p in paths.values()):
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "")
        if not offline and not hub_reachable():
            raise UserError(
                "cannot reach the Hugging Face hub to download minipile; train offline on Python's "
                "own sources with --data stdlib, or on your own text with --data PATH"
            )
        import datasets

        print(f"downloading {MINIPILE} and converting it to bytes in {folder} (once)")
        convert_splits(datasets.load_dataset(MINIPILE), folder, "minipile")
    return {split: np.memmap(path, dtype=np.uint8, mode="r") for split, path in paths.items()}


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
        path = concatenate_files(files, Path(cache_dir), f"stdlib-{version}")
    else:
        source = Path(spec).expanduser()
        if not source.exists():
            raise UserError(
                f"{flag} {spec}: no such path; give a file, a folder, 'stdlib' or 'minipile'"
            )
        if source.is_dir():
            files = [f for f in corpus_files(source) if f.stat().st_size]
            if not files:
                raise UserError(
                    f"{flag} {spec}: the folder holds no file with bytes in it "
                    "(hidden ones skipped)"
                )
            path = concatenate_files(files, Path(cache_dir), source.resolve().name or "root")
        else:
            path = source
    if path.stat().st_size == 0:
        raise UserError(f"{flag} {spec}: the file is empty; give a file with some text")
    if path.suffix == ".npy":
        return load_npy(path, spec, flag)
    return np.memmap(path, dtype=np.uint8, mode="r")


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
    """measure_baselines, computed once per (training file, validation rows) and kept as JSON."""
    source = Path(getattr(train, "filename", "") or "")
    stamp = (str(source), source.stat().st_mtime_ns if source.exists() else 0, len(train))
    digest = hashlib.sha256(repr(stamp).encode() + rows.tobytes()).hexdigest()[:16]
    path = Path(cache_dir) / f"baselines-{digest}.json"
    if path.exists():
        return json.loads(path.read_text())
    values = measure_baselines(train, rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(values).encode())
    return values


def describe_baselines(values: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.2f}" for name, value in values.items())
