"""SQuAD partition by k-means over question embeddings (FeDeRA App. A.2): seeded clusters, the
embedding cache, the classes a Dirichlet partition skews over, and MiniLM's sentence embedding."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpeft.config import ConfigError, PartitionConfig, TaskConfig, build_config
from fedpeft.data.partition import partition_indices
from fedpeft.data.question_clusters import cached_embeddings, kmeans_classes, minilm_embeddings
from fedpeft.data.tasks import load_task, with_example_classes
from fedpeft.experiment import load_data
from tests.conftest import SHARED_DATA
from tests.test_extractive_qa import THINGS, toy_articles, write_squad


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("FEDPEFT_CACHE_DIR", str(folder))
    return folder


def squad_files(tmp_path: Path) -> tuple[Path, Path]:
    return (write_squad(tmp_path / "train.json", toy_articles(120, 0, "train")),
            write_squad(tmp_path / "eval.json", toy_articles(30, 1, "eval")))


def qa_task_config(tmp_path: Path, **fields: object) -> TaskConfig:
    train, eval_ = squad_files(tmp_path)
    return TaskConfig(name="file", problem_type="extractive_qa", train_file=str(train), eval_file=str(eval_),
                      **fields)


def thing_of(question: str) -> str:
    return next(thing for thing in THINGS if f" {thing} " in question)


def one_hot_things(texts: Sequence[str]) -> np.ndarray:
    """A cheap stand-in embedding: which thing the toy question asks about."""
    return np.array([[float(thing_of(t) == thing) for thing in THINGS] for t in texts], dtype=np.float32)


def test_kmeans_classes_are_seeded_and_eval_takes_the_nearest_centroid() -> None:
    rng = np.random.default_rng(0)
    centres = np.array([[5.0, 0, 0], [0, 5.0, 0], [0, 0, 5.0]])
    blob = np.repeat(np.arange(3), 20)
    train = centres[blob] + 0.1 * rng.standard_normal((60, 3))
    evaluation = centres[[2, 0, 1]] + 0.1 * rng.standard_normal((3, 3))
    ids, eval_ids = kmeans_classes(train, evaluation, 3)
    assert len(set(zip(blob.tolist(), ids.tolist(), strict=True))) == 3  # each blob is one cluster
    assert [ids[blob == b][0] for b in (2, 0, 1)] == eval_ids.tolist()
    again, again_eval = kmeans_classes(train, evaluation, 3)
    assert np.array_equal(ids, again) and np.array_equal(eval_ids, again_eval)


def test_embeddings_are_cached_by_encoder_and_texts(private_cache: Path) -> None:
    calls: list[int] = []

    def embed(texts: Sequence[str]) -> np.ndarray:
        calls.append(len(texts))
        return np.arange(2 * len(texts), dtype=np.float32).reshape(len(texts), 2)

    first = cached_embeddings(["a", "b"], embed, "enc")
    assert np.array_equal(cached_embeddings(["a", "b"], embed, "enc"), first) and calls == [2]
    cached_embeddings(["a", "c"], embed, "enc")
    cached_embeddings(["a", "b"], embed, "other encoder")
    assert calls == [2, 2, 2]
    for entry in (private_cache / "question_embeddings").glob("*.npy"):
        entry.write_bytes(b"damaged")
    cached_embeddings(["a", "b"], embed, "enc")  # a damaged entry is recomputed, not an error
    assert len(calls) == 4


def test_question_clusters_are_the_classes_a_dirichlet_partition_skews(tmp_path: Path) -> None:
    task = load_task(qa_task_config(tmp_path))  # title classes first
    assert "train0" in task.example_classes and "eval0" in task.example_classes
    titles = [ex.group for ex in task.train]
    clustered = with_example_classes(task, qa_class_by="question_clusters", qa_clusters=len(THINGS),
                                     embed=one_hot_things)
    assert clustered.example_classes == tuple(f"cluster_{c:02d}" for c in range(len(THINGS)))
    by_thing: dict[str, set[int]] = {}
    for ex in [*clustered.train, *clustered.eval]:
        by_thing.setdefault(thing_of(ex.texts[0]), set()).add(int(ex.label))  # type: ignore[arg-type]
    assert all(len(ids) == 1 for ids in by_thing.values()) and len(by_thing) == len(THINGS)
    assert [ex.group for ex in clustered.train] == titles  # natural partitions still go by article
    shards = partition_indices([ex.label for ex in clustered.train],
                               PartitionConfig(kind="dirichlet", alpha=0.05, num_clients=4), seed=0)
    for shard in shards:  # label skew over the question clusters: 7 classes, 4 clients, mostly one each
        counts = Counter(int(clustered.train[i].label) for i in shard)  # type: ignore[arg-type]
        assert counts.most_common(1)[0][1] >= 0.4 * len(shard)  # iid would give about 1/7


def test_bad_question_cluster_settings_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"task\.qa_clusters"):
        with_example_classes(load_task(qa_task_config(tmp_path)), qa_class_by="question_clusters", qa_clusters=500,
                             embed=one_hot_things)
    with pytest.raises(ConfigError, match=r"task\.qa_class_by"):
        build_config({"task": {"qa_class_by": "kmeans"}})
    csv = tmp_path / "t.csv"
    csv.write_text("text,label\ngood,1\nbad,0\n")
    with pytest.raises(ConfigError, match=r"task\.qa_class_by"):
        load_task(TaskConfig(name="file", train_file=str(csv), eval_file=str(csv), text_columns=["text"],
                             label_column="label", qa_class_by="question_clusters"))


@pytest.mark.real
def test_minilm_question_clusters_end_to_end(tmp_path: Path, private_cache: Path) -> None:
    """The production path: MiniLM's sentence embedding (as sentence-transformers computes it), cached,
    thread-count independent, clustered, then partitioned."""
    questions = [f"what color is the {thing} ?" for thing in THINGS] + ["who wrote the book ?", "when did it end ?"]
    vectors = minilm_embeddings(questions, batch_size=4)
    assert vectors.shape == (len(questions), 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from fedpeft.models.backbone import minilm_path

    reference = sentence_transformers.SentenceTransformer(str(minilm_path()), device="cpu").encode(
        questions, normalize_embeddings=True)
    np.testing.assert_allclose(vectors, reference, atol=1e-5)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert np.array_equal(minilm_embeddings(questions, batch_size=4), vectors)
    finally:
        torch.set_num_threads(before)

    cfg = qa_task_config(tmp_path, qa_class_by="question_clusters", qa_clusters=3)
    raw = {"method": "lora", "task": cfg.model_dump(exclude_defaults=True),
           "partition": {"kind": "dirichlet", "alpha": 0.5, "num_clients": 3}}
    task, shards = load_data(build_config(raw))
    assert len(task.example_classes) == 3 and {ex.label for ex in task.train} == {0, 1, 2}
    assert sum(len(s) for s in shards) == len(task.train)
    assert list((private_cache / "question_embeddings").glob("*.npy"))  # cached for the next load
    again, _ = load_data(build_config(raw))
    assert [ex.label for ex in again.train] == [ex.label for ex in task.train]


@pytest.mark.real
@pytest.mark.skipif(not (SHARED_DATA / "qa" / "squad_v1.1").is_dir(), reason="needs ../shared/data/qa")
def test_squad_question_clusters_on_the_real_dev_split() -> None:
    """The built-in task with the paper's 30 clusters over its 9,231 training questions."""
    task = load_task(TaskConfig(name="squad", qa_class_by="question_clusters"), SHARED_DATA)
    counts = Counter(int(ex.label) for ex in task.train)  # type: ignore[arg-type]
    assert len(task.example_classes) == 30 and len(counts) == 30 and len(task.train) == 9231
    assert max(counts.values()) < 0.2 * len(task.train)  # clusters, not one blob
