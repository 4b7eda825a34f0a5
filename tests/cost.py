"""Where the suite's time goes (pytest --cost FOLDER, conftest.py): for each test, the CPU seconds
of its own process and of the processes it started and waited for (getrusage: RUSAGE_SELF and
RUSAGE_CHILDREN), and the seconds JAX spent in its process tracing, lowering and compiling
(jax.monitoring's events; a compile read back from the persistent cache counts as its reading).
Each process of the run (each pytest-xdist worker) appends a JSON line a test to FOLDER/PID.jsonl;
`summary` reads them all."""

import collections
import json
import os
import resource
from contextlib import contextmanager
from pathlib import Path

import jax

# jax._src.dispatch's names of the events, which jax.monitoring passes to its listeners
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
SPENT = collections.Counter()  # this process's seconds by EVENTS' names, and its compiles


def heard(event: str, seconds: float, **_) -> None:
    if event in EVENTS:
        SPENT[EVENTS[event]] += seconds
        SPENT["compiles"] += EVENTS[event] == "compile"


jax.monitoring.register_event_duration_secs_listener(heard)


def cpu() -> tuple[float, float]:
    """CPU seconds (user and system) of this process and of its children that have ended."""
    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@contextmanager
def measured(folder: str, test: str):
    """What the code run inside costs, a line in this process's file under `folder`."""
    (own, children), spent = cpu(), SPENT.copy()
    yield
    (own_after, children_after), spent = cpu(), SPENT - spent
    line = {"test": test, "self": own_after - own, "children": children_after - children}
    line |= {name: spent[name] for name in ("trace", "lower", "compile", "compiles")}
    path = Path(folder) / f"{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def cpu_of(test: dict) -> float:
    return test["self"] + test["children"]


def summary(folder: str, slowest: int = 15) -> list[str]:
    """The costs of every test under `folder`: totals, each file's, and the `slowest` tests'."""
    paths = Path(folder).glob("*.jsonl")
    tests = [json.loads(line) for path in paths for line in path.read_text().splitlines()]
    columns = ("self", "children", "trace", "lower", "compile", "compiles")

    def row(name: str, tests: list[dict]) -> str:
        total = {c: sum(t[c] for t in tests) for c in columns}
        figures = " ".join(f"{total[c]:8.1f}" for c in columns[:-1])
        return f"{sum(map(cpu_of, tests)):8.1f} {figures} {total['compiles']:8.0f}  {name}"

    files = collections.defaultdict(list)
    for test in tests:
        files[test["test"].split("::")[0]].append(test)
    by_file = sorted(files.items(), key=lambda item: -sum(map(cpu_of, item[1])))
    header = f"{'CPU s':>8} " + " ".join(f"{c:>8}" for c in columns) + "  (seconds)"
    return [
        header,
        row(f"all {len(tests)} tests", tests),
        *(row(name, tests) for name, tests in by_file),
        f"the {slowest} costliest tests:",
        *(row(test["test"], [test]) for test in sorted(tests, key=cpu_of, reverse=True)[:slowest]),
    ]
