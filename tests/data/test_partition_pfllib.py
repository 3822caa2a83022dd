"""partition=pfllib (SPEC 2.6, PFLlib's dataset_utils): train and test merged into one pool, Dirichlet over
the clients with PFLlib's minimum (40 samples) enforced by redrawing, then a 75/25 train/test split per
client; and the engine hands the methods the pool as both arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raysim.data import PartitionSpec, partition
from raysim.data.partition import PFLLIB_MIN_SAMPLES, is_pooled, pfllib_dirichlet, pfllib_min_samples, pooled_labels
from raysim.errors import ConfigError


def labels(n_per_class: int, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(classes), n_per_class))


def spec(**kw) -> PartitionSpec:
    base = dict(train_labels=labels(100), test_labels=labels(20, seed=1), num_clients=8, seed=1, beta=0.5)
    base.update(kw)
    return PartitionSpec(**base)


@pytest.mark.parametrize("beta", [0.1, 0.5, 1.0])
def test_every_client_has_at_least_the_minimum(beta):
    s = spec(beta=beta)
    splits = partition("pfllib", s)
    assert len(splits) == 8
    assert pfllib_min_samples(s) == PFLLIB_MIN_SAMPLES  # 1200 samples / 8 clients / 2 = 75 > 40
    assert min(len(x.train) + len(x.test) for x in splits) >= PFLLIB_MIN_SAMPLES


def test_min_samples_is_configurable_and_capped_by_half_the_mean():
    s = spec(min_samples=120, beta=1.0)
    assert pfllib_min_samples(s) == 75  # int(min(120, 1200 / 8 / 2)): PFLlib's cap
    assert min(len(x.train) + len(x.test) for x in partition("pfllib", s)) >= 75
    assert pfllib_min_samples(spec(min_samples=50)) == 50
    with pytest.raises(ConfigError, match="could not give every client 60 samples"):
        pfllib_dirichlet(labels(10, 3), 5, 0.01, 60, np.random.default_rng(0), max_draws=20)


def test_train_and_test_come_from_the_merged_pool_disjoint_and_covering_it():
    s = spec()
    pool = pooled_labels(s)
    assert len(pool) == 1200 and is_pooled("pfllib") and not is_pooled("dirichlet")
    splits = partition("pfllib", s)
    tr = np.concatenate([x.train for x in splits])
    te = np.concatenate([x.test for x in splits])
    everything = np.concatenate([tr, te])
    assert len(everything) == len(set(everything.tolist())) == len(pool)  # disjoint, every sample once
    assert set(everything.tolist()) == set(range(len(pool)))  # union = the pool
    # the pool holds the official test rows (indices >= 1000) on both sides of the per-client split
    assert (tr >= 1000).any() and (te < 1000).any()
    for x in splits:
        assert not set(x.train.tolist()) & set(x.test.tolist())


def test_the_split_is_75_25_per_client():
    for x in partition("pfllib", spec(beta=0.1)):
        n = len(x.train) + len(x.test)
        assert len(x.train) == math.floor(0.75 * n)  # sklearn's train_test_split(train_size=0.75)
        assert abs(len(x.train) / n - 0.75) <= 1 / n


def test_label_skew_grows_as_beta_shrinks_and_the_seed_fixes_the_split():
    def skew(beta):
        s = spec(beta=beta)
        pool = pooled_labels(s)
        shares = []
        for x in partition("pfllib", s):
            counts = np.bincount(pool[np.concatenate([x.train, x.test])], minlength=10)
            shares.append(counts.max() / counts.sum())
        return float(np.mean(shares))

    assert skew(0.1) > skew(1.0) + 0.1
    a, b = partition("pfllib", spec()), partition("pfllib", spec())
    assert all(np.array_equal(x.train, y.train) and np.array_equal(x.test, y.test) for x, y in zip(a, b))
    c = partition("pfllib", spec(seed=2))
    assert not all(np.array_equal(x.train, y.train) for x, y in zip(a, c))


def test_the_engine_hands_the_methods_the_pool(tmp_path):
    from raysim.build import build_config, make_method
    from raysim.engine.loop import prepare_data

    cfg = build_config({
        "method": "fedavg", "fedavg": {"model": "cnn_tiny"},
        "data": {"dataset": "digits", "partition": "pfllib", "beta": 0.5, "shots": 0},
        "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"num_clients": 4}, "execution": {"backend": "inline"},
        "output": {"progress": False, "tensorboard": False, "cache_dir": str(tmp_path / "c")},
    })
    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    assert data.x_train is data.x_test and data.y_train is data.y_test  # one pool, not a copy
    assert len(data.y_train) == 1797  # scikit-learn's digits, train and test merged
    for cid in range(4):
        c = data.client(cid)
        assert c.num_train + len(c.y_test) >= 40 and c.num_train == math.floor(0.75 * (c.num_train + len(c.y_test)))
    # the evaluation protocol sees only the clients' test rows of the pool
    from raysim.engine.evaluation import PROTOCOLS

    proto = PROTOCOLS.get("in_cross")(data, batch_size=64)
    assert len(proto.y) == sum(len(t) for t in data.test_idx)


def test_pfllib_keeps_every_sample_so_shots_must_be_zero():
    from raysim.build import build_config
    with pytest.raises(ConfigError, match="data.shots=0"):
        build_config({"method": "fedavg", "data": {"dataset": "digits", "partition": "pfllib"}})
