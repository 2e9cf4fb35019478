"""The local engine: every client in one process, one frozen backbone, states swapped in and out.

Its transport runs the round's tasks one after the other through :func:`serve_task` in this
process; the round loop is the shared :class:`~fedpeft.engines.rounds.RoundEngine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from fedpeft.engines.protocol import ClientFailure, Outcome, WireTask, serve_task
from fedpeft.engines.rounds import ClientRun, RoundEngine, decode_reply, encode_task, evaluate_on_shards
from fedpeft.experiment import Experiment
from fedpeft.federated.types import ClientTask, State


class LocalTransport:
    """Runs each task in this process, in order."""

    def __init__(self, exp: Experiment) -> None:
        self.exp = exp

    def train(self, round_idx: int, tasks: Sequence[WireTask]) -> list[Outcome]:
        return [serve_task(self.exp, task) for task in tasks]

    def evaluate_clients(self, round_idx: int, state: State, clients: Sequence[int]) -> dict[int, dict[str, float]]:
        return evaluate_on_shards(self.exp, state, clients)

    def close(self) -> None:
        """Nothing to release."""


class LocalEngine(RoundEngine):
    """The round loop with the in-process transport (``engine.kind: local``)."""

    def __init__(self, exp: Experiment, run_dir: Path, console: Console | None = None) -> None:
        super().__init__(exp, run_dir, LocalTransport(exp), console)


def run_client(exp: Experiment, task: ClientTask, round_idx: int, count_flops: bool) -> ClientRun:
    """One task through both codecs and the client, outside a round (for tests and probes)."""
    wire = encode_task(exp, task, round_idx, count_flops)
    outcome = serve_task(exp, wire)
    if isinstance(outcome, ClientFailure):
        raise RuntimeError(f"client {outcome.client_id} {outcome.stage}: {outcome.reason}")
    return decode_reply(exp, wire, outcome)
