"""Partition invariants: samples used once, disjoint classes, skew grows as beta shrinks."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.data import PartitionSpec, partition
from raysim.errors import ConfigError
from raysim.sampling import batch_indices, batches_per_epoch, generator, participants


def labels(n_per_class=60, classes=10, seed=0):
    y = np.repeat(np.arange(classes), n_per_class)
    return np.random.default_rng(seed).permutation(y)


def spec(**kw):
    base = dict(train_labels=labels(), test_labels=labels(20), num_clients=5, seed=1)
    base.update(kw)
    return PartitionSpec(**base)


def assert_disjoint(splits, n_train, n_test):
    tr = np.concatenate([s.train for s in splits])
    te = np.concatenate([s.test for s in splits])
    assert len(tr) == len(set(tr.tolist())) and len(te) == len(set(te.tolist()))
    assert tr.max() < n_train and te.max() < n_test


@pytest.mark.parametrize("kind", ["pathological", "dirichlet", "iid"])
def test_every_sample_used_at_most_once(kind):
    s = spec()
    splits = partition(kind, s)
    assert len(splits) == 5
    assert_disjoint(splits, len(s.train_labels), len(s.test_labels))
    if kind in ("dirichlet", "iid"):  # these use every sample exactly once
        assert sum(len(x.train) for x in splits) == len(s.train_labels)
        assert sum(len(x.test) for x in splits) == len(s.test_labels)


def test_pathological_classes_are_disjoint_and_test_matches_train():
    s = spec(shots=4)
    splits = partition("pathological", s)
    owned = [set(s.train_labels[x.train].tolist()) for x in splits]
    for i in range(len(owned)):
        for j in range(i + 1, len(owned)):
            assert not owned[i] & owned[j]
    for x, cls in zip(splits, owned):
        assert set(s.test_labels[x.test].tolist()) == cls
        counts = np.bincount(s.train_labels[x.train])
        assert counts.max() == 4  # few-shot cap per class
    assert set().union(*owned) == set(range(10))


def test_pathological_needs_more_classes_than_clients():
    with pytest.raises(ConfigError, match="num_clients"):
        partition("pathological", spec(num_clients=20))


def test_smaller_beta_gives_more_label_skew():
    def skew(beta):
        sp = spec(beta=beta, min_samples=1, train_labels=labels(200), test_labels=labels(50))
        splits = partition("dirichlet", sp)
        # mean over clients of the largest class share
        return np.mean([np.bincount(sp.train_labels[x.train], minlength=10).max() / len(x.train) for x in splits])

    assert skew(0.1) > skew(1.0) > skew(100.0)


def test_dirichlet_minimum_size_and_reproducibility():
    a = partition("dirichlet", spec(beta=0.5, min_samples=10))
    b = partition("dirichlet", spec(beta=0.5, min_samples=10))
    assert all(len(x.train) >= 10 and len(x.test) >= 10 for x in a)
    assert all((x.train == y.train).all() and (x.test == y.test).all() for x, y in zip(a, b))
    c = partition("dirichlet", spec(beta=0.5, min_samples=10, seed=2))
    assert any(len(x.train) != len(y.train) or (x.train != y.train).any() for x, y in zip(a, c))


def test_domain_partition_keeps_clients_inside_one_domain():
    tr_dom = np.tile(np.arange(2), 300)
    te_dom = np.tile(np.arange(2), 100)
    sp = spec(num_clients=4, train_domains=tr_dom, test_domains=te_dom, min_samples=2)
    splits = partition("domain", sp)
    assert_disjoint(splits, 600, 200)
    for k, x in enumerate(splits):
        assert set(tr_dom[x.train].tolist()) == {k // 2}
        assert set(te_dom[x.test].tolist()) == {k // 2}
    with pytest.raises(ConfigError, match="multiple"):
        partition("domain", spec(num_clients=3, train_domains=tr_dom, test_domains=te_dom))
    with pytest.raises(ConfigError, match="domains"):
        partition("domain", spec(num_clients=4))


def test_client_sampling_is_seeded_sorted_and_sized():
    a = participants(1, 3, 100, 0.1)
    assert a == participants(1, 3, 100, 0.1) and a == sorted(a) and len(a) == 10
    assert participants(1, 4, 100, 0.1) != a
    assert participants(1, 0, 7, 1.0) == list(range(7))


def test_batches_drop_last_like_the_official_loader():
    assert batches_per_epoch(100, 32) == 3 and batches_per_epoch(16, 32) == 1
    g = generator(1, "x")
    batches = list(batch_indices(100, 32, g))
    assert [len(b) for b in batches] == [32, 32, 32]
    assert len(set(np.concatenate([b.numpy() for b in batches]).tolist())) == 96
    assert [len(b) for b in batch_indices(10, 32, generator(1, "x"))] == [10]
