"""Text from a model: its next-byte log2-probabilities, read byte by byte, turned into draws
(--sample from a checkpoint, --sample_every during training): a presence penalty, a temperature,
min-p; bytes shown with the undecodable ones escaped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np

from egg.flags import flag

BYTES = 256


@dataclass(frozen=True)
class Flags:
    sample: bool = False
    """generate text from the checkpoint given by --resume instead of training"""
    prompt: str = "The "
    """text the samples continue"""
    max_new_bytes: Annotated[int, *flag("[0, inf)")] = 200
    """bytes to generate per sample"""
    temperature: Annotated[float, *flag("[0, inf)")] = 0.6
    """sampling temperature (0: greedy)"""
    min_p: Annotated[float, *flag("[0, 1]")] = 0.08
    """drop bytes whose probability is below min_p times the most likely byte's"""
    presence_penalty: float = 0.2
    """bits subtracted from the log2-probability of every byte already generated"""
    sample_replica: int = -1
    """--sample from a checkpoint of several replicas: which one (-1: the best by its last validation)"""
    sample_every: Annotated[int, *flag("[0, inf)")] = 0
    """generations between samples printed (and logged) during training (0: none)"""


def probabilities(bits, generated, temperature: float, min_p: float, penalty: float) -> np.ndarray:
    """Next-byte probabilities from the model's log2-probabilities in bits (up to a constant):
    `penalty` bits off every byte already generated, divided by the temperature, then bytes
    below min_p times the most likely one dropped. Temperature 0 is greedy decoding."""
    bits = np.asarray(bits, np.float64) - penalty * np.asarray(generated, np.float64)
    if temperature <= 0:
        return (np.arange(BYTES) == np.argmax(bits)).astype(np.float64)
    weights = np.exp2((bits - bits.max()) / temperature)
    weights[weights < min_p] = 0.0  # the most likely byte has weight exactly 1
    return weights / weights.sum()


def continuation(read, prompt: bytes, flags: Flags, seed: int) -> bytes:
    """flags.max_new_bytes bytes continuing `prompt`, drawn with a generator seeded by `seed`:
    read(data) gives the next byte's log2-probabilities (BYTES,) in bits once the model (which
    keeps its own state) has read these bytes."""
    rng, bits = np.random.default_rng(seed), read(prompt)
    generated, out = np.zeros(BYTES, bool), bytearray()
    for _ in range(flags.max_new_bytes):
        chances = probabilities(bits, generated, flags.temperature, flags.min_p, flags.presence_penalty)
        byte = int(rng.choice(BYTES, p=chances))
        out.append(byte)
        generated[byte] = True
        bits = read(bytes([byte]))
    return bytes(out)


def printable(data: bytes) -> str:
    """Bytes as text, with undecodable bytes shown as \\xNN escapes."""
    return data.decode("utf-8", errors="backslashreplace")
