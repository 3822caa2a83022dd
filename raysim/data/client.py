"""One client's data as a method sees it (the engine builds it from the federation's split)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class ClientData:
    """One client's data as the method sees it (features of a frozen encoder, or images).

    `tokens_*` (N, K, width), float16, are the frozen image tower's token sequences, present only for
    methods whose `input` is "features+tokens".

    Under training augmentation (data.augment, raysim/data/augment.py) `views_train` (N, V, D) holds the features
    of V augmented views of every training image (and `token_views_train` (N, V, K, width) their tokens, when
    asked for); `for_round` draws one view per image per local epoch and `train_inputs(epoch)` gives that
    epoch's features. Without it, `train_inputs(epoch)` is (x_train, tokens_train) for every epoch."""

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

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    def classes(self) -> list[int]:
        return sorted(int(c) for c in torch.unique(self.y_train))

    def for_round(self, seed: int, round_idx: int, epochs: int) -> "ClientData":
        """This client's data for its local training in round `round_idx`: itself without augmented views; else
        a copy whose `view_choice` holds one view per image per epoch, drawn from generator(seed, "views",
        round, client) (the same on every backend and host), and whose x_train / tokens_train are epoch 0's."""
        if self.views_train is None:
            return self
        from raysim.sampling import generator

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
