"""Where the hosts run: `inline` (this process) or `ray` (a ServerActor and ClientActors).

Both expose the same three calls per round: `train_round` (dispatch once per client host with the list
of its participating clients, then aggregate on the server in client-id order), `evaluate`, `commit`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from raysim.actors import ClientHost, ClientReport, FederationData, ServerHost
from raysim.config import RunConfig

log = logging.getLogger(__name__)


def assign_clients(num_clients: int, num_hosts: int) -> list[list[int]]:
    """Client c lives on host c mod H for the whole run (pooled placement)."""
    return [[c for c in range(num_clients) if c % num_hosts == h] for h in range(num_hosts)]


class InlineBackend:
    name = "inline"

    def __init__(self, cfg: RunConfig, data: FederationData, out_dir: str, resume_round: int) -> None:
        hosts = 1 if cfg.placement == "pooled" and cfg.num_actors == 0 else (
            cfg.num_clients if cfg.placement == "actor_per_client" else cfg.num_actors
        )
        self.groups = assign_clients(cfg.num_clients, min(hosts, cfg.num_clients))
        self.server = ServerHost(cfg, data.classnames, out_dir, resume_round)
        self.hosts = [ClientHost(cfg, data, g, out_dir, resume_round) for g in self.groups]
        self.info = {"backend": "inline", "hosts": len(self.hosts)}

    def train_round(self, round_idx: int, participants: list[int]) -> tuple[list[ClientReport], dict[str, Any]]:
        shared = self.server.get_shared()
        chosen = set(participants)
        upload_lists, reports = [], []
        for host, group in zip(self.hosts, self.groups):
            mine = [c for c in group if c in chosen]
            if mine:
                ups, reps = host.train(round_idx, mine, shared)
                upload_lists.append(ups)
                reports += reps
        stats = self.server.aggregate(round_idx, *upload_lists)
        return sorted(reports, key=lambda r: r.client_id), stats

    def evaluate(self) -> list[dict[str, Any]]:
        shared = self.server.get_shared()
        return sorted((row for h in self.hosts for row in h.evaluate(shared)), key=lambda r: r["client"])

    def commit(self, round_idx: int) -> None:
        self.server.commit(round_idx)
        for h in self.hosts:
            h.commit(round_idx)

    def shutdown(self) -> None:
        pass


class RayBackend:
    name = "ray"

    def __init__(self, cfg: RunConfig, data: FederationData, out_dir: str, resume_round: int) -> None:
        import ray

        self.ray = ray
        self.started_ray = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = dict(include_dashboard=False, configure_logging=False, log_to_driver=True)
            if cfg.address:
                ray.init(address=cfg.address, **kwargs)
            else:
                ray.init(num_cpus=os.cpu_count(), **kwargs)
            self.started_ray = True
        resources = ray.cluster_resources()
        cpus, gpus = float(resources.get("CPU", 1)), float(resources.get("GPU", 0))
        client_gpus, server_gpus = cfg.client_gpus, cfg.server_gpus
        if (client_gpus > 0 or server_gpus > 0) and gpus == 0:
            log.warning("no GPU in the Ray cluster: client_gpus/server_gpus ignored, actors run on CPU")
            client_gpus = server_gpus = 0.0
        if cfg.placement == "actor_per_client":
            num_hosts = cfg.num_clients
        elif cfg.num_actors > 0:
            num_hosts = cfg.num_actors
        else:
            by_cpu = int((cpus - cfg.server_cpus) // cfg.client_cpus) if cfg.client_cpus > 0 else cfg.num_clients
            by_gpu = int(gpus // client_gpus) if client_gpus > 0 else cfg.num_clients
            num_hosts = max(1, min(by_cpu, by_gpu))
        num_hosts = min(num_hosts, cfg.num_clients)
        self.groups = assign_clients(cfg.num_clients, num_hosts)
        data_ref = ray.put(data)  # every actor reads the same copy from the object store
        ServerActor = ray.remote(ServerHost)
        ClientActor = ray.remote(ClientHost)
        self.server = ServerActor.options(num_cpus=cfg.server_cpus, num_gpus=server_gpus).remote(
            cfg, data.classnames, out_dir, resume_round
        )
        self.hosts = [
            ClientActor.options(num_cpus=cfg.client_cpus, num_gpus=client_gpus).remote(cfg, data_ref, g, out_dir, resume_round)
            for g in self.groups
        ]
        devices = ray.get([h.device_info.remote() for h in self.hosts])
        self.info = {
            "backend": "ray",
            "hosts": len(self.hosts),
            "cluster_cpus": cpus,
            "cluster_gpus": gpus,
            "devices": sorted({d["device"] for d in devices}),
        }

    def train_round(self, round_idx: int, participants: list[int]) -> tuple[list[ClientReport], dict[str, Any]]:
        ray = self.ray
        shared_ref = self.server.get_shared.remote()  # one object in the store, read by every actor
        chosen = set(participants)
        upload_refs, report_refs = [], []
        for host, group in zip(self.hosts, self.groups):
            mine = [c for c in group if c in chosen]
            if mine:
                ups, reps = host.train.options(num_returns=2).remote(round_idx, mine, shared_ref)
                upload_refs.append(ups)
                report_refs.append(reps)
        stats_ref = self.server.aggregate.remote(round_idx, *upload_refs)  # uploads go actor -> server
        reports = [r for lst in ray.get(report_refs) for r in lst]
        stats = ray.get(stats_ref)
        return sorted(reports, key=lambda r: r.client_id), stats

    def evaluate(self) -> list[dict[str, Any]]:
        shared_ref = self.server.get_shared.remote()
        rows = self.ray.get([h.evaluate.remote(shared_ref) for h in self.hosts])
        return sorted((row for lst in rows for row in lst), key=lambda r: r["client"])

    def commit(self, round_idx: int) -> None:
        self.ray.get([self.server.commit.remote(round_idx)] + [h.commit.remote(round_idx) for h in self.hosts])

    def shutdown(self) -> None:
        for a in [self.server, *self.hosts]:
            try:
                self.ray.kill(a)
            except Exception:  # already gone
                pass
        if self.started_ray:
            self.ray.shutdown()


BACKENDS = {"inline": InlineBackend, "ray": RayBackend}
