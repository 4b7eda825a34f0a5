"""Backpropagation baselines on egg-jax's bytes: what a float32 model trained with gradients
(optax's Adam) reaches on the same training bytes, validated on the very rows run.py validates on.

    python baselines/backprop.py --network mingru --data corpora/english_train.bin \
        --valid_data corpora/english_valid.bin --n_embd 64 --n_layer 2 --num_epochs 3000 \
        --validate_every 100

- mingru: EGG's model in float32, layer for layer: the byte embedding, n_layer x [L1 layer norm ->
  minGRU (gate g = sigmoid(Wf a + Uf h + bf), candidate c = tanh(Wh a + Uh (g h) + bh),
  h' = h + g (c - h)) -> residual; L1 layer norm -> the MLP n -> 4n -> n with no nonlinearity ->
  residual] -> L1 layer norm -> head, the states restarting at every byte 0; sigmoid and tanh
  where EGG clips to int8 (the same shapes, smooth enough for gradients). Trained by
  backpropagation through each window, the states carried from one window to the next.
- transformer: a pre-norm causal Transformer of the same width and depth (n_embd / 32 heads,
  learned positions, GELU MLP of 4n), in the spirit of upstream nano-egg's baseline; it sees one
  window at a time.

Every step trains on --batch_size rows of --window bytes, read like run.py reads its sequences
(rows at evenly spaced offsets, each advancing a window a step). The flags are run.py's (so that
one command line serves both, compare.py's --flags included) and these few; those of ES do
nothing here. A run writes <runs_dir>/<run_name>/metrics.jsonl with run.py's fields (a step is a
"generation"), which compare.py tables and plots beside run.py's runs, and its last parameters,
params.npz, which --init_from RUN_FOLDER starts another run of the same network from.

With --task, the bytes are the task's worked examples, as run.py reads them (--task without
--objective reward), and every validation also writes greedy completions of the held-out prompts
(write_completions, as run.py validates a reward run): val/reward and val/accuracy beside the
bits. baselines/grpo.py trains these models on a task's reward.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import run  # noqa: E402  (run.py's data and validation rows; importing it does nothing)
from egg import UserError, cluster, corpus, tasks  # noqa: E402
from egg.flags import check_range  # noqa: E402


@dataclass(frozen=True)
class Args(run.Args):
    network: Literal["mingru", "transformer"] = "mingru"
    """what to train: EGG's minGRU in float32 or a causal Transformer of the same width and depth"""
    batch_size: int = 64
    """rows a step trains on"""
    window: int = 128
    """bytes of each row a step predicts (the Transformer's context)"""
    learning_rate: float = 2e-3
    """Adam's step size (gradients clipped to norm 1)"""
    train_seconds: float = 0.0
    """stop once this many seconds of training are done (compilation and validation excluded;
    0: run every --num_epochs step): equal time beside another run"""


# ------------------------------------------------------------------------------------------------
# Models: init(key, args) -> params; forward(params, state, tokens (B, T)) ->
# (logits (B, T, 256), state)


def l1_norm(x, gain):
    """EGG's layer norm: x / mean |x| times the gain."""
    return gain * x / (jnp.mean(jnp.abs(x), axis=-1, keepdims=True) + 1e-6)


def init_mingru(key, args: Args) -> dict:
    n, layers = args.model.n_embd, args.model.n_layer
    shapes = dict(Wf=(n, n), Uf=(n, n), Wh=(n, n), Uh=(n, n), W1=(4 * n, n), W2=(n, 4 * n))
    keys = iter(jax.random.split(key, 2 + len(shapes)))
    params = {
        "emb": jax.random.normal(next(keys), (run.VOCAB, n)),
        "head": jax.random.normal(next(keys), (run.VOCAB, n)) / math.sqrt(n),
        "ln_out": jnp.ones(n),
    }
    for name, (
        rows,
        cols,
    ) in shapes.items():  # N(0, 1 / n_in), as EGG's products divide by sqrt(n_in)
        params[name] = jax.random.normal(next(keys), (layers, rows, cols)) / math.sqrt(cols)
    params.update({name: jnp.ones((layers, n)) for name in ("ln1", "ln2")})
    params.update({name: jnp.zeros((layers, n)) for name in ("bf", "bh")})
    return params


def mingru_forward(params, h, tokens):
    """h: (B, L, n) carried states; tokens (B, T). Layer by layer over the window, each layer's
    recurrence a scan over the bytes (the states restart where the byte is 0)."""
    x = params["emb"][tokens]  # (B, T, n)
    reset = (tokens == 0)[..., None]
    blocks = {k: params[k] for k in ("ln1", "Wf", "Uf", "bf", "Wh", "Uh", "bh", "ln2", "W1", "W2")}

    def layer(x, inputs):
        p, h0 = inputs
        a = l1_norm(x, p["ln1"])
        f_in, c_in = a @ p["Wf"].T, a @ p["Wh"].T  # the input projections of every byte at once

        def byte(h, xs):
            f, c, r = xs
            h = jnp.where(r, 0.0, h)
            g = jax.nn.sigmoid(f + h @ p["Uf"].T + p["bf"])
            c = jnp.tanh(c + (g * h) @ p["Uh"].T + p["bh"])
            h = h + g * (c - h)
            return h, h

        h, hs = jax.lax.scan(
            byte, h0, (f_in.swapaxes(0, 1), c_in.swapaxes(0, 1), reset.swapaxes(0, 1))
        )
        x = x + hs.swapaxes(0, 1)
        x = x + (l1_norm(x, p["ln2"]) @ p["W1"].T) @ p["W2"].T
        return x, h

    x, h = jax.lax.scan(layer, x, (blocks, h.swapaxes(0, 1)))
    return l1_norm(x, params["ln_out"]) @ params["head"].T, h.swapaxes(0, 1)


def zero_state(params: dict, rows: int):
    """The carried state of `rows` rows at the start: zeros (rows, n_layer, n_embd)."""
    layers, width = params["ln1"].shape
    return jnp.zeros((rows, layers, width))


def init_transformer(key, args: Args) -> dict:
    n, layers = args.model.n_embd, args.model.n_layer
    keys = iter(jax.random.split(key, 8))

    def dense(rows, cols):
        return jax.random.normal(next(keys), (layers, rows, cols)) / math.sqrt(cols)

    return {
        "emb": jax.random.normal(next(keys), (run.VOCAB, n)) * 0.02,
        "pos": jax.random.normal(next(keys), (args.window, n)) * 0.02,
        "qkv": dense(3 * n, n),
        "out": dense(n, n),
        "fc": dense(4 * n, n),
        "proj": dense(n, 4 * n),
        "ln1": jnp.ones((layers, n)),
        "ln2": jnp.ones((layers, n)),
        "ln_out": jnp.ones(n),
        "head": jax.random.normal(next(keys), (run.VOCAB, n)) / math.sqrt(n),
    }


def layer_norm(x, gain):
    mean, var = jnp.mean(x, -1, keepdims=True), jnp.var(x, -1, keepdims=True)
    return gain * (x - mean) / jnp.sqrt(var + 1e-5)


def transformer_forward(params, state, tokens):
    """Causal attention within the window (no state carried: `state` passes through)."""
    batch, length = tokens.shape
    n = params["emb"].shape[1]
    heads = max(n // 32, 1)
    x = params["emb"][tokens] + params["pos"][:length]
    causal = jnp.tril(jnp.ones((length, length), bool))

    def layer(x, p):
        q, k, v = jnp.split(layer_norm(x, p["ln1"]) @ p["qkv"].T, 3, axis=-1)
        q, k, v = (t.reshape(batch, length, heads, n // heads) for t in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(n // heads)
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, n) @ p["out"].T
        x = x + jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["fc"].T) @ p["proj"].T
        return x, None

    blocks = {k: params[k] for k in ("qkv", "out", "fc", "proj", "ln1", "ln2")}
    x, _ = jax.lax.scan(layer, x, blocks)
    return layer_norm(x, params["ln_out"]) @ params["head"].T, state


MODELS = {
    "mingru": (init_mingru, mingru_forward),
    "transformer": (init_transformer, transformer_forward),
}


# ------------------------------------------------------------------------------------------------
# Training and validation


def bits(logits, targets):
    """Mean bits per byte of the targets under the logits' softmax."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)) / math.log(2)


def make_step(forward, optimizer):
    @jax.jit
    def step(params, opt_state, state, window):
        def loss(params):
            logits, new_state = forward(params, state, window[:, :-1])
            return bits(logits, window[:, 1:]), new_state

        (value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            jax.lax.stop_gradient(new_state),
            value,
        )

    return step


def make_writer(forward, completion_bytes: int, stop: int):
    """write(params, prompts (N, L) uint8, key, temperature) -> (buffer (N, L + C) uint8, read
    (N, C) bool): each row's prompt (its bytes at the right, byte 0 before: a fresh start) continued
    by up to C = completion_bytes bytes, each drawn from the model's logits at `temperature`
    (0: its most likely byte, the lowest of equals, as run.py writes), ending at the stop byte or
    at byte 0 (a document's end). `read` marks the bytes the row wrote before it ended, its stop
    byte included: those a policy gradient scores. Every byte is read from a forward over the
    whole buffer (prompts and completions are a few dozen bytes)."""

    @partial(jax.jit, static_argnames="temperature")
    def write(params, prompts, key, temperature: float):
        rows, length = prompts.shape
        buffer = jnp.pad(prompts, ((0, 0), (0, completion_bytes)))
        state = zero_state(params, rows)

        def byte(carry, at):
            buffer, ended = carry
            logits = forward(params, state, buffer)[0]
            logits = jax.lax.dynamic_index_in_dim(logits, length - 1 + at, 1, keepdims=False)
            if temperature:
                new = jax.random.categorical(jax.random.fold_in(key, at), logits / temperature)
            else:
                new = jnp.argmax(logits, axis=-1)
            new = new.astype(jnp.uint8)
            buffer = jax.lax.dynamic_update_index_in_dim(buffer, new, length + at, 1)
            return (buffer, ended | (new == stop) | (new == 0)), ~ended

        start = (buffer, jnp.zeros(rows, bool))
        (buffer, _), read = jax.lax.scan(byte, start, jnp.arange(completion_bytes))
        return buffer, read.T

    return write


def completions_of(buffer, length: int, stop: int) -> list[bytes]:
    """What each row of make_writer's buffer wrote after its `length` prompt bytes: its bytes before
    the first stop byte or byte 0 (the stop byte cut off, as run.py scores them)."""
    texts = []
    for row in np.asarray(buffer, np.uint8)[:, length:]:
        ends = np.flatnonzero((row == stop) | (row == 0))
        texts.append(bytes(row[: ends[0] if len(ends) else len(row)]))
    return texts


def task_prompts(task: tasks.Task, args: Args) -> tuple[np.ndarray, np.ndarray]:
    """(training prompts (N, L), held-out prompts validated on (V, L)) uint8, as run.py lays them
    out: left-padded with byte 0 to one length (the longest and a byte 0 before it), the first
    --validation_batch_size held-out prompts."""
    valid = task.valid.prompts[: args.validation_batch_size]
    length = 1 + max(tasks.longest(task.train.prompts), tasks.longest(valid))
    return tasks.left_padded(task.train.prompts, length), tasks.left_padded(valid, length)


def validate_completions(write, params, task: tasks.Task, prompts: np.ndarray) -> dict:
    """val/reward and val/accuracy of greedy completions of the held-out prompts (as run.py
    validates a reward run). Sync point."""
    buffer, _ = write(params, jnp.asarray(prompts), jax.random.key(0), 0.0)
    written = completions_of(buffer, prompts.shape[1], task.stop)
    rewards = tasks.score(task, task.valid, range(len(written)), written)
    accuracy = float(np.mean(rewards >= task.full_reward))
    return {"val/reward": float(np.mean(rewards)), "val/accuracy": accuracy}


def check_window(args: Args, length: int, what: str) -> None:
    """The transformer's --window holds `length` bytes (its learned positions are that many)."""
    if args.network == "transformer" and length > args.window:
        raise UserError(f"{what} of {length} bytes: give the transformer --window {length} or more")


def start_params(args: Args):
    """The network's parameters to start from: --init_from RUN_FOLDER's params.npz (a run of this
    script or baselines/grpo.py, of the same network and shapes), else drawn from --seed."""
    init, _ = MODELS[args.network]
    params = init(jax.random.key(args.seed), args)
    source = args.checkpoints.init_from
    if not source:
        return params
    path = Path(source) / "params.npz"
    if not path.is_file():
        raise UserError(f"--init_from {source}: no params.npz there (a run of baselines/)")
    with np.load(path) as saved:
        loaded = {k: jnp.asarray(saved[k]) for k in saved.files}
    shapes = {k: v.shape for k, v in params.items()}
    if {k: v.shape for k, v in loaded.items()} != shapes:
        raise UserError(
            f"--init_from {source}: its parameters are not a {args.network} of --n_embd "
            f"{args.model.n_embd} --n_layer {args.model.n_layer} (--window {args.window})"
        )
    return loaded


def save_params(params, folder: Path) -> None:
    """params.npz, written whole under a temporary name, then renamed."""
    temporary = folder / "params.tmp.npz"
    np.savez(temporary, **{k: np.asarray(v) for k, v in params.items()})
    temporary.replace(folder / "params.npz")


def run_folder(args: Args, kind: str) -> Path:
    """<runs_dir>/<run_name> (default: KIND-NETWORK-DATA-seedS), with the run's config.json."""
    data = Path(args.tasks.task or args.corpus.data).stem
    name = args.record.run_name or f"{kind}-{args.network}-{data}-seed{args.seed}"
    folder = Path(args.record.runs_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(args), indent=1) + "\n")
    return folder


def validation_bits(forward, params, rows: np.ndarray, args: Args) -> float:
    """Bits/byte on run.py's validation rows, each from a zero state: the minGRU over the whole row,
    the Transformer window by window (each a fresh context)."""
    zero = jnp.zeros((rows.shape[0], args.model.n_layer, args.model.n_embd))
    if args.network == "mingru":
        logits, _ = jax.jit(forward)(params, zero, jnp.asarray(rows[:, :-1]))
        return float(bits(logits, jnp.asarray(rows[:, 1:])))
    total, count, span = 0.0, 0, args.window
    for start in range(0, rows.shape[1] - 1, span):
        chunk = jnp.asarray(rows[:, start : start + span + 1])
        logits, _ = jax.jit(forward)(params, zero, chunk[:, :-1])
        total += float(bits(logits, chunk[:, 1:])) * (chunk.shape[1] - 1)
        count += chunk.shape[1] - 1
    return total / count


def train(args: Args) -> dict:
    """Train --num_epochs steps (or until --train_seconds), validating every --validate_every and
    at the end; write the run's metrics.jsonl and params.npz; return the last metrics."""
    task = tasks.open_task(args.tasks, rewarded=True) if args.tasks.task else None
    if task is not None:
        train_bytes, valid_bytes = run.task_bytes(task)
    else:
        train_bytes, valid_bytes = corpus.open_data(args.corpus, 2 * args.validation_batch_size)
    rows = run.validation_rows(valid_bytes, args)
    baselines = corpus.cached_baselines(train_bytes, rows, args.corpus.dir_path)
    stride = len(train_bytes) // args.batch_size
    windows = (stride - 1) // args.window
    if windows < 1:
        raise UserError(
            f"--data has {len(train_bytes)} bytes: too short for {args.batch_size} rows"
        )
    _, forward = MODELS[args.network]
    if task is not None:
        _, valid_prompts = task_prompts(task, args)
        write = make_writer(forward, args.reward.completion_bytes, task.stop)
        check_window(args, valid_prompts.shape[1] + args.reward.completion_bytes, "a completion")
    params = start_params(args)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.learning_rate))
    opt_state, step = optimizer.init(params), make_step(forward, optimizer)
    state = jnp.zeros((args.batch_size, args.model.n_layer, args.model.n_embd))
    folder = run_folder(args, "backprop")
    starts = np.arange(args.batch_size) * stride
    metrics, trained = {}, 0.0
    with open(folder / "metrics.jsonl", "w") as record:
        for generation in range(args.num_epochs):
            offset = (generation % windows) * args.window
            window = np.asarray(train_bytes[starts[:, None] + offset + np.arange(args.window + 1)])
            tick = time.time()
            params, opt_state, state, loss = jax.block_until_ready(
                step(params, opt_state, state, window)
            )
            seconds, done = time.time() - tick, generation + 1
            trained += seconds if done > 1 else 0.0  # the first step compiles
            timed_out = bool(args.train_seconds) and trained >= args.train_seconds
            metrics = {
                "train/bits_per_byte": float(loss),
                "perf/seconds": seconds,
                "perf/tokens_per_s": args.batch_size * args.window / seconds,
            }
            last = done == args.num_epochs or timed_out
            if last or (args.validate_every and done % args.validate_every == 0):
                metrics["val/bits_per_byte"] = validation_bits(forward, params, rows, args)
                metrics.update({f"val/{k}_bits_per_byte": v for k, v in baselines.items()})
                said = f"validation {metrics['val/bits_per_byte']:.3f} bits/byte"
                if task is not None:
                    metrics.update(validate_completions(write, params, task, valid_prompts))
                    said += f", reward {metrics['val/reward']:.3f}"
                print(f"step {done}: {said}", flush=True)
            record.write(json.dumps({"generation": done, **metrics}) + "\n")
            record.flush()
            if timed_out:
                break
    save_params(params, folder)
    return metrics


def main(argv: list[str] | None = None, flags: type = Args, trainer=train) -> None:
    """A command line of `flags` trained by `trainer` (baselines/grpo.py's too): bad input refused
    in one line (exit 2), a reward that fails on a completion in one line (exit 65, as run.py)."""
    cluster.select_platform("")  # JAX's choice, without jax[cuda12]'s traceback on a CPU machine
    try:
        args = tyro.cli(flags, args=argv, use_underscores=True)
        check_range(flags, "num_epochs", args.num_epochs)
        trainer(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except tasks.RewardFailed as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(65) from None


if __name__ == "__main__":
    main()
