"""Head pruning with head-weighted aggregation ("Assortment of Attention Heads", ``papers/003``).

One round (the paper's Algorithm 1), with the pieces this module adds to FedAvg-LoRA:

1. **Importance** (Eq. 6): each selected client scores every attention head of the model it
   received (encoder and decoder self-attention, cross-attention) by Voita's confidence, in a
   no-grad pass over its data (:func:`fedpeft.models.heads.head_importance`).
2. **Pruning** (Eq. 7): it keeps the heads at or above the threshold that gives the target
   sparsity (:func:`heads_to_keep`: global over the model by default, or per attention block;
   each block keeps ``min_heads_per_layer`` heads) and sets the others' scores to 0. Pruned
   heads are *removed* while it trains (:func:`fedpeft.models.heads.pruned_heads` slices the
   q/k/v/o projections), so its FLOPs really fall, and their parameters get no update.
3. **Sparse upload**: head ``h`` owns rows ``[h*d, (h+1)*d)`` of LoRA ``B`` of q/k/v (columns of
   ``A`` of the output projection when targeted). Pruned heads' slices of the update are exactly
   zero and the ``zero_slices`` codec (:class:`ZeroSliceCodec`) leaves them off the wire; LoRA
   ``A`` of q/k/v and the task head go dense. The Eq. 7 scores travel with the update under
   :data:`HEAD_SCORES_KEY`, so the recorded bytes include them.
4. **Aggregation**: each head's slices by Eq. 8, ``p <- p + eta * sum_c a_hc d_hc / (sum_c a_hc +
   eps)`` (a pruned head has ``a_hc = 0``, so only clients that kept it count; a head no client
   kept does not move), everything else sample-weighted (Eq. 5), through the configured server
   strategy (``fedavg``: ``eta = strategy.server_lr``).
5. **Selection** (Eq. 9): ``strategy.selection: loss_gap`` (:mod:`fedpeft.methods.loss_gap`).

Ablations of the paper's Table 1 are options of the same algorithm: B1 (FedAvg-LoRA) is
``head_pruning: none, head_aggregation: samples``; B2 (FedAvg + random pruning) is
``head_pruning: random, head_aggregation: samples`` (a head's slices averaged, sample-weighted,
over the clients that kept it). Their recipes use the same lossless ``zero_slices`` codec, which
also drops slices that are zero for other reasons (LoRA ``A`` gets no gradient while ``B`` is 0,
so after a single local step from ``B = 0`` its update is exactly zero).

Choices where the paper is silent (config options where reasonable people differ):

- ``importance_timing`` (default ``before``): importance is measured once per round, *before*
  local training, on the received global model, so that pruning can save the training's compute;
  the same scores weight Eq. 8. Algorithm 1 lists "compute importance" *after* local training;
  ``after`` follows that order literally: the client trains every head, scores its trained model,
  and Eq. 7 then prunes only what it uploads (no training compute saved). ``before`` is the default
  because the paper's own figures need it: Sec. 3.1 prunes "to increase the efficiency of the local
  training", and Table 1's OPs (8.47G at 90% vs 33.07G) are those of training a pruned model, which
  scoring after training cannot give.
- Eq. 7 may leave an attention block with no head (``min_heads_per_layer: 0``, the paper's rule:
  the threshold is global). Such a block adds only its output projection's bias to the residual;
  the server logs a warning per block and round and records it under ``emptied_blocks``. On a
  shallow model this is what costs accuracy: on MiniLM (6 x 12 heads) at 90%, scored before
  training, the 7 kept heads sit in the lower layers (the last layer empty in every client round), and
  ``pruning_scope: per_layer`` (one head a layer) or ``min_heads_per_layer: 1`` wins back about 12 of
  the 18 points ours lost to B1 on 20 Newsgroups (``benchmarks/results/headprune_20ng.md``), though
  not on MNLI, where ours ends about 10 points behind B1 with or without it (``headprune_mnli.md``); the
  default stays the paper's global rule. What does keep MNLI within a few points on MiniLM is less
  pruning: at ``head_sparsity: 0.5``, each arm's lr tuned on MNLI, ours ends 2.6 points behind B1
  (within noise of 2 points over 3 seeds; ``headprune_mnli_tuned.md``).
- FLOPs: the round's ``client_flops_per_round`` (``FlopCounterMode``: the first step's count times
  the steps, plus the importance pass over the shard) sits beside the engine's per-step figure;
  ``attention_flops_per_example`` is the analytic count of the attention blocks alone (forward and
  backward at ``task.max_length``, :func:`fedpeft.metrics.flops.attention_block_flops`), the
  accounting of the paper's OPs column, for a like-for-like look at its 3.9x.
- Eq. 6 writes ``max(q . k)``; following the cited Voita et al. (2019) the score is the maximum
  *softmax* attention weight, averaged over query tokens, then over examples.
- Padding is never a query or a key; end-of-sequence / separator tokens are excluded as both by
  default (``importance_exclude``: ``both | keys | queries | none``).
- The sparsity is a count: ``round(sparsity * heads)`` heads are pruned (fewer if
  ``min_heads_per_layer`` forbids; 0 by default, as in the paper); ties in importance go to the lower head index.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors.torch import save as st_save
from torch.utils.flop_counter import FlopCounterMode

from fedpeft.config import ConfigError, ExperimentConfig, StrategyConfig
from fedpeft.federated.algorithm import Algorithm, MethodContext, register_algorithm
from fedpeft.federated.client import ModelSlot, TrainStats, train_client
from fedpeft.federated.codec import Codec, CodecError, _load, check_dtype, read_metadata, register_codec
from fedpeft.federated.strategy.robust import clipped_if_robust
from fedpeft.federated.types import ClientResult, ClientTask, State
from fedpeft.metrics.flops import attention_block_flops
from fedpeft.models.encoding import EncodedData, training_batch
from fedpeft.models.heads import (
    HeadOwnership,
    end_token_ids,
    find_head_sites,
    head_importance,
    head_ownership,
    projection_in_features,
    pruned_heads,
)
from fedpeft.seeding import derive_seed

logger = logging.getLogger(__name__)

HEAD_SCORES_KEY = "headprune.scores"
"""Update key of a client's Eq. 7 scores, shape (attention blocks, heads); 0 marks a pruned head.
When importance is not measured (random pruning, sample-weighted aggregation) kept heads send 1."""


class HeadPruneOptions(BaseModel):
    """The ``strategy.*`` fields of head pruning (validated here; the strategy section allows extras)."""

    model_config = ConfigDict(extra="ignore")

    head_pruning: Literal["importance", "random", "none"] = "importance"
    head_sparsity: float = Field(0.9, ge=0.0, le=1.0)
    pruning_scope: Literal["global", "per_layer"] = "global"
    min_heads_per_layer: int = Field(0, ge=0)
    importance_timing: Literal["before", "after"] = "before"
    head_aggregation: Literal["importance", "samples"] = "importance"
    aggregation_eps: float = Field(1e-8, gt=0.0)
    importance_batches: int | None = Field(None, gt=0)
    importance_exclude: Literal["both", "keys", "queries", "none"] = "both"

    @classmethod
    def from_strategy(cls, cfg: StrategyConfig) -> HeadPruneOptions:
        try:  # a misspelt field never gets here: build_config's check_strategy_fields refuses it
            return cls.model_validate(cfg.model_extra or {})
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"strategy.{field}", first["msg"]) from None

    @property
    def measures_importance(self) -> bool:
        return self.head_pruning == "importance" or self.head_aggregation == "importance"

    @property
    def sends_scores(self) -> bool:
        return self.head_pruning != "none" or self.head_aggregation == "importance"


# ----------------------------------------------------------------------------------------------
# Eq. 7: which heads a client keeps


def heads_to_keep(scores: torch.Tensor | None, shape: tuple[int, int], sparsity: float,
                  scope: Literal["global", "per_layer"] = "global", min_per_layer: int = 0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Boolean ``(blocks, heads)`` mask of the heads kept at ``sparsity``.

    With ``scores`` the lowest-scoring heads are pruned (Eq. 7's threshold; ties: lower index
    first); without, a uniformly random set (``generator``) is. ``global`` prunes
    ``round(sparsity * blocks * heads)`` heads over the whole model, skipping a head whose
    pruning would leave its block with fewer than ``min_per_layer``; ``per_layer`` prunes
    ``round(sparsity * heads)`` in every block, at most ``heads - min_per_layer``.
    """
    blocks, heads = shape
    priority = torch.rand(shape, generator=generator) if scores is None else scores.detach().float()
    kept = torch.ones(shape, dtype=torch.bool)
    if scope == "per_layer":
        count = min(math.floor(sparsity * heads + 0.5), max(heads - min_per_layer, 0))
        for block in range(blocks):
            order = torch.argsort(priority[block], stable=True)
            kept[block, order[:count]] = False
        return kept
    target = math.floor(sparsity * blocks * heads + 0.5)
    left = [heads] * blocks
    pruned = 0
    for flat in torch.argsort(priority.flatten(), stable=True).tolist():
        if pruned == target:
            break
        block, head = divmod(flat, heads)
        if left[block] > min_per_layer:
            kept[block, head] = False
            left[block] -= 1
            pruned += 1
    return kept


def zero_pruned_slices(update: State, ownership: dict[str, HeadOwnership], kept: torch.Tensor) -> State:
    """Set the pruned heads' slices of ``update`` to exactly 0 (they got no gradient; this also
    undoes weight decay, so "no update" holds for every optimizer). ``kept`` is flat over heads."""
    out = dict(update)
    for key, own in ownership.items():
        if key in out:
            out[key] = out[key].masked_fill(~_along(kept[own.owner], own.dim, out[key].dim()), 0.0)
    return out


def _along(values: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    shape = [1] * ndim
    shape[dim] = -1
    return values.view(shape)


# ----------------------------------------------------------------------------------------------
# Eq. 8 + Eq. 5: the aggregated update


def head_weighted_delta(updates: Sequence[State], head_weights: Sequence[torch.Tensor],
                        sample_weights: Sequence[float], ownership: dict[str, HeadOwnership],
                        eps: float = 1e-8) -> State:
    """The averaged update (before the server step) of head-owned and other tensors.

    Head-owned slices (Eq. 8): ``sum_c w_hc * d_hc / (sum_c w_hc + eps)`` with ``head_weights[c]``
    a flat per-head tensor (Eq. 7's scores: zero for a pruned head; or ``|D_c|`` for kept heads in
    the sample-weighted ablation). Every other tensor (Eq. 5): ``sum_c |D_c| d_c / sum_c |D_c|``
    over the clients that sent it.
    """
    keys = sorted({k for update in updates for k in update})
    delta: State = {}
    for key in keys:
        senders = [(i, u[key].to(torch.float32)) for i, u in enumerate(updates) if key in u]
        if key in ownership:
            own = ownership[key]
            numerator = torch.zeros_like(senders[0][1])
            denominator = torch.zeros(own.owner.numel())
            for i, value in senders:
                weight = head_weights[i].to(torch.float32)[own.owner]
                numerator += _along(weight, own.dim, value.dim()) * value
                denominator += weight
            delta[key] = numerator / _along(denominator + eps, own.dim, numerator.dim())
        else:
            mass = sum(float(sample_weights[i]) for i, _ in senders)
            delta[key] = sum(float(sample_weights[i]) * value for i, value in senders) / mass
    return delta


# ----------------------------------------------------------------------------------------------
# The round logic


@register_algorithm
class HeadPruning(Algorithm):
    """FedAvg-LoRA with per-client head pruning (Eq. 6-7), sparse upload and Eq. 8 aggregation."""

    name = "headprune"
    strategy_options = (HeadPruneOptions,)
    robust_aggregations = ("none", "clip")  # Eq. 8 weights heads by importance: no median / trimmed mean
    server_dp = False  # Eq. 8 + the strategy's step, not strategy.aggregate

    def __init__(self, cfg: ExperimentConfig, ctx: MethodContext) -> None:
        super().__init__(cfg, ctx)
        self.options = HeadPruneOptions.from_strategy(cfg.strategy)
        model = ctx.backbone.model
        self.sites = find_head_sites(model)
        self.shape = (len(self.sites), self.sites[0].num_heads)
        trainable = set(ctx.slot.trainable)
        self.ownership = {k: v for k, v in head_ownership(model, self.sites).items() if k in trainable}
        self.end_ids = end_token_ids(ctx.backbone.tokenizer)
        self.widths = [projection_in_features(model, site) for site in self.sites]
        self._round: dict[str, Any] = {}

    # -- client side --------------------------------------------------------------------------

    def _importance_batches(self, data: EncodedData, shard: np.ndarray, seed: int) -> list[dict[str, torch.Tensor]]:
        """The client's data in batches of ``client.batch_size`` (a seeded subset of
        ``importance_batches`` batches when set)."""
        positions = [int(i) for i in shard]
        size = self.cfg.client.batch_size
        limit = self.options.importance_batches
        if limit is not None and limit * size < len(positions):
            order = torch.randperm(len(positions), generator=torch.Generator().manual_seed(seed))
            positions = sorted(positions[i] for i in order[: limit * size].tolist())
        return [training_batch(data, positions[i : i + size]) for i in range(0, len(positions), size)]

    def _measure_importance(self, slot: ModelSlot, data: EncodedData, shard: np.ndarray, seed: int,
                            count_flops: bool) -> tuple[torch.Tensor, float, int | None]:
        """Eq. 6 on the model now in ``slot``: (scores, seconds, FLOPs of the pass when counted)."""
        t0 = time.perf_counter()
        batches = self._importance_batches(data, shard, derive_seed(seed, "headprune.importance"))
        counter = FlopCounterMode(display=False) if count_flops else None
        with counter if counter is not None else nullcontext():
            scores = head_importance(slot.model, self.sites, batches, self.end_ids, self.options.importance_exclude)
        flops = int(counter.get_total_flops()) if counter is not None else None
        return scores, time.perf_counter() - t0, flops

    def _kept(self, scores: torch.Tensor | None, seed: int) -> torch.Tensor:
        """Eq. 7's mask of kept heads (all of them without pruning)."""
        opts = self.options
        if opts.head_pruning == "none":
            return torch.ones(self.shape, dtype=torch.bool)
        generator = torch.Generator().manual_seed(derive_seed(seed, "headprune.random"))
        return heads_to_keep(scores if opts.head_pruning == "importance" else None, self.shape,
                             opts.head_sparsity, opts.pruning_scope, opts.min_heads_per_layer, generator)

    def client_update(self, slot: ModelSlot, data: EncodedData, shard: np.ndarray, task: ClientTask,
                      seed: int, count_flops: bool) -> tuple[ClientResult, TrainStats]:
        """Score, prune, train (``importance_timing: before``) or train, score, prune the upload (``after``)."""
        opts = self.options
        scores: torch.Tensor | None = None
        importance_seconds, importance_flops = 0.0, None
        before = opts.importance_timing == "before"
        if before:
            t0 = time.perf_counter()
            slot.load(task.payload)
            if opts.measures_importance:
                scores, _, importance_flops = self._measure_importance(slot, data, shard, seed, count_flops)
            importance_seconds = time.perf_counter() - t0
        kept = self._kept(scores, seed) if before else torch.ones(self.shape, dtype=torch.bool)
        with pruned_heads(slot.model, self.sites, [torch.nonzero(row).flatten().tolist() for row in kept]):
            result, stats = train_client(slot, data, shard, task, self.cfg.client, seed, count_flops)
        if not before:  # Alg. 1's order: the locally trained model (every head) is scored, then pruned
            if opts.measures_importance:
                scores, importance_seconds, importance_flops = self._measure_importance(slot, data, shard, seed,
                                                                                        count_flops)
            kept = self._kept(scores, seed)

        result.update = zero_pruned_slices(result.update, self.ownership, kept.flatten())
        if opts.sends_scores:  # Eq. 7: pruned heads score 0
            result.update[HEAD_SCORES_KEY] = scores * kept if scores is not None else kept.float()
        result.metrics["kept_heads"] = float(kept.sum())
        result.metrics["empty_blocks"] = float((~kept.any(dim=1)).sum())
        result.metrics["importance_seconds"] = importance_seconds
        if importance_flops is not None:
            result.metrics["importance_flops"] = float(importance_flops)
        if stats.flops_per_step is not None:  # the round's training (steps x the first step's count) + scoring
            result.metrics["round_flops"] = float(stats.flops_per_step * stats.steps + (importance_flops or 0))
        stats.total_seconds += importance_seconds
        return result, stats

    def extra_upload_shapes(self, task: ClientTask) -> dict[str, torch.Size]:
        return {HEAD_SCORES_KEY: torch.Size(self.shape)} if self.options.sends_scores else {}

    # -- server side --------------------------------------------------------------------------

    def aggregate(self, round_idx: int, global_state: State, results: Sequence[ClientResult]) -> State:
        updates, head_weights, scores = [], [], []
        for r in results:
            sent = r.update.get(HEAD_SCORES_KEY)
            if sent is not None and tuple(sent.shape) != self.shape:
                raise ValueError(f"client {r.client_id}: {HEAD_SCORES_KEY} has shape {tuple(sent.shape)}, "
                                 f"expected {self.shape}")
            score = torch.ones(self.shape) if sent is None else sent.to(torch.float32)
            kept = score != 0
            weight = score if self.options.head_aggregation == "importance" else kept.float() * float(r.num_samples)
            updates.append(clipped_if_robust(self.cfg.strategy,
                                             {k: v for k, v in r.update.items() if k != HEAD_SCORES_KEY}))
            head_weights.append(weight.flatten())
            scores.append(score)
        delta = head_weighted_delta(updates, head_weights, [float(r.num_samples) for r in results],
                                    self.ownership, self.options.aggregation_eps)
        self._round = self._describe(results, scores)
        for block, clients in self._round["emptied_blocks"].items():  # one warning per block and round
            logger.warning("round %d: attention block %s (%s) lost every head at client(s) %s", round_idx, block,
                           self.sites[int(block)].name, clients)
        return self.strategy.step(global_state, delta)

    def _describe(self, results: Sequence[ClientResult], scores: Sequence[torch.Tensor]) -> dict[str, Any]:
        kept = torch.stack([s != 0 for s in scores]) if scores else torch.zeros((0, *self.shape), dtype=torch.bool)
        total = self.shape[0] * self.shape[1]
        emptied: dict[str, list[int]] = {}
        for result, client_kept in zip(results, kept):
            for block in torch.nonzero(~client_kept.any(dim=1)).flatten().tolist():
                emptied.setdefault(str(block), []).append(int(result.client_id))
        info: dict[str, Any] = {
            "kept_heads": [int(k.sum()) for k in kept],
            "emptied_blocks": emptied,
            "attention_flops_per_example": [self.attention_flops(k) for k in kept],
            "attention_flops_dense_per_example": self.attention_flops(torch.ones(self.shape, dtype=torch.bool)),
            "head_sparsity": 1.0 - float(kept.float().mean()) if len(kept) else 0.0,
            "heads_updated": int(kept.any(dim=0).sum()) if len(kept) else 0,
            "heads_total": total,
        }
        if self.options.measures_importance and len(scores) > 1:
            flat = torch.stack([s.flatten() for s in scores])
            # mean pairwise Euclidean distance of the clients' scores as the server gets them (Eq. 7:
            # pruned heads 0), the quantity of the paper's Fig. 5b
            info["importance_distance"] = float(torch.pdist(flat).mean())
        for key, name in (("importance_flops", "importance_flops"), ("round_flops", "client_flops_per_round")):
            measured = [r.metrics[key] for r in results if key in r.metrics]
            if measured:  # the client that counted (engine.measure_flops), beside client_flops_per_step
                info[name] = measured[0]
        return info

    def attention_flops(self, kept: torch.Tensor) -> int:
        """Analytic forward + backward FLOPs of every attention block for one example at
        ``task.max_length`` tokens with the ``kept`` heads (papers/003 App. A's accounting of the
        attention block, like for like with its OPs column; frozen projections, LoRA not counted)."""
        tokens = self.cfg.task.max_length
        return sum(attention_block_flops(tokens, hidden, int(heads), site.head_dim, backward=backward)
                   for site, hidden, heads in zip(self.sites, self.widths, kept.sum(dim=1).tolist())
                   for backward in (False, True))

    def round_metrics(self, round_idx: int, global_state: State) -> dict[str, Any]:
        return dict(self._round)


# ----------------------------------------------------------------------------------------------
# The wire: all-zero rows or columns stay home


@register_codec
class ZeroSliceCodec(Codec):
    """Lossless codec that drops the all-zero rows (or columns) of 2-D tensors.

    For each 2-D tensor it sends whichever is smallest: the dense tensor, its nonzero rows plus a
    one-bit-per-row mask, or its nonzero columns plus a one-bit-per-column mask. Pruned heads'
    slices of a head-pruning update are such rows (LoRA ``B`` of q/k/v) or columns (LoRA ``A`` of
    the output projection), so they cost one bit each. Masks are packed ``uint8`` tensors named
    ``<key>::rows`` / ``<key>::cols``; the metadata's ``layout`` maps each compacted key to its
    mode and full length along that dimension (keys not listed went dense).
    """

    kind = "zero_slices"

    def encode(self, state: State) -> bytes:
        tensors: dict[str, torch.Tensor] = {}
        layout: dict[str, list[Any]] = {}
        for key, value in state.items():
            value = value.detach().to(self.wire_dtype)
            mode, kept, data = self._compact(value)
            tensors[key] = data.contiguous()
            if kept is not None:
                tensors[f"{key}::{mode}"] = torch.from_numpy(np.packbits(kept.numpy()))
                layout[key] = [mode, int(kept.numel())]
        metadata = {**self._metadata(), "layout": json.dumps(layout, separators=(",", ":"))}
        return st_save(tensors, metadata=metadata)

    @staticmethod
    def _compact(value: torch.Tensor) -> tuple[str, torch.Tensor | None, torch.Tensor]:
        if value.dim() != 2 or value.numel() == 0:
            return "dense", None, value
        width = value.element_size()
        nonzero = value != 0
        rows, cols = nonzero.any(dim=1), nonzero.any(dim=0)
        costs = {
            "dense": value.numel() * width,
            "rows": int(rows.sum()) * value.shape[1] * width + math.ceil(value.shape[0] / 8),
            "cols": int(cols.sum()) * value.shape[0] * width + math.ceil(value.shape[1] / 8),
        }
        mode = min(costs, key=lambda m: (costs[m], m != "dense"))
        if mode == "rows":
            return mode, rows, value[rows]
        if mode == "cols":
            return mode, cols, value[:, cols]
        return mode, None, value

    def decode(self, message: bytes) -> State:
        tensors = _load(message, self.kind)
        try:
            layout = json.loads(read_metadata(message)["layout"])
        except (KeyError, json.JSONDecodeError) as err:
            raise CodecError(f"zero_slices message without a valid layout: {err}") from err
        if not isinstance(layout, dict) or not all(
                isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], int)
                for v in layout.values()):
            raise CodecError("zero_slices layout must map each key to [mode, length]")
        masks = {f"{key}::{mode}" for key, (mode, _) in layout.items()}
        for key in tensors.keys() - masks:
            check_dtype(key, tensors[key], self.wire_dtype)
        try:
            return {key: self._expand(tensors, key, *layout.get(key, ("dense", 0)))
                    for key in tensors if key not in masks}
        except (KeyError, IndexError, RuntimeError, ValueError, TypeError) as err:
            raise CodecError(f"corrupt zero_slices message: {err}") from err

    @staticmethod
    def _expand(tensors: dict[str, torch.Tensor], key: str, mode: str, length: int) -> torch.Tensor:
        data = tensors[key].to(torch.float32)
        if mode == "dense":
            return data
        if mode not in ("rows", "cols"):
            raise ValueError(f"unknown layout {mode!r} for {key}")
        kept = torch.from_numpy(np.unpackbits(tensors[f"{key}::{mode}"].numpy())[:length].astype(bool))
        if mode == "rows":
            full = data.new_zeros(length, data.shape[1])
            full[kept] = data
        else:
            full = data.new_zeros(data.shape[0], length)
            full[:, kept] = data
        return full
