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
from raysim.build import build_config
from raysim.engine.loop import run
out, report = sys.argv[1], sys.argv[2]
seen = {}
def after(row):
    if not seen:
        pids = descendants(os.getpid())
        # the whole command line: the checkout's path can be long (a clone under /check/... pushed
        # ".../ray/gcs/gcs_server" past an 80-character cut, and the test failed in CI alone)
        names = {p: open(f"/proc/{p}/cmdline").read().replace("\\0", " ") for p in pids if os.path.exists(f"/proc/{p}")}
        environ = {p: dict(kv.split("=", 1) for kv in open(f"/proc/{p}/environ").read().split("\\0") if "=" in kv)
                   for p in names if names[p].split(" ")[1:2] and names[p].split(" ")[1].endswith("dashboard/dashboard.py")}
        seen.update(pids=sorted(pids), names=names, sockets=listening(pids), environ=environ)
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
    # the dashboard is off unless asked for: Ray still runs its head process, with no web frontend, loading
    # only the usage-stats module, and that report is off (nothing leaves the machine)
    heads = [pid for pid, n in names.items() if n.split(" ")[1:2] and n.split(" ")[1].endswith("dashboard/dashboard.py")]
    assert heads, "the dashboard's head process was not seen: the listing is broken"
    for pid in heads:
        assert "--disable-frontend" in names[pid] and "--modules-to-load=UsageStatsHead" in names[pid], names[pid]
        assert seen["environ"][str(pid)].get("RAY_USAGE_STATS_ENABLED") == "0"
    deadline = time.monotonic() + 120  # Ray's processes exit as the driver shuts the cluster down
    left = [pid for pid in seen["pids"] if alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = [pid for pid in seen["pids"] if alive(pid)]
    assert left == [], {pid: names.get(pid) for pid in left}


# a Ray-backend run on a new local cluster, slowed so that the test can kill its driver mid-run
KILLED = """
import sys, time
from raysim.build import build_config
from raysim.engine.loop import run
out, cache, resume = sys.argv[1], sys.argv[2], sys.argv[3]
def slow(row):
    time.sleep(3)
cfg = build_config({"method": "promptfl", "data": {"dataset": "digits", "shots": 4},
                    "model": {"name": "raysim-tiny", "pretrained": ""},
                    "train": {"n_ctx": 4, "ctx_init": "", "num_clients": 2, "rounds": 3, "batch_size": 16},
                    "execution": {"backend": "ray", "address": "local", "num_actors": 2, "client_cpus": 0.5},
                    "output": {"progress": False, "tensorboard": False, "out_dir": out, "cache_dir": cache,
                               "resume": resume}})
run(cfg, on_round=slow)
"""


def test_kill_9_of_the_driver_leaves_no_process_and_the_run_resumes(tmp_path, cache_dir):
    from sockets import descendants

    out = tmp_path / "run"
    driver = subprocess.Popen([sys.executable, "-c", KILLED, str(out), cache_dir, ""], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (out / "results.csv").is_file() or len((out / "results.csv").read_text().splitlines()) < 2:
            assert driver.poll() is None, driver.stderr.read()[-3000:] if driver.stderr else ""
            assert time.monotonic() < deadline, "round 0 never finished"
            time.sleep(0.5)
        time.sleep(2)  # the reaper records the tree every second: let it see the whole cluster
        tree = {p: _cmd(p) for p in descendants(driver.pid) if p != driver.pid}
        ray_procs = [p for p, cmd in tree.items() if "ray" in cmd and "raysim.engine.reaper" not in cmd]
        assert any("raylet" in tree[p] for p in ray_procs) and any("ray::" in tree[p] for p in ray_procs)  # the cluster, seen
        driver.kill()  # SIGKILL: no atexit, no ray.shutdown
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    deadline = time.monotonic() + 60  # the reaper: SIGTERM at once, SIGKILL 5 s later
    left = [p for p in ray_procs if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = [p for p in ray_procs if alive(p)]
    assert left == [], {p: tree[p][:100] for p in left}
    resumed = subprocess.run([sys.executable, "-c", KILLED, str(out), cache_dir, str(out)], env=ENV,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rounds = [line.split(",")[0] for line in (out / "results.csv").read_text().splitlines()[1:]]
    assert rounds == ["0", "1", "2"]


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
