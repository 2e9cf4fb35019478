"""Deterministic seeds: every random choice derives its own seed from (run seed, purpose, ...).

Rounds and clients get independent streams, so a resumed run draws exactly what an
uninterrupted one would, with no random state to checkpoint. :func:`single_thread` makes torch
kernels independent of the machine's thread count, for values every party must derive alike.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


def derive_seed(seed: int, purpose: str, *parts: int) -> int:
    """A 63-bit seed for ``purpose`` (e.g. "select", round) from the run's ``seed``."""
    key = [seed & 0xFFFFFFFF, zlib.crc32(purpose.encode()), *(p & 0xFFFFFFFF for p in parts)]
    return int(np.random.SeedSequence(key).generate_state(2, dtype=np.uint32).astype(np.uint64)
               .dot(np.array([1 << 31, 1], dtype=np.uint64)))


def rng_for(seed: int, purpose: str, *parts: int) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, purpose, *parts))


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread inside the block: multi-threaded LAPACK/BLAS results differ in the
    last bits with the thread count, which differs between machines."""
    import torch  # here: the data layer uses this module without needing torch loaded

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
