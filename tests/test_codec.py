"""Bytes are the length of real messages; messages round-trip; bad messages give clear errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fedpeft.config import ConfigError, DirectionCodecConfig, build_config
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.federated.codec import Codec, CodecError, build_codec, packed_with_dtype, schema_of
from tests.conftest import tiny_raw_config


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


# ----- packed wire format (codec.<direction>.pack) ------------------------------------------------
def packed(dtype: str = "fp32", schema: dict | None = None) -> Codec:
    return build_codec(DirectionCodecConfig(dtype=dtype, pack=True), "up",
                       schema_of(state()) if schema is None else schema)


@pytest.mark.parametrize("dtype,width", [("fp32", 4), ("fp16", 2), ("bf16", 2)])
def test_packed_roundtrip_is_exact_and_bytes_track_parameters(dtype: str, width: int) -> None:
    codec, plain = packed(dtype), build_codec(DirectionCodecConfig(dtype=dtype), "up")
    for keys in (["a.weight", "b.bias"], ["b.bias"], ["a.weight"], []):  # any subset, as FedTT+ sends
        subset = {k: state()[k] for k in keys}
        message = codec.encode(subset)
        assert len(message) == 17 + 1 + sum(v.numel() for v in subset.values()) * width  # header, bitmask, data
        decoded = codec.decode(message)
        expected = plain.decode(plain.encode(subset))  # the same values the safetensors codec delivers
        assert sorted(decoded) == sorted(subset)
        assert all(decoded[k].dtype == torch.float32 and torch.equal(decoded[k], expected[k]) for k in subset)


def test_packed_header_is_a_few_bytes_however_many_tensors() -> None:
    many = {f"layer.{i}.cores.{j}": torch.randn(5, 8, 5) for i in range(48) for j in range(6)}
    sizes = {pack: len(build_codec(DirectionCodecConfig(pack=pack), "up", schema_of(many)).encode(many))
             for pack in (False, True)}
    payload = 288 * 200 * 4
    assert sizes[True] == 17 + 36 + payload
    assert sizes[False] - payload > 20_000  # safetensors: a JSON entry per tensor


def forged(message: bytes, offset: int, value: int) -> bytes:
    return message[:offset] + bytes([value]) + message[offset + 1:]


@pytest.mark.parametrize("damage,reason", [
    (lambda m: m[:-1], "payload has"),
    (lambda m: m + b"\x00", "payload has"),
    (lambda m: m[:10], "too short"),
    (lambda m: b"FPK2" + m[4:], "magic"),
    (lambda m: forged(m, 4, 9), "dtype code"),
    (lambda m: forged(m, 4, 1), "dtype torch.float16"),  # an fp16 tag on an fp32 codec's message
    (lambda m: forged(m, 5, m[5] ^ 1), "another schema"),
    (lambda m: forged(m, 17, 0b11100000), "past the schema"),
    (lambda m: forged(m, 17, 0b01000000), "payload has"),  # drops a.weight: the lengths disagree
])
def test_malformed_packed_messages_are_rejected(damage: Callable[[bytes], bytes], reason: str) -> None:
    codec = packed()
    with pytest.raises(CodecError, match=reason):
        codec.decode(damage(codec.encode(state())))


def test_packed_codec_refuses_what_the_schema_does_not_hold() -> None:
    codec = packed()
    with pytest.raises(CodecError, match="not in the agreed schema"):
        codec.encode({**state(), "c.weight": torch.zeros(2)})
    with pytest.raises(CodecError, match="shape"):
        codec.encode({"a.weight": torch.zeros(4, 8)})
    other = packed(schema={"a.weight": (8, 4)})  # same key, another model: refused by the digest
    with pytest.raises(CodecError, match="another schema"):
        other.decode(codec.encode({"a.weight": state()["a.weight"]}))
    with pytest.raises(CodecError, match=r"dtype torch\.int64"):
        codec.decode(packed_with_dtype(codec.encode(state()), codec.schema, torch.int64))


def test_pack_is_a_dense_codec_option() -> None:
    with pytest.raises(ConfigError) as err:
        build_config({"codec": {"up": {"kind": "topk", "density": 0.1, "pack": True}}})
    assert err.value.field == "codec.up" and "pack" in str(err.value)


@pytest.mark.parametrize("kind,reason", [
    ("truncated", "payload has"), ("wrong_dtype", "has dtype torch.int64"), ("unknown_key", "not in the agreed schema"),
])
def test_packed_uploads_damaged_in_flight_are_rejected(toy_files: tuple[Path, Path], tmp_path: Path, kind: str,
                                                       reason: str, single_torch_thread: None) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=1, codec={"up": {"pack": True}},
                          strategy={"selection": "all", "clients_per_round": None},
                          task={"max_train_examples": 32, "max_eval_examples": 16},
                          faults=[{"kind": kind, "clients": [1]}])
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    failures = records[0]["failures"]
    assert [(f["client"], f["stage"]) for f in failures] == [(1, "rejected")]
    assert reason in failures[0]["reason"]
    assert records[0]["clients"] == [0, 2, 3]


@pytest.mark.parametrize("method", ["fedtt", "fedtt_plus"])
def test_packing_changes_bytes_not_results(toy_files: tuple[Path, Path], tmp_path: Path, method: str,
                                           single_torch_thread: None) -> None:
    train, eval_ = toy_files
    runs = {}
    for pack in (False, True):
        raw = tiny_raw_config(train, eval_, tmp_path / str(pack), method=method, rounds=2,
                              adapter={"kind": "tt", "bottleneck_size": 8, "tt_rank": 3, "tt_max_mode": 4},
                              task={"max_train_examples": 32, "max_eval_examples": 16},
                              codec={"up": {"pack": pack}, "down": {"pack": pack}})
        exp = prepare(build_config(raw))
        engine = LocalEngine(exp, tmp_path / str(pack))
        runs[pack] = (exp, engine.run(), engine.final_state)
    (exp, records, final), (_, plain_records, plain_final) = runs[True], runs[False]
    assert all(torch.equal(final[k], plain_final[k]) for k in plain_final)
    assert [r["client_losses"] for r in records] == [r["client_losses"] for r in plain_records]
    for record, plain in zip(records, plain_records, strict=True):
        for packed_bytes, plain_bytes in zip(record["bytes_up"], plain["bytes_up"], strict=True):
            assert packed_bytes < plain_bytes
    keys = len(exp.initial_state)
    up = exp.algorithm.round_keys(1) if method == "fedtt_plus" else exp.initial_state
    expected = 17 + -(-keys // 8) + 4 * sum(exp.initial_state[k].numel() for k in up)
    assert records[0]["bytes_up"][0] == expected
