"""What a dataset is to the engine: class names, labelled train/test images, optional domains."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from raysim.registry import Registry

# CLIP's input normalisation (open_clip OPENAI_DATASET_MEAN / STD)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class ImageSet:
    """Labelled images. `images` is a torch Dataset yielding a (3, H, W) float tensor per index, already
    transformed for the model (see `transform_for`); `labels` and `domains` are int64 numpy arrays."""

    images: Dataset
    labels: np.ndarray
    domains: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass
class DatasetBundle:
    """A dataset as loaded from disk (or generated): class names, train and test sets, domains.

    `signature` identifies the exact data (name, source, split, size): it keys the feature cache, so it
    must change whenever the images could."""

    name: str
    classnames: list[str]
    train: ImageSet
    test: ImageSet
    domain_names: list[str] = field(default_factory=list)
    signature: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.classnames)


@dataclass
class LoadSpec:
    """What a dataset loader is given."""

    data_root: str
    image_size: int
    mean: Sequence[float] = CLIP_MEAN
    std: Sequence[float] = CLIP_STD
    download: bool = False
    seed: int = 1
    cache_dir: str = "~/.cache/raysim"
    cifar_transform: str = "clip"  # data.cifar_transform: clip | official (the FedSEPT code's, raysim/data/folders.py)


Loader = Callable[[LoadSpec], DatasetBundle]
DATASETS: Registry[Loader] = Registry("dataset")


def register_dataset(name: str) -> Callable[[Loader], Loader]:
    return DATASETS.register(name)


class TensorImages(Dataset):
    """In-memory images (N, C, h, w) in [0, 1], resized to the model size and normalised on access."""

    def __init__(self, images: torch.Tensor, image_size: int, mean: Sequence[float], std: Sequence[float]) -> None:
        if images.dim() != 4:
            raise ValueError("images must be (N, C, H, W)")
        self.images = images
        self.image_size = image_size
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.images[i].float()
        if x.shape[0] == 1:
            x = x.expand(3, -1, -1)
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = torch.nn.functional.interpolate(
                x[None], size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )[0]
        return (x - self.mean) / self.std
