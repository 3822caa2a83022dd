"""Training augmentation as each method's official code does it (data.augment): the policy, and the cached views
of frozen-feature methods.

Frozen-feature (CLIP) methods: the official FedSEPT code trains every method on the CLIP datasets' train transform
(SPEC 1.9): RandomResizedCrop(224, scale 0.08-1, ratio 3/4-4/3, bicubic), a horizontal flip with probability 1/2,
CLIP's mean/std (raysim/data/crop.py). Its CIFAR runs use no augmentation, and neither do FedTSP's. The image
tower is frozen, so raysim encodes a fixed number of augmented views per training image once
(`data.augment_views`, cached with the other features: raysim/data/features.py) and draws one view per image
per local epoch from the (round, client) stream (`ClientData.for_round`). The views of image i are drawn from its
own stream, generator(seed, "augment-view", i, v), so they do not depend on the batch size of the encoder, the
device or the order the images are encoded in.

Methods that train on images and declare their code's augmentation (`Method.image_augment`): the VPDR frameworks'
"pad-crop-flip", the VPDR code's RandomCrop(224, padding 4) + horizontal flip on its Digits, PACS and
Office-Caltech (not on its CIFAR label skew), raysim/data/padcrop.py. Their model is not frozen, so nothing is
cached: the images are materialised once with the test transform and every pass over a client's training images
(each local epoch, and the release's pass) crops and flips them afresh, the crops drawn from the (round, client)
stream. The test split keeps the test transform.

`data.augment`: "auto" (the default) is "official" exactly where the method's official code augments (FedSEPT:
the CoOp and domain datasets, for methods that see frozen features; VPDR: vpdr_digits, pacs, office_caltech10)
and "off" elsewhere (synthetic, digits, CIFAR, Tiny-ImageNet, PFLlib folders, methods that train their own image
models without an augmentation of their code's); "official" asks for it on any dataset it can apply to (CIFAR
included); "off" is the test transform for training too, the behaviour before augmentation existed, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from raysim.data.crop import TAG  # re-exported: the feature cache key reads it from here
from raysim.data.padcrop import NAME as PAD_CROP_FLIP
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


# a method's declared image augmentation (Method.image_augment) -> the datasets its official code trains with it
IMAGE_AUGMENTED: dict[str, frozenset[str]] = {
    PAD_CROP_FLIP: frozenset({"vpdr_digits", "pacs", "office_caltech10"}),  # VPDR utils/domain_skew.py (not label_skew.py)
}


def augment_mode(augment: str, dataset: str, *, partition: str = "", input_kind: str = "features", image_augment: str = "") -> str:
    """`data.augment` resolved for a run: "official" or "off". `image_augment` is the method's declared augmentation
    of the images it trains on (`Method.image_augment`). Raises ConfigError (exit 2) where "official" is asked for
    but cannot apply: a method that trains its own image model and declares no augmentation of its code's, a pooled
    partition (the pool merges train and test, so a training row may be another client's test row), a dataset with
    nothing to augment."""
    from raysim.data.partition import is_pooled

    pooled = bool(partition) and is_pooled(partition)
    if augment == "off":
        return "off"
    if augment == "auto":
        if pooled:
            return "off"
        if input_kind == "images":
            on = dataset in IMAGE_AUGMENTED.get(image_augment, frozenset())
        else:
            on = officially_augmented(dataset)
        return "official" if on else "off"
    if input_kind == "images" and not image_augment:
        raise ConfigError("data.augment=official is the training augmentation of the method's official code; this method "
                          "trains its own image model on the images as loaded (its code does not augment them): set "
                          "data.augment=off (or auto)")
    if input_kind == "images" and image_augment not in IMAGE_AUGMENTED:
        raise ConfigError(f"the method declares the image augmentation {image_augment!r}, which raysim does not have "
                          f"(known: {', '.join(sorted(IMAGE_AUGMENTED))}): set data.augment=off")
    if pooled:
        raise ConfigError(f"data.augment=official cannot go with data.partition={partition}: it pools train and test, "
                          "so a client's training row may be another's test row; set data.augment=off (or auto)")
    if input_kind == "images" and dataset == "pfllib":
        raise ConfigError("data.augment=official pads the crop with the images' black, which needs their normalisation; "
                          "data.dataset=pfllib stores its images already normalised by the folder's own: set data.augment=off")
    if input_kind != "images" and not augmentable(dataset):
        raise ConfigError(f"data.augment=official needs a dataset of image files or arrays ({', '.join(sorted(augmentable()))}); "
                          f"data.dataset={dataset} has no images to augment: set data.augment=off (or auto)")
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


__all__ = ["IMAGE_AUGMENTED", "TAG", "AugmentedViews", "augment_mode", "augmentable", "officially_augmented"]
