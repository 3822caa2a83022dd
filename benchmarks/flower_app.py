"""The peer workload as a Flower app (Flower's Message API, `run_simulation` on its Ray backend), for
benchmarks/vs_flower.py. Run by that script as a worker (`--worker flower`), with a Python that has
`flwr[simulation]` (see vs_flower.py's docstring); raysim itself is imported from this source tree.

The ClientApp does exactly the step of raysim's PromptFL client, with raysim's own code: the same
method object (`make_method`), env (`build_env`, the frozen text tower and CoOp prompts), client data
(`FederationData.client`), `local_train` with the same per-(round, client) random stream and DP off.
The ServerApp samples the same clients per round (`raysim.sampling.participants`) and aggregates with
the method's own `aggregate` in client-id order. PromptFL clients keep no private state, so the client
is stateless like a Flower client (its frozen model is built once per Flower actor and kept).

This module is imported by name (not run as __main__) so that Flower's actors pickle its functions by
reference and keep the per-actor cache below.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import benchlib

benchlib.use_raysim_from()  # this Python has no raysim installed: the source tree's (actors too)

SPEC_ENV = "RAYSIM_BENCH_FLOWER_SPEC"  # the workload, for the actors (they inherit the driver's environment)
_cache: dict[str, Any] = {}


def _setup(role: str):
    """(cfg, method, data, env) of this process, built once (per Flower actor, and once for the server)."""
    if role not in _cache:
        import torch

        from raysim.build import build_config, env_spec, make_method
        from raysim.engine.loop import prepare_data

        benchlib.register_bench_model()
        spec = json.loads(os.environ[SPEC_ENV])
        torch.set_num_threads(spec["threads"])
        cfg = build_config(spec["config"])
        method = make_method(cfg)
        data = prepare_data(cfg, method.needs(), progress=False)  # from the feature cache the driver filled
        env = method.build_env(env_spec(cfg, data.classnames), role=role)
        _cache[role] = (cfg, method, data, env, spec)
    return _cache[role]


def _build_client_app():
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"node": ConfigRecord({"partition_id": int(context.node_config["partition-id"])})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        from raysim.methods.base import initial_private
        from raysim.privacy import NoDP
        from raysim.sampling import generator

        cfg, method, data, env, _ = _setup("client")
        cid = int(context.node_config["partition-id"])
        r = int(msg.content["config"]["round"])
        shared = dict(msg.content["arrays"].to_torch_state_dict())
        cd = data.client(cid)
        res = method.local_train(env, shared, initial_private(method, env, cd, cfg.train.seed), cd,
                                 rng=generator(cfg.train.seed, "train", r, cid), privacy=NoDP())
        return Message(RecordDict({
            "arrays": ArrayRecord({k: v.detach().cpu() for k, v in res.upload.items()}),
            "metrics": MetricRecord({"cid": cid, "num_samples": int(res.num_samples), "loss": float(res.metrics["loss"])}),
        }), reply_to=msg)

    return app


def _build_server_app(report: Callable[[dict], None], wait: Callable[[], None]):
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.serverapp import Grid, ServerApp

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        import time

        from raysim.methods import Upload
        from raysim.sampling import generator, participants

        cfg, method, data, env, spec = _setup("server")
        seed = cfg.train.seed
        shared = {k: v.detach().cpu() for k, v in method.init_shared(env, generator(seed, "server-init")).items()}
        while len(nodes := list(grid.get_node_ids())) < cfg.train.num_clients:  # the SuperNodes register
            time.sleep(0.05)
        # which node holds which partition (= raysim client id)
        replies = grid.send_and_receive([Message(RecordDict({}), dst_node_id=n, message_type=MessageType.QUERY) for n in nodes])
        node_of = {int(m.content["node"]["partition_id"]): m.metadata.src_node_id for m in replies}
        for r in range(cfg.train.rounds):
            if r > 0:
                wait()
            t0 = time.perf_counter()
            part = participants(seed, r, cfg.train.num_clients, cfg.train.participation)
            msgs = [Message(RecordDict({"arrays": ArrayRecord(dict(shared)), "config": ConfigRecord({"round": r})}),
                            dst_node_id=node_of[c], message_type=MessageType.TRAIN, group_id=str(r)) for c in part]
            out = list(grid.send_and_receive(msgs))
            bad = [m.error for m in out if m.has_error()]
            if bad or len(out) != len(part):
                raise RuntimeError(f"Flower round {r}: {len(out)} of {len(part)} replies, errors: {bad[:3]}")
            ups = sorted(
                (Upload(int(m.content["metrics"]["cid"]), dict(m.content["arrays"].to_torch_state_dict()),
                        int(m.content["metrics"]["num_samples"])) for m in out),
                key=lambda u: u.client_id,
            )
            losses = {int(m.content["metrics"]["cid"]): float(m.content["metrics"]["loss"]) for m in out}
            new = method.aggregate(env, shared, ups, generator(seed, "server", r))
            shared = {k: v.detach().cpu() for k, v in new.items()}
            report({"round": r, "clients": sorted(losses), "losses": [losses[c] for c in sorted(losses)],
                    "inner_s": time.perf_counter() - t0})
        report({"final": {k: v.tolist() for k, v in shared.items()}})

    return app


def run(spec: dict, report: Callable[[dict], None], wait: Callable[[], None]) -> None:
    """Run the workload on Flower's simulation engine: `spec["config"]` (raysim's flat config), one Flower
    SuperNode per client, `spec["actors"]` Ray actors of 1 CPU each; `report` after each round, `wait`
    (for the benchmark's go) before each round after the first."""
    os.environ[SPEC_ENV] = json.dumps(spec)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no network here, and none wanted
    from flwr.simulation import run_simulation

    _setup("server")  # fill this process's cache before Flower starts (start-up, not timed)
    run_simulation(
        server_app=_build_server_app(report, wait),
        client_app=_build_client_app(),
        num_supernodes=spec["config"]["train"]["num_clients"],
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": spec["actors"], "include_dashboard": False, "log_to_driver": False},
        },
    )
