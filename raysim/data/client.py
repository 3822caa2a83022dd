"""One client's data as a method sees it (the engine builds it from the federation's split)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class ClientData:
    """One client's data as the method sees it (features of a frozen encoder, or images).

    `tokens_*` (N, K, width), float16, are the frozen image tower's token sequences, present only for
    methods whose `input` is "features+tokens"."""

    client_id: int
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    tokens_train: Optional[Tensor] = None
    tokens_test: Optional[Tensor] = None

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    def classes(self) -> list[int]:
        return sorted(int(c) for c in torch.unique(self.y_train))
