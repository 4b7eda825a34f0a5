"""Integer building blocks against references computed another way (float64, exact integers)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import run

INT8 = np.arange(-127, 128)


@pytest.mark.parametrize("shift", range(0, 9))
def test_round_shift_is_symmetric_round_half_away_from_zero(shift):
    got = np.asarray(run.round_shift(jnp.asarray(INT8), shift))
    want = np.sign(INT8) * np.floor(np.abs(INT8) / 2**shift + 0.5)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[::-1], -got)  # +noise and -noise stay opposite


@pytest.mark.parametrize(
    "divisor", [1, 2, 128, 256, 512, 16 * math.sqrt(128), 16 * math.sqrt(48), 100, 3]
)
def test_divide_to_int8_is_floor_division(divisor):
    acc = np.concatenate([np.arange(-70000, 70000, 7), [-(2**31) + 1, 2**31 - 1, 0, 1, -1]]).astype(
        np.int32
    )
    got = np.asarray(run.divide_to_int8(jnp.asarray(acc), divisor)).astype(np.int64)
    want = np.clip(np.floor(acc.astype(np.float64) / divisor), -127, 127)
    if divisor == 2 ** int(math.log2(divisor)):
        np.testing.assert_array_equal(got, want)  # powers of two: an exact shift
    else:
        assert np.max(np.abs(got - want)) <= 1
        assert np.mean(got == want) > 0.97


def test_log2_likelihood_matches_float64_log_softmax_over_the_whole_range():
    rng = np.random.default_rng(0)
    cases = [rng.integers(-127, 128, 256) for _ in range(300)]
    cases += [rng.integers(-127, -100, 256), rng.integers(100, 128, 256)]
    cases += [np.full(256, v) for v in (-127, 0, 127)]
    spike = np.full(256, -127)
    spike[7] = 127
    cases += [spike, -spike]
    tables = run.make_tables(1)
    worst = 0.0
    for logits in cases:
        logits = logits.astype(np.int8)
        real = logits.astype(np.float64) / 2**run.LOGIT_FRAC  # log2 units
        exact = real - (np.log(np.sum(np.exp2(real - real.max()))) / np.log(2) + real.max())
        for target in (0, 7, int(np.argmax(logits)), int(np.argmin(logits)), 255):
            got = int(run.log2_likelihood(jnp.asarray(logits), target, tables)) / 2**run.LL_FRAC
            worst = max(worst, abs(got - exact[target]))
    assert worst <= 1 / 2**run.LL_FRAC, worst


def test_layer_norm_matches_exact_integer_reference():
    rng = np.random.default_rng(1)
    for n in (4, 64, 48):
        for _ in range(50):
            x = rng.integers(-127, 128, n).astype(np.int8) // rng.integers(1, 64)
            gain = rng.integers(-127, 128, n).astype(np.int8)
            mean = max(1, min(127, int(np.abs(x.astype(np.int64)).sum()) // n))
            recip = round(2**run.RECIP_BITS / mean)
            want = np.clip((x.astype(np.int64) * gain * recip) >> run.RECIP_BITS, -127, 127)
            got = np.asarray(run.layer_norm(jnp.asarray(x), jnp.asarray(gain)))
            if n == 48:  # the mean is a constant multiply for non-powers of two: within one step
                alt = [
                    np.clip((x.astype(np.int64) * gain * round(2**16 / m)) >> 16, -127, 127)
                    for m in (mean, max(1, mean - 1), min(127, mean + 1))
                ]
                assert any(np.array_equal(got, a) for a in alt)
            else:
                np.testing.assert_array_equal(got, want)


def test_layer_norm_of_zeros_is_zero_not_a_division_by_zero():
    got = run.layer_norm(jnp.zeros(8, jnp.int8), jnp.full(8, 16, jnp.int8))
    np.testing.assert_array_equal(np.asarray(got), 0)


def test_layer_norm_multiplier_is_the_rounded_reciprocal_of_every_mean():
    """norm_scale gives round(2**16 / m) for every floor mean m in [1, 127] (all of them: never a
    tie, so its (2**17 + m) // 2m is the rounding either way), from the sum |x| of n entries."""
    for n in (4, 48, 64):
        means = np.arange(1, 128)
        got = np.asarray(run.norm_scale(jnp.asarray(means * n, jnp.int32), n))
        want = [round(2**run.RECIP_BITS / m) for m in means]
        np.testing.assert_array_equal(got, want)
    assert int(run.norm_scale(jnp.int32(0), 8)) == 2**run.RECIP_BITS  # mean 0 counts as 1


def test_tables_are_small():
    for rank in (1, 3):
        assert sum(t.nbytes for t in run.make_tables(rank)) < 64 * 1024
