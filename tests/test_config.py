"""Every bad config value fails before training, naming the field and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedpeft.config import ConfigError, build_config, load_config
from fedpeft.experiment import prepare
from tests.conftest import tiny_raw_config


def test_recipe_defaults_under_user_values() -> None:
    cfg = build_config({"method": "lora", "adapter": {"r": 2}})
    assert cfg.adapter.r == 2 and cfg.adapter.kind == "lora"
    assert cfg.client.optimizer == "adamw"  # from the recipe


@pytest.mark.parametrize(("method", "short", "paper"), [
    ("flasc", {"client.lr": 0.17, "strategy.server_lr": 0.02}, {"client.lr": 0.0005, "strategy.server_lr": 0.001}),
    ("headprune_b1", {"client.batch_size": 16, "client.lr": 0.00096}, {"client.batch_size": 80, "client.lr": 0.0005}),
    ("hetlora", {"client.lr": 0.0087, "strategy.server_lr": 0.013}, {"client.lr": 0.0005, "strategy.server_lr": 0.005}),
    ("ffa_lora", {"client.lr": 0.002}, {"client.lr": 0.001}),
])
def test_paper_defaults_select_the_papers_values(method: str, short: dict, paper: dict) -> None:
    """A recipe defaults to values that learn in short runs; ``paper_defaults: true`` takes the
    paper's (``paper_values``), and the user's own values still win over both."""
    def values(cfg: object, keys: dict) -> dict:
        out = {}
        for key in keys:
            section, name = key.split(".")
            out[key] = getattr(getattr(cfg, section), name)
        return out

    assert values(build_config({"method": method}), short) == short
    assert values(build_config({"method": method, "paper_defaults": True}), paper) == paper
    mine = build_config({"method": method, "paper_defaults": True, "client": {"lr": 0.3, "batch_size": 4}})
    assert (mine.client.lr, mine.client.batch_size) == (0.3, 4)


def test_yaml_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"method": "lora", "rounds": 4}))
    cfg = load_config(path, ["partition.num_clients=20", "strategy.clients_per_round=5", "adapter.dropout=0.1"])
    assert (cfg.rounds, cfg.partition.num_clients, cfg.clients_per_round(), cfg.adapter.dropout) == (4, 20, 5, 0.1)


@pytest.mark.parametrize(
    "raw,field,hint",
    [
        ({"method": "nope"}, "method", "allowed"),
        ({"adapter": {"r": 0}}, "adapter.r", "greater than 0"),
        ({"codec": {"up": {"density": 1.5}}}, "codec.up.density", "less than or equal to 1"),
        ({"codec": {"down": {"density": 0}}}, "codec.down.density", "greater than 0"),
        ({"client": {"optimizer": "lion"}}, "client.optimizer", "sgd"),
        ({"partition": {"kind": "zipf"}}, "partition.kind", "dirichlet"),
        ({"partition": {"num_clients": 4}, "strategy": {"clients_per_round": 5}}, "strategy.clients_per_round",
         "exceeds"),
        ({"rounds": -1}, "rounds", "greater than 0"),
        ({"tasks": {}}, "tasks", "unknown field"),
        # a strategy's own fields are checked with the config, not when a run starts
        ({"method": "flasc", "strategy": {"dp_delta": 2}}, "strategy.dp_delta", "less than 1"),
        ({"method": "flasc", "partition": {"num_clients": 100},
          "strategy": {"clients_per_round": 10, "dp_clip_norm": 0.01, "dp_simulated_cohort": 1000}},
         "strategy.dp_simulated_cohort", "exceeds the 100 clients"),
        # the strategy and adapter sections allow their readers' own fields, and no field nothing reads
        ({"method": "flasc", "strategy": {"down_densty": 0.5}}, "strategy.down_densty", "did you mean 'down_density'"),
        ({"method": "lora", "strategy": {"density_tiers": [0.5, 1.0]}}, "strategy.density_tiers",
         "unknown field for method 'lora' with strategy 'fedavg'"),
        ({"method": "flasc", "strategy": {"name": "fedavg", "weight_decay": 0.1}}, "strategy.weight_decay",
         "unknown field"),  # FedAdamW's, not FedAvg's
        # a server optimiser's own field set for a server that never reads it (plain FedAvg under a FedProx label)
        ({"method": "lora", "strategy": {"proximal_mu": 0.1}}, "strategy.proximal_mu", "read by strategy fedprox"),
        ({"method": "lora", "strategy": {"name": "fedadagrad", "beta2": 0.9}}, "strategy.beta2",
         "fedadam or fedadamw or fedyogi"),
        ({"method": "flasc", "strategy": {"server_momentum": 0.5}}, "strategy.server_momentum", "strategy 'fedadamw'"),
        ({"method": "federa", "adapter": {"svd_absorb_scal": True}}, "adapter.svd_absorb_scal",
         "did you mean 'svd_absorb_scale'"),
        ({"method": "lora", "adapter": {"svd_absorb_scale": True}}, "adapter.svd_absorb_scale", "(init 'kaiming')"),
        ({"method": "prompt_tuning", "adapter": {"num_virtual_token": 8}}, "adapter.num_virtual_token",
         "did you mean 'num_virtual_tokens'"),
    ],
)
def test_bad_values_name_the_field(raw: dict, field: str, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(raw)
    assert info.value.field == field
    assert hint in str(info.value)


def test_a_recipe_default_the_users_choice_does_not_read_is_no_error() -> None:
    """FLASC's recipe sets FedAdamW's weight_decay; a user who switches to FedAvg did not write it."""
    cfg = build_config({"method": "flasc", "strategy": {"name": "fedavg", "down_density": 0.25}})
    assert cfg.strategy.model_extra["weight_decay"] == 0.01 and cfg.strategy.model_extra["down_density"] == 0.25
    assert build_config(cfg.model_dump(mode="json")) == cfg  # nor when the resolved config is read back


def test_server_optimiser_fields_where_something_reads_them() -> None:
    """FedPepTAO's own server reads the momentum under ``name: fedavg``; a resolved config, which holds
    every field at its default, reads back whatever its strategy."""
    assert build_config({"method": "fedpeptao", "strategy": {"server_momentum": 0.5}}).strategy.server_momentum == 0.5
    assert build_config({"method": "lora", "strategy": {"name": "fedprox", "proximal_mu": 0.1}}).strategy.proximal_mu \
        == 0.1
    cfg = build_config({"method": "lora"})
    assert build_config(cfg.model_dump(mode="json")) == cfg


def test_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match="--set"):
        load_config(None, ["adapter.r"])


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def _prepare(raw: dict) -> None:
    prepare(build_config(raw))


def test_missing_data_file(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    _train, eval_ = toy_files
    raw = tiny_raw_config(tmp_path / "nope.csv", eval_, tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        _prepare(raw)
    assert info.value.field == "task.train_file"


def test_label_not_in_label_set(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", task={"label_names": ["neg", "neutral"]})
    with pytest.raises(ConfigError) as info:
        _prepare(raw)
    assert info.value.field == "task.label_names"


def test_more_clients_than_examples(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", partition={"num_clients": 500})
    with pytest.raises(ConfigError) as info:
        _prepare(raw)
    assert info.value.field == "partition.num_clients"


def test_unknown_adapter_and_strategy(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    with pytest.raises(ConfigError, match=r"adapter\.kind"):
        _prepare(tiny_raw_config(train, eval_, tmp_path / "r1", adapter={"kind": "magic"}))
    with pytest.raises(ConfigError, match=r"strategy\.name"):
        _prepare(tiny_raw_config(train, eval_, tmp_path / "r2", strategy={"name": "fedmagic"}))
    with pytest.raises(ConfigError, match=r"task\.name"):
        _prepare(tiny_raw_config(train, eval_, tmp_path / "r3", task={"name": "sst3"}))
    with pytest.raises(ConfigError, match=r"codec\.up\.densty: unknown field; the dense codec"):
        _prepare(tiny_raw_config(train, eval_, tmp_path / "r4", codec={"up": {"kind": "dense", "densty": 0.1}}))
    # density is topk's: the dense codec sent every entry under density 0.1 without a word
    with pytest.raises(ConfigError, match=r"codec\.down\.density: the dense codec sends every entry"):
        _prepare(tiny_raw_config(train, eval_, tmp_path / "r5", codec={"down": {"kind": "dense", "density": 0.1}}))
    with pytest.raises(ConfigError, match=r"codec\.up\.density: the zero_slices codec"):
        _prepare(tiny_raw_config(train, eval_, tmp_path / "r6", method="headprune", adapter={"r": 4, "alpha": 8},
                                 codec={"up": {"kind": "zero_slices", "density": 0.5}}))
    sparse = prepare(build_config(tiny_raw_config(train, eval_, tmp_path / "r7",
                                                  codec={"up": {"kind": "topk", "density": 0.1}})))
    assert sparse.up_codec.density == 0.1
