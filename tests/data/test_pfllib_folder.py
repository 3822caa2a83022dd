"""PFLlib / HtFLlib dataset folders: read safely (a planted malicious pickle never runs), the stored clients
as they are, export and import round trip, the config refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raysim.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[2]


def _folder(tmp_path: Path, *, clients: int = 3, shape=(1, 28, 28), seed: int = 0) -> tuple[Path, list, list]:
    """A small PFLlib folder written as PFLlib's save_file writes one (np.savez_compressed(f, data=dict))."""
    rng = np.random.default_rng(seed)
    root = tmp_path / "pf"
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    train, test = [], []
    for i in range(clients):
        for split, n, out in (("train", 6 + i, train), ("test", 3 + i, test)):
            d = {"x": rng.standard_normal((n, *shape)).astype(np.float32), "y": rng.integers(0, 10, n).astype(np.int64)}
            with open(root / split / f"{i}.npz", "wb") as f:
                np.savez_compressed(f, data=d)
            out.append(d)
    (root / "config.json").write_text(json.dumps({"num_clients": clients, "num_classes": 10, "non_iid": True,
                                                  "balance": False, "partition": "dir", "alpha": 0.1, "batch_size": 10,
                                                  "Size of samples for labels in clients": []}))
    return root, train, test


def test_reads_the_stored_clients_in_order_and_as_stored(tmp_path):
    from raysim.data.pfllib_folder import read_folder

    root, train, test = _folder(tmp_path)
    got = read_folder(root)
    assert got.num_clients == 3 and got.config["alpha"] == 0.1
    for (x, y), want in zip(got.train + got.test, train + test):
        assert np.array_equal(x, want["x"]) and np.array_equal(y, want["y"])  # bytes as stored: exact
        assert x.shape[1:] == (1, 28, 28)


class _Payload:
    """Unpickling this would create the marker file (a __reduce__ payload: os.system, as a hostile folder would)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(root: Path, marker: Path) -> None:
    """Client 1's train archive replaced by one whose pickled dict holds the payload."""
    data = np.empty((), dtype=object)
    data[()] = {"x": np.zeros((2, 1, 28, 28), np.float32), "y": np.zeros(2, np.int64), "evil": _Payload(marker)}
    with open(root / "train" / "1.npz", "wb") as f:
        np.savez_compressed(f, data=data)


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    from raysim.data.pfllib_folder import read_folder

    root, _, _ = _folder(tmp_path)
    marker = tmp_path / "pwned"
    _plant(root, marker)
    with pytest.raises(DataError, match=r"train/1\.npz.*not plain data"):
        read_folder(root)
    assert not marker.exists()


def test_malicious_pickle_exits_2_from_the_cli(tmp_path):
    root, _, _ = _folder(tmp_path)
    marker = tmp_path / "pwned"
    _plant(root, marker)
    proc = subprocess.run(
        [sys.executable, "-m", "raysim", "run", "method=local", "data.dataset=pfllib", f"data.data_root={root}",
         "local.model_family=FedAvgCNN-1x28", "train.rounds=1", "execution.backend=inline",
         f"output.out_dir={tmp_path / 'run'}", "output.progress=false", "output.tensorboard=false"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "1.npz" in proc.stderr and "not plain data" in proc.stderr
    assert not marker.exists()


def test_the_planted_payload_is_live(tmp_path):
    """The test above could pass with a payload that never fires; numpy's own allow_pickle load fires it."""
    root, _, _ = _folder(tmp_path)
    marker = tmp_path / "fired"
    _plant(root, marker)
    code = f"import numpy as np; np.load({str(root / 'train' / '1.npz')!r}, allow_pickle=True)['data']"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert marker.exists()


def test_other_damage_is_refused_naming_the_file(tmp_path):
    from raysim.data.pfllib_folder import read_folder

    root, _, _ = _folder(tmp_path)
    (root / "test" / "2.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match=r"test/2\.npz"):
        read_folder(root)
    (root / "test" / "2.npz").unlink()
    with pytest.raises(DataError, match=r"test/2\.npz is missing"):
        read_folder(root)
    (root / "config.json").write_text("{\"num_clients\": 0}")
    with pytest.raises(DataError, match="num_clients must be a positive integer"):
        read_folder(root)


def test_config_takes_the_clients_from_the_folder(tmp_path):
    from raysim.build import build_config
    root, _, _ = _folder(tmp_path)
    base = {"method": "local", "data": {"dataset": "pfllib", "data_root": str(root)}, "local": {"model_family": "FedAvgCNN-1x28"}}
    cfg = build_config(base)
    assert cfg.train.num_clients == 3 and cfg.data.partition == "stored" and cfg.data.shots == 0
    assert cfg.data.folder_config["alpha"] == 0.1  # the folder's config.json, recorded in the run's config
    assert build_config({**base, "train": {"num_clients": 3}}).train.num_clients == 3
    with pytest.raises(ConfigError, match="conflicts with the 3 clients"):
        build_config({**base, "train": {"num_clients": 5}})
    with pytest.raises(ConfigError, match="would re-split"):
        build_config({**base, "data": {**base["data"], "partition": "dirichlet"}})
    with pytest.raises(ConfigError, match="data.partition=stored"):
        build_config({"method": "local", "data": {"dataset": "digits", "partition": "stored"}})


def test_export_then_import_round_trips_the_split(tmp_path):
    """A raysim split (digits, Dirichlet, seed 3) written as a PFLlib folder and read back: every client's
    train and test rows and labels unchanged, in order."""
    from raysim.build import build_config
    from raysim.data.prepare import prepare_data
    from raysim.methods.base import Needs
    from raysim.tools.export_pfllib import main as export_main

    out = tmp_path / "exported"
    args = ["data.dataset=digits", "data.partition=dirichlet", "data.beta=0.5", "data.shots=0", "train.num_clients=4",
            "train.seed=3", "model.name=raysim-tiny", "model.pretrained="]
    assert export_main([str(out), *args]) == 0
    cfg = build_config({"data": {"dataset": "digits", "partition": "dirichlet", "beta": 0.5, "shots": 0},
                        "train": {"num_clients": 4, "seed": 3}, "model": {"name": "raysim-tiny", "pretrained": ""}})
    need = Needs(input="images", image_size=32)
    want = prepare_data(cfg, need, progress=False)
    back = prepare_data(build_config({"method": "local", "data": {"dataset": "pfllib", "data_root": str(out)},
                                      "model": {"name": "raysim-tiny", "pretrained": ""}}), need, progress=False)
    assert back.num_clients == want.num_clients == 4
    for c in range(4):
        a, b = want.client(c), back.client(c)
        assert np.array_equal(a.x_train.numpy(), b.x_train.numpy())  # float32 written and read back: bit-exact
        assert np.array_equal(a.y_train.numpy(), b.y_train.numpy())
        assert np.array_equal(a.x_test.numpy(), b.x_test.numpy())
        assert np.array_equal(a.y_test.numpy(), b.y_test.numpy())
    meta = json.loads((out / "config.json").read_text())
    assert meta["num_clients"] == 4 and meta["raysim"]["seed"] == 3 and meta["partition"] == "dirichlet"
    assert export_main([str(out), *args]) == 2  # never over an existing folder


def test_trains_end_to_end_on_a_one_channel_folder(tmp_path):
    """The MNIST-like folder (benchmarks/parity_htfllib.py --make-mnist-like, 20 clients, Dirichlet 0.1, one
    channel at 28x28), one round of FedProto on FedAvgCNN-1x28 with HtFLlib's defaults."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from parity_htfllib import make_mnist_like, raysim_side

    folder = make_mnist_like(tmp_path / "mnist_like")
    from raysim.data.pfllib_folder import read_folder

    got = read_folder(folder)
    assert got.num_clients == 20 and got.train[0][0].shape[1:] == (1, 28, 28) and got.config["alpha"] == 0.1
    curve = raysim_side(str(folder), "fedproto", family="FedAvgCNN-1x28", rounds=1, out_dir=tmp_path / "runs")
    assert len(curve) == 1 and 0.0 <= curve[0] <= 1.0


def test_an_archive_that_unpacks_past_the_cap_is_refused(tmp_path):
    """A zip bomb in miniature: 10 KB of zeros compresses to a few hundred bytes; under a 4 KB cap the member is
    refused from its declared size, before it is unpacked."""
    from raysim.safeio import read_npz_safely

    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, data=np.zeros(10_000, np.uint8))
    assert path.stat().st_size < 4096
    with pytest.raises(DataError, match=r"bomb\.npz\[data\.npy\] unpacks to 10128 bytes, more than the 4096"):
        read_npz_safely(path, max_bytes=4096)
    assert read_npz_safely(path)["data"].shape == (10_000,)


def test_a_clip_method_is_refused_on_a_stored_folder(tmp_path):
    from raysim.build import build_config, make_method
    from raysim.data.prepare import prepare_data

    root, _, _ = _folder(tmp_path)
    cfg = build_config({"method": "promptfl", "data": {"dataset": "pfllib", "data_root": str(root)},
                        "model": {"name": "raysim-tiny", "pretrained": ""}})
    with pytest.raises(ConfigError, match=r"gives its images as stored \(\(1, 28, 28\)"):
        prepare_data(cfg, make_method(cfg).needs(), progress=False)


def test_a_family_that_cannot_take_the_stored_images_is_refused(tmp_path):
    from raysim.build import build_config, make_method
    from raysim.data.prepare import prepare_data

    root, _, _ = _folder(tmp_path)  # one channel at 28x28
    for section in ({"model_family": "HtFE-img-2"}, {"model_family": "FedAvgCNN-1x28", "shared_model": "cnn_tiny"}):
        cfg = build_config({"method": "fml", "data": {"dataset": "pfllib", "data_root": str(root)}, "fml": section})
        with pytest.raises(ConfigError, match=r"images as stored, \(1, 28, 28\); fml's (fedavgcnn|cnn_tiny) takes \(3, 32, 32\)"):
            prepare_data(cfg, make_method(cfg).needs(), progress=False)
    cfg = build_config({"method": "fml", "data": {"dataset": "pfllib", "data_root": str(root)},
                        "fml": {"model_family": "FedAvgCNN-1x28", "shared_model": "first"}})
    assert prepare_data(cfg, make_method(cfg).needs(), progress=False).num_clients == 3


def test_the_input_check_reads_the_family_before_the_single_model(tmp_path):
    from raysim.build import build_config, make_method
    from raysim.data.prepare import prepare_data

    root, _, _ = _folder(tmp_path)
    ok = build_config({"method": "fedpcl", "data": {"dataset": "pfllib", "data_root": str(root)},
                       "fedpcl": {"model_family": "FedAvgCNN-1x28"}})  # its `model` (fedavgcnn) is unused then
    assert prepare_data(ok, make_method(ok).needs(), progress=False).num_clients == 3
    bad = build_config({"method": "fedavg", "data": {"dataset": "pfllib", "data_root": str(root)}})
    with pytest.raises(ConfigError, match="fedavg's fedavgcnn takes"):
        prepare_data(bad, make_method(bad).needs(), progress=False)
