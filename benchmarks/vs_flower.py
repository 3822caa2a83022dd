"""raysim against a plain loop and Flower, on the same PromptFL workload, side by side in one run.

    python benchmarks/vs_flower.py [--rounds 30] [--clients 100] [--participation 0.1] [--actors 2]
                                   [--flower-python PATH | --no-flower] [--client-by-client]

The workload (issue 17): PromptFL with a tiny random CLIP of width 64 (benchlib.BENCH_MODEL), digits split
IID over 100 clients, 10 clients per round, one SGD step per client (every client holds at most
`train.batch_size` training images: checked), no evaluation. Four loops run it, each in its own process:

    plain   a single-process loop written here: the method's own local_train and aggregate, nothing else
    inline  raysim's engine, execution.backend=inline (checkpoints, logging and all)
    ray     raysim's engine, execution.backend=ray with --actors pooled client actors
    flower  Flower's simulation engine (run_simulation, Ray backend, --actors actors of 1 CPU), the client
            doing raysim's PromptFL step with raysim's code (benchmarks/flower_app.py)

Each process starts, runs round 0 (start-up and warm-up, not timed) and then waits; the benchmark then asks
each for one round at a time, in an order that rotates every round, so that the machine's drift (other
load, frequency) falls on all four alike. A round's time is the wall clock from the request to the answer.
Printed: s/round (median over rounds 1..R-1, and the mean), and the ratio of each to the plain loop and
to Flower. Training must be the same in all four: the same clients per round, the same round losses and
the same final prompt, to 1e-5 (asserted; the run fails otherwise).

Flower: flwr 1.42 cannot be installed beside raysim's pinned environment (it requires protobuf < 7, typer <
0.21, packaging < 26, and its simulation extra pins ray 2.55.1, where raysim pins ray 2.60.0), so it is
not an extra of raysim's. It runs from a Python of its own, given by --flower-python (or the environment
variable RAYSIM_FLOWER_PYTHON): a venv that sees raysim's packages (torch, open_clip, ...) behind its own,

    python3 -m venv /opt/flwr-venv
    .venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \\
        > /opt/flwr-venv/lib/python3.11/site-packages/raysim-deps.pth
    /opt/flwr-venv/bin/pip install "flwr[simulation]==1.42.0"

(pip installs flwr's own protobuf, typer, packaging and ray 2.55.1 into that venv, which shadow raysim's
there; raysim's venv is not touched; where raysim's venv itself reaches its packages through a .pth
file, copy that file instead). This was checked with flwr 1.42.0. raysim is imported in it from this source tree. Without a Flower
Python the benchmark runs the other three and says why Flower is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
KINDS = ("plain", "inline", "ray", "flower")
LABELS = {"plain": "plain single-process loop", "inline": "raysim, backend=inline", "ray": "raysim, backend=ray",
          "flower": "Flower simulation (Ray backend)"}
TOL = 1e-5  # the same float32 computation in every loop; only summation order could differ


def workload(args: argparse.Namespace, cache: str) -> dict[str, Any]:
    """raysim's config of the peer workload (every loop builds its config from this)."""
    return {
        "method": "promptfl",
        "data": {"dataset": "digits", "partition": "iid", "shots": 0},
        "model": {"name": BENCH, "pretrained": ""},
        "train": {"num_clients": args.clients, "participation": args.participation, "rounds": args.rounds, "batch_size": 32,
                  "local_epochs": 1},
        "eval": {"every": 10**6, "last": 0},
        "execution": {"num_threads": 1, "batch_clients": not getattr(args, "client_by_client", False)},
        "output": {"progress": False, "tensorboard": False, "cache_dir": cache},
    }


# ---------------------------------------------------------------------------------------------- workers
def _channel(fd: int) -> tuple[Callable[[dict], None], Callable[[], None]]:
    """(report, wait): JSON lines to the benchmark on `fd`, and a blocking read of its next request."""
    os.set_inheritable(fd, False)  # Ray's processes started from here must not hold the pipe open
    out = os.fdopen(fd, "w", buffering=1)

    def report(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    def wait() -> None:
        line = sys.stdin.readline()
        if line.strip() != "go":
            raise SystemExit(f"worker: expected 'go', got {line!r}")

    return report, wait


def worker_plain(spec: dict, report, wait) -> None:
    import torch

    from raysim.build import build_config, env_spec, make_method
    from raysim.engine.loop import prepare_data
    from raysim.methods import Upload
    from raysim.methods.base import initial_private
    from raysim.privacy import NoDP
    from raysim.sampling import generator, participants

    torch.set_num_threads(spec["threads"])
    cfg = build_config(spec["config"])
    method = make_method(cfg)
    data = prepare_data(cfg, method.needs(), progress=False)
    env = method.build_env(env_spec(cfg, data.classnames), role="client")
    seed = cfg.train.seed
    shared = {k: v.detach().cpu() for k, v in method.init_shared(env, generator(seed, "server-init")).items()}
    clients = {cid: data.client(cid) for cid in range(cfg.train.num_clients)}
    private: dict[int, dict] = {}
    for r in range(cfg.train.rounds):
        if r > 0:
            wait()
        t0 = time.perf_counter()
        uploads, losses = [], []
        for cid in participants(seed, r, cfg.train.num_clients, cfg.train.participation):
            cd = clients[cid]
            if cid not in private:
                private[cid] = initial_private(method, env, cd, seed)
            res = method.local_train(env, shared, private[cid], cd, rng=generator(seed, "train", r, cid), privacy=NoDP())
            private[cid] = res.private
            uploads.append(Upload(cid, {k: v.detach().cpu() for k, v in res.upload.items()}, res.num_samples))
            losses.append(float(res.metrics["loss"]))
        shared = {k: v.detach().cpu() for k, v in method.aggregate(env, shared, uploads, generator(seed, "server", r)).items()}
        report({"round": r, "clients": [u.client_id for u in uploads], "losses": losses, "inner_s": time.perf_counter() - t0})
    report({"final": {k: v.tolist() for k, v in shared.items()}})


def worker_engine(spec: dict, report, wait, backend: str) -> None:
    from raysim.build import build_config
    from raysim.config import merge_config
    from raysim.engine.loop import run
    from raysim.storage.store import StateStore

    values = merge_config(spec["config"], {"execution": {"backend": backend}, "output": {"out_dir": spec["out_dir"]}})
    if backend == "ray":
        import benchlib
        import ray

        values["execution"]["num_actors"] = spec["actors"]
        os.environ["PYTHONPATH"] = benchlib.bench_pythonpath()  # the actors import benchlib (the setup hook)
        # Ray as raysim starts it (raysim.engine.cluster.init_ray), plus a hook that registers the benchmark model in
        # each worker; the engine then joins this Ray instead of starting its own (start-up is not timed)
        ray.init(num_cpus=spec["actors"], include_dashboard=False, configure_logging=False, log_to_driver=False,
                 runtime_env={"worker_process_setup_hook": "benchlib.ray_setup_hook"})
    cfg = build_config(values)
    rounds = cfg.train.rounds

    def on_round(row: dict) -> None:
        report({"round": int(row["round"]), "participants": int(row["participants"]), "loss": float(row["train_loss"]),
                "inner_s": float(row["seconds"])})
        if row["round"] < rounds - 1:
            wait()

    run(cfg, on_round=on_round)
    state = StateStore(spec["out_dir"]).load_server(rounds - 1)
    report({"final": {k: v.tolist() for k, v in state.items()}})


def worker_main(kind: str, spec: dict, fd: int) -> None:
    report, wait = _channel(fd)
    try:
        if kind == "flower":
            import flower_app  # by name: Flower's actors pickle its functions by reference

            flower_app.run(spec, report, wait)
        else:
            import benchlib

            benchlib.register_bench_model()
            if kind == "plain":
                worker_plain(spec, report, wait)
            else:
                worker_engine(spec, report, wait, kind)
    except BaseException as e:
        report({"error": f"{type(e).__name__}: {e}"})
        raise


# ------------------------------------------------------------------------------------------ the benchmark
class Worker:
    def __init__(self, kind: str, python: str, spec: dict, log_path: Path) -> None:
        self.kind, self.log_path = kind, log_path
        r, w = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p))
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", kind, "--fd", str(w), "--spec", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, pass_fds=(w,), text=True, env=env,
        )
        os.close(w)
        self.answers = os.fdopen(r)
        self.rounds: list[dict] = []
        self.seconds: list[float] = []
        self.final: dict | None = None

    def read(self) -> dict:
        line = self.answers.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text()[-3000:]
            raise SystemExit(f"{self.kind} worker ended unexpectedly (exit {self.proc.returncode}); its log ends:\n{tail}")
        msg = json.loads(line)
        if "error" in msg:
            self.proc.wait()
            raise SystemExit(f"{self.kind} worker failed: {msg['error']}; log: {self.log_path}\n{self.log_path.read_text()[-3000:]}")
        return msg

    def first_round(self) -> None:
        self.rounds.append(self.read())

    def one_round(self) -> None:
        t0 = time.perf_counter()
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        msg = self.read()
        self.seconds.append(time.perf_counter() - t0)
        self.rounds.append(msg)

    def finish(self) -> None:
        self.final = self.read()["final"]
        self.proc.wait(timeout=120)
        self.log.close()


def flower_python(args: argparse.Namespace) -> tuple[str | None, str]:
    """(the Python to run Flower with, or None; what was found)."""
    candidates = [args.flower_python or os.environ.get("RAYSIM_FLOWER_PYTHON", ""), sys.executable]
    for py in [c for c in candidates if c]:
        try:
            out = subprocess.run([py, "-c", "import flwr, flwr.simulation, ray; print(flwr.__version__, ray.__version__)"],
                                 capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            if py != sys.executable:
                return None, f"--flower-python {py} could not run: {e}"
            continue
        if out.returncode == 0:
            flwr_v, ray_v = out.stdout.split()
            return py, f"flwr {flwr_v} with ray {ray_v} ({py})"
        if py != sys.executable:
            return None, f"--flower-python {py} has no flwr[simulation]: {out.stderr.strip().splitlines()[-1:]}"
    return None, ("flwr is not installed in this Python and no --flower-python (or RAYSIM_FLOWER_PYTHON) was given; "
                  "flwr 1.42 cannot share raysim's environment (it needs protobuf < 7 and ray 2.55.1): "
                  "see this script's docstring for its own venv")


def check_same(workers: dict[str, Worker]) -> list[str]:
    """Differences in training between the loops (empty: the same clients, losses and final prompt)."""
    import numpy as np

    ref = workers["plain"]
    problems = []
    for kind, w in workers.items():
        if kind == "plain":
            continue
        for a, b in zip(ref.rounds, w.rounds):
            r = a["round"]
            if "clients" in b and b["clients"] != a["clients"]:
                problems.append(f"{kind} round {r}: clients {b['clients']} != {a['clients']}")
            if "participants" in b and b["participants"] != len(a["clients"]):
                problems.append(f"{kind} round {r}: {b['participants']} participants != {len(a['clients'])}")
            got = b["losses"] if "losses" in b else [b["loss"]]
            want = a["losses"] if "losses" in b else [float(np.mean(a["losses"]))]
            diff = float(np.max(np.abs(np.subtract(got, want))))
            if not diff <= TOL:
                problems.append(f"{kind} round {r}: losses differ from the plain loop's by {diff:.2e}")
        for k, v in ref.final.items():
            diff = float(np.max(np.abs(np.subtract(w.final[k], v))))
            if not diff <= TOL:
                problems.append(f"{kind}: final {k} differs from the plain loop's by {diff:.2e}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30, help="rounds per loop; round 0 is warm-up (default 30)")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--participation", type=float, default=0.1)
    ap.add_argument("--actors", type=int, default=2, help="Ray actors for raysim's Ray backend and Flower's")
    ap.add_argument("--flower-python", default="", help="a Python with flwr[simulation] (default: $RAYSIM_FLOWER_PYTHON, else this one)")
    ap.add_argument("--no-flower", action="store_true", help="run only the plain loop and raysim")
    ap.add_argument("--client-by-client", action="store_true",
                    help="raysim's loops with execution.batch_clients=false (default: raysim's default, client-batched stacks)")
    ap.add_argument("--batch-clients", action="store_true",
                    help="client-batched stacks, raysim's default (kept for the commands in docs/benchmarks.md)")
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(HERE))
        worker_main(args.worker, json.loads(args.spec), args.fd)
        return 0
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (round 0 is warm-up)")

    import benchlib

    benchlib.register_bench_model()
    from raysim.build import build_config, make_method
    from raysim.config import merge_config
    from raysim.engine.loop import prepare_data

    tmp = Path(tempfile.mkdtemp(prefix="raysim-vs-flower-"))
    values = workload(args, str(tmp / "cache"))
    cfg = build_config(merge_config(values, {"output": {"out_dir": str(tmp / "check")}}))
    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)  # fills the feature cache every loop reads
    sizes = [len(t) for t in data.train_idx]
    if max(sizes) > cfg.train.batch_size:
        raise SystemExit(f"a client holds {max(sizes)} > batch_size={cfg.train.batch_size} images: more than one step per client")

    fpy, found = (None, "--no-flower") if args.no_flower else flower_python(args)
    kinds = [k for k in KINDS if k != "flower" or fpy]
    spec = {"config": values, "actors": args.actors, "threads": 1}
    workers = {}
    for k in kinds:  # started together; each runs round 0 (not timed) and waits
        s = dict(spec, out_dir=str(tmp / f"run-{k}"))
        workers[k] = Worker(k, fpy if k == "flower" else sys.executable, s, tmp / f"{k}.log")
    t_start = time.perf_counter()
    start_s = {}
    for k, w in workers.items():
        w.first_round()
        start_s[k] = time.perf_counter() - t_start
    for r in range(1, args.rounds):  # one round of each loop at a time, the order rotating every round
        for k in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
            workers[k].one_round()
    for w in workers.values():
        w.finish()
    problems = check_same(workers)

    import platform

    from raysim.metrics import markdown_table

    med = {k: statistics.median(w.seconds) for k, w in workers.items()}
    own = {k: statistics.median(m["inner_s"] for m in w.rounds[1:]) for k, w in workers.items()}
    mean = {k: statistics.fmean(w.seconds) for k, w in workers.items()}
    print(f"PromptFL, {BENCH} width-64 random CLIP, digits IID, {args.clients} clients, {round(args.clients * args.participation)} "
          f"per round, one SGD step each; {args.rounds - 1} timed rounds per loop, alternating; "
          f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"Flower: {found}")
    rows = []
    for k in kinds:
        name = LABELS[k] + (f" ({args.actors} actors)" if k in ("ray", "flower") else "")
        rows.append([name, f"{med[k]:.4f}", f"{mean[k]:.4f}", f"{own[k]:.4f}", f"{med[k] / med['plain']:.2f}",
                     f"{med['flower'] / med[k]:.2f}" if "flower" in med else "-"])
    print(markdown_table(["loop", "s / round (median)", "mean", "own timer (median)", "time / plain", "Flower time / this"], rows), end="")
    print("s / round: wall clock from the benchmark's request to the loop's answer; own timer: the loop's own clock around "
          "its round (raysim: results.csv's seconds, without writing the CSV row; Flower: the ServerApp's round)")
    print("start-up and round 0, all started together (not in the table): "
          + ", ".join(f"{k} ready after {s:.1f} s" for k, s in start_s.items()))
    if problems:
        print("TRAINING DIFFERS:\n  " + "\n  ".join(problems))
        return 1
    print(f"training identical in all {len(kinds)} loops: same clients every round, round losses and final prompt within {TOL:g}")
    return 0


BENCH = "raysim-bench-w64"

if __name__ == "__main__":
    sys.exit(main())
