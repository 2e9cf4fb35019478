"""Layer importance of FedPepTAO (Sec. 3.2, Eq. 2-4) and the layer choice of Algorithm 1 (lines 15-19).

On a client, one batch of its data goes through the model *without prompts*; the hidden states
h_l (output of layer l, padding positions zeroed, flattened) give cosine-similarity kernels whose
eigenvalues lambda score each layer with log(lambda + eps) + 1 / (lambda + eps) (Eq. 3). Similar
hidden states (a low-rank kernel, tiny eigenvalues) mean examples that are hard to separate, so a
high score marks a layer whose prompt matters. Two kernels:

* ``batch`` (default, the released code's ``get_score``): per layer, the B x B kernel across the
  batch's examples; the layer's score is the *sum* over its B eigenvalues.
* ``layers`` (the paper's Eq. 2): per example j, the L x L kernel across layers; its eigenvalues,
  in ascending order, are assigned to layers 1..L (the paper pairs lambda_{j,l} with layer l without
  saying how; ascending is ``eigvalsh``'s order) and Eq. 3 averages over the n examples.

Kernels are positive semi-definite; eigenvalues that round below zero are clamped to 0 before eps
is added. The server's global score is the sample-weighted mean over clients (Eq. 4).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def cosine_kernel(vectors: torch.Tensor) -> torch.Tensor:
    """K[a, b] = cos(v_a, v_b) for the rows of ``vectors`` (n, d)."""
    unit = F.normalize(vectors.to(torch.float64), dim=-1)
    return unit @ unit.T


def eigenvalue_score(eigenvalues: torch.Tensor, eps: float) -> torch.Tensor:
    """Eq. 3's summand, elementwise: log(lambda + eps) + 1 / (lambda + eps)."""
    shifted = eigenvalues.clamp(min=0.0) + eps
    return torch.log(shifted) + 1.0 / shifted


def _flattened(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (hidden * mask.unsqueeze(-1).to(hidden.dtype)).reshape(hidden.shape[0], -1)


def batch_kernel_scores(hidden_states: Sequence[torch.Tensor], mask: torch.Tensor, eps: float = 1e-5
                        ) -> torch.Tensor:
    """Per layer: the B x B kernel of the batch's flattened hidden states; score = sum over its eigenvalues."""
    scores = []
    for hidden in hidden_states:
        eigenvalues = torch.linalg.eigvalsh(cosine_kernel(_flattened(hidden, mask)))
        scores.append(eigenvalue_score(eigenvalues, eps).sum())
    return torch.stack(scores).to(torch.float32)


def layer_kernel_scores(hidden_states: Sequence[torch.Tensor], mask: torch.Tensor, eps: float = 1e-5
                        ) -> torch.Tensor:
    """Eq. 2-3: per example the L x L kernel across layers; layer l gets the mean of its eigenvalue's score."""
    per_layer = torch.stack([_flattened(hidden, mask) for hidden in hidden_states], dim=1)  # (B, L, S*H)
    kernels = torch.stack([cosine_kernel(example) for example in per_layer])  # (B, L, L)
    eigenvalues = torch.linalg.eigvalsh(kernels)  # (B, L), ascending per example
    return eigenvalue_score(eigenvalues, eps).mean(dim=0).to(torch.float32)


def aggregate_scores(scores: Sequence[torch.Tensor], num_samples: Sequence[float]) -> torch.Tensor:
    """Eq. 4: sum_i (n_i / N) * score_i."""
    total = float(sum(num_samples))
    return sum((n / total) * s for s, n in zip(scores, num_samples, strict=True))  # type: ignore[return-value]


def select_layers(global_scores: torch.Tensor, ratio: float, layer_sizes: Sequence[int], min_layers: int = 1
                  ) -> list[int]:
    """Alg. 1 lines 16-19: layers by descending score while Para(SL) / Para(L) < ratio (at least ``min_layers``)."""
    order = torch.argsort(global_scores, descending=True, stable=True).tolist()
    total = float(sum(layer_sizes))
    chosen: list[int] = []
    for layer in order:
        if len(chosen) >= min_layers and sum(layer_sizes[i] for i in chosen) / total >= ratio:
            break
        chosen.append(layer)
    return sorted(chosen)
