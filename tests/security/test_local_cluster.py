"""A cluster raysim starts itself is private: every process of a local Ray run listens on loopback only,
the dashboard is off, and the processes are gone once the run ends. One Ray run (slow: a cluster of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sockets import is_loopback

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=f"{ROOT}:{Path(__file__).parent}")

# the driver: a Ray-backend run on a new local cluster that, after round 0 (every actor up), lists the
# listening sockets of its whole process tree (the GCS, raylet, agents, actors, itself)
DRIVER = """
import json, os, sys
from sockets import descendants, listening
from raysim.config.checks import build_config
from raysim.engine.loop import run
out, report = sys.argv[1], sys.argv[2]
seen = {}
def after(row):
    if not seen:
        pids = descendants(os.getpid())
        names = {p: open(f"/proc/{p}/cmdline").read().replace("\\0", " ")[:80] for p in pids if os.path.exists(f"/proc/{p}")}
        seen.update(pids=sorted(pids), names=names, sockets=listening(pids))
cfg = build_config({"method": "promptfl", "data": {"dataset": "digits", "shots": 4},
                    "model": {"name": "raysim-tiny", "pretrained": ""},
                    "train": {"n_ctx": 4, "ctx_init": "", "num_clients": 2, "rounds": 2, "batch_size": 16},
                    "execution": {"backend": "ray", "address": "local", "num_actors": 2, "client_cpus": 0.5},
                    "output": {"progress": False, "tensorboard": False, "out_dir": out, "cache_dir": sys.argv[3]}})
run(cfg, on_round=after)
json.dump(seen, open(report, "w"))
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_local_ray_run_listens_only_on_loopback_and_leaves_no_process(tmp_path, cache_dir):
    report = tmp_path / "sockets.json"
    p = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "run"), str(report), cache_dir],
                       env=ENV, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    seen = json.loads(report.read_text())
    names = {int(k): v for k, v in seen["names"].items()}
    assert any("gcs_server" in n for n in names.values()) and any("raylet" in n for n in names.values())  # Ray's own, seen
    assert seen["sockets"], "no listening socket found: the listing itself is broken"
    exposed = [(pid, proto, addr, names.get(pid, "?")) for pid, proto, addr in seen["sockets"] if not is_loopback(addr)]
    assert exposed == []
    assert not any("dashboard/dashboard.py" in n for n in names.values())  # the dashboard is off unless asked for
    deadline = time.monotonic() + 120  # Ray's processes exit as the driver shuts the cluster down
    left = [pid for pid in seen["pids"] if alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = [pid for pid in seen["pids"] if alive(pid)]
    assert left == [], {pid: names.get(pid) for pid in left}
