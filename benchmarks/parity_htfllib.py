"""Parity of raysim and HtFLlib / PFLlib on the same clients: the best-round pooled test accuracy of each
algorithm both have, side by side (docs/interop.md).

    python benchmarks/parity_htfllib.py --folder PFLLIB_FOLDER [--family F] [--rounds R] [--algorithms a,b]
        [--htfllib HTFLLIB_CHECKOUT] [--pfllib PFLLIB_CHECKOUT] [--python PY] [--out DIR]
    python benchmarks/parity_htfllib.py --make-mnist-like DIR   # an offline stand-in for HtFLlib's MNIST folder

raysim's side runs every listed algorithm raysim has on the folder (data.dataset=pfllib: the stored
clients), with benchmarks/presets/htfllib.yaml: HtFLlib's settings (lr 0.01, batch 10, one local epoch, every
client every round, d = 512, evaluated every round with eval.protocol=fedtsp, whose "local" is HtFLlib's
metric: total correct over total test samples across clients), each algorithm's coefficients as HtFLlib's
total.sh passes them (SCRIPT_FLAGS: the library's side gets the same flags) and each algorithm evaluated as
HtFLlib does (FedProto and FedTGP by the nearest global prototype). The other side runs when a
checkout and a Python that runs it are given: the folder is linked into CHECKOUT/dataset/ and each algorithm
is run by CHECKOUT/system/main.py with the same settings (PFLlib's side with "-m CNN", its FedAvgCNN, whose
input PFLlib picks from the dataset's name: the link is named MNIST_... or Cifar10_... by the folder's
sample shape); its per-round "Averaged Test Accurancy" lines are
read back. Without a checkout the table says what is missing. Per algorithm the table gives the best
round's accuracy of each side, the difference, and the (1-based) round that reached it; OUT/parity.png
plots the two curves, OUT/parity.json holds them.

HtFLlib evaluates at the start of each round, before training (its first point is the untrained models),
raysim after each round's training; the curves are aligned so that point r is "after r rounds of training"
(HtFLlib's first point is dropped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "benchmarks" / "presets" / "htfllib.yaml"

# (library's name, raysim method, the library): HtFLlib's heterogeneous algorithms, then PFLlib's
ALGORITHMS: list[tuple[str, str, str]] = [
    ("Local", "local", "htfllib"),
    ("FedProto", "fedproto", "htfllib"),
    ("FedTGP", "fedtgp", "htfllib"),
    ("FedGH", "fedgh", "htfllib"),
    ("LG-FedAvg", "lgfedavg", "htfllib"),
    ("FD", "feddistill", "htfllib"),  # HtFLlib calls FedDistill "FD"
    ("FML", "fml", "htfllib"),
    ("FedKD", "fedkd", "htfllib"),
    ("FedGen", "fedgen", "htfllib"),
    ("FedMRL", "fedmrl", "htfllib"),
    ("FedAvg", "fedavg", "pfllib"),
    ("FedBABU", "fedbabu", "pfllib"),
    ("FedPCL", "fedpcl", "pfllib"),
    ("FedPAC", "fedpac", "pfllib"),
]
HOMOGENEOUS = {"fedavg", "fedbabu", "fedpac"}  # one global model (opts.model), not a family

# Each HtFLlib algorithm's coefficients as its run script passes them (HtFLlib's system/total.sh): flag -> (the
# raysim key of the method's section in benchmarks/presets/htfllib.yaml, the value). The library's side is run with
# these flags, raysim's with the preset; tests/benchmarks/test_parity_htfllib.py checks the preset holds each value.
SCRIPT_FLAGS: dict[str, dict[str, tuple[str, float]]] = {
    "FedProto": {"-lam": ("lam", 10)},
    "FedTGP": {"-lam": ("lam", 10), "-se": ("server_epochs", 100), "-mart": ("margin_threshold", 100)},
    "FedGH": {"-slr": ("server_lr", 0.01)},
    "FD": {"-lam": ("lam", 1)},
    "FML": {"-al": ("alpha", 0.5), "-bt": ("beta", 0.5)},
    "FedKD": {"-mlr": ("mentee_lr", 0.01), "-Ts": ("T_start", 0.95), "-Te": ("T_end", 0.98)},
    "FedGen": {"-nd": ("noise_dim", 32), "-glr": ("gen_lr", 0.1), "-hd": ("hidden_dim", 512), "-se": ("server_epochs", 100)},
    "FedMRL": {"-sfd": ("sub_dim", 128)},
}


def script_flags(algorithm: str) -> list[str]:
    """The algorithm's coefficients as HtFLlib's command-line flags (SCRIPT_FLAGS), e.g. ["-lam", "10"]."""
    return [a for flag, (_, v) in SCRIPT_FLAGS.get(algorithm, {}).items() for a in (flag, f"{v:g}")]
ACC_LINE = re.compile(r"Averaged Test Accurac?n?cy:\s*([0-9.]+)")  # HtFLlib / PFLlib print "Accurancy"


# ------------------------------------------------------------------------------------ the offline folder
def make_mnist_like(out: str | Path, *, clients: int = 20, alpha: float = 0.1, seed: int = 0) -> Path:
    """A PFLlib-format folder like HtFLlib's shipped MNIST one, offline: scikit-learn's digits upsampled to
    one channel at 28x28, normalised as PFLlib's MNIST generator does (Normalize([0.5], [0.5])), the
    train and test sets pooled and split by PFLlib's Dirichlet procedure (alpha 0.1, every client at least
    `least` samples) and each client 75 / 25 into train / test, written with PFLlib's save_file layout."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    from raysim.data.partition import PFLLIB_TRAIN_SHARE, pfllib_dirichlet
    from raysim.data.pfllib_folder import write_folder

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]
    x = torch.nn.functional.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False).clamp(0, 1)
    x = ((x - 0.5) / 0.5).numpy()
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    train, test = [], []
    for idx in pfllib_dirichlet(y, clients, alpha, least=8, rng=rng):
        idx = rng.permutation(idx)
        n = int(np.floor(PFLLIB_TRAIN_SHARE * len(idx)))
        train.append((x[idx[:n]], y[idx[:n]]))
        test.append((x[idx[n:]], y[idx[n:]]))
    return write_folder(out, train, test, num_classes=10, extra={
        "non_iid": True, "balance": False, "partition": "dir", "alpha": alpha, "batch_size": 10,
        "raysim": {"made_by": "benchmarks/parity_htfllib.py --make-mnist-like", "source": "sklearn digits at 28x28", "seed": seed},
    })


# ------------------------------------------------------------------------------------ raysim's side
def raysim_side(folder: str, method: str, *, family: str, rounds: int, out_dir: Path, seed: int = 0,
                overrides: Optional[dict[str, Any]] = None, preset: Path = PRESET) -> list[float]:
    """raysim's per-round pooled test accuracy (total correct / total test samples) of `method` on the folder."""
    from raysim.build import build_config
    from raysim.config import load_config_file, merge_config
    from raysim.engine.loop import run
    from raysim.protocols import fedtsp_round_metrics

    section: dict[str, Any] = {"model": _single_model(family)} if method in HOMOGENEOUS else {"model_family": family}
    if method == "fedpcl":
        section = {"model_family": family}
    values = merge_config(load_config_file(preset), {
        "method": method,
        "data": {"dataset": "pfllib", "data_root": folder},
        "train": {"rounds": rounds, "seed": seed},
        "execution": {"backend": "inline", "device": "auto"},
        "output": {"progress": False, "tensorboard": False, "out_dir": str(out_dir / method)},
        method: section,
    })
    cfg = build_config(merge_config(values, overrides or {}))
    res = run(cfg)
    per_round = fedtsp_round_metrics(res.out_dir / "client_results.csv")
    return [per_round[r]["local"] for r in sorted(per_round)]


def _single_model(family: str) -> str:
    from raysim.models.zoo import family as archs

    models = archs(family)
    return models[0]  # a homogeneous method trains one model: the family's first (client 0's)


# ------------------------------------------------------------------------------------ the library's side
def library_side(lib: str, checkout: Path, python: str, folder: str, algorithm: str, *, family: str, rounds: int,
                 num_clients: int, num_classes: int, timeout: float) -> list[float]:
    """The library's per-round test accuracy, each point after r rounds of training (r = 1 .. rounds)."""
    name = "raysim_" + Path(folder).resolve().name
    if lib == "pfllib":  # PFLlib's "-m CNN" picks FedAvgCNN's input from the dataset's name
        shape = _sample_shape(folder)
        prefix = {(1, 28, 28): "MNIST_", (3, 32, 32): "Cifar10_"}.get(shape)
        if prefix is None:
            raise RuntimeError(f"PFLlib's CNN takes 1x28x28 (MNIST) or 3x32x32 (Cifar10) input, the folder holds {shape}")
        name = prefix + name
    link = checkout / "dataset" / name
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(Path(folder).resolve(), link)
    cmd = [python, "main.py", "-data", name, "-ncl", str(num_classes), "-algo", algorithm, "-gr", str(rounds),
           "-nc", str(num_clients), "-lbs", "10", "-lr", "0.01", "-ls", "1", "-jr", "1", "-fd", "512", "-eg", "1",
           "-dev", "cuda" if _has_cuda() else "cpu"]
    cmd += ["-m", family] if lib == "htfllib" else ["-m", "CNN"]
    cmd += script_flags(algorithm) if lib == "htfllib" else []
    proc = subprocess.run(cmd, cwd=checkout / "system", capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    accs = [float(m.group(1)) for m in ACC_LINE.finditer(proc.stdout)]
    return accs[1:]  # its first evaluation is before any training


def _sample_shape(folder: str) -> tuple[int, ...]:
    """The shape of one sample of the folder (client 0's first training row)."""
    from raysim.data.pfllib_folder import read_folder

    return tuple(int(n) for n in read_folder(folder).train[0][0].shape[1:])


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------------ the table
def best(curve: list[float]) -> tuple[float, int]:
    """(best accuracy, its 1-based round; the earliest of equal bests), (nan, 0) for an empty curve."""
    finite = [(a, i) for i, a in enumerate(curve) if math.isfinite(a)]
    if not finite:
        return math.nan, 0
    a, i = max(finite, key=lambda t: (t[0], -t[1]))
    return a, i + 1


def table(rows: list[dict[str, Any]]) -> str:
    def pct(v: float) -> str:
        return f"{100 * v:.2f}" if math.isfinite(v) else "-"

    lines = ["| Algorithm | raysim method | raysim best | round | library best | round | difference |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ra, rr = best(r["raysim"])
        la, lr = best(r["library"]) if r["library"] else (math.nan, 0)
        diff = ra - la if math.isfinite(ra) and math.isfinite(la) else math.nan
        lib = pct(la) if r["library"] else r.get("missing", "-")
        lines.append(f"| {r['algorithm']} | {r['method']} | {pct(ra)} | {rr or '-'} | {lib} | {lr or '-'} | "
                     f"{pct(diff) if math.isfinite(diff) else '-'} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(rows)
    cols = min(4, n)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(4 * cols, 3 * ((n + cols - 1) // cols)), squeeze=False)
    for ax, r in zip(axes.flat, rows):
        ax.plot(range(1, len(r["raysim"]) + 1), [100 * a for a in r["raysim"]], label="raysim")
        if r["library"]:
            ax.plot(range(1, len(r["library"]) + 1), [100 * a for a in r["library"]], label=r["lib"])
        ax.set_title(r["algorithm"])
        ax.set_xlabel("round")
        ax.set_ylabel("pooled test accuracy (%)")
        ax.legend()
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    sys.path.insert(0, str(ROOT))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make-mnist-like", metavar="DIR", help="write the offline MNIST-like PFLlib folder to DIR and exit")
    p.add_argument("--folder", help="the PFLlib / HtFLlib dataset folder both sides train on")
    p.add_argument("--family", default="HtFE-img-2", help="the model family (FedAvgCNN-1x28 for one channel at 28x28)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--algorithms", default="", help="comma-separated library names (default: all of ALGORITHMS)")
    p.add_argument("--htfllib", type=Path, help="an HtFLlib checkout (runs its side of the HtFLlib algorithms)")
    p.add_argument("--pfllib", type=Path, help="a PFLlib checkout (runs its side of the PFLlib algorithms)")
    p.add_argument("--python", default="", help="the Python that runs the checkouts (default: this one)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per library run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("parity_out"))
    p.add_argument("--preset", type=Path, default=PRESET, help="raysim's run config (default: benchmarks/presets/htfllib.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config keys applied to every raysim run (fedproto.lam=10)")
    args = p.parse_args(argv)
    if args.make_mnist_like:
        print(f"wrote {make_mnist_like(args.make_mnist_like)}")
        return 0
    if not args.folder:
        p.error("--folder is required (or --make-mnist-like DIR to make one)")
    from raysim.data.pfllib_folder import read_config
    from raysim.errors import RaysimError

    try:
        folder_cfg = read_config(args.folder)
    except RaysimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from raysim.config import parse_overrides

    try:
        overrides = parse_overrides(args.overrides)
    except RaysimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wanted = {a.strip().lower() for a in args.algorithms.split(",") if a.strip()}
    chosen = [a for a in ALGORITHMS if not wanted or a[0].lower() in wanted or a[1] in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    python = args.python or sys.executable
    rows = []
    for algorithm, method, lib in chosen:
        print(f"[raysim] {algorithm} ({method}) ...", flush=True)
        row: dict[str, Any] = {"algorithm": algorithm, "method": method, "lib": lib, "library": []}
        row["raysim"] = raysim_side(args.folder, method, family=args.family, rounds=args.rounds,
                                    out_dir=args.out / "raysim", seed=args.seed, overrides=overrides, preset=args.preset)
        checkout = args.htfllib if lib == "htfllib" else args.pfllib
        if checkout is None:
            row["missing"] = f"no --{lib} checkout"
        elif lib == "htfllib" and args.family.lower() not in {f"htfe-img-{n}" for n in (2, 3, 4, 5, 8, 9)}:
            row["missing"] = f"{args.family} is raysim's; HtFLlib has HtFE-img-2..9"
        else:
            print(f"[{lib}] {algorithm} ...", flush=True)
            try:
                row["library"] = library_side(lib, checkout, python, args.folder, algorithm, family=args.family,
                                              rounds=args.rounds, num_clients=int(folder_cfg["num_clients"]),
                                              num_classes=int(folder_cfg["num_classes"]), timeout=args.timeout)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                row["missing"] = f"{lib} run failed: {str(e)[:120]}"
        rows.append(row)
    text = table(rows)
    missing = sorted({r["missing"] for r in rows if r.get("missing")})
    header = (f"Parity on {args.folder} ({folder_cfg['num_clients']} clients), family {args.family}, {args.rounds} rounds, "
              f"raysim with {args.preset}{' ' + ' '.join(args.overrides) if args.overrides else ''}; pooled test accuracy (%) "
              "at the best round (1-based)\n\n")
    (args.out / "parity.md").write_text(header + text + "".join(f"\nmissing: {m}" for m in missing) + "\n")
    (args.out / "parity.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "parity.png")
    print(header + text)
    for m in missing:
        print(f"missing: {m} (give --htfllib / --pfllib CHECKOUT and --python PY to run the other side)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
