"""Bytes are the length of real messages; messages round-trip; bad messages give clear errors."""

from __future__ import annotations

import pytest
import torch

from fedpeft.config import ConfigError, DirectionCodecConfig
from fedpeft.federated.codec import CodecError, build_codec


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(8, 4, generator=g), "b.bias": torch.randn(3, generator=g)}


def test_dense_fp32_roundtrip_exact() -> None:
    codec = build_codec(DirectionCodecConfig(), "up")
    message = codec.encode(state())
    decoded = codec.decode(message)
    assert all(torch.equal(decoded[k], v) for k, v in state().items())
    assert isinstance(message, bytes)


@pytest.mark.parametrize("dtype,width", [("fp32", 4), ("fp16", 2), ("bf16", 2)])
def test_bytes_are_header_plus_payload(dtype: str, width: int) -> None:
    codec = build_codec(DirectionCodecConfig(dtype=dtype), "down")
    message = codec.encode(state())
    header = int.from_bytes(message[:8], "little")
    assert len(message) == 8 + header + (32 + 3) * width


def test_half_precision_rounds_like_torch() -> None:
    codec = build_codec(DirectionCodecConfig(dtype="fp16"), "up")
    decoded = codec.decode(codec.encode(state()))
    assert torch.equal(decoded["a.weight"], state()["a.weight"].half().float())


@pytest.mark.parametrize("message", [b"", b"\x00" * 7, b"\xff" * 64, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}xx"])
def test_garbage_is_a_codec_error(message: bytes) -> None:
    with pytest.raises(CodecError):
        build_codec(DirectionCodecConfig(), "up").decode(message)


def test_truncated_message_is_a_codec_error() -> None:
    codec = build_codec(DirectionCodecConfig(), "up")
    with pytest.raises(CodecError):
        codec.decode(codec.encode(state())[:-5])


def test_unknown_codec_names_field() -> None:
    with pytest.raises(ConfigError, match=r"codec.up.kind"):
        build_codec(DirectionCodecConfig(kind="zip"), "up")
