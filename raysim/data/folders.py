"""Datasets read from users' local copies: CIFAR pickles, CoOp-layout image folders, domain folders.

Every loader here reads from `LoadSpec.data_root` and never fetches anything, except CIFAR when
`download=true` (passed through to torchvision). The layouts each loader expects are in `LAYOUTS`
(quoted by the README and by every `DataError` raised here; see SPEC section 4).

The transforms below are deterministic: every image's features are computed once with the test transform and
cached. Training augmentation (data.augment, raysim/data/augment.py: the official code's RandomResizedCrop and
flips) is a separate, seeded function of the image, `ImageItems.augment`, set on every training split here; its
views are encoded once too, and one view per image is drawn per local epoch. Two deterministic transforms are used:

- ``"tensor-resize"`` (CIFAR): ToTensor, Resize(image_size, bicubic), Normalize(spec.mean, spec.std).
- ``"cifar-official"`` (CIFAR with data.cifar_transform=official): the FedSEPT code's (its Dassl `DatasetCifar100`
  wrapper, train and test alike): ToTensor, Normalize with the CIFAR set's own mean/std (`CIFAR_STATS`), then
  Resize((image_size, image_size)) (torchvision's default, bilinear with antialias) of the normalised tensor.
- ``"resize-centercrop"`` (all image folders): resize the shorter side to image_size (bicubic),
  CenterCrop(image_size), ToTensor, Normalize(spec.mean, spec.std), i.e. CLIP's test transform.

Domain datasets split each domain deterministically (SPEC 1.9): the domain's images in ImageFolder order
(sorted classes, then sorted files) are train if ``index % 10 <= 7`` and test otherwise, unless the domain
has explicit ``train/`` and ``test/`` folders. A run may keep a random fraction of each domain's training
split (data.train_fraction, raysim/data/subset.py: the VPDR code keeps 30% of PACS and Office-Caltech).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from raysim.data.base import DatasetBundle, ImageSet, LoadSpec, register_dataset
from raysim.errors import DataError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # = ImageFolder's

COOP_SPLITS_URL = "https://github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md"

# dataset name -> the layout it expects under DATA_ROOT (quoted in errors and in the README)
LAYOUTS: dict[str, str] = {
    "cifar10": "DATA_ROOT/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta} "
    "(torchvision pickles; or pass data.download=true)",
    "cifar100": "DATA_ROOT/cifar-100-python/{train,test,meta} (torchvision pickles; or pass data.download=true)",
    "caltech101": "DATA_ROOT/caltech-101/101_ObjectCategories/<class>/*.jpg and "
    "DATA_ROOT/caltech-101/split_zhou_Caltech101.json",
    "oxford_pets": "DATA_ROOT/oxford_pets/images/*.jpg and DATA_ROOT/oxford_pets/split_zhou_OxfordPets.json",
    "flowers102": "DATA_ROOT/oxford_flowers/jpg/image_*.jpg and DATA_ROOT/oxford_flowers/split_zhou_OxfordFlowers.json",
    "food101": "DATA_ROOT/food-101/images/<class>/*.jpg and DATA_ROOT/food-101/split_zhou_Food101.json",
    "dtd": "DATA_ROOT/dtd/images/<class>/*.jpg and DATA_ROOT/dtd/split_zhou_DescribableTextures.json (required)",
    "pacs": "DATA_ROOT/PACS/{art_painting,cartoon,photo,sketch}/<class>/* "
    "(or <domain>/{train,test}/<class>/*)",
    "office31": "DATA_ROOT/office31/{amazon,dslr,webcam}/<class>/* (an extra <domain>/images/ level is accepted)",
    "officehome": "DATA_ROOT/Office-Home/{Art,Clipart,Product,Real World}/<class>/*",
    "office_caltech10": "DATA_ROOT/Office-Caltech-10/{amazon,caltech,dslr,webcam}/{train,test}/<class>/* "
    "or DATA_ROOT/Office-Caltech-10/<domain>/<class>/*",
    "domainnet": "DATA_ROOT/DomainNet/{clipart,infograph,painting,quickdraw,real,sketch}/<class>/* "
    "(a doubled <domain>/<domain>/ level is accepted; the first 100 classes in sorted order are kept)",
    "tiny_imagenet": "DATA_ROOT/tiny-imagenet-200/train/<wnid>/images/*.JPEG and DATA_ROOT/tiny-imagenet-200/val/ "
    "as released (val/images/*.JPEG with val/val_annotations.txt) or re-organised into val/<wnid>/[images/]*.JPEG; "
    "class names from tinyimagenet_classes_sorted_lex.csv (\"Class Label\" column) or words.txt beside train/ "
    "(DATA_ROOT/rawdata/TinyImagenet/tiny-imagenet-200, FedTSP's place, is accepted too)",
}


def _missing(name: str, what: str, extra: str = "") -> DataError:
    msg = f"{name}: {what}. Expected layout: {LAYOUTS[name]}."
    return DataError(msg + (f" {extra}" if extra else ""))


# --------------------------------------------------------------------------------------------------
# The shared pieces: transforms, one lazy image dataset, the signature
# --------------------------------------------------------------------------------------------------


# the FedSEPT code's CIFAR normalisation (Dassl/dassl/data/data_manager.py DatasetCifar100), per dataset
CIFAR_STATS: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def make_transform(kind: str, spec: LoadSpec, dataset: str = "") -> Callable[[Image.Image], Any]:
    """The deterministic transform named `kind` ("tensor-resize", "cifar-official" of `dataset`, or "resize-centercrop")."""
    from torchvision import transforms as T

    bicubic = T.InterpolationMode.BICUBIC
    norm = T.Normalize(mean=list(spec.mean), std=list(spec.std))
    size = int(spec.image_size)
    if kind == "cifar-official":
        mean, std = CIFAR_STATS[dataset]
        return T.Compose([T.ToTensor(), T.Normalize(mean=list(mean), std=list(std)), T.Resize([size, size])])
    if kind == "tensor-resize":
        return T.Compose([T.ToTensor(), T.Resize((size, size), interpolation=bicubic, antialias=True), norm])
    if kind == "resize-centercrop":
        return T.Compose([T.Resize(size, interpolation=bicubic), T.CenterCrop(size), T.ToTensor(), norm])
    raise ValueError(f"unknown transform {kind!r}")


class ImageItems(Dataset):
    """Images loaded lazily, converted to RGB and transformed on access.

    `items` is either a list of file paths or a uint8 array (N, H, W, 3) of in-memory images (CIFAR)."""

    def __init__(self, items: Sequence[str] | np.ndarray, transform: Callable[[Image.Image], Any],
                 augment: Optional[Callable[[Image.Image, Any], Any]] = None) -> None:
        self.items = items
        self.transform = transform
        self.augment = augment  # (image, torch.Generator) -> tensor: the training augmentation (raysim/data/crop.py)

    def __len__(self) -> int:
        return len(self.items)

    def load(self, i: int) -> Image.Image:
        item = self.items[i]
        if isinstance(item, np.ndarray):
            return Image.fromarray(item).convert("RGB")
        try:
            with Image.open(item) as img:
                return img.convert("RGB")
        except FileNotFoundError as e:
            raise DataError(f"image file {item} is missing (the dataset folder changed after it was listed)") from e
        except OSError as e:
            raise DataError(f"image file {item} cannot be read as an image: {e}") from e

    def __getitem__(self, i: int):
        return self.transform(self.load(int(i)))


def make_signature(name: str, root: str, files: Sequence[str], n: int, spec: LoadSpec, transform: str) -> str:
    """Identifies the exact data: dataset, resolved root, file list (count and digest), size, transform."""
    h = hashlib.sha1()
    for f in files:
        h.update(f.encode("utf-8", "surrogateescape"))
        h.update(b"\0")
    h.update(repr((tuple(float(m) for m in spec.mean), tuple(float(s) for s in spec.std))).encode())
    return (
        f"{name}|root={os.path.realpath(root)}|files={n}|list={h.hexdigest()[:12]}"
        f"|size={int(spec.image_size)}|tf={transform}"
    )


def _augment(spec: LoadSpec):
    """The training augmentation of a training split (used only when data.augment resolves to official)."""
    from raysim.data.crop import make_augment

    return make_augment(spec.image_size, spec.mean, spec.std)


def _root(spec: LoadSpec) -> str:
    return os.path.abspath(os.path.expanduser(str(spec.data_root)))


def _subset(items: list[str] | np.ndarray, labels, domains, transform, augment=None) -> ImageSet:
    return ImageSet(
        images=ImageItems(items, transform, augment),
        labels=np.asarray(labels, dtype=np.int64),
        domains=None if domains is None else np.asarray(domains, dtype=np.int64),
    )


def _pretty(classname: str) -> str:
    return classname.replace("_", " ").strip()


# --------------------------------------------------------------------------------------------------
# CIFAR (torchvision pickles)
# --------------------------------------------------------------------------------------------------


def _load_cifar(name: str, spec: LoadSpec) -> DatasetBundle:
    from torchvision import datasets as tvd

    cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
    root = _root(spec)
    folder = os.path.join(root, cls.base_folder)
    if not spec.download and not os.path.isdir(folder):
        raise _missing(name, f"folder {folder} not found", f"Put it under {root} or pass data.download=true.")
    parts = {}
    try:
        for split in ("train", "test"):
            parts[split] = cls(root=root, train=(split == "train"), download=spec.download)
    except RuntimeError as e:  # torchvision: files missing or md5 mismatch
        raise _missing(
            name,
            f"{folder} is incomplete or corrupted ({e})",
            "Re-extract the official archive there or pass data.download=true.",
        ) from e
    except Exception as e:  # download failures (no network), unreadable pickles
        raise _missing(name, f"could not read or download {folder}: {type(e).__name__}: {e}") from e
    tf_name = "cifar-official" if spec.cifar_transform == "official" else "tensor-resize"
    transform = make_transform(tf_name, spec, name)
    classnames = [_pretty(c) for c in parts["train"].classes]
    files = [f for f, _ in cls.train_list + cls.test_list]
    n = len(parts["train"]) + len(parts["test"])
    return DatasetBundle(
        name=name,
        classnames=classnames,
        train=_subset(parts["train"].data, parts["train"].targets, None, transform, _augment(spec)),
        test=_subset(parts["test"].data, parts["test"].targets, None, transform),
        signature=make_signature(name, folder, files, n, spec, tf_name),
        meta={"root": folder, "transform": tf_name},
    )


@register_dataset("cifar10")
def load_cifar10(spec: LoadSpec) -> DatasetBundle:
    """CIFAR-10 from torchvision pickles (DATA_ROOT/cifar-10-batches-py); deterministic transform."""
    return _load_cifar("cifar10", spec)


@register_dataset("cifar100")
def load_cifar100(spec: LoadSpec) -> DatasetBundle:
    """CIFAR-100 (fine labels) from torchvision pickles (DATA_ROOT/cifar-100-python); deterministic transform."""
    return _load_cifar("cifar100", spec)


# --------------------------------------------------------------------------------------------------
# CoOp-layout datasets (split_zhou_*.json)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CoopLayout:
    folder: str  # under DATA_ROOT
    image_dir: str  # under folder; json paths are relative to it
    split_file: str  # under folder


COOP: dict[str, CoopLayout] = {
    "caltech101": CoopLayout("caltech-101", "101_ObjectCategories", "split_zhou_Caltech101.json"),
    "oxford_pets": CoopLayout("oxford_pets", "images", "split_zhou_OxfordPets.json"),
    "flowers102": CoopLayout("oxford_flowers", "jpg", "split_zhou_OxfordFlowers.json"),
    "food101": CoopLayout("food-101", "images", "split_zhou_Food101.json"),
    "dtd": CoopLayout("dtd", "images", "split_zhou_DescribableTextures.json"),
}


def _load_coop(name: str, spec: LoadSpec) -> DatasetBundle:
    lay = COOP[name]
    base = os.path.join(_root(spec), lay.folder)
    image_dir = os.path.join(base, lay.image_dir)
    split_path = os.path.join(base, lay.split_file)
    if not os.path.isdir(image_dir):
        raise _missing(name, f"image folder {image_dir} not found")
    if not os.path.isfile(split_path):
        raise _missing(
            name,
            f"split file {split_path} not found",
            f"Download CoOp's {lay.split_file} (links in {COOP_SPLITS_URL}) and put it in {base}.",
        )
    try:
        with open(split_path, encoding="utf-8") as fh:
            split = json.load(fh)
        entries = {k: [(str(p), int(y), str(c)) for p, y, c in split[k]] for k in ("train", "test")}
        extra = [(str(p), int(y), str(c)) for p, y, c in split.get("val", [])]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _missing(
            name,
            f"split file {split_path} is malformed ({type(e).__name__}: {e}); expected "
            '{"train"|"val"|"test": [[relative_path, int_label, classname], ...]}',
        ) from e

    names: dict[int, str] = {}
    for _, y, c in entries["train"] + extra + entries["test"]:
        if names.setdefault(y, c) != c:
            raise _missing(name, f"split file {split_path} gives label {y} two class names ({names[y]!r}, {c!r})")
    if not names or sorted(names) != list(range(len(names))):
        raise _missing(name, f"split file {split_path} has labels {sorted(names)[:5]}..., not 0..C-1")
    classnames = [_pretty(names[y]) for y in range(len(names))]

    for k in ("train", "test"):
        if not entries[k]:
            raise _missing(name, f"split file {split_path} has an empty {k!r} split")
        for p, _, _ in (entries[k][0], entries[k][-1]):  # spot-check the json matches the image folder
            if not os.path.isfile(os.path.join(image_dir, p)):
                raise _missing(name, f"image {os.path.join(image_dir, p)} listed in {lay.split_file} not found")

    tf_name = "resize-centercrop"
    transform = make_transform(tf_name, spec)

    def part(k: str) -> ImageSet:
        paths = [os.path.join(image_dir, p) for p, _, _ in entries[k]]
        return _subset(paths, [y for _, y, _ in entries[k]], None, transform, _augment(spec) if k == "train" else None)

    files = [f"{k}:{p}:{y}" for k in ("train", "test") for p, y, _ in entries[k]]
    return DatasetBundle(
        name=name,
        classnames=classnames,
        train=part("train"),
        test=part("test"),
        signature=make_signature(name, image_dir, files, len(files), spec, tf_name),
        meta={"root": image_dir, "split_file": split_path, "transform": tf_name},
    )


def _register(name: str, load, how: str) -> None:
    def loader(spec: LoadSpec) -> DatasetBundle:
        return load(name, spec)

    loader.__name__ = f"load_{name}"
    loader.__doc__ = f"{name} {how} ({LAYOUTS[name]}); deterministic resize+center-crop transform."
    register_dataset(name)(loader)


for _name in COOP:
    _register(_name, _load_coop, "with CoOp's split")


# --------------------------------------------------------------------------------------------------
# Domain datasets (DATA_ROOT/<Dataset>/<domain>/<class>/image)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DomainLayout:
    folder: str  # under DATA_ROOT
    domains: tuple[str, ...]  # domain ids follow this order
    max_classes: Optional[int] = None  # keep the first N classes in sorted order


DOMAIN: dict[str, DomainLayout] = {
    "pacs": DomainLayout("PACS", ("art_painting", "cartoon", "photo", "sketch")),
    "office31": DomainLayout("office31", ("amazon", "dslr", "webcam")),
    "officehome": DomainLayout("Office-Home", ("Art", "Clipart", "Product", "Real World")),
    "office_caltech10": DomainLayout("Office-Caltech-10", ("amazon", "caltech", "dslr", "webcam")),
    "domainnet": DomainLayout(
        "DomainNet", ("clipart", "infograph", "painting", "quickdraw", "real", "sketch"), max_classes=100
    ),
}


def in_train_split(idx: int) -> bool:
    """Whether the idx-th image of a domain folder without train/ and test/ is a training image (SPEC 1.9)."""
    return idx % 10 <= 7


def split_sizes(n: int) -> tuple[int, int]:
    """(training, test) images of a domain folder of n images without train/ and test/ (`in_train_split`)."""
    train = 8 * (n // 10) + min(n % 10, 8)
    return train, n - train


def _subdirs(path: str) -> list[str]:
    with os.scandir(path) as it:
        return sorted(e.name for e in it if e.is_dir(follow_symlinks=True) and not e.name.startswith("."))


def _find_dir(parent: str, name: str) -> Optional[str]:
    """parent/name, or a case-insensitive match of it (e.g. Office31 for office31)."""
    exact = os.path.join(parent, name)
    if os.path.isdir(exact):
        return exact
    if os.path.isdir(parent):
        hits = [d for d in _subdirs(parent) if d.lower() == name.lower()]
        if len(hits) == 1:
            return os.path.join(parent, hits[0])
    return None


def _class_root(domain_dir: str, domain: str) -> str:
    """Skip a single wrapping level: Office31's <domain>/images/ or DomainNet's doubled <domain>/<domain>/."""
    subs = _subdirs(domain_dir)
    if len(subs) == 1 and subs[0].lower() in ("images", domain.lower()):
        return os.path.join(domain_dir, subs[0])
    return domain_dir


def _image_files(class_dir: str) -> list[str]:
    """Files under class_dir in torchvision ImageFolder order (sorted walk, sorted names)."""
    out = []
    for dirpath, _, fnames in sorted(os.walk(class_dir, followlinks=True)):
        for f in sorted(fnames):
            if f.lower().endswith(IMG_EXTENSIONS):
                out.append(os.path.join(dirpath, f))
    return out


def _load_domains(name: str, spec: LoadSpec) -> DatasetBundle:
    lay = DOMAIN[name]
    root = _root(spec)
    base = _find_dir(root, lay.folder)
    if base is None:
        raise _missing(name, f"folder {os.path.join(root, lay.folder)} not found")

    # per domain: {"all"} or {"train", "test"} -> class root folder
    layout: dict[str, dict[str, str]] = {}
    for dom in lay.domains:
        ddir = _find_dir(base, dom)
        if ddir is None:
            raise _missing(name, f"domain folder {os.path.join(base, dom)} not found")
        ddir = _class_root(ddir, dom)
        subs = _subdirs(ddir)
        if "train" in subs and "test" in subs:
            layout[dom] = {s: _class_root(os.path.join(ddir, s), dom) for s in ("train", "test")}
        else:
            layout[dom] = {"all": ddir}

    # the shared class list
    class_sets = {(dom, part): _subdirs(d) for dom, parts in layout.items() for part, d in parts.items()}
    first_key, first = next(iter(class_sets.items()))
    if not first:
        raise _missing(name, f"no class folders in {layout[first_key[0]][first_key[1]]}")
    for key, cs in class_sets.items():
        if set(cs) != set(first):
            where = layout[key[0]][key[1]]
            only_here = sorted(set(cs) - set(first))[:5]
            missing = sorted(set(first) - set(cs))[:5]
            raise _missing(
                name,
                f"class folders differ between domains: {where} has extra {only_here} and lacks {missing} "
                f"compared with {layout[first_key[0]][first_key[1]]}",
            )
    classes = sorted(first)
    if lay.max_classes is not None:
        classes = classes[: lay.max_classes]

    tr: dict[str, list] = {"items": [], "labels": [], "domains": []}
    te: dict[str, list] = {"items": [], "labels": [], "domains": []}
    files: list[str] = []

    def add(dst: dict[str, list], path: str, y: int, d: int) -> None:
        dst["items"].append(path)
        dst["labels"].append(y)
        dst["domains"].append(d)
        files.append(os.path.relpath(path, base))

    for d, dom in enumerate(lay.domains):
        parts = layout[dom]
        for part, croot in parts.items():
            n_before = len(files)
            idx = 0
            for y, c in enumerate(classes):
                for path in _image_files(os.path.join(croot, c)):
                    if part == "all":
                        add(tr if in_train_split(idx) else te, path, y, d)
                    else:
                        add(tr if part == "train" else te, path, y, d)
                    idx += 1
            if len(files) == n_before:
                raise _missing(name, f"no image files ({', '.join(IMG_EXTENSIONS)}) under {croot}/<class>/")

    tf_name = "resize-centercrop"
    transform = make_transform(tf_name, spec)
    return DatasetBundle(
        name=name,
        classnames=[_pretty(c) for c in classes],
        train=_subset(tr["items"], tr["labels"], tr["domains"], transform, _augment(spec)),
        test=_subset(te["items"], te["labels"], te["domains"], transform),
        domain_names=list(lay.domains),
        signature=make_signature(name, base, files, len(files), spec, tf_name),
        meta={
            "root": base,
            "transform": tf_name,
            "split": {dom: ("folders" if "train" in p else "index%10<=7") for dom, p in layout.items()},
            "class_folders": classes,
        },
    )


for _name in DOMAIN:
    _register(_name, _load_domains, "by domain")


# --------------------------------------------------------------------------------------------------
# Tiny-ImageNet (DATA_ROOT/tiny-imagenet-200, SPEC section 4)
# --------------------------------------------------------------------------------------------------

TINY_FOLDERS = ("tiny-imagenet-200", os.path.join("rawdata", "TinyImagenet", "tiny-imagenet-200"))
TINY_CLASS_CSV = "tinyimagenet_classes_sorted_lex.csv"  # FedTSP's class-name file ("Class Label" column, wnid order)


def _tiny_classnames(base: str, wnids: list[str]) -> tuple[list[str], str]:
    """Human-readable names in wnid order: FedTSP's CSV (its "Class Label" column, rows in sorted wnid
    order), else the first name of each wnid in words.txt, else the wnid itself; and where they came from."""
    import csv

    for folder in (base, os.path.dirname(base)):
        path = os.path.join(folder, TINY_CLASS_CSV)
        if os.path.isfile(path):
            with open(path, newline="", encoding="utf-8") as fh:
                rows = list(csv.DictReader(fh))
            if not rows or "Class Label" not in rows[0]:
                raise _missing("tiny_imagenet", f"{path} has no \"Class Label\" column")
            if len(rows) != len(wnids):
                raise _missing("tiny_imagenet", f"{path} names {len(rows)} classes, train/ has {len(wnids)}")
            return [_pretty(r["Class Label"]) for r in rows], path
    words = os.path.join(base, "words.txt")
    if os.path.isfile(words):
        names: dict[str, str] = {}
        with open(words, encoding="utf-8") as fh:
            for line in fh:
                wnid, _, text = line.rstrip("\n").partition("\t")
                names[wnid.strip()] = text.split(",")[0].strip()
        return [_pretty(names.get(w) or w) for w in wnids], words
    return list(wnids), "wnids"


def _tiny_val(base: str, wnids: list[str]) -> tuple[list[str], list[int], str]:
    """The labelled val split: class folders val/<wnid>/[images/]* (ImageFolder, as FedTSP re-organises
    it), or the release's val/images/* with val/val_annotations.txt (file, wnid, box)."""
    val = os.path.join(base, "val")
    index = {w: i for i, w in enumerate(wnids)}
    if not os.path.isdir(val):
        raise _missing("tiny_imagenet", f"folder {val} not found")
    subs = [d for d in _subdirs(val) if d != "images"]
    if subs:
        if set(subs) != set(wnids):
            extra, lacking = sorted(set(subs) - set(wnids))[:5], sorted(set(wnids) - set(subs))[:5]
            raise _missing("tiny_imagenet", f"class folders of {val} differ from train/: extra {extra}, lacking {lacking}")
        paths, labels = [], []
        for w in wnids:
            for f in _image_files(os.path.join(val, w)):
                paths.append(f)
                labels.append(index[w])
        return paths, labels, "folders"
    ann = os.path.join(val, "val_annotations.txt")
    if not os.path.isfile(ann):
        raise _missing("tiny_imagenet", f"{val} has neither class folders nor val_annotations.txt")
    paths, labels = [], []
    with open(ann, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            parts = line.split("\t")
            if len(parts) < 2 or not line.strip():
                continue
            fname, wnid = parts[0].strip(), parts[1].strip()
            if wnid not in index:
                raise _missing("tiny_imagenet", f"{ann} line {n} names class {wnid!r}, which has no train/ folder")
            path = os.path.join(val, "images", fname)
            if not os.path.isfile(path):
                raise _missing("tiny_imagenet", f"image {path} listed in {ann} not found")
            paths.append(path)
            labels.append(index[wnid])
    order = sorted(range(len(paths)), key=lambda i: (labels[i], paths[i]))  # ImageFolder order, like the folders layout
    return [paths[i] for i in order], [labels[i] for i in order], "val_annotations"


@register_dataset("tiny_imagenet")
def load_tiny_imagenet(spec: LoadSpec) -> DatasetBundle:
    """Tiny-ImageNet (200 classes, 64x64): train/ (100k images) as the train set, the labelled val/ (10k)
    as the test set; classes in sorted wnid order (ImageFolder's); deterministic resize+center-crop
    transform. FedTSP merges both and re-splits them per client (partition=pfllib)."""
    root = _root(spec)
    base = next((os.path.join(root, f) for f in TINY_FOLDERS if os.path.isdir(os.path.join(root, f, "train"))), None)
    if base is None:
        raise _missing("tiny_imagenet", f"folder {os.path.join(root, TINY_FOLDERS[0], 'train')} not found")
    train_dir = os.path.join(base, "train")
    wnids = _subdirs(train_dir)
    if not wnids:
        raise _missing("tiny_imagenet", f"no class folders in {train_dir}")
    tr_paths, tr_labels = [], []
    for y, w in enumerate(wnids):
        files = _image_files(os.path.join(train_dir, w))
        if not files:
            raise _missing("tiny_imagenet", f"no image files ({', '.join(IMG_EXTENSIONS)}) under {os.path.join(train_dir, w)}")
        tr_paths += files
        tr_labels += [y] * len(files)
    te_paths, te_labels, val_layout = _tiny_val(base, wnids)
    if not te_paths:
        raise _missing("tiny_imagenet", f"no labelled images in {os.path.join(base, 'val')}")
    classnames, names_from = _tiny_classnames(base, wnids)
    tf_name = "resize-centercrop"
    transform = make_transform(tf_name, spec)
    files = [os.path.relpath(p, base) for p in tr_paths] + [f"{os.path.relpath(p, base)}:{y}" for p, y in zip(te_paths, te_labels)]
    return DatasetBundle(
        name="tiny_imagenet",
        classnames=classnames,
        train=_subset(tr_paths, tr_labels, None, transform, _augment(spec)),
        test=_subset(te_paths, te_labels, None, transform),
        signature=make_signature("tiny_imagenet", base, files, len(files), spec, tf_name),
        meta={"root": base, "transform": tf_name, "val_layout": val_layout, "classnames_from": names_from, "wnids": wnids},
    )


__all__ = ["LAYOUTS", "COOP", "DOMAIN", "ImageItems", "in_train_split", "make_transform", "make_signature", "split_sizes"]
