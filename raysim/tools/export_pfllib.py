"""`raysim export-pfllib OUT [--config F] [--image-size S] [key=value ...]`: write a raysim split as a PFLlib /
HtFLlib dataset folder, so those libraries train on exactly raysim's clients.

The split is the one a run with the same config trains on (`prepare_data`: data.dataset, data.partition,
data.beta, train.num_clients, train.seed, data.shots, ...), and each client's rows are written as the
image methods see them: (N, 3, S, S) float32 at --image-size S (default 32, the zoo's input), normalised as
raysim normalises them (CLIP's mean and std), in the split's row order. config.json records PFLlib's keys
plus `raysim` (the dataset, partition, seed and image size that made it). `data.dataset=pfllib` reads the
folder back unchanged (tests/data/test_pfllib_folder.py round-trips it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from raysim.errors import DataError

USAGE = "raysim export-pfllib OUT [--config F] [--image-size S] [key=value ...]"
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 16, 512  # the zoo's smallest input; 512 already holds 256x the floats of 32


def write_atomically(out: str | Path, write: Callable[[Path], Any]) -> Path:
    """`write(tmp)` fills a new temporary folder beside `out` (same file system), which is then renamed to
    `out`: a failure part-way (a full disk, Ctrl-C) leaves no half-written `out` to block a re-run, and the
    temporary folder goes too. `out` must not exist, or be an empty folder (it is replaced)."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} exists and is not an empty folder; export into a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if out.is_dir():
            out.rmdir()  # empty (checked above); a rename needs the name free
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_split(cfg, out: str, *, image_size: int = 32) -> str:
    """Write the split `cfg` describes to the PFLlib folder `out`; returns the folder."""
    from raysim.data.pfllib_folder import write_folder
    from raysim.data.prepare import prepare_data
    from raysim.methods.base import Needs

    fed = prepare_data(cfg, Needs(input="images", image_size=image_size), progress=False)
    train = [(fed.x_train[i], fed.y_train[i]) for i in fed.train_idx]
    test = [(fed.x_test[i], fed.y_test[i]) for i in fed.test_idx]
    extra = {
        "non_iid": cfg.data.partition != "iid",
        "partition": cfg.data.partition,
        "alpha": cfg.data.beta if cfg.data.partition in ("dirichlet", "domain", "pfllib") else None,
        "classnames": list(fed.classnames),
        "raysim": {
            "dataset": cfg.data.dataset, "data_root": cfg.data.data_root, "partition": cfg.data.partition,
            "beta": cfg.data.beta, "shots": cfg.data.shots, "min_samples": cfg.data.min_samples,
            "num_clients": cfg.train.num_clients, "seed": cfg.train.seed, "image_size": image_size,
            "normalisation": "CLIP mean/std (raysim.data.base.CLIP_MEAN / CLIP_STD)",
        },
    }
    return str(write_atomically(out, lambda tmp: write_folder(tmp, train, test, num_classes=len(fed.classnames), extra=extra)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from raysim.errors import RaysimError

    p = argparse.ArgumentParser(prog="raysim export-pfllib", usage=USAGE,
                                description="Write a raysim split (any dataset and partition, with its seed) as a PFLlib folder.")
    p.add_argument("out", help="the folder to write (new or empty)")
    p.add_argument("--config", default=None, help="a run config file (YAML)")
    p.add_argument("--image-size", type=int, default=32,
                   help=f"side of the square images written, {MIN_IMAGE_SIZE} to {MAX_IMAGE_SIZE} (default 32)")
    p.add_argument("overrides", nargs="*", help="key=value overrides (data.dataset=digits data.partition=dirichlet ...)")
    args = p.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))  # OUT --image-size S k=v works too
    try:
        from raysim.build import config_from_cli
        from raysim.errors import ConfigError

        if not MIN_IMAGE_SIZE <= args.image_size <= MAX_IMAGE_SIZE:
            raise ConfigError(f"--image-size must be between {MIN_IMAGE_SIZE} (the zoo's smallest input) and {MAX_IMAGE_SIZE} "
                              f"(every image is held in memory as 3 x S x S floats), got {args.image_size}")
        cfg = config_from_cli(args.config, args.overrides)
        if cfg.data.dataset == "pfllib":
            raise ConfigError("data.dataset=pfllib is already a PFLlib folder; copy it instead of exporting it")
        out = export_split(cfg, args.out, image_size=args.image_size)
    except RaysimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        from raysim.errors import os_error_line

        print(f"error: {os_error_line(e, args.out, again=True)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: nothing was written to {args.out}; run the command again", file=sys.stderr)
        return 130
    print(f"wrote {cfg.train.num_clients} clients of {cfg.data.dataset} ({cfg.data.partition}, seed {cfg.train.seed}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
