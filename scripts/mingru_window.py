"""The minGRU's products by the byte (run.py's --model mingru) or over a window at once: the gate
and candidate read the input alone, so a layer's products could cover a member's whole window,
leaving only the elementwise recurrence byte by byte. Both compute the same bits (checked here);
this times one replica's fitness of each, alternating, and prints the ratio window / byte of their
tokens/s.

    python scripts/mingru_window.py --n_embd 32 --n_layer 1 --members 1024 --window 10
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import run  # noqa: E402
from egg import flags  # noqa: E402


@dataclass(frozen=True)
class Args:
    n_embd: int = 32
    n_layer: int = 1
    members: int = 1024
    window: int = 10  # bytes a member reads with one perturbation (a segment's)
    rounds: int = 20  # timed calls of each, alternating


def mingru_window(w: run.Perturbed, states, bytes_TxRxDxS, cfg: run.Config):
    """The minGRU over a window: each layer's products over every byte at once, then the state's
    elementwise recurrence byte by byte (from the carried states, restarting at byte 0)."""
    x = run.embed(w, "emb", bytes_TxRxDxS)
    restart = (bytes_TxRxDxS == 0)[..., None]
    carried = []
    for layer in range(cfg.n_layer):
        wf, wh = run.products(w, x, ("Wf", "Wh"), layer, gain="ln1")
        g = run.clipped_add(wf, w.params["bf"][layer]).astype(run.i32) + run.INT8_MAX
        c = run.clipped_add(wh, w.params["bh"][layer]).astype(run.i32)

        def recur(h, at):
            g, c, restart = at
            h = jnp.where(restart, 0, h)
            h = h + ((g * (c - h)) >> run.GATE_BITS)
            return h, h.astype(jnp.int8)

        last, h = jax.lax.scan(recur, states[layer].astype(run.i32), (g, c, restart))
        carried.append(last.astype(jnp.int8))
        x = run.join(h, x, cfg.residual_shift)
        (hidden,) = run.products(w, x, ("W1",), layer, gain="ln2")
        (x,) = run.products(w, hidden, ("W2",), layer, residual=x)
    (logits,) = run.products(w, x, ("head",), gain="ln_out")
    return logits, run.layer_carry(jnp.stack(carried), cfg), {}


def main(args: Args) -> None:
    given = dict(model="mingru", n_embd=args.n_embd, n_layer=args.n_layer)
    cfg = run.make_config(
        flags.replace(
            run.Args(),
            **given,
            parallel_generations_per_gpu=args.members,
            tokens_per_update=args.window,
            segments=1,
        )
    )
    window = cfg._replace(model="mingru_window")
    run.MODELS["mingru_window"] = run.MODELS["mingru"]._replace(
        step=None, window=mingru_window, context=run.window_length
    )
    params = run.init_params(cfg, 0)
    noise = run.generation_noise(cfg, 0, jnp.int32(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 256, (args.members, args.window + 1)).astype(np.uint8)
    states = np.zeros((args.members, *run.egg_state(cfg)), np.int8)
    inputs = (params, noise, states, tokens[:, :-1], tokens[:, 1:], np.int32(3))
    steps = {
        name: jax.jit(run.forward, static_argnums=6).lower(*inputs, c).compile()
        for name, c in (("byte", cfg), ("window", window))
    }
    fitness = {name: np.asarray(step(*inputs)[0]) for name, step in steps.items()}
    assert np.array_equal(fitness["byte"], fitness["window"]), "the two differ"
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(*inputs))
            times[name].append(time.perf_counter() - start)
    rate = {k: args.members * args.window / float(np.median(v)) for k, v in times.items()}
    print(
        f"{args.n_embd}D-{args.n_layer}L, {args.members} members, windows of {args.window}: "
        f"byte {rate['byte']:,.0f} tokens/s, window {rate['window']:,.0f} "
        f"({rate['window'] / rate['byte']:.2f}x); the same fitness"
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
