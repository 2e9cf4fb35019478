"""Decode texts for a generation task and score them with ROUGE.

Encoder-decoders (T5, BART) read the right-padded prompt; decoders (GPT-2, LLaMA) read it
left-padded so that every row's continuation starts at the same position, and only the new
tokens are kept. Decoding is greedy (``num_beams: 1``) or beam search, bounded by
``max_new_tokens``; special tokens are dropped from the decoded text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedpeft.metrics.rouge import rouge_scores
from fedpeft.models.encoding import EncodedData, GenerationSettings


def _padded(rows: Sequence[Sequence[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row, dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


@torch.no_grad()
def generate_texts(model: nn.Module, data: EncodedData, idx: Sequence[int],
                   settings: GenerationSettings | None = None) -> list[str]:
    """The model's continuation of the prompts ``idx`` of ``data``, decoded to text."""
    settings = settings or data.generation
    if settings is None:
        raise ValueError("this split has no generation settings (not a generation task)")
    tokenizer = settings.tokenizer
    causal = data.head == "causal_lm"
    input_ids, attention_mask = _padded([data.features[i]["input_ids"] for i in idx], data.pad_id, left=causal)
    input_ids, attention_mask = input_ids.to(data.device), attention_mask.to(data.device)
    output = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=settings.max_new_tokens,
        num_beams=settings.num_beams, do_sample=False, pad_token_id=data.pad_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if causal:
        output = output[:, input_ids.shape[1] :]
    return [text.strip() for text in tokenizer.batch_decode(output, skip_special_tokens=True)]


def evaluate_generation(model: nn.Module, data: EncodedData, order: Sequence[int], batch_size: int,
                        metrics: Sequence[str]) -> dict[str, float]:
    """ROUGE (``metrics``) of the texts generated for the examples ``order`` against their references."""
    if data.references is None:
        raise ValueError("this split has no reference texts (not a generation task)")
    texts = [text for start in range(0, len(order), batch_size)
             for text in generate_texts(model, data, order[start : start + batch_size])]
    return rouge_scores(texts, [data.references[i] for i in order], metrics)
