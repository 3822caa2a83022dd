"""data.train_fraction: a seeded random fraction of each domain's training split, the test split whole.

The VPDR code (utils/domain_skew.py `partition_domain_skew_loaders`) keeps `max(1, int(n * keep_ratio))` random
training images of each domain (keep_ratio 0.1 for Digits, 0.3 for PACS and Office-Caltech; SPEC 4) and every
test image; with one client per domain (data.partition=domain) that is each client's training split. Here the
fraction is applied to the loaded dataset, before the partition and before any image is encoded or
materialised: for a dataset with domains, to each domain's training images; for one without, to the whole
training split. The rows kept of domain d are drawn from their own stream, stream_seed(seed, "train-fraction",
d), so they depend on the run seed and the domain only (not on the backend, the other domains or the order of
loading), and are kept in the loader's order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from raysim.data.base import DatasetBundle, ImageSet
from raysim.sampling import stream_seed


def kept_count(n: int, fraction: float) -> int:
    """How many of n training images a domain keeps: max(1, floor(n * fraction)), the VPDR code's
    max(1, int(total * keep_ratio)) (all n at fraction 1, none of an empty domain)."""
    if n <= 0:
        return 0
    return n if fraction >= 1.0 else max(1, int(n * float(fraction)))


def kept_rows(n: int, fraction: float, *, seed: int, domain: int = 0) -> np.ndarray:
    """The sorted rows (of n) that domain `domain` keeps, drawn from stream_seed(seed, "train-fraction", domain)."""
    k = kept_count(n, fraction)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(stream_seed(seed, "train-fraction", int(domain)))
    return np.sort(rng.permutation(n)[:k]).astype(np.int64)


class SubsetImages(Dataset):
    """Rows `rows` of an image dataset, in that order. It passes on the training augmentation of image files
    (`load` and `augment`, raysim/data/augment.py) so that data.augment works on a kept fraction too."""

    def __init__(self, images: Any, rows: np.ndarray) -> None:
        self.images, self.rows = images, np.asarray(rows, dtype=np.int64)
        self.augment = getattr(images, "augment", None)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, i: int) -> Any:
        return self.images[int(self.rows[int(i)])]

    def load(self, i: int) -> Any:
        return self.images.load(int(self.rows[int(i)]))


def train_rows(bundle: DatasetBundle, fraction: float, *, seed: int) -> np.ndarray:
    """The training rows a run keeps at `fraction`: per domain (`kept_rows`), or of the whole split without domains."""
    domains = bundle.train.domains
    if domains is None:
        return kept_rows(len(bundle.train), fraction, seed=seed)
    keep = []
    for d in np.unique(domains):
        where = np.flatnonzero(domains == d)
        keep.append(where[kept_rows(len(where), fraction, seed=seed, domain=int(d))])
    return np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)


def keep_train_fraction(bundle: DatasetBundle, fraction: float, *, seed: int) -> DatasetBundle:
    """The bundle with `fraction` of each domain's training images kept (module docstring); the test split,
    the classes and the domains as they were. Fraction 1 returns the bundle itself. The signature records the
    fraction and the seed (it keys the feature cache)."""
    if fraction >= 1.0:
        return bundle
    rows = train_rows(bundle, fraction, seed=seed)
    tr = bundle.train
    train = ImageSet(SubsetImages(tr.images, rows), tr.labels[rows], None if tr.domains is None else tr.domains[rows])
    meta = {**bundle.meta, "train_fraction": float(fraction), "train_full": len(tr)}
    return dataclasses.replace(bundle, train=train, signature=f"{bundle.signature}|train_fraction={float(fraction)!r}|seed={int(seed)}",
                               meta=meta)


__all__ = ["SubsetImages", "keep_train_fraction", "kept_count", "kept_rows", "train_rows"]
