"""The official FedSEPT code's train transform as a seeded function of (image, generator): RandomResizedCrop's
box drawn as torchvision draws it, from the given generator instead of the global RNG, then resize, flip,
ToTensor, Normalize. The policy of where it applies (data.augment) and the cached views are in
raysim/data/augment.py; the image loaders (raysim/data/folders.py) attach this transform to training splits.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from PIL import Image

SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop defaults, as the official code (Dassl) uses them
RATIO = (3.0 / 4.0, 4.0 / 3.0)
FLIP_P = 0.5
# what the feature cache's key records of the transform: a change to the transform must change it
TAG = f"rrc{SCALE[0]:g}-{SCALE[1]:g}-r{RATIO[0]:.4f}-{RATIO[1]:.4f}-bicubic-flip{FLIP_P:g}-v1"


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


__all__ = ["FLIP_P", "RATIO", "SCALE", "TAG", "crop_box", "make_augment"]
