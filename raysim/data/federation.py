"""What every client host reads: the inputs of all clients (features or images), the labels and the
partition, as numpy arrays (zero-copy in Ray's object store), and each client's slice of it."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from raysim.data.client import ClientData
from raysim.data.padcrop import PadCropFlip


@dataclass
class FederationData:
    """Inputs of every client (features or images), labels, and the partition (numpy, zero-copy in Ray).

    Under a pooled partition (partition=pfllib) the official train and test sets are merged: `x_train`
    and `x_test` are then the same pool array (and so are the labels), and a client's train and test
    indices are disjoint rows of it."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    train_idx: list[np.ndarray]
    test_idx: list[np.ndarray]
    classnames: list[str]
    tok_train: Optional[np.ndarray] = None  # image-tower tokens (N, K, width), for "features+tokens" methods
    tok_test: Optional[np.ndarray] = None
    client_domains: Optional[list[str]] = None  # each client's (majority) training domain, for datasets with domains
    # training augmentation (data.augment): features (N_train, V, D) of V augmented views of every training image,
    # and their tokens (N_train, V, K, width) for "features+tokens" methods; None = train on x_train as it is
    x_views: Optional[np.ndarray] = None
    tok_views: Optional[np.ndarray] = None
    # training augmentation of images (data.augment for a method training on them): the crop-and-flip every pass
    # over a client's training images applies afresh (raysim/data/padcrop.py); None = train on x_train as it is
    image_augment: Optional[PadCropFlip] = None

    @property
    def num_clients(self) -> int:
        return len(self.train_idx)

    def client(self, cid: int) -> ClientData:
        """Client `cid`'s slice as the method sees it (tensors; the arrays themselves are not copied)."""
        tr, te = as_tensor(self.train_idx[cid]), as_tensor(self.test_idx[cid])
        xtr, ytr, xte, yte = (as_tensor(a) for a in (self.x_train, self.y_train, self.x_test, self.y_test))
        ttr, tte = (None if a is None else as_tensor(a) for a in (self.tok_train, self.tok_test))
        xv, tv = (None if a is None else as_tensor(a) for a in (self.x_views, self.tok_views))
        return ClientData(
            cid, xtr[tr], ytr[tr], xte[te], yte[te], len(self.classnames),
            tokens_train=None if ttr is None else ttr[tr], tokens_test=None if tte is None else tte[te],
            views_train=None if xv is None else xv[tr], token_views_train=None if tv is None else tv[tr],
            image_augment=self.image_augment,
        )


class ClientSlices(Mapping[int, ClientData]):
    """The `ClientData` of a host's clients, made on first use and kept for the `keep` most recently used
    (a slice copies the client's rows, so building all of them up front held every row a second time per
    host: about 1 GiB at 100,000 clients). Slices are pure functions of the arrays, so a rebuilt one equals
    the dropped one."""

    def __init__(self, data: FederationData, client_ids: list[int], *, keep: int = 1024) -> None:
        self._data, self._ids, self._keep = data, sorted(client_ids), keep
        self._known = set(self._ids)
        self._cache: OrderedDict[int, ClientData] = OrderedDict()

    def __getitem__(self, cid: int) -> ClientData:
        if cid not in self._known:
            raise KeyError(cid)
        got = self._cache.get(cid)
        if got is None:
            got = self._cache[cid] = self._data.client(cid)
            if len(self._cache) > self._keep:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(cid)
        return got

    def __contains__(self, cid: object) -> bool:
        return cid in self._known  # without building the slice

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def as_tensor(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # arrays from Ray's object store are read-only; we never write them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)
