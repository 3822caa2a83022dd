"""The Tiny-ImageNet loader (SPEC section 4) on a fake tiny-imagenet-200 tree built in tmp_path: the
release's layout (val/images + val_annotations.txt), FedTSP's re-organised val/<wnid>/ folders, class names
from words.txt or FedTSP's CSV, and the errors that name the expected layout."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from raysim.data import DATASETS, LoadSpec
from raysim.errors import DataError

S = 16
WNIDS = ["n01443537", "n01629819", "n02124075"]  # sorted: ImageFolder's class order
WORDS = {"n01443537": "goldfish, Carassius auratus", "n01629819": "European fire salamander, Salamandra salamandra",
         "n02124075": "Egyptian cat", "n09999999": "not in this dataset"}


def write_img(path, seed):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, format="JPEG")


def make_tree(root, *, val="release", train_per_class=3, val_per_class=2, words=True):
    base = root / "tiny-imagenet-200"
    for i, w in enumerate(WNIDS):
        for k in range(train_per_class):
            write_img(base / "train" / w / "images" / f"{w}_{k}.JPEG", seed=10 * i + k)
        (base / "train" / w / f"{w}_boxes.txt").write_text("ignored\n")
    ann = []
    for i, w in enumerate(reversed(WNIDS)):  # annotation order is not class order
        for k in range(val_per_class):
            name = f"val_{i * val_per_class + k}.JPEG"
            if val == "release":
                write_img(base / "val" / "images" / name, seed=100 + i * 10 + k)
                ann.append(f"{name}\t{w}\t0\t0\t63\t63")
            else:
                write_img(base / "val" / w / "images" / name, seed=100 + i * 10 + k)
    if val == "release":
        (base / "val" / "val_annotations.txt").write_text("\n".join(ann) + "\n")
    (base / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    if words:
        (base / "words.txt").write_text("".join(f"{k}\t{v}\n" for k, v in WORDS.items()))
    write_img(base / "test" / "images" / "test_0.JPEG", seed=999)  # unlabelled: never read
    return base


def load(root):
    return DATASETS.get("tiny_imagenet")(LoadSpec(data_root=str(root), image_size=S))


@pytest.mark.parametrize("val", ["release", "folders"])
def test_train_and_labelled_val_in_wnid_order(tmp_path, val):
    make_tree(tmp_path, val=val)
    b = load(tmp_path)
    assert b.classnames == ["goldfish", "European fire salamander", "Egyptian cat"]  # words.txt, first name
    assert len(b.train) == 9 and np.bincount(b.train.labels).tolist() == [3, 3, 3]
    assert len(b.test) == 6 and np.bincount(b.test.labels).tolist() == [2, 2, 2]
    assert b.meta["val_layout"] == ("val_annotations" if val == "release" else "folders")
    x = b.train.images[0]
    assert isinstance(x, torch.Tensor) and tuple(x.shape) == (3, S, S) and x.dtype == torch.float32
    # labels follow the annotation file, not the file order: every val image of class y came from wnid y
    files = b.test.images.items
    assert all(os.path.basename(p).startswith("val_") for p in files)
    assert list(b.test.labels) == sorted(b.test.labels)  # ImageFolder order (class, then file)


def test_release_val_labels_match_annotations(tmp_path):
    base = make_tree(tmp_path, val="release")
    b = load(tmp_path)
    truth = {}
    for line in (base / "val" / "val_annotations.txt").read_text().splitlines():
        f, w = line.split("\t")[:2]
        truth[f] = WNIDS.index(w)
    for p, y in zip(b.test.images.items, b.test.labels):
        assert truth[os.path.basename(p)] == y


def test_fedtsp_class_csv_wins_and_rawdata_place_is_accepted(tmp_path):
    base = make_tree(tmp_path / "rawdata" / "TinyImagenet", val="folders", words=False)
    (base / "tinyimagenet_classes_sorted_lex.csv").write_text("Class ID,Class Label\nn01443537,goldfish\n"
                                                               "n01629819,fire_salamander\nn02124075,Egyptian cat\n")
    b = load(tmp_path)
    assert b.classnames == ["goldfish", "fire salamander", "Egyptian cat"]
    assert b.meta["root"] == str(base)


def test_without_names_the_wnids_are_the_classnames(tmp_path):
    make_tree(tmp_path, words=False)
    assert load(tmp_path).classnames == WNIDS


def test_signature_changes_with_the_files(tmp_path):
    base = make_tree(tmp_path)
    a = load(tmp_path).signature
    write_img(base / "train" / WNIDS[0] / "images" / "extra.JPEG", seed=5)
    assert load(tmp_path).signature != a


def test_errors_name_the_expected_layout(tmp_path):
    with pytest.raises(DataError, match="tiny-imagenet-200/train"):
        load(tmp_path)
    base = make_tree(tmp_path)
    (base / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn00000000\t0\t0\t1\t1\n")
    with pytest.raises(DataError, match="no train/ folder"):
        load(tmp_path)
    (base / "val" / "val_annotations.txt").unlink()
    with pytest.raises(DataError, match="neither class folders nor val_annotations.txt"):
        load(tmp_path)
