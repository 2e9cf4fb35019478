"""Fuzzing the inputs: random configs and random or damaged messages give clear errors only."""

from __future__ import annotations

import contextlib

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpeft.config import ConfigError, DirectionCodecConfig, build_config
from fedpeft.federated.codec import CodecError, build_codec

SECTIONS = ["task", "partition", "model", "adapter", "client", "strategy", "codec", "engine", "evaluation", "output"]
FIELDS = ["name", "r", "alpha", "lr", "kind", "num_clients", "density", "dtype", "rounds", "seed", "every",
          "optimizer", "clients_per_round", "fraction", "batch_size", "bogus"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True), st.text(max_size=8),
                   st.lists(st.integers(), max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from([*SECTIONS, "method", "rounds", "seed"]),
                       st.one_of(VALUES, st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4)), max_size=5))
def test_random_configs_validate_or_name_a_field(raw: dict) -> None:
    try:
        build_config(raw)
    except ConfigError as err:
        assert err.field and str(err).startswith(err.field)


def _message() -> bytes:
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3)}
    return build_codec(DirectionCodecConfig(), "up").encode(state)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_codec_errors(data: bytes) -> None:
    with contextlib.suppress(CodecError):  # any other exception fails the test
        build_codec(DirectionCodecConfig(), "up").decode(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.binary(min_size=1, max_size=8))
def test_truncated_or_damaged_messages(cut: int, noise: bytes) -> None:
    message = _message()
    codec = build_codec(DirectionCodecConfig(), "up")
    for damaged in (message[: cut % len(message)], message[:8] + noise + message[8 + len(noise):]):
        try:
            decoded = codec.decode(damaged)
        except CodecError:
            continue
        assert all(isinstance(v, torch.Tensor) for v in decoded.values())


def test_wrong_header_is_a_codec_error() -> None:
    other = build_codec(DirectionCodecConfig(dtype="fp16"), "up").encode({"w": torch.ones(2)})
    spoofed = other.replace(b'"codec":"dense"', b'"codec":"xense"')
    try:
        build_codec(DirectionCodecConfig(), "up").decode(spoofed)
    except CodecError as err:
        assert "xense" in str(err)
    else:
        raise AssertionError("a message from another codec was accepted")
