"""raysim at 10,000 and 100,000 clients: s/round on Ray, the plain loop's, memory of all processes, and an
evaluated round.

    python benchmarks/scale.py                                          # ~2-3 minutes: 10,000 clients, 100 per round
    python benchmarks/scale.py --clients 10000 100000 --per-round 1000  # issue 17's sizes
    python benchmarks/scale.py ... --set eval.clients=100               # any raysim config key=value, for every run

Workload: PromptFL with the peer workload's width-64 random CLIP (benchlib.BENCH_MODEL), clients split
IID, `--per-round` clients sampled per round, one SGD step each (`--train-per-client` images, at most the
batch size). The data is generated at the feature level: the image tower is frozen, so a client only ever
sees its images' pooled CLIP features, and the benchmark writes those (seeded: 10 class directions in the
64-d feature space plus Gaussian noise, L2-normalised) straight into raysim's feature cache, under a
dataset registered for the run (`bench-scale-N`). The image generator (raysim/data/synthetic.py) can be
sized (SyntheticParams.train_per_cell) but draws each image with Pillow, about 5 ms an image here: the
million images of 100,000 clients would take over an hour to draw and encode.

For each client count N, in a fresh process each (so that memory is that run's alone):

    ray    raysim's engine, backend=ray, --actors pooled client actors: round 0 (warm-up), --rounds timed
           rounds, then one evaluated round (the engine's evaluation, protocol in_cross: every client's
           model on every test split; pass the evaluation keys of your raysim with --set)
    plain  the plain single-process loop of vs_flower.py (local_train and aggregate, nothing else)

and a baseline run with N = --per-round clients (every client in every round), so that the growth of
memory with clients is measured at the same per-round work. Memory: the proportional set size (PSS:
shared pages, such as Ray's object store, split between the processes that map them, so the sum is what
the machine holds) of the driver and all its descendants (Ray's GCS, raylet and workers), summed, after
the last training round; RSS summed is printed too (it counts shared pages once per process).
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
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
NUM_CLASSES = 10
NOISE = 0.8  # feature noise around a class direction (each of the 64 coordinates): a learnable, not trivial task


def dataset_name(clients: int) -> str:
    return f"bench-scale-{clients}"


class _NoImages:
    """Images that are never drawn: the features are in the cache (a Dataset of the right length)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        raise RuntimeError("bench-scale has no images: its features are written to the cache by benchmarks/scale.py")


def register_dataset(spec: dict) -> None:
    """Register `bench-scale-N` (N clients x the per-client sizes) and write its features into the cache."""
    import numpy as np
    import torch

    from raysim.data.base import DatasetBundle, ImageSet, register_dataset
    from raysim.data.features import feature_cache_path
    from raysim.models.clip import ModelSpec

    n = spec["clients"]
    n_train, n_test, seed, dim = n * spec["train_per_client"], n * spec["test_per_client"], spec["seed"], spec["dim"]
    g = np.random.default_rng([seed, n])
    y_train, y_test = g.integers(0, NUM_CLASSES, n_train), g.integers(0, NUM_CLASSES, n_test)
    name = dataset_name(n)
    sig = f"{name}-v1-{n_train}-{n_test}-seed{seed}-d{dim}"

    def load(load_spec) -> DatasetBundle:
        return DatasetBundle(name=name, classnames=["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"],
                             train=ImageSet(_NoImages(n_train), y_train), test=ImageSet(_NoImages(n_test), y_test), signature=sig)

    register_dataset(name)(load)
    bundle = load(None)
    model_key = ModelSpec(spec["model"], "", cache_dir=spec["cache_dir"]).key()
    path = feature_cache_path(spec["cache_dir"], model_key, bundle, spec["image_size"])
    if not path.is_file():
        centres = torch.nn.functional.normalize(torch.from_numpy(g.standard_normal((NUM_CLASSES, dim))).float(), dim=-1)
        blob = {}
        for split, y in (("train", y_train), ("test", y_test)):
            x = centres[torch.from_numpy(y)] + NOISE / dim**0.5 * torch.from_numpy(g.standard_normal((len(y), dim))).float()
            blob[split] = torch.nn.functional.normalize(x, dim=-1)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(blob, path)


def config(spec: dict, backend: str, out_dir: str) -> dict[str, Any]:
    from raysim.config import merge_config, parse_overrides

    values = {
        "method": "promptfl",
        "data": {"dataset": dataset_name(spec["clients"]), "partition": "iid", "shots": 0},
        "model": {"name": spec["model"], "pretrained": ""},
        "train": {"num_clients": spec["clients"], "participation": spec["per_round"] / spec["clients"],
                  "rounds": spec["rounds"] + 1 + int(spec["eval"]), "batch_size": max(32, spec["train_per_client"]), "local_epochs": 1},
        # round 0 warm-up, rounds 1..R timed, round R+1 evaluated
        "eval": {"every": 10**6, "last": int(spec["eval"])},
        "execution": {"backend": backend, "num_actors": spec["actors"], "num_threads": 1},
        "output": {"progress": False, "tensorboard": False, "cache_dir": spec["cache_dir"], "out_dir": out_dir},
    }
    return merge_config(values, parse_overrides(spec["set"]))


# ---------------------------------------------------------------------------------------------- the runs
def run_ray(spec: dict, sizes: list[int]) -> dict[int, dict[str, Any]]:
    """The engine on one Ray cluster, one run per client count (ascending); each run's actors are gone
    before the next starts."""
    import benchlib
    import ray

    from raysim.build import build_config
    from raysim.engine.loop import run

    os.environ["PYTHONPATH"] = benchlib.bench_pythonpath()  # the actors import benchlib (the setup hook)
    t0 = time.perf_counter()
    ray.init(num_cpus=max(2, spec["actors"]), include_dashboard=False, configure_logging=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "benchlib.ray_setup_hook"})
    init_s = time.perf_counter() - t0
    out: dict[int, dict[str, Any]] = {}
    for n in sizes:
        s = dict(spec, clients=n)
        register_dataset(s)
        cfg = build_config(config(s, "ray", str(Path(spec["out_dir"]) / f"ray-{n}")))
        memory: dict[str, Any] = {}
        marks: dict[str, float] = {}
        t0 = time.perf_counter()

        def on_round(row: dict, memory=memory, marks=marks, t0=t0) -> None:
            r = int(row["round"])
            if r == 0:
                marks["ready"] = time.perf_counter() - t0 - row["seconds"]
            if r == spec["rounds"]:  # after the last training round, before the evaluated one (actors alive)
                memory.update(benchlib.tree_memory())

        rows = run(cfg, on_round=on_round).rounds
        train = [r["seconds"] for r in rows[1 : spec["rounds"] + 1]]
        out[n] = {"start_s": marks["ready"], "round_s": statistics.median(train), "rounds_s": train,
                  "eval_round_s": rows[-1]["seconds"] if spec["eval"] else None, "memory": memory}
        print(f"  ray, {n:,} clients: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    out[0] = {"init_s": init_s}
    ray.shutdown()
    return out


def run_plain(spec: dict, sizes: list[int]) -> dict[int, dict[str, Any]]:
    """The plain loop, one run per client count (ascending) in this process."""
    import benchlib
    import torch

    from raysim.build import build_config, env_spec, make_method
    from raysim.engine.loop import prepare_data
    from raysim.methods import Upload
    from raysim.methods.base import initial_private
    from raysim.privacy import NoDP
    from raysim.sampling import generator, participants

    torch.set_num_threads(1)
    out: dict[int, dict[str, Any]] = {}
    for n in sizes:
        s = dict(spec, clients=n)
        register_dataset(s)
        cfg = build_config(config(s, "inline", str(Path(spec["out_dir"]) / f"plain-{n}")))
        method = make_method(cfg)
        data = prepare_data(cfg, method.needs(), progress=False)
        env = method.build_env(env_spec(cfg, data.classnames), role="client")
        seed = cfg.train.seed
        shared = {k: v.detach().cpu() for k, v in method.init_shared(env, generator(seed, "server-init")).items()}
        private: dict[int, dict] = {}
        times = []
        for r in range(spec["rounds"] + 1):
            t0 = time.perf_counter()
            uploads = []
            for cid in participants(seed, r, cfg.train.num_clients, cfg.train.participation):
                cd = data.client(cid)
                if cid not in private:
                    private[cid] = initial_private(method, env, cd, seed)
                res = method.local_train(env, shared, private[cid], cd, rng=generator(seed, "train", r, cid), privacy=NoDP())
                private[cid] = res.private
                uploads.append(Upload(cid, {k: v.detach().cpu() for k, v in res.upload.items()}, res.num_samples))
            shared = {k: v.detach().cpu() for k, v in method.aggregate(env, shared, uploads, generator(seed, "server", r)).items()}
            times.append(time.perf_counter() - t0)
        out[n] = {"round_s": statistics.median(times[1:]), "rounds_s": times[1:], "memory": benchlib.tree_memory()}
        del data, private, env
        print(f"  plain, {n:,} clients: {sum(times):.0f} s of rounds", file=sys.stderr, flush=True)
    return out


def worker(spec: dict) -> None:
    import benchlib

    benchlib.register_bench_model()
    sizes = spec.pop("sizes")
    out = run_ray(spec, sizes) if spec["kind"] == "ray" else run_plain(spec, sizes)
    print("@@" + json.dumps({str(k): v for k, v in out.items()}), flush=True)


def launch(spec: dict, log: Path, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p))
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        assert p.stderr is not None and p.stdout is not None
        for line in p.stderr:  # the progress lines to the terminal, everything to the log
            f.write(line)
            if line.startswith("  "):
                print(line, end="", file=sys.stderr, flush=True)
        stdout = p.stdout.read()
        p.wait(timeout=timeout)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("@@")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"the {spec['kind']} runs failed (exit {p.returncode}); log {log}:\n" + log.read_text()[-3000:])
    return {int(k): v for k, v in json.loads(lines[-1][2:]).items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[10_000], help="client counts N (default 10000)")
    ap.add_argument("--per-round", type=int, default=100, help="clients sampled per round (default 100)")
    ap.add_argument("--rounds", type=int, default=3, help="timed training rounds per run (after a warm-up round)")
    ap.add_argument("--actors", type=int, default=2, help="pooled client actors on Ray")
    ap.add_argument("--train-per-client", type=int, default=8)
    ap.add_argument("--test-per-client", type=int, default=2)
    ap.add_argument("--no-plain", action="store_true", help="skip the plain loop")
    ap.add_argument("--no-eval", action="store_true", help="skip the evaluated round")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="raysim config overrides for every run")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run before giving up")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(HERE))
        worker(json.loads(args.worker))
        return 0

    sys.path.insert(0, str(HERE))
    import benchlib

    benchlib.register_bench_model()
    import open_clip

    mcfg = open_clip.get_model_config(benchlib.BENCH_MODEL)
    tmp = Path(tempfile.mkdtemp(prefix="raysim-scale-"))
    base = {"per_round": args.per_round, "rounds": args.rounds, "actors": args.actors, "train_per_client": args.train_per_client,
            "test_per_client": args.test_per_client, "seed": 1, "dim": mcfg["embed_dim"], "image_size": mcfg["vision_cfg"]["image_size"],
            "model": benchlib.BENCH_MODEL, "cache_dir": str(tmp / "cache"), "set": list(args.set), "eval": not args.no_eval}
    sizes = sorted(set(args.clients))
    if args.per_round > min(sizes):
        ap.error("--per-round must be at most the smallest --clients")
    runs = [args.per_round] + [n for n in sizes if n != args.per_round]
    t_all = time.perf_counter()
    spec = dict(base, out_dir=str(tmp))
    ray_res = launch(dict(spec, kind="ray", sizes=runs), tmp / "ray.log", args.timeout)
    plain_res = {} if args.no_plain else launch(dict(spec, kind="plain", sizes=[n for n in runs if n != args.per_round]),
                                                tmp / "plain.log", args.timeout)

    import platform

    from raysim.metrics import markdown_table

    base_mem = ray_res[args.per_round]["memory"]["pss"]
    print(f"PromptFL, {benchlib.BENCH_MODEL} width-64 random CLIP, generated features ({args.train_per_client} train + "
          f"{args.test_per_client} test per client), {args.per_round:,} clients per round, one SGD step each, "
          f"{args.actors} client actors; {args.rounds} timed rounds per run; {os.cpu_count()} CPUs "
          f"({platform.machine()}), {time.strftime('%Y-%m-%d %H:%M %Z')}" + (f"; --set {' '.join(args.set)}" if args.set else ""))
    rows = []
    for n in runs:
        r = ray_res[n]
        m = r["memory"]
        plain = plain_res.get(n)
        rows.append([
            f"{n:,}", f"{r['round_s']:.2f}", f"{plain['round_s']:.2f}" if plain else "-",
            f"{r['eval_round_s']:.2f}" if r["eval_round_s"] is not None else "-",
            f"{r['eval_round_s'] / r['round_s']:.1f}" if r["eval_round_s"] is not None else "-",
            f"{r['start_s']:.1f}", benchlib.mib(m["pss"]), benchlib.mib(m["rss"]),
            f"{benchlib.mib(m['driver_pss'])} / {benchlib.mib(m['workers_pss'])} ({m['workers']}) / {benchlib.mib(m['other_pss'])}",
            f"{(m['pss'] - base_mem) / 2**20:+,.0f}" if n != args.per_round else "(baseline)",
            benchlib.mib(plain["memory"]["pss"]) if plain else "-",
        ])
    print(markdown_table(["clients", "ray s/round", "plain s/round", "evaluated round s", "eval / train round", "ray start s",
                          "total PSS MiB", "total RSS MiB", "driver / workers (n) / Ray daemons PSS MiB",
                          "PSS growth vs baseline MiB", "plain PSS MiB"], rows), end="")
    print(f"(all runs: {time.perf_counter() - t_all:.0f} s, ray.init {ray_res[0]['init_s']:.1f} s; baseline: {args.per_round:,} "
          "clients, all in every round; memory after the last training round; ray start s: from run() to round 0 (data, actors))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
