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
import sys
from typing import Optional, Sequence

USAGE = "raysim export-pfllib OUT [--config F] [--image-size S] [key=value ...]"


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
    return str(write_folder(out, train, test, num_classes=len(fed.classnames), extra=extra))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from raysim.errors import RaysimError

    p = argparse.ArgumentParser(prog="raysim export-pfllib", usage=USAGE,
                                description="Write a raysim split (any dataset and partition, with its seed) as a PFLlib folder.")
    p.add_argument("out", help="the folder to write (new or empty)")
    p.add_argument("--config", default=None, help="a run config file (YAML)")
    p.add_argument("--image-size", type=int, default=32, help="side of the square images written (default 32)")
    p.add_argument("overrides", nargs="*", help="key=value overrides (data.dataset=digits data.partition=dirichlet ...)")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        from raysim.config.checks import config_from_cli
        from raysim.errors import ConfigError

        if args.image_size < 16:
            raise ConfigError(f"--image-size must be at least 16 (the zoo's smallest input), got {args.image_size}")
        cfg = config_from_cli(args.config, args.overrides)
        if cfg.data.dataset == "pfllib":
            raise ConfigError("data.dataset=pfllib is already a PFLlib folder; copy it instead of exporting it")
        out = export_split(cfg, args.out, image_size=args.image_size)
    except RaysimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        from raysim.errors import os_error_line

        print(f"error: {os_error_line(e, args.out)}", file=sys.stderr)
        return 2
    print(f"wrote {cfg.train.num_clients} clients of {cfg.data.dataset} ({cfg.data.partition}, seed {cfg.train.seed}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
