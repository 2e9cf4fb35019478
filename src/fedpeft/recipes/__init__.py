"""Named methods. A recipe is a documented preset of adapter + client + strategy + codec
(+ selection), plus the name of the round logic (:mod:`fedpeft.federated.algorithm`) it uses.

Each recipe is one YAML file in this folder::

    summary: one line for `fedpeft recipes`
    algorithm: default            # a registered Algorithm
    paper: where the method comes from (optional)
    defaults: {adapter: ..., client: ..., strategy: ..., codec: ...}
    paper_values: {client: {lr: ...}}   # the paper's values where the defaults differ (optional)
    tune: {client.lr: {low: ..., high: ..., log: true}}   # `fedpeft tune`'s search space

The user's config is merged over ``defaults``, so every default can be overridden. ``defaults``
are values that learn in short runs (tens of rounds); where the paper used other values for its
runs of hundreds of rounds, ``paper_values`` keeps them and ``paper_defaults: true`` in a config
selects them. ``tune`` is the recipe's own search space (every recipe has one: the client learning
rate, and the server learning rate where the strategy steps with one).
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
    paper_values: dict[str, Any] = field(default_factory=dict)
    tune: dict[str, Any] = field(default_factory=dict)


def _load_recipes() -> dict[str, Recipe]:
    recipes = {}
    for path in sorted(Path(__file__).parent.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        recipes[path.stem] = Recipe(name=path.stem, **raw)
    return recipes


RECIPES: dict[str, Recipe] = _load_recipes()
