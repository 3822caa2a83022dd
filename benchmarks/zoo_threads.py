"""Heterogeneous-model clients trained at once (execution.client_threads): s/round of the zoo's FedProto.

    python benchmarks/zoo_threads.py [--clients 20] [--family HtFE2] [--rounds 4] [--repeats 2] [--ray 2]
        [--layouts seq intra threads ray]
    python benchmarks/zoo_threads.py --steps fedavgcnn resnet18   # the threads' CPU cost, two clients' steps

The setting of issue 29: FedProto on digits (Dirichlet 0.1, every image), 20 clients on HtFE2 (FedAvgCNN and
ResNet-18, alternating), HtFLlib's defaults (benchmarks/presets/htfllib.yaml: lr 0.01, batch 10, one local
epoch, every client every round), no evaluation. Per layout, the median s/round of results.csv after the
first round (which builds the models and warms caches), and for the inline layouts the process's CPU time
over its wall time (how many cores it kept busy: on a loaded machine the threads get what the others leave):

  seq      inline, one client at a time on one torch thread (client_threads=1, num_threads=1)
  intra    inline, one client at a time on 2 torch threads (client_threads=1, num_threads=2)
  threads  inline, 2 clients at a time, one torch thread each (client_threads=2, num_threads=1)
  ray      the Ray backend with --ray actors (client_cpus 1 each: one client thread, one torch thread)

Layouts alternate, --repeats times, so the machine's drift spreads over all of them. The runs on one torch
thread must end bitwise the same (the server's prototypes and every client's model are compared after
each repeat); `intra` is left out of that check, since a torch op's own thread count may change its last
bits (execution.num_threads: results are bitwise reproducible for a fixed value).
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

LAYOUTS = {
    "seq": dict(client_threads=1, num_threads=1),
    "intra": dict(client_threads=1, num_threads=2),
    "threads": dict(client_threads=2, num_threads=1),
}


def config(tmp: Path, tag: str, clients: int, family: str, rounds: int, **execution):
    from raysim.build import build_config
    return build_config({
        "method": "fedproto",
        "data": {"dataset": "digits", "partition": "dirichlet", "beta": 0.1, "shots": 0},
        "train": {"num_clients": clients, "rounds": rounds, "lr": 0.01, "batch_size": 10, "local_epochs": 1, "participation": 1.0},
        "eval": {"every": 10**6, "last": 0},
        "fedproto": {"model_family": family, "feature_dim": 512, "lam": 1.0},
        "execution": {"backend": "inline", **execution},
        "output": {"progress": False, "tensorboard": False, "cache_dir": str(tmp / "cache"), "out_dir": str(tmp / tag)},
    })


def final_state(cfg) -> dict:
    """{name: tensor} of the run's last server state and every client's model."""
    from raysim.storage.store import StateStore

    store, last = StateStore(cfg.output.out_dir), cfg.train.rounds - 1
    out = {f"server.{k}": v for k, v in store.load_server(last).items()}
    for c in range(cfg.train.num_clients):
        for k, v in store.load_client(c, last)["private"]["model"].items():
            out[f"client{c}.{k}"] = v
    return out


def steps_cpu(arch: str, batch: int = 10, batches: int = 40, alternations: int = 2) -> None:
    """Two clients' local steps (a fresh `arch` model each, `batches` SGD steps on random 32x32 batches of
    `batch`) one after the other and on two threads, alternated: wall and process CPU seconds of each."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch.nn.functional as F

    from raysim.models.zoo import make_client_model

    torch.set_num_threads(1)

    def step(seed: int, n: int = batches) -> float:
        model = make_client_model(arch, 512, 10, seed=seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(n * batch, 3, 32, 32, generator=g), torch.randint(0, 10, (n * batch,), generator=g)
        for i in range(n):
            loss = F.cross_entropy(model(x[i * batch:(i + 1) * batch])[1], y[i * batch:(i + 1) * batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return float(loss.detach())

    step(0, 2)  # warm-up
    for _ in range(alternations):
        for mode in ("one after the other", "on two threads"):
            t0, c0 = time.perf_counter(), time.process_time()
            if mode == "on two threads":
                with ThreadPoolExecutor(2) as pool:
                    list(pool.map(step, (1, 2)))
            else:
                [step(s) for s in (1, 2)]
            print(f"{arch}, batch {batch}, two clients {mode}: wall {time.perf_counter() - t0:.2f} s, "
                  f"CPU {time.process_time() - c0:.2f} s; load {os.getloadavg()[0]:.1f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--family", default="HtFE2")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ray", type=int, default=2, help="actors of the Ray layout")
    ap.add_argument("--layouts", nargs="+", default=["seq", "intra", "threads", "ray"], choices=[*LAYOUTS, "ray"])
    ap.add_argument("--steps", nargs="+", default=[], metavar="ARCH",
                    help="instead: two clients' local steps of each ARCH (fedavgcnn, resnet18, ...) one after the other "
                         "and on two threads, wall and CPU seconds")
    args = ap.parse_args(argv)
    if args.steps:
        for arch in args.steps:
            steps_cpu(arch)
        return 0

    import torch

    from raysim.engine.loop import run
    from raysim.metrics import markdown_table

    tmp = Path(tempfile.mkdtemp(prefix="raysim-zoo-threads-"))
    runs: dict[str, list[float]] = {}
    t_start = time.time()
    for rep in range(args.repeats):
        states = {}
        for name in args.layouts:
            execution = dict(backend="ray", num_actors=args.ray, client_cpus=1.0, client_threads=1, num_threads=1) \
                if name == "ray" else LAYOUTS[name]
            cfg = config(tmp, f"{name}-{rep}", args.clients, args.family, args.rounds, **execution)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            secs = [row["seconds"] for row in run(cfg).rounds]
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            med = statistics.median(secs[1:] if len(secs) > 1 else secs)
            runs.setdefault(name, []).append(med)
            used = f"{cpu / wall:.2f} cores busy in this process" if name != "ray" else "(the actors' CPU is not this process's)"
            print(f"repeat {rep} {name}: s/round {', '.join(f'{s:.2f}' for s in secs)} (median after the first {med:.2f}); "
                  f"{used}; load {os.getloadavg()[0]:.2f}", flush=True)
            if name != "intra":
                states[name] = final_state(cfg)
        names = list(states)
        for other in names[1:]:
            a, b = states[names[0]], states[other]
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{other} differs from {names[0]}"
        if len(names) > 1:
            print(f"checked: {', '.join(names)} end bitwise the same ({len(states[names[0]])} tensors)")
    base = statistics.median(runs["seq"]) if "seq" in runs else None
    print(f"\nFedProto, digits (Dirichlet 0.1), {args.clients} clients on {args.family}, HtFLlib's defaults, "
          f"{args.rounds} rounds x {args.repeats} repeats, {(time.time() - t_start) / 60:.1f} min in all; "
          f"{os.cpu_count()} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    for k, v in runs.items():
        med = statistics.median(v)
        rows.append([k, f"{med:.2f}", f"{min(v):.2f} - {max(v):.2f}", f"{base / med:.2f}" if base else ""])
    print(markdown_table(["layout", "s / round (median)", "range over repeats", "speed-up over seq"], rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
