"""Codecs: turn a state dict into the bytes that cross the wire, and back.

Every byte count fedpeft reports is ``len()`` of what :meth:`Codec.encode` returned. The wire
format is safetensors (a JSON header with names, dtypes, shapes and our ``codec`` metadata,
then raw little-endian tensor data), so messages are self-describing and safe to parse.
Subclasses (sparse top-k, ...) register with :func:`register_codec`.
"""

from __future__ import annotations

import json
import struct
from typing import ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedpeft.config import ConfigError, DirectionCodecConfig
from fedpeft.federated.types import State

WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class CodecError(ValueError):
    """A message could not be decoded (truncated, corrupt, or from another codec)."""


class Codec:
    """Dense codec: every tensor sent in full, cast to the wire dtype; decoded back to fp32."""

    kind: ClassVar[str] = "dense"

    def __init__(self, cfg: DirectionCodecConfig, direction: str = "up") -> None:
        self.cfg = cfg
        self.direction = direction  # "down" or "up": lets a codec name its own config fields in errors
        self.wire_dtype = WIRE_DTYPES[cfg.dtype]

    def _metadata(self) -> dict[str, str]:
        return {"codec": self.kind, "dtype": self.cfg.dtype}

    def encode(self, state: State) -> bytes:
        tensors = {k: v.detach().to(self.wire_dtype).contiguous() for k, v in state.items()}
        return st_save(tensors, metadata=self._metadata())

    def decode(self, message: bytes) -> State:
        tensors = _load(message, self.kind)
        for key, value in tensors.items():
            check_dtype(key, value, self.wire_dtype)
        return {k: v.to(torch.float32) for k, v in tensors.items()}


def check_dtype(name: str, tensor: torch.Tensor, expected: torch.dtype) -> None:
    """A tensor of another dtype than the codec sends is a forged or corrupt message."""
    if tensor.dtype != expected:
        raise CodecError(f"tensor {name!r} has dtype {tensor.dtype}, the codec sends {expected}")


def read_metadata(message: bytes) -> dict[str, str]:
    """The metadata of a safetensors message (raises CodecError when the header is invalid)."""
    if len(message) < 8:
        raise CodecError(f"message of {len(message)} bytes is too short for a header")
    (size,) = struct.unpack("<Q", message[:8])
    if size > len(message) - 8:
        raise CodecError(f"header claims {size} bytes but the message has {len(message) - 8}")
    try:
        header = json.loads(message[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CodecError(f"header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise CodecError("header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise CodecError("metadata is not an object")
    return meta


def _load(message: bytes, expected_kind: str) -> dict[str, torch.Tensor]:
    meta = read_metadata(message)
    if meta.get("codec") != expected_kind:
        raise CodecError(f"message was encoded by codec {meta.get('codec')!r}, expected {expected_kind!r}")
    try:
        return st_load(message)
    except (SafetensorError, ValueError, RuntimeError) as err:
        raise CodecError(f"corrupt message: {err}") from err


CODECS: dict[str, type[Codec]] = {"dense": Codec}


def register_codec(cls: type[Codec]) -> type[Codec]:
    CODECS[cls.kind] = cls
    return cls


def build_codec(cfg: DirectionCodecConfig, direction: str) -> Codec:
    if cfg.kind not in CODECS:
        allowed = ", ".join(sorted(CODECS))
        raise ConfigError(f"codec.{direction}.kind", f"unknown codec {cfg.kind!r}; allowed: {allowed}")
    return CODECS[cfg.kind](cfg, direction)
