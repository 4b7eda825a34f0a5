"""The machine's own faults: every write a run makes meets a real file system that fills (a small
tmpfs, mounted in a mount namespace of the run's own: as root, or in a user namespace, which the
kernel offers unprivileged processes), and a cache cut short outside the program. A write the run
needs (a checkpoint, the best checkpoint, a line of metrics.jsonl, the run's record) stops it in one
line saying what and how much room, with the last whole checkpoint and the command that goes on,
exit 74, its partial files removed; a cache (corpus, baselines, compilation) or W&B's folder is a
warning and the run goes on."""

import json
import os
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from helpers import CACHE, ROOT, TINY, in_process

from egg import checkpoints, corpus

NAMESPACES = (["unshare", "--user", "--map-root-user", "--mount"], ["unshare", "--mount"])


@cache
def namespace() -> list[str] | None:
    """A command prefix that runs its command with a mount namespace of its own, or None."""
    for prefix in NAMESPACES:
        probe = [*prefix, "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt && echo ok"]
        if shutil.which("unshare") and subprocess.run(probe, capture_output=True, text=True).stdout:
            return prefix
    return None


def on_small_disk(tmp_path: Path, size: str, *flags, env=None):
    """python run.py TINY FLAGS, with a tmpfs of `size` mounted at tmp_path/disk for it alone; the
    disk's files copied to tmp_path/after once it ends. (exit code, stdout, stderr)."""
    prefix = namespace()
    if prefix is None:
        pytest.skip("no tmpfs can be mounted here (neither as root nor in a user namespace)")
    disk, after = tmp_path / "disk", tmp_path / "after"
    disk.mkdir()
    after.mkdir()
    command = shlex.join([sys.executable, str(ROOT / "run.py"), *TINY, *flags])
    script = (
        f"mount -t tmpfs -o size={size} tmpfs {disk} && cd {tmp_path} && {command}; "
        f"code=$?; cp -a {disk}/. {after}/; exit $code"
    )
    done = subprocess.run(
        [*prefix, "sh", "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    return done.returncode, done.stdout, done.stderr


def files(folder: Path) -> list[str]:
    """Every file under a folder, hidden ones too, relative to it."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def one_line_74(err: str, *said: str) -> str:
    lines = err.strip().splitlines()
    assert lines and "Traceback" not in err, err[-2000:]
    assert all(text in lines[-1] for text in said), lines[-1]
    return lines[-1]


def test_a_checkpoint_the_disk_cannot_hold_stops_the_run_in_one_line(tmp_path):
    """The disk holds gen-2 but not gen-4: exit 74, one line naming gen-4, the room it needs, gen-2
    as the last whole checkpoint and the command that continues; nothing of gen-4 left."""
    flags = ["--num_epochs", "6", "--save_every", "2", "--save_dir", str(tmp_path / "disk")]
    code, _, err = on_small_disk(tmp_path, "60k", *flags, "--runs_dir", str(tmp_path / "runs"))
    assert code == 74, err[-2000:]
    saved = tmp_path / "disk" / "gen-00000002"
    line = one_line_74(
        err,
        f"error: cannot write checkpoint {tmp_path / 'disk' / 'gen-00000004'} (No space left on",
        "; it needs 19.",  # KiB: the arrays and meta.json
        f"the last whole checkpoint is {saved}: make room, then continue with: python run.py "
        f"--resume {tmp_path / 'disk'}",
    )
    print(line)
    after = tmp_path / "after"
    assert files(after) == [
        ".owner",
        "LATEST",
        *(f"gen-00000002/{name}" for name in ("meta.json", "optimizer.npz", "params.npz")),
        "gen-00000002/states.npz",
    ]
    assert (after / "LATEST").read_text() == "gen-00000002"
    checkpoints.read_arrays(after / "gen-00000002")  # whole
    lines = (tmp_path / "runs").glob("*/metrics.jsonl").__next__().read_text().splitlines()
    assert [json.loads(x)["generation"] for x in lines] == [1, 2, 3, 4]  # recorded to the stop


def test_a_best_checkpoint_the_disk_cannot_hold_stops_the_run(tmp_path):
    flags = ["--num_epochs", "4", "--save_every", "0", "--validate_every", "2"]
    disk = ["--save_dir", str(tmp_path / "disk"), "--runs_dir", str(tmp_path / "runs")]
    code, _, err = on_small_disk(tmp_path, "8k", *flags, *disk)
    assert code == 74, err[-2000:]
    one_line_74(err, "error: cannot write checkpoint", "best-", "nothing was saved: make room")
    assert files(tmp_path / "after") == [".owner"]


@pytest.mark.parametrize(
    "size, what", [("4k", "the run's record in"), ("8k", "generation 1's line")]
)
def test_a_record_the_disk_cannot_hold_stops_the_run(tmp_path, size, what):
    """--runs_dir on a disk that holds its lock file (4k), and config.json (8k), but no more."""
    flags = ["--num_epochs", "4", "--runs_dir", str(tmp_path / "disk"), "--run_name", "r"]
    code, _, err = on_small_disk(tmp_path, size, *flags, "--save_dir", str(tmp_path / "saved"))
    assert code == 74, err[-2000:]
    one_line_74(err, f"error: cannot write {what}", "No space left on device; it needs")
    record = tmp_path / "after" / "r" / "metrics.jsonl"
    assert not record.exists() or record.read_text() == ""  # no line cut short
    assert not [name for name in files(tmp_path / "after") if ".tmp" in name]


def test_caches_the_disk_cannot_hold_are_warnings_and_the_run_goes_on(tmp_path):
    """--dir_path (the corpus and baselines caches) and the compilation cache on a disk of 64k:
    the corpus is held in memory, the compilation cache left alone after its first failed entry,
    each said once; the run trains as it would have, and no partial cache is left."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "disk" / "jax"))
    cached = ["--dir_path", str(tmp_path / "disk"), "--runs_dir", str(tmp_path / "runs")]
    code, out, err = on_small_disk(tmp_path, "64k", *cached, "--num_epochs", "2", env=env)
    assert code == 0 and "Traceback" not in err, err[-2000:]
    said = out + err
    assert said.count("warning: cannot write the corpus cache") == 1
    assert "(No space left on device; it needs 30." in said and "held in memory this run" in said
    assert said.count("warning: cannot write the compilation cache in") == 1
    assert "validation bits/byte" in out
    left = files(tmp_path / "after")
    assert not [name for name in left if name.endswith(".bin") or ".tmp" in name], left
    for name in left:  # every compilation cache entry left is whole: JAX can read it
        assert (tmp_path / "after" / name).stat().st_size > 0, name


def test_a_wandb_folder_the_disk_cannot_hold_is_a_warning(tmp_path):
    env = dict(
        os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "disk"), WANDB_SILENT="true"
    )
    flags = ["--num_epochs", "2", "--track", "--runs_dir", str(tmp_path / "runs")]
    # room for W&B's start (the run's config among it), not for its whole record: with less, its
    # own log fails (a traceback of W&B's logging, not ours)
    code, out, err = on_small_disk(tmp_path, "32k", *flags, env=env)
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert "warning: Weights & Biases may not have kept its record of this run in" in out + err
    assert "the run's record is" in out + err


def cut_short(path: Path, keep: int) -> None:
    data = path.read_bytes()[:keep]
    path.write_bytes(data)


def test_a_corpus_cache_cut_short_outside_the_program_is_built_again(tmp_path, capsys):
    """A cache's check (its length and fingerprint when built) catches a copy cut short: --data
    stdlib over its cache cut to 1000 bytes builds it again, saying so naming the cache (not the
    user's --data), and trains on the whole standard library."""
    (source,) = Path(CACHE).glob("stdlib-*.bin") or [None]
    if source is None:  # not built yet by this worker's tests
        corpus.load_corpus("stdlib", CACHE)
        (source,) = Path(CACHE).glob("stdlib-*.bin")
    mine = tmp_path / "cache"
    mine.mkdir()
    for path in (source, corpus.check_file(source)):
        shutil.copy(path, mine / path.name)
    cut_short(mine / source.name, 1000)
    flags = [*TINY, "--dir_path", str(mine), "--runs_dir", str(tmp_path), "--num_epochs", "1"]
    result = in_process(capsys, *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    said = result.stdout + result.stderr
    assert f"warning: the corpus cache {mine / source.name} is not as it was built" in said
    assert "--data has" not in said and "31,211,744 training bytes" in said
    assert (mine / source.name).stat().st_size == source.stat().st_size


def test_a_minipile_cache_cut_short_is_refused_naming_it_where_the_hub_is_out_of_reach(
    tmp_path, monkeypatch
):
    for split in corpus.MINIPILE_SPLITS:
        path = tmp_path / f"minipile_{split}.bin"
        corpus.build_cache(path, lambda sink: sink.write(b"\0a document" * 100), "a split to")
    assert corpus.load_minipile(str(tmp_path))["train"].size == 1100
    cut_short(tmp_path / "minipile_validation.bin", 10)
    monkeypatch.setattr(corpus, "hub_reachable", lambda: False)
    with pytest.raises(
        corpus.UserError, match="the minipile cache .*minipile_validation.bin is not"
    ):
        corpus.load_minipile(str(tmp_path))


def test_a_baselines_cache_that_fails_its_check_is_computed_again(tmp_path):
    train = np.frombuffer(b"\0some training bytes, not many" * 50, np.uint8)
    rows = np.frombuffer(b"\0rows of validation bytes", np.uint8)[None].repeat(2, 0)
    values = corpus.cached_baselines(train, rows, str(tmp_path))
    (path,) = tmp_path.glob("baselines-*.json")
    path.write_text(path.read_text()[:20])  # cut short
    assert corpus.cached_baselines(train, rows, str(tmp_path)) == values
    assert json.loads(path.read_text())["values"] == values
