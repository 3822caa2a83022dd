"""PFLlib / HtFLlib dataset folders: read one as a dataset (`data.dataset=pfllib data.data_root=PATH`), on
its clients exactly as stored, and write a raysim split as one (`raysim export-pfllib`).

The layout (PFLlib dataset/utils/dataset_utils.py `save_file`, read by HtFLlib system/utils/data_utils.py
`read_data`):

    PATH/config.json       {"num_clients": K, "num_classes": C, "non_iid", "balance", "partition", "alpha",
                            "batch_size", "Size of samples for labels in clients": [[[label, count], ...], ...]}
    PATH/train/<i>.npz     i = 0 .. K-1: np.savez_compressed(f, data={"x": X, "y": Y}), a pickled dict
    PATH/test/<i>.npz      the same for client i's test split

HtFLlib reads `np.load(f, allow_pickle=True)["data"].tolist()`, which runs any code a downloaded pickle
holds; raysim reads the archives with `raysim.safeio` (`read_regular`, then `parse_npz`: numpy arrays, dicts, lists
and numbers only; anything else is refused naming the file).

As a raysim dataset the folder's clients are laid end to end: the train set is client 0's train rows,
then client 1's, ..., and the test set likewise, so `stored_splits` gives each client its own rows in
their stored order (data.partition=stored). Images are used as stored, (N, C, H, W) with the folder's own
normalisation: no resizing, no channel expansion, no re-normalisation.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from raysim.config.limits import MAX_CLIENTS
from raysim.config.load import _coerce
from raysim.config.schema import DataConfig
from raysim.data.base import DatasetBundle, ImageSet, LoadSpec, register_dataset
from raysim.data.partition import PARTITIONERS, ClientSplit, PartitionSpec
from raysim.errors import ConfigError, DataError
from raysim.safeio import Budget, parse_npz, read_regular

CONFIG = "config.json"
MAX_CONFIG_BYTES = 64 << 20  # a config.json listing label counts of 100,000 clients stays far below this
# documented maxima (docs/security.md): MAX_FOLDER_CLIENTS is train.num_clients's maximum (raysim.config.limits, their
# one home); a folder claiming more classes is a typo or an attack (heads, class names and per-class statistics are
# sized by it)
MAX_FOLDER_CLIENTS = MAX_CLIENTS
MAX_CLASSES = 100_000
STATISTIC_KEY = "Size of samples for labels in clients"
LAYOUT = ("PATH/config.json (with num_clients and num_classes), PATH/train/<i>.npz and PATH/test/<i>.npz for "
          "i = 0 .. num_clients-1, each np.savez_compressed(f, data={'x': X, 'y': Y}) (PFLlib's save_file)")


@dataclass
class PfllibFolder:
    """A PFLlib folder's contents: its config.json and each client's (x, y) train and test arrays."""

    config: dict[str, Any]
    train: list[tuple[np.ndarray, np.ndarray]]
    test: list[tuple[np.ndarray, np.ndarray]]
    digests: list[str] = field(default_factory=list)  # SHA-256 of config.json and every archive, in order

    @property
    def num_clients(self) -> int:
        return len(self.train)


def read_config(root: str | Path) -> dict[str, Any]:
    """The folder's config.json, checked: a JSON object (no NaN or Infinity anywhere: json.dumps would write it
    back as is, and a resume could never match it) whose num_clients and num_classes are positive integers of at
    most MAX_FOLDER_CLIENTS and MAX_CLASSES."""
    root = Path(root).expanduser()
    path = root / CONFIG
    if not path.is_file():
        raise DataError(f"{root} is not a PFLlib dataset folder: it has no {CONFIG}. Expected layout: {LAYOUT}.")
    raw = read_regular(path, max_bytes=MAX_CONFIG_BYTES)
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, or an integer of thousands of digits
        raise DataError(f"{path} is not valid JSON ({str(e)[:200]})") from None
    except RecursionError:
        raise DataError(f"{path} is nested too deeply to be a PFLlib config.json") from None
    if not isinstance(cfg, dict):
        raise DataError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    bad = _non_finite(cfg)
    if bad is not None:
        raise DataError(f"{path}: {bad} is NaN or infinite, which JSON cannot hold (a run recording it could never be "
                        "resumed); write a number or null there")
    for key, most in (("num_clients", MAX_FOLDER_CLIENTS), ("num_classes", MAX_CLASSES)):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DataError(f"{path}: {key} must be a positive integer, got {_shown(v)}. Expected layout: {LAYOUT}.")
        if v > most:
            raise DataError(f"{path}: {key} is at most {most:,} (raysim's documented maximum, docs/security.md), got {_shown(v)}")
    return cfg


def _non_finite(obj: Any) -> Optional[str]:
    """The key path (`alpha`, `Size of samples...[3][0]`) of the first NaN or infinite number in `obj`, or None."""
    todo: list[tuple[str, Any]] = [("", obj)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return where or "the value"
        if isinstance(v, dict):
            todo.extend((f"{where}.{str(k)[:60]}" if where else str(k)[:60], x) for k, x in v.items())
        elif isinstance(v, list):
            todo.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _client_arrays(path: Path, raw: bytes, num_classes: int, budget: Budget) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of one client archive (its bytes `raw`, unpacked within `budget`), checked: a dict holding a
    real-valued, finite numpy array x of N >= 1 rows and a numpy array y of N integer labels in [0, C)."""
    content = parse_npz(raw, what=str(path), budget=budget)
    data = content.get("data")
    if not isinstance(data, dict) or "x" not in data or "y" not in data:
        raise DataError(f"{path} must hold data={{'x': X, 'y': Y}} (PFLlib's save_file); it holds {sorted(content)[:10]}")
    x, y = data["x"], data["y"]
    for key, v in (("x", x), ("y", y)):  # never np.asarray of a list: one row listed 10^6 times would become 10^6 rows
        if not isinstance(v, np.ndarray):
            raise DataError(f"{path}: {key} must be a numpy array (PFLlib's save_file writes arrays), got a {type(v).__name__}")
    if x.dtype.kind not in "biuf":
        raise DataError(f"{path}: x must be a real-valued numeric array, got dtype {x.dtype}")
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise DataError(f"{path}: y must be a 1-D integer array, got shape {_shown(y.shape)} and dtype {y.dtype}")
    if x.ndim < 2 or x.shape[0] != y.shape[0]:
        raise DataError(f"{path}: x has shape {_shown(x.shape)}, which does not give one row per label of y ({y.shape[0]})")
    if len(y) == 0:
        raise DataError(f"{path} holds no samples: every client needs train and test samples (PFLlib's split gives each "
                        "some); remove the client or give it samples")
    if x.dtype.kind == "f":
        step = max(1, (1 << 24) // max(1, x[0].size))  # a bounded scratch array per block of rows
        for i in range(0, len(x), step):
            if not np.isfinite(x[i:i + step]).all():
                raise DataError(f"{path}: x holds NaN or infinite values (from row {i}); a model cannot train on them")
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or hi >= num_classes:
        raise DataError(f"{path}: labels must lie in [0, {num_classes}) (config.json num_classes), got {lo}..{hi}")
    return x, y.astype(np.int64)


def read_folder(root: str | Path, *, max_bytes: Optional[int] = None) -> PfllibFolder:
    """Read a PFLlib / HtFLlib dataset folder safely (see the module docstring); every client of
    config.json's num_clients must have its train and test archive (and no other archive may be there), of
    one shape of x across clients. Everything the archives unpack to, all together, is charged to one
    `raysim.safeio.Budget` of `max_bytes` (default MAX_DATA_BYTES, RAYSIM_MAX_DATA_BYTES in the environment)."""
    root = Path(root).expanduser()
    cfg = read_config(root)
    K, C = int(cfg["num_clients"]), int(cfg["num_classes"])
    budget = Budget(max_bytes, scope=f"the PFLlib folder {root}")
    for split in ("train", "test"):  # before any archive is unpacked
        names = {f"{i}.npz" for i in range(K)}
        extra = sorted(p.name for p in (root / split).glob("*.npz") if p.name not in names) if (root / split).is_dir() else []
        if extra:
            raise DataError(f"{root}/{split} holds archives beyond config.json's num_clients={K} "
                            f"({', '.join(e[:40] for e in extra[:5])}); fix num_clients or remove them")
    digests = [hashlib.sha256(read_regular(root / CONFIG, max_bytes=MAX_CONFIG_BYTES)).hexdigest()]
    train: list[tuple[np.ndarray, np.ndarray]] = []
    test: list[tuple[np.ndarray, np.ndarray]] = []
    for i in range(K):
        for split, out in (("train", train), ("test", test)):
            path = root / split / f"{i}.npz"
            if not path.is_file():
                raise DataError(f"{path} is missing. Expected layout: {LAYOUT}.")
            raw = read_regular(path, root=root, max_bytes=budget.limit)  # a regular file inside the folder
            out.append(_client_arrays(path, raw, C, budget))
            digests.append(hashlib.sha256(raw).hexdigest())
    shapes = {x.shape[1:] for x, _ in train + test}
    if len(shapes) != 1:
        raise DataError(f"{root}: the clients' x arrays differ in shape per sample ({sorted(shapes)[:4]}); one dataset has one")
    return PfllibFolder(cfg, train, test, digests)


def write_folder(root: str | Path, train: Sequence[tuple[np.ndarray, np.ndarray]], test: Sequence[tuple[np.ndarray, np.ndarray]],
                 *, num_classes: int, extra: Optional[dict[str, Any]] = None) -> Path:
    """Write clients' (x, y) train and test arrays as a PFLlib folder (PFLlib's save_file layout:
    np.savez_compressed(f, data={'x', 'y'}) per client and split, config.json with its keys). `extra` is
    merged into config.json (raysim records how the split was made there). Refuses a non-empty folder."""
    root = Path(root).expanduser()
    if root.exists() and any(root.iterdir()):
        raise DataError(f"{root} exists and is not empty; export into a new folder")
    if len(train) != len(test):
        raise DataError("every client needs a train and a test split")
    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "test").mkdir(parents=True, exist_ok=True)
    statistic = []
    for i, ((xtr, ytr), (xte, yte)) in enumerate(zip(train, test)):
        for split, x, y in (("train", xtr, ytr), ("test", xte, yte)):
            with open(root / split / f"{i}.npz", "wb") as f:
                record = {"x": np.ascontiguousarray(x), "y": np.asarray(y, dtype=np.int64)}
                np.savez_compressed(f, data=record)  # type: ignore[arg-type]  # a dict, pickled: PFLlib's layout
        labels, counts = np.unique(np.concatenate([ytr, yte]), return_counts=True)  # PFLlib counts before its split
        statistic.append([[int(c), int(n)] for c, n in zip(labels, counts)])
    cfg: dict[str, Any] = {
        "num_clients": len(train),
        "num_classes": int(num_classes),
        "non_iid": True,
        "balance": False,
        "partition": "raysim",
        STATISTIC_KEY: statistic,
        "alpha": None,
        "batch_size": None,
    }
    cfg.update(extra or {})
    (root / CONFIG).write_text(json.dumps(cfg))
    return root


class StoredImages(Dataset):
    """Images as stored, one float32 tensor per row (no resize, no channel expansion, no re-normalisation)."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.x[int(i)], dtype=np.float32))


@register_dataset("pfllib")
def load_pfllib(spec: LoadSpec) -> DatasetBundle:
    """A PFLlib / HtFLlib folder at data.data_root: its clients laid end to end (see `stored_splits`)."""
    folder = read_folder(spec.data_root)
    x_tr = np.concatenate([x for x, _ in folder.train]).astype(np.float32, copy=False)
    y_tr = np.concatenate([y for _, y in folder.train])
    x_te = np.concatenate([x for x, _ in folder.test]).astype(np.float32, copy=False)
    y_te = np.concatenate([y for _, y in folder.test])
    C = int(folder.config["num_classes"])
    names = folder.config.get("classnames")
    classnames = [str(n) for n in names] if isinstance(names, list) and len(names) == C else [f"class {c}" for c in range(C)]
    h = hashlib.sha256("".join(folder.digests).encode())
    return DatasetBundle(
        name="pfllib",
        classnames=classnames,
        train=ImageSet(StoredImages(x_tr), y_tr),
        test=ImageSet(StoredImages(x_te), y_te),
        signature=f"pfllib-{str(Path(spec.data_root).expanduser().resolve())}-{h.hexdigest()[:16]}",
        meta={
            "stored_clients": ([len(y) for _, y in folder.train], [len(y) for _, y in folder.test]),
            "folder_config": folder.config,
            "sample_shape": tuple(int(s) for s in x_tr.shape[1:]),
        },
    )


def stored_splits(bundle: DatasetBundle) -> list[ClientSplit]:
    """Each stored client's rows (contiguous, in the stored order) of a dataset that stores its clients."""
    sizes = bundle.meta.get("stored_clients")
    if sizes is None:
        raise DataError(f"dataset {bundle.name} does not store its clients; data.partition=stored needs data.dataset=pfllib")
    tr, te = (np.concatenate([[0], np.cumsum(s)]).astype(np.int64) for s in sizes)
    return [ClientSplit(np.arange(tr[i], tr[i + 1]), np.arange(te[i], te[i + 1])) for i in range(len(sizes[0]))]




@PARTITIONERS.register("stored")
def stored(spec: PartitionSpec) -> list[ClientSplit]:
    """The clients a dataset folder stores (data.dataset=pfllib); prepare_data reads them from the
    dataset itself, so this is reached only with a dataset that stores none."""
    raise ConfigError("data.partition=stored uses the clients a dataset folder stores: it needs data.dataset=pfllib "
                      "(a PFLlib / HtFLlib folder); pick another data.partition for this dataset")



def stored_clients(plain: dict[str, Any]) -> dict[str, Any]:
    """data.dataset=pfllib runs on the clients its folder stores: data.partition=stored and train.num_clients
    are taken from the folder's config.json (a conflicting value the user set is refused), data.shots is 0
    (every stored sample), and the config.json is recorded as data.folder_config. `plain`: the run's mapping
    before its sections are built (raysim.build.build_config)."""
    if not isinstance(plain.get("data") or {}, Mapping) or not isinstance(plain.get("train") or {}, Mapping):
        return plain  # not sections: _build_dataclass says so
    data = dict(plain.get("data") or {})
    if str(data.get("dataset", "")).lower() != "pfllib":
        if data.get("folder_config"):
            raise ConfigError("data.folder_config is recorded from a data.dataset=pfllib folder; do not set it")
        return plain
    root = str(data.get("data_root", DataConfig.data_root))
    folder = read_config(root)
    train = dict(plain.get("train") or {})
    K = int(folder["num_clients"])
    if "num_clients" in train and _coerce(train["num_clients"], int, "train.num_clients") != K:
        raise ConfigError(f"train.num_clients={train['num_clients']} conflicts with the {K} clients of the PFLlib folder "
                          f"{root} (its config.json): data.dataset=pfllib runs on the stored clients; drop train.num_clients "
                          f"or set it to {K}")
    if data.get("partition", "stored") != "stored":
        raise ConfigError(f"data.partition={data['partition']} would re-split the clients of the PFLlib folder {root}; "
                          "data.dataset=pfllib runs on its stored clients (data.partition=stored): drop data.partition")
    if _coerce(data.get("shots", 0) or 0, int, "data.shots") != 0:
        raise ConfigError(f"data.shots={data['shots']} would drop samples of the stored clients of {root}; data.dataset=pfllib "
                          "keeps every stored sample: set data.shots=0 or drop it")
    if data.get("folder_config") not in (None, {}, folder):
        raise ConfigError(f"data.folder_config differs from {root}/config.json: the folder changed since this config was "
                          "written (its clients may differ); start a new run")
    train["num_clients"] = K
    data.update(partition="stored", shots=0, folder_config=folder)
    return {**plain, "data": data, "train": train}

__all__ = ["PfllibFolder", "StoredImages", "load_pfllib", "read_config", "read_folder", "stored", "stored_clients", "stored_splits",
           "write_folder"]
