"""Training augmentation as the official FedSEPT code does it, for frozen-feature (CLIP) methods.

The official code trains every method on the CLIP datasets' train transform (SPEC 1.9): RandomResizedCrop(224,
scale 0.08-1, ratio 3/4-4/3, bicubic), a horizontal flip with probability 1/2, CLIP's mean/std. Its CIFAR runs
use no augmentation, and neither do FedTSP's or VPDR's (their images are stored pre-transformed).

The image tower is frozen, so raysim encodes a fixed number of augmented views per training image once
(`data.augment_views`, cached with the other features: raysim/data/features.py) and draws one view per image
per local epoch from the (round, client) stream (`ClientData.for_round`). The views of image i are drawn from its
own stream, generator(seed, "augment-view", i, v), so they do not depend on the batch size of the encoder, the
device or the order the images are encoded in. The test split keeps the test transform.

`data.augment`: "auto" (the default) is "official" exactly where the official code augments (the CoOp
datasets and the domain datasets, for methods that see frozen features) and "off" elsewhere (synthetic, digits,
CIFAR, Tiny-ImageNet, PFLlib folders, methods that train their own image models); "official" asks for it on any
dataset of image files or arrays (CIFAR included); "off" is the test transform for training too, the behaviour
before augmentation existed, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from raysim.data.crop import TAG  # re-exported: the feature cache key reads it from here
from raysim.errors import ConfigError
from raysim.sampling import generator


def officially_augmented(dataset: str) -> bool:
    """True for the datasets the official FedSEPT code trains with augmentation (CoOp and domain datasets)."""
    from raysim.data.folders import COOP, DOMAIN

    return dataset in COOP or dataset in DOMAIN


def augmentable(dataset: str | None = None):
    """The datasets whose training split carries the augmentation (`ImageItems.augment`, raysim/data/folders.py):
    the set of them, or whether `dataset` is one."""
    from raysim.data.folders import COOP, DOMAIN

    names = frozenset(COOP) | frozenset(DOMAIN) | {"cifar10", "cifar100", "tiny_imagenet"}
    return names if dataset is None else dataset in names


def augment_mode(augment: str, dataset: str, *, partition: str = "", input_kind: str = "features") -> str:
    """`data.augment` resolved for a run: "official" or "off". Raises ConfigError (exit 2) where "official" is
    asked for but cannot apply: a method that trains its own image models, or a pooled partition (the pool
    merges train and test, so a training row may be another client's test row)."""
    from raysim.data.partition import is_pooled

    if augment == "off":
        return "off"
    if augment == "auto":
        on = officially_augmented(dataset) and input_kind != "images" and not (partition and is_pooled(partition))
        return "official" if on else "off"
    if input_kind == "images":
        raise ConfigError("data.augment=official augments the images a frozen CLIP tower encodes; this method trains its "
                          "own image model on the images as loaded: set data.augment=off (or auto)")
    if partition and is_pooled(partition):
        raise ConfigError(f"data.augment=official cannot go with data.partition={partition}: it pools train and test, "
                          "so a client's training row may be another's test row; set data.augment=off (or auto)")
    return "official"


class AugmentedViews(Dataset):
    """`views` augmented views of every image of an ImageItems, flattened image-major: item j is view j % views
    of image j // views, drawn from generator(seed, "augment-view", image, view)."""

    def __init__(self, images: Any, views: int, seed: int) -> None:
        augment = getattr(images, "augment", None)
        if augment is None:
            raise ConfigError("data.augment=official needs a dataset of image files or arrays (CoOp, domain, CIFAR, "
                              "Tiny-ImageNet); this dataset's images have no augmentation: set data.augment=off (or auto)")
        self.images, self.views, self.seed, self.augment = images, int(views), int(seed), augment

    def __len__(self) -> int:
        return len(self.images) * self.views

    def __getitem__(self, j: int) -> torch.Tensor:
        i, v = divmod(int(j), self.views)
        return self.augment(self.images.load(i), generator(self.seed, "augment-view", i, v))


__all__ = ["TAG", "AugmentedViews", "augment_mode", "augmentable", "officially_augmented"]
