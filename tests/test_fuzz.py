"""Fuzzing the inputs: random configs, overrides, messages, replies and run directories give clear
errors only (ConfigError, CodecError, CheckpointError or a rejection reason), never another
exception or a hang."""

from __future__ import annotations

import contextlib
import json
import struct
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

import fedpeft.experiment  # noqa: F401  (registers every codec)
from fedpeft.config import ConfigError, DirectionCodecConfig, apply_overrides, build_config
from fedpeft.federated.codec import CODECS, CodecError, build_codec
from fedpeft.federated.types import ClientResult
from fedpeft.federated.validation import check_update
from fedpeft.metrics.recorder import CheckpointError, Recorder, resume_fingerprint

SECTIONS = ["task", "partition", "model", "adapter", "client", "strategy", "codec", "engine", "evaluation", "output",
            "network", "faults"]
FIELDS = ["name", "r", "alpha", "lr", "kind", "num_clients", "density", "dtype", "rounds", "seed", "every",
          "optimizer", "clients_per_round", "fraction", "batch_size", "bogus", "dp", "epsilon", "delta", "clip_norm",
          "timeout_seconds", "robust", "up_mbps"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True), st.text(max_size=8),
                   st.lists(st.integers(), max_size=3))
NESTED = st.recursive(VALUES, lambda inner: st.dictionaries(st.sampled_from(FIELDS), inner, max_size=3), max_leaves=6)
KINDS = sorted(CODECS)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from([*SECTIONS, "method", "rounds", "seed"]), NESTED, max_size=5))
def test_random_configs_validate_or_name_a_field(raw: dict) -> None:
    try:
        build_config(raw)
    except ConfigError as err:
        assert err.field and str(err).startswith(err.field)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from("abcdr=.:[]{}-, 0123456789'\"\\n"), max_size=24), max_size=4))
def test_random_overrides_validate_or_name_a_field(overrides: list[str]) -> None:
    try:
        build_config(apply_overrides({}, overrides))
    except ConfigError as err:
        assert err.field


def _codec(kind: str) -> object:
    return build_codec(DirectionCodecConfig(kind=kind, density=0.5 if kind == "topk" else 1.0), "up")


def _message(kind: str) -> bytes:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    w[1] = 0  # a zero row, so zero_slices compacts and topk has zeros to skip
    return _codec(kind).encode({"w": w, "b": torch.ones(3)})  # type: ignore[attr-defined]


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(KINDS), st.binary(max_size=512))
def test_random_bytes_are_codec_errors(kind: str, data: bytes) -> None:
    with contextlib.suppress(CodecError):  # any other exception fails the test
        _codec(kind).decode(data)  # type: ignore[attr-defined]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(KINDS), st.integers(0, 10_000), st.integers(0, 10_000), st.binary(min_size=1, max_size=8))
def test_truncated_or_damaged_messages(kind: str, cut: int, where: int, noise: bytes) -> None:
    message = _message(kind)
    at = where % len(message)
    for damaged in (message[: cut % len(message)], message[:at] + noise + message[at + len(noise):]):
        try:
            decoded = _codec(kind).decode(damaged)  # type: ignore[attr-defined]
        except CodecError:
            continue
        assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in decoded.values())


HEADER_VALUES = st.one_of(st.text(max_size=12), st.integers(-3, 2**40), st.lists(st.integers(-2, 9), max_size=3),
                          st.none(), st.sampled_from(["F32", "F16", "I64", "U8", "dense", "rows", "bitmask"]))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(KINDS), st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets"]), HEADER_VALUES),
       st.dictionaries(st.sampled_from(["dtype", "layout", "keys"]), st.one_of(st.text(max_size=30), st.just("[]"))),
       st.binary(max_size=64))
def test_wrong_headers_are_codec_errors(kind: str, entry: dict, meta: dict, body: bytes) -> None:
    """A well-framed message whose JSON header lies about tensors or codec metadata."""
    header = json.dumps({"w": entry, "__metadata__": {"codec": kind, **meta}}).encode()
    with contextlib.suppress(CodecError):
        _codec(kind).decode(struct.pack("<Q", len(header)) + header + body)  # type: ignore[attr-defined]


JSON = st.recursive(st.one_of(st.none(), st.integers(-2, 40), st.text(max_size=6), st.booleans()),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.sampled_from(["w", "b", "w::rows"]), inner, max_size=3)),
                    max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(KINDS), st.dictionaries(st.sampled_from(["dtype", "layout", "keys"]),
                                               st.one_of(st.text(max_size=12), JSON.map(json.dumps))))
def test_valid_tensors_with_lying_metadata(kind: str, meta: dict) -> None:
    """Real tensors under codec metadata that does not describe them."""
    tensors = safetensors_load(_message(kind))
    with contextlib.suppress(CodecError):
        _codec(kind).decode(safetensors_save(tensors, metadata={"codec": kind, **meta}))  # type: ignore[attr-defined]


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(KINDS), st.sampled_from(KINDS))
def test_messages_of_another_codec_are_rejected(sender: str, receiver: str) -> None:
    if sender == receiver:
        return
    try:
        _codec(receiver).decode(_message(sender))  # type: ignore[attr-defined]
    except CodecError as err:
        assert sender in str(err)
    else:
        raise AssertionError(f"a {sender} message was accepted by {receiver}")


TENSORS = st.builds(
    lambda shape, dtype, fill: torch.full(shape, fill).to(dtype),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.float16, torch.int64, torch.bool, torch.complex64]),
    st.sampled_from([0.0, 1.5, float("nan"), float("inf"), -1e30]),
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["w", "b", "x"]), st.one_of(TENSORS, st.integers(), st.text(max_size=3))),
       st.integers(-3, 5), st.one_of(st.none(), st.integers(0, 100)))
def test_random_replies_are_rejected_with_a_reason(update: dict, samples: int, limit: int | None) -> None:
    expected = {"w": torch.Size([2, 2]), "b": torch.Size([2])}
    reason = check_update(ClientResult(0, update, samples, 0.0), expected, 50, limit)  # type: ignore[arg-type]
    good = (samples > 0 and (limit is None or limit >= 50) and set(update) == set(expected)
            and all(isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == expected[k]
                    and bool(torch.isfinite(v).all()) for k, v in update.items()))
    assert (reason is None) == good, reason


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=256), st.text(max_size=200))
def test_damaged_run_directories_are_checkpoint_errors(checkpoint: bytes, metrics: str) -> None:
    cfg = build_config({})
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        (run_dir / "checkpoint.pt").write_bytes(checkpoint)
        (run_dir / "metrics.jsonl").write_text(metrics)
        with contextlib.suppress(CheckpointError):
            Recorder(run_dir).resume(cfg)
        # a well-formed checkpoint of this config, next to a damaged metrics file
        state = {"round": 1, "global_state": {}, "algorithm": {}, "totals": {}, "fingerprint": resume_fingerprint(cfg)}
        torch.save(state, run_dir / "checkpoint.pt")
        (run_dir / "metrics.jsonl").write_text(metrics)
        with contextlib.suppress(CheckpointError):
            Recorder(run_dir).resume(cfg)
