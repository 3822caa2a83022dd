"""Where a Ray run's start-up time goes (issue 17 item 5).

    python benchmarks/startup.py [--rounds 2] [--actors 0] [--model raysim-clip] [--repeat 1] [--no-inline]
                                 [--address ""|local|HOST:PORT] [--prestart]

Times, on the driver, each phase a `backend=ray` run goes through before and after its rounds: `import
ray`, `ray.init` (a new local cluster, or joining the one `ray start --head` runs on this machine), the data
into the object store, the actors (server and client hosts, all created before the first is waited for),
the first and a later training round, and the shutdown (actors killed, `ray.shutdown`). Inside each actor it
times the worker's start (process, imports) and the host's construction (method, frozen model, data
slices), and, in this process, how long building one host takes (the model build every actor repeats).
Then the same run end to end (`raysim.engine.loop.run`, as `python raysim/run.py execution.backend=ray`) next
to `execution.backend=inline`. The data (features of the default synthetic dataset) are cached first, so
no phase pays for them. `--prestart` restores Ray's default of prestarting one Python worker per CPU at
`ray.init` (what raysim did before; the actors never use those workers); `--address local` always starts a
new cluster, `--address ""` (the default) joins one that `ray start --head` runs here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def config(tmp: Path, tag: str, args, **extra):
    from raysim.build import build_config
    values = {
        "model": {"name": args.model, "pretrained": "bundled" if args.model == "raysim-clip" else ""},
        "train": {"rounds": args.rounds},
        "execution": {"num_actors": args.actors, "address": args.address, **extra},
        "output": {"out_dir": str(tmp / tag), "cache_dir": str(tmp / "cache") if args.fresh_cache else "~/.cache/raysim",
                   "progress": False, "tensorboard": False},
    }
    return build_config(values)


def phases(cfg) -> dict[str, float]:
    """Each phase of a RayBackend's life, timed on the driver (and inside the actors)."""
    from raysim.build import make_method
    from raysim.engine.hosts import ClientHost
    from raysim.engine.loop import prepare_data
    from raysim.sampling import participants

    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    import ray

    from raysim.engine.backends import RayBackend
    from raysim.engine.cluster import init_ray

    t["import ray"] = time.perf_counter() - t0

    class TimedHost(ClientHost):
        def __init__(self, *a, **k):
            self.entered = time.time()
            super().__init__(*a, **k)
            self.built = time.time() - self.entered

        def times(self) -> tuple[float, float]:
            return self.entered, self.built

    class Timed(RayBackend):
        def _new_host(self, group, resume_round):
            self.submitted = getattr(self, "submitted", None) or time.time()
            return self.ray.remote(TimedHost).options(**self.client_opts).remote(
                self.cfg, self.data_ref, group, self.out_dir, resume_round)

    t0 = time.perf_counter()
    init_ray(cfg.execution.address)  # what RayBackend does first (it finds Ray up, so leaves it to us to stop)
    t["ray.init"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = Timed(cfg, data, cfg.output.out_dir, -1)  # put, server + client actors, device_info from every host
    t["actors ready (all, in parallel)"] = time.perf_counter() - t0
    times = ray.get([h.times.remote() for h in b.hosts])
    t["  in an actor: worker start + imports (max)"] = max(e - b.submitted for e, _ in times)
    t["  in an actor: host built (max)"] = max(built for _, built in times)
    t["  hosts"] = float(len(b.hosts))
    for r in range(cfg.train.rounds):
        t0 = time.perf_counter()
        b.train_round(r, participants(cfg.train.seed, r, cfg.train.num_clients, cfg.train.participation))
        b.commit(r)
        t["first round" if r == 0 else "a later round"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    b.shutdown()
    ray.shutdown()
    t["shutdown"] = time.perf_counter() - t0
    # in this process: one host's construction, as every actor does it
    t0 = time.perf_counter()
    ClientHost(cfg, data, list(range(cfg.train.num_clients)), cfg.output.out_dir + "-inproc")
    t["one host built here (model build)"] = time.perf_counter() - t0
    return t


def end_to_end(cfg) -> float:
    from raysim.engine.loop import run

    t0 = time.perf_counter()
    run(cfg)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each run (the default run has 10)")
    ap.add_argument("--actors", type=int, default=0, help="client actors (0 = as many as the CPUs allow, the default)")
    ap.add_argument("--model", default="raysim-clip")
    ap.add_argument("--repeat", type=int, default=1, help="repeat each measurement, report the median")
    ap.add_argument("--no-inline", action="store_true", help="skip the inline end-to-end run")
    ap.add_argument("--address", default="", help="execution.address (local: always a new cluster)")
    ap.add_argument("--prestart", action="store_true", help="let Ray prestart its workers (raysim's start-up before)")
    ap.add_argument("--fresh-cache", action="store_true", help="a new feature cache (counts feature extraction)")
    args = ap.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    if args.prestart:
        from raysim.engine import cluster

        cluster.LOCAL_SYSTEM_CONFIG.clear()
    tmp = Path(tempfile.mkdtemp(prefix="raysim-startup-"))
    from raysim.build import make_method
    from raysim.engine.loop import prepare_data

    warm = config(tmp, "warm", args)
    prepare_data(warm, make_method(warm).needs(), progress=False)  # features cached: no phase below pays for them
    runs = [phases(config(tmp, f"phases{i}", args)) for i in range(args.repeat)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    from raysim.metrics import markdown_table

    print(f"Ray start-up, {args.model}, {args.rounds} rounds, num_actors={args.actors} ({os.cpu_count()} CPUs), "
          f"median of {args.repeat}")
    print(markdown_table(["phase", "seconds"], [[k, f"{v:.2f}" if not k.endswith("hosts") else f"{int(v)}"] for k, v in med.items()]))
    rows = []
    for backend in ("ray",) + (() if args.no_inline else ("inline",)):
        secs = [end_to_end(config(tmp, f"e2e-{backend}{i}", args, backend=backend)) for i in range(args.repeat)]
        rows.append([f"run(), execution.backend={backend}", f"{statistics.median(secs):.2f}"])
    print(markdown_table(["end to end (data cached)", "seconds"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
