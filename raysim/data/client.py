"""One client's data as a method sees it (the engine builds it from the federation's split)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from raysim.data.padcrop import PadCropFlip


@dataclass
class ClientData:
    """One client's data as the method sees it (features of a frozen encoder, or images).

    `tokens_*` (N, K, width), float16, are the frozen image tower's token sequences, present only for
    methods whose `input` is "features+tokens".

    Under training augmentation (data.augment, raysim/data/augment.py) `views_train` (N, V, D) holds the features
    of V augmented views of every training image (and `token_views_train` (N, V, K, width) their tokens, when
    asked for); `for_round` draws one view per image per local epoch and `train_inputs(epoch)` gives that
    epoch's features. Without it, `train_inputs(epoch)` is (x_train, tokens_train) for every epoch.

    Under training augmentation of images (a method training on them, raysim/data/padcrop.py) `image_augment` is
    the crop-and-flip; `for_round` draws one crop per image for each local epoch and one for the release's pass
    (`crop_draws`), and `train_batch(idx, epoch)` gives those rows of the training images as that pass sees them.
    Without it, `train_batch(idx, epoch)` is x_train[idx] (or the epoch's drawn view of features)."""

    client_id: int
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    tokens_train: Optional[Tensor] = None
    tokens_test: Optional[Tensor] = None
    views_train: Optional[Tensor] = None
    token_views_train: Optional[Tensor] = None
    view_choice: Optional[Tensor] = None  # (epochs, N) int64: the view of each image in each epoch of this round
    image_augment: Optional[PadCropFlip] = None  # images: the crop-and-flip of every pass over the training images
    crop_draws: Optional[Tensor] = None  # (epochs + 1, N, 3) int64: each pass's crop of each image (the last: the release's)

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    def classes(self) -> list[int]:
        return sorted(int(c) for c in torch.unique(self.y_train))

    def for_round(self, seed: int, round_idx: int, epochs: int) -> "ClientData":
        """This client's data for its local training in round `round_idx`: itself without augmentation; else a
        copy whose `view_choice` holds one view per image per epoch (features; x_train / tokens_train are then epoch
        0's), or whose `crop_draws` holds one crop per image per epoch and one for the release's pass (images),
        drawn from generator(seed, "views", round, client): the same on every backend and host."""
        from raysim.sampling import generator

        if self.image_augment is not None:  # images: a crop per image for each epoch and the release's pass
            g = generator(seed, "views", round_idx, self.client_id)
            return dataclasses.replace(self, crop_draws=self.image_augment.draw(self.num_train, max(1, int(epochs)) + 1, g))
        if self.views_train is None:
            return self
        g = generator(seed, "views", round_idx, self.client_id)
        n, v = self.views_train.shape[:2]
        choice = torch.randint(0, int(v), (max(1, int(epochs)), int(n)), generator=g)
        out = dataclasses.replace(self, view_choice=choice)
        out.x_train, out.tokens_train = out.train_inputs(0)
        return out

    def train_inputs(self, epoch: int) -> tuple[Tensor, Optional[Tensor]]:
        """(features, tokens) of the training images in local epoch `epoch` of this round (tokens None unless
        asked for): the epoch's drawn view under augmentation, else x_train and tokens_train."""
        if self.view_choice is None or self.views_train is None:
            return self.x_train, self.tokens_train
        pick = self.view_choice[int(epoch) % self.view_choice.shape[0]]
        rows = torch.arange(pick.shape[0])
        toks = None if self.token_views_train is None else self.token_views_train[rows, pick]
        return self.views_train[rows, pick], toks

    def train_batch(self, idx: Tensor, epoch: Optional[int] = None, *, device: Optional[torch.device] = None) -> Tensor:
        """Rows `idx` of the training inputs, on `device`, as local epoch `epoch` of this round sees them (None: the
        release's pass over the training images, which reads them once before the round's training). Under
        augmentation of images: their drawn crops (the crop is taken on `device`: a copy of pixels, the same on
        any); of features: the epoch's drawn views (epoch 0's for the release); else x_train[idx]."""
        if self.image_augment is not None and self.crop_draws is not None:
            passes = self.crop_draws.shape[0] - 1  # the last row is the release's
            row = self.crop_draws[passes if epoch is None else int(epoch) % passes]
            return self.image_augment(_on(self.x_train[idx], device), row[idx])
        x = self.x_train if epoch is None else self.train_inputs(epoch)[0]
        return _on(x[idx], device)


def _on(x: Tensor, device: Optional[torch.device]) -> Tensor:
    return x if device is None else x.to(device)
