"""Head pruning (papers/003): importance, pruning, sparse upload, Eq. 8, and learning end to end."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fedpeft.config import ConfigError, build_config
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import load_data, prepare
from fedpeft.federated.codec import CodecError, build_codec
from fedpeft.federated.types import ClientResult, ClientTask
from fedpeft.methods.headprune import (
    HEAD_SCORES_KEY,
    HeadPruneOptions,
    ZeroSliceCodec,
    head_weighted_delta,
    heads_to_keep,
    zero_pruned_slices,
)
from fedpeft.metrics.flops import attention_block_flops
from fedpeft.models.backbone import load_backbone
from fedpeft.models.encoding import EncodedData, training_batch
from fedpeft.models.heads import (
    HeadOwnership,
    eager_attention,
    end_token_ids,
    find_head_sites,
    head_confidence,
    head_importance,
    masked_heads,
    projection_in_features,
    pruned_heads,
)
from fedpeft.sweep import load_sweep
from tests.conftest import tiny_raw_config


def tiny_experiment(toy_files: tuple[Path, Path], tmp_path: Path, arch: str = "bert", **sections: object):
    train, eval_ = toy_files
    merged = {"model": {"name": f"tiny-{arch}"}, "adapter": {"r": 4}, **sections}
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="headprune", **merged)
    return prepare(build_config(raw))


# -- Eq. 6: importance --------------------------------------------------------------------------


def test_head_confidence_on_hand_made_attention() -> None:
    # one example, 2 heads, 3 queries x 3 keys; key 2 is an end token, query 2 is padding
    attention = torch.tensor([[
        [[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.3, 0.3, 0.4]],
        [[0.2, 0.2, 0.6], [0.5, 0.4, 0.1], [1.0, 0.0, 0.0]],
    ]])
    queries = torch.tensor([[True, True, False]])
    all_keys = torch.tensor([[True, True, True]])
    no_end_key = torch.tensor([[True, True, False]])
    confidence, has_queries = head_confidence(attention, queries, all_keys)
    assert torch.allclose(confidence, torch.tensor([[(0.7 + 0.6) / 2, (0.6 + 0.5) / 2]]))
    confidence, _ = head_confidence(attention, queries, no_end_key)
    assert torch.allclose(confidence, torch.tensor([[(0.7 + 0.3) / 2, (0.2 + 0.5) / 2]]))
    assert has_queries.tolist() == [True]
    _, has_queries = head_confidence(attention, torch.zeros(1, 3, dtype=torch.bool), all_keys)
    assert has_queries.tolist() == [False]


def test_importance_ignores_padding(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    exp = tiny_experiment(toy_files, tmp_path)
    model, sites = exp.backbone.model, find_head_sites(exp.backbone.model)
    ends = end_token_ids(exp.backbone.tokenizer)
    tokenizer = exp.backbone.tokenizer
    texts = ["good film", "the movie was really quite bad and the plot awful"]
    data = EncodedData([{"input_ids": tokenizer(t)["input_ids"]} for t in texts], [1, 0], "sequence_classification",
                       tokenizer.pad_token_id)
    together = head_importance(model, sites, [training_batch(data, [0, 1])], ends)
    alone = head_importance(model, sites, [training_batch(data, [0]), training_batch(data, [1])], ends)
    assert together.shape == (2, 4)
    assert torch.allclose(together, alone, atol=1e-5)
    assert bool((together > 0).all()) and bool((together <= 1).all())


# -- Eq. 7: pruning -----------------------------------------------------------------------------


def test_heads_to_keep_global_per_layer_and_random() -> None:
    scores = torch.tensor([[0.9, 0.1, 0.2, 0.3], [0.05, 0.06, 0.07, 0.8]])
    kept = heads_to_keep(scores, (2, 4), 0.5)  # the 4 lowest scores over the model
    assert kept.tolist() == [[True, False, True, True], [False, False, False, True]]
    # 7 of 8 asked, but each block keeps its best head: only 6 go
    kept = heads_to_keep(scores, (2, 4), 0.875, min_per_layer=1)
    assert kept.tolist() == [[True, False, False, False], [False, False, False, True]]
    kept = heads_to_keep(scores, (2, 4), 1.0, min_per_layer=0)
    assert not kept.any()
    kept = heads_to_keep(scores, (2, 4), 0.25, scope="per_layer")
    assert kept.tolist() == [[True, False, True, True], [False, True, True, True]]
    first = heads_to_keep(None, (2, 4), 0.5, generator=torch.Generator().manual_seed(3))
    again = heads_to_keep(None, (2, 4), 0.5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(first, again) and int(first.sum()) == 4
    assert torch.equal(heads_to_keep(scores, (2, 4), 0.0), torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("arch", ["bert", "t5", "bart", "gpt2", "llama"])
def test_removed_heads_equal_zeroed_heads(toy_files: tuple[Path, Path], tmp_path: Path, arch: str) -> None:
    targets = {"bert": ["query", "value", "dense"], "t5": ["q", "k", "o"], "bart": ["q_proj", "v_proj", "out_proj"],
               "gpt2": ["c_attn", "c_proj"], "llama": ["q_proj", "v_proj", "o_proj"]}[arch]
    exp = tiny_experiment(toy_files, tmp_path, arch, adapter={"r": 4, "target_modules": targets})
    model = exp.backbone.model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    sites = find_head_sites(model)
    kept = [[0, 2]] * len(sites)
    kept[0], kept[-1] = [3], []  # one block keeps one head, another none (min_heads_per_layer: 0)
    batch = training_batch(exp.train_data, list(range(6)))
    model.eval()

    def run(context):  # logits and LoRA gradients under a pruning context
        model.zero_grad()
        with context(model, sites, kept):
            output = model(**batch)
        output.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_B" in n and p.grad is not None}
        return output.logits.detach(), grads

    zeroed_logits, zeroed_grads = run(masked_heads)
    removed_logits, removed_grads = run(pruned_heads)
    assert torch.allclose(zeroed_logits, removed_logits, atol=1e-4)
    for name, grad in zeroed_grads.items():  # a block with no head left gets no gradient at all
        assert torch.allclose(grad, removed_grads.get(name, torch.zeros_like(grad)), atol=1e-4), name
    full_logits = model(**batch).logits.detach()  # the context restored the model
    assert not torch.allclose(full_logits, removed_logits, atol=1e-3)


def test_flops_fall_as_sparsity_rises(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    exp = tiny_experiment(toy_files, tmp_path, model={"name": "tiny-bert", "tiny_hidden_size": 64},
                          client={"local_steps": 1}, strategy={"clients_per_round": 2, "importance_batches": 1})
    flops = []
    for sparsity in (0.0, 0.5, 0.75):
        exp.algorithm.options = exp.algorithm.options.model_copy(update={"head_sparsity": sparsity})
        task = ClientTask(client_id=0, payload=exp.initial_state)
        result, stats = exp.algorithm.client_update(exp.slot, exp.train_data, exp.shards[0], task, 1, True)
        flops.append(stats.flops_per_step)
        assert result.metrics["kept_heads"] == 8 - round(sparsity * 8)
    assert flops[0] > flops[1] > flops[2] > 0, flops


def plain_model(toy_files: tuple[Path, Path], tmp_path: Path, arch: str):
    """The tiny backbone without adapters, in eval mode, every parameter frozen."""
    train, eval_ = toy_files
    cfg = build_config(tiny_raw_config(train, eval_, tmp_path / "plain", method="headprune",
                                       model={"name": f"tiny-{arch}"}))
    task, _ = load_data(cfg)
    model = load_backbone(cfg.model, task, cfg.seed).model.eval()
    model.requires_grad_(False)
    return model


@pytest.mark.parametrize("arch", ["bert", "t5"])
def test_analytic_attention_flops_match_flop_counter(toy_files: tuple[Path, Path], tmp_path: Path, arch: str,
                                                     single_torch_thread: None) -> None:
    model = plain_model(toy_files, tmp_path, arch)
    sites = find_head_sites(model)
    site = sites[0]
    # BERT's output projection lives in the parent (BertAttention = self-attention + output); T5's in the block
    block = model.get_submodule(site.name.rsplit(".", 1)[0] if arch == "bert" else site.name)
    hidden = projection_in_features(model, site)
    tokens = 7
    for heads in ([0, 1, 2, 3], [1, 3], []):
        kept = [list(range(site.num_heads))] * len(sites)
        kept[0] = heads
        states = torch.randn(2, tokens, hidden, requires_grad=True)
        # eager attention: fused kernels recompute the scores in their backward (one product more)
        with eager_attention(model), pruned_heads(model, sites, kept):
            with FlopCounterMode(display=False) as forward:
                output = block(states)[0]
            with FlopCounterMode(display=False) as backward:
                if output.requires_grad:  # T5 without heads: o(nothing) = 0, no graph to the input
                    output.sum().backward()
        expected = [2 * attention_block_flops(tokens, hidden, len(heads), site.head_dim, backward=b)
                    for b in (False, True)]
        assert [forward.get_total_flops(), backward.get_total_flops()] == expected, heads


@pytest.mark.parametrize("arch", ["bert", "t5"])
def test_block_without_heads_is_its_residual(toy_files: tuple[Path, Path], tmp_path: Path, arch: str,
                                             single_torch_thread: None) -> None:
    """min_heads_per_layer 0: an emptied block's attention output is zero (plus the output bias), and
    the residual carries the input through, forward and backward."""
    model = plain_model(toy_files, tmp_path, arch)
    sites = find_head_sites(model)
    states = torch.randn(2, 5, projection_in_features(model, sites[0]), requires_grad=True)
    with pruned_heads(model, sites, [[]] * len(sites)):
        if arch == "bert":
            attention = model.get_submodule(sites[0].name.rsplit(".", 1)[0])
            output = attention(states)[0]
            expected = attention.output.LayerNorm(states + attention.output.dense.bias)
        else:
            layer = model.get_submodule(sites[0].name.rsplit(".", 1)[0])  # T5LayerSelfAttention: x + attn(norm(x))
            output = layer(states)[0]
            expected = states
        output.sum().backward()
    torch.testing.assert_close(output, expected)
    assert states.grad is not None and bool(torch.isfinite(states.grad).all()) and states.grad.abs().sum() > 0


@pytest.mark.parametrize("arch", ["bert", "t5"])
def test_emptied_blocks_train_and_warn(toy_files: tuple[Path, Path], tmp_path: Path, arch: str,
                                       caplog: pytest.LogCaptureFixture, single_torch_thread: None) -> None:
    """At 90% over the model (tiny BERT: 1 of 8 heads left, tiny T5: 2 of 24) Eq. 7 empties whole
    blocks; clients still train through them, and the server warns once per emptied block."""
    exp = tiny_experiment(toy_files, tmp_path, arch, client={"local_steps": 2},
                          strategy={"clients_per_round": 2, "head_sparsity": 0.9, "importance_batches": 1})
    algorithm = exp.algorithm
    assert algorithm.options.min_heads_per_layer == 0  # the paper's default
    blocks = len(algorithm.sites)
    results, emptied = [], {}
    for client in (0, 1):
        task = ClientTask(client_id=client, payload=exp.initial_state)
        result, _ = algorithm.client_update(exp.slot, exp.train_data, exp.shards[client], task, client, False)
        kept = (result.update[HEAD_SCORES_KEY] != 0)
        assert result.train_loss == result.train_loss  # not NaN
        assert result.metrics["empty_blocks"] == float((~kept.any(dim=1)).sum()) >= blocks - int(kept.sum())
        for block in torch.nonzero(~kept.any(dim=1)).flatten().tolist():
            emptied.setdefault(str(block), []).append(client)
        assert any(bool(v.abs().sum() > 0) for k, v in result.update.items() if k in algorithm.ownership)
        results.append(result)
    with caplog.at_level(logging.WARNING, logger="fedpeft.methods.headprune"):
        algorithm.aggregate(1, exp.initial_state, results)
    assert emptied and len(caplog.records) == len(emptied)  # once per block, not once per client
    assert algorithm.round_metrics(1, exp.initial_state)["emptied_blocks"] == emptied


def test_importance_timing_before_and_after(toy_files: tuple[Path, Path], tmp_path: Path,
                                            single_torch_thread: None) -> None:
    exp = tiny_experiment(toy_files, tmp_path, client={"local_steps": 3, "lr": 0.05},
                          strategy={"clients_per_round": 2, "head_sparsity": 0.5})
    algorithm, sites, ends = exp.algorithm, exp.algorithm.sites, exp.algorithm.end_ids
    batches = algorithm._importance_batches(exp.train_data, exp.shards[0], 0)
    task = ClientTask(client_id=0, payload=exp.initial_state)
    sent, flops = {}, {}
    for timing in ("before", "after"):
        algorithm.options = algorithm.options.model_copy(update={"importance_timing": timing})
        result, stats = algorithm.client_update(exp.slot, exp.train_data, exp.shards[0], task, 3, True)
        if timing == "after":  # the slot still holds the client's trained model: its scores are the ones sent
            expected = head_importance(exp.slot.model, sites, batches, ends)
        else:
            exp.slot.load(exp.initial_state)
            expected = head_importance(exp.slot.model, sites, batches, ends)
        kept = heads_to_keep(expected, algorithm.shape, 0.5)
        torch.testing.assert_close(result.update[HEAD_SCORES_KEY], expected * kept)
        sent[timing] = result.update[HEAD_SCORES_KEY]
        flops[timing] = stats.flops_per_step
        assert result.metrics["round_flops"] == stats.flops_per_step * stats.steps + result.metrics["importance_flops"]
    assert not torch.allclose(sent["before"], sent["after"])
    assert flops["after"] > flops["before"]  # scoring after training cannot prune the training


# -- sparse upload and Eq. 8 ---------------------------------------------------------------------


def test_head_weighted_aggregation_matches_hand_computation() -> None:
    # 2 blocks x 2 heads (global ids 0..3), head dim 1: "b" rows are heads 0..3; "a" is shared
    ownership = {"b": HeadOwnership(0, torch.tensor([0, 1, 2, 3]))}
    update_1 = {"b": torch.tensor([[1.0], [2.0], [0.0], [0.0]]), "a": torch.tensor([1.0, 1.0])}
    update_2 = {"b": torch.tensor([[3.0], [0.0], [5.0], [0.0]]), "a": torch.tensor([3.0, -1.0])}
    alpha_1 = torch.tensor([0.5, 0.2, 0.0, 0.0])  # client 1 kept heads 0, 1
    alpha_2 = torch.tensor([0.25, 0.0, 0.4, 0.0])  # client 2 kept heads 0, 2; head 3 kept by nobody
    delta = head_weighted_delta([update_1, update_2], [alpha_1, alpha_2], [10.0, 30.0], ownership, eps=1e-8)
    expected_b = torch.tensor([[(0.5 * 1 + 0.25 * 3) / 0.75], [2.0], [5.0], [0.0]])
    assert torch.allclose(delta["b"], expected_b, atol=1e-6)
    assert torch.allclose(delta["a"], torch.tensor([(10 * 1 + 30 * 3) / 40, (10 * 1 - 30 * 1) / 40]))
    # columns owned (output projection's A): weights broadcast along dim 1
    ownership = {"a_o": HeadOwnership(1, torch.tensor([0, 1]))}
    delta = head_weighted_delta([{"a_o": torch.ones(2, 2)}, {"a_o": 3 * torch.ones(2, 2)}],
                                [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 2.0])], [1.0, 1.0], ownership)
    assert torch.allclose(delta["a_o"], torch.tensor([[2.0, 3.0], [2.0, 3.0]]))


def test_zero_pruned_slices() -> None:
    ownership = {"b": HeadOwnership(0, torch.tensor([0, 0, 1, 1])), "a": HeadOwnership(1, torch.tensor([0, 1]))}
    update = {"b": torch.ones(4, 3), "a": torch.ones(3, 2), "other": torch.ones(2)}
    out = zero_pruned_slices(update, ownership, torch.tensor([False, True]))
    assert out["b"][:2].abs().sum() == 0 and out["b"][2:].eq(1).all()
    assert out["a"][:, 0].abs().sum() == 0 and out["a"][:, 1].eq(1).all()
    assert torch.equal(out["other"], update["other"])


def test_zero_slice_codec_is_lossless_and_smaller() -> None:
    from fedpeft.config import DirectionCodecConfig

    codec = build_codec(DirectionCodecConfig(kind="zero_slices"), "up")
    assert isinstance(codec, ZeroSliceCodec)
    rows = torch.randn(64, 8)
    rows[16:48] = 0
    cols = torch.randn(8, 64)
    cols[:, :40] = 0
    state = {"rows": rows, "cols": cols, "dense": torch.randn(8, 8), "vector": torch.randn(5)}
    message = codec.encode(state)
    decoded = codec.decode(message)
    for key, value in state.items():
        assert torch.equal(decoded[key], value), key
    dense = build_codec(DirectionCodecConfig(kind="dense"), "up").encode(state)
    saved = (32 * 8 + 40 * 8) * 4  # the zero rows and columns
    assert saved - 250 < len(dense) - len(message) < saved  # masks and their header entries cost a little
    with pytest.raises(CodecError):
        codec.decode(message[:-7])


# -- end to end ---------------------------------------------------------------------------------


def test_headprune_learns_and_uploads_only_kept_heads(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    sections = {"rounds": 8, "model": {"name": "tiny-bert", "tiny_hidden_size": 64}, "adapter": {"r": 8},
                "client": {"local_epochs": 2}, "strategy": {"clients_per_round": 2, "head_sparsity": 0.5}}
    raw = tiny_raw_config(train, eval_, tmp_path / "ours", method="headprune", **sections)
    exp = prepare(build_config(raw))
    records = LocalEngine(exp, tmp_path / "ours").run()
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert max(r["eval"]["accuracy"] for r in records[-3:]) >= 0.7  # chance is 0.5
    assert all(r["method"]["kept_heads"] == [4, 4] for r in records)
    first = records[0]["method"]  # round 1 counts FLOPs: 10 steps (2 epochs of 40 / 8) plus the importance pass
    assert first["client_flops_per_round"] == 10 * records[0]["client_flops_per_step"] + first["importance_flops"]
    assert first["attention_flops_per_example"][0] < first["attention_flops_dense_per_example"]
    # loss-gap selection gives every client a turn before anyone goes twice
    assert sorted(records[0]["clients"] + records[1]["clients"]) == [0, 1, 2, 3]

    raw_b1 = tiny_raw_config(train, eval_, tmp_path / "b1", method="headprune_b1", **{**sections, "rounds": 1})
    b1 = LocalEngine(prepare(build_config(raw_b1)), tmp_path / "b1").run()
    assert records[0]["bytes_up"][0] < b1[0]["bytes_up"][0]
    assert records[0]["bytes_down"] == b1[0]["bytes_down"]

    # one client's update: pruned heads' B rows are exactly zero, scores are Eq. 7's
    task = ClientTask(client_id=1, payload=exp.initial_state)
    result, _ = exp.algorithm.client_update(exp.slot, exp.train_data, exp.shards[1], task, 5, False)
    scores = result.update[HEAD_SCORES_KEY]
    assert int((scores != 0).sum()) == 4
    kept = (scores != 0).flatten()
    for key, own in exp.algorithm.ownership.items():
        rows = result.update[key].abs().sum(dim=1 - own.dim)
        assert torch.all(rows[~kept[own.owner]] == 0), key
        assert torch.all(rows[kept[own.owner]] > 0), key


def test_headprune_resume_is_bit_identical(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    sections = {"method": "headprune_b2", "strategy": {"selection": "loss_gap", "head_sparsity": 0.5}}
    full_raw = tiny_raw_config(train, eval_, tmp_path / "full", rounds=4, **sections)
    full = LocalEngine(prepare(build_config(full_raw)), tmp_path / "full")
    full_records = full.run()
    part_raw = tiny_raw_config(train, eval_, tmp_path / "part", rounds=2, **sections)
    LocalEngine(prepare(build_config(part_raw)), tmp_path / "part").run()
    part_raw["rounds"] = 4
    resumed = LocalEngine(prepare(build_config(part_raw)), tmp_path / "part")
    resumed_records = resumed.run(resume=True)
    assert [r["clients"] for r in resumed_records] == [r["clients"] for r in full_records]
    for key, value in full.final_state.items():
        assert torch.equal(value, resumed.final_state[key]), key


def test_bad_head_pruning_options_name_the_field(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"strategy\.head_sparsity"):
        tiny_experiment(toy_files, tmp_path, strategy={"clients_per_round": 2, "head_sparsity": 1.5})
    with pytest.raises(ConfigError, match=r"strategy\.head_pruning"):
        tiny_experiment(toy_files, tmp_path, strategy={"clients_per_round": 2, "head_pruning": "magnitude"})
    with pytest.raises(ConfigError, match=r"strategy\.head_sparcity"):
        tiny_experiment(toy_files, tmp_path, strategy={"clients_per_round": 2, "head_sparcity": 0.5})


def test_aggregate_rejects_scores_of_wrong_shape(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    exp = tiny_experiment(toy_files, tmp_path)
    bad = ClientResult(0, {HEAD_SCORES_KEY: torch.ones(3)}, 10, 0.5)
    with pytest.raises(ValueError, match=HEAD_SCORES_KEY):
        exp.algorithm.aggregate(1, exp.initial_state, [bad])


@pytest.mark.parametrize("arch", ["bert", "gpt2", "t5"])
def test_svd_init_keeps_every_kept_head_exact(toy_files: tuple[Path, Path], tmp_path: Path, arch: str) -> None:
    """FeDeRA's init with head pruning: a pruned head leaves the base weight and LoRA B (and A of the output
    projection) together, so a client's pruned model at the start equals the pretrained model pruned alike."""
    targets = {"bert": ["query", "value", "dense"], "t5": ["q", "k", "o"], "gpt2": ["c_attn", "c_proj"]}[arch]
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="headprune", model={"name": f"tiny-{arch}"}, rounds=1,
                          adapter={"r": 4, "init": "svd", "target_modules": targets})
    cfg = build_config(raw)
    task, _ = load_data(cfg)
    plain = load_backbone(cfg.model, task, cfg.seed)
    exp = prepare(cfg)
    svd_model = exp.backbone.model
    assert any(p.abs().sum() > 0 for n, p in svd_model.named_parameters() if "lora_B" in n)
    sites = find_head_sites(svd_model)
    assert [s.name for s in sites] == [s.name for s in find_head_sites(plain.model)]
    kept = [[0, 2]] * len(sites)
    kept[0] = [3]
    batch = training_batch(exp.train_data, list(range(6)))
    plain.model.eval()
    svd_model.eval()
    with torch.no_grad(), pruned_heads(plain.model, find_head_sites(plain.model), kept):
        expected = plain.model(**batch).logits
    with torch.no_grad(), pruned_heads(svd_model, sites, kept):
        got = svd_model(**batch).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    LocalEngine(exp, tmp_path / "run").run()  # and a round of the recipe runs with it


def test_headprune_benchmark_file_validates() -> None:
    """benchmarks/headprune.yaml expands and every run's head-pruning options validate (a sweep of hours
    must not die at its 30th run on a misspelt option)."""
    sweep = load_sweep(Path(__file__).resolve().parents[1] / "benchmarks" / "headprune.yaml")
    assert sweep.is_benchmark and len(sweep.spec.seeds) >= 3 and sweep.spec.tune is not None
    assert {run.task for run in sweep.runs} == {"mnli", "20newsgroups", "sst2"}  # sst2: the CPU-sized cell
    for run in sweep.runs:
        options = HeadPruneOptions.from_strategy(build_config(run.raw).strategy)
        if run.method.startswith("ours"):
            assert (options.head_sparsity, options.min_heads_per_layer) == (0.9, 0)
    assert {c.id for c in sweep.spec.claims} >= {"uplink", "accuracy", "flops"}
