"""The bandwidth time model: exact seconds from bytes, seeded link draws, and the engine's records."""

from __future__ import annotations

import pytest

from fedpeft.config import ConfigError, NetworkConfig, build_config
from fedpeft.federated.timing import Link, client_seconds, draw_link, simulate_round, transfer_seconds


def test_transfer_seconds_is_latency_plus_bits_over_bandwidth() -> None:
    assert transfer_seconds(1_250_000, 10.0) == pytest.approx(1.0)  # 10 Mbit over 10 Mbps
    assert transfer_seconds(125_000, 1.0, latency_s=0.05) == pytest.approx(1.05)
    with pytest.raises(ValueError):
        transfer_seconds(1, 0.0)


def test_client_and_round_seconds_by_hand() -> None:
    link = Link(down_mbps=8.0, up_mbps=2.0, latency_s=0.01)
    t = client_seconds(link, bytes_down=1_000_000, bytes_up=250_000, compute_seconds=3.0, compute_scale=2.0)
    assert t == pytest.approx({"down": 1.01, "compute": 6.0, "up": 1.01, "total": 8.02})
    cfg = NetworkConfig(down_mbps=8.0, up_mbps=2.0, latency_ms=10.0, compute_scale=2.0)
    sim = simulate_round(cfg, 0, 1, [3, 7], [1_000_000, 1_000_000], [250_000, 500_000], [3.0, 0.5])
    # client 3: 1.01 + 6 + 1.01 = 8.02; client 7: 1.01 + 1 + 2.01 = 4.02 -> round = 8.02; comm = max(2.02, 3.02)
    assert sim == pytest.approx({"simulated": 8.02, "simulated_communication": 3.02})
    assert simulate_round(cfg, 0, 1, [], [], [], []) == {"simulated": 0.0, "simulated_communication": 0.0}


def test_sparse_upload_helps_most_when_upload_is_slow() -> None:
    dense, sparse = 600_000, 600_000 // 16

    def speedup(up_ratio: float) -> float:
        cfg = NetworkConfig(down_mbps=10.0, up_mbps=10.0 * up_ratio)
        full = simulate_round(cfg, 0, 1, [0], [dense], [dense], [0.0])["simulated_communication"]
        flasc = simulate_round(cfg, 0, 1, [0], [dense], [sparse], [0.0])["simulated_communication"]
        return full / flasc

    # same bytes down; the upload is 16x smaller: (1 + 1/r) / (1 + 1/(16 r)) with r the upload ratio
    assert speedup(1.0) == pytest.approx(2 / (1 + 1 / 16))
    assert speedup(1 / 16) == pytest.approx(17 / 2)


def test_lognormal_links_are_seeded_per_round_and_client() -> None:
    cfg = NetworkConfig(down_mbps=10.0, up_mbps=1.0, latency_ms=50.0, distribution="lognormal", spread=0.5)
    a = draw_link(cfg, 0, 3, 5)
    assert a == draw_link(cfg, 0, 3, 5)
    assert a != draw_link(cfg, 0, 3, 6) and a != draw_link(cfg, 0, 4, 5) and a != draw_link(cfg, 1, 3, 5)
    assert a.down_mbps / a.up_mbps == pytest.approx(10.0)  # one factor slows both directions
    draws = [draw_link(cfg, 0, 1, c).down_mbps for c in range(400)]
    assert min(draws) < 10.0 < max(draws)
    assert draw_link(NetworkConfig(), 0, 1, 0) == Link(10.0, 1.0, 0.0)


def test_bad_network_values_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"network\.up_mbps"):
        build_config({"network": {"up_mbps": 0}})
    with pytest.raises(ConfigError, match=r"network\.distribution"):
        build_config({"network": {"distribution": "pareto"}})
