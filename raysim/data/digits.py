"""scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes), upscaled for CLIP."""

from __future__ import annotations

import numpy as np
import torch

from raysim.data.base import DatasetBundle, ImageSet, LoadSpec, TensorImages, register_dataset

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed per-class split (the dataset's own train/test split, independent of the run seed)."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        k = int(round(len(idx) * test_fraction))
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


@register_dataset("digits")
def load_digits(spec: LoadSpec) -> DatasetBundle:
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    images = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]  # (N, 1, 8, 8) in [0, 1]
    labels = d.target.astype(np.int64)
    tr, te = stratified_split(labels, test_fraction=0.3, seed=0)

    def subset(idx: np.ndarray) -> ImageSet:
        return ImageSet(TensorImages(images[idx], spec.image_size, spec.mean, spec.std), labels[idx])

    return DatasetBundle(
        name="digits",
        classnames=list(DIGIT_NAMES),
        train=subset(tr),
        test=subset(te),
        signature="sklearn-digits-v1-split0.3",
    )
