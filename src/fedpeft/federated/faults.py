"""Fault injection for any engine (applied where the client runs): corrupt, crash, drop or slow clients.

Used by tests and the robustness benchmark to show what the server survives. Every draw is
seeded from (run seed, round, client), so a faulty run is as reproducible as a clean one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedpeft.config import FaultConfig
from fedpeft.federated.codec import PACK_MAGIC, Schema, packed_with_dtype, read_metadata
from fedpeft.federated.types import ClientResult
from fedpeft.seeding import rng_for

UPDATE_FAULTS = ("nan", "inf", "wrong_shape", "unknown_key", "missing_key", "oversize", "zero_samples", "huge")
MESSAGE_FAULTS = ("truncated", "wrong_dtype")


class ClientCrashed(RuntimeError):
    """An injected client failure (``raise`` fault)."""


def active_faults(faults: Sequence[FaultConfig], seed: int, round_idx: int, client: int) -> list[FaultConfig]:
    """The faults that hit ``client`` in ``round_idx``."""
    hits = []
    for index, fault in enumerate(faults):
        if fault.clients is not None and client not in fault.clients:
            continue
        if fault.rounds is not None and round_idx not in fault.rounds:
            continue
        if fault.probability < 1 and rng_for(seed, "fault", index, round_idx, client).random() >= fault.probability:
            continue
        hits.append(fault)
    return hits


def corrupt(result: ClientResult, kind: str) -> ClientResult:
    """Return ``result`` with its update (or sample count) corrupted as ``kind`` says."""
    update = dict(result.update)
    first = sorted(update)[0]
    if kind == "nan":
        update[first] = update[first].clone().fill_(float("nan"))
    elif kind == "inf":
        update[first] = update[first].clone().fill_(float("inf"))
    elif kind == "wrong_shape":
        update[first] = torch.zeros(*update[first].shape, 2)
    elif kind == "unknown_key":
        update["not.a.parameter"] = torch.zeros(3)
    elif kind == "missing_key":
        del update[first]
    elif kind == "oversize":
        update["padding.oversize"] = torch.zeros(1 << 20)  # a 4 MB message
    elif kind == "huge":
        update = {k: v * 1e6 for k, v in update.items()}
    elif kind == "zero_samples":
        return ClientResult(result.client_id, update, 0, result.train_loss, result.metrics)
    return ClientResult(result.client_id, update, result.num_samples, result.train_loss, result.metrics)


def damage(message: bytes, kind: str, schema: Schema | None = None) -> bytes:
    """Return the encoded upload ``message`` damaged as ``kind`` says: cut in half (``truncated``),
    or with its first tensor re-sent as int64 under the same header metadata (``wrong_dtype``; a
    packed message, whose tensors share one dtype, has all of them re-sent as int64)."""
    if kind == "truncated":
        return message[: len(message) // 2]
    if message.startswith(PACK_MAGIC) and schema is not None:
        return packed_with_dtype(message, schema, torch.int64)
    tensors = st_load(message)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].to(torch.int64)
    return st_save(tensors, metadata=read_metadata(message))
