"""The engine protocol: what crosses between the server's round loop and the clients.

Every engine runs the same round loop (:class:`fedpeft.engines.rounds.RoundEngine`): the method
selects and configures clients, each :class:`ClientTask` becomes a :class:`WireTask` whose payload
is the down codec's message (the bytes that are counted, and in the Flower engine the bytes that
are actually sent), a :class:`Transport` delivers the wire tasks to wherever the clients run and
brings back, in task order, a :class:`WireReply` (the update as the up codec's message, plus
statistics) or a :class:`ClientFailure`. Engines differ only in the transport.

:func:`serve_task` is the client side, the same function in every engine: decode the payload,
train with the method's ``client_update``, encode the update. A method never learns which
engine runs it. What a client's device keeps between its rounds (:func:`device_state`: the
method's device state and, with ``client.dp``, its DP-SGD accountant) is moved with the client
or kept on its device by the engine; the server never needs it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fedpeft.federated.codec import CodecError
from fedpeft.federated.faults import MESSAGE_FAULTS, UPDATE_FAULTS, ClientCrashed, active_faults, corrupt, damage
from fedpeft.federated.types import ClientTask, State
from fedpeft.seeding import derive_seed

if TYPE_CHECKING:
    from fedpeft.experiment import Experiment


@dataclass
class WireTask:
    """A :class:`ClientTask` as it travels: the payload is the down codec's message."""

    client_id: int
    round_idx: int
    message: bytes
    train_keys: list[str] | None = None
    upload_keys: list[str] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    count_flops: bool = False


@dataclass
class WireReply:
    """A client's reply as it travels: the update is the up codec's message."""

    client_id: int
    message: bytes
    num_samples: int
    train_loss: float
    metrics: dict[str, float]
    codec_seconds: float
    compute_seconds: float
    step_seconds: float
    flops_per_step: int | None


@dataclass
class ClientFailure:
    """A client that produced no usable reply, and why (logged in the round's ``failures``).

    ``stage``: ``dropout`` (vanished), ``raised`` (the client failed), ``rejected`` (the server
    refused the reply), ``timeout`` (no reply within ``client.timeout_seconds``), ``unreachable``
    (the transport got no reply: dead node, ``engine.round_timeout``).
    """

    client_id: int
    stage: str
    reason: str

    def record(self) -> dict[str, Any]:
        return {"client": self.client_id, "stage": self.stage, "reason": self.reason}


Outcome = WireReply | ClientFailure


class Transport(Protocol):
    """How an engine executes client tasks; everything else is the shared round loop."""

    def train(self, round_idx: int, tasks: Sequence[WireTask]) -> list[Outcome]:
        """Run every task; one outcome per task, in task order (aggregation order is fixed)."""
        ...

    def evaluate_clients(self, round_idx: int, state: State, clients: Sequence[int]) -> dict[int, dict[str, float]]:
        """The metrics of ``state`` on each client's own shard (``evaluation.per_client``)."""
        ...

    def close(self) -> None:
        """Release workers and connections at the end of the run."""
        ...


def to_client_task(exp: Experiment, wire: WireTask) -> ClientTask:
    """Decode the payload back into the task the method configured."""
    return ClientTask(
        client_id=wire.client_id,
        payload=exp.down_codec.decode(wire.message),
        train_keys=None if wire.train_keys is None else frozenset(wire.train_keys),
        upload_keys=None if wire.upload_keys is None else frozenset(wire.upload_keys),
        config=dict(wire.config),
    )


METHOD_PREFIX = "method."
PRIVACY_PREFIX = "privacy."


def device_state(exp: Experiment, client_id: int) -> State | None:
    """Everything the device of ``client_id`` keeps between its rounds (None: nothing yet): the
    method's :meth:`~fedpeft.federated.algorithm.Algorithm.device_state` and, with ``client.dp``,
    its DP-SGD accountant, under the prefixes :data:`METHOD_PREFIX` and :data:`PRIVACY_PREFIX`."""
    parts = [(METHOD_PREFIX, exp.algorithm.device_state(client_id))]
    if exp.privacy is not None:
        parts.append((PRIVACY_PREFIX, exp.privacy.device_state(client_id)))
    state = {prefix + key: value for prefix, part in parts if part is not None for key, value in part.items()}
    return state or None


def load_device_state(exp: Experiment, client_id: int, state: State | None) -> None:
    """Restore what :func:`device_state` returned for ``client_id`` (None: forget it on this process)."""

    def part(prefix: str) -> State | None:
        own = {k.removeprefix(prefix): v for k, v in (state or {}).items() if k.startswith(prefix)}
        return own or None

    exp.algorithm.load_device_state(client_id, part(METHOD_PREFIX))
    if exp.privacy is not None:
        exp.privacy.load_device_state(client_id, part(PRIVACY_PREFIX))


def serve_task(exp: Experiment, wire: WireTask) -> Outcome:
    """The client side of one task: decode, train with the method's hook, encode the update.

    Keys the payload leaves out start from the initial state, so a client's start depends only
    on what it received (not on which client used the model before it). With ``client.dp`` the
    client trains with DP-SGD under its own accountant (this process's ledger holds it, see
    :func:`device_state`) and reports what it has spent in its reply's metrics. Injected faults
    (``faults`` in the config; simulation and tests) crash, drop, delay or corrupt the client or
    its message here, so they behave the same in every engine. A failing client returns a
    :class:`ClientFailure` instead of taking the round down.
    """
    cid = wire.client_id
    faults = active_faults(exp.cfg.faults, exp.cfg.seed, wire.round_idx, cid)
    if any(f.kind == "dropout" for f in faults):
        return ClientFailure(cid, "dropout", "dropped out")
    if any(f.kind == "timeout" for f in faults):
        return ClientFailure(cid, "timeout", "no reply before the deadline of client.timeout_seconds = "
                                             f"{exp.cfg.client.timeout_seconds} s")
    try:
        if any(f.kind == "raise" for f in faults):
            raise ClientCrashed(f"injected failure of client {cid}")
        t0 = time.perf_counter()
        task = to_client_task(exp, wire)
        codec_seconds = time.perf_counter() - t0
        if exp.privacy is not None:
            task.privacy = exp.privacy.client(cid)
        missing = [k for k in exp.slot.trainable if k not in task.payload]
        if missing:
            exp.slot.load({k: exp.initial_state[k] for k in missing})
        seed = derive_seed(exp.cfg.seed, "client", wire.round_idx, cid)
        result, stats = exp.algorithm.client_update(exp.slot, exp.train_data, exp.train_rows[cid], task, seed,
                                                    wire.count_flops)
        # the codec encodes CPU tensors, whatever device computed them (a method's extra probes included)
        result.update = {key: value.cpu() for key, value in result.update.items()}
        if exp.privacy is not None:
            result.metrics.update(exp.privacy.report(cid))
        for fault in faults:
            if fault.kind in UPDATE_FAULTS:
                result = corrupt(result, fault.kind)
            elif fault.kind == "straggler":
                stats.total_seconds *= fault.slowdown
        t0 = time.perf_counter()
        message = exp.up_codec.encode(result.update)
        codec_seconds += time.perf_counter() - t0
        for fault in faults:
            if fault.kind in MESSAGE_FAULTS:
                message = damage(message, fault.kind, exp.up_codec.schema)
    except CodecError as err:
        return ClientFailure(cid, "rejected", f"undecodable message: {err}")
    except Exception as err:  # a failing client must not take the round down
        return ClientFailure(cid, "raised", f"{type(err).__name__}: {err}")
    return WireReply(client_id=cid, message=message, num_samples=result.num_samples, train_loss=result.train_loss,
                     metrics=dict(result.metrics), codec_seconds=codec_seconds, compute_seconds=stats.total_seconds,
                     step_seconds=stats.step_seconds, flops_per_step=stats.flops_per_step)
