"""The multi-node path, for real on one machine: a Ray head and a second worker node, started as separate
`ray start` processes with their own temp dir, ports and custom resources ({"head_node": 1} and
{"worker_node": 1}, 1 CPU each), token authentication on (Ray 2.60's default for clusters). A small
federation and a small sweep run against it through `address=`, and the client actors must have been
placed on both nodes.

The driver runs in a subprocess: Ray reads RAY_AUTH_MODE / RAY_AUTH_TOKEN when it is imported, and the
test session may already hold its own local cluster (tests/conftest.py `ray_session`), which this test
neither joins nor disturbs. The two nodes are stopped by process id in the fixture's teardown (never with
`ray stop`, which would stop every Ray process on the machine).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT),
               # The GCS marks a node dead after 5 failed health checks of 10 s, 3 s apart (Ray's defaults). On the
               # 2-core CI machine, with the other test worker and its own cluster busy, a raylet can miss that
               # window: 20 checks of 30 s. What this test checks is placement on two nodes, not failure detection.
               RAY_health_check_timeout_ms="30000", RAY_health_check_failure_threshold="20")
    return env


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM the `ray start --block` process (it stops its node), then SIGKILL its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything of this node still alive (own session, own group)
    except (ProcessLookupError, PermissionError):
        pass


class TwoNodes:
    """A head and a worker node (`ray start --block`, own temp dir and ports, token auth), restartable."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(32)
        self.env = node_env(self.token)
        self.procs: list[subprocess.Popen] = []
        self.tmp = ""
        self.address = ""

    def start(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="rsmn", dir="/tmp")  # short: Ray's unix socket paths must fit 107 chars
        port = free_port()
        self.address = f"127.0.0.1:{port}"

        def ports(*names: str) -> list[str]:
            return [f"--{n}={free_port()}" for n in names]

        def common() -> list[str]:  # every node needs its own agent ports (defaults would clash with other clusters)
            return ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats",
                    *ports("dashboard-agent-listen-port", "metrics-export-port", "runtime-env-agent-port")]

        head_cmd = [RAY, "start", "--head", f"--port={port}", f"--temp-dir={self.tmp}", "--include-dashboard=false",
                    '--resources={"head_node": 1}', *ports("ray-client-server-port", "dashboard-port"), *common()]
        worker_cmd = [RAY, "start", f"--address={self.address}", '--resources={"worker_node": 1}', *common()]
        for name, cmd in (("head", head_cmd), ("worker", worker_cmd)):
            with open(os.path.join(self.tmp, f"{name}.log"), "w") as log:
                self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
            if name == "head":
                deadline = time.time() + 60
                while not os.path.exists(os.path.join(self.tmp, "session_latest")) and time.time() < deadline:
                    assert self.procs[0].poll() is None, Path(self.tmp, "head.log").read_text()
                    time.sleep(0.5)
                time.sleep(2)

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop(p)
        self.procs = []
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def logs(self, chars: int = 3000) -> str:
        """What `ray start` printed for each node (`ray start --block` ends the whole node when one of its
        processes dies, and says which), with the tails of the raylet and GCS logs."""
        out = [f"--- {name}.log (ray start; exited: {p.poll()})\n{Path(self.tmp, f'{name}.log').read_text(errors='replace')[-chars:]}"
               for name, p in zip(("head", "worker"), self.procs)]
        return "\n".join(out + [node_logs(self.tmp, chars)])


@pytest.fixture(scope="module")
def two_nodes():
    nodes = TwoNodes()
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


DRIVER = r"""
import faulthandler, json, os, sys, threading, time, math
T0 = time.time()
def tick(msg): print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)
import ray
from ray._private.state import state

def watchdog(after=float(os.environ.get("RAYSIM_TEST_WATCHDOG_S", "240"))):
    # a run still going after `after` s (60-130 s is usual here) prints, to stderr, where every thread is and
    # what the cluster holds (placement groups and actors by state), so a hang says where it is
    time.sleep(after)
    print(f"[{time.time() - T0:6.1f}s] WATCHDOG: still running; threads:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)
    try:
        if ray.is_initialized():
            pgs = [(p.get("state"), p.get("bundles")) for p in state.placement_group_table().values()]
            actors = [(a["ActorClassName"], a["State"], a["JobID"]) for a in state.actor_table(None).values()]
            print("WATCHDOG placement groups:", pgs, "\nWATCHDOG actors:", actors, file=sys.stderr, flush=True)
    except Exception as e:
        print("WATCHDOG: no cluster state:", repr(e), file=sys.stderr, flush=True)
threading.Thread(target=watchdog, daemon=True).start()

address, storage, cache_dir, out_dir = sys.argv[1:5]

def client_actor_nodes():
    rows = state.actor_table(None).values()
    out = {}
    for a in rows:
        if a["ActorClassName"].endswith("ClientHost"):
            out.setdefault(a["JobID"], set()).add(a["Address"]["NodeID"])
    return {k: sorted(v) for k, v in out.items()}

# wait until both nodes have joined (the worker registers a few seconds after the head)
ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=False)
deadline = time.time() + 90
while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.time() < deadline:
    time.sleep(1)
nodes = {n["NodeID"]: sorted(k for k in n["Resources"] if k.endswith("_node")) for n in ray.nodes() if n["Alive"]}
earlier = set(client_actor_nodes())  # jobs of an earlier driver on these nodes (a retried test): not this sweep's
ray.shutdown()
assert len(nodes) == 2, nodes
tick("two nodes up")

# 1. one federation through address=: RayBackend connects itself; 2 client actors x 1 CPU on 2 nodes x 1 CPU
from raysim.build import build_config
from raysim.engine.loop import run
seen = {}
def on_round(row):
    seen.update(client_actor_nodes())  # while the federation's actors are alive
cfg = build_config(dict(method="promptfl", data={"dataset": "digits"}, model={"name": "raysim-tiny", "pretrained": ""},
                        train={"ctx_init": "", "num_clients": 2, "rounds": 2}, eval={"every": 1, "last": 1},
                        execution={"backend": "ray", "placement": "actor_per_client", "client_cpus": 1, "address": address},
                        output={"progress": False, "cache_dir": cache_dir, "out_dir": out_dir}))
result = run(cfg, on_round=on_round)
tick("federation done")
fed = {"summary": result.summary, "info": result.info, "actor_nodes": seen}

# 2. a small sweep through address= (run_sweep connects itself): 2 trials, one client actor each
from raysim.tools.sweep import load_sweep, run_sweep
spec = load_sweep("sweeps/smoke.yaml", [f"storage={storage}", "name=multinode", f"execution.address={address}",
                                        f"output.cache_dir={cache_dir}", "train.num_clients=2"])
spec["space"] = {"train.seed": {"grid": [1, 2]}}
df = run_sweep(spec, verbose=0)
tick("sweep done")
ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=False)
all_jobs = client_actor_nodes()
ray.shutdown()
sweep_nodes = sorted({n for job, ns in all_jobs.items() if job not in seen and job not in earlier for n in ns})
print("RESULT " + json.dumps({"nodes": nodes, "fed": fed, "sweep_rows": json.loads(df.to_json(orient="records")),
                             "sweep_errors": df.attrs["num_errors"], "sweep_nodes": sweep_nodes}), flush=True)
tick("exiting")
"""


def node_logs(tmp: str, chars: int = 3000) -> str:
    """The tails of the two nodes' raylet and GCS logs (what a hang's report needs besides the driver's)."""
    out = []
    for path in sorted(Path(tmp).glob("session_*/logs/*")):
        if path.name.startswith(("raylet", "gcs_server")) and path.suffix in (".out", ".err") and path.stat().st_size:
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
    return "\n".join(out)


def drive(two_nodes, tmp_path, cache_dir) -> subprocess.CompletedProcess:
    tmp_path.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    return subprocess.run(
        [sys.executable, str(script), two_nodes.address, str(tmp_path / "sweeps"), cache_dir, str(tmp_path / "run")],
        cwd=ROOT, env=two_nodes.env, capture_output=True, text=True, timeout=360,
    )


NODE_LOST = ("has been marked dead", "Raylet is terminated", "ActorDiedError")  # a node went, not a wrong result


def with_one_retry(two_nodes, attempt_run, what: str) -> tuple[subprocess.CompletedProcess, int]:
    """`attempt_run(attempt)` (a driver subprocess), given one retry on fresh nodes when the machine failed it:
    the driver hung past its timeout, or a node was lost (NODE_LOST). The first failure is a warning with the
    driver's output and the nodes' logs; a second one, or any other failure, is the caller's to assert on.
    Returns the last attempt's process and its number (1 or 2)."""
    text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
    for attempt in (1, 2):
        try:
            proc = attempt_run(attempt)
        except subprocess.TimeoutExpired as e:
            if attempt == 2:
                raise AssertionError(f"{what}: the driver hung twice\n{text(e.stdout)[-3000:]}\n{text(e.stderr)[-6000:]}\n"
                                     f"{two_nodes.logs()}") from None
            warnings.warn(f"{what}: the driver timed out once; retrying on fresh nodes.\nstdout:\n{text(e.stdout)[-3000:]}\n"
                          f"stderr:\n{text(e.stderr)[-8000:]}\nnode logs:\n{two_nodes.logs()}", stacklevel=2)
        else:
            lost = proc.returncode != 0 and any(m in proc.stdout + proc.stderr for m in NODE_LOST)
            if not lost or attempt == 2:
                return proc, attempt
            warnings.warn(f"{what}: a node was lost once; retrying on fresh nodes.\nstdout:\n{proc.stdout[-3000:]}\n"
                          f"stderr:\n{proc.stderr[-8000:]}\nnode logs:\n{two_nodes.logs()}", stacklevel=2)
        two_nodes.stop()
        two_nodes.start()
    raise AssertionError("unreachable")  # pragma: no cover


def test_federation_and_sweep_on_two_nodes(two_nodes, tmp_path, cache_dir):
    # Two failures of the machine, not of raysim, get one retry each, on fresh nodes: (1) stop 36, the driver
    # printed the sweep's start and nothing after it for 400 s of a 420 s limit (not reproduced in 8 runs here);
    # (2) stop 42, the worker node's raylet ended 12 s into the federation and the GCS marked the node dead,
    # on a 2-core CI machine under load (alone here the test passes in ~45 s). Both are reported as a warning
    # with the driver's output (its watchdog says where a hang stood) and the nodes' logs; a second failure, or
    # any wrong result, fails the test.
    proc, attempt = with_one_retry(two_nodes, lambda a: drive(two_nodes, tmp_path / str(a), cache_dir), "multinode")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}\n"
                                            f"{two_nodes.logs()}")
    res = json.loads(lines[-1][len("RESULT "):])
    print("\n".join(ln for ln in proc.stdout.splitlines() if ln.startswith("[")))
    # two nodes, told apart by their custom resources
    assert sorted(r for rs in res["nodes"].values() for r in rs) == ["head_node", "worker_node"]
    # the federation ran through address= and its 2 client actors (1 CPU each) were placed on both nodes
    fed = res["fed"]
    assert fed["info"]["backend"] == "ray" and fed["info"]["hosts"] == 2 and fed["info"]["cluster_cpus"] == 2.0
    assert 0.0 <= fed["summary"]["hm"] <= 1.0
    (job_nodes,) = fed["actor_nodes"].values()
    assert sorted(job_nodes) == sorted(res["nodes"]), (job_nodes, res["nodes"])
    # the sweep's trials all completed, and their client actors also used both nodes
    assert res["sweep_errors"] == 0 and [r["status"] for r in res["sweep_rows"]] == ["completed", "completed"]
    assert sorted(res["sweep_nodes"]) == sorted(res["nodes"])
    assert (tmp_path / str(attempt) / "sweeps" / "multinode" / "trials.csv").is_file()
