"""FedTT / FedTT+ vs LoRA r=8: the bytes of one client upload, per backbone (no training).

FedTT's abstract promises "up to 10x" less communication than LoRA; the issue's base-width run
found 4.4x (FedTT) and 12.3x (FedTT+). This benchmark finds where the ratio holds by encoding each
method's real upload with the real codec (``len()`` of the message): every trainable tensor for
LoRA r=8 (query/value, alpha 16) and FedTT; for FedTT+ the keys of Alg. 2 (G_1, G_r, G_J of every
adapter TT layer + the head), averaged over a whole round-robin cycle of rounds (the middle cores
differ in size). Each method with and without the tensorized classifier (FedTT Fig. 1c:
``adapter.tt_classifier``) where the head has a dense hidden x hidden layer, and in both wire
formats: safetensors (a JSON entry per tensor; the default) and ``codec.up.pack: true`` (one
buffer, 17 bytes + a bitmask of header).

Backbones:

- ``minilm``: all-MiniLM-L6-v2 (384 hidden, 6 layers; its BERT pooler is pretrained);
- ``mpnet``: all-mpnet-base-v2 (768 hidden, 12 layers, the papers' base width, the same matrix
  shapes as DeBERTa-base): real weights when ``fedpeft[mpnet]`` is installed, else its config
  with random weights (the same shapes, so the same bytes);
- ``llama2-7b``: LLaMA-2-7B's config (4096 hidden, 11008 MLP, 32 layers) built on PyTorch's
  ``meta`` device (no weights); the trainable tensors' shapes are read off the adapted model and
  the messages are encoded from zero tensors of those shapes (exact lengths: values do not change
  them). Both adapter layouts: LoRETTA's MLP adapters (``decoder_layout: loretta``, 3 per layer)
  and the paper's text (``after_blocks``, 2 per layer); LLaMA has no dense classifier layer.

Every model gets a 2-label sequence-classification head, trained by every method.

Outputs: ``benchmarks/results/fedtt_bytes.{json,md,png}``, each starting with its command.
Run: ``.venv/bin/python benchmarks/fedtt_bytes.py`` (about a minute; ``--backbones`` picks some).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, LlamaConfig

from fedpeft.adapters.base import build_adapter
from fedpeft.adapters.tt import tt_layers
from fedpeft.config import ConfigError, DirectionCodecConfig, ModelConfig, build_config
from fedpeft.data.types import TaskData
from fedpeft.federated.algorithm import MethodContext
from fedpeft.federated.client import ModelSlot
from fedpeft.federated.codec import build_codec, schema_of
from fedpeft.methods.fedtt import FedTTPlus
from fedpeft.models.backbone import Backbone, load_backbone
from fedpeft.models.mpnet import mpnet_parts

RESULTS = Path(__file__).resolve().parent / "results"
BACKBONES = ("minilm", "mpnet", "llama2-7b")
TASK = TaskData(name="binary", problem_type="classification", label_names=("neg", "pos"), metrics=("accuracy",))
PAPER_DEBERTA_BASE = {"lora_r8": 0.30e6, "fedtt": 0.06e6, "fedtt_plus": 0.02e6}
"""FedTT's parameter table (Table 1, DeBERTa-base): trainable parameters per method."""
LLAMA2_7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096}
MPNET_BASE = {"vocab_size": 30527, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
              "intermediate_size": 3072, "max_position_embeddings": 514}
"""all-mpnet-base-v2's config.json, for a random-weight stand-in when the extra is not installed."""


def arms(backbone: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, method, adapter overrides) measured on ``backbone``."""
    if backbone == "llama2-7b":
        tt = [(f"{m}_{layout}", m, {"decoder_layout": layout}) for m in ("fedtt", "fedtt_plus")
              for layout in ("loretta", "after_blocks")]
    else:
        tt = [(f"{m}{'_ttcls' if cls else ''}", m, {"tt_classifier": cls}) for m in ("fedtt", "fedtt_plus")
              for cls in (False, True)]
    return [("lora_r8", "lora", {}), *tt]


def load(backbone: str, seed: int) -> tuple[Backbone, str]:
    """A fresh ``backbone`` with a 2-label head, and where its weights come from."""
    if backbone == "llama2-7b":
        config = LlamaConfig(**LLAMA2_7B, num_labels=2, pad_token_id=0)
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(config)
        return Backbone(model=model, tokenizer=None, architecture="decoder",  # type: ignore[arg-type]
                        head="sequence_classification", name=backbone,
                        new_parameters=("score.weight",)), "LLaMA-2-7B config on the meta device (no weights)"
    if backbone == "mpnet":
        try:
            mpnet_parts()
        except ConfigError:
            config = AutoConfig.for_model("mpnet", **MPNET_BASE, num_labels=2)
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_config(config)
            head = tuple(n for n, _ in model.named_parameters() if n.startswith("classifier."))
            return Backbone(model=model, tokenizer=None, architecture="encoder",  # type: ignore[arg-type]
                            head="sequence_classification", name=backbone, new_parameters=head), \
                "all-mpnet-base-v2's config, random weights (fedpeft[mpnet] not installed)"
    return load_backbone(ModelConfig(name=backbone), TASK, seed), "real weights"


def upload_sizes(state: dict[str, torch.Tensor], rounds: list[frozenset[str]]) -> dict[str, Any]:
    """Mean (and range) over ``rounds`` of the upload message of each round's keys, both wire formats."""
    real = {k: torch.zeros(v.shape) for k, v in state.items()}  # meta tensors have no bytes to send
    schema = schema_of(real)
    out: dict[str, Any] = {}
    for fmt, pack in (("safetensors", False), ("packed", True)):
        codec = build_codec(DirectionCodecConfig(pack=pack), "up", schema)
        sizes = [len(codec.encode({k: real[k] for k in sorted(keys)})) for keys in rounds]
        out[fmt] = {"mean": sum(sizes) / len(sizes), "min": min(sizes), "max": max(sizes)}
    params = [sum(state[k].numel() for k in keys) for keys in rounds]
    out["params"] = sum(params) / len(params)
    out["tensors"] = sum(len(keys) for keys in rounds) / len(rounds)
    return out


def measure(backbone: str, label: str, method: str, adapter: dict[str, Any], seed: int) -> dict[str, Any]:
    cfg = build_config({"method": method, "seed": seed, "adapter": adapter, "model": {"name": backbone},
                        "strategy": {"selection": "all"}})
    model, source = load(backbone, seed)
    build_adapter(cfg.adapter).apply(model)
    trainable = [n for n, p in model.model.named_parameters() if p.requires_grad]
    state = {n: p.detach() for n, p in model.model.named_parameters() if p.requires_grad}
    # the head: what is neither an adapter nor LoRA (the classifier, a tensorized pooler/dense layer, LLaMA's score)
    head = {k for k in trainable if ".adapter." not in k and "lora_" not in k}
    if method == "fedtt_plus":
        ctx = MethodContext(backbone=model, slot=ModelSlot(model.model, trainable), task=TASK, shards=[],
                            train_data=None)  # type: ignore[arg-type]
        algorithm = FedTTPlus(cfg, ctx)
        cycle = math.lcm(*(max(1, j - 2) for j in algorithm.round_robin.values()))
        rounds = [algorithm.round_keys(t) for t in range(1, cycle + 1)]
    else:
        rounds = [frozenset(trainable)]
    sizes = upload_sizes(state, rounds)
    layers = tt_layers(model.model)
    return {
        "backbone": backbone, "weights": source, "arm": label, "method": method, "adapter": adapter,
        "rounds_averaged": len(rounds), **sizes,
        "head_params": sum(state[k].numel() for k in head),
        "adapter_params": sizes["params"] - sum(state[k].numel() for k in head),  # the head goes up every round
        "tt_classifier": any(".adapter." not in f".{n}." for n in layers),
        "tt_modes": sorted({f"{m.in_features}x{m.out_features}: {m.modes}" for m in layers.values()}),
    }


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def ratios(rows: list[dict[str, Any]]) -> None:
    """Add each row's LoRA-r=8-to-this ratio (same backbone, same wire format) in place."""
    for row in rows:
        lora = next(r for r in rows if r["backbone"] == row["backbone"] and r["arm"] == "lora_r8")
        row["lora_ratio"] = {fmt: lora[fmt]["mean"] / row[fmt]["mean"] for fmt in ("safetensors", "packed")}
        row["lora_ratio_params"] = lora["params"] / row["params"]
        row["lora_ratio_adapter_params"] = lora["adapter_params"] / row["adapter_params"]


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Command: `{result['command']}`", "", "# FedTT / FedTT+ vs LoRA r=8: bytes of one client upload", "",
             f"Machine: {result['machine']}", "", result["setup"], ""]
    for backbone in result["backbones"]:
        rows = [r for r in result["rows"] if r["backbone"] == backbone]
        lines += [f"## {backbone} ({rows[0]['weights']})", "",
                  "| arm | params sent / round | of which head | tensors | safetensors message | vs LoRA r=8 "
                  "| packed message | vs LoRA r=8 | header share (safetensors) | adapter params (no head) "
                  "| vs LoRA r=8 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            header = 1 - 4 * r["params"] / r["safetensors"]["mean"]
            lines.append(
                f"| {r['arm']} | {r['params']:,.0f} | {r['head_params']:,} | {r['tensors']:.0f} "
                f"| {fmt_bytes(r['safetensors']['mean'])} | {r['lora_ratio']['safetensors']:.1f}x "
                f"| {fmt_bytes(r['packed']['mean'])} | {r['lora_ratio']['packed']:.1f}x | {header:.0%} "
                f"| {r['adapter_params']:,.0f} | {r['lora_ratio_adapter_params']:.1f}x |")
        lines.append("")
    lines += ["## Against the paper's parameter table (DeBERTa-base; MPNet-base has the same matrix shapes)", "",
              "| method | paper | ours, MPNet-base, adapters only | ours, with the head sent |", "|---|---|---|---|"]
    for method, paper in PAPER_DEBERTA_BASE.items():
        arm = {"lora_r8": "lora_r8", "fedtt": "fedtt_ttcls", "fedtt_plus": "fedtt_plus_ttcls"}[method]
        row = next((r for r in result["rows"] if r["backbone"] == "mpnet" and r["arm"] == arm), None)
        if row is not None:
            lines.append(f"| {method} ({arm}) | {paper / 1e6:.2f}M | {row['adapter_params'] / 1e6:.3f}M "
                         f"| {row['params'] / 1e6:.3f}M |")
    lines += ["", "![upload bytes](fedtt_bytes.png)", ""]
    if result.get("notes"):
        lines += ["## What this shows", "", *result["notes"], ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backbones = result["backbones"]
    fig, axes = plt.subplots(1, len(backbones), figsize=(5.0 * len(backbones), 4.6), squeeze=False)
    for ax, backbone in zip(axes[0], backbones):
        rows = [r for r in result["rows"] if r["backbone"] == backbone]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["safetensors"]["mean"] / 1e3 for r in rows], 0.4, label="safetensors")
        ax.bar([i + 0.2 for i in x], [r["packed"]["mean"] / 1e3 for r in rows], 0.4, label="packed")
        for i, r in enumerate(rows):
            ax.text(i, r["safetensors"]["mean"] / 1e3, f"{r['lora_ratio']['packed']:.1f}x", ha="center",
                    va="bottom", fontsize=7)
        ax.set_xticks(list(x), [r["arm"] for r in rows], rotation=45, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("upload per client and round (KB)")
        ax.set_title(backbone)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{result['command']}\nlabels: LoRA r=8 bytes / this arm's bytes (packed)", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fedtt_bytes.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backbones", default=",".join(BACKBONES), help="subset of: " + ", ".join(BACKBONES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    backbones = [b.strip() for b in args.backbones.split(",") if b.strip()]
    unknown = [b for b in backbones if b not in BACKBONES]
    if unknown:
        parser.error(f"unknown backbones {unknown}; allowed: {', '.join(BACKBONES)}")
    torch.set_num_threads(1)
    rows = []
    for backbone in backbones:
        for label, method, adapter in arms(backbone):
            rows.append(measure(backbone, label, method, adapter, args.seed))
            print(f"{backbone} {label}: {rows[-1]['params']:,.0f} params, {rows[-1]['packed']['mean']:,.0f} B packed, "
                  f"{rows[-1]['safetensors']['mean']:,.0f} B safetensors", flush=True)
    ratios(rows)
    result = {
        "command": " ".join(["python benchmarks/fedtt_bytes.py", *(argv if argv is not None else sys.argv[1:])]),
        "benchmark": "fedtt_bytes",
        "machine": f"{platform.machine()} {platform.system()}, Python {platform.python_version()}, "
                   f"torch {torch.__version__}",
        "setup": ("One client's upload in one round, fp32, `len()` of the real message. LoRA r=8 (alpha 16) on the "
                  "attention query/value projections (MPNet q/v, LLaMA q_proj/v_proj); FedTT/FedTT+: the recipes' "
                  "TT adapters (bottleneck 64, rank 5) after attention and FFN outputs, `_ttcls`: with the "
                  "tensorized classifier (`adapter.tt_classifier: true`; MPNet's recipe default `auto` turns it "
                  "on, MiniLM's leaves its pretrained pooler); FedTT+ averaged over a round-robin cycle. Every "
                  "arm also sends its 2-label head. `packed`: `codec.up.pack: true`."),
        "backbones": backbones,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    notes = out / "fedtt_bytes_notes.md"
    if notes.exists():
        result["notes"] = notes.read_text().strip().splitlines()
    (out / "fedtt_bytes.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "fedtt_bytes.md").write_text(markdown(result))
    plot(result, out)
    print((out / "fedtt_bytes.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
