"""fedpeft: federated parameter-efficient fine-tuning of language models."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedpeft.export import LoadedModel

__version__ = "0.1.0"


def load(path: str | os.PathLike[str], data_dir: str | None = None) -> LoadedModel:
    """A ready model (eval mode) + tokenizer + label names + task for a run directory or any export
    of ``fedpeft export`` (:func:`fedpeft.export.load`). Importing fedpeft stays light: this imports torch."""
    from fedpeft.export import load as load_model

    return load_model(path, data_dir)


__all__ = ["__version__", "load"]
