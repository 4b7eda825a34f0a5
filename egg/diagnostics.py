"""Diagnostics: the int8 activations' and parameters' health (--log_every, --debug), from a model's
activations reading a few validation rows noise-free, its parameters and the share of each that
the last update moved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np

from egg.flags import flag


@dataclass(frozen=True)
class Flags:
    log_every: Annotated[int, *flag("[0, inf)")] = 0
    """generations between integer-health diagnostics, logged as diag/... (0: none)"""
    debug: bool = False
    """print diagnostics as a colour-coded table (every --log_every generations, else every 10)"""


def tensor_stats(values: np.ndarray, limit: int) -> dict[str, float]:
    """Mean, standard deviation, entropy of the value histogram in bits (0 to 8) and the share
    saturated (at +-limit, the edges of the int8 range run.py keeps), of an int8 tensor."""
    values = np.asarray(values).ravel().astype(np.int64)
    counts = np.bincount(values + 128, minlength=256)
    p = counts[counts > 0] / values.size
    return {
        "mean": float(values.mean()),
        "std": float(values.std()),
        "entropy": float(-(p * np.log2(p)).sum()),
        "saturated": float(np.mean(np.abs(values) == limit)),
    }


def moved_shares(counts, tensors: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Each tensor's share of entries that moved, from the update's counts (each tensor's in order,
    layer by layer) and {name: (layers, entries)}."""
    cuts = np.cumsum([layers for layers, _ in tensors.values()])[:-1]
    parts = np.split(np.asarray(counts, np.int64), cuts)
    return {
        name: int(c.sum()) / size
        for (name, (_, size)), c in zip(tensors.items(), parts, strict=True)
    }


def health(seen: dict, params: dict, moved: dict[str, float], limit: int) -> dict[str, float]:
    """diag/ metrics: statistics of each activation (`seen`: {name: (rows, bytes, width)}, or with
    a layer axis (rows, bytes, layers, width): per layer, as NAME0, NAME1, ...); per parameter the
    share at +-limit and the share that moved in the last generation (`moved`, by name);
    saturated: at +-limit, the edges of the int8 range."""
    out = {}
    for name, values in seen.items():
        values = np.asarray(values)
        if values.ndim == 3:
            parts = {name: values}
        else:
            parts = {f"{name}{k}": values[:, :, k] for k in range(values.shape[2])}
        for label, part in parts.items():
            out.update({f"diag/{label}/{k}": v for k, v in tensor_stats(part, limit).items()})
    for name, p in params.items():
        out[f"diag/param_{name}/saturated"] = float(np.mean(np.abs(np.asarray(p)) == limit))
        out[f"diag/param_{name}/moved"] = float(moved[name])
    return out


def table(values: dict[str, float]) -> str:
    """A compact table of the diag/ metrics, coloured: red where values saturate (> 5% at +-127)
    or collapse (entropy < 2 bits), yellow at > 1% or < 4 bits, green otherwise."""
    rows = {}
    for key, value in values.items():
        _, tensor, stat = key.split("/")
        rows.setdefault(tensor, {})[stat] = value

    def colour(text, saturated, entropy):
        code = (
            31 if saturated > 0.05 or entropy < 2 else 33 if saturated > 0.01 or entropy < 4 else 32
        )
        return f"\033[{code}m{text}\033[0m"

    lines = [f"{'tensor':14} {'mean':>8} {'std':>8} {'entropy':>8} {'sat%':>6} {'moved%':>7}"]
    for tensor, stats in rows.items():
        if "entropy" in stats:
            text = (
                f"{tensor:14} {stats['mean']:8.2f} {stats['std']:8.2f} {stats['entropy']:8.2f} "
                f"{100 * stats['saturated']:6.2f} {'':>7}"
            )
            lines.append(colour(text, stats["saturated"], stats["entropy"]))
        else:
            blank = f"{'':>8} " * 3
            text = f"{tensor:14} {blank}{100 * stats['saturated']:6.2f} {100 * stats['moved']:7.3f}"
            lines.append(colour(text, stats["saturated"], 8.0))
    return "\n".join(lines)
