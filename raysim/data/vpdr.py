"""The VPDR paper's data (vpdr.txt section 5, SPEC 3.4 and 4): Digits as four domains, its offline stand-in,
and CIFAR-10's label skew with a shared global test set.

``digits4`` (offline): the project's generator (raysim/data/synthetic.py) drawing the ten digit classes in its
four styles, clean / photo / sketch / cartoon, one domain per client as the paper has MNIST / USPS / SVHN /
SynthDigits (use ``data.partition=domain train.num_clients=4``: client k holds domain k). 30 training and
50 test images per (digit, domain) at 32x32, data seed 5 (no other registered dataset uses it; the shipped
raysim-vit backbone was pretrained on the generator's shapes and letters only, never its digits).

``vpdr_digits`` (a user's copies under data.data_root; nothing is downloaded or written):

    DATA_ROOT/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]     (torchvision's MNIST layout)
    DATA_ROOT/USPS/{usps.bz2,usps.t.bz2}                                       (torchvision's USPS files)
    DATA_ROOT/SVHN/{train_32x32.mat,test_32x32.mat}                            (torchvision's SVHN files)
    DATA_ROOT/synthetic_digits/{imgs_train,imgs_valid}/<0..9>/*.png            (SynthDigits)

Domains in that order (mnist, usps, svhn, synth), every image of each split; grey images become 3 channels.
The VPDR code keeps a random 10% of each domain's training set and every test image (utils/domain_skew.py
keep_ratio): `data.train_fraction=0.1` does the same (raysim/data/subset.py: max(1, floor(0.1 n)) rows per
domain, drawn from the run seed), as the VPDR paper presets set it; PACS and Office-Caltech are kept at 0.3
there the same way.

Images: the deterministic test transform (resize the shorter side, centre crop), materialised once for the
methods that train on them. The VPDR code trains on RandomCrop(224, padding 4) + horizontal flip of the domain
datasets (Digits, PACS, Office-Caltech); `data.augment` (its default `auto` is `official` for the VPDR frameworks
on vpdr_digits, pacs and office_caltech10) crops and flips the materialised images afresh at every pass over a
client's training images, from the (round, client) stream (raysim/data/padcrop.py), so nothing is decoded
twice and every backend sees the same crops.

``partition=dirichlet_shared_test`` (CIFAR-10 label skew as the VPDR code splits it): per class,
p ~ Dirichlet(data.beta = alpha) over the clients, client k gets floor(p_k n_c) of the class's training
images and the last client the remainder; every client tests on the whole test set (the paper's shared
global test set).
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import os
from typing import Any, Optional

import numpy as np
from torch.utils.data import ConcatDataset

import raysim.data.synthetic as syn
from raysim.data.base import DatasetBundle, ImageSet, LoadSpec, register_dataset
from raysim.data.folders import IMG_EXTENSIONS, ImageItems, make_signature, make_transform
from raysim.data.partition import PARTITIONERS, ClientSplit, PartitionSpec
from raysim.errors import DataError

DIGITS4 = syn.SyntheticParams(classes=tuple(syn.DIGITS), domains=tuple(syn.DOMAINS), train_per_cell=30, test_per_cell=50, seed=5)
VPDR_DIGIT_DOMAINS = ("mnist", "usps", "svhn", "synth")
LAYOUT = (
    "DATA_ROOT/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz], DATA_ROOT/USPS/{usps.bz2,usps.t.bz2}, "
    "DATA_ROOT/SVHN/{train_32x32.mat,test_32x32.mat}, DATA_ROOT/synthetic_digits/{imgs_train,imgs_valid}/<0..9>/*"
)


@register_dataset("digits4")
def load_digits4(spec: LoadSpec) -> DatasetBundle:
    """Ten digits in the generator's four styles (clean, photo, sketch, cartoon): VPDR's Digits, offline."""
    return syn.make_bundle(DIGITS4, spec, "digits4")


# ------------------------------------------------------------------------------------------ Digits from disk
def _missing(what: str) -> DataError:
    return DataError(
        f"vpdr_digits: {what}. Expected layout: {LAYOUT} (SPEC section 4). Put your copies of MNIST, USPS, SVHN and "
        "SynthDigits there and pass data.data_root=DATA_ROOT, or run offline on the stand-in with data.dataset=digits4."
    )


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _find(folder: str, name: str) -> Optional[str]:
    for cand in (name, name + ".gz"):
        p = os.path.join(folder, cand)
        if os.path.isfile(p):
            return p
    return None


def read_idx(path: str) -> np.ndarray:
    """An IDX file (MNIST's format: magic 0x0000 0x08 ndim, big-endian int32 dims, uint8 data)."""
    with _open(path) as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise _missing(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise _missing(f"{path} is truncated ({data.size} bytes for dims {dims})")
    return data.reshape(dims)


def _mnist(root: str, train: bool) -> tuple[np.ndarray, np.ndarray, str]:
    folder = os.path.join(root, "MNIST", "raw")
    pre = "train" if train else "t10k"
    img, lab = _find(folder, f"{pre}-images-idx3-ubyte"), _find(folder, f"{pre}-labels-idx1-ubyte")
    if img is None or lab is None:
        raise _missing(f"MNIST files {pre}-images-idx3-ubyte / {pre}-labels-idx1-ubyte not found in {folder}")
    x, y = read_idx(img), read_idx(lab).astype(np.int64)
    if x.shape[0] != y.shape[0]:
        raise _missing(f"{img} holds {x.shape[0]} images but {lab} {y.shape[0]} labels")
    return x, y, img


def _usps(root: str, train: bool) -> tuple[np.ndarray, np.ndarray, str]:
    path = os.path.join(root, "USPS", "usps.bz2" if train else "usps.t.bz2")
    if not os.path.isfile(path):
        raise _missing(f"USPS file {path} not found")
    with bz2.open(path) as fp:
        rows = [line.decode().split() for line in fp.readlines() if line.strip()]
    vals = np.asarray([[v.split(":")[-1] for v in r[1:]] for r in rows], dtype=np.float32).reshape(-1, 16, 16)
    x = ((vals + 1) / 2 * 255).clip(0, 255).astype(np.uint8)  # libsvm values in [-1, 1]
    y = np.asarray([int(float(r[0])) - 1 for r in rows], dtype=np.int64)  # labels 1..10 -> 0..9
    return x, y, path


def _svhn(root: str, train: bool) -> tuple[np.ndarray, np.ndarray, str]:
    path = os.path.join(root, "SVHN", "train_32x32.mat" if train else "test_32x32.mat")
    if not os.path.isfile(path):
        raise _missing(f"SVHN file {path} not found")
    import scipy.io as sio

    m = sio.loadmat(path)
    x = np.ascontiguousarray(np.transpose(m["X"], (3, 0, 1, 2))).astype(np.uint8)  # (32, 32, 3, N) -> (N, 32, 32, 3)
    y = m["y"].astype(np.int64).reshape(-1) % 10  # SVHN labels 10 for the digit 0
    return x, y, path


def _synth(root: str, train: bool) -> tuple[list[str], np.ndarray, str]:
    folder = os.path.join(root, "synthetic_digits", "imgs_train" if train else "imgs_valid")
    if not os.path.isdir(folder):
        raise _missing(f"SynthDigits folder {folder} not found")
    items, labels = [], []
    for c in range(10):
        cdir = os.path.join(folder, str(c))
        if not os.path.isdir(cdir):
            raise _missing(f"SynthDigits class folder {cdir} not found")
        files = sorted(f for f in os.listdir(cdir) if f.lower().endswith(IMG_EXTENSIONS))
        items += [os.path.join(cdir, f) for f in files]
        labels += [c] * len(files)
    if not items:
        raise _missing(f"no images under {folder}/<0..9>/")
    return items, np.asarray(labels, dtype=np.int64), folder


READERS: dict[str, Any] = {"mnist": _mnist, "usps": _usps, "svhn": _svhn, "synth": _synth}


@register_dataset("vpdr_digits")
def load_vpdr_digits(spec: LoadSpec) -> DatasetBundle:
    """MNIST, USPS, SVHN and SynthDigits from data_root as four domains (the paper's 10% of each training set:
    data.train_fraction=0.1)."""
    root = os.path.abspath(os.path.expanduser(str(spec.data_root)))
    if not os.path.isdir(root):
        raise _missing(f"data_root {root} not found")
    tf_name = "resize-centercrop"
    transform = make_transform(tf_name, spec)
    parts: dict[str, dict[str, list]] = {s: {"sets": [], "labels": [], "domains": []} for s in ("train", "test")}
    sources: list[str] = []
    for d, dom in enumerate(VPDR_DIGIT_DOMAINS):
        for split in ("train", "test"):
            items, labels, src = READERS[dom](root, split == "train")
            parts[split]["sets"].append(ImageItems(items, transform))
            parts[split]["labels"].append(labels)
            parts[split]["domains"].append(np.full(len(labels), d, dtype=np.int64))
            sources.append(f"{os.path.relpath(src, root)}:{len(labels)}:{_digest(labels)}")

    def imageset(split: str) -> ImageSet:
        p = parts[split]
        return ImageSet(ConcatDataset(p["sets"]), np.concatenate(p["labels"]), np.concatenate(p["domains"]))

    train, test = imageset("train"), imageset("test")
    return DatasetBundle(
        name="vpdr_digits",
        classnames=list(syn.DIGITS),
        train=train,
        test=test,
        domain_names=list(VPDR_DIGIT_DOMAINS),
        signature=make_signature("vpdr_digits", root, sources, len(train) + len(test), spec, tf_name),
        meta={"root": root, "transform": tf_name},
    )


def _digest(labels: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(labels).tobytes()).hexdigest()[:8]


# ------------------------------------------------------------------------------------------ CIFAR label skew
@PARTITIONERS.register("dirichlet_shared_test")
def dirichlet_shared_test(spec: PartitionSpec) -> list[ClientSplit]:
    """VPDR's label skew: per class p ~ Dir(beta) over the K clients, floor(p_k n_c) training images to
    client k and the remainder to the last client; every client's test split is the whole test set."""
    K = spec.num_clients
    rng = np.random.default_rng([spec.seed, 5])
    train: list[list[np.ndarray]] = [[] for _ in range(K)]
    for c in range(spec.num_classes):
        idx = rng.permutation(np.flatnonzero(spec.train_labels == c))
        p = rng.dirichlet(np.full(K, spec.beta))
        counts = np.floor(p * len(idx)).astype(int)
        counts[-1] = len(idx) - counts[:-1].sum()
        for k, part in enumerate(np.split(idx, np.cumsum(counts)[:-1])):
            train[k].append(part)
    everyone = np.arange(len(spec.test_labels))
    return [ClientSplit(np.concatenate(t) if t else np.zeros(0, np.int64), everyone.copy()) for t in train]


__all__ = ["DIGITS4", "VPDR_DIGIT_DOMAINS", "load_digits4", "load_vpdr_digits", "dirichlet_shared_test", "read_idx"]
