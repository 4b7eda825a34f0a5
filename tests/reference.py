"""Slow references the tests compare run.py against."""

import jax
import jax.numpy as jnp

import run


def member_log2_likelihood(params, nz, sign, h, inputs, targets, cfg, tables):
    """One member alone, byte by byte: the sum of log2 p(target | prefix) at LL_FRAC and the final
    hidden states, the state reset to zero at every input byte 0 (run.population_fitness does the
    same for a whole population at once)."""

    def step(h, io):
        tok, target = io
        h = jnp.where(tok == 0, jnp.zeros_like(h), h)
        logits, h, _ = run.token_logits(params, nz, sign, h, tok, cfg, tables)
        return h, run.log2_likelihood(logits, target, tables)

    h, ll = jax.lax.scan(step, h, (inputs, targets))
    return jnp.sum(ll), h
