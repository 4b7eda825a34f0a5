"""A run's record (egg/record.py): metrics.jsonl and config.json always, Weights & Biases with
--track (offline here), and a record cut short by a kill."""

import json
import os

from helpers import TINY, cli

from egg import record


def test_offline_wandb_run_and_local_record(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    flags = [
        *TINY,
        "--num_epochs",
        "3",
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
    ]
    result = cli(*flags, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "baselines on the validation bytes" in result.stdout
    assert "(unigram" in result.stdout
    folder = next((tmp_path / "runs").iterdir())
    assert folder.name.endswith("-smoke") and "8D2L" in folder.name
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
    (table,) = (tmp_path / "wandb").glob(
        "offline-run-*/files/media/table/samples/text_*.table.json"
    )
    samples = json.loads(table.read_text())
    assert samples == {"columns": ["generation", "text"], "data": [[2, lines[1]["samples/text"]]]}


def test_a_record_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(
        '{"generation": 1}\n{"generation": 2}\n{"generation": 3}\n{"gener'
    )
    record.RunRecord(folder, {}, {}, 2).close()
    assert (folder / "metrics.jsonl").read_text() == '{"generation": 1}\n{"generation": 2}\n'
