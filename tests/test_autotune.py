"""--kernels auto: the fastest of run.PRODUCT_CANDIDATES at a run's shapes, timed under a stand-in
for the device (a candidate's probe a function whose every call moves a clock by a cost the test
gives it), kept by device kind, JAX version and shapes, said in one line. That every candidate
computes the same integers: tests/test_kernels.py."""

import json

import jax
import pytest

import run
from egg import autotune

# 32D-1L, population 32 (16 distinct pairs: the kernel's least tile), 6 bytes in 3 segments of 2
FLAGS = "--n_embd 32 --n_layer 1 --parallel_generations_per_gpu 32 --tokens_per_update 6 "
FLAGS += "--segments 3"


class StandIn:
    """The device and its clock: a candidate's probe (run.make_probe's) stands in for its program,
    each call moving the clock by that candidate's cost (its real integers: the test after)."""

    def __init__(self, costs: dict):
        self.now, self.costs, self.calls = 0.0, costs, []

    def __call__(self) -> float:
        return self.now

    def make_probe(self, cfg):
        def of(c):
            return c.kernels, c.kernel_options

        (name,) = [
            n for n in run.PRODUCT_CANDIDATES if of(run.as_candidate(cfg, n, "cpu")) == of(cfg)
        ]

        def probe(*inputs):
            self.calls.append(name)
            self.now += self.costs[name]

        return probe


def choose(monkeypatch, capsys, costs: dict, kept):
    """(the candidate chosen, the stand-in clock, the line said)."""
    cfg = run.make_config(run.parse_args(FLAGS.split()))
    clock = StandIn(costs)
    monkeypatch.setattr(run, "make_probe", clock.make_probe)
    replicas = run.replicas_of(run.parse_args(FLAGS.split()))
    capsys.readouterr()
    name = run.fastest_products(cfg, jax.devices()[0], replicas, kept, clock)
    monkeypatch.undo()
    return name, clock, capsys.readouterr().out.strip()


def test_auto_takes_the_fastest_by_the_clock_keeps_it_and_says_so(monkeypatch, capsys, tmp_path):
    kept = tmp_path / "product_choices.json"
    names = list(run.PRODUCT_CANDIDATES)
    for fastest in (names[1], names[2]):
        kept.unlink(missing_ok=True)
        costs = {n: 0.01 if n == fastest else 0.03 for n in names}
        name, clock, line = choose(monkeypatch, capsys, costs, kept)
        assert name == fastest
        # every candidate timed: one untimed call, then autotune.CALLS at least
        assert sorted(set(clock.calls)) == sorted(names)
        assert all(clock.calls.count(n) >= 1 + autotune.CALLS for n in names)
        assert line.startswith(f"products: {fastest}, the fastest at this run's shapes (ms: ")
        assert f"; {fastest} 10; " in line
    # kept under the device kind, JAX version and shapes: the next run of them times nothing
    (key,) = json.loads(kept.read_text())
    assert key.startswith(f"{jax.devices()[0].device_kind} | JAX {jax.__version__} | Config(")
    assert json.loads(kept.read_text())[key]["choice"] == names[2]
    name, clock, line = choose(monkeypatch, capsys, dict.fromkeys(names, 0.0), kept)
    assert name == names[2] and clock.calls == []
    assert line == f"products: {names[2]} (the fastest when timed before: {kept})"


def test_a_candidate_that_cannot_run_is_left_out_and_an_unreadable_file_is_timed_anew(tmp_path):
    kept = tmp_path / "choices.json"
    kept.write_text("not json")
    now = [0.0]

    def call(cost):
        def run_once():
            now[0] += cost

        return run_once

    def broken():
        raise RuntimeError("no such kernel here\nmore")

    candidates = {"slow": lambda: call(2.0), "broken": broken, "fast": lambda: call(1.0)}
    lines = []
    name = autotune.choose("key", candidates, kept, lambda: now[0], 0.0, lines.append)
    assert name == "fast" and json.loads(kept.read_text())["key"]["choice"] == "fast"
    assert lines[-1] == "products: broken cannot run here (RuntimeError: no such kernel here)"
    with pytest.raises(RuntimeError, match="no product candidate runs here"):
        autotune.choose("other", {"broken": broken}, None, lambda: 0.0, 0.0, lines.append)


def test_auto_on_a_cpu_chooses_nothing():
    args = run.parse_args(FLAGS.split())
    _, mesh, cfg = run.start_devices(args)
    assert cfg.kernels == "xla" and cfg.kernel_options == run.kernel.DEFAULT
