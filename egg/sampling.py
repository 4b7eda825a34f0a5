"""Text from a model: its next-byte log2-probabilities, read byte by byte, turned into draws
(--sample from a checkpoint, --sample_every during training): a presence penalty, a temperature,
min-p; bytes shown with the undecodable and the control ones escaped."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Annotated

import numpy as np

from egg.flags import flag


@dataclass(frozen=True)
class Flags:
    sample: Annotated[bool, *flag(carried=False)] = False
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
    """--sample from a checkpoint of several replicas: which one (-1: best by last validation)"""
    sample_every: Annotated[int, *flag("[0, inf)")] = 0
    """generations between samples printed (and logged) during training (0: none)"""


def probabilities(bits, generated, temperature: float, min_p: float, penalty: float) -> np.ndarray:
    """Next-byte probabilities from the model's log2-probabilities in bits (up to a constant):
    `penalty` bits off every byte already generated, divided by the temperature, then bytes
    below min_p times the most likely one dropped. Temperature 0 is greedy decoding."""
    bits = np.asarray(bits, np.float64) - penalty * np.asarray(generated, np.float64)
    if temperature <= 0:
        return (np.arange(len(bits)) == np.argmax(bits)).astype(np.float64)
    weights = np.exp2((bits - bits.max()) / temperature)
    weights[weights < min_p] = 0.0  # the most likely byte has weight exactly 1
    return weights / weights.sum()


def continuation(read, prompt: bytes, flags: Flags, seed: int, stop: int | None = None) -> bytes:
    """flags.max_new_bytes bytes continuing `prompt`, drawn with a generator seeded by `seed`, or
    fewer, ending before a `stop` byte: read(data) gives the next byte's log2-probabilities in
    bits once the model (which keeps its own state) has read these bytes: one value for each of
    the bytes."""
    rng, bits = np.random.default_rng(seed), read(prompt)
    generated, out = np.zeros(len(bits), bool), bytearray()
    for _ in range(flags.max_new_bytes):
        chances = probabilities(
            bits, generated, flags.temperature, flags.min_p, flags.presence_penalty
        )
        byte = int(rng.choice(len(bits), p=chances))
        if byte == stop:
            break
        out.append(byte)
        generated[byte] = True
        bits = read(bytes([byte]))
    return bytes(out)


def prompt_bytes(prompt: str) -> bytes:
    """--prompt's bytes, any bytes: a command line's undecodable bytes reach Python as surrogates
    (PEP 383), which os.fsencode turns back into those bytes."""
    return os.fsencode(prompt)


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # control characters but newline and tab


def printable(data: bytes) -> str:
    """Bytes as text a terminal shows as it is: UTF-8 decoded; undecodable bytes and control
    characters (ESC, BEL, CR, byte 0...) but newline and tab as escapes, \\xNN (\\u00NN above
    127)."""
    text = data.decode("utf-8", errors="backslashreplace")
    return CONTROL.sub(
        lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 128 else f"\\u{ord(m[0]):04x}", text
    )
