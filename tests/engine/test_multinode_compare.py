"""`raysim compare` on a 2-node local cluster (the nodes of tests/engine/test_multinode.py: separate `ray
start` processes, 1 CPU each, token authentication): two inline runs of one CPU each, at once, go one to
each node. The driver runs in a subprocess, as there (this test neither joins nor disturbs `ray_session`)."""

from __future__ import annotations

import re
import subprocess
import sys

from test_multinode import ROOT, two_nodes, with_one_retry  # noqa: F401 (the fixture: a head and a worker node, stopped by pid)

DRIVER = r"""
import sys, time
import ray
address, out, cache_dir = sys.argv[1:4]
ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=False)
deadline = time.time() + 90
while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.time() < deadline:
    time.sleep(1)
print("NODES", sorted(n["NodeID"][:12] for n in ray.nodes() if n["Alive"]), flush=True)
ray.shutdown()
from raysim.tools.compare import main
sys.exit(main(["--methods", "zeroshot,promptfl", "--rounds", "1", "--out", out, "--max-concurrent", "2",
               "data.dataset=digits", "data.shots=8", "model.name=raysim-tiny", "model.pretrained=",
               "train.num_clients=2", "train.n_ctx=4", "execution.backend=inline", "execution.num_threads=1",
               f"execution.address={address}", f"output.cache_dir={cache_dir}", "output.tensorboard=false"]))
"""


def test_a_concurrent_table_uses_both_nodes(two_nodes, tmp_path, cache_dir):  # noqa: F811
    """Two runs, 1 CPU each, at once on two `ray start` nodes of 1 CPU: one on each (by the node ids the
    command logs for every finished run)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    # the machine's failures (a hung driver: stop 49's CI, under load, past 420 s of a run that takes ~25 s
    # alone; a lost node) get one retry on fresh nodes, as in test_multinode.py; a second one fails the test
    proc, attempt = with_one_retry(two_nodes, lambda a: subprocess.run(
        [sys.executable, str(script), two_nodes.address, str(tmp_path / f"cmp{a}"), cache_dir],
        cwd=ROOT, env=two_nodes.env, capture_output=True, text=True, timeout=300), "multinode compare")
    out = tmp_path / f"cmp{attempt}"
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}\n{two_nodes.logs()}"
    nodes = re.search(r"NODES \[(.*)\]", proc.stdout).group(1).replace("'", "").split(", ")
    used = re.findall(r"done\] .* on node (\w+) ->", proc.stderr)
    assert len(nodes) == 2 and len(used) == 2 and sorted(used) == sorted(nodes), (nodes, proc.stderr[-3000:])
    assert (out / "table.md").is_file()
