"""Per-client tensors kept out of RAM and out of the checkpoint: one safetensors file per client.

A method that keeps something for every client (FedPepTAO: each device's own prompt, the server's
control variate of each device) would otherwise hold clients x state in memory and write all of it
into every checkpoint. :class:`ClientStateStore` keeps each client's state in its own file under
the run directory (``RUN_DIR/client_state/<name>/``), written atomically under a new version name
whenever it changes, so memory holds only the clients of the current round. The versions in use
form the store's *index* (a few integers), which is all the method's checkpoint holds; a resumed
run reads exactly the files its checkpoint names, and files written after that checkpoint (by a
run that stopped before its next one) are ignored, then overwritten or removed. Files that neither
the latest nor the previous snapshot of the index names are deleted when a snapshot is taken.

Until :meth:`ClientStateStore.attach` gives it a directory (the engine does, through
:meth:`~fedpeft.federated.algorithm.Algorithm.attach_run_dir`) the store holds the states in memory,
so a method used without an engine (unit tests) behaves the same.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from safetensors.torch import save as st_save

from fedpeft.federated.types import State
from fedpeft.metrics.recorder import atomic_write_bytes

_FILE = re.compile(r"^(\d+)\.v(\d+)\.safetensors$")


class ClientStateStore(Mapping[int, State]):
    """Client id -> its tensors, on disk once attached (a read-only mapping plus :meth:`put`/:meth:`drop`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.directory: Path | None = None
        self.memory: dict[int, State] = {}
        self.index: dict[int, int] = {}  # client -> version of its file
        self.previous: dict[int, int] = {}  # the index of the last snapshot (a checkpoint may name it)

    def attach(self, run_dir: Path) -> None:
        """Keep the states under ``run_dir/client_state/<name>/`` from now on."""
        directory = run_dir / "client_state" / self.name
        if directory == self.directory:
            return
        held = {client: self[client] for client in self}
        self.directory, self.memory, self.index, self.previous = directory, {}, {}, {}
        directory.mkdir(parents=True, exist_ok=True)
        for client, state in held.items():
            self.put(client, state)

    def _path(self, client: int, version: int) -> Path:
        assert self.directory is not None
        return self.directory / f"{client}.v{version}.safetensors"

    def __getitem__(self, client: int) -> State:
        if self.directory is None:
            return dict(self.memory[client])
        return load_file(self._path(client, self.index[client]))

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.memory if self.directory is None else self.index))

    def __len__(self) -> int:
        return len(self.memory if self.directory is None else self.index)

    def put(self, client: int, state: State) -> None:
        """Store ``state`` as the client's (a new file version, written atomically)."""
        tensors = {key: value.detach().cpu().contiguous().clone() for key, value in state.items()}  # CPU copies
        if self.directory is None:
            self.memory[client] = tensors
            return
        version = self.index.get(client, 0) + 1
        atomic_write_bytes(self._path(client, version), st_save(tensors))
        self.index[client] = version

    def drop(self, client: int) -> None:
        """Forget the client's state (its file goes at the next snapshot)."""
        self.memory.pop(client, None)
        self.index.pop(client, None)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds: the index (on disk) or the tensors themselves (in memory)."""
        if self.directory is None:
            return {"memory": {str(c): dict(s) for c, s in self.memory.items()}}
        snapshot = dict(self.index)
        self._remove_unused(snapshot)
        self.previous = snapshot
        return {"index": {str(c): v for c, v in snapshot.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "memory" in state:
            if self.directory is not None:
                raise ValueError(f"client store {self.name!r}: the checkpoint holds tensors, the run a directory")
            self.memory = {int(c): dict(s) for c, s in state["memory"].items()}
            return
        if self.directory is None:
            raise ValueError(f"client store {self.name!r}: the checkpoint names files but no run directory is attached")
        self.index = {int(c): int(v) for c, v in state["index"].items()}
        self.previous = dict(self.index)
        missing = [c for c, v in self.index.items() if not self._path(c, v).exists()]
        if missing:
            raise FileNotFoundError(f"client store {self.name!r}: the checkpoint's files of clients {missing[:5]} "
                                    f"are missing from {self.directory}")

    def _remove_unused(self, snapshot: dict[int, int]) -> None:
        assert self.directory is not None
        keep = set(snapshot.items()) | set(self.previous.items())
        for path in self.directory.iterdir():
            match = _FILE.match(path.name)
            if match and (int(match.group(1)), int(match.group(2))) not in keep:
                path.unlink()
