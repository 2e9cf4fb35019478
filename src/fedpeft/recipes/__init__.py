"""Named methods. A recipe is a documented preset of adapter + client + strategy + codec
(+ selection), plus the name of the round logic (:mod:`fedpeft.federated.algorithm`) it uses.

Each recipe is one YAML file in this folder::

    summary: one line for `fedpeft recipes`
    algorithm: default            # a registered Algorithm
    paper: where the method comes from (optional)
    defaults: {adapter: ..., client: ..., strategy: ..., codec: ...}

The user's config is merged over ``defaults``, so every default can be overridden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    algorithm: str = "default"
    paper: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)


def _load_recipes() -> dict[str, Recipe]:
    recipes = {}
    for path in sorted(Path(__file__).parent.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        recipes[path.stem] = Recipe(name=path.stem, **raw)
    return recipes


RECIPES: dict[str, Recipe] = _load_recipes()
