"""compare.py: the learning comparison's table against the runs' own metrics files."""

import json
import statistics
import sys

import pytest
from helpers import CACHE, ROOT

sys.path.insert(0, str(ROOT))
import compare  # noqa: E402


def test_the_table_holds_each_variants_mean_and_spread_over_seeds(tmp_path, capsys):
    corpus = tmp_path / "text_train.bin"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 400)
    (tmp_path / "text_valid.bin").write_bytes(b"a lazy dog sleeps while the quick fox jumps. " * 20)
    tiny = "--n_embd 8 --n_layer 1 --parallel_generations_per_gpu 16 --tokens_per_update 8"
    args = compare.CompareArgs(
        variants=("plain=", "momentum=--optimizer momentum --alpha 0.3"),
        data=(str(corpus),),
        seeds=(0, 1),
        num_epochs=4,
        report_at=(2, 4),
        validate_every=2,
        wall_seconds=1e6,
        flags=f"{tiny} --validation_batch_size 4 --validation_tokens 16 --dir_path {CACHE}",
        runs_dir=str(tmp_path / "runs"),
    )
    text = compare.compare(args)
    assert "--valid_data " + str(tmp_path / "text_valid.bin") in capsys.readouterr().out
    (folder,) = (tmp_path / "runs").iterdir()
    header = "variant text gen 2 text gen 4 text 1e+06 s"  # the corpus less its _train suffix
    assert text.splitlines()[0].split() == header.split()
    rows = {line.split()[0]: line for line in text.splitlines()[1:]}
    for name in ("plain", "momentum"):
        scores = {2: [], 4: []}
        for seed in (0, 1):
            lines = (folder / f"{name}-text_train-seed{seed}" / "metrics.jsonl").read_text().splitlines()
            for line in map(json.loads, lines):
                if "val/bits_per_byte" in line:
                    scores[line["generation"]].append(line["val/bits_per_byte"])
                    baselines = {k: line[f"val/{k}_bits_per_byte"] for k in ("unigram", "bigram")}
        cells = [
            f"{statistics.mean(scores[g]):.3f} +- {statistics.stdev(scores[g]):.3f}" for g in (2, 4, 4)
        ]  # the wall-time column: no run took 1e6 s, so generation 4
        assert rows[name].split()[1:] == " ".join(cells).split(), rows[name]
    assert rows["plain"] != rows["momentum"]
    for kind, value in baselines.items():
        assert rows[kind].split()[1:] == [f"{value:.3f}"] * 3


def test_a_variant_with_replicas_reports_its_best_and_its_median_replica(tmp_path):
    corpus = tmp_path / "text_train.bin"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 400)
    tiny = "--n_embd 8 --n_layer 1 --parallel_generations_per_gpu 16 --tokens_per_update 8"
    args = compare.CompareArgs(
        variants=("four=--replicas 4 --replica_alpha 0.1 0.2 0.3 0.5",),
        data=(str(corpus),),
        seeds=(0, 1),
        num_epochs=2,
        report_at=(2,),
        validate_every=2,
        flags=f"{tiny} --validation_batch_size 4 --validation_tokens 16 --dir_path {CACHE}",
        runs_dir=str(tmp_path / "runs"),
    )
    rows = compare.compare(args).splitlines()[1:3]
    (folder,) = (tmp_path / "runs").iterdir()
    best, median = [], []
    for seed in (0, 1):
        (line,) = [json.loads(x) for x in (folder / f"four-text_train-seed{seed}" / "metrics.jsonl").open()][
            1:
        ]
        replicas = [line[f"replica/{k}/val/bits_per_byte"] for k in range(4)]
        best.append(line["val/bits_per_byte"])
        median.append(statistics.median(replicas))
        assert best[-1] == min(replicas)
    assert rows[0].split() == ["four", f"{statistics.mean(best):.3f}", "+-", f"{statistics.stdev(best):.3f}"]
    assert rows[1].split() == [
        "four,",
        "median",
        f"{statistics.mean(median):.3f}",
        "+-",
        f"{statistics.stdev(median):.3f}",
    ]


def test_bad_variants_and_reporting_points_are_refused():
    with pytest.raises(SystemExit, match="NAME=FLAGS"):
        compare.parse_variants(("a=", "a=--alpha 2"))
    with pytest.raises(SystemExit, match="multiple of --validate_every"):
        compare.compare(compare.CompareArgs(report_at=(150,), validate_every=100))
