"""Hostile PFLlib folders and checkpoints (issue 45, items 1, 2, 3, 5, 9): a pickled dtype with fields at odd
offsets, a forged checkpoint size, a huge num_classes, pickles and members that unpack to far more than they
weigh, and values no model can train on are each refused with one line naming the file or key (exit 2 from the
command line), within bounded memory, leaving nothing behind."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy._core.multiarray import _reconstruct

from raysim.errors import CheckpointError, DataError
from raysim.safeio import DIGEST_SUFFIX, MAX_CHECKPOINT_BYTES, atomic_save, load_checked, plain_unpickle

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class _Reduce:
    """Pickles as `func(*args)` followed by BUILD `state`: what a hostile file can hand numpy's reconstructors."""

    def __init__(self, func, args, state=None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def _array(dtype, shape, raw) -> _Reduce:
    """An ndarray as numpy pickles one (_reconstruct, then BUILD (1, shape, dtype, fortran, data)), any parts."""
    return _Reduce(_reconstruct, (np.ndarray, (0,), b"b"), (1, shape, dtype, False, raw))


def _wrapped(obj) -> bytes:
    """`obj` pickled inside a 0-d object array, as np.savez pickles PFLlib's data dict."""
    return pickle.dumps(_array(np.dtype("O"), (), [obj]), protocol=3)


def _npz(payload: bytes) -> bytes:
    """A one-member .npz whose data.npy is an object array holding the pickle `payload`."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "|O", "fortran_order": False, "shape": ()})
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("data.npy", head.getvalue() + payload)
    return out.getvalue()


# a dtype named as numpy names float64's, given the state of a structured dtype whose one object field lies 1 GiB
# past its 8-byte item: numpy trusts a pickled dtype's state, and writing the array's object reads and writes there
ODD_OFFSET = (3, "|", None, ("a",), {"a": (np.dtype("O"), 1 << 30)}, 8, 1, 0x3F)


def _segfault_npz() -> bytes:
    dt = _Reduce(np.dtype, ("V8", False, True), ODD_OFFSET)
    return _npz(_wrapped({"x": _array(dt, (1,), [None]), "y": np.zeros(1, np.int64)}))


def _folder(root: Path, *, clients: int = 2, n: int = 4, classes: int = 10, shape=(1, 4, 4), **config) -> Path:
    """A tiny PFLlib folder (PFLlib's save_file layout) of `clients` clients with n train and n test rows each."""
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
        for i in range(clients):
            d = {"x": rng.standard_normal((n, *shape)).astype(np.float32), "y": rng.integers(0, classes, n)}
            with open(root / split / f"{i}.npz", "wb") as f:
                np.savez_compressed(f, data=d)  # type: ignore[arg-type]
    (root / "config.json").write_text(json.dumps({"num_clients": clients, "num_classes": classes, **config}))
    return root


def _put(root: Path, split: str, i: int, data) -> Path:
    path = root / split / f"{i}.npz"
    with open(path, "wb") as f:
        np.savez_compressed(f, data=data)  # type: ignore[arg-type]
    return path


def _cli(root: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raysim", "run", "method=local", "data.dataset=pfllib", f"data.data_root={root}",
         "local.model_family=FedAvgCNN-1x28", "train.rounds=1", "execution.backend=inline", f"output.out_dir={out}",
         "output.progress=false", "output.tensorboard=false", *extra],
        capture_output=True, text=True, timeout=300, env=ENV,
    )


# ------------------------------------------------------------------ 1: a pickled dtype with fields at odd offsets
def test_the_odd_offset_dtype_is_live_under_numpys_own_loader(tmp_path):
    """The refusal below could pass on a pickle that never harms: numpy's allow_pickle load dies of it (SIGSEGV
    here: a signal in any case, as the object is written 1 GiB past its array)."""
    path = tmp_path / "0.npz"
    path.write_bytes(_segfault_npz())
    code = f"import numpy as np; d = np.load({str(path)!r}, allow_pickle=True)['data'].item(); print(d['x'])"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert p.returncode < 0, (p.returncode, p.stderr[-500:])


def test_the_odd_offset_dtype_exits_2_with_one_line_and_no_lock(tmp_path):
    root = _folder(tmp_path / "pf", shape=(1, 28, 28))
    bad = root / "train" / "1.npz"
    bad.write_bytes(_segfault_npz())
    out = tmp_path / "run"
    p = _cli(root, out)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(lines) == 1 and str(bad) in lines[0] and "not a simple numeric dtype" in lines[0], p.stderr[-2000:]
    assert not (out / "run.lock").exists() and (not out.exists() or not any(out.iterdir()))


_FIELDS = st.sampled_from([("a",), ("a", "b")])
_STATES = st.one_of(
    st.tuples(st.just(3), st.just("|"), st.none(), _FIELDS, st.just({"a": (np.dtype("O"), 1 << 30)}), st.just(8), st.just(1), st.just(63)),
    st.tuples(st.just(3), st.just("<"), st.just((np.dtype("f8"), (1 << 20,))), st.none(), st.none(), st.just(8), st.just(8), st.just(0)),
    st.tuples(st.just(3), st.just("<"), st.none(), st.none(), st.none(), st.integers(0, 1 << 31), st.just(-1), st.just(0)),
    st.tuples(st.just(3), st.just("<"), st.none(), st.none(), st.none(), st.just(-1), st.integers(0, 64), st.just(0)),
    st.tuples(st.just(3), st.sampled_from(["|", "x", "", 5]), st.none(), st.none(), st.none(), st.just(-1), st.just(-1), st.just(0)),
    st.tuples(st.just(3), st.just("<"), st.none(), st.none(), st.none(), st.just(-1), st.just(-1), st.integers(1, 255)),
    st.tuples(st.just(4), st.just("<"), st.none(), st.none(), st.none(), st.just(-1), st.just(-1), st.just(0), st.just({"m": 1})),
)


@FAST
@given(name=st.sampled_from(["f8", "i8", "V8", "O8", "f16", "M8", "U4", "(2,)f8"]), state=_STATES)
def test_a_dtype_state_other_than_a_simple_types_is_refused(name, state):
    """Every admitted name given a structured, subarray, resized, realigned, flagged or odd-byte-order state:
    refused before numpy sees the state (f8 with the state numpy itself writes is the control, below)."""
    payload = _wrapped(_array(_Reduce(np.dtype, (name, False, True), state), (1,), [None] if name == "O8" else b"\0" * 8))
    with pytest.raises(DataError, match="not plain data"):
        plain_unpickle(payload, what="hostile.npy")


@FAST
@given(dtype=st.sampled_from(["?", "i1", "u1", "<i2", ">u2", "<i4", ">i8", "<f2", ">f4", "<f8", "<c8", ">c16"]),
       shape=st.lists(st.integers(0, 4), max_size=3).map(tuple))
def test_arrays_of_every_simple_dtype_round_trip(dtype, shape):
    """What numpy itself pickles (both byte orders; numpy 2's pickle, and numpy 1's module name and spelling of the
    dtype's arguments) reads back as numpy's own unpickler reads it: same dtype, same values."""
    want = np.arange(math.prod(shape), dtype=np.int64).astype(dtype).reshape(shape)
    old = _array(_Reduce(np.dtype, (want.dtype.str[1:], 0, 1), (3, want.dtype.str[0], None, None, None, -1, -1, 0)),
                 shape, want.tobytes())
    numpy1 = pickle.dumps({"x": old}, protocol=3).replace(b"numpy._core.", b"numpy.core.")  # GLOBAL names are text lines
    assert b"numpy.core.multiarray" in numpy1
    for payload in (pickle.dumps({"x": want, "s": want.dtype.type(1)}, protocol=4), numpy1):
        got, ref = plain_unpickle(payload), pickle.loads(payload)
        assert got["x"].dtype == ref["x"].dtype and np.array_equal(got["x"], want)  # bytes as pickled: exact
    assert got["x"].shape == shape


def test_other_calls_and_opcodes_are_refused():
    for obj in (_Reduce(np.ndarray, ((1 << 40,),)),  # an admitted class called directly would allocate 1 TB
                _Reduce(_reconstruct, (np.ndarray, (1 << 40,), b"b")),
                _Reduce(np.dtype, ("f8", False, False), (3, "<", None, None, None, -1, -1, 0))):  # not a fresh copy
        with pytest.raises(DataError, match="not plain data"):
            plain_unpickle(pickle.dumps(obj, protocol=3), what="hostile.npy")
    newobj = pickle.dumps(_Reduce(np.ndarray.__new__, (np.ndarray, (4,))), protocol=3)
    with pytest.raises(DataError, match="not plain data"):
        plain_unpickle(newobj, what="hostile.npy")
    assert np.dtype("f8").byteorder == "="  # the global float64 was never touched


# ------------------------------------------------------------------ 2: a checkpoint with a forged size
def test_a_forged_checkpoint_size_is_refused_before_a_byte_is_read(tmp_path):
    ckpt = tmp_path / "00001.pt"
    ckpt.touch()
    os.truncate(ckpt, 12_000_000_000)  # sparse: 12 GB without using the disk
    digest = ckpt.with_name(ckpt.name + DIGEST_SUFFIX)
    digest.write_text(f"{'0' * 64} {12_000_000_000}\n")
    with pytest.raises(CheckpointError, match=rf"records a size of 12,000,000,000 bytes.*more than the {MAX_CHECKPOINT_BYTES:,}"):
        load_checked(ckpt, root=tmp_path)
    digest.write_text(f"{'0' * 64} 1000\n")  # a size within the cap that is not the file's
    with pytest.raises(CheckpointError, match="12000000000 bytes, more than the 1000"):
        load_checked(ckpt, root=tmp_path)
    atomic_save({"w": np.arange(3)}, ckpt)
    good = digest.read_text()
    digest.write_text(good.replace(good[0], "f" if good[0] != "f" else "e", 1))  # same size, wrong SHA-256
    with pytest.raises(CheckpointError, match="SHA-256 does not match"):
        load_checked(ckpt, root=tmp_path)
    digest.write_text(good)
    assert np.array_equal(load_checked(ckpt, root=tmp_path)["w"], np.arange(3))


# ------------------------------------------------------------------ 3 and 9: config.json values
@FAST
@given(value=st.sampled_from(["1000000000", "100001", "-3", "0", "true", "2.5", "NaN", "\"10\"", "null", "[10]"]),
       key=st.sampled_from(["num_classes", "num_clients"]))
def test_a_bad_count_in_config_json_is_refused_naming_it(tmp_path, value, key):
    from raysim.data.pfllib_folder import read_config

    root = tmp_path / "pf"
    root.mkdir(exist_ok=True)
    counts = {"num_clients": "2", "num_classes": "10", key: value}
    (root / "config.json").write_text("{" + ", ".join(f'"{k}": {v}' for k, v in counts.items()) + "}")
    with pytest.raises(DataError, match=rf"config\.json: {key} (must be a positive integer|is at most 100,000|is NaN)"):
        read_config(root)


def test_the_folder_caps_are_the_configs():
    from raysim.config.limits import MAX_CLIENTS
    from raysim.data.pfllib_folder import MAX_FOLDER_CLIENTS

    assert MAX_FOLDER_CLIENTS == MAX_CLIENTS


@FAST
@given(where=st.sampled_from(["alpha", "batch_size", "stats"]), const=st.sampled_from(["NaN", "Infinity", "-Infinity"]))
def test_nan_anywhere_in_config_json_is_refused_naming_the_key(tmp_path, where, const):
    from raysim.data.pfllib_folder import read_config

    root = tmp_path / "pf"
    root.mkdir(exist_ok=True)
    val = {"alpha": const, "batch_size": const, "stats": f"[[1, 2], [3, {const}]]"}
    body = {"alpha": "0.1", "batch_size": "10", "stats": "[]", where: val[where]}
    (root / "config.json").write_text('{"num_clients": 2, "num_classes": 10, ' + ", ".join(f'"{k}": {v}' for k, v in body.items()) + "}")
    want = {"alpha": "alpha", "batch_size": "batch_size", "stats": r"stats\[1\]\[1\]"}[where]
    with pytest.raises(DataError, match=rf"config\.json: {want} is NaN or infinite"):
        read_config(root)


def test_deep_nesting_and_huge_integers_in_config_json_are_refused(tmp_path):
    from raysim.data.pfllib_folder import read_config

    deep, digits = "[" * 100_000 + "]" * 100_000, '{"num_clients": ' + "9" * 5000 + "}"
    for text, msg in ((deep, "nested too deeply|not valid JSON"), (digits, "not valid JSON")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(DataError, match=msg):
            read_config(tmp_path)


# ------------------------------------------------------------------ 9: values no model can train on
def _bad_client(kind: str, rng: np.random.Generator):
    x = rng.standard_normal((4, 1, 4, 4)).astype(np.float32)
    y = rng.integers(0, 10, 4)
    if kind in ("nan", "inf", "-inf"):
        x.reshape(-1)[rng.integers(0, x.size)] = float(kind)
    elif kind == "complex":
        x = x.astype(np.complex64)
    elif kind == "empty":
        x, y = x[:0], y[:0]
    elif kind == "label-high":
        y[rng.integers(0, 4)] = 10
    elif kind == "label-low":
        y[rng.integers(0, 4)] = -1
    elif kind == "float-labels":
        y = y.astype(np.float64)
    elif kind == "list-x":
        x = list(x)
    return {"x": x, "y": y}


@FAST
@given(kind=st.sampled_from(["nan", "inf", "-inf", "complex", "empty", "label-high", "label-low", "float-labels", "list-x"]),
       split=st.sampled_from(["train", "test"]), client=st.integers(0, 1), seed=st.integers(0, 2**16))
def test_values_no_model_can_train_on_are_refused_naming_the_file(tmp_path, kind, split, client, seed):
    from raysim.data.pfllib_folder import read_folder

    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        root = _folder(Path(d) / "pf")
        bad = _put(root, split, client, _bad_client(kind, np.random.default_rng(seed)))
        with pytest.raises(DataError, match=rf"{bad}(:| holds no samples)"):
            read_folder(root)


@pytest.mark.parametrize("extra", ["test/2.npz", "train/2.npz", "test/7.npz", "train/01.npz"])
def test_archives_beyond_num_clients_are_refused(tmp_path, extra):
    from raysim.data.pfllib_folder import read_folder

    root = _folder(tmp_path / "pf")
    (root / extra).write_bytes((root / "train" / "0.npz").read_bytes())
    split, name = extra.split("/")
    with pytest.raises(DataError, match=rf"{root}/{split} holds archives beyond config\.json's num_clients=2 \({name}"):
        read_folder(root)


# ------------------------------------------------------------------ 5: one budget per folder
def test_one_budget_covers_all_the_archives_of_a_folder(tmp_path):
    from raysim.data.pfllib_folder import read_folder

    root = _folder(tmp_path / "pf", clients=4, n=64, shape=(1, 16, 16))  # each archive unpacks to ~65 KB
    assert read_folder(root).num_clients == 4
    one = sum(len(zipfile.ZipFile(root / "train" / "0.npz").read(n)) for n in ("data.npy",))
    assert 3 * one < 300_000 < 8 * one  # each archive fits the budget, the folder's eight do not
    past = r"/pf/(train|test)/[1-3]\.npz\[data\.npy\] unpacks (past|to) .* raysim allows for the PFLlib folder"
    with pytest.raises(DataError, match=past):
        read_folder(root, max_bytes=300_000)


def test_a_row_repeated_by_reference_is_never_stacked():
    """A 200,000-row list (or object array) holding one 3x32x32 row by reference pickles to 0.4 MB and compresses
    to a few KB; np.asarray of it would allocate 2.4 GB. Refused before anything is built from it."""
    row = np.zeros((3, 32, 32), np.float32)
    for x in ([row] * 200_000, _array(np.dtype("O"), (200_000,), [row] * 200_000)):
        npz = _npz(_wrapped({"x": x, "y": np.zeros(200_000, np.int64)}))
        assert len(npz) < 40_000
        with tempfile.TemporaryDirectory() as d:
            root = _folder(Path(d) / "pf", shape=(3, 32, 32))
            bad = root / "train" / "0.npz"
            bad.write_bytes(npz)
            from raysim.data.pfllib_folder import read_folder

            with pytest.raises(DataError, match=rf"{bad}: x must be a (numpy array|real-valued numeric array)"):
                read_folder(root)


# The worst cases, each under an address-space limit 1 GiB above what the imports took: every one would need
# gigabytes (or tens of them) if it were built; each must end in the one-line error, not MemoryError.
_WORST = r'''
import io, json, os, resource, sys, zipfile
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_hostile_data import _array, _npz, _wrapped, _folder
from raysim.errors import RaysimError
from raysim.safeio import DIGEST_SUFFIX, load_checked
from raysim.data.pfllib_folder import read_folder, read_config
tmp = sys.argv[2]
size = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), size + (1 << 30)))
row = np.zeros((3, 32, 32), np.float32)
huge_head = io.BytesIO()
np.lib.format.write_array_header_1_0(huge_head, {"descr": "<f8", "fortran_order": False, "shape": (1 << 31,)})
def member(body, name="data.npy", size=None):
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(name, body)
    return out.getvalue()
cases = {
    "2.4 GB by reference": _npz(_wrapped({"x": [row] * 200_000, "y": np.zeros(200_000, np.int64)})),
    "an object array of 2^31 elements": _npz(_wrapped({"x": _array(np.dtype("O"), (1 << 31,), [row] * 10), "y": 1})),
    "a float array claiming 2^34 elements": _npz(_wrapped({"x": _array(np.dtype("f8"), (1 << 17, 1 << 17), b"\0" * 8), "y": 1})),
    "a header claiming 16 GiB": member(huge_head.getvalue() + b"\0" * 64),
    "a member unpacking past the budget": member(bytes(96 << 20)),
}
for i, (name, raw) in enumerate(cases.items()):
    root = _folder(Path(tmp) / f"case{i}")
    (root / "train" / "0.npz").write_bytes(raw)
    try:
        read_folder(root, max_bytes=64 << 20)
        print("ACCEPTED", name)
    except RaysimError as e:
        print("REFUSED", name, "|", str(e).splitlines()[0][:160])
os.makedirs(tmp + "/pf", exist_ok=True)
open(tmp + "/pf/config.json", "w").write(json.dumps({"num_clients": 2, "num_classes": 1_000_000_000}))
try:
    read_config(tmp + "/pf"); print("ACCEPTED num_classes")
except RaysimError as e:
    print("REFUSED num_classes |", str(e)[:160])
ck = tmp + "/00001.pt"
open(ck, "wb").close(); os.truncate(ck, 12_000_000_000)
open(ck + DIGEST_SUFFIX, "w").write("0" * 64 + " 12000000000\n")
try:
    load_checked(ck); print("ACCEPTED checkpoint")
except RaysimError as e:
    print("REFUSED checkpoint |", str(e)[:160])
'''


def test_the_worst_cases_stay_within_a_memory_limit(tmp_path):
    p = subprocess.run([sys.executable, "-c", _WORST, str(Path(__file__).parent), str(tmp_path)], capture_output=True,
                       text=True, timeout=120, env=ENV)
    assert p.returncode == 0 and "MemoryError" not in p.stderr + p.stdout, (p.stdout, p.stderr[-3000:])
    refused = [ln for ln in p.stdout.splitlines() if ln.startswith("REFUSED")]
    assert len(refused) == 7 and "ACCEPTED" not in p.stdout, p.stdout
    assert "num_classes is at most 100,000" in p.stdout and "records a size of 12,000,000,000" in p.stdout
    assert p.stdout.count("unpacks past the 67,108,864 bytes") + p.stdout.count("unpacks to") >= 3, p.stdout


def test_an_archive_listing_thousands_of_members_is_refused_before_zipfile_parses_the_list():
    """zipfile keeps ~0.5 KB per listed member: a 2 GiB archive of empty members would take 20 GB to list."""
    from raysim.safeio import MAX_NPZ_DIRECTORY_BYTES, parse_npz

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for i in range(MAX_NPZ_DIRECTORY_BYTES // 40):  # each listing is over 40 bytes: past the limit
            z.writestr(f"{i}.npy", b"")
    with pytest.raises(DataError, match=r"many\.npz lists .* bytes of members, more than the 1,048,576"):
        parse_npz(out.getvalue(), what="many.npz")
    ok = io.BytesIO()
    np.savez(ok, **{f"a{i}": np.arange(i) for i in range(50)})
    assert np.array_equal(parse_npz(ok.getvalue(), what="ok.npz")["a49"], np.arange(49))


# ------------------------------------------------------------------ 1, in a checkpoint: torch hands numpy the same state
def _odd_offset_checkpoint(path: Path) -> None:
    dt = _Reduce(np.dtype, ("O8", False, True), ODD_OFFSET)  # an object dtype: one torch's allowlist (SAFE_NUMPY) admits
    atomic_save({"x": _array(dt, (1,), [None])}, path)


def test_torchs_own_weights_only_load_admits_the_odd_offset_dtype(tmp_path):
    """The refusal below could pass on a checkpoint torch refuses anyway: torch.load(weights_only=True) with raysim's
    numpy allowlist builds the dtype with its field 1 GiB past the item (in a subprocess: memory may be corrupted)."""
    ckpt = tmp_path / "00001.pt"
    _odd_offset_checkpoint(ckpt)
    code = ("import torch; from raysim.safeio import SAFE_NUMPY\n"
            f"with torch.serialization.safe_globals(SAFE_NUMPY): x = torch.load({str(ckpt)!r}, weights_only=True)['x']\n"
            "print('offset', x.dtype.fields['a'][1], flush=True)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert f"offset {1 << 30}" in p.stdout, (p.returncode, p.stdout, p.stderr[-1000:])


def test_a_checkpoint_handing_numpy_an_odd_offset_dtype_is_refused(tmp_path):
    from raysim.safeio import safe_load, serialize

    ckpt = tmp_path / "00001.pt"
    _odd_offset_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=rf"{ckpt} holds a pickled object that is not plain data \(a numpy dtype whose state"):
        load_checked(ckpt, root=tmp_path)
    plain = {"a": np.arange(5.0), "names": np.array(["ab", "c"]), "o": np.array([{"k": 1}, None], dtype=object),
             "be": np.arange(4, dtype=">f4"), "s": np.float32(2)}
    got = safe_load(serialize(plain))  # what the data caches hold still loads
    assert all(np.array_equal(got[k], v) for k, v in plain.items() if k != "o") and got["o"][0] == {"k": 1}
