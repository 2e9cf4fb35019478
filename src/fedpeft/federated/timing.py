"""Bandwidth-aware time model: simulated round time from the real bytes and the measured compute.

A client's round is download, local training, upload, one after the other:

    t_i = (latency_i + 8 bytes_down_i / down_bps_i) + compute_scale * compute_i + (latency_i + 8 bytes_up_i / up_bps_i)

and a synchronous round lasts as long as its slowest client, ``max_i t_i``. The communication-only
time ``max_i (t_down_i + t_up_i)`` is what FLASC's Fig. 3 compares ("ideal noiseless channels where
communication time is the size of the update divided by a fixed bandwidth"). Bytes are the lengths
of the encoded messages; compute is the wall clock the client took here.

Links: ``constant`` gives every client the configured Mbps and latency. ``lognormal`` draws, per
(round, client), a bandwidth factor f ~ LogNormal(0, spread) that divides both bandwidths (a slow
client is slow both ways) and an independent latency factor ~ LogNormal(0, spread), from a
generator seeded by (run seed, "network", round, client), so draws survive resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedpeft.config import NetworkConfig
from fedpeft.seeding import rng_for


@dataclass(frozen=True)
class Link:
    """One client's link in one round."""

    down_mbps: float
    up_mbps: float
    latency_s: float


def transfer_seconds(num_bytes: int, mbps: float, latency_s: float = 0.0) -> float:
    """Seconds to move ``num_bytes`` over a ``mbps`` link (10^6 bits per second) after ``latency_s``."""
    if mbps <= 0:
        raise ValueError(f"bandwidth must be positive, got {mbps} Mbps")
    return latency_s + 8.0 * num_bytes / (mbps * 1e6)


def draw_link(cfg: NetworkConfig, seed: int, round_idx: int, client_id: int) -> Link:
    """The link of ``client_id`` in ``round_idx`` (deterministic for the run seed)."""
    latency = cfg.latency_ms / 1000.0
    if cfg.distribution == "constant":
        return Link(cfg.down_mbps, cfg.up_mbps, latency)
    rng = rng_for(seed, "network", round_idx, client_id)
    slow, lag = rng.lognormal(0.0, cfg.spread, size=2)
    return Link(cfg.down_mbps / slow, cfg.up_mbps / slow, latency * lag)


def client_seconds(link: Link, bytes_down: int, bytes_up: int, compute_seconds: float,
                   compute_scale: float = 1.0) -> dict[str, float]:
    """Download, compute and upload seconds of one client, and their sum."""
    down = transfer_seconds(bytes_down, link.down_mbps, link.latency_s)
    up = transfer_seconds(bytes_up, link.up_mbps, link.latency_s)
    compute = compute_seconds * compute_scale
    return {"down": down, "compute": compute, "up": up, "total": down + compute + up}


def client_round_seconds(cfg: NetworkConfig, seed: int, round_idx: int, client_id: int, bytes_down: int,
                         bytes_up: int, compute_seconds: float) -> dict[str, float]:
    """:func:`client_seconds` of ``client_id`` on its link of ``round_idx``."""
    return client_seconds(draw_link(cfg, seed, round_idx, client_id), bytes_down, bytes_up, compute_seconds,
                          cfg.compute_scale)


def simulate_round(cfg: NetworkConfig, seed: int, round_idx: int, clients: Sequence[int], bytes_down: Sequence[int],
                   bytes_up: Sequence[int], compute_seconds: Sequence[float]) -> dict[str, Any]:
    """Simulated seconds of one synchronous round (``simulated``: the slowest client's total;
    ``simulated_communication``: the slowest client's download + upload), as logged under ``time``."""
    per_client = [
        client_round_seconds(cfg, seed, round_idx, c, bd, bu, cs)
        for c, bd, bu, cs in zip(clients, bytes_down, bytes_up, compute_seconds, strict=True)
    ]
    if not per_client:
        return {"simulated": 0.0, "simulated_communication": 0.0}
    return {
        "simulated": max(t["total"] for t in per_client),
        "simulated_communication": max(t["down"] + t["up"] for t in per_client),
    }
