"""The Flower engine: the shared round loop as a Flower ServerApp, the client side as a ClientApp.

Message API (flwr >= 1.41): the ServerApp (:data:`server_app`) runs
:class:`~fedpeft.engines.rounds.RoundEngine` with :class:`FlowerTransport`, which turns a round's
wire tasks into one ``train`` message per SuperNode and its replies back into outcomes;
per-client evaluation uses ``evaluate`` messages; a ``query`` message asks each SuperNode which
clients it hosts. Payloads and updates cross the wire as our codec's bytes, one
:class:`~flwr.app.Array` (``stype`` :data:`CODEC_STYPE`) per message inside an ``ArrayRecord``, so
sparse and partial payloads stay as small on the real wire as in the recorded byte counts; task
and reply fields travel in ``ConfigRecord``.

Both apps read the experiment from the run config (``experiment``: the YAML text, written by
``fedpeft deploy app``), so every machine runs the same config. A SuperNode started with
``--node-config "partition-id=i num-partitions=N"`` hosts the clients ``c`` with ``c mod N == i``
(one client per node when N equals ``partition.num_clients``); an optional ``data-dir`` node
config points at its copy of the data, an optional ``device`` (``cuda:1``, ``cpu``, ...) at the
node's own ``engine.device``. The ServerApp writes metrics and checkpoints to
``run-dir`` on the SuperLink's machine and evaluates the global model on the eval split there.

A node that dies or times out (``engine.round_timeout``) costs the round its clients (logged as
``unreachable`` in the round's ``failures``); the round goes on when ``strategy.min_clients``
valid replies remain. ``client.timeout_seconds`` is the real reply deadline here: a node's reply
to k tasks must arrive within k x ``client.timeout_seconds`` (its clients train one after
another), else its clients are logged as ``timeout``; as in every engine, a reply that arrived
but whose simulated round time exceeds the deadline is dropped too. Nodes that join later are
asked for their partition at the next round.

A client's device-side state (:func:`~fedpeft.engines.protocol.device_state`: the method's, and
its DP-SGD accountant under ``client.dp``) stays on its SuperNode, in the node's per-run Flower
context state, and never reaches the server; the DP report travels in the reply's metrics. That
state lasts as long as the Flower run: a resumed run (a new Flower run) starts it afresh.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp
from rich.console import Console

from fedpeft.config import ConfigError, DirectionCodecConfig, ExperimentConfig, apply_overrides, build_config
from fedpeft.engines.protocol import (
    ClientFailure,
    Outcome,
    WireReply,
    WireTask,
    device_state,
    load_device_state,
    serve_task,
)
from fedpeft.federated.codec import Codec
from fedpeft.federated.types import State

if TYPE_CHECKING:  # models and data load only where a handler trains or evaluates: a query stays light
    from fedpeft.experiment import Experiment

CODEC_STYPE = "fedpeft.codec"
POLL_SECONDS = 0.2
UNREACHABLE_CODES = (ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE)
DEVICE_STATE_PREFIX = "fedpeft.device."

server_app = ServerApp()
client_app = ClientApp()


# ----------------------------------------------------------------------------------------------
# Run and node configuration


@dataclass
class RunSettings:
    """What ``flwr run`` passes both apps (``[tool.flwr.app.config]`` of the generated app)."""

    experiment_yaml: str
    run_dir: Path | None
    resume: bool
    data_dir: str | None

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> RunSettings:
        if not run_config.get("experiment"):
            raise ConfigError("experiment", "the Flower run config has no experiment; build the app with "
                                            "`fedpeft deploy app CONFIG --out DIR`")
        run_dir = str(run_config.get("run-dir", ""))
        return cls(experiment_yaml=str(run_config["experiment"]), run_dir=Path(run_dir) if run_dir else None,
                   resume=bool(run_config.get("resume", False)), data_dir=str(run_config.get("data-dir", "")) or None)

    def config(self) -> ExperimentConfig:
        return build_config(yaml.safe_load(self.experiment_yaml))


@dataclass
class NodePartition:
    """The clients a SuperNode hosts, from its ``--node-config``."""

    partition_id: int
    num_partitions: int
    clients: list[int]

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any], cfg: ExperimentConfig) -> NodePartition:
        try:
            partition_id, num_partitions = int(node_config["partition-id"]), int(node_config["num-partitions"])
        except (KeyError, ValueError, TypeError):
            raise ConfigError("--node-config", "start the SuperNode with --node-config "
                                               "\"partition-id=I num-partitions=N\" (integers)") from None
        num_clients = cfg.partition.num_clients
        if not 0 < num_partitions <= num_clients:
            raise ConfigError("--node-config", f"num-partitions={num_partitions} must be in 1..partition.num_clients "
                                               f"({num_clients})")
        if not 0 <= partition_id < num_partitions:
            raise ConfigError("--node-config", f"partition-id={partition_id} must be in 0..{num_partitions - 1}")
        return cls(partition_id, num_partitions, [c for c in range(num_clients) if c % num_partitions == partition_id])

    def record(self) -> ConfigRecord:
        return ConfigRecord({"partition-id": self.partition_id, "num-partitions": self.num_partitions,
                             "clients": list(self.clients)})

    @classmethod
    def from_record(cls, record: ConfigRecord) -> NodePartition:
        return cls(int(record["partition-id"]), int(record["num-partitions"]), [int(c) for c in record["clients"]])


# ----------------------------------------------------------------------------------------------
# Records: wire tasks and replies as Flower records


def bytes_record(message: bytes) -> ArrayRecord:
    """Codec bytes as one uint8 Array: exactly the codec's message on the wire, plus Flower's framing."""
    return ArrayRecord({"message": Array(dtype="uint8", shape=(len(message),), stype=CODEC_STYPE, data=message)})


def record_bytes(record: ArrayRecord) -> bytes:
    array = record["message"]
    if array.stype != CODEC_STYPE:
        raise ValueError(f"expected a {CODEC_STYPE} array, got {array.stype!r}")
    return bytes(array.data)


def put_task(content: RecordDict, index: int, wire: WireTask) -> None:
    fields: dict[str, Any] = {"client-id": wire.client_id, "round": wire.round_idx, "count-flops": wire.count_flops,
                              "config": json.dumps(wire.config, sort_keys=True)}
    if wire.train_keys is not None:
        fields["train-keys"] = list(wire.train_keys)
    if wire.upload_keys is not None:
        fields["upload-keys"] = list(wire.upload_keys)
    content[f"task.{index}"] = ConfigRecord(fields)
    content[f"payload.{index}"] = bytes_record(wire.message)


def get_tasks(content: RecordDict) -> list[WireTask]:
    tasks = []
    for index in range(len(content.config_records)):
        fields = content.config_records[f"task.{index}"]
        tasks.append(WireTask(
            client_id=int(fields["client-id"]), round_idx=int(fields["round"]),
            message=record_bytes(content.array_records[f"payload.{index}"]),
            train_keys=[str(k) for k in fields["train-keys"]] if "train-keys" in fields else None,
            upload_keys=[str(k) for k in fields["upload-keys"]] if "upload-keys" in fields else None,
            config=json.loads(str(fields["config"])), count_flops=bool(fields["count-flops"]),
        ))
    return tasks


def put_outcome(content: RecordDict, index: int, outcome: Outcome) -> None:
    if isinstance(outcome, ClientFailure):
        content[f"reply.{index}"] = ConfigRecord({"client-id": outcome.client_id, "ok": False,
                                                  "stage": outcome.stage, "reason": outcome.reason})
        return
    fields: dict[str, Any] = {
        "client-id": outcome.client_id, "ok": True, "num-samples": outcome.num_samples,
        "train-loss": float(outcome.train_loss), "metrics": json.dumps(outcome.metrics, sort_keys=True),
        "codec-seconds": outcome.codec_seconds, "compute-seconds": outcome.compute_seconds,
        "step-seconds": outcome.step_seconds,
    }
    if outcome.flops_per_step is not None:
        fields["flops-per-step"] = int(outcome.flops_per_step)
    content[f"reply.{index}"] = ConfigRecord(fields)
    content[f"update.{index}"] = bytes_record(outcome.message)


def get_outcomes(content: RecordDict) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for index in range(len(content.config_records)):
        fields = content.config_records[f"reply.{index}"]
        cid = int(fields["client-id"])
        if not fields["ok"]:
            outcomes.append(ClientFailure(cid, str(fields["stage"]), str(fields["reason"])))
            continue
        outcomes.append(WireReply(
            client_id=cid, message=record_bytes(content.array_records[f"update.{index}"]),
            num_samples=int(fields["num-samples"]), train_loss=float(fields["train-loss"]),
            metrics={k: float(v) for k, v in json.loads(str(fields["metrics"])).items()},
            codec_seconds=float(fields["codec-seconds"]), compute_seconds=float(fields["compute-seconds"]),
            step_seconds=float(fields["step-seconds"]),
            flops_per_step=int(fields["flops-per-step"]) if "flops-per-step" in fields else None,
        ))
    return outcomes


def lossless_codec() -> Codec:
    """Dense fp32: how the global state travels for per-client evaluation (not a training payload)."""
    return Codec(DirectionCodecConfig(), "down")


# ----------------------------------------------------------------------------------------------
# Server side


class FlowerTransport:
    """Delivers a round's tasks as one ``train`` message per SuperNode and collects the replies."""

    def __init__(self, grid: Grid, cfg: ExperimentConfig, console: Console) -> None:
        self.grid = grid
        self.cfg = cfg
        self.console = console
        self.nodes: dict[int, NodePartition] = {}  # node id -> what it hosts
        self.ignored: set[int] = set()  # replaced by a restarted node, or silent when asked: never asked again
        self.num_partitions: int | None = None

    # -- membership ----------------------------------------------------------------------------
    def _query(self, node_ids: Iterable[int], timeout: float) -> None:
        messages = [Message(RecordDict({}), dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids]
        for node, reply in self._exchange(messages, timeout).items():
            if reply is None:
                self.ignored.add(node)
                continue
            if reply.has_error():
                raise ConfigError("--node-config", f"SuperNode {node} could not describe itself: {reply.error.reason}")
            part = NodePartition.from_record(reply.content.config_records["node"])
            if self.num_partitions is not None and part.num_partitions != self.num_partitions:
                raise ConfigError("--node-config", f"SuperNode {node} says num-partitions={part.num_partitions}, "
                                                   f"others {self.num_partitions}")
            self.num_partitions = part.num_partitions
            for other, known in list(self.nodes.items()):
                if known.partition_id == part.partition_id:  # a restarted node replaces its old self
                    del self.nodes[other]
                    self.ignored.add(other)
            self.nodes[node] = part

    def refresh(self, timeout: float) -> None:
        """Forget nodes the SuperLink no longer lists; ask new ones which partition they host."""
        online = set(self.grid.get_node_ids())
        for node in [n for n in self.nodes if n not in online]:
            del self.nodes[node]
        new = sorted(online - set(self.nodes) - self.ignored)
        if new:
            self._query(new, timeout)

    def missing_partitions(self) -> list[int]:
        if self.num_partitions is None:
            return []
        hosted = {p.partition_id for p in self.nodes.values()}
        return [p for p in range(self.num_partitions) if p not in hosted]

    def connect(self) -> None:
        """Wait (``engine.connect_timeout``) until a SuperNode serves every partition."""
        deadline = time.monotonic() + self.cfg.engine.connect_timeout
        while True:
            self.refresh(max(deadline - time.monotonic(), 1.0))
            if self.num_partitions is not None and not self.missing_partitions():
                break
            if time.monotonic() > deadline:
                missing = self.missing_partitions() if self.num_partitions else "all"
                raise ConfigError("engine.connect_timeout", f"no SuperNode for partitions {missing} after "
                                                            f"{self.cfg.engine.connect_timeout:g} s")
            time.sleep(0.5)
        self.console.print(f"{len(self.nodes)} SuperNodes serve {self.num_partitions} partitions")

    def node_of(self, client: int) -> int | None:
        if self.num_partitions is None:
            return None
        return next((n for n, p in self.nodes.items() if p.partition_id == client % self.num_partitions), None)

    # -- messaging -----------------------------------------------------------------------------
    def _exchange(self, messages: Sequence[Message], timeout: float | Sequence[float | None] | None
                  ) -> dict[int, Message | None]:
        """Push ``messages`` and pull replies until all arrived or their ``timeout`` passed (one for all,
        or one per message; None: no limit); by destination node."""
        if not messages:
            return {}
        timeouts = list(timeout) if isinstance(timeout, Sequence) else [timeout] * len(messages)
        start = time.monotonic()
        ids = list(self.grid.push_messages(messages))
        node_of_id = {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages)}
        deadline_of_id = {mid: None if t is None else start + t for mid, t in zip(ids, timeouts)}
        replies: dict[int, Message | None] = {node: None for node in node_of_id.values()}
        pending = set(ids)
        while pending:
            for reply in self.grid.pull_messages(sorted(pending)):
                mid = reply.metadata.reply_to_message_id
                if mid in pending:
                    pending.discard(mid)
                    replies[node_of_id[mid]] = reply
            now = time.monotonic()
            pending = {mid for mid in pending if deadline_of_id[mid] is None or now < deadline_of_id[mid]}
            if pending:
                time.sleep(POLL_SECONDS)
        return replies

    def _message(self, content: RecordDict, node: int, kind: str, round_idx: int,
                 timeout: float | None = None) -> Message:
        """A message that expires after ``timeout`` seconds (default ``engine.round_timeout``; None: never)."""
        timeout = self.cfg.engine.round_timeout if timeout is None else timeout
        return Message(content, dst_node_id=node, message_type=kind, group_id=str(round_idx),
                       ttl=None if timeout is None else timeout)

    def reply_timeout(self, num_tasks: int) -> tuple[float | None, bool]:
        """How long to wait for a node's reply to ``num_tasks`` tasks, and whether that is the clients'
        deadline: ``client.timeout_seconds`` per task (a node serves its clients one after another;
        with one client per node it is the client's own reply deadline), at most ``engine.round_timeout``."""
        round_timeout = self.cfg.engine.round_timeout
        if self.cfg.client.timeout_seconds is None:
            return round_timeout, False
        deadline = self.cfg.client.timeout_seconds * num_tasks
        if round_timeout is not None and round_timeout < deadline:
            return round_timeout, False
        return deadline, True

    def _by_node(self, clients: Sequence[int]) -> tuple[dict[int, list[int]], list[int]]:
        """Positions of ``clients`` grouped by the node hosting them, and the positions no node hosts."""
        groups: dict[int, list[int]] = {}
        orphans = []
        for position, client in enumerate(clients):
            node = self.node_of(client)
            if node is None:
                orphans.append(position)
            else:
                groups.setdefault(node, []).append(position)
        return groups, orphans

    def train(self, round_idx: int, tasks: Sequence[WireTask]) -> list[Outcome]:
        self.refresh(self.cfg.engine.connect_timeout)
        groups, orphans = self._by_node([t.client_id for t in tasks])
        outcomes: list[Outcome | None] = [None] * len(tasks)
        for position in orphans:
            cid = tasks[position].client_id
            outcomes[position] = ClientFailure(cid, "unreachable", f"no SuperNode serves client {cid}'s partition")
        messages = []
        timeouts = []
        for node, positions in groups.items():
            content = RecordDict({})
            for index, position in enumerate(positions):
                put_task(content, index, tasks[position])
            timeout, _ = self.reply_timeout(len(positions))
            messages.append(self._message(content, node, MessageType.TRAIN, round_idx, timeout))
            timeouts.append(timeout)
        replies = self._exchange(messages, timeouts)
        for node, positions in groups.items():
            for position, outcome in zip(positions, self._node_outcomes(node, replies.get(node), tasks, positions)):
                outcomes[position] = outcome
        return [o for o in outcomes if o is not None]

    def _node_outcomes(self, node: int, reply: Message | None, tasks: Sequence[WireTask], positions: list[int]
                       ) -> list[Outcome]:
        """One node's reply split into its tasks' outcomes (all failures when it sent none or an error)."""
        clients = [tasks[p].client_id for p in positions]
        if reply is None:
            timeout, client_deadline = self.reply_timeout(len(positions))
            if client_deadline:
                reason = (f"no reply from SuperNode {node} within client.timeout_seconds = "
                          f"{self.cfg.client.timeout_seconds:g} s per client ({len(clients)} clients: {timeout:g} s)")
                return [ClientFailure(c, "timeout", reason) for c in clients]
            reason = f"no reply from SuperNode {node} within engine.round_timeout={self.cfg.engine.round_timeout:g} s"
            return [ClientFailure(c, "unreachable", reason) for c in clients]
        if reply.has_error():
            stage = "unreachable" if reply.error.code in UNREACHABLE_CODES else "raised"
            return [ClientFailure(c, stage, f"SuperNode {node}: {reply.error.reason}") for c in clients]
        outcomes = get_outcomes(reply.content)
        if [o.client_id for o in outcomes] != clients:
            reason = f"SuperNode {node} replied for clients {[o.client_id for o in outcomes]}, asked {clients}"
            return [ClientFailure(c, "rejected", reason) for c in clients]
        return outcomes

    def evaluate_clients(self, round_idx: int, state: State, clients: Sequence[int]) -> dict[int, dict[str, float]]:
        """``evaluate`` messages: each node scores the global state on its clients' own shards."""
        groups, _ = self._by_node(clients)
        payload = bytes_record(lossless_codec().encode(state))
        messages = [self._message(RecordDict({"state": payload, "clients": ConfigRecord(
            {"clients": [int(clients[p]) for p in positions]})}), node, MessageType.EVALUATE, round_idx)
            for node, positions in groups.items()]
        measured: dict[int, dict[str, float]] = {}
        for node, reply in self._exchange(messages, self.cfg.engine.round_timeout).items():
            if reply is None or reply.has_error():
                self.console.print(f"[yellow]SuperNode {node} did not evaluate round {round_idx}[/]")
                continue
            for name, record in reply.content.metric_records.items():
                measured[int(name.removeprefix("client."))] = {k: float(v) for k, v in record.items()}
        return measured

    def close(self) -> None:
        """Nothing to release: the SuperLink ends the run when the ServerApp returns."""


@server_app.main()
def serve(grid: Grid, context: Context) -> None:
    """The ServerApp: the shared round loop over the SuperNodes that serve the run's partitions."""
    from fedpeft.engines import run_and_report
    from fedpeft.engines.rounds import RoundEngine
    from fedpeft.experiment import default_run_dir, prepare

    settings = RunSettings.from_run_config(dict(context.run_config))
    console = Console(width=160)
    cfg = settings.config()
    exp = prepare(cfg, settings.data_dir)
    transport = FlowerTransport(grid, cfg, console)
    transport.connect()
    run_dir = settings.run_dir or default_run_dir(cfg)
    run_and_report(RoundEngine(exp, run_dir, transport, console), console, settings.resume)


# ----------------------------------------------------------------------------------------------
# Client side


@functools.lru_cache(maxsize=1)
def prepared(experiment_yaml: str, data_dir: str | None, device: str | None = None) -> Experiment:
    """The node's experiment, on the node's own ``device`` when its node config names one (else the
    run's ``engine.device``); kept while the process lives (Flower's simulation reuses its workers)."""
    from fedpeft.experiment import prepare

    raw = yaml.safe_load(experiment_yaml)
    if device:
        raw = apply_overrides(raw, [f"engine.device={device}"])
    return prepare(build_config(raw), data_dir)


def node_experiment(context: Context) -> tuple[Experiment, NodePartition]:
    settings = RunSettings.from_run_config(dict(context.run_config))
    node_config = dict(context.node_config)
    data_dir = str(node_config.get("data-dir", "")) or settings.data_dir
    exp = prepared(settings.experiment_yaml, data_dir, str(node_config.get("device", "")) or None)
    return exp, NodePartition.from_node_config(node_config, exp.cfg)


def stored_device_state(context: Context, client: int) -> State | None:
    """The device state of ``client`` kept in this node's per-run context (None: none yet)."""
    record = context.state.array_records.get(f"{DEVICE_STATE_PREFIX}{client}")
    return None if record is None else dict(record.to_torch_state_dict())


def store_device_state(context: Context, client: int, state: State | None) -> None:
    if state is not None:
        context.state[f"{DEVICE_STATE_PREFIX}{client}"] = ArrayRecord({k: v.contiguous() for k, v in state.items()})


@client_app.query()
def describe(message: Message, context: Context) -> Message:
    """Which partition this SuperNode hosts (asked once per node per run)."""
    settings = RunSettings.from_run_config(dict(context.run_config))
    part = NodePartition.from_node_config(dict(context.node_config), settings.config())
    return Message(RecordDict({"node": part.record()}), reply_to=message)


@client_app.train()
def train(message: Message, context: Context) -> Message:
    """Serve this node's tasks of the round, in order, with the node's device state."""
    exp, part = node_experiment(context)
    reply = RecordDict({})
    for index, wire in enumerate(get_tasks(message.content)):
        cid = wire.client_id
        if cid not in part.clients:
            outcome: Outcome = ClientFailure(cid, "rejected", f"client {cid} is not in partition {part.partition_id}")
        else:
            load_device_state(exp, cid, stored_device_state(context, cid))
            outcome = serve_task(exp, wire)
            store_device_state(context, cid, device_state(exp, cid))
            load_device_state(exp, cid, None)
        put_outcome(reply, index, outcome)
    return Message(reply, reply_to=message)


@client_app.evaluate()
def evaluate_shards(message: Message, context: Context) -> Message:
    """The global state's metrics on each asked client's own shard."""
    from fedpeft.experiment import evaluate

    exp, part = node_experiment(context)
    state = lossless_codec().decode(record_bytes(message.content.array_records["state"]))
    clients = [int(c) for c in message.content.config_records["clients"]["clients"]]
    reply = RecordDict({})
    for client in clients:
        if client in part.clients:
            metrics = evaluate(exp.slot, exp.train_data, exp.task, state, exp.cfg.evaluation.batch_size,
                               exp.shards[client])
            reply[f"client.{client}"] = MetricRecord({k: float(v) for k, v in metrics.items()})
    return Message(reply, reply_to=message)
