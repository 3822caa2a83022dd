"""Folder-based dataset loaders (raysim.data.folders) on tiny fake trees built in tmp_path."""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from raysim.data import DATASETS, LoadSpec, dataset_names, folders
from raysim.errors import DataError

S = 16  # model image size in these tests


def spec(root, **kw) -> LoadSpec:
    return LoadSpec(data_root=str(root), image_size=S, **kw)


def write_img(path, seed: int = 0, size=(8, 8), mode="RGB") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)


def make_domain_tree(base, domains, classes, per_class, ext=".png", mid=("",)):
    """base/<domain>/<mid...>/<class>/img_<k><ext>"""
    for d in domains:
        for c in classes:
            for k in range(per_class):
                write_img(os.path.join(base, d, *mid, c, f"img_{k:02d}{ext}"), seed=k)


def check_image(ds, i=0):
    x = ds[i]
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float32 and tuple(x.shape) == (3, S, S)


def test_registered_and_layouts():
    names = set(dataset_names())
    expected = {"cifar10", "cifar100", "caltech101", "oxford_pets", "flowers102", "food101", "dtd", "pacs",
                "office31", "officehome", "office_caltech10", "domainnet", "tiny_imagenet"}
    assert expected <= names
    assert expected == set(folders.LAYOUTS)


# ---------------------------------------------------------------- domain datasets


def test_pacs_flat_80_20(tmp_path):
    classes = ["dog", "elephant", "giraffe"]
    make_domain_tree(tmp_path / "PACS", ["art_painting", "cartoon", "photo", "sketch"], classes, per_class=7)
    b = DATASETS.get("pacs")(spec(tmp_path))
    assert b.classnames == classes
    assert b.domain_names == ["art_painting", "cartoon", "photo", "sketch"]
    # per domain 21 images in ImageFolder order; index % 10 <= 7 -> train: 0-7, 10-17, 20 -> 17 train, 4 test
    assert len(b.train) == 4 * 17 and len(b.test) == 4 * 4
    assert np.bincount(b.train.domains).tolist() == [17] * 4
    assert np.bincount(b.test.domains).tolist() == [4] * 4
    # domain 0 test indices 8, 9 (elephant img 1, 2; dog has 0..6) and 18, 19 (giraffe img 4, 5)
    te0 = [p for p, d in zip(b.test.images.items, b.test.domains) if d == 0]
    assert [os.path.relpath(p, tmp_path / "PACS") for p in te0] == [
        os.path.join("art_painting", "elephant", "img_01.png"),
        os.path.join("art_painting", "elephant", "img_02.png"),
        os.path.join("art_painting", "giraffe", "img_04.png"),
        os.path.join("art_painting", "giraffe", "img_05.png"),
    ]
    assert b.test.labels[b.test.domains == 0].tolist() == [1, 1, 2, 2]
    assert b.train.labels.dtype == np.int64 and b.train.domains.dtype == np.int64
    check_image(b.train.images)
    check_image(b.test.images, len(b.test) - 1)
    assert "pacs" in b.signature and str(S) in b.signature


def test_office31_extra_images_level(tmp_path):
    make_domain_tree(tmp_path / "office31", ["amazon", "dslr", "webcam"], ["back_pack", "bike"], 5,
                     ext=".jpg", mid=("images",))
    b = DATASETS.get("office31")(spec(tmp_path))
    assert b.classnames == ["back pack", "bike"]
    assert len(b.train) + len(b.test) == 30
    assert len(b.train) == 3 * 8
    check_image(b.train.images)


def test_officehome_space_in_domain_and_grey_image(tmp_path):
    base = tmp_path / "Office-Home"
    make_domain_tree(base, ["Art", "Clipart", "Product", "Real World"], ["Alarm_Clock", "Bike"], 2)
    write_img(str(base / "Art" / "Bike" / "grey.png"), mode="L", size=(10, 6))
    b = DATASETS.get("officehome")(spec(tmp_path))
    assert b.domain_names[-1] == "Real World"
    i = [k for k, p in enumerate(b.train.images.items) if p.endswith("grey.png")][0]
    check_image(b.train.images, i)


def test_office_caltech_explicit_train_test(tmp_path):
    base = tmp_path / "Office-Caltech-10"
    doms = ["amazon", "caltech", "dslr", "webcam"]
    make_domain_tree(base, doms, ["bike", "mug"], 3, mid=("train",))
    make_domain_tree(base, doms, ["bike", "mug"], 1, mid=("test",))
    b = DATASETS.get("office_caltech10")(spec(tmp_path))
    assert b.classnames == ["bike", "mug"]
    assert len(b.train) == 4 * 6 and len(b.test) == 4 * 2
    assert all(os.sep + "test" + os.sep in p for p in b.test.images.items)
    assert b.meta["split"]["amazon"] == "folders"


def test_office_caltech_flat(tmp_path):
    make_domain_tree(tmp_path / "Office-Caltech-10", ["amazon", "caltech", "dslr", "webcam"], ["bike", "mug"], 5)
    b = DATASETS.get("office_caltech10")(spec(tmp_path))
    assert len(b.train) == 4 * 8 and len(b.test) == 4 * 2


def test_domainnet_doubled_level_and_100_classes(tmp_path):
    doms = ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
    classes = [f"c{i:03d}" for i in range(102)]  # 102 class folders, one image each
    base = tmp_path / "DomainNet"
    for d in doms:
        for c in classes:
            mid = (d,) if d in ("clipart", "real") else ()  # doubled <domain>/<domain>/ for some domains
            path = os.path.join(base, d, *mid, c, "a.jpg")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb"):
                pass  # empty files: listing only; images are read lazily
    b = DATASETS.get("domainnet")(spec(tmp_path))
    assert b.num_classes == 100 and b.classnames[:2] == ["c000", "c001"] and b.classnames[-1] == "c099"
    assert len(b.train) + len(b.test) == 6 * 100
    assert len(b.train) == 6 * 80
    # one image per class: labels 8, 9, 18, 19, ... (index % 10 > 7) are test in every domain
    assert b.test.labels[b.test.domains == 0].tolist() == [k for k in range(100) if k % 10 > 7]
    assert b.train.labels.max() == 97 and b.test.labels.max() == 99
    assert sorted(set(b.train.domains.tolist())) == list(range(6))
    # unreadable image -> DataError naming the file, on access
    with pytest.raises(DataError, match="a.jpg"):
        b.train.images[0]


def test_missing_domain_dataset_folder(tmp_path):
    with pytest.raises(DataError) as e:
        DATASETS.get("pacs")(spec(tmp_path))
    assert str(tmp_path / "PACS") in str(e.value)
    assert "art_painting" in str(e.value)  # the layout text


def test_missing_domain(tmp_path):
    make_domain_tree(tmp_path / "PACS", ["art_painting", "cartoon", "photo"], ["dog"], 1)
    with pytest.raises(DataError, match=str(tmp_path / "PACS" / "sketch")):
        DATASETS.get("pacs")(spec(tmp_path))


def test_class_sets_differ(tmp_path):
    make_domain_tree(tmp_path / "office31", ["amazon", "dslr"], ["bike", "mug"], 1)
    make_domain_tree(tmp_path / "office31", ["webcam"], ["bike"], 1)
    with pytest.raises(DataError, match="differ"):
        DATASETS.get("office31")(spec(tmp_path))


def test_signature_changes_with_files_and_size(tmp_path):
    make_domain_tree(tmp_path / "office31", ["amazon", "dslr", "webcam"], ["bike"], 2)
    s1 = DATASETS.get("office31")(spec(tmp_path)).signature
    assert DATASETS.get("office31")(spec(tmp_path)).signature == s1
    s2 = DATASETS.get("office31")(LoadSpec(data_root=str(tmp_path), image_size=S + 1)).signature
    write_img(str(tmp_path / "office31" / "dslr" / "bike" / "z.png"))
    s3 = DATASETS.get("office31")(spec(tmp_path)).signature
    assert len({s1, s2, s3}) == 3


# ---------------------------------------------------------------- CoOp-layout datasets


def write_split(path, train, test, val=()):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"train": list(train), "val": list(val), "test": list(test)}, f)


def test_dtd_split_json(tmp_path):
    base = tmp_path / "dtd"
    classes = ["banded", "blotchy", "bubbly"]
    train, test = [], []
    for y, c in enumerate(classes):
        for k in range(3):
            rel = f"{c}/{c}_{k}.jpg"
            write_img(str(base / "images" / rel), seed=k, size=(12, 8))
            (train if k < 2 else test).append([rel, y, c])
    write_split(base / "split_zhou_DescribableTextures.json", train, test)
    b = DATASETS.get("dtd")(spec(tmp_path))
    assert b.classnames == classes
    assert len(b.train) == 6 and len(b.test) == 3
    assert b.train.labels.tolist() == [0, 0, 1, 1, 2, 2] and b.test.labels.tolist() == [0, 1, 2]
    assert b.train.domains is None and b.domain_names == []
    check_image(b.train.images)
    check_image(b.test.images, 2)


def test_dtd_requires_json(tmp_path):
    write_img(str(tmp_path / "dtd" / "images" / "banded" / "a.jpg"))
    with pytest.raises(DataError) as e:
        DATASETS.get("dtd")(spec(tmp_path))
    assert str(tmp_path / "dtd" / "split_zhou_DescribableTextures.json") in str(e.value)
    assert "CoOp" in str(e.value)


def test_flowers_pets_food_caltech_layouts(tmp_path):
    cases = {
        "flowers102": ("oxford_flowers", "jpg", "split_zhou_OxfordFlowers.json",
                       lambda y, k: f"image_{y:03d}{k}.jpg", ["pink primrose", "hard-leaved pocket orchid"]),
        "oxford_pets": ("oxford_pets", "images", "split_zhou_OxfordPets.json",
                        lambda y, k: f"breed{y}_{k}.jpg", ["abyssinian", "american_bulldog"]),
        "food101": ("food-101", "images", "split_zhou_Food101.json",
                    lambda y, k: f"c{y}/{k}.jpg", ["apple_pie", "baby_back_ribs"]),
        "caltech101": ("caltech-101", "101_ObjectCategories", "split_zhou_Caltech101.json",
                       lambda y, k: f"c{y}/image_{k:04d}.jpg", ["face", "leopard"]),
    }
    for name, (folder, imdir, jname, relf, names) in cases.items():
        train, val, test = [], [], []
        for y, c in enumerate(names):
            for k in range(4):
                rel = relf(y, k)
                write_img(str(tmp_path / folder / imdir / rel), seed=k)
                [train, train, val, test][k].append([rel, y, c])
        # labels listed out of order in the json: class names still come sorted by label
        write_split(tmp_path / folder / jname, train[::-1], test, val)
        b = DATASETS.get(name)(spec(tmp_path))
        assert b.classnames == [n.replace("_", " ") for n in names], name
        assert len(b.train) == 4 and len(b.test) == 2, name
        assert sorted(b.train.labels.tolist()) == [0, 0, 1, 1]
        check_image(b.test.images, 1)


def test_coop_missing_image_folder_and_listed_image(tmp_path):
    with pytest.raises(DataError, match=str(tmp_path / "food-101" / "images")):
        DATASETS.get("food101")(spec(tmp_path))
    write_img(str(tmp_path / "food-101" / "images" / "a" / "1.jpg"))
    write_split(tmp_path / "food-101" / "split_zhou_Food101.json", [["a/1.jpg", 0, "a"]], [["a/2.jpg", 0, "a"]])
    with pytest.raises(DataError, match="2.jpg"):
        DATASETS.get("food101")(spec(tmp_path))


def test_coop_malformed_json(tmp_path):
    write_img(str(tmp_path / "caltech-101" / "101_ObjectCategories" / "a" / "1.jpg"))
    (tmp_path / "caltech-101" / "split_zhou_Caltech101.json").write_text('{"train": []}')
    with pytest.raises(DataError, match="malformed"):
        DATASETS.get("caltech101")(spec(tmp_path))


# ---------------------------------------------------------------- CIFAR


def write_cifar(root, monkeypatch, cls, n_per_file=4, n_classes=10):
    """Fake torchvision-format pickles; the class's md5 table is patched to the fake files' digests."""
    folder = os.path.join(root, cls.base_folder)
    os.makedirs(folder, exist_ok=True)
    label_key = "labels" if cls.base_folder.startswith("cifar-10-") else "fine_labels"
    rng = np.random.default_rng(0)

    def md5(path):
        return hashlib.md5(open(path, "rb").read()).hexdigest()

    def batch(fname, offset):
        data = rng.integers(0, 256, (n_per_file, 3072), dtype=np.uint8)
        labels = [(offset + i) % n_classes for i in range(n_per_file)]
        path = os.path.join(folder, fname)
        with open(path, "wb") as f:
            pickle.dump({"data": data, label_key: labels}, f)
        return [fname, md5(path)]

    train = [batch(f, i) for i, (f, _) in enumerate(cls.train_list)]
    test = [batch(f, 0) for f, _ in cls.test_list]
    meta_path = os.path.join(folder, cls.meta["filename"])
    with open(meta_path, "wb") as f:
        pickle.dump({cls.meta["key"]: [f"class_{i}" for i in range(n_classes)]}, f)
    monkeypatch.setattr(cls, "train_list", train)
    monkeypatch.setattr(cls, "test_list", test)
    monkeypatch.setattr(cls, "meta", dict(cls.meta, md5=md5(meta_path)))
    return folder


def test_cifar10_fake_pickles(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10

    write_cifar(tmp_path, monkeypatch, CIFAR10)
    b = DATASETS.get("cifar10")(spec(tmp_path))
    assert b.classnames == [f"class {i}" for i in range(10)]
    assert len(b.train) == 5 * 4 and len(b.test) == 4
    assert b.train.labels.dtype == np.int64 and b.train.labels.tolist()[:5] == [0, 1, 2, 3, 1]
    check_image(b.train.images)
    check_image(b.test.images, 3)
    assert "tensor-resize" in b.signature


def test_cifar_official_transform_is_the_fedsept_codes(tmp_path, monkeypatch):
    """data.cifar_transform=official: ToTensor, the CIFAR set's own mean/std, then the resize of the normalised image
    (the FedSEPT code's DatasetCifar100), for the train and the test split; its own cache signature."""
    import torch.nn.functional as F
    from torchvision.datasets import CIFAR10

    from raysim.data.folders import CIFAR_STATS

    write_cifar(tmp_path, monkeypatch, CIFAR10)
    b = DATASETS.get("cifar10")(spec(tmp_path, cifar_transform="official"))
    clip = DATASETS.get("cifar10")(spec(tmp_path))
    assert "cifar-official" in b.signature and b.signature != clip.signature
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in CIFAR_STATS["cifar10"])
    for split in (b.train.images, b.test.images):
        raw = torch.from_numpy(np.asarray(split.load(0))).permute(2, 0, 1).float() / 255  # ToTensor
        want = F.interpolate(((raw - mean) / std)[None], size=(S, S), mode="bilinear", align_corners=False, antialias=True)[0]
        # torchvision's Resize on a tensor is this interpolate; float32 rounding of the same ops
        torch.testing.assert_close(split[0], want, rtol=0, atol=1e-5)
        assert not torch.allclose(clip.test.images[0], b.test.images[0], atol=1e-2)  # CLIP's normalisation differs


def test_cifar100_fake_pickles(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR100

    write_cifar(tmp_path, monkeypatch, CIFAR100, n_per_file=6, n_classes=100)
    b = DATASETS.get("cifar100")(spec(tmp_path))
    assert b.num_classes == 100 and len(b.train) == 6 and len(b.test) == 6
    check_image(b.train.images, 5)


def test_cifar_missing_and_corrupt(tmp_path, monkeypatch):
    with pytest.raises(DataError) as e:
        DATASETS.get("cifar10")(spec(tmp_path))
    assert str(tmp_path / "cifar-10-batches-py") in str(e.value) and "download=true" in str(e.value)
    (tmp_path / "cifar-100-python").mkdir()
    with pytest.raises(DataError, match="corrupted"):
        DATASETS.get("cifar100")(spec(tmp_path))
