"""Reading and writing files that may come from elsewhere: checkpoints as plain data only.

`safe_load` is `torch.load(weights_only=True)` plus numpy arrays: a file that needs anything else to
unpickle (a class, a function: an object that could run code) is refused. `atomic_save` writes through a
temporary name with the SHA-256 beside the file, and `load_checked` reads it back against that digest.
Run folders (raysim/storage) and the data caches (raysim/data) use them.

`read_regular` is how every file of a run folder (or a dataset / cache folder) is read: it must be a
regular file (a symbolic link may point only inside the folder; no device, FIFO or socket) no larger than
the size the writer recorded, or than `MAX_FILE_BYTES` (a documented maximum, 8 GiB, settable with the
environment variable RAYSIM_MAX_FILE_BYTES) when nothing was recorded; it is read in bounded chunks, so a
file that grows while it is read cannot exhaust memory either. A checkpoint without its digest is damaged;
the size its digest records may be at most `MAX_CHECKPOINT_BYTES` (4 GiB, RAYSIM_MAX_CHECKPOINT_BYTES) and
must be the file's, and its SHA-256 is computed as it streams in.

`parse_npz` / `read_npz_safely` read .npz archives from elsewhere (PFLlib folders): members decompressed a
chunk at a time against one `Budget` (`MAX_DATA_BYTES`, 2 GiB, RAYSIM_MAX_DATA_BYTES) for everything a
folder unpacks to, and pickles read by `plain_unpickle`, which checks every opcode and what numpy's
reconstructors are called with (simple dtypes only; an array's size charged before it is built).
"""

from __future__ import annotations

import codecs
import hashlib
import io
import os
import pickle
import re
import stat
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from numpy._core import multiarray as np_multiarray  # numpy's stubs do not list np._core

from raysim.errors import CheckpointError, DataError, RaysimError

DIGEST_SUFFIX = ".sha256"
MAX_FILE_BYTES = int(os.environ.get("RAYSIM_MAX_FILE_BYTES", str(8 << 30)))  # documented maximum (docs/security.md)
# a checkpoint (a model's and its optimizer's state) larger than this is damage or an attack: it would be read into memory
MAX_CHECKPOINT_BYTES = int(os.environ.get("RAYSIM_MAX_CHECKPOINT_BYTES", str(4 << 30)))  # documented maximum (docs/security.md)
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


def safe_load(source: str | Path | bytes | io.BytesIO, *, what: str = "") -> Any:
    """torch.load with weights_only=True (plus numpy arrays): a file that needs anything else to unpickle
    (a class, a function: an object that could run code) is refused with a CheckpointError naming it, and so
    is one that hands numpy's reconstructors anything but plain data (`_scan_checkpoint`, run first)."""
    name = what or (str(source) if isinstance(source, (str, Path)) else "the checkpoint")
    if isinstance(source, (str, Path)):
        source = read_regular(source, max_bytes=MAX_CHECKPOINT_BYTES, error=CheckpointError)
    buf = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    _scan_checkpoint(buf, name)  # what torch would hand numpy, checked first
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
    chunks: list[bytes] = []
    stream_regular(path, chunks.append, root=root, max_bytes=max_bytes, error=error, what=what)
    return b"".join(chunks)


def stream_regular(path: str | Path, sink: Callable[[bytes], Any], *, root: str | Path | None = None,
                   max_bytes: int | None = None, size: int | None = None, error: type[Exception] = DataError,
                   what: str = "") -> int:
    """`read_regular`, handing the file to `sink` a chunk (1 MiB) at a time instead of keeping it; returns
    how many bytes it read. With `size` the file must have exactly that many bytes, checked before it is read."""
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
        if size is not None and st.st_size != size:
            raise error(f"{name} is truncated or corrupted ({st.st_size} bytes where {size} were written)")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise error(f"{name} cannot be read ({_reason(e)})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between the stat and the open
            raise error(f"{name} is not a regular file; raysim reads only plain files there")
        total = 0
        while chunk := os.read(fd, min(_CHUNK, limit + 1 - total) or 1):
            total += len(chunk)
            if total > limit:
                raise error(f"{name} grew past the {limit} bytes expected of it while being read")
            sink(chunk)
        if size is not None and total != size:
            raise error(f"{name} is truncated or corrupted ({total} bytes where {size} were written)")
        return total
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
    data. Anything else raises a CheckpointError naming the file. The recorded size may be at most
    MAX_CHECKPOINT_BYTES and must be the file's size, both checked before a byte is read; the SHA-256 is
    computed as the file streams in, so nothing larger than the recorded size is ever held."""
    path = Path(path)
    want, size = read_digest(path, root=root)
    if size is not None and size > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(
            f"{path.name}{DIGEST_SUFFIX} records a size of {size:,} bytes for {path}, more than the {MAX_CHECKPOINT_BYTES:,} "
            "a checkpoint may have (raysim's documented maximum, docs/security.md; RAYSIM_MAX_CHECKPOINT_BYTES raises it); "
            "the checkpoint is treated as damaged"
        )
    h, buf = hashlib.sha256(), io.BytesIO()

    def take(chunk: bytes) -> None:
        h.update(chunk)
        buf.write(chunk)

    n = stream_regular(path, take, root=root, max_bytes=MAX_CHECKPOINT_BYTES if size is None else size, size=size,
                       error=CheckpointError)
    if h.hexdigest() != want:
        raise CheckpointError(
            f"{path} is truncated or corrupted ({n} bytes whose SHA-256 does not match the one recorded when it was written)"
        )
    buf.seek(0)
    return safe_load(buf, what=str(path))


# ------------------------------------------------------------------ pickled numpy data from elsewhere
# What a pickle of plain numpy data needs besides the pickle opcodes for dicts, lists, tuples, strings and
# numbers: numpy's array and scalar reconstructors (under numpy 1's and numpy 2's module names) and the
# dtype. Nothing else is ever looked up, so no class or function of a hostile file can run. What those three
# are called with is checked before they run (`_PlainUnpickler`): a dtype is one of the simple builtin types
# below (never fields, offsets, subarrays or an odd item size: numpy trusts such a pickled dtype and reads
# outside its memory), and an array's size is charged to a `Budget` before it is built.
PLAIN_PICKLE_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # how protocol 2 (torch.save's) writes bytes: encode(text, "latin1")
})
# the dtypes a pickle may name (as numpy pickles them: np.dtype(name, False, True)): bool, integers, floats,
# complex (admitted so a complex image is refused by the reader that gets it, with its name) and object (the
# array numpy wraps a pickled dict in)
SIMPLE_DTYPES: frozenset[str] = frozenset({"b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16", "O8"})
MAX_DATA_BYTES = int(os.environ.get("RAYSIM_MAX_DATA_BYTES", str(2 << 30)))  # documented maximum (docs/security.md)
MAX_PICKLE_OPS = 10_000_000  # a PFLlib client archive's pickle takes a few dozen opcodes; each costs ~1 us here
_OP_BYTES = 8  # what one opcode may allocate beyond the bytes it reads (a stack or container slot), charged per opcode
_MAX_NDIM = 32  # numpy's own limit is 64
MAX_NPZ_DIRECTORY_BYTES = 1 << 20  # an .npz's list of members (~100 bytes each): zipfile holds ~0.5 KB per member


class Budget:
    """The bytes a reader may still allocate, one budget for everything it unpacks (all members of all the
    archives of a folder): decompressed bytes as they arrive, and each array a pickle builds before it is
    built. Exceeding it raises `error` naming the file being read, the budget, and how to raise it."""

    def __init__(self, limit: int | None = None, *, scope: str = "one folder", error: type[Exception] = DataError) -> None:
        self.limit = MAX_DATA_BYTES if limit is None else int(limit)
        self.used = 0
        self.scope = scope
        self.error = error

    @property
    def left(self) -> int:
        return max(self.limit - self.used, 0)

    def charge(self, n: int, what: str) -> None:
        self.used += int(n)
        if self.used > self.limit:
            raise self.error(
                f"{what} unpacks past the {self.limit:,} bytes raysim allows for {self.scope} (the documented maximum, "
                "docs/security.md; RAYSIM_MAX_DATA_BYTES in the environment raises it for a real dataset that large)"
            )


class _Refused(pickle.UnpicklingError):
    """Something a plain-data pickle never holds (the message says what)."""


def _refuse(opname: str) -> Callable[[Any], None]:
    def refused(self: Any) -> None:
        raise _Refused(f"pickle opcode {opname} is not plain data")
    return refused


# the opcodes of dicts, lists, tuples, sets, strings, bytes, numbers and the memo; GLOBAL / STACK_GLOBAL go
# through find_class, REDUCE and BUILD through the checks below; INST, OBJ, NEWOBJ_EX, EXT*, PERSID and
# out-of-band buffers are refused, and NEWOBJ and BINPERSID everywhere but in a checkpoint scan
_PLAIN_OPS = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1",
    "LONG4", "NONE", "NEWTRUE", "NEWFALSE", "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES",
    "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "EMPTY_LIST",
    "APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_DICT", "DICT", "SETITEM",
    "SETITEMS", "EMPTY_SET", "ADDITEMS", "FROZENSET", "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT",
    "MEMOIZE", "GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD",
    "NEWOBJ", "BINPERSID",  # only in a checkpoint scan, on torch's own objects (refused otherwise)
})


_STRING_DTYPE = re.compile(r"[US][0-9]{1,6}")  # fixed-width strings (a cache's names), as numpy pickles them: U4, S16


def _simple(dt: Any) -> bool:
    """A dtype of SIMPLE_DTYPES or a fixed-width string (either byte order; no fields, subarray or metadata)."""
    return (isinstance(dt, np.dtype) and dt.fields is None and dt.subdtype is None and dt.metadata is None
            and (f"{dt.kind}{dt.itemsize}" in SIMPLE_DTYPES or dt.kind in "US"))


class _PlainUnpickler(pickle._Unpickler):
    """A pure-Python unpickler (so each opcode can be checked) that admits numpy arrays, numpy scalars, dicts,
    lists, tuples, sets, strings and numbers only, and charges what it builds to `budget`."""

    def __init__(self, file: Any, *, budget: Budget, what: str) -> None:
        super().__init__(file)
        self.budget, self.what = budget, what
        self._fresh: dict[int, Any] = {}  # id -> dtype or array made by REDUCE and not yet given its state (BUILD)
        self._used: set[int] = set()  # dtypes an array or scalar took: their state can no longer change

    _dispatch: dict[int, Callable[[Any], None]] = {}  # _plain_dispatch(), set below the class

    scan = False  # _CheckpointScan: other names pass as _Opaque, and arrays are checked but not built

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in PLAIN_PICKLE_GLOBALS:
            return super().find_class(module, name)
        if self.scan and module.split(".")[0] != "numpy":
            return _Opaque()
        raise _Refused(f"{module[:80]}.{name[:80]} is not plain data")

    def persistent_load(self, pid: Any) -> Any:
        if self.scan:
            return _Opaque()
        raise _Refused("persistent references are not plain data")

    def load(self) -> Any:
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)  # type: ignore[attr-defined]
        self.read = self._unframer.read
        self.readinto = self._unframer.readinto
        self.readline = self._unframer.readline
        self.metastack: list[Any] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch, ops = self.read, self._dispatch, 0
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError("the pickle ends before its STOP opcode")
                ops += 1
                if ops % 4096 == 0:
                    self.budget.charge(4096 * _OP_BYTES, self.what)
                    if ops > MAX_PICKLE_OPS:
                        raise _Refused(f"more than {MAX_PICKLE_OPS:,} pickle opcodes, far more than plain data takes")
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    # ---- the checked opcodes
    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if self.scan and isinstance(func, _Opaque):
            self.stack[-1] = _Opaque()
            return
        if not isinstance(args, tuple):
            raise _Refused("REDUCE without an argument tuple")
        if func is np.dtype:
            if len(args) != 3 or type(args[0]) is not str or not (args[0] in SIMPLE_DTYPES or _STRING_DTYPE.fullmatch(args[0])) \
                    or args[1:] not in ((False, True), (0, 1)) or {type(a) for a in args[1:]} - {bool, int}:  # numpy 1 writes 0, 1
                raise _Refused(f"numpy.dtype{_brief(args)} is not a simple numeric dtype "
                               f"(only {', '.join(sorted(SIMPLE_DTYPES))}, U<n> and S<n>)")
            out: Any = np.dtype(args[0], False, True)  # always a fresh copy: a later BUILD changes only this one
            self._fresh[id(out)] = out
        elif func is np_multiarray._reconstruct:
            if len(args) != 3 or args[0] is not np.ndarray or type(args[1]) is not tuple or args[1] != (0,) \
                    or type(args[2]) is not bytes or args[2] != b"b":
                raise _Refused(f"numpy's _reconstruct{_brief(args)} is not how numpy pickles an array")
            out = np_multiarray._reconstruct(np.ndarray, (0,), b"b")
            self._fresh[id(out)] = out
        elif func is codecs.encode:
            if len(args) != 2 or type(args[0]) is not str or args[1] != "latin1":
                raise _Refused("_codecs.encode called other than as protocol 2 writes bytes")
            out = codecs.encode(args[0], "latin1")
        elif func is np_multiarray.scalar:
            if len(args) != 2 or not _simple(args[0]) or args[0].hasobject or not isinstance(args[1], bytes) \
                    or len(args[1]) != args[0].itemsize:
                raise _Refused("a numpy scalar that is not a simple number")
            self._used.add(id(args[0]))
            out = np_multiarray.scalar(*args)
        else:
            raise _Refused(f"{getattr(func, '__name__', type(func).__name__)} called while unpickling; only numpy's "
                           "array, scalar and dtype reconstructors may be")
        self.stack[-1] = out

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if self.scan and isinstance(inst, _Opaque):
            return
        if self._fresh.pop(id(inst), None) is not inst:
            raise _Refused(f"BUILD on a {type(inst).__name__} that numpy's reconstructors did not just make")
        if isinstance(inst, np.dtype):
            own = inst.__reduce__()[2]  # the state numpy writes for this dtype: only its byte order may differ
            ok = (id(inst) not in self._used and isinstance(state, tuple) and len(state) == len(own) == 8
                  and state[0] == 3 and state[1] in (("|",) if own[1] == "|" else ("<", ">"))
                  and all(type(a) is type(b) and a == b for a, b in zip(state[2:], own[2:])))
            if not ok:
                raise _Refused(f"a numpy dtype whose state {_brief(state)} is not a simple numeric dtype's (fields, "
                               "offsets, subarrays and odd item sizes are refused)")
        else:
            if not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1):
                raise _Refused("an array state that is not numpy's (version 1, shape, dtype, order, data)")
            _, shape, dtype, fortran, raw = state
            if not (isinstance(shape, tuple) and len(shape) <= _MAX_NDIM
                    and all(type(d) is int and d >= 0 for d in shape)):
                raise _Refused(f"an array shape {_brief(shape)} that is not a tuple of at most {_MAX_NDIM} sizes >= 0")
            if not _simple(dtype) or type(fortran) is not bool:
                raise _Refused("an array whose dtype is not a simple numeric dtype")
            self._used.add(id(dtype))
            count = 1
            for d in shape:
                count *= d
            self.budget.charge(count * dtype.itemsize, self.what)  # before it is built
            if dtype.hasobject:
                if type(raw) is not list or len(raw) != count:
                    raise _Refused(f"an object array of {count} elements whose data is not a list of as many")
            elif not isinstance(raw, (bytes, bytearray)) or len(raw) != count * dtype.itemsize:
                raise _Refused(f"an array of {count} x {dtype.itemsize} bytes whose data does not hold that many")
            if self.scan:
                return
        inst.__setstate__(state)

    def _load_newobj(self) -> None:  # scan only: torch's unpickler builds its own allowed classes this way
        args = self.stack.pop()
        if not (self.scan and isinstance(self.stack[-1], _Opaque) and isinstance(args, tuple)):
            raise _Refused("NEWOBJ on a numpy class")
        self.stack[-1] = _Opaque()

    def _expect(self, obj: object, kind: type, opcode: str) -> None:
        """Refuse `opcode` unless it acts on a `kind` (or, when scanning, on an object the scan left opaque)."""
        if not isinstance(obj, (kind, _Opaque) if self.scan else kind):
            raise _Refused(f"{opcode} on something that is not a {kind.__name__}")

    def _marked(self) -> object:
        """The object a *S opcode (SETITEMS, APPENDS, ADDITEMS) adds to: the one below the last MARK."""
        return self.metastack[-1][-1] if self.metastack else None

    def _load_setitems(self) -> None:
        self._expect(self._marked(), dict, "SETITEMS")
        pickle._Unpickler.load_setitems(self)  # type: ignore[attr-defined]

    def _load_setitem(self) -> None:
        self._expect(self.stack[-3] if len(self.stack) >= 3 else None, dict, "SETITEM")
        pickle._Unpickler.load_setitem(self)  # type: ignore[attr-defined]

    def _load_appends(self) -> None:
        self._expect(self._marked(), list, "APPENDS")
        pickle._Unpickler.load_appends(self)  # type: ignore[attr-defined]

    def _load_append(self) -> None:
        self._expect(self.stack[-2] if len(self.stack) >= 2 else None, list, "APPEND")
        pickle._Unpickler.load_append(self)  # type: ignore[attr-defined]

    def _load_additems(self) -> None:
        self._expect(self._marked(), set, "ADDITEMS")
        pickle._Unpickler.load_additems(self)  # type: ignore[attr-defined]


class _Opaque:
    """What a checkpoint scan stands in for torch's own objects (its classes, functions, storages and what they
    build): torch's weights_only unpickler checks those; the scan checks only what numpy is handed."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def add(self, value: Any) -> None:
        pass


class _CheckpointScan(_PlainUnpickler):
    """A dry run of a checkpoint's pickle before torch.load: torch's weights_only unpickler calls the numpy
    reconstructors raysim admits (SAFE_NUMPY) with whatever they are handed, and gives a dtype whatever state
    the file says (one with a field past its item corrupts memory), so each of those calls goes through the
    checks of `_PlainUnpickler` first; everything else stands in as `_Opaque`, for torch to check."""

    scan = True


def _scan_checkpoint(buf: io.BytesIO, what: str) -> None:
    """Refuse (CheckpointError) a torch.save archive any of whose pickles hands numpy more than plain data."""
    import zipfile

    try:
        archive = zipfile.ZipFile(buf)
        members = [i for i in archive.infolist() if i.filename.endswith(".pkl")]
    except (zipfile.BadZipFile, ValueError, OSError, struct.error) as e:
        raise CheckpointError(f"{what} is truncated or corrupted (not a torch.save archive: {_reason(e)})") from None
    budget = Budget(4 * MAX_CHECKPOINT_BYTES, scope="one checkpoint", error=CheckpointError)
    with archive:
        for info in members:
            try:
                raw = archive.read(info)
            except Exception as e:
                raise CheckpointError(f"{what} is truncated or corrupted ({_reason(e)})") from None
            if b"numpy" not in raw:  # torch finds a global by its literal name: without one, numpy is never reached
                continue
            try:
                _CheckpointScan(_BufferReader(raw), budget=budget, what=what).load()
            except RaysimError:
                raise
            except _Refused as e:
                raise CheckpointError(f"{what} holds a pickled object that is not plain data ({str(e)[:200]}); loading it "
                                      "could corrupt memory, so raysim refuses it") from None
            except Exception as e:
                raise CheckpointError(f"{what} is truncated or corrupted ({_reason(e)})") from None
    buf.seek(0)


def _plain_dispatch() -> dict[int, Callable[[Any], None]]:
    import pickletools

    names = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
    checked = {"REDUCE": _PlainUnpickler._load_reduce, "BUILD": _PlainUnpickler._load_build, "NEWOBJ": _PlainUnpickler._load_newobj,
               "SETITEMS": _PlainUnpickler._load_setitems, "SETITEM": _PlainUnpickler._load_setitem,
               "APPENDS": _PlainUnpickler._load_appends, "APPEND": _PlainUnpickler._load_append,
               "ADDITEMS": _PlainUnpickler._load_additems}
    table: dict[int, Callable[[Any], None]] = {code: _refuse(f"{code:#04x}") for code in range(256)}
    for code, fn in pickle._Unpickler.dispatch.items():
        name = names.get(code, f"{code:#04x}")
        table[code] = checked.get(name, fn) if name in _PLAIN_OPS else _refuse(name)
    return table


_PlainUnpickler._dispatch = _plain_dispatch()


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


class _BufferReader:
    """read / readline over a bytearray without copying it whole (what the pure-Python unpickler asks of a file)."""

    def __init__(self, buf: bytearray | bytes, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def read(self, n: int = -1) -> bytes:
        end = len(self.buf) if n is None or n < 0 else min(self.pos + n, len(self.buf))
        out = bytes(memoryview(self.buf)[self.pos:end])
        self.pos = end
        return out

    def readline(self) -> bytes:
        end = self.buf.find(b"\n", self.pos)
        return self.read(-1 if end < 0 else end + 1 - self.pos)


def plain_unpickle(data: bytes | bytearray | Any, *, what: str = "the file", error: type[Exception] = DataError,
                   budget: Budget | None = None) -> Any:
    """Unpickle plain numpy data (arrays, scalars, dicts, lists, numbers, strings); anything else (an object
    whose unpickling would call a class or a function, a dtype other than a simple numeric one) raises `error`
    naming `what`, before it runs, and so does building more than `budget` allows (default: MAX_DATA_BYTES)."""
    fp = _BufferReader(data) if isinstance(data, (bytes, bytearray)) else data
    budget = budget if budget is not None else Budget(error=error)
    try:
        return _PlainUnpickler(fp, budget=budget, what=what).load()
    except RaysimError:
        raise
    except pickle.UnpicklingError as e:
        raise error(
            f"{what} holds a pickled object that is not plain data ({str(e)[:200]}); unpickling it could run code or "
            "corrupt memory, so raysim refuses it. Only numpy arrays of numbers, dicts, lists and numbers are accepted."
        ) from None
    except RecursionError:
        raise error(f"{what} is nested too deeply to be plain data") from None
    except Exception as e:
        raise error(f"{what} is truncated or corrupted ({_reason(e)})") from None


def read_npz_safely(path: str | Path, *, root: str | Path | None = None, max_bytes: int | None = None,
                    error: type[Exception] = DataError) -> dict[str, Any]:
    """The arrays of an .npz archive (np.savez / np.savez_compressed) as {name: value}, read without
    numpy's `allow_pickle`: an object array (a pickled dict, as PFLlib stores its clients) is unpickled
    with `plain_unpickle`, and its single value returned for a 0-d array (what `.tolist()` gives).

    The archive is read with `read_regular` (a regular file of at most `max_bytes`, default
    MAX_DATA_BYTES), and everything it unpacks to is charged to one `Budget` of that many bytes as it
    arrives, so neither a large file nor a zip bomb can exhaust memory. Anything malformed raises `error`
    naming the file."""
    budget = Budget(max_bytes, scope="one archive", error=error)
    return parse_npz(read_regular(path, root=root, max_bytes=budget.limit, error=error), what=str(path), budget=budget, error=error)


def parse_npz(raw: bytes, *, what: str, budget: Budget | None = None, error: type[Exception] = DataError) -> dict[str, Any]:
    """`read_npz_safely` on the bytes of an archive already read (with `read_regular`); `what` names it and
    `budget` (default: a fresh one of MAX_DATA_BYTES) is what its members may unpack to, all together."""
    import zipfile

    path = what
    budget = budget if budget is not None else Budget(scope="one archive", error=error)
    try:
        end = zipfile._EndRecData(io.BytesIO(raw))  # type: ignore[attr-defined]  # the directory's size, before zipfile parses it
        listed = end[zipfile._ECD_SIZE] if end else 0  # type: ignore[attr-defined]
        if listed > MAX_NPZ_DIRECTORY_BYTES:
            raise error(f"{path} lists {listed:,} bytes of members, more than the {MAX_NPZ_DIRECTORY_BYTES:,} an .npz of a few "
                        "arrays takes")
        archive = zipfile.ZipFile(io.BytesIO(raw))
    except (zipfile.BadZipFile, ValueError, OSError, struct.error) as e:
        raise error(f"{path} is not an .npz archive ({_reason(e)})") from None
    out: dict[str, Any] = {}
    with archive:
        for info in archive.infolist():
            member = f"{path}[{info.filename[:100]}]"
            if not info.filename.endswith(".npy"):
                raise error(f"{member}: an .npz archive holds only .npy members")
            if info.file_size > budget.left:  # what the archive says: a first check, the real one is as bytes arrive
                raise error(f"{member} unpacks to {info.file_size} bytes, more than the {budget.left} bytes left of the "
                            f"{budget.limit:,} raysim allows for {budget.scope} (docs/security.md; RAYSIM_MAX_DATA_BYTES raises it)")
            try:
                buf = bytearray()
                with archive.open(info) as f:
                    while chunk := f.read(_CHUNK):  # decompressed a chunk at a time, stopping at the budget
                        budget.charge(len(chunk), member)
                        buf += chunk
                value = _npy_value(buf, member=member, budget=budget, error=error)
            except RaysimError:
                raise
            except Exception as e:  # a cut member, a bad header, a CRC mismatch
                raise error(f"{member} is truncated or corrupted ({_reason(e)})") from None
            out[info.filename[: -len(".npy")]] = value
    return out


def _npy_value(buf: bytearray, *, member: str, budget: Budget, error: type[Exception]) -> Any:
    """The array of one .npy member (its bytes `buf`): a simple-dtype array of exactly the bytes its header
    says, viewed in place, or a pickled object array unpickled with `plain_unpickle`."""
    head = io.BytesIO(bytes(memoryview(buf)[:1 << 16]))  # numpy caps a header at 10,000 bytes
    version = np.lib.format.read_magic(head)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(head)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(head)
    offset = head.tell()
    if not _simple(dtype) or not all(type(d) is int and d >= 0 for d in shape) or len(shape) > _MAX_NDIM:
        raise error(f"{member} holds an array of dtype {_brief(str(dtype))} and shape {_brief(shape)}; only simple numeric "
                    "dtypes (no fields or offsets) are read")
    if dtype.hasobject:
        value = plain_unpickle(_BufferReader(buf, offset), what=member, error=error, budget=budget)
        if isinstance(value, np.ndarray) and value.dtype.hasobject and value.shape == ():
            value = value.item()
        return value
    count = 1
    for d in shape:
        count *= d
    if len(buf) - offset != count * dtype.itemsize:
        raise error(f"{member} is truncated or corrupted (its header says {count} x {dtype.itemsize} bytes, it holds "
                    f"{len(buf) - offset})")
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(shape, order="F" if fortran else "C")
