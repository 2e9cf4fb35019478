"""Server-side checks on every client reply before it can touch the global model.

A reply is rejected (and logged with the client id and reason) when its keys are not exactly
the keys it was asked to upload, a tensor has the wrong shape or is not floating point, a
value is NaN or infinite, the message is larger than ``strategy.max_update_bytes``, or the
sample count is not positive. The round goes on with the valid replies.
"""

from __future__ import annotations

import torch

from fedpeft.federated.types import ClientResult, ClientTask, State


class RoundFailed(RuntimeError):
    """Too few valid client replies to aggregate this round."""



NON_FINITE = "NaN or Inf values"
"""The reason given for an update holding NaN or Inf (a client whose training diverged)."""

def expected_upload_shapes(task: ClientTask, global_state: State, trainable: list[str]) -> dict[str, torch.Size]:
    """Keys the client must send and their shapes (the payload's shape when it was sent sliced)."""
    keys = task.upload_keys if task.upload_keys is not None else task.train_keys
    keys = trainable if keys is None else sorted(keys)
    return {k: (task.payload[k] if k in task.payload else global_state[k]).shape for k in keys}


def check_update(result: ClientResult, expected: dict[str, torch.Size], message_bytes: int,
                 max_bytes: int | None) -> str | None:
    """The reason to reject ``result``, or None when it is well formed."""
    if result.num_samples <= 0:
        return f"sample count {result.num_samples} <= 0"
    if max_bytes is not None and message_bytes > max_bytes:
        return f"message of {message_bytes} bytes exceeds the limit of {max_bytes}"
    unknown = sorted(set(result.update) - set(expected))
    if unknown:
        return f"unknown keys {unknown[:3]}{' ...' if len(unknown) > 3 else ''}"
    missing = sorted(set(expected) - set(result.update))
    if missing:
        return f"missing keys {missing[:3]}{' ...' if len(missing) > 3 else ''}"
    for key, value in result.update.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return f"{key}: not a floating-point tensor"
        if value.shape != expected[key]:
            return f"{key}: shape {tuple(value.shape)}, expected {tuple(expected[key])}"
        if not torch.isfinite(value).all():
            return f"{key}: {NON_FINITE}"
    return None
