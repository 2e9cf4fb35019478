"""Codecs: turn a state dict into the bytes that cross the wire, and back.

Every byte count fedpeft reports is ``len()`` of what :meth:`Codec.encode` returned. The wire
format is safetensors (a JSON header with names, dtypes, shapes and our ``codec`` metadata,
then raw little-endian tensor data), so messages are self-describing and safe to parse.
Subclasses (sparse top-k, ...) register with :func:`register_codec`.

``codec.<direction>.pack: true`` (dense codec) sends instead one packed buffer behind a fixed
17-byte header and a presence bitmask (:func:`pack_state`): names and shapes are not sent, as both
sides know them from the config: the :data:`Schema` (the global state's keys, sorted, with their
shapes) that :func:`build_codec` is given. With ~290 small tensors (FedTT on MiniLM) the
safetensors header is ~35 KB of a message; packed, it is 17 + ceil(290 / 8) = 54 bytes, so the
bytes track the parameters. A packed message names the schema by an 8-byte digest; a message of
another schema, dtype or length is rejected like any corrupt message. Packing needs a method that
sends whole tensors of the global state; ``hetlora`` with tiers below its rank sends slices and
refuses ``pack`` at start-up.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from typing import ClassVar

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedpeft.config import ConfigError, DirectionCodecConfig
from fedpeft.federated.types import State

WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

Schema = dict[str, tuple[int, ...]]
"""The tensors both sides agree on, in wire order: key -> shape."""

PACK_MAGIC = b"FPK1"
PACK_HEADER = struct.Struct("<4sB8sI")  # magic, dtype code, schema digest, number of schema keys
PACK_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.int64)
"""Dtype codes of a packed message (int64 only ever arrives forged: the ``wrong_dtype`` fault)."""


class CodecError(ValueError):
    """A message could not be decoded (truncated, corrupt, or from another codec)."""


class Codec:
    """Dense codec: every tensor sent in full, cast to the wire dtype; decoded back to fp32."""

    kind: ClassVar[str] = "dense"
    has_options: ClassVar[bool] = False  # reads extra ``codec.<dir>.*`` fields (and validates them itself)
    reads_density: ClassVar[bool] = False  # sends only a ``codec.<dir>.density`` fraction of the entries

    def __init__(self, cfg: DirectionCodecConfig, direction: str = "up", schema: Schema | None = None) -> None:
        if cfg.model_extra and not self.has_options:
            raise ConfigError(f"codec.{direction}.{next(iter(cfg.model_extra))}",
                              f"unknown field; the {self.kind} codec reads only kind, dtype and pack")
        if cfg.density < 1 and not self.reads_density:  # it would send every entry the method gives it
            raise ConfigError(f"codec.{direction}.density", f"the {self.kind} codec sends every entry it is given, "
                              f"so density {cfg.density:g} would change nothing; density is topk's (kind: topk)")
        self.cfg = cfg
        self.direction = direction  # "down" or "up": lets a codec name its own config fields in errors
        self.wire_dtype = WIRE_DTYPES[cfg.dtype]
        self.schema = schema

    def _metadata(self) -> dict[str, str]:
        return {"codec": self.kind, "dtype": self.cfg.dtype}

    def _packed_schema(self) -> Schema | None:
        """The schema when this codec packs (``pack: true``), else None."""
        if not self.cfg.pack:
            return None
        if self.schema is None:
            raise ConfigError(f"codec.{self.direction}.pack", "a packed codec needs the agreed schema (build_codec's)")
        return self.schema

    def encode(self, state: State) -> bytes:
        schema = self._packed_schema()
        if schema is not None:
            return pack_state(state, schema, self.wire_dtype)
        tensors = {k: v.detach().to(self.wire_dtype).contiguous() for k, v in state.items()}
        return st_save(tensors, metadata=self._metadata())

    def decode(self, message: bytes) -> State:
        schema = self._packed_schema()
        if schema is not None:
            return unpack_state(message, schema, self.wire_dtype)
        tensors = _load(message, self.kind)
        for key, value in tensors.items():
            check_dtype(key, value, self.wire_dtype)
        return {k: v.to(torch.float32) for k, v in tensors.items()}


def schema_of(state: State) -> Schema:
    """The schema of ``state``: its keys, sorted, with their shapes."""
    return {key: tuple(state[key].shape) for key in sorted(state)}


def schema_digest(schema: Schema) -> bytes:
    """8 bytes that name a schema: a message packed under another one is refused, not misread."""
    text = json.dumps([[key, list(shape)] for key, shape in schema.items()], separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()[:8]


def pack_state(state: State, schema: Schema, dtype: torch.dtype) -> bytes:
    """``state`` (any subset of ``schema``, same shapes) as header + presence bitmask + one buffer.

    The buffer holds the present tensors in schema order, cast to ``dtype``, raw little-endian."""
    unknown = sorted(set(state) - set(schema))
    if unknown:
        raise CodecError(f"tensor {unknown[0]!r} is not in the agreed schema of {len(schema)} keys; a packed codec "
                         "sends only the global state's tensors")
    present = [key in state for key in schema]
    for key in state:
        if tuple(state[key].shape) != schema[key]:
            raise CodecError(f"tensor {key!r} has shape {tuple(state[key].shape)}, the schema says {schema[key]}")
    header = PACK_HEADER.pack(PACK_MAGIC, PACK_DTYPES.index(dtype), schema_digest(schema), len(schema))
    bitmask = np.packbits(np.asarray(present, dtype=bool)).tobytes()
    tensors = [state[key].detach().reshape(-1).to(dtype) for key in schema if key in state]
    payload = torch.cat(tensors).view(torch.uint8).numpy().tobytes() if tensors else b""
    return header + bitmask + payload


def read_packed_header(message: bytes, schema: Schema) -> tuple[torch.dtype, list[str], int]:
    """(dtype, present keys, payload offset) of a packed message, checked against ``schema``."""
    if len(message) < PACK_HEADER.size:
        raise CodecError(f"message of {len(message)} bytes is too short for a packed header")
    magic, code, digest, count = PACK_HEADER.unpack_from(message)
    if magic != PACK_MAGIC:
        raise CodecError("not a packed message (wrong magic bytes)")
    if code >= len(PACK_DTYPES):
        raise CodecError(f"unknown dtype code {code}")
    if count != len(schema) or digest != schema_digest(schema):
        raise CodecError(f"packed under another schema ({count} keys) than the agreed one ({len(schema)} keys)")
    offset = PACK_HEADER.size + math.ceil(count / 8)
    if len(message) < offset:
        raise CodecError("message ends inside its presence bitmask")
    bits = np.unpackbits(np.frombuffer(message, dtype=np.uint8, count=offset - PACK_HEADER.size,
                                       offset=PACK_HEADER.size))
    if bits[count:].any():
        raise CodecError("presence bitmask has bits set past the schema's keys")
    return PACK_DTYPES[code], [key for key, bit in zip(schema, bits[:count]) if bit], offset


def unpack_state(message: bytes, schema: Schema, expected: torch.dtype) -> State:
    """The fp32 state a :func:`pack_state` message holds; CodecError on any mismatch."""
    dtype, keys, offset = read_packed_header(message, schema)
    check_dtype("packed buffer", torch.empty(0, dtype=dtype), expected)
    sizes = [math.prod(schema[key]) for key in keys]
    width = torch.empty(0, dtype=dtype).element_size()
    if len(message) - offset != sum(sizes) * width:
        raise CodecError(f"packed payload has {len(message) - offset} bytes, its header announces "
                         f"{sum(sizes) * width}")
    if not keys:
        return {}
    flat = torch.frombuffer(bytearray(message[offset:]), dtype=torch.uint8).view(dtype).to(torch.float32)
    return {key: part.reshape(schema[key]) for key, part in zip(keys, torch.split(flat, sizes), strict=True)}


def packed_with_dtype(message: bytes, schema: Schema, dtype: torch.dtype) -> bytes:
    """A packed message re-sent with its values cast to ``dtype`` under the same header (a forged
    message: the ``wrong_dtype`` fault)."""
    wire, keys, _ = read_packed_header(message, schema)
    state = unpack_state(message, schema, wire)
    return pack_state({key: state[key] for key in keys}, schema, dtype)


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


def build_codec(cfg: DirectionCodecConfig, direction: str, schema: Schema | None = None) -> Codec:
    """The codec of one direction; ``schema`` (the global state's keys and shapes) is what a packed
    codec (``pack: true``) relies on both sides knowing."""
    if cfg.kind not in CODECS:
        allowed = ", ".join(sorted(CODECS))
        raise ConfigError(f"codec.{direction}.kind", f"unknown codec {cfg.kind!r}; allowed: {allowed}")
    codec = CODECS[cfg.kind](cfg, direction)
    codec.schema = schema
    return codec
