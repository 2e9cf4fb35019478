"""Flower engine: records round-trip exactly; a silent node costs only its clients; the ServerApp's
transport driving the real ClientApp handlers in process gives the local engine's results bit for
bit (FedPepTAO: device-side prompts stay in the node's state; per-client evaluation by messages);
a real loopback deployment (SuperLink + 2 SuperNodes, TLS, SuperNode authentication) running
FLASC's sparse messages does too, also when a SuperNode is killed mid-round."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.supercore.task_identity import TaskIdentity
from rich.console import Console

from fedpeft.config import build_config
from fedpeft.engines.deploy import LocalDeployment, run_config, write_app
from fedpeft.engines.flower import (
    CODEC_STYPE,
    FlowerTransport,
    NodePartition,
    client_app,
    get_outcomes,
    get_tasks,
    lossless_codec,
    put_outcome,
    put_task,
)
from fedpeft.engines.local import LocalEngine
from fedpeft.engines.protocol import ClientFailure, WireReply, WireTask
from fedpeft.engines.rounds import RoundEngine
from fedpeft.experiment import prepare
from fedpeft.metrics.recorder import load_metrics
from tests.conftest import tiny_raw_config, without_timing

# A run's wall time is long on a loaded 2-core machine: each round starts a fresh ClientApp process per node.
RUN_TIMEOUT = 900


@pytest.fixture
def server_identity() -> Iterator[None]:
    """Messages are created inside a ServerApp; give this process the identity one would have."""
    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 7, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved


def test_tasks_and_replies_round_trip_through_records() -> None:
    tasks = [WireTask(3, 2, b"\x08\x00codec-bytes\x00\xff", ["a.weight", "b"], ["a.weight"],
                      {"up_density": 0.25, "mask_scope": "global", "train_received_only": False}, True),
             WireTask(5, 2, b"another message", None, None, {}, False)]
    content = RecordDict({})
    for i, task in enumerate(tasks):
        put_task(content, i, task)
    assert get_tasks(content) == tasks
    assert content.array_records["payload.0"]["message"].stype == CODEC_STYPE
    assert content.array_records["payload.0"]["message"].data == tasks[0].message  # the codec's bytes, unchanged

    replies = [WireReply(3, b"up-message", 40, 0.5, {"steps": 5.0, "kept_heads": 7.0}, 0.01, 1.5, 1.2, 12345),
               ClientFailure(5, "raised", "RuntimeError: boom"),
               WireReply(6, b"m", 1, float("nan"), {}, 0.0, 0.1, 0.1, None)]
    content = RecordDict({})
    for i, reply in enumerate(replies):
        put_outcome(content, i, reply)
    back = get_outcomes(content)
    assert back[:2] == replies[:2]
    assert back[2].flops_per_step is None and back[2].message == b"m" and back[2].train_loss != back[2].train_loss


def test_node_config_picks_the_hosted_clients(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    cfg = build_config(tiny_raw_config(*toy_files, tmp_path / "run", partition={"num_clients": 5}))
    assert NodePartition.from_node_config({"partition-id": 1, "num-partitions": 2}, cfg).clients == [1, 3]
    with pytest.raises(Exception, match="num-partitions"):
        NodePartition.from_node_config({"partition-id": 0, "num-partitions": 6}, cfg)
    with pytest.raises(Exception, match="partition-id"):
        NodePartition.from_node_config({"num-partitions": 2}, cfg)


class SilentNodeGrid:
    """Two SuperNodes: node 11 (partition 0) answers everything, node 12 (partition 1) never answers training."""

    def __init__(self) -> None:
        self.sent: dict[str, Message] = {}

    def get_node_ids(self) -> Iterable[int]:
        return [11, 12]

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            mid = f"m{len(self.sent)}"
            message.metadata.__dict__["_message_id"] = mid
            self.sent[mid] = message
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        replies = []
        for mid in message_ids:
            message = self.sent[mid]
            node, kind = message.metadata.dst_node_id, message.metadata.message_type
            if kind == MessageType.QUERY:
                part = NodePartition(node - 11, 2, [c for c in range(4) if c % 2 == node - 11])
                replies.append(Message(RecordDict({"node": part.record()}), reply_to=message))
            elif node == 11:
                reply = RecordDict({})
                for i, task in enumerate(get_tasks(message.content)):
                    put_outcome(reply, i, WireReply(task.client_id, b"update", 10, 0.3, {}, 0.0, 1.0, 1.0, None))
                replies.append(Message(reply, reply_to=message))
        return replies


def test_silent_node_costs_only_its_clients(server_identity: None, toy_files: tuple[Path, Path],
                                            tmp_path: Path) -> None:
    cfg = build_config(tiny_raw_config(*toy_files, tmp_path / "run", engine={"round_timeout": 0.5}))
    transport = FlowerTransport(SilentNodeGrid(), cfg, Console(quiet=True))  # type: ignore[arg-type]
    transport.connect()
    tasks = [WireTask(c, 1, b"payload", None, None, {}, False) for c in (2, 1, 0, 3)]
    t0 = time.monotonic()
    outcomes = transport.train(1, tasks)
    assert time.monotonic() - t0 < 5
    assert [type(o).__name__ for o in outcomes] == ["WireReply", "ClientFailure", "WireReply", "ClientFailure"]
    assert [o.client_id for o in outcomes] == [2, 1, 0, 3]  # task order, whatever order the nodes answer in
    assert all(o.stage == "unreachable" and "round_timeout" in o.reason for o in outcomes[1::2])


def test_client_timeout_is_the_real_reply_deadline(server_identity: None, toy_files: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    """``client.timeout_seconds`` bounds the wait per client a node serves (node 12 hosts two: 0.6 s)."""
    cfg = build_config(tiny_raw_config(*toy_files, tmp_path / "run", client={"timeout_seconds": 0.3}))
    transport = FlowerTransport(SilentNodeGrid(), cfg, Console(quiet=True))  # type: ignore[arg-type]
    transport.connect()
    assert transport.reply_timeout(2) == (0.6, True)
    t0 = time.monotonic()
    outcomes = transport.train(1, [WireTask(c, 1, b"payload", None, None, {}, False) for c in (0, 1, 3)])
    assert 0.6 <= time.monotonic() - t0 < 5
    assert isinstance(outcomes[0], WireReply)
    assert [(o.client_id, o.stage) for o in outcomes[1:]] == [(1, "timeout"), (3, "timeout")]
    assert all("client.timeout_seconds = 0.3 s per client" in o.reason for o in outcomes[1:])
    capped = build_config(tiny_raw_config(*toy_files, tmp_path / "run", client={"timeout_seconds": 0.3},
                                          engine={"round_timeout": 0.4}))
    assert FlowerTransport(SilentNodeGrid(), capped, Console(quiet=True)).reply_timeout(2) == (0.4, False)  # type: ignore[arg-type]


class InProcessGrid:
    """A Grid whose nodes are the real ClientApp handlers called in this process, each with its own
    node config and persistent state, as a SuperNode would give them (no processes, no network)."""

    def __init__(self, run_config: dict[str, Any], num_nodes: int) -> None:
        self.contexts = {100 + i: Context(run_id=7, node_id=100 + i, node_config={"partition-id": i,
                                                                                   "num-partitions": num_nodes},
                                          state=RecordDict({}), run_config=run_config) for i in range(num_nodes)}
        self.replies: dict[str, Message] = {}
        self.kinds: list[str] = []

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            mid = f"m{len(self.replies)}"
            message.metadata.__dict__["_message_id"] = mid
            self.kinds.append(message.metadata.message_type)
            self.replies[mid] = client_app(message, self.contexts[message.metadata.dst_node_id])
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies[mid] for mid in message_ids]


def run_in_process(raw: dict[str, Any], run_dir: Path, num_nodes: int = 2) -> tuple[RoundEngine, InProcessGrid]:
    """The ServerApp's round loop and transport over ``num_nodes`` in-process ClientApps."""
    cfg = build_config(raw)
    grid = InProcessGrid(run_config(cfg, run_dir), num_nodes=num_nodes)
    transport = FlowerTransport(grid, cfg, Console(quiet=True))  # type: ignore[arg-type]
    transport.connect()
    engine = RoundEngine(prepare(cfg), run_dir, transport, Console(quiet=True))
    engine.run()
    return engine, grid


def test_server_and_client_apps_in_process_match_the_local_engine(server_identity: None,
                                                                  toy_files: tuple[Path, Path],
                                                                  tmp_path: Path) -> None:
    """FedPepTAO (3 layers, one selected after round 1): partial exchange, device-side prompts."""
    raw = tiny_raw_config(*toy_files, tmp_path / "flower", method="fedpeptao", rounds=3, model={"tiny_layers": 3},
                          task={"max_train_examples": 48, "max_eval_examples": 16},
                          evaluation={"per_client": True})
    raw["adapter"] = {"kind": "p_tuning_v2", "num_virtual_tokens": 2}
    raw["client"] = {"optimizer": "adam", "lr": 0.01, "batch_size": 8, "local_epochs": 1}
    raw["strategy"] = {"name": "fedavg", "clients_per_round": 2, "selection_round": 1, "lanczos_iterations": 8,
                       "score_batch_size": 4, "hessian_batch_size": 4, "fixed_ratio": 0.3}
    engine, grid = run_in_process(raw, tmp_path / "flower")
    exp = engine.exp
    local = local_reference(raw, tmp_path / "local")
    assert_same_weights(engine.final_state, local.final_state)
    ours, theirs = without_timing(load_metrics(tmp_path / "flower")), without_timing(load_metrics(tmp_path / "local"))
    assert ours == theirs and all("client_eval" in r for r in ours)
    assert {"query", "train", "evaluate"} <= set(grid.kinds)
    assert not exp.algorithm.client_prompts  # the server never holds a device's prompt ...
    held = {key for context in grid.contexts.values() for key in context.state.array_records}
    assert held == {f"fedpeft.device.{c}" for c in local.exp.algorithm.client_prompts}  # ... its node does


def test_dp_accountants_stay_on_the_nodes_and_reports_reach_the_server(server_identity: None,
                                                                       toy_files: tuple[Path, Path],
                                                                       tmp_path: Path) -> None:
    """DP-SGD through the ServerApp transport and the real ClientApp handlers: each client's accountant
    lives in its node's state (3 of 4 clients a round, so some train twice and their count carries
    over), the server holds none, and its privacy records, weights and metrics are the local engine's."""
    raw = tiny_raw_config(*toy_files, tmp_path / "flower", rounds=2, strategy={"clients_per_round": 3},
                          client={"local_steps": 2, "dp": {"epsilon": 3.0, "clip_norm": 1.0, "noise_seed": 0}})
    engine, grid = run_in_process(raw, tmp_path / "flower")
    exp = engine.exp
    local = local_reference(raw, tmp_path / "local")
    assert_same_weights(engine.final_state, local.final_state)
    ours, theirs = without_timing(load_metrics(tmp_path / "flower")), without_timing(load_metrics(tmp_path / "local"))
    assert ours == theirs
    assert max(s for r in ours for s in r["privacy"]["steps"].values()) > 2
    assert exp.privacy is not None and not exp.privacy.accountants  # the server never held an accountant
    assert local.exp.privacy is not None
    held = {int(key.removeprefix("fedpeft.device.")): record
            for context in grid.contexts.values() for key, record in context.state.array_records.items()}
    assert sorted(held) == sorted(local.exp.privacy.accountants)
    for client, record in held.items():
        history = record.to_torch_state_dict()["privacy.history"]
        assert [tuple(h) for h in local.exp.privacy.accountants[client].history] == \
            [(s, q, int(n)) for s, q, n in history.tolist()]


# ----------------------------------------------------------------------------------------------
# A real deployment on loopback


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    with LocalDeployment(tmp_path_factory.mktemp("flower"), num_nodes=2, tls=True, auth=True) as running:
        yield running


def local_reference(raw: dict[str, Any], run_dir: Path) -> LocalEngine:
    raw = {**raw, "output": {**raw["output"], "run_dir": str(run_dir)}}
    engine = LocalEngine(prepare(build_config(raw)), run_dir)
    engine.run()
    return engine


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["global_state"]


def assert_same_weights(flower: dict[str, torch.Tensor], local: dict[str, torch.Tensor]) -> None:
    """Bit-identical (tolerance 0): same seeds, same tasks, same aggregation order, fp32 on one CPU kind."""
    assert flower.keys() == local.keys()
    for key in local:
        assert torch.equal(flower[key], local[key]), key


def clientapp_running(deployment: LocalDeployment, name: str) -> bool:
    for pid in deployment.tree(name):
        try:
            if b"flwr-clientapp" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def test_supernode_killed_mid_round_with_sparse_flasc(deployment: LocalDeployment, toy_files: tuple[Path, Path],
                                                      tmp_path: Path) -> None:
    """FLASC (top-k sparse down and up): SuperNode 1 (clients 1 and 3) dies by SIGKILL while it trains in
    round 2; the round waits ``round_timeout``, aggregates clients 0 and 2 and logs 1 and 3 as unreachable.
    The local engine with those two clients dropping out in round 2 reaches the same weights."""
    raw = tiny_raw_config(*toy_files, tmp_path / "flower", method="flasc", rounds=2,
                          adapter={"kind": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "init": "kaiming"},
                          client={"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "batch_size": 8},
                          strategy={"name": "fedadamw", "server_lr": 0.05, "selection": "all",
                                    "clients_per_round": None, "min_clients": 1, "down_density": 0.25,
                                    "up_density": 0.125},
                          engine={"kind": "flower", "round_timeout": 75})
    app = write_app(build_config(raw), tmp_path / "app", tmp_path / "flower")
    metrics = tmp_path / "flower" / "metrics.jsonl"
    with (tmp_path / "flwr-run.log").open("wb") as log:
        run = deployment.start_run(app, log)
        deadline = time.monotonic() + RUN_TIMEOUT
        while not (metrics.exists() and metrics.read_text().strip()):  # round 1 recorded
            assert run.poll() is None and time.monotonic() < deadline, "the run ended before round 2"
            time.sleep(0.2)
        while not clientapp_running(deployment, "supernode1"):  # round 2 reached SuperNode 1
            assert run.poll() is None and time.monotonic() < deadline, "SuperNode 1 never started round 2"
            time.sleep(0.05)
        deployment.kill("supernode1")
        status = run.wait(timeout=RUN_TIMEOUT)
    finished = (tmp_path / "flower" / "summary.json").exists()  # flwr run exits 0 even when the ServerApp failed
    assert status == 0 and finished, (tmp_path / "flwr-run.log").read_text()[-3000:]

    records = load_metrics(tmp_path / "flower")
    assert records[1]["selected"] == [0, 1, 2, 3] and records[1]["clients"] == [0, 2]
    assert [(f["client"], f["stage"]) for f in records[1]["failures"]] == [(1, "unreachable"), (3, "unreachable")]
    reference = {**raw, "faults": [{"kind": "dropout", "clients": [1, 3], "rounds": [2]}]}
    local = local_reference(reference, tmp_path / "local")
    assert_same_weights(final_weights(tmp_path / "flower"), local.final_state)
    theirs = without_timing(load_metrics(tmp_path / "local"))
    ours = without_timing(records)
    assert ours[0] == theirs[0]  # round 1, every client: losses, accuracy, exact byte counts
    for key in ("clients", "num_samples", "client_losses", "eval", "bytes_down", "bytes_up", "method"):
        assert ours[1][key] == theirs[1][key], key
    dense = len(lossless_codec().encode(local.exp.initial_state))  # what a dense fp32 message would weigh
    assert max(b for r in records for b in r["bytes_up"] + r["bytes_down"]) < dense / 2
