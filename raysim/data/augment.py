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

import math
from typing import Any, Callable, Sequence

import torch
from PIL import Image
from torch.utils.data import Dataset

from raysim.errors import ConfigError
from raysim.sampling import generator

SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop defaults, as the official code (Dassl) uses them
RATIO = (3.0 / 4.0, 4.0 / 3.0)
FLIP_P = 0.5
# what the feature cache's key records of the transform: a change to the transform must change it
TAG = f"rrc{SCALE[0]:g}-{SCALE[1]:g}-r{RATIO[0]:.4f}-{RATIO[1]:.4f}-bicubic-flip{FLIP_P:g}-v1"


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


def crop_box(width: int, height: int, gen: torch.Generator) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (top, left, h, w) as torchvision draws it (10 tries, then the centre crop at
    the nearest allowed aspect ratio), from `gen` instead of the global RNG."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * float(torch.empty(1).uniform_(SCALE[0], SCALE[1], generator=gen))
        aspect = math.exp(float(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=gen)))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=gen))
            left = int(torch.randint(0, width - w + 1, (1,), generator=gen))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif in_ratio > RATIO[1]:
        h, w = height, int(round(height * RATIO[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def make_augment(image_size: int, mean: Sequence[float], std: Sequence[float]) -> Callable[[Image.Image, torch.Generator], torch.Tensor]:
    """The official train transform as a function of (image, generator): crop, resize to image_size (bicubic),
    flip, ToTensor, Normalize(mean, std)."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    size = int(image_size)
    m, s = [float(v) for v in mean], [float(v) for v in std]

    def view(img: Image.Image, gen: torch.Generator) -> torch.Tensor:
        top, left, h, w = crop_box(img.width, img.height, gen)
        out = TF.resized_crop(img, top, left, h, w, [size, size], interpolation=InterpolationMode.BICUBIC)
        if float(torch.rand(1, generator=gen)) < FLIP_P:
            out = TF.hflip(out)
        return TF.normalize(TF.to_tensor(out), m, s)

    return view


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


__all__ = ["TAG", "AugmentedViews", "augment_mode", "augmentable", "crop_box", "make_augment", "officially_augmented"]
