"""Reading and writing files that may come from elsewhere: checkpoints as plain data only.

`safe_load` is `torch.load(weights_only=True)` plus numpy arrays: a file that needs anything else to
unpickle (a class, a function: an object that could run code) is refused. `atomic_save` writes through a
temporary name with the SHA-256 beside the file, and `load_checked` reads it back against that digest.
Run folders (raysim/storage) and the data caches (raysim/data) use them.

`read_regular` is how every file of a run folder (or a dataset / cache folder) is read: it must be a
regular file (a symbolic link may point only inside the folder; no device, FIFO or socket) no larger than
the size the writer recorded, or than `MAX_FILE_BYTES` (a documented maximum, 8 GiB, settable with the
environment variable RAYSIM_MAX_FILE_BYTES) when nothing was recorded; it is read in bounded chunks, so a
file that grows while it is read cannot exhaust memory either. A checkpoint without its digest is damaged.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import stat
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from numpy._core import multiarray as np_multiarray  # numpy's stubs do not list np._core

from raysim.errors import CheckpointError, DataError, RaysimError

DIGEST_SUFFIX = ".sha256"
MAX_FILE_BYTES = int(os.environ.get("RAYSIM_MAX_FILE_BYTES", str(8 << 30)))  # documented maximum (docs/security.md)
MAX_DIGEST_BYTES = 1024  # "<64 hex digits> <size>\n"
_CHUNK = 1 << 20

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


def serialize(obj: Any) -> bytes:
    """`obj` as `torch.save` writes it (what `atomic_write` puts on disk and `load_checked` reads back)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def atomic_save(obj: Any, path: Path) -> None:
    """Write `obj` to `path` (and its SHA-256 to `path.sha256`) through temporary names and renames."""
    atomic_write(serialize(obj), path)


def atomic_write(data: bytes, path: Path) -> None:
    """Write the serialized `data` (`serialize`) to `path` and its SHA-256 to `path.sha256`, through
    temporary names and renames: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = f".tmp{os.getpid()}"
    digest = path.with_name(path.name + DIGEST_SUFFIX)
    tmp, tmp_digest = path.with_name(f".{path.name}{tag}"), digest.with_name(f".{digest.name}{tag}")
    try:
        tmp.write_bytes(data)
        tmp_digest.write_text(f"{hashlib.sha256(data).hexdigest()} {len(data)}\n")
        os.replace(tmp_digest, digest)
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no half-written temporary file is left behind
        tmp.unlink(missing_ok=True)
        tmp_digest.unlink(missing_ok=True)
        raise


def _inside(path: Path, root: Path) -> bool:
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def read_regular(path: str | Path, *, root: str | Path | None = None, max_bytes: int | None = None,
                 error: type[Exception] = DataError, what: str = "") -> bytes:
    """The bytes of `path`, which must be a regular file (inside `root` when given, also through symbolic
    links) of at most `max_bytes` (default MAX_FILE_BYTES). Anything else raises `error` naming the file,
    before more than `max_bytes` + 1 bytes are ever read."""
    path = Path(path)
    name = what or str(path)
    limit = MAX_FILE_BYTES if max_bytes is None else max_bytes
    if root is not None and not _inside(path, Path(root)):
        raise error(f"{name} is a link to {os.path.realpath(path)}, outside {root}; a run folder's files must lie inside it")
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{name} is not a regular file (a device, FIFO, socket or folder); raysim reads only plain files there")
        if st.st_size > limit:
            raise error(f"{name} is {st.st_size} bytes, more than the {limit} bytes expected of it")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise error(f"{name} cannot be read ({_reason(e)})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between the stat and the open
            raise error(f"{name} is not a regular file; raysim reads only plain files there")
        chunks, total = [], 0
        while chunk := os.read(fd, min(_CHUNK, limit + 1 - total) or 1):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise error(f"{name} grew past the {limit} bytes expected of it while being read")
        return b"".join(chunks)
    except OSError as e:
        raise error(f"{name} cannot be read ({_reason(e)})") from None
    finally:
        os.close(fd)


def read_digest(path: Path, *, root: str | Path | None = None) -> tuple[str, int | None]:
    """The (SHA-256, size) recorded beside a checkpoint (size None in a digest written without one).
    A missing or unreadable digest is a CheckpointError: the checkpoint is then treated as damaged."""
    digest = path.with_name(path.name + DIGEST_SUFFIX)
    if not os.path.lexists(digest):
        raise CheckpointError(
            f"{path} has no {digest.name} beside it, so its content cannot be checked; it is treated as damaged"
        )
    raw = read_regular(digest, root=root, max_bytes=MAX_DIGEST_BYTES, error=CheckpointError)
    parts = raw.decode("ascii", errors="replace").split()
    ok = len(parts) in (1, 2) and len(parts[0]) == 64 and all(c in "0123456789abcdef" for c in parts[0])
    if ok and len(parts) == 2:
        ok = parts[1].isdigit() and len(parts[1]) < 20
    if not ok:
        raise CheckpointError(f"{digest} is damaged: it should hold a SHA-256 in hex and the file's size")
    return parts[0], (int(parts[1]) if len(parts) == 2 else None)


def load_checked(path: Path, *, root: str | Path | None = None) -> Any:
    """Read a checkpoint: a regular file (inside `root`, the run folder, when given) whose size and bytes
    match the SHA-256 and size recorded beside it (a missing digest is damage too), unpickled as plain
    data. Anything else raises a CheckpointError naming the file; nothing larger than the recorded size is read."""
    path = Path(path)
    want, size = read_digest(path, root=root)
    data = read_regular(path, root=root, max_bytes=size, error=CheckpointError)
    if size is not None and len(data) != size:
        raise CheckpointError(f"{path} is truncated or corrupted ({len(data)} bytes where {size} were written)")
    if hashlib.sha256(data).hexdigest() != want:
        raise CheckpointError(
            f"{path} is truncated or corrupted ({len(data)} bytes whose SHA-256 does not match the one recorded when it was written)"
        )
    return safe_load(data, what=str(path))


# ------------------------------------------------------------------ pickled numpy data from elsewhere
# What a pickle of plain numpy data needs besides the pickle opcodes for dicts, lists, tuples, strings and
# numbers: numpy's array and scalar reconstructors (under numpy 1's and numpy 2's module names) and the
# dtype. Nothing else is ever looked up, so no class or function of a hostile file can run.
PLAIN_PICKLE_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
})


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler that admits numpy arrays, numpy scalars, dicts, lists, tuples, strings and numbers only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in PLAIN_PICKLE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent references are not plain data")


def plain_unpickle(data: bytes | io.BufferedIOBase, *, what: str = "the file", error: type[Exception] = DataError) -> Any:
    """Unpickle plain numpy data (arrays, scalars, dicts, lists, numbers, strings); anything else (an object
    whose unpickling would call a class or a function) raises `error` naming `what`, before it runs."""
    fp = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        return _PlainUnpickler(fp).load()
    except pickle.UnpicklingError as e:
        raise error(
            f"{what} holds a pickled object that is not plain data ({e}); unpickling it could run code, so raysim "
            "refuses it. Only numpy arrays, dicts, lists and numbers are accepted."
        ) from None
    except Exception as e:
        raise error(f"{what} is truncated or corrupted ({_reason(e)})") from None


def read_npz_safely(path: str | Path, *, root: str | Path | None = None, max_bytes: int | None = None,
                    error: type[Exception] = DataError) -> dict[str, Any]:
    """The arrays of an .npz archive (np.savez / np.savez_compressed) as {name: value}, read without
    numpy's `allow_pickle`: an object array (a pickled dict, as PFLlib stores its clients) is unpickled
    with `plain_unpickle`, and its single value returned for a 0-d array (what `.tolist()` gives).

    The archive is read with `read_regular` (a regular file of at most `max_bytes`, default
    MAX_FILE_BYTES), and each member may hold at most that many bytes uncompressed, so neither a large
    file nor a zip bomb can exhaust memory. Anything malformed raises `error` naming the file."""
    limit = MAX_FILE_BYTES if max_bytes is None else max_bytes
    return parse_npz(read_regular(path, root=root, max_bytes=limit, error=error), what=str(path), max_bytes=limit, error=error)


def parse_npz(raw: bytes, *, what: str, max_bytes: int | None = None, error: type[Exception] = DataError) -> dict[str, Any]:
    """`read_npz_safely` on the bytes of an archive already read (with `read_regular`); `what` names it."""
    import zipfile

    path = what
    limit = MAX_FILE_BYTES if max_bytes is None else max_bytes
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise error(f"{path} is not an .npz archive ({_reason(e)})") from None
    out: dict[str, Any] = {}
    with archive:
        for info in archive.infolist():
            member = f"{path}[{info.filename}]"
            if not info.filename.endswith(".npy"):
                raise error(f"{member}: an .npz archive holds only .npy members")
            if info.file_size > limit:
                raise error(f"{member} unpacks to {info.file_size} bytes, more than the {limit} bytes allowed")
            try:
                with archive.open(info) as f:
                    buf = io.BytesIO(f.read(limit + 1))
                if len(buf.getbuffer()) > limit:
                    raise error(f"{member} unpacks to more than the {limit} bytes allowed")
                version = np.lib.format.read_magic(buf)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
                else:
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf)
                if dtype.hasobject:
                    value = plain_unpickle(buf, what=member, error=error)
                    if isinstance(value, np.ndarray) and value.dtype.hasobject and value.shape == ():
                        value = value.item()
                else:
                    buf.seek(0)
                    value = np.lib.format.read_array(buf, allow_pickle=False)
            except RaysimError:
                raise
            except Exception as e:  # a cut member, a bad header
                raise error(f"{member} is truncated or corrupted ({_reason(e)})") from None
            out[info.filename[: -len(".npy")]] = value
    return out
