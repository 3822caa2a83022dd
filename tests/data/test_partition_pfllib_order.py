"""partition=pfllib keeps PFLlib's per-client data order: the order its dataset_utils (separate_data with
partition="dir", then split_data's train_test_split) leaves each client's rows in, which PFLlib's clients
read unshuffled (DataLoader(shuffle=False, drop_last=True)). The reference below re-implements that
procedure from PFLlib's code, with PFLlib's global numpy stream replaced by the partition's generator."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raysim.data import PartitionSpec, partition
from raysim.data.partition import PFLLIB_TRAIN_SHARE, pfllib_min_samples, pooled_labels


def pfllib_reference(labels: np.ndarray, num_clients: int, alpha: float, least: int, rng: np.random.Generator):
    """PFLlib's procedure, step by step: per class (0..C-1, in order) shuffle that class's indices, draw
    Dirichlet proportions, zero those of clients already at N/K or more, renormalise, cut; every client's
    list grows by its slice, class after class; redraw everything until the smallest list has `least`.
    Then per client sklearn's ShuffleSplit layout: perm of n, test = perm[:n - floor(0.75 n)], train = the rest."""
    n_all, num_classes = len(labels), int(labels.max()) + 1
    smallest = 0
    while smallest < least:
        lists: list[list[int]] = [[] for _ in range(num_clients)]
        for c in range(num_classes):
            members = np.where(labels == c)[0]
            rng.shuffle(members)
            p = rng.dirichlet(np.repeat(alpha, num_clients))
            p = np.array([pk * (len(held) < n_all / num_clients) for pk, held in zip(p, lists)])
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(members)).astype(int)[:-1]
            lists = [held + part.tolist() for held, part in zip(lists, np.split(members, cuts))]
            smallest = min(len(held) for held in lists)
    out = []
    for held in lists:
        rows = np.asarray(held)
        n = len(rows)
        n_train = math.floor(PFLLIB_TRAIN_SHARE * n)
        n_test = n - n_train
        perm = rng.permutation(n)
        out.append((rows[perm[n_test:n_test + n_train]], rows[perm[:n_test]]))
    return out


def class_sorted(n_per_class: int, classes: int) -> np.ndarray:
    return np.repeat(np.arange(classes), n_per_class)  # as Tiny-ImageNet's folders: class by class


def spec(**kw) -> PartitionSpec:
    base = dict(train_labels=class_sorted(60, 10), test_labels=class_sorted(20, 10), num_clients=5, seed=3, beta=0.5)
    base.update(kw)
    return PartitionSpec(**base)


@pytest.mark.parametrize("beta", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("seed", [1, 3])
def test_per_client_order_is_pfllibs(beta, seed):
    s = spec(beta=beta, seed=seed)
    got = partition("pfllib", s)
    want = pfllib_reference(pooled_labels(s), s.num_clients, beta, pfllib_min_samples(s), np.random.default_rng([seed, 5]))
    for split, (tr, te) in zip(got, want, strict=True):
        assert np.array_equal(split.train, tr)  # the same rows in the same order (integers: exact)
        assert np.array_equal(split.test, te)
    # and it is not sorted: sorting was what undid PFLlib's order
    assert any(np.any(np.diff(x.train) < 0) for x in got)


def test_the_split_layout_is_sklearns_train_test_split():
    """The reference's layout (test = the permutation's head) is what sklearn's train_test_split does with
    a given RandomState; checked against sklearn itself on a few sizes."""
    sk = pytest.importorskip("sklearn.model_selection")
    for n in (40, 41, 97):
        rows = np.arange(n) * 7
        tr, te = sk.train_test_split(rows, train_size=PFLLIB_TRAIN_SHARE, shuffle=True, random_state=np.random.RandomState(n))
        perm = np.random.RandomState(n).permutation(n)
        n_test = n - math.floor(PFLLIB_TRAIN_SHARE * n)
        assert np.array_equal(te, rows[perm[:n_test]]) and np.array_equal(tr, rows[perm[n_test:]])


def test_kept_order_mixes_classes_in_a_batch_on_a_class_sorted_pool():
    """What the sort did: on a class-sorted pool an unshuffled loader over sorted rows sees one class per
    batch; PFLlib's order mixes them (train_test_split's shuffle)."""
    s = spec(train_labels=class_sorted(200, 10), test_labels=class_sorted(40, 10), num_clients=4, beta=1.0)
    pool = pooled_labels(s)
    B = 20

    def classes_per_batch(rows):
        return np.mean([len(np.unique(pool[rows[i:i + B]])) for i in range(0, len(rows) - B + 1, B)])

    kept = np.mean([classes_per_batch(x.train) for x in partition("pfllib", s)])
    sorted_ = np.mean([classes_per_batch(np.sort(x.train)) for x in partition("pfllib", s)])
    assert sorted_ < 2.5 < 4.5 < kept  # measured 1.74 vs 6.59 classes per batch of 20 (seed 3)


def test_other_partitions_still_sort_each_clients_rows():
    s = spec(train_labels=np.random.default_rng(0).permutation(class_sorted(60, 10)),
             test_labels=np.random.default_rng(1).permutation(class_sorted(20, 10)))
    for kind in ("dirichlet", "iid"):
        for x in partition(kind, s):
            assert np.all(np.diff(x.train) > 0) and np.all(np.diff(x.test) > 0)


def test_a_pfllib_run_reads_pfllibs_batches(tmp_path):
    """Through the engine: a client's training rows are the pool's rows in PFLlib's order, and the zoo
    methods' default (shuffle=False) takes them in consecutive drop_last batches, as PFLlib's loader."""
    import torch

    from raysim.build import build_config, make_method
    from raysim.engine.loop import prepare_data
    from raysim.methods.families.zoo import ZooModelOptions, ZooOptions
    from raysim.sampling import epoch_batches

    assert ZooOptions().shuffle is False and ZooModelOptions().shuffle is False
    cfg = build_config({
        "method": "fedproto", "fedproto": {"model_family": "tiny", "feature_dim": 16},
        "data": {"dataset": "digits", "partition": "pfllib", "beta": 0.5, "shots": 0},
        "train": {"num_clients": 4, "batch_size": 10}, "execution": {"backend": "inline"},
        "output": {"progress": False, "tensorboard": False, "cache_dir": str(tmp_path / "c")},
    })
    m = make_method(cfg)
    assert m.opts.shuffle is False
    data = prepare_data(cfg, m.needs(), progress=False)
    c = data.client(0)
    rows = data.train_idx[0]
    assert np.any(np.diff(rows) < 0)  # PFLlib's order, not sorted
    assert torch.equal(c.y_train, torch.as_tensor(data.y_train[rows]))
    batches = epoch_batches(c.num_train, 10, torch.Generator(), shuffle=False)
    assert len(batches) == c.num_train // 10  # drop_last
    for i, idx in enumerate(batches):
        assert torch.equal(c.y_train[idx], torch.as_tensor(data.y_train[rows[i * 10:(i + 1) * 10]]))
