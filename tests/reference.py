"""A slow, independent reference of the integer forward pass, written from docs/design.org's
description of the model and sharing no function with run.py: Python integers and numpy int64
arithmetic, one member and one byte at a time. Only the parameters, the noise and the bytes come
from outside.

Fixed-point formats (docs/design.org, "The model"): weights, gains, embeddings, residual stream and
layer-norm outputs are q / 16; noise entries q / 16 (B already divided by sqrt(rank)); the hidden
state uses the full range (q / 127); logits are log2-probabilities at q / 16 bits; the
log-likelihood is in bits at q / 256.
"""

import math

import numpy as np

BLOCK = ("ln1", "Wf", "Uf", "bf", "Wh", "Uh", "bh", "ln2", "W1", "W2")
ATTENTION_BLOCK = ("ln1", "Wq", "Wk", "Wv", "Wo", "ln2", "W1", "W2")


def clip8(v):
    """Saturate to the symmetric int8 range [-127, 127] (int64 arrays or Python ints)."""
    return np.clip(v, -127, 127)


def round_half_away(v, k: int):
    """v / 2**k rounded half away from zero."""
    v = np.asarray(v, np.int64)
    if k == 0:
        return v
    return np.sign(v) * ((np.abs(v) + (1 << (k - 1))) >> k)


def rescale(acc, divisor: float):
    """floor(acc / divisor), clipped to int8: design.org's rescale. A power of two is an exact floor
    shift; otherwise divisor = 2**k c with c in [1, 2): acc is floored by 2**(k - g), g = min(k, 6)
    guard bits, clipped to +-2**(8 + g), multiplied by round(2**(14 + k) / divisor) and floored by
    2**(14 + g)."""
    acc = np.asarray(acc, np.int64)
    k = math.floor(math.log2(divisor))
    if 2**k == divisor:
        return clip8(acc >> k)
    g = min(k, 6)
    multiplier = round(2 ** (14 + k) / divisor)
    z = np.clip(acc >> (k - g), -(2 ** (8 + g)), 2 ** (8 + g))
    return clip8((z * multiplier) >> (14 + g))


def perturbed_vector(p, noise, sign: int, sigma_shift: int):
    """A bias or gain plus sign * noise / 2**sigma_shift (noise and vector both at q / 16)."""
    p = np.asarray(p, np.int64)
    if noise is None:
        return p
    return clip8(p + sign * round_half_away(noise, sigma_shift))


def matmul(x, w, noise, sign: int, sigma_shift: int):
    """x (W + sigma E)^T / (16 sqrt(n_in)): x W^T in int64, plus, for E = A B^T, the rank-r term
    sign * ((x B) >> 4) A^T >> sigma_shift, or for a full E, sign * x E^T >> sigma_shift."""
    x = np.asarray(x, np.int64)
    acc = np.asarray(w, np.int64) @ x
    if isinstance(noise, tuple):
        a, b = (np.asarray(m, np.int64) for m in noise)
        u = (x @ b) >> 4
        acc = acc + ((sign * (a @ u)) >> sigma_shift)
    elif noise is not None:
        acc = acc + ((sign * (np.asarray(noise, np.int64) @ x)) >> sigma_shift)
    return rescale(acc, 16 * math.sqrt(len(x)))


def layer_norm(x, gain):
    """gain * x / mean|x|: mean = floor(sum|x| / n) (design.org's rescale), at least 1; the product
    times round(2**16 / mean), floored by 2**16, clipped."""
    x = np.asarray(x, np.int64)
    mean = max(int(rescale(np.abs(x).sum(), len(x))), 1)
    return clip8((x * np.asarray(gain, np.int64) * round(2**16 / mean)) >> 16)


def embed(emb, tok: int, noise, sign: int, sigma_shift: int):
    """Row tok of the embedding, plus sign * (A[tok] B^T) >> (4 + sigma_shift) for a rank-r
    perturbation, or the row of a full noise matrix as a vector perturbation."""
    row = np.asarray(emb[tok], np.int64)
    if isinstance(noise, tuple):
        a, b = (np.asarray(m, np.int64) for m in noise)
        return clip8(row + ((sign * (b @ a[tok])) >> (4 + sigma_shift)))
    return perturbed_vector(row, None if noise is None else noise[tok], sign, sigma_shift)


def log2_softmax(logits, target: int) -> int:
    """log2 p(target) at q / 256 bits, with design.org's tables: d = max - logit, s = sum of
    round(2**(20 - (d % 16) / 16)) >> (d // 16), log2 s = top bit + a 1024-entry mantissa table of
    round(256 log2(1 + (i + 0.5) / 1024))."""
    logits = [int(v) for v in logits]
    top = max(logits)
    s = 0
    for v in logits:
        d = top - v
        s += round(2 ** (20 - (d % 16) / 16)) >> (d // 16)
    e = s.bit_length() - 1
    mantissa = (s >> (e - 10)) - 1024
    log2_s = ((e - 20) << 8) + round(math.log2(1 + (mantissa + 0.5) / 1024) * 256)
    return ((logits[target] - top) << 4) - log2_s


def pair_noise(noise):
    """nz(name, layer=None): one pair's noise of a parameter (of one layer), or None."""

    def nz(name, layer=None):
        if noise is None:
            return None
        value = noise[name]
        if layer is None:
            return value
        return (
            tuple(np.asarray(m)[layer] for m in value) if isinstance(value, tuple) else value[layer]
        )

    return nz


def forward(params, noise, sign: int, h, tok: int, sigma_shift: int, residual_shift: int = 0):
    """One byte: (logits (256,), new states (L, n)). h restarts at 0 on byte 0. noise is one pair's
    {name: (A, B) or full array} (block entries with a leading layer axis), or None. The MLP has no
    nonlinearity, as upstream's. A block's state and MLP output join the residual stream halved
    residual_shift times, each quotient rounded half away from zero. Without Uf and Uh in params
    (the minGRU of "Were RNNs All We Needed?"), the gate and candidate read the input alone."""
    h = np.zeros_like(h) if tok == 0 else np.asarray(h, np.int64).copy()
    nz = pair_noise(noise)
    x = embed(params["emb"], tok, nz("emb"), sign, sigma_shift)
    for layer in range(len(h)):
        p = {name: np.asarray(params[name])[layer] for name in BLOCK if name in params}

        def vec(name, layer=layer, p=p):
            return perturbed_vector(p[name], nz(name, layer), sign, sigma_shift)

        def mm(v, name, layer=layer, p=p):
            return matmul(v, p[name], nz(name, layer), sign, sigma_shift)

        state = h[layer]
        a = layer_norm(x, vec("ln1"))
        # the fraction g / 256 in [0, 254]
        if "Uf" in p:
            g = clip8(mm(a, "Wf") + mm(state, "Uf") + vec("bf")) + 127
            gated = (g * state) >> 8
            c = clip8(mm(a, "Wh") + mm(gated, "Uh") + vec("bh"))
        else:
            g = clip8(mm(a, "Wf") + vec("bf")) + 127
            c = clip8(mm(a, "Wh") + vec("bh"))
        new = state + ((g * (c - state)) >> 8)
        assert np.all(np.abs(new) <= 127)  # between the old state and the candidate
        h[layer] = new
        x = clip8(x + round_half_away(new, residual_shift))
        a = layer_norm(x, vec("ln2"))
        x = clip8(x + round_half_away(mm(mm(a, "W1"), "W2"), residual_shift))
    x = layer_norm(x, perturbed_vector(params["ln_out"], nz("ln_out"), sign, sigma_shift))
    return matmul(x, params["head"], nz("head"), sign, sigma_shift), h


def member_fitness(
    params, noise, sign: int, h, inputs, targets, sigma_shift: int, residual_shift=0
):
    """One member over a window: (sum of log2 p(target) at q / 256, final states, logits per
    byte)."""
    total, every = 0, []
    for tok, target in zip(inputs, targets, strict=True):
        logits, h = forward(params, noise, sign, h, int(tok), sigma_shift, residual_shift)
        every.append(logits)
        total += log2_softmax(logits, int(target))
    return total, h, np.array(every)


def exp2_sixteenths(d: int) -> int:
    """round(2**(20 - (d % 16) / 16)) >> (d // 16): 2**(-d / 16) at q / 2**20."""
    return round(2 ** (20 - (d % 16) / 16)) >> min(d // 16, 31)


def log2_of_sum(s: int) -> int:
    """log2(s / 2**20) at q / 256: s's top bit and a 1024-entry mantissa table."""
    e = s.bit_length() - 1
    mantissa = (s >> (e - 10)) - 1024
    return ((e - 20) << 8) + round(math.log2(1 + (mantissa + 0.5) / 1024) * 256)


def head_attention(q, k, v, allowed, width: int, bias=None):
    """One head of one byte: q (width,), k and v (U, width) of the bytes before it and itself,
    allowed (U,) those of its document. Score = floor(q k * m / 2**16), less bias (U,) where given,
    clipped to int8, m = round(2**16 * 16 log2(e) / (256 sqrt(width))): log2-units at q / 16; p =
    2**(-(top - score + log2 sum) / 16) at q / 2**7 (the log2 rounded to sixteenths), at most 127;
    floor(sum p v / 2**7)."""
    m = round(2**16 * 16 * math.log2(math.e) / (256 * math.sqrt(width)))
    bias = [0] * len(k) if bias is None else bias
    scores = [int(clip8(((int(np.dot(q, k[u])) * m) >> 16) - bias[u])) for u in range(len(k))]
    top = max(s for s, a in zip(scores, allowed, strict=True) if a)
    s = sum(exp2_sixteenths(top - c) for c, a in zip(scores, allowed, strict=True) if a)
    log2_s = log2_of_sum(s)
    out = np.zeros(width, np.int64)
    for u, (score, a) in enumerate(zip(scores, allowed, strict=True)):
        if a:
            sixteenths = top - score + ((log2_s + 8) >> 4)
            p = min(
                round(2 ** (20 - (sixteenths % 16) / 16)) >> min(sixteenths // 16 + 13, 31), 127
            )
            out += p * np.asarray(v[u], np.int64)
    return clip8(out >> 7)


def distance_bias(head: int, heads: int, distance: int) -> int:
    """A head's score lowered by floor(slope x distance) in sixteenths of a bit, slope = ALiBi's
    2**(-8 (head + 1) / heads) nats a byte in bits, rounded to 1/256 of a sixteenth."""
    slope = round(2 ** (-8 * (head + 1) / heads) * math.log2(math.e) * 2**12)
    return (slope * distance) >> 8


def transformer_row(params, noise, sign, toks, sigma_shift, residual_shift, width, window, **kw):
    """One member reading toks a window at a time (windows of `window` bytes from the first):
    (logits (T, 256), the carried state after them). Byte t of the window starting at byte s
    attends the bytes j from s - C to t (C = carried) of its document (a byte 0 starts one), each
    key and value as computed when j was read: the row computed layer by layer, as one long window
    whose attention reaches C bytes before each window. Where j < 0 it reads the state it started
    with, start = (flags (C,), keys (L, C, n), values (L, C, n)): the C bytes before toks, which t
    may attend where flags[j] and no byte 0 is in toks[: t + 1]. No embedding of places: each
    head's score is lowered by distance_bias(t - j). The state after: the last C bytes (of the
    start's and toks), each with its flag (1 while no byte 0 follows it), key and value."""
    carried = kw.get("carried", 0)
    nz = pair_noise(noise)
    layers, n = np.asarray(params["Wq"]).shape[0], np.asarray(params["Wq"]).shape[-1]
    start = kw.get("start") or (
        np.zeros(carried, np.int64),
        np.zeros((layers, carried, n), np.int64),
        np.zeros((layers, carried, n), np.int64),
    )
    flags = [int(f) for f in start[0]]
    documents = [0] * carried + list(np.cumsum([int(t) == 0 for t in toks]))
    xs = [embed(params["emb"], int(tok), nz("emb"), sign, sigma_shift) for tok in toks]
    heads = n // width
    keys_after, values_after = [], []
    for layer in range(layers):
        p = {name: np.asarray(params[name])[layer] for name in ATTENTION_BLOCK}

        def vec(name, layer=layer, p=p):
            return perturbed_vector(p[name], nz(name, layer), sign, sigma_shift)

        def mm(v, name, layer=layer, p=p):
            return matmul(v, p[name], nz(name, layer), sign, sigma_shift)

        a = [layer_norm(x, vec("ln1")) for x in xs]
        q, k, v = ([mm(x, name) for x in a] for name in ("Wq", "Wk", "Wv"))
        k = [np.asarray(row, np.int64) for row in start[1][layer]] + k  # index j + C
        v = [np.asarray(row, np.int64) for row in start[2][layer]] + v
        joined = []
        for t, x in enumerate(xs):
            reach = range((t // window) * window, t + carried + 1)  # j + C, from j = s - C

            def allowed(j, t=t):
                if j < carried:  # a byte of the start's
                    return bool(flags[j]) and documents[t + carried] == 0
                return documents[j] == documents[t + carried]

            parts = []
            for h in range(heads):
                i = h * width
                bias = [distance_bias(h, heads, t + carried - j) for j in reach]
                parts.append(
                    head_attention(
                        q[t][i : i + width],
                        [k[j][i : i + width] for j in reach],
                        [v[j][i : i + width] for j in reach],
                        [allowed(j) for j in reach],
                        width,
                        bias,
                    )
                )
            x = clip8(x + round_half_away(mm(np.concatenate(parts), "Wo"), residual_shift))
            hidden = np.maximum(mm(layer_norm(x, vec("ln2")), "W1"), 0)
            joined.append(clip8(x + round_half_away(mm(hidden, "W2"), residual_shift)))
        xs = joined
        keys_after.append(k[len(k) - carried :])
        values_after.append(v[len(v) - carried :])
    gain = perturbed_vector(params["ln_out"], nz("ln_out"), sign, sigma_shift)
    logits = np.array(
        [matmul(layer_norm(x, gain), params["head"], nz("head"), sign, sigma_shift) for x in xs]
    )
    every = flags + [1] * len(toks)
    last = documents[-1]
    after = [
        int(f and (documents[j] == last if j >= carried else last == 0))
        for j, f in enumerate(every)
    ]
    state = (
        np.array(after[len(after) - carried :], np.int64),
        np.array(keys_after, np.int64).reshape(layers, carried, n),
        np.array(values_after, np.int64).reshape(layers, carried, n),
    )
    return logits, state


def transformer_fitness(params, noise, sign, inputs, targets, *settings, **kw):
    """One member over its bytes (transformer_row's settings): (sum of log2 p(target) at q / 256,
    logits per byte, the carried state after them)."""
    every, state = transformer_row(params, noise, sign, inputs, *settings, **kw)
    total = sum(log2_softmax(logits, int(t)) for logits, t in zip(every, targets, strict=True))
    return total, every, state
