"""VPDR's data: the digits4 stand-in (four styles of the ten digits, one domain per client), the Digits
loader on a fake folder tree, CIFAR's shared-test label skew, and the per-domain summary."""

from __future__ import annotations

import bz2
import csv
import gzip

import numpy as np
import pytest

from raysim.data import DATASETS, LoadSpec, PartitionSpec, partition
from raysim.errors import DataError


def test_digits4_has_ten_digits_in_four_styles_one_per_client(cache_dir):
    from raysim.data.vpdr import DIGITS4
    from raysim.engine.loop import client_domains

    b = DATASETS.get("digits4")(LoadSpec(data_root="", image_size=32, cache_dir=cache_dir))
    assert b.classnames == ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    assert b.domain_names == ["clean", "photo", "sketch", "cartoon"]
    assert len(b.train) == 10 * 4 * DIGITS4.train_per_cell and len(b.test) == 10 * 4 * DIGITS4.test_per_cell
    assert tuple(b.train.images[0].shape) == (3, 32, 32)
    splits = partition("domain", PartitionSpec(b.train.labels, b.test.labels, num_clients=4, seed=1, beta=0.5,
                                               train_domains=b.train.domains, test_domains=b.test.domains))
    assert client_domains(b, splits) == ["clean", "photo", "sketch", "cartoon"]
    for k, s in enumerate(splits):  # client k holds all of domain k, train and test
        assert set(b.train.domains[s.train]) == {k} and len(s.train) == 10 * DIGITS4.train_per_cell
        assert set(b.test.domains[s.test]) == {k} and len(s.test) == 10 * DIGITS4.test_per_cell
    # the styles differ: the mean colour of each domain's images is not the same
    means = [b.train.images.images[b.train.domains == d].float().mean().item() for d in range(4)]
    assert len({round(m) for m in means}) > 1


# ------------------------------------------------------------------------------------------ a fake Digits tree
def _idx(path, arr: np.ndarray, compress: bool) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    blob = header + arr.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(blob)
    else:
        path.write_bytes(blob)


def make_digits_tree(root, n_train: int = 20, n_test: int = 5) -> None:
    """MNIST (raw idx, the training files gzipped), USPS (libsvm bz2), SVHN (.mat), SynthDigits (PNGs)."""
    import scipy.io as sio
    from PIL import Image

    rng = np.random.default_rng(0)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for pre, n, gz in (("train", n_train, True), ("t10k", n_test, False)):
        _idx(raw / f"{pre}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)), gz)
        _idx(raw / f"{pre}-labels-idx1-ubyte", np.arange(n) % 10, gz)
    (root / "USPS").mkdir()
    for name, n in (("usps.bz2", n_train), ("usps.t.bz2", n_test)):
        lines = [f"{i % 10 + 1} " + " ".join(f"{j + 1}:{v:.3f}" for j, v in enumerate(rng.uniform(-1, 1, 256))) for i in range(n)]
        with bz2.open(root / "USPS" / name, "wb") as f:
            f.write(("\n".join(lines) + "\n").encode())
    (root / "SVHN").mkdir()
    for name, n in (("train_32x32.mat", n_train), ("test_32x32.mat", n_test)):
        y = (np.arange(n) % 10).reshape(-1, 1)
        sio.savemat(root / "SVHN" / name, {"X": rng.integers(0, 256, (32, 32, 3, n)).astype(np.uint8), "y": np.where(y == 0, 10, y)})
    for part, n in (("imgs_train", n_train), ("imgs_valid", n_test)):
        for c in range(10):
            d = root / "synthetic_digits" / part / str(c)
            d.mkdir(parents=True)
            for i in range(max(1, n // 10)):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3)).astype(np.uint8)).save(d / f"{i}.png")


def test_vpdr_digits_reads_the_four_domains_and_train_fraction_keeps_10_percent_of_training(tmp_path):
    from raysim.data.subset import keep_train_fraction

    make_digits_tree(tmp_path, n_train=40, n_test=10)
    full = DATASETS.get("vpdr_digits")(LoadSpec(data_root=str(tmp_path), image_size=24))
    assert full.domain_names == ["mnist", "usps", "svhn", "synth"]
    assert np.bincount(full.train.domains).tolist() == [40, 40, 40, 40]  # the loader keeps every image
    # data.train_fraction=0.1, the VPDR code's keep_ratio: 10% of 40 training images per domain (floor, at least
    # 1), the test sets whole
    b = keep_train_fraction(full, 0.1, seed=1)
    assert np.bincount(b.train.domains).tolist() == [4, 4, 4, 4]
    assert np.bincount(b.test.domains).tolist() == [10, 10, 10, 10]
    assert set(b.test.labels.tolist()) == set(range(10))  # SVHN's label 10 is the digit 0
    for i in (0, len(b.test) - 1):  # grey MNIST and colour SynthDigits both come out 3 x 24 x 24
        assert tuple(b.test.images[i].shape) == (3, 24, 24)
    assert tuple(b.train.images[len(b.train) - 1].shape) == (3, 24, 24)  # a kept SynthDigits file, read through the subset
    again = keep_train_fraction(DATASETS.get("vpdr_digits")(LoadSpec(data_root=str(tmp_path), image_size=24)), 0.1, seed=1)
    assert again.signature == b.signature != full.signature
    assert np.array_equal(again.train.labels, b.train.labels)  # a fixed subset for a seed


@pytest.mark.parametrize("drop", ["MNIST", "USPS", "SVHN", "synthetic_digits"])
def test_a_missing_digits_folder_says_what_to_do(tmp_path, drop):
    import shutil

    make_digits_tree(tmp_path)
    shutil.rmtree(tmp_path / drop)
    with pytest.raises(DataError, match="Expected layout.*data.dataset=digits4"):
        DATASETS.get("vpdr_digits")(LoadSpec(data_root=str(tmp_path), image_size=24))


def test_a_missing_digits_folder_exits_2_and_writes_nothing(tmp_path, capsys):
    from raysim.run import main

    out = tmp_path / "run"
    rc = main(["method=vpdr_fedproto", "data.dataset=vpdr_digits", f"data.data_root={tmp_path / 'nowhere'}", "data.partition=domain",
               "train.num_clients=4", "execution.backend=inline", f"output.out_dir={out}", "output.progress=false",
               f"output.cache_dir={tmp_path / 'c'}"])
    assert rc == 2 and not out.exists()
    assert "Expected layout" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ CIFAR label skew
def test_dirichlet_shared_test_floors_counts_gives_the_rest_to_the_last_client_and_shares_the_test_set():
    from raysim.data.vpdr import dirichlet_shared_test

    ytr = np.repeat(np.arange(3), 7)  # 7 training images per class
    yte = np.repeat(np.arange(3), 2)
    spec = PartitionSpec(ytr, yte, num_clients=3, seed=4, beta=0.5)
    splits = dirichlet_shared_test(spec)
    # the same draws by hand: per class a permutation, then p ~ Dir(0.5); floor(p n), remainder to the last client
    rng = np.random.default_rng([4, 5])
    for c in range(3):
        rng.permutation(np.flatnonzero(ytr == c))
        p = rng.dirichlet(np.full(3, 0.5))
        want = np.floor(p * 7).astype(int)
        want[-1] = 7 - want[:-1].sum()
        assert [int((ytr[s.train] == c).sum()) for s in splits] == want.tolist()
    assert sorted(np.concatenate([s.train for s in splits]).tolist()) == list(range(21))  # each image exactly once
    assert all(s.test.tolist() == list(range(6)) for s in splits)
    assert [s.train.tolist() for s in partition("dirichlet_shared_test", spec)] == [sorted(s.train.tolist()) for s in splits]


# ------------------------------------------------------------------------------------------ the VPDR summary
def test_vpdr_table_per_domain_avg_and_sample_std_of_the_last_round(tmp_path):
    from raysim.engine.evaluation import PROTOCOLS, vpdr_table

    path = tmp_path / "client_results.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["round", "client", "in_client", "domain"])
        w.writeheader()
        for c, d in enumerate(["amazon", "caltech", "dslr", "webcam"]):
            w.writerow({"round": 0, "client": c, "in_client": 0.1, "domain": d})  # an earlier round: ignored
        # vpdr.txt Table 1, Office-Caltech, FedProto + IGPP: 95.32 91.07 81.38 95.51 -> AVG 90.82, STD 6.62
        for c, (d, a) in enumerate(zip(["amazon", "caltech", "dslr", "webcam"], [0.9532, 0.9107, 0.8138, 0.9551])):
            w.writerow({"round": 4, "client": c, "in_client": a, "domain": d})
    t = vpdr_table(path)
    assert list(t) == ["amazon", "caltech", "dslr", "webcam", "AVG", "STD"]
    assert t["dslr"] == pytest.approx(0.8138)
    assert round(100 * t["AVG"], 2) == 90.82 and round(100 * t["STD"], 2) == 6.62  # the paper's rounding
    numbers = {"vpdr_avg": t["AVG"], "vpdr_std": t["STD"], **{f"vpdr_{d}": t[d] for d in ["amazon", "caltech", "dslr", "webcam"]}}
    md = PROTOCOLS.get("vpdr").markdown("FedProto+IGPP", numbers)
    assert "| FedProto+IGPP | 95.32 | 91.07 | 81.38 | 95.51 | 90.82 | 6.62 |" in md
