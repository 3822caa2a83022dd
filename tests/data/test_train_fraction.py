"""data.train_fraction (raysim/data/subset.py): a seeded random fraction of each domain's training split, as the
VPDR code's keep_ratio; the test split untouched; refused outside (0, 1] and where there is no training split."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import tiny_config
from PIL import Image

from raysim.data import DATASETS, LoadSpec
from raysim.errors import ConfigError

DOMAINS = ["art_painting", "cartoon", "photo", "sketch"]
PER_DOMAIN = (23, 31, 12, 40)  # images per domain folder (two classes), so each domain's 30% differs


def write_pacs(root) -> str:
    """A tiny flat PACS tree of random-noise images, PER_DOMAIN images per domain over two classes."""
    for d, (dom, n) in enumerate(zip(DOMAINS, PER_DOMAIN)):
        for k in range(n):
            cls = ("dog", "cat")[k % 2]
            path = os.path.join(root, "PACS", dom, cls, f"img_{k:02d}.png")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            rng = np.random.default_rng(1000 * d + k)
            Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(path)
    return str(root)


@pytest.fixture(scope="module")
def pacs(tmp_path_factory):
    root = write_pacs(tmp_path_factory.mktemp("data"))
    return root, DATASETS.get("pacs")(LoadSpec(data_root=root, image_size=12))


def test_kept_count_is_the_vpdr_codes_max_1_int_n_times_ratio():
    from raysim.data.subset import kept_count

    # utils/domain_skew.py: keep = max(1, int(total * keep_ratio)); by hand for raysim's PACS training splits
    # (1640, 1876, 1336, 3144 images: 492, 562.8, 400.8, 943.2) and Office-Caltech's (768, 899, 127, 237)
    assert [kept_count(n, 0.3) for n in (1640, 1876, 1336, 3144)] == [492, 562, 400, 943]
    assert [kept_count(n, 0.3) for n in (768, 899, 127, 237)] == [230, 269, 38, 71]
    assert [kept_count(n, 0.1) for n in (60000, 7291, 73257, 10000)] == [6000, 729, 7325, 1000]  # Digits: 15,054
    assert kept_count(3, 0.1) == 1 and kept_count(0, 0.3) == 0 and kept_count(17, 1.0) == 17


def test_each_domain_keeps_its_fraction_and_the_test_split_is_untouched(pacs):
    from raysim.data.folders import split_sizes
    from raysim.data.subset import keep_train_fraction, kept_count

    _, full = pacs
    b = keep_train_fraction(full, 0.3, seed=1)
    train_full = [split_sizes(n)[0] for n in PER_DOMAIN]  # 19, 25, 10, 32 training images
    assert np.bincount(full.train.domains).tolist() == train_full
    assert np.bincount(b.train.domains).tolist() == [kept_count(n, 0.3) for n in train_full] == [5, 7, 3, 9]
    # the kept rows are training rows of the full split: labels and images as they were
    rows = b.train.images.rows
    assert np.array_equal(b.train.labels, full.train.labels[rows]) and np.array_equal(b.train.domains, full.train.domains[rows])
    for i in (0, len(b.train) - 1):
        assert np.array_equal(b.train.images[i].numpy(), full.train.images[int(rows[i])].numpy())
    assert b.test is full.test  # the test split whole, the same object
    assert b.classnames == full.classnames and b.domain_names == full.domain_names
    assert keep_train_fraction(full, 1.0, seed=1) is full  # 1 keeps everything: the bundle itself


def test_the_same_seed_gives_the_same_subset_and_another_seed_another(pacs):
    from raysim.data.subset import keep_train_fraction

    _, full = pacs
    a, again, other = (keep_train_fraction(full, 0.3, seed=s) for s in (1, 1, 2))
    assert np.array_equal(a.train.images.rows, again.train.images.rows) and a.signature == again.signature
    assert not np.array_equal(a.train.images.rows, other.train.images.rows)
    assert a.signature != other.signature != full.signature  # the feature cache cannot mix them up
    assert np.bincount(other.train.domains).tolist() == np.bincount(a.train.domains).tolist()  # the sizes are the seed's no matter


def test_a_run_partitions_the_kept_images_one_domain_per_client(pacs, tmp_path, cache_dir):
    from raysim.build import make_method
    from raysim.data.prepare import prepare_data

    root, full = pacs
    cfg = tiny_config(tmp_path, cache_dir,
                      data={"dataset": "pacs", "data_root": root, "partition": "domain", "shots": 0, "train_fraction": 0.3},
                      train={"num_clients": 4})
    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    assert [len(t) for t in data.train_idx] == [5, 7, 3, 9]
    assert [len(t) for t in data.test_idx] == [n - (8 * (n // 10) + min(n % 10, 8)) for n in PER_DOMAIN]
    assert data.x_test.shape[0] == len(full.test)


def test_the_config_refuses_a_fraction_outside_0_1_and_where_there_is_no_training_split(tmp_path, cache_dir):
    for bad in (0, 0.0, -0.2, 1.5, float("nan")):
        with pytest.raises(ConfigError, match=r"data.train_fraction must be a number in \(0, 1\].*1 = all"):
            tiny_config(tmp_path, cache_dir, data={"train_fraction": bad})
    with pytest.raises(ConfigError, match="pools train and test.*set data.train_fraction=1"):
        tiny_config(tmp_path, cache_dir, data={"train_fraction": 0.5, "partition": "pfllib", "shots": 0})
    assert tiny_config(tmp_path, cache_dir, data={"train_fraction": 1}).data.train_fraction == 1.0
    assert tiny_config(tmp_path, cache_dir, data={"train_fraction": 0.3}).data.train_fraction == 0.3
