"""--kernels auto on a GPU: of the candidates that compute a run's products (run.py's
PRODUCT_CANDIDATES, every one the same integers), the fastest at the run's own shapes on its own
device. Each candidate is compiled and timed for a fraction of a second; the choice is kept in a
JSON file beside JAX's compilation cache under its key (device kind, JAX version and shapes), so a
later run of the same shapes on the same kind of device takes it without timing anything.

Takes values only: the candidates as functions that build a call, a clock, a file."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from egg import files

CALLS = 3  # a candidate is timed over this many calls at least (after one untimed: it compiles)


def seconds_a_call(call: Callable[[], object], clock: Callable[[], float], least: float) -> float:
    """The mean seconds of `call` (which waits for the device) by `clock`: one call untimed, then
    back to back for at least `least` seconds and CALLS calls."""
    call()
    count, start = 0, clock()
    while count < CALLS or clock() - start < least:
        call()
        count += 1
    return (clock() - start) / count


def time_candidates(
    candidates: dict[str, Callable[[], Callable[[], object]]],
    clock: Callable[[], float],
    least: float,
) -> tuple[dict[str, float], dict[str, str]]:
    """({name: seconds a call}, {name: why it failed}): each candidate's build() gives its call,
    whose first (untimed) compiles it; a candidate that cannot compile or run here is left out."""
    times, failed = {}, {}
    for name, build in candidates.items():
        try:
            times[name] = seconds_a_call(build(), clock, least)
        except Exception as error:  # a candidate this device or JAX cannot run: not a choice
            failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return times, failed


def read_choices(path: Path | None) -> dict:
    """The choices kept in `path` ({} where there is none, or it cannot be read)."""
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):  # a file another version wrote, or half a disk's: time anew
        return {}


def choose(
    key: str,
    candidates: dict[str, Callable[[], Callable[[], object]]],
    path: Path | None,
    clock: Callable[[], float] = time.perf_counter,
    least: float = 0.25,
    log: Callable[[str], None] = print,
) -> str:
    """The name of the fastest candidate for `key`: the one kept in `path` under it, else the
    fastest timed now (then kept there, where `path` is given). Says the choice in one line."""
    kept = read_choices(path).get(key)
    if kept is not None and kept.get("choice") in candidates:
        log(f"products: {kept['choice']} (the fastest when timed before: {path})")
        return kept["choice"]
    started = clock()
    times, failed = time_candidates(candidates, clock, least)
    if not times:
        raise RuntimeError(f"no product candidate runs here: {failed}")
    best = min(times, key=times.get)
    took = clock() - started
    if path is not None:
        choices = read_choices(path)
        choices[key] = {"choice": best, "ms": {k: v * 1e3 for k, v in times.items()}}
        try:
            files.write_atomic(path, json.dumps(choices, indent=1).encode())
        except OSError as error:  # not kept: the next run times them again
            log(f"products: the choice is not kept ({path}: {error.strerror})")
    each = "; ".join(f"{name} {t * 1e3:.3g}" for name, t in times.items())
    log(f"products: {best}, the fastest at this run's shapes (ms: {each}; timed in {took:.1f} s)")
    if failed:
        log(
            "products: "
            + "; ".join(f"{name} cannot run here ({why})" for name, why in failed.items())
        )
    return best
