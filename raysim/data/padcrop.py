"""The VPDR code's train transform on images a method trains on: RandomCrop(size, padding 4) + horizontal flip.

The VPDR code (utils/domain_skew.py `get_federated_loaders`) trains on Resize((224, 224)), RandomCrop(224,
padding=4), RandomHorizontalFlip(), ToTensor, Normalize: the resized image is padded with 4 black pixels on every
side, a 224 x 224 window is taken at a uniformly drawn offset (0..8 on each axis) and flipped with probability 1/2.
Normalisation is a per-channel affine map, so the same crop of the already resized and normalised image, padded
with the normalised black, (0 - mean) / std, gives the same pixels: raysim crops the images it has materialised
once (raysim/data/prepare.py) instead of decoding them again, which is a copy of pixels, bitwise the same on
every device.

The draws: one (top, left, flip) per training image per pass over the data, from the (round, client) stream
(`ClientData.for_round`, raysim/data/client.py), so inline, Ray and resumed runs see the same crops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

PADDING = 4  # RandomCrop(224, padding=4)
FLIP_P = 0.5  # RandomHorizontalFlip()
NAME = "pad-crop-flip"  # what a method declares (Method.image_augment) when its official code trains with this


@dataclass(frozen=True)
class PadCropFlip:
    """RandomCrop(size, padding) + a horizontal flip on normalised images (N, C, S, S); `fill` is the
    normalised black, one value per channel."""

    fill: tuple[float, ...]
    padding: int = PADDING
    flip_p: float = FLIP_P

    @classmethod
    def normalised(cls, mean: Sequence[float], std: Sequence[float]) -> "PadCropFlip":
        """The transform for images normalised by (mean, std): the padding is black, (0 - mean) / std in float32
        (as torchvision's Normalize computes it for a black pixel)."""
        m, s = torch.tensor([float(v) for v in mean]), torch.tensor([float(v) for v in std])
        return cls(fill=tuple(float(v) for v in (torch.zeros(len(m)) - m) / s))

    def draw(self, n: int, passes: int, gen: torch.Generator) -> Tensor:
        """(passes, n, 3) int64: each image's crop offset (top, left), each in 0..2 * padding, and its flip (0/1)."""
        offsets = torch.randint(0, 2 * self.padding + 1, (passes, n, 2), generator=gen)
        flips = (torch.rand((passes, n), generator=gen) < self.flip_p).long()
        return torch.cat([offsets, flips[..., None]], dim=-1)

    def __call__(self, x: Tensor, draws: Tensor) -> Tensor:
        """The crops of a batch x (B, C, H, W) at `draws` (B, 3) (from `draw`): the image padded with `fill`,
        the H x W window at (top, left), flipped where the flip is 1. Indexing only: exact on any device."""
        b, c, h, w = x.shape
        p = self.padding
        draws = draws.to(x.device)
        fill = torch.tensor(self.fill, dtype=x.dtype, device=x.device).view(1, c, 1, 1)
        padded = fill.expand(b, c, h + 2 * p, w + 2 * p).clone()
        padded[:, :, p : p + h, p : p + w] = x
        rows = draws[:, 0, None] + torch.arange(h, device=x.device)  # (B, H)
        cols = draws[:, 1, None] + torch.arange(w, device=x.device)  # (B, W)
        out = padded[torch.arange(b, device=x.device)[:, None, None, None], torch.arange(c, device=x.device)[None, :, None, None],
                     rows[:, None, :, None], cols[:, None, None, :]]
        return torch.where(draws[:, 2].bool()[:, None, None, None], out.flip(-1), out)


__all__ = ["FLIP_P", "NAME", "PADDING", "PadCropFlip"]
