"""Where the hosts run: `inline` (this process) or `ray` (a ServerActor and ClientActors).

Both implement `Backend`: per round `train_round` (dispatch once per client host with the list of its
participating clients, then aggregate on the server in client-id order), `evaluate`, `commit`; and
`shutdown` and `info` for the run. Which clients share a host is `raysim.engine.cluster.plan_hosts`.

With client-batched training (execution.batch_clients, the default, for a method that stacks) a round's
stacks are planned from its participants alone (raysim/engine/batched.py `stacked_round`): the host of a
stack's first member trains it, its other members' state brought there from their own hosts and their
results brought back (in process inline; on Ray through the driver), so a run's results are bitwise the
same on either backend and for any pool size.

For a method with `release_first` (SPEC 3.4) `train_round` has two phases: every host's `release` of the
broadcast state, the server's aggregation of those uploads, then every host's `train` on the new
broadcast (whose uploads are empty and not aggregated). The clients whose release failed (dropped) do
not train. Reports carry the training's loss and metrics and the release's bytes_up.

For a method with a Step 0 (`Method.setup_clients`) the loop calls `setup(0, clients)` before round 0's
`train_round`: those clients' hosts' `setup`, then the server's `setup` of their uploads, whose broadcast
round 0 trains on. It belongs to round 0 (a Ray actor lost in round 0 is replaced and Step 0 replayed for it).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

from raysim.build import make_method
from raysim.config import RunConfig
from raysim.engine.batched import stacked_round, stacks_clients
from raysim.engine.client_round import ClientReport, check_round, merge_phases
from raysim.engine.cluster import init_ray, plan_hosts
from raysim.engine.evaluation import merge_hits
from raysim.engine.hosts import ClientHost, FederationData, ServerHost, host_client_threads
from raysim.methods import get_method

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What the engine's round loop calls; built as BACKENDS[cfg.execution.backend](cfg, data, out_dir, resume_round)."""

    name: str
    info: dict[str, Any]  # what the run reports about where it ran: backend, hosts, ...

    def __init__(self, cfg: RunConfig, data: FederationData, out_dir: str, resume_round: int) -> None:
        """Build the server host and the client hosts, resuming from `resume_round` (-1: a new run)."""

    def setup(self, round_idx: int, clients: list[int]) -> tuple[list[ClientReport], dict[str, Any]]:
        """Step 0 before round `round_idx` (0) trains: `clients`' `local_setup`, then the server's `aggregate_setup`
        of their uploads: (reports in client order, server stats)."""

    def train_round(self, round_idx: int, participants: list[int]) -> tuple[list[ClientReport], dict[str, Any]]:
        """Train the round's participants and aggregate their uploads: (reports in client order, server stats)."""

    def evaluate(self, clients: Optional[list[int]] = None) -> list[dict[str, Any]]:
        """The evaluation rows of `clients` (None: every client) against the current shared state, among
        them (raysim.engine.evaluation), in client order."""

    def commit(self, round_idx: int) -> None:
        """When it returns, the server's and every client's state as of the end of `round_idx` are on disk (the
        hosts and the server write theirs at the end of the calls that change them: `ClientHost.commit`,
        `ServerHost.aggregate`)."""

    def shutdown(self) -> None:
        """Release the hosts (and Ray, when this backend started it)."""


class InlineBackend:
    name = "inline"

    def __init__(self, cfg: RunConfig, data: FederationData, out_dir: str, resume_round: int) -> None:
        self.cfg = cfg
        self.groups = plan_hosts(cfg, cluster_cpus=1, cluster_gpus=0)  # one process: num_actors=0 is one host
        self.server = ServerHost(cfg, data.classnames, out_dir, resume_round)
        self.hosts = [ClientHost(cfg, data, g, out_dir, resume_round) for g in self.groups]
        self.release_first = bool(get_method(cfg.method).release_first)
        method = make_method(cfg)
        self.global_eval = method.predicts_globally()
        self.stacked = stacks_clients(cfg, method)
        self.home = {c: i for i, g in enumerate(self.groups) for c in g}
        self.info = {"backend": "inline", "hosts": len(self.hosts)}

    def _call(self, name: str, calls: dict[int, tuple], returns: int) -> dict[int, tuple]:
        """Each listed host's `name(*args)`, in host order (`stacked_round`'s call)."""
        out = {}
        for i in sorted(calls):
            got = getattr(self.hosts[i], name)(*calls[i])
            out[i] = tuple(got) if returns > 1 else (got,)
        return out

    def setup(self, round_idx: int, clients: list[int]) -> tuple[list[ClientReport], dict[str, Any]]:
        shared = self.server.get_shared()
        upload_lists, reports = [], []
        for host, group in zip(self.hosts, self.groups):
            mine = [c for c in group if c in set(clients)]
            if mine:
                ups, reps = host.setup(round_idx, mine, shared)
                upload_lists.append(ups)
                reports += reps
        check_round(self.cfg, round_idx, reports)
        stats, _ = self.server.setup(round_idx, *upload_lists)
        return sorted(reports, key=lambda r: r.client_id), stats

    def train_round(self, round_idx: int, participants: list[int]) -> tuple[list[ClientReport], dict[str, Any]]:
        shared = self.server.get_shared()
        if self.stacked:
            upload_lists, reports = stacked_round(round_idx, participants, self.cfg.execution.stack_size, self.home,
                                                  shared, self._call, lambda v: v)
            check_round(self.cfg, round_idx, reports)
            return reports, self.server.aggregate(round_idx, *upload_lists)
        chosen = set(participants)
        upload_lists, reports = [], []
        for host, group in zip(self.hosts, self.groups):
            mine = [c for c in group if c in chosen]
            if mine:
                ups, reps = (host.release if self.release_first else host.train)(round_idx, mine, shared)
                upload_lists.append(ups)
                reports += reps
        check_round(self.cfg, round_idx, reports)  # on_client_error: stop, or aggregate without the dropped
        stats = self.server.aggregate(round_idx, *upload_lists)
        if not self.release_first:
            return sorted(reports, key=lambda r: r.client_id), stats
        shared = self.server.get_shared()  # (c) the fresh aggregate, then (d) training on it
        released = {r.client_id for r in reports if not r.dropped}
        trained: list[ClientReport] = []
        for host, group in zip(self.hosts, self.groups):
            mine = [c for c in group if c in released]
            if mine:
                trained += host.train(round_idx, mine, shared)[1]
        reports = merge_phases(reports, trained)
        check_round(self.cfg, round_idx, reports)
        return reports, stats

    def evaluate(self, clients: Optional[list[int]] = None) -> list[dict[str, Any]]:
        shared = self.server.get_shared()
        mine = host_clients(self.groups, clients)
        if self.global_eval:  # one model for all: its hits once (here, one process: on the first host)
            hits = self.hosts[0].global_hits(shared, clients)
            rows = [row for i in sorted(mine) for row in self.hosts[i].score_hits(hits, mine[i])]
        else:
            rows = [row for i in sorted(mine) for row in self.hosts[i].evaluate(shared, mine[i], clients)]
        return sorted(rows, key=lambda r: r["client"])

    def commit(self, round_idx: int) -> None:
        for h in self.hosts:  # nothing is left to write: each call that changed a client wrote it
            assert not h.dirty, f"round {round_idx}: a host's clients changed outside its round calls"

    def shutdown(self) -> None:
        pass


class RayBackend:
    name = "ray"

    def __init__(self, cfg: RunConfig, data: FederationData, out_dir: str, resume_round: int) -> None:
        import ray

        self.ray = ray
        self.started_ray = init_ray(cfg.execution.address, dashboard=cfg.execution.dashboard)
        resources = ray.cluster_resources()
        cpus, gpus = float(resources.get("CPU", 1)), float(resources.get("GPU", 0))
        client_gpus, server_gpus = cfg.execution.client_gpus, cfg.execution.server_gpus
        if (client_gpus > 0 or server_gpus > 0) and gpus == 0:
            log.warning("no GPU in the Ray cluster: client_gpus/server_gpus ignored, actors run on CPU")
            client_gpus = server_gpus = 0.0
        self.groups = plan_hosts(cfg, cpus, gpus)
        self.cfg, self.out_dir = cfg, out_dir
        self.data_ref = ray.put(data)  # every actor reads the same copy from the object store
        self.classnames = list(data.classnames)
        self.server_opts = dict(num_cpus=cfg.execution.server_cpus, num_gpus=server_gpus)
        self.client_opts = dict(num_cpus=cfg.execution.client_cpus, num_gpus=client_gpus)
        self.server = self._new_server(resume_round)
        self.hosts = [self._new_host(g, resume_round) for g in self.groups]
        method = make_method(cfg)
        self.global_eval = method.predicts_globally()
        self.stacked = stacks_clients(cfg, method)
        self.home = {c: i for i, g in enumerate(self.groups) for c in g}
        threads = host_client_threads(cfg.execution) * cfg.execution.num_threads  # client_threads=0: client_cpus
        if method.independent_clients() and threads > max(1.0, cfg.execution.client_cpus):
            log.warning("each client actor runs %d threads (client_threads x num_threads) on %g reserved CPUs (client_cpus): "
                        "raise execution.client_cpus to %d, or lower client_threads, so the actors do not oversubscribe the cores",
                        threads, cfg.execution.client_cpus, threads)
        self.restarts = 0
        self.release_first = bool(get_method(cfg.method).release_first)
        self._round: dict[str, Any] = {}  # this round's inputs, kept until commit (to replay it on a new actor)
        self._shared: Any = None  # the broadcast state's object (`_shared_ref`)
        devices = ray.get([h.device_info.remote() for h in self.hosts])
        self.info = {
            "backend": "ray",
            "hosts": len(self.hosts),
            "cluster_cpus": cpus,
            "cluster_gpus": gpus,
            "devices": sorted({d["device"] for d in devices}),
        }

    # -- actors, and their replacement when one dies ---------------------------------------------
    def _new_server(self, resume_round: int):
        return self.ray.remote(ServerHost).options(**self.server_opts).remote(
            self.cfg, self.classnames, self.out_dir, resume_round
        )

    def _new_host(self, group: list[int], resume_round: int):
        return self.ray.remote(ClientHost).options(**self.client_opts).remote(
            self.cfg, self.data_ref, group, self.out_dir, resume_round
        )

    def _dead(self, what: str, error: Exception) -> None:
        """Count a lost actor; give up (re-raising) past cfg.execution.max_actor_restarts per run."""
        self.restarts += 1
        if self.restarts > self.cfg.execution.max_actor_restarts:
            raise RuntimeError(
                f"{what} died ({error.__class__.__name__}) and the run has used its {self.cfg.execution.max_actor_restarts} "
                f"actor restarts (max_actor_restarts); continue it later with output.resume={self.out_dir}"
            ) from error
        log.warning("%s died (%s); restarting it from the last completed round", what, error.__class__.__name__)

    def _replace_host(self, i: int, error: Exception) -> None:
        """A new actor for host i from the last committed round (the one before `_round`). It replays the
        calls of this round that every host had completed (`_round["done"]`: the training, or a
        release_first method's release and then its training, or a stacked round's export, stacks and
        settling of guests), with the same inputs and RNG streams: the same private state and ledger as the
        lost actor held (its uploads are discarded; the server already has identical ones)."""
        self._dead(f"client actor {i} (clients {self.groups[i][:4]}{'...' if len(self.groups[i]) > 4 else ''})", error)
        r = self._round
        self.hosts[i] = self._new_host(self.groups[i], r["round"] - 1)
        for name, calls, returns in r.get("done", []):
            if i in calls:
                refs = getattr(self.hosts[i], name).options(num_returns=returns).remote(*calls[i])
                self.ray.get(refs)

    def _get_each(self, refs: dict[int, Any], resubmit) -> dict[int, Any]:
        """ray.get per host; a host whose actor died is replaced and its call resubmitted."""
        out = {}
        while refs:
            retry = {}
            for i, ref in refs.items():
                try:
                    out[i] = self.ray.get(ref)
                except self.ray.exceptions.RayActorError as e:
                    self._replace_host(i, e)
                    retry[i] = resubmit(i)
            refs = retry
        return out

    # -- the three calls of a round --------------------------------------------------------------
    def setup(self, round_idx: int, clients: list[int]) -> tuple[list[ClientReport], dict[str, Any]]:
        self._round = {"round": round_idx, "done": []}
        chosen = set(clients)
        mine = {i: [c for c in g if c in chosen] for i, g in enumerate(self.groups)}
        mine = {i: m for i, m in mine.items() if m}
        reports, upload_refs = self._phase("setup", round_idx, mine, self._shared_ref(aggregated=False))
        flat = sorted((r for i in sorted(reports) for r in reports[i]), key=lambda r: r.client_id)
        check_round(self.cfg, round_idx, flat)
        self._round["setup"] = [upload_refs[i] for i in sorted(upload_refs)]

        def call():
            stats, self._shared = self.server.setup.options(num_returns=2).remote(round_idx, *self._round["setup"])
            return stats

        return flat, self._server_call(call, aggregated=False)

    def train_round(self, round_idx: int, participants: list[int]) -> tuple[list[ClientReport], dict[str, Any]]:
        if self._round.get("round") != round_idx:  # else Step 0 (`setup`) began this round
            self._round = {"round": round_idx, "done": []}
        shared_ref = self._shared_ref(aggregated=False)
        if self.stacked:
            stacked_uploads, flat = stacked_round(round_idx, participants, self.cfg.execution.stack_size, self.home,
                                                  shared_ref, self._calls, self.ray.get)
            check_round(self.cfg, round_idx, flat)
            self._round["uploads"] = stacked_uploads
            return flat, self._aggregate(round_idx)
        chosen = set(participants)
        mine = {i: [c for c in g if c in chosen] for i, g in enumerate(self.groups)}
        mine = {i: m for i, m in mine.items() if m}
        reports, upload_refs = self._phase("release" if self.release_first else "train", round_idx, mine, shared_ref)
        check_round(self.cfg, round_idx, [r for i in sorted(reports) for r in reports[i]])
        self._round["uploads"] = [upload_refs[i] for i in sorted(upload_refs)]
        stats = self._aggregate(round_idx)
        flat = sorted((r for i in sorted(reports) for r in reports[i]), key=lambda r: r.client_id)
        if not self.release_first:
            return flat, stats
        shared_ref = self._shared_ref(aggregated=True)
        released = {r.client_id for r in flat if not r.dropped}
        trainers = {i: [c for c in m if c in released] for i, m in mine.items()}
        trained, _ = self._phase("train", round_idx, {i: m for i, m in trainers.items() if m}, shared_ref)
        flat = merge_phases(flat, [r for i in sorted(trained) for r in trained[i]])
        check_round(self.cfg, round_idx, flat)
        return flat, stats

    def _phase(self, phase: str, round_idx: int, mine: dict[int, list[int]], shared_ref: Any) -> tuple[dict[int, Any], dict[int, Any]]:
        """One `phase` call ("train", "release" or "setup") per host with its clients: (reports, upload refs) by host."""
        refs = self._calls(phase, {i: (round_idx, mine[i], shared_ref) for i in mine}, 2)
        return {i: self.ray.get(refs[i][1]) for i in refs}, {i: refs[i][0] for i in refs}

    def _calls(self, name: str, calls: dict[int, tuple], returns: int) -> dict[int, tuple]:
        """Each listed host's `name(*args)` at once: {host: its `returns` result refs}, every call finished (a
        host whose actor died is replaced and the call resubmitted). Once every host has answered, the call
        joins `_round["done"]`, what a replacement actor replays."""
        refs: dict[int, tuple] = {}

        def submit(i: int):
            got = getattr(self.hosts[i], name).options(num_returns=returns).remote(*calls[i])
            refs[i] = tuple(got) if returns > 1 else (got,)
            return refs[i][-1]

        self._get_each({i: submit(i) for i in calls}, submit)
        self._round["done"].append((name, calls, returns))
        return refs

    def _shared_ref(self, *, aggregated: bool) -> Any:
        """The broadcast state in the object store, one object every actor reads: the one the server's last
        `aggregate_and_share` left there, else (a new or resumed run, a new server actor) asked for and put."""
        if self._shared is None:
            self._shared = self.ray.put(self._server_call(lambda: self.server.get_shared.remote(), aggregated=aggregated))
        return self._shared

    def _aggregate(self, round_idx: int) -> dict[str, Any]:
        """The server's aggregate of this round's uploads (`_round["uploads"]`): its stats; the new broadcast
        state stays in the object store for the next round (`_shared_ref`)."""
        def call():
            stats, self._shared = self.server.aggregate_and_share.options(num_returns=2).remote(round_idx, *self._round["uploads"])
            return stats

        return self._server_call(call, aggregated=False)

    def _server_call(self, call, *, aggregated: bool):
        """A server call; if the server actor died, a new one resumes from the last committed round, and
        (once the lost one had `aggregated` this round) re-aggregates this round's uploads, still in the
        object store, before the call is repeated."""
        try:
            return self.ray.get(call())
        except self.ray.exceptions.RayActorError as e:
            self._dead("the server actor", e)
            self.server = self._new_server(self._round["round"] - 1)
            self._shared = None  # asked of the new server (what the lost one answered may be lost with its node)
            if "setup" in self._round and (aggregated or "uploads" in self._round):  # Step 0 of round 0, made again
                self.ray.get(self.server.setup.options(num_returns=2).remote(self._round["round"], *self._round["setup"])[0])
            if aggregated:
                self.ray.get(self.server.aggregate.remote(self._round["round"], *self._round["uploads"]))
            return self._server_call(call, aggregated=aggregated)

    def evaluate(self, clients: Optional[list[int]] = None) -> list[dict[str, Any]]:
        shared_ref = self._shared_ref(aggregated=True)
        mine = host_clients(self.groups, clients)
        if self.global_eval:  # one model for all: every host scores a part of the rows, each client is scored from them
            parts = len(self.hosts)

            def submit_part(i: int):
                return self.hosts[i].global_hits.remote(shared_ref, clients, i, parts)

            got = self._get_each({i: submit_part(i) for i in range(parts)}, submit_part)
            hits_ref = self.ray.put(merge_hits([got[i] for i in range(parts)]))

            def submit(i: int):
                return self.hosts[i].score_hits.remote(hits_ref, mine[i])
        else:
            def submit(i: int):
                return self.hosts[i].evaluate.remote(shared_ref, mine[i], clients)

        rows = self._get_each({i: submit(i) for i in mine}, submit)
        return sorted((row for i in rows for row in rows[i]), key=lambda r: r["client"])

    def commit(self, round_idx: int) -> None:
        # no call: every host wrote its clients' state at the end of its last call of the round and the server its
        # state in `aggregate`, all of which have returned (a replacement actor replays them, writing the same)
        self._round = {}

    def shutdown(self) -> None:
        for a in [self.server, *self.hosts]:
            try:
                self.ray.kill(a)
            except Exception:  # already gone
                pass
        if self.started_ray:
            self.ray.shutdown()


def host_clients(groups: list[list[int]], clients: Optional[list[int]]) -> dict[int, list[int]]:
    """{host index: its clients among `clients` (None: all)}, hosts without any left out."""
    chosen = None if clients is None else set(clients)
    mine = {i: [c for c in g if chosen is None or c in chosen] for i, g in enumerate(groups)}
    return {i: m for i, m in mine.items() if m}


BACKENDS: dict[str, type[Backend]] = {"inline": InlineBackend, "ray": RayBackend}
