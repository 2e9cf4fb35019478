"""Deterministic seeds: every random choice derives its own seed from (run seed, purpose, ...).

Rounds and clients get independent streams, so a resumed run draws exactly what an
uninterrupted one would, with no random state to checkpoint.
"""

from __future__ import annotations

import zlib

import numpy as np


def derive_seed(seed: int, purpose: str, *parts: int) -> int:
    """A 63-bit seed for ``purpose`` (e.g. "select", round) from the run's ``seed``."""
    key = [seed & 0xFFFFFFFF, zlib.crc32(purpose.encode()), *(p & 0xFFFFFFFF for p in parts)]
    return int(np.random.SeedSequence(key).generate_state(2, dtype=np.uint32).astype(np.uint64)
               .dot(np.array([1 << 31, 1], dtype=np.uint64)))


def rng_for(seed: int, purpose: str, *parts: int) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, purpose, *parts))
