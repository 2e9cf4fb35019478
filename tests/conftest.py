"""Shared fixtures: offline hub, a separable toy task on disk, tiny-model experiment configs."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

# the machine's 2 cores, shared among pytest-xdist's workers (`make test` runs two)
torch.set_num_threads(max(1, 2 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

POSITIVE = ["good", "great", "excellent", "wonderful", "lovely", "superb"]
NEGATIVE = ["bad", "awful", "terrible", "poor", "horrible", "dreadful"]
FILLER = ["the", "movie", "was", "plot", "actor", "story", "really", "quite", "film", "scene", "music", "a"]


def write_toy_sentiment(path: Path, n: int, seed: int) -> Path:
    """A linearly separable sentiment CSV: the label is carried by one polar word."""
    rng = random.Random(seed)
    lines = ["text,label"]
    for i in range(n):
        label = i % 2
        words = rng.sample(FILLER, 2)
        words.insert(rng.randrange(3), rng.choice(POSITIVE if label else NEGATIVE))
        lines.append(f"{' '.join(words)},{'pos' if label else 'neg'}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def single_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a shared CPU two spinning threads cost 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def toy_files(tmp_path: Path) -> tuple[Path, Path]:
    return write_toy_sentiment(tmp_path / "train.csv", 160, 0), write_toy_sentiment(tmp_path / "eval.csv", 64, 1)


def tiny_raw_config(train: Path, eval_: Path, run_dir: Path, **sections: Any) -> dict[str, Any]:
    """A small, fast experiment on the toy task with a tiny random BERT."""
    raw: dict[str, Any] = {
        "method": "lora",
        "seed": 0,
        "rounds": 3,
        "task": {"name": "file", "train_file": str(train), "eval_file": str(eval_), "text_columns": ["text"],
                 "label_column": "label", "max_length": 32},
        "partition": {"kind": "iid", "num_clients": 4},
        "model": {"name": "tiny-bert"},
        "adapter": {"kind": "lora", "r": 4, "alpha": 8},
        "client": {"optimizer": "adam", "lr": 0.01, "batch_size": 8, "local_epochs": 1},
        "strategy": {"name": "fedavg", "clients_per_round": 2},
        "output": {"run_dir": str(run_dir), "progress": False},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return raw


TIMING_FIELDS = ("time", "cum_wall_seconds", "client_seconds")


def without_timing(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records minus wall-clock measurements, which differ between identical runs."""
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


def tiny_per_token_config(tmp_path: Path, method: str, task_fields: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """A NER or QA experiment on toy files (``task_fields``) with full local epochs on a tiny random BERT:
    2 clients, both every round, 4 rounds; ``sections`` update the named sections."""
    raw: dict[str, Any] = {
        "method": method, "seed": 0, "rounds": 4,
        "task": {"name": "file", "max_length": 24, **task_fields},
        "partition": {"kind": "iid", "num_clients": 2},
        "model": {"name": "tiny-bert"},
        "adapter": {},
        "client": {"optimizer": "adam", "lr": 0.005, "batch_size": 16, "local_epochs": 2},
        "strategy": {"name": "fedavg", "clients_per_round": 2},
        "evaluation": {"at_start": True},
        "output": {"run_dir": str(tmp_path / "run"), "progress": False},
    }
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    return raw


@pytest.fixture(scope="session")
def minilm_tokenizer() -> Any:
    """MiniLM's (uncased WordPiece, fast) tokenizer, the one tiny models use too."""
    from transformers import AutoTokenizer

    from fedpeft.models.backbone import minilm_path

    return AutoTokenizer.from_pretrained(str(minilm_path()))
