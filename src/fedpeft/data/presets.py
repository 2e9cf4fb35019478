"""Named heterogeneity settings from the papers, usable as ``partition.preset: NAME``.

A preset is a set of config values (partition and, where the paper fixes it, the number of
local steps) merged over the recipe's defaults and under the user's own values, so anything
the user writes explicitly still wins. ``fedpeft data CONFIG`` shows the shards a preset gives.

FedTT Sec. 5.3 (after Chen et al.'s RoLoRA): heterogeneity grows with the number of clients,
each doing 20 local updates; the data are split uniformly at random:

- ``fedtt_iid``: 3 clients ("i.i.d."), ``fedtt_mild``: 20 clients, ``fedtt_severe``: 50 clients.

FedTT App. B (after Sun et al.'s FFA-LoRA): 3 clients with fixed label proportions and 10 local
updates. The rows depend on the number of classes, so the preset names say it:

- ``fedtt_appb_iid``: 3 clients, uniform split;
- ``fedtt_appb_mild_2class``: [0.15, 0.85], [0.85, 0.15], [0.5, 0.5];
- ``fedtt_appb_mild_3class``: [0.6, 0.2, 0.2], [0.2, 0.6, 0.2], [0.2, 0.2, 0.6];
- ``fedtt_appb_severe_2class``: [0.05, 0.95], [0.95, 0.05], [0.5, 0.5];
- ``fedtt_appb_severe_3class``: [0.9, 0.05, 0.05], [0.05, 0.9, 0.05], [0.05, 0.05, 0.9].

A preset whose rows do not match the task's labels fails at start-up with the partitioner's
``partition.label_proportions`` error.
"""

from __future__ import annotations

import copy
from typing import Any

from fedpeft.config import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    "fedtt_iid": {"partition": {"kind": "iid", "num_clients": 3}, "client": {"local_steps": 20}},
    "fedtt_mild": {"partition": {"kind": "iid", "num_clients": 20}, "client": {"local_steps": 20}},
    "fedtt_severe": {"partition": {"kind": "iid", "num_clients": 50}, "client": {"local_steps": 20}},
    "fedtt_appb_iid": {"partition": {"kind": "iid", "num_clients": 3}, "client": {"local_steps": 10}},
    "fedtt_appb_mild_2class": {
        "partition": {"kind": "label_proportions", "num_clients": 3,
                      "label_proportions": [[0.15, 0.85], [0.85, 0.15], [0.5, 0.5]]},
        "client": {"local_steps": 10},
    },
    "fedtt_appb_mild_3class": {
        "partition": {"kind": "label_proportions", "num_clients": 3,
                      "label_proportions": [[0.6, 0.2, 0.2], [0.2, 0.6, 0.2], [0.2, 0.2, 0.6]]},
        "client": {"local_steps": 10},
    },
    "fedtt_appb_severe_2class": {
        "partition": {"kind": "label_proportions", "num_clients": 3,
                      "label_proportions": [[0.05, 0.95], [0.95, 0.05], [0.5, 0.5]]},
        "client": {"local_steps": 10},
    },
    "fedtt_appb_severe_3class": {
        "partition": {"kind": "label_proportions", "num_clients": 3,
                      "label_proportions": [[0.9, 0.05, 0.05], [0.05, 0.9, 0.05], [0.05, 0.05, 0.9]]},
        "client": {"local_steps": 10},
    },
}


def preset_sections(raw: dict[str, Any]) -> dict[str, Any]:
    """The config sections of the preset named by ``raw["partition"]["preset"]`` ({} when none)."""
    partition = raw.get("partition")
    name = partition.get("preset") if isinstance(partition, dict) else None
    if name is None:
        return {}
    if name not in PRESETS:
        raise ConfigError("partition.preset", f"unknown preset {name!r}; allowed: {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])
