"""A shared helper of the zoo baselines' end-to-end tests (test_fedtsp_baselines_a.py / _b.py): a short
run on digits on the Ray backend with every upload recorded. Not a test module (no test_ prefix); the
tests import it by name (pytest puts this folder on sys.path)."""

from __future__ import annotations

import csv
from typing import Any


def ray_zoo_run(tmp_path, name: str, section: dict[str, Any], *, out: str, num_actors: int):
    """Two rounds, three clients, Dirichlet 0.5 on digits, the raysim-tiny model, eval every round, on Ray
    with `num_actors` actors and `record_uploads`; returns the RunResult and the rows of client_results.csv."""
    from raysim.build import build_config
    from raysim.engine.loop import run

    cfg = build_config({
        "method": name,
        "data": {"dataset": "digits", "partition": "dirichlet", "beta": 0.5, "shots": 0},
        "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"num_clients": 3, "rounds": 2, "batch_size": 32},
        "eval": {"every": 1},
        "execution": {"backend": "ray", "num_actors": num_actors},
        "output": {"out_dir": str(tmp_path / out), "progress": False, "tensorboard": False, "cache_dir": str(tmp_path / "c"),
                   "record_uploads": True},
        name: section,
    })
    res = run(cfg)
    with open(res.out_dir / "client_results.csv") as f:
        return res, list(csv.DictReader(f))
