"""Reading and writing files that may come from elsewhere: checkpoints as plain data only.

`safe_load` is `torch.load(weights_only=True)` plus numpy arrays: a file that needs anything else to
unpickle (a class, a function: an object that could run code) is refused. `atomic_save` writes through a
temporary name with the SHA-256 beside the file, and `load_checked` reads it back against that digest.
Run folders (raysim/storage) and the data caches (raysim/data) use them.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from numpy._core import multiarray as np_multiarray  # numpy's stubs do not list np._core

from raysim.errors import CheckpointError

DIGEST_SUFFIX = ".sha256"

# numpy arrays and scalars are plain data too (generated-data caches hold them); nothing else is let through
SAFE_NUMPY: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [  # what torch.serialization.safe_globals takes
    np.ndarray,
    np.dtype,
    np_multiarray._reconstruct,
    np_multiarray.scalar,
    *{type(np.dtype(t)) for t in ("b", "u1", "i1", "i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16", "?", "U", "S", "O")},
]


def safe_load(source: str | Path | bytes, *, what: str = "") -> Any:
    """torch.load with weights_only=True (plus numpy arrays): a file that needs anything else to unpickle
    (a class, a function: an object that could run code) is refused with a CheckpointError naming it."""
    name = what or str(source)
    buf = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    try:
        with torch.serialization.safe_globals(SAFE_NUMPY):
            return torch.load(buf, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Unsupported global" in str(e) or "Unsupported operand" in str(e):
            first = next((ln.strip() for ln in str(e).splitlines() if "Unsupported" in ln), str(e).splitlines()[0])
            raise CheckpointError(
                f"{name} holds a pickled object that is not plain data ({first}); it could run code when loaded, "
                "so raysim refuses it. Checkpoints hold only tensors, numbers, strings, lists and dicts."
            ) from None
        raise CheckpointError(f"{name} is truncated or corrupted ({_reason(e)})") from None
    except Exception as e:  # a cut or garbled zip archive
        raise CheckpointError(f"{name} is truncated or corrupted ({_reason(e)})") from None


def _reason(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def atomic_save(obj: Any, path: Path) -> None:
    """Write `obj` to `path` (and its SHA-256 to `path.sha256`) through temporary names and renames."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    tag = f".tmp{os.getpid()}"
    digest = path.with_name(path.name + DIGEST_SUFFIX)
    tmp, tmp_digest = path.with_name(f".{path.name}{tag}"), digest.with_name(f".{digest.name}{tag}")
    tmp.write_bytes(data)
    tmp_digest.write_text(hashlib.sha256(data).hexdigest() + "\n")
    os.replace(tmp_digest, digest)
    os.replace(tmp, path)


def load_checked(path: Path) -> Any:
    """Read a checkpoint: its bytes must match the recorded SHA-256 (when there is one: older run folders
    have none) and unpickle as plain data. Anything else raises a CheckpointError naming the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({_reason(e)})") from None
    digest = path.with_name(path.name + DIGEST_SUFFIX)
    if digest.is_file():
        want = digest.read_text().strip()
        got = hashlib.sha256(data).hexdigest()
        if want != got:
            raise CheckpointError(
                f"{path} is truncated or corrupted ({len(data)} bytes whose SHA-256 does not match the one recorded when it was written)"
            )
    return safe_load(data, what=str(path))
