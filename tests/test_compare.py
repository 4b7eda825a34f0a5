"""compare.py: the learning comparison's table against the runs' own metrics files."""

import dataclasses
import json
import statistics
import sys

import pytest
from helpers import CACHE, ROOT, run_here

sys.path.insert(0, str(ROOT))
import compare  # noqa: E402


@pytest.fixture
def runs_in_this_process():
    """compare.train running run.py's commands in this process, their lines kept in the log as
    compare.train keeps them: without a new interpreter's start-up and the tracing this one has
    done. The backprop baselines still go through compare.train, in processes of their own.
    Patched by hand, not by monkeypatch, which would have run.py's programs traced afresh
    (conftest.py): nothing they trace changes."""
    train = compare.train

    def train_here(command, log):
        if not command[1].endswith("run.py"):
            return train(command, log)
        done = run_here(*command[2:])
        log.write_text(done.stdout)
        assert done.returncode == 0, done.stderr[-2000:]

    compare.train = train_here
    yield
    compare.train = train


def test_the_table_holds_each_variants_mean_and_spread_over_seeds(
    tmp_path, capsys, runs_in_this_process
):
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
            lines = (
                (folder / f"{name}-text_train-seed{seed}" / "metrics.jsonl")
                .read_text()
                .splitlines()
            )
            for line in map(json.loads, lines):
                if "val/bits_per_byte" in line:
                    scores[line["generation"]].append(line["val/bits_per_byte"])
                    baselines = {k: line[f"val/{k}_bits_per_byte"] for k in ("unigram", "bigram")}
        # the wall-time column: no run took 1e6 s, so generation 4
        cells = [
            f"{statistics.mean(scores[g]):.3f} +- {statistics.stdev(scores[g]):.3f}"
            for g in (2, 4, 4)
        ]
        assert rows[name].split()[1:] == " ".join(cells).split(), rows[name]
    assert rows["plain"] != rows["momentum"]
    for kind, value in baselines.items():
        assert rows[kind].split()[1:] == [f"{value:.3f}"] * 3
    # --reuse: the same comparison read back from those runs' folders, nothing trained again
    again = dataclasses.replace(
        args, reuse=(str(tmp_path / "nowhere"), str(folder)), runs_dir=str(tmp_path / "new")
    )
    assert compare.compare(again) == text and not (tmp_path / "new").exists()
    assert (folder / "table.txt").read_text() == text + "\n"  # kept in the comparison's folder
    # runs trained with other flags are never joined into one table
    other = dataclasses.replace(again, flags=f"{args.flags} --sigma_shift 2")
    said = r"trained with other flags \(its own: none; this comparison's: --sigma_shift 2\)$"
    with pytest.raises(SystemExit, match=said):
        compare.compare(other)


def test_a_variant_with_replicas_reports_its_best_and_its_median_replica(
    tmp_path, runs_in_this_process
):
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
        (line,) = [
            json.loads(x) for x in (folder / f"four-text_train-seed{seed}" / "metrics.jsonl").open()
        ][1:]
        replicas = [line[f"replica/{k}/val/bits_per_byte"] for k in range(4)]
        best.append(line["val/bits_per_byte"])
        median.append(statistics.median(replicas))
        assert best[-1] == min(replicas)
    assert rows[0].split() == [
        "four",
        f"{statistics.mean(best):.3f}",
        "+-",
        f"{statistics.stdev(best):.3f}",
    ]
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


def test_backprop_baselines_join_the_table_and_the_plot_holds_a_line_per_variant(
    tmp_path, runs_in_this_process
):
    """A run.py variant and the two backprop baselines (baselines/backprop.py) on one corpus: each
    parses into the table, the training-bytes column reads each run's own bytes, and the plot
    (written, then read back) has one curve per variant in each of its three panels, besides the
    unigram and bigram lines. A variant's own flags win over the common ones (tf's --num_epochs)."""
    import matplotlib.image

    corpus = tmp_path / "text_train.bin"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 400)
    tiny = "--n_embd 8 --n_layer 1 --parallel_generations_per_gpu 16 --tokens_per_update 8"
    args = compare.CompareArgs(
        variants=(
            "es=",
            "gru=@backprop --network mingru --batch_size 4 --window 16",
            # its own length
            "tf=@backprop --network transformer --batch_size 4 --window 16 --num_epochs 6",
        ),
        data=(str(corpus),),
        seeds=(0, 1),
        num_epochs=4,
        report_at=(4,),
        validate_every=2,
        train_bytes=200,
        flags=f"{tiny} --validation_batch_size 4 --validation_tokens 16 --dir_path {CACHE}",
        runs_dir=str(tmp_path / "runs"),
        plot=str(tmp_path / "curves.png"),
    )
    text = compare.compare(args)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[1:]}
    (folder,) = (tmp_path / "runs").iterdir()
    for name in ("gru", "tf"):  # 4 x 16 bytes a step: after 3 steps (192 bytes), within 200
        values = []
        for seed in (0, 1):
            lines = [
                json.loads(x)
                for x in (folder / f"{name}-text_train-seed{seed}" / "metrics.jsonl")
                .read_text()
                .splitlines()
            ]
            assert [x["generation"] for x in lines] == list(range(1, 7 if name == "tf" else 5))
            # generation 2: the last validation within 200 bytes
            values.append(lines[1]["val/bits_per_byte"])
        assert (
            rows[name][-3:]
            == f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}".split()
        )
    # population 16 x 8 bytes = 128 a generation: no validation within 200
    assert rows["es"][-1] == "-"
    image = matplotlib.image.imread(tmp_path / "curves.png")
    assert image.shape[0] > 200 and image.shape[1] > 600 and image.std() > 0  # drawn, not blank


def test_the_plot_draws_each_variants_mean_band_and_the_baselines():
    run_ = {
        "validation": {2: 5.0, 4: 4.0},
        "elapsed": {2: 1.0, 4: 2.0},
        "tokens": {2: 10.0, 4: 20.0},
    }
    other = {
        "validation": {2: 6.0, 4: 5.0},
        "elapsed": {2: 1.5, 4: 3.0},
        "tokens": {2: 10.0, 4: 20.0},
    }
    baselines = {"unigram": 7.0, "bigram": 6.5}
    results = {
        "corpus": {
            "a": [{**run_, "baselines": baselines}, {**other, "baselines": baselines}],
            "b": [{**run_, "baselines": baselines}],
        }
    }
    args = compare.CompareArgs(variants=("a=", "b="), data=("corpus",), seeds=(0, 1))
    figure = compare.plot(args, results)
    for ax in figure.axes:
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels == ["a", "b", "unigram", "bigram"]
    generations = figure.axes[0].get_lines()[0]
    assert list(generations.get_xdata()) == [2, 4] and list(generations.get_ydata()) == [5.5, 4.5]
    seconds = figure.axes[1].get_lines()[0]
    assert list(seconds.get_xdata()) == [1.25, 2.5]
