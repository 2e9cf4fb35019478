"""Run directory: ``config.yaml``, ``metrics.jsonl`` (one line per round) and ``checkpoint.pt``.

Every file is written atomically (temp file in the same folder, fsync, ``os.replace``), so a
crash never leaves a half-written checkpoint or metrics file. The metrics line of round t is
written before the checkpoint of round t; on resume, lines after the checkpoint's round are
dropped, so the file always matches the state the run continues from.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from fedpeft.config import ConfigError, ExperimentConfig, build_config

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
SUMMARY = "summary.json"
PARTITION = "partition.json"


CHECKPOINT_KEYS = ("round", "global_state", "algorithm", "totals", "fingerprint")


class CheckpointError(RuntimeError):
    """The run directory cannot be resumed (missing, corrupt or from another experiment)."""


class ExportError(ValueError):
    """A run or export cannot be loaded, exported or predicted with (:mod:`fedpeft.export`); the
    message names why, in one line."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# Engine fields that change where clients run, not what they compute: a run may resume on another engine
# or device (checkpoints hold CPU tensors only).
TRANSPORT_FIELDS = ("threads", "backend", "round_timeout", "connect_timeout", "device", "gradient_checkpointing",
                    "deterministic")

LATER_FIELDS: dict[tuple[str, ...], Any] = {
    ("client", "dp"): None, ("client", "timeout_seconds"): None, ("task", "validation_fraction"): None,
    ("task", "validation_file"): None, ("evaluation", "splits"): ["eval", "validation"],
    ("codec", "down", "pack"): False, ("codec", "up", "pack"): False,
    ("engine", "precision"): "fp32", ("model", "dtype"): "fp32", ("model", "quantization"): "none",
    ("partition", "dirichlet_over"): "classes",
}
"""Config fields added after runs were already checkpointed, with their defaults: left out of the
fingerprint while at the default, so those runs still resume (they ran with the default)."""

BEFORE_FIELDS: dict[tuple[str, ...], Any] = {("model", "pooling"): "head"}
"""Fields added without a :data:`LATER_FIELDS` entry, with what runs written before them did: such a
run's config.yaml lacks the field (:func:`read_saved_config` fills the old value in) and its
checkpoint's fingerprint was hashed without it (:func:`fingerprint_matches` accepts that hash).
``model.pooling`` arrived with ``head`` as its default and is hashed as set since, and ``auto``
became the default later, so a config without the key now means something else than it did."""


def _section(tree: Any, sections: list[str]) -> dict[str, Any] | None:
    """The mapping at ``sections`` inside ``tree`` (a config as plain data), or None where there is none."""
    for section in sections:
        tree = tree.get(section) if isinstance(tree, dict) else None
    return tree if isinstance(tree, dict) else None


def resume_fields(cfg: ExperimentConfig) -> dict[str, Any]:
    """Everything that must match to continue a run (not ``rounds``, ``output`` or the transport).

    The engine kind counts as ``local`` (all engines compute the same rounds), which keeps the
    fingerprints of runs written before the other engines existed; :data:`LATER_FIELDS` at their
    defaults are left out for the same reason.
    """
    raw = cfg.model_dump(mode="json")
    raw.pop("rounds")
    raw.pop("output")
    raw.pop("paper_defaults")  # the values it selected are in the sections
    for key in TRANSPORT_FIELDS:
        raw["engine"].pop(key, None)
    raw["engine"]["kind"] = "local"
    for (*sections, field), default in LATER_FIELDS.items():
        node = _section(raw, sections)
        if node is not None and node.get(field) == default:
            node.pop(field, None)
    return raw


def _hash(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def resume_fingerprint(cfg: ExperimentConfig) -> str:
    """Hash of :func:`resume_fields`."""
    return _hash(resume_fields(cfg))


def fingerprint_matches(fingerprint: Any, cfg: ExperimentConfig) -> bool:
    """Whether a checkpoint's ``fingerprint`` was written by ``cfg``: its hash today, or the hash a run
    written before the :data:`BEFORE_FIELDS` that ``cfg`` holds at their old values would carry."""
    fields = resume_fields(cfg)
    if fingerprint == _hash(fields):
        return True
    before = False
    for (*sections, field), value in BEFORE_FIELDS.items():
        node = _section(fields, sections)
        if node is not None and node.get(field) == value:
            node.pop(field)
            before = True
    return before and fingerprint == _hash(fields)


def read_saved_config(path: Path) -> ExperimentConfig:
    """A run directory's ``config.yaml`` as the run ran it (:func:`saved_config`; raises what
    :func:`build_config` and YAML raise, and OSError)."""
    return saved_config(yaml.safe_load(path.read_text()))


def saved_config(raw: dict[str, Any]) -> ExperimentConfig:
    """A saved ``config.yaml`` (as plain data, changed in place) as the run ran it: :data:`BEFORE_FIELDS`
    it lacks take the value they had before they existed, and what it asked of the hardware is not
    checked against this machine (a run trained on a GPU is compared, resumed or exported on a CPU)."""
    for (*sections, field), value in BEFORE_FIELDS.items():
        node = _section(raw, sections)
        if node is not None:
            node.setdefault(field, value)
    return build_config(raw, here=False)


def resume_differences(saved: ExperimentConfig, given: ExperimentConfig) -> list[str]:
    """The dotted :func:`resume_fields` that differ, as ``field (RUN in the run, GIVEN given)``."""
    def flat(node: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(node, dict):
            return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()}
        return {prefix.rstrip("."): node}

    before, after = flat(resume_fields(saved)), flat(resume_fields(given))
    return [f"{key} ({before.get(key)!r} in the run, {after.get(key)!r} given)"
            for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)]


class Recorder:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.records: list[dict[str, Any]] = []

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT

    def check_new(self) -> None:
        """Refuse to overwrite a run directory that already holds a run."""
        if (self.run_dir / METRICS).exists() or self.checkpoint_path.exists():
            raise ConfigError("output.run_dir", f"{self.run_dir} already holds a run; use --resume or another dir")

    def start(self, cfg: ExperimentConfig) -> None:
        self.check_new()
        self.begin(cfg)

    def begin(self, cfg: ExperimentConfig) -> None:
        """Write the config and an empty metrics file (a new run, or one restarted from round 1)."""
        self.records = []
        atomic_write_bytes(self.run_dir / CONFIG, cfg.to_yaml().encode())
        atomic_write_bytes(self.run_dir / METRICS, b"")

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        payload = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records)
        atomic_write_bytes(self.run_dir / METRICS, payload.encode())

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        import io

        buffer = io.BytesIO()
        torch.save(state, buffer)
        atomic_write_bytes(self.checkpoint_path, buffer.getvalue())

    def _saved_config(self) -> ExperimentConfig:
        saved = self.run_dir / CONFIG
        try:
            return read_saved_config(saved)
        except (OSError, ConfigError, yaml.YAMLError) as err:
            raise CheckpointError(f"{saved} is not a valid config: {err}") from err

    def _differences(self, cfg: ExperimentConfig, saved: ExperimentConfig | None = None) -> str:
        """``: FIELD (RUN in the run, GIVEN given), ...`` against the run's config (``saved``, else its
        config.yaml), or nothing to add."""
        try:
            fields = resume_differences(saved or self._saved_config(), cfg)
        except CheckpointError:
            return ""
        return f": {'; '.join(fields[:5])}{' ...' if len(fields) > 5 else ''}" if fields else ""

    def resume(self, cfg: ExperimentConfig, template: dict[str, torch.Tensor] | None = None) -> dict[str, Any] | None:
        """Load the checkpoint, check it belongs to ``cfg`` (and that its global state has the keys
        and shapes of ``template``), and trim metrics to its round.

        None means the run stopped before its first checkpoint: it restarts from round 1, which
        is the state it would resume from (the initial state is a function of the config).
        """
        for leftover in self.run_dir.glob(".*.tmp"):  # a write cut short by the crash; the real file is intact
            leftover.unlink()
        if not self.checkpoint_path.exists():
            saved = self.run_dir / CONFIG
            if not saved.exists():
                raise CheckpointError(f"no checkpoint and no {CONFIG} in {self.run_dir}: nothing to resume")
            saved_cfg = self._saved_config()
            if resume_fingerprint(saved_cfg) != resume_fingerprint(cfg):
                raise CheckpointError(f"{saved} differs from the config given{self._differences(cfg, saved_cfg)}; "
                                      "only rounds and output.* may change")
            return None
        try:
            state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"corrupt checkpoint {self.checkpoint_path}: {err}") from err
        missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
        if missing:
            raise CheckpointError(f"{self.checkpoint_path} is not a fedpeft checkpoint (no {', '.join(missing)})")
        if not fingerprint_matches(state.get("fingerprint"), cfg):
            saved = self.run_dir / CONFIG
            raise CheckpointError(
                f"{self.checkpoint_path} was written by a different experiment config than the one given "
                f"(compare with {saved}){self._differences(cfg)}; only rounds and output.* may change on resume"
            )
        if template is not None:
            check_state(self.checkpoint_path, state["global_state"], template)
        try:
            self.records = [r for r in load_metrics(self.run_dir) if r["round"] <= state["round"]]
        except (ValueError, KeyError, TypeError) as err:  # not JSON, or lines that are not round records
            raise CheckpointError(f"corrupt {self.run_dir / METRICS}: {type(err).__name__}: {err}") from err
        logged = {r["round"] for r in self.records}
        lost = [t for t in range(1, int(state["round"]) + 1) if t not in logged]
        if lost:
            raise CheckpointError(f"{self.run_dir / METRICS} lacks rounds {lost[:5]} of the checkpoint's "
                                  f"{state['round']}: the run directory was altered")
        payload = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records)
        atomic_write_bytes(self.run_dir / METRICS, payload.encode())
        atomic_write_bytes(self.run_dir / CONFIG, cfg.to_yaml().encode())
        return state

    def write_partition(self, partition: dict[str, Any]) -> None:
        atomic_write_bytes(self.run_dir / PARTITION, json.dumps(partition, sort_keys=True).encode())

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_bytes(self.run_dir / SUMMARY, json.dumps(summary, indent=2, sort_keys=True).encode())


def check_state(path: Path, state: Any, template: dict[str, torch.Tensor]) -> None:
    """The checkpoint's global state must hold exactly the model's trainable keys, with their shapes."""
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: global_state is not a dict of tensors")
    if set(state) != set(template):
        odd = sorted(set(state) ^ set(template))
        raise CheckpointError(f"{path}: global_state keys do not match the model's trainable parameters "
                              f"(e.g. {odd[:3]})")
    for key, value in template.items():
        if state[key].shape != value.shape:
            raise CheckpointError(f"{path}: {key} has shape {tuple(state[key].shape)}, "
                                  f"the model's is {tuple(value.shape)}")


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            records.append(json.loads(line))
    return records


def load_run_config(run_dir: Path) -> dict[str, Any]:
    return yaml.safe_load((Path(run_dir) / CONFIG).read_text())
