"""The per-client state store: files per client, versions named by the checkpoint, memory before attach."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedpeft.federated.client_store import ClientStateStore


def test_store_keeps_one_file_per_client_and_resumes_from_the_checkpoint_index(tmp_path: Path) -> None:
    store = ClientStateStore("prompts")
    store.put(3, {"p": torch.ones(2)})  # before attach: in memory
    assert store[3]["p"].tolist() == [1.0, 1.0] and not (tmp_path / "client_state").exists()
    store.attach(tmp_path)
    folder = tmp_path / "client_state" / "prompts"
    assert [p.name for p in folder.iterdir()] == ["3.v1.safetensors"] and not store.memory
    store.put(7, {"p": torch.zeros(2)})
    checkpoint = store.state_dict()  # what the method's checkpoint holds: versions only
    assert checkpoint == {"index": {"3": 1, "7": 1}}
    store.put(3, {"p": torch.full((2,), 5.0)})  # written after the checkpoint, then the run stops
    store.put(3, {"p": torch.full((2,), 6.0)})

    resumed = ClientStateStore("prompts")
    resumed.attach(tmp_path)
    resumed.load_state_dict(checkpoint)
    assert resumed[3]["p"].tolist() == [1.0, 1.0] and list(resumed) == [3, 7]
    resumed.put(3, {"p": torch.full((2,), 2.0)})  # overwrites the stale v2 atomically
    resumed.drop(7)
    assert resumed.state_dict() == {"index": {"3": 2}}
    # the previous snapshot's files stay (a checkpoint may still name them), the rest go; no temp files
    assert sorted(p.name for p in folder.iterdir()) == ["3.v1.safetensors", "3.v2.safetensors",
                                                       "7.v1.safetensors"]
    resumed.state_dict()
    assert sorted(p.name for p in folder.iterdir()) == ["3.v2.safetensors"]
    assert resumed[3]["p"].tolist() == [2.0, 2.0]


def test_store_refuses_a_checkpoint_whose_files_are_gone(tmp_path: Path) -> None:
    store = ClientStateStore("controls")
    store.attach(tmp_path)
    with pytest.raises(FileNotFoundError, match="clients \\[4\\]"):
        store.load_state_dict({"index": {"4": 2}})
