"""Pieces the model-homogeneous GFL / PFL baselines (fedbabu, fedetf, fedfa, fedpac) share.

The global model of `Homogeneous` (methods/fedtsp/fedavg.py) travels as one flat vector of its state_dict. A
zoo model registers its extractor first and its head last (`HtModel`: base, pool, head), so the flat
vector is the body (feature extractor, BatchNorm buffers included) followed by the head (weight, bias):
`split_weights` cuts it there, `join_weights` glues the two back.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn

from raysim.models.zoo import HtModel


def head_size(model: HtModel) -> int:
    """How many values of the flat state are the head's (they are its last entries)."""
    keys = list(model.state_dict())
    head = [k for k in keys if k.startswith("head.")]
    if keys[-len(head):] != head:  # pragma: no cover - HtModel registers the head last
        raise AssertionError("the head's entries must come last in the model's state_dict")
    return sum(model.state_dict()[k].numel() for k in head)


def split_weights(weights: Tensor, n_head: int) -> tuple[Tensor, Tensor]:
    """(body, head) of a flat model vector whose last `n_head` values are the head's."""
    return weights[:-n_head].clone(), weights[-n_head:].clone()


def join_weights(body: Tensor, head: Tensor) -> Tensor:
    return torch.cat([body.reshape(-1).float(), head.reshape(-1).float()])


def flat_head(model: nn.Module) -> Tensor:
    return torch.cat([v.detach().reshape(-1).float().cpu() for k, v in model.state_dict().items() if k.startswith("head.")])


def flat_body(model: nn.Module) -> Tensor:
    return torch.cat([v.detach().reshape(-1).float().cpu() for k, v in model.state_dict().items() if not k.startswith("head.")])


@contextmanager
def frozen(*modules: nn.Module) -> Iterator[None]:
    """The parameters of `modules` get no gradient inside the block (plain SGD then leaves them as they
    are); their requires_grad flags are put back afterwards (the host's cached module is reused)."""
    params = [p for m in modules for p in m.parameters()]
    before = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, before):
            p.requires_grad_(flag)


def class_counts(y: Tensor, num_classes: int) -> Tensor:
    return torch.bincount(y.long().cpu(), minlength=num_classes).float()
