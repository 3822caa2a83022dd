"""Partition invariants: samples used once, disjoint classes, skew grows as beta shrinks."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.data import PartitionSpec, partition
from raysim.data.partition import pathological_class_counts
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


def test_pathological_needs_at_least_one_class_per_client():
    with pytest.raises(ConfigError, match=r"10 classes cannot be split over 20 clients \(lower num_clients to at most 10"):
        partition("pathological", spec(num_clients=20))


def _spec_1_9_rule(C, K, seed):
    """The rule as the code had it before any K <= C was allowed (SPEC 1.9, the official code)."""
    per = max(1, int(round(C / K)))
    order = np.random.default_rng([seed, 1]).permutation(C)
    return [set(order[k * per : (k + 1) * per].tolist()) if k < K - 1 else set(order[(K - 1) * per :].tolist()) for k in range(K)]


@pytest.mark.parametrize("C", [10, 37, 47])
def test_pathological_works_for_every_k_up_to_c(C):
    tr, te = labels(6, C), labels(2, C, seed=1)
    for K in range(1, C + 1):
        s = spec(train_labels=tr, test_labels=te, num_clients=K)
        splits = partition("pathological", s)
        owned = [set(tr[x.train].tolist()) for x in splits]
        assert len(splits) == K and all(owned), K  # every client has at least one class
        assert sum(len(o) for o in owned) == C and set().union(*owned) == set(range(C)), K  # disjoint, all used
        assert all(set(te[x.test].tolist()) == o for x, o in zip(splits, owned)), K
        counts, spec_rule = pathological_class_counts(C, K)
        assert [len(o) for o in owned] == counts
        if spec_rule:  # wherever SPEC 1.9's rule works, the split is exactly the one it gives
            assert owned == _spec_1_9_rule(C, K, s.seed), K
        else:  # elsewhere as even as possible
            assert max(counts) - min(counts) <= 1, K


def test_pathological_k6_of_10_classes_spreads_evenly():
    splits = partition("pathological", spec(num_clients=6))
    s = spec(num_clients=6)
    assert [len(set(s.train_labels[x.train].tolist())) for x in splits] == [2, 2, 2, 2, 1, 1]
    assert pathological_class_counts(10, 6) == ([2, 2, 2, 2, 1, 1], False)


def test_pathological_keeps_the_spec_class_counts():
    # SPEC 1.9, K=10: Pets 4 x 9 + 1, DTD 5 x 9 + 2, Food 10 x 9 + 11, Flowers 10 x 9 + 12, Caltech 10 x 10
    for C, per, last in ((37, 4, 1), (47, 5, 2), (101, 10, 11), (102, 10, 12), (100, 10, 10)):
        assert pathological_class_counts(C, 10) == ([per] * 9 + [last], True)
    assert pathological_class_counts(10, 10) == ([1] * 10, True)
    assert pathological_class_counts(10, 4) == ([2, 2, 2, 4], True)  # round(2.5) = 2, the code's rounding


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


def _class_counts(splits, y, classes):
    """(classes, clients) training samples of each class on each client."""
    return np.array([[int((y[s.train] == c).sum()) for s in splits] for c in range(classes)])


def test_domain_reseed_gives_every_class_the_code_proportions_and_fresh_draws_do_not():
    """data.domain_reseed (SPEC 1.9 item 9): every class of a domain is cut by the same p = Dir(beta) under numpy seed 0,
    as the FedSEPT code's re-seeding does, until a client holds N / K samples; then the full client gets no more."""
    C, n, K, beta = 10, 100, 2, 0.5
    y_tr, y_te = np.repeat(np.arange(C), n), np.repeat(np.arange(C), 20)
    one_domain = dict(train_labels=y_tr, test_labels=y_te, num_clients=K, beta=beta,
                      train_domains=np.zeros(len(y_tr), int), test_domains=np.zeros(len(y_te), int))
    p = np.random.RandomState(0).dirichlet(np.repeat(beta, K))  # what the code draws before every class
    code_counts = np.diff([0, *(np.cumsum(p) * n).astype(int)[:-1], n])
    counts = _class_counts(partition("domain", PartitionSpec(seed=1, domain_reseed=True, **one_domain)), y_tr, C)
    held, same = np.zeros(K), 0
    for c in range(C):
        full = held >= len(y_tr) / K
        if not full.any():  # nobody full yet: exactly the code's proportions, the same for every class
            assert counts[c].tolist() == code_counts.tolist(), f"class {c}"
            same += 1
        else:  # the full client is masked out: the class goes to the others
            assert (counts[c][full] == 0).all() and counts[c].sum() == n, f"class {c}"
        held += counts[c]
    assert same >= 2  # several classes share the one draw (here p = {p.round(3)})
    again = _class_counts(partition("domain", PartitionSpec(seed=7, domain_reseed=True, **one_domain)), y_tr, C)
    assert (again == counts).all()  # the code's seed 0, whatever train.seed
    fresh = _class_counts(partition("domain", PartitionSpec(seed=1, **one_domain)), y_tr, C)
    assert fresh[0].tolist() != fresh[1].tolist()  # without it each class draws its own p


def test_domain_reseed_refuses_a_split_it_cannot_redraw_and_other_partitions():
    from raysim.build import build_config
    y = np.zeros(6, int)  # one class: at beta 0.01 the one draw gives (almost) all of it to one client
    sp = PartitionSpec(train_labels=y, test_labels=y, num_clients=2, seed=1, beta=0.01, domain_reseed=True,
                       train_domains=np.zeros(len(y), int), test_domains=np.zeros(len(y), int))
    with pytest.raises(ConfigError, match="domain_reseed"):
        partition("domain", sp)
    with pytest.raises(ConfigError, match="data.partition=domain"):
        build_config({"data": {"partition": "dirichlet", "domain_reseed": True}})
