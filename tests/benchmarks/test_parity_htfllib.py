"""benchmarks/parity_htfllib.py's own logic: the best round, the table, and the library's side read back from a
stand-in checkout (a main.py printing HtFLlib's per-round lines), its first (untrained) point dropped."""

from __future__ import annotations

import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import parity_htfllib as parity  # noqa: E402


def test_best_is_the_earliest_of_equal_bests_and_one_based():
    assert parity.best([0.1, 0.5, 0.5, 0.2]) == (0.5, 2)
    a, r = parity.best([])
    assert math.isnan(a) and r == 0


def test_table_says_what_is_missing_without_a_checkout():
    rows = [{"algorithm": "FedProto", "method": "fedproto", "lib": "htfllib", "raysim": [0.2, 0.4], "library": [],
             "missing": "no --htfllib checkout"},
            {"algorithm": "Local", "method": "local", "lib": "htfllib", "raysim": [0.3, 0.5], "library": [0.25, 0.45]}]
    text = parity.table(rows)
    assert "| FedProto | fedproto | 40.00 | 2 | no --htfllib checkout | - | - |" in text
    assert "| Local | local | 50.00 | 2 | 45.00 | 2 | 5.00 |" in text


def test_library_side_runs_the_checkout_and_aligns_its_curve(tmp_path):
    checkout = tmp_path / "HtFLlib"
    (checkout / "system").mkdir(parents=True)
    # a stand-in for HtFLlib's main: it checks the folder is linked where HtFLlib reads it, prints its lines
    (checkout / "system" / "main.py").write_text(
        "import sys, os\n"
        "a = sys.argv\n"
        "name = a[a.index('-data') + 1]\n"
        "assert os.path.isfile(os.path.join('..', 'dataset', name, 'config.json'))\n"
        "assert a[a.index('-algo') + 1] == 'FedProto' and a[a.index('-m') + 1] == 'HtFE-img-2'\n"
        "assert a[a.index('-lam') + 1] == '10', a  # total.sh's FedProto coefficient, as the preset's\n"
        "for acc in (0.1, 0.3, 0.6, 0.5):\n"
        "    print('Averaged Test Accurancy: %.4f' % acc)\n"
    )
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text('{"num_clients": 2, "num_classes": 10}')
    curve = parity.library_side("htfllib", checkout, sys.executable, str(folder), "FedProto", family="HtFE-img-2",
                                rounds=3, num_clients=2, num_classes=10, timeout=60)
    assert curve == [0.3, 0.6, 0.5]  # parsed from 4-digit text; the untrained first point dropped


def test_pfllib_side_names_the_link_for_its_cnn(tmp_path):
    """PFLlib's "-m CNN" picks FedAvgCNN's input from the dataset's name: a one-channel 28x28 folder is linked as MNIST_..."""
    checkout = tmp_path / "PFLlib"
    (checkout / "system").mkdir(parents=True)
    (checkout / "system" / "main.py").write_text(
        "import sys, os\n"
        "a = sys.argv\n"
        "name = a[a.index('-data') + 1]\n"
        "assert name.startswith('MNIST_') and a[a.index('-m') + 1] == 'CNN', a\n"
        "assert os.path.isfile(os.path.join('..', 'dataset', name, 'train', '0.npz'))\n"
        "print('Averaged Test Accurancy: 0.1000')\n"
        "print('Averaged Test Accurancy: 0.2000')\n"
    )
    folder = parity.make_mnist_like(tmp_path / "mnist_like")
    curve = parity.library_side("pfllib", checkout, sys.executable, str(folder), "FedAvg", family="FedAvgCNN-1x28",
                                rounds=1, num_clients=20, num_classes=10, timeout=60)
    assert curve == [0.2]  # parsed from text, the untrained first point dropped


def _preset() -> dict:
    import yaml

    return yaml.safe_load(parity.PRESET.read_text())


def test_preset_holds_every_coefficient_the_library_side_is_given():
    """The library's side runs with SCRIPT_FLAGS (HtFLlib's total.sh), raysim's with the preset: the same values."""
    preset = _preset()
    methods = {alg: method for alg, method, _ in parity.ALGORITHMS}
    assert set(parity.SCRIPT_FLAGS) <= set(methods)
    for alg, flags in parity.SCRIPT_FLAGS.items():
        for flag, (key, value) in flags.items():
            assert preset[methods[alg]][key] == value, (alg, flag, key)
    assert parity.script_flags("FedGen") == ["-nd", "32", "-glr", "0.1", "-hd", "512", "-se", "100"]
    assert parity.script_flags("Local") == []


def test_preset_evaluates_and_computes_each_algorithm_as_htfllib():
    """FedProto / FedTGP predict by the nearest global prototype (clientproto / clienttgp test_metrics), FedProto's
    server averages uniformly, FedGen's clients sample the initial generator, and the quirk flags of FML, FedKD
    and FedMRL are on; every section is a valid set of the method's options."""
    from raysim.methods import get_method

    preset = _preset()
    assert preset["fedproto"]["protocol"] == preset["fedtgp"]["protocol"] == "htfllib"
    assert preset["fedproto"]["proto_weighting"] == "uniform"
    assert preset["fedgen"]["generator"] == "initial"
    assert preset["fml"]["htfllib_kl"] and preset["fedkd"]["htfllib_grads"] and not preset["fedmrl"]["persist_projector"]
    assert preset["feddistill"]["distill"] == "ce"  # HtFLlib's FD (clientfd.py): CE to softmax(Z_g[y])
    assert preset["eval"] == {"protocol": "fedtsp", "every": 1, "last": 1}
    for _, method, lib in parity.ALGORITHMS:
        if lib == "htfllib":
            get_method(method).Options(**preset[method]).validate()
