"""The two kinds of host: `ClientHost` (home of one or many clients) and `ServerHost`.

They are plain Python classes. The Ray backend wraps them with `ray.remote` (ClientActor, ServerActor);
the inline backend calls them directly, so both backends run exactly the same code.

A ClientHost holds the method's frozen parts once, and per client: the data slice and the private state;
its `HostPrivacy` (privacy/host.py) holds each client's calibrated noise and ledger and checks every upload
against the method's declared releases. Private state leaves the host only into the client's own
checkpoint; metrics go to the driver, never to the server. A round is one `train` call per host, or for a
method that releases first (`Method.release_first`, SPEC 3.4) a `release` call, the server's
aggregation, then a `train` call whose uploads are empty (raysim/engine/backends.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from raysim.config import RunConfig, keeps_all_client_states
from raysim.config.checks import make_method
from raysim.data.federation import ClientSlices, FederationData
from raysim.errors import ClientFailure, RaysimError, UploadViolation
from raysim.methods import ClientData, EnvSpec, Method, Upload
from raysim.methods.base import ServerResult
from raysim.sampling import generator, schedule
from raysim.storage.store import StateStore

log = logging.getLogger(__name__)


@dataclass
class ClientReport:
    """What the driver learns of a client's round (never its private state)."""

    client_id: int
    loss: float
    bytes_up: int
    epsilon: float
    metrics: dict[str, float] = field(default_factory=dict)
    dropped: bool = False  # its local training failed (raised, non-finite upload, past client_timeout): no upload
    error: str = ""  # what went wrong, when dropped


def env_spec(cfg: RunConfig, classnames: list[str]) -> EnvSpec:
    from raysim.models.clip import FastPaths, ModelSpec, resolve_device

    return EnvSpec(
        model=ModelSpec(cfg.model.name, cfg.model.pretrained, cache_dir=cfg.output.cache_dir,
                        fast=FastPaths(cfg.execution.autocast, cfg.execution.compile)),
        classnames=list(classnames),
        device=str(resolve_device(cfg.execution.device)),
        dataset=cfg.data.dataset,
    )


def initial_private(method: Method, env: Any, data: ClientData, seed: int) -> dict[str, Any]:
    """A client's private state before its first participation (from its own seeded stream)."""
    return method.init_private(env, data, generator(seed, "init", data.client_id))


def broadcast_state(method: Method, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The part of the server state that is broadcast (without the method's `server_only` keys)."""
    hidden = tuple(method.server_only)
    return {k: v for k, v in state.items() if not any(k == h or k.startswith(h + ".") for h in hidden)}


def check_upload(method: Method, client_id: int, upload: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Only tensors the method declares as shared reach the server (the client host checked them, with
    their releases, in privacy/host.py; the server checks the names again)."""
    allowed = set(method.uploads)
    extra = sorted(set(upload) - allowed)
    if extra:
        raise UploadViolation(
            f"client {client_id} tried to upload {extra}, which {method.name} does not declare as shared "
            f"(declared: {sorted(allowed)})"
        )
    clean = {}
    for k, v in upload.items():
        if not isinstance(v, torch.Tensor):
            raise UploadViolation(f"client {client_id}: upload {k!r} must be a tensor, got {type(v).__name__}")
        clean[k] = v.detach().to("cpu", copy=True)
    return clean


class ClientHost:
    """Hosts a fixed set of clients for the whole run (one Ray actor, or in-process)."""

    def __init__(self, cfg: RunConfig, data: FederationData, client_ids: list[int], out_dir: str, resume_round: int = -1) -> None:
        torch.set_num_threads(cfg.execution.num_threads)
        self.cfg = cfg
        self.method = make_method(cfg)
        spec = env_spec(cfg, data.classnames)
        self.device = torch.device(spec.device)
        self.env = self.method.build_env(spec, role="client")
        self.num_classes = len(data.classnames)
        self.clients = sorted(client_ids)
        self.data: Mapping[int, ClientData] = ClientSlices(data, self.clients)  # each client's slice, made on first use
        from raysim.engine.evaluation import PROTOCOLS

        self.protocol = PROTOCOLS.get(cfg.eval.protocol)(data, batch_size=cfg.eval.batch_size)
        self.store = StateStore(out_dir, keep_all_clients=keeps_all_client_states(cfg.output))
        self.private: dict[int, dict[str, Any]] = {}
        self.dirty: set[int] = set()
        self.participation = self._participation_counts()
        from raysim.privacy.host import HostPrivacy

        self.privacy = HostPrivacy(dp=self.method.dp, method=self.method, seed=cfg.train.seed, batch_size=cfg.train.batch_size,
                                   releases_per_client=self._rounds_for_calibration)
        for cid in self.clients:
            saved = self.store.load_client(cid, resume_round) if resume_round >= 0 else None
            if saved is not None:
                self.private[cid] = saved["private"]
                legacy = {"multiplier": saved.get("sigma"), "ledger": saved.get("ledger")}  # checkpoints before declared releases
                self.privacy.load(cid, saved.get("privacy", legacy))

    def _participation_counts(self) -> dict[int, int]:
        sched = schedule(self.cfg.train.seed, self.cfg.train.rounds, self.cfg.train.num_clients, self.cfg.train.participation)
        counts = {cid: 0 for cid in self.clients}
        for part in sched:
            for cid in part:
                if cid in counts:
                    counts[cid] += 1
        return counts

    # -- private state ----------------------------------------------------------------------
    def _private(self, cid: int) -> dict[str, Any]:
        if cid not in self.private:
            self.private[cid] = initial_private(self.method, self.env, self.data[cid], self.cfg.train.seed)
        return self.private[cid]

    def _rounds_for_calibration(self, cid: int) -> int:
        return self.participation[cid] if self.cfg.dp.calibration == "participated" else self.cfg.train.rounds

    def epsilon(self, cid: int) -> float:
        return self.privacy.epsilon(cid)

    # -- one round --------------------------------------------------------------------------
    def train(self, round_idx: int, client_ids: list[int], shared: dict[str, torch.Tensor]) -> tuple[list[Upload], list[ClientReport]]:
        """Train each of `client_ids` (in id order) from `shared`. A client whose local training fails
        (raises, returns a non-finite upload, or takes longer than cfg.execution.client_timeout) sends nothing and
        gets a report with `dropped=True` and the error; its private state and privacy ledger stay as
        before the round (nothing left it, so nothing is charged). The driver applies the policy
        (`check_round`). Under on_client_error=fail the host stops at its first failed client: the run
        stops anyway. Privacy errors (UploadViolation, PrivacyBudgetExceeded) and other RaysimErrors
        always propagate: they are not client faults but the privacy checks doing their job.
        For a `release_first` method this is the round's second half, after the server aggregated the
        clients' `release`: local_train must upload nothing, and a failed client keeps its state and ledger
        as after its release (which was sent, so stays charged)."""
        shared = {k: v.to(self.device) for k, v in shared.items()}
        from raysim.engine.batched import train_stack

        stacked = train_stack(self, round_idx, client_ids, shared)  # execution.batch_clients: None = client by client
        if stacked is not None:
            return stacked
        return self._each_client(round_idx, client_ids, shared, phase="train")

    def release(self, round_idx: int, client_ids: list[int], shared: dict[str, torch.Tensor]) -> tuple[list[Upload], list[ClientReport]]:
        """The first half of a `release_first` method's round: each of `client_ids` (in id order) makes its
        upload from its current state (`local_release`, rng stream "release"), checked, privatised and
        accounted by the host like any upload; the server aggregates these, then `train` runs on the new
        broadcast. Failures as in `train`: a client whose release fails sends nothing and keeps its state
        and ledger (the driver leaves it out of the round's training)."""
        if not self.method.release_first:
            raise RaysimError(f"{self.method.name} does not release first (release_first is False): its uploads come from train")
        shared = {k: v.to(self.device) for k, v in shared.items()}
        return self._each_client(round_idx, client_ids, shared, phase="release")

    def _each_client(self, round_idx: int, client_ids: list[int], shared: dict[str, torch.Tensor], *,
                     phase: str) -> tuple[list[Upload], list[ClientReport]]:
        """One phase ("train" or "release") for each of `client_ids` in id order, client by client: open
        the client's privacy handle, run the method, check, privatise and account the upload, keep the new
        private state; a failed client gets a dropped report (and under drop its state and ledger back)."""
        uploads, reports = [], []
        drop = self.cfg.execution.on_client_error == "drop"
        for cid in sorted(client_ids):
            # under drop, what the round may change is kept to be put back if the client fails
            saved = (copy.deepcopy(self._private(cid)), self.privacy.snapshot(cid)) if drop else None
            privacy = self.privacy.open(cid, round_idx, self.data[cid].num_train, shared)
            error, result = self._local_train(round_idx, cid, shared, privacy, phase=phase)
            if error:
                if saved is not None:
                    self.private[cid] = saved[0]
                    self.privacy.restore(cid, saved[1])
                reports.append(ClientReport(cid, math.nan, 0, self.epsilon(cid), {}, dropped=True, error=error))
                if not drop:
                    break
                continue
            tensors = privacy.close(result.upload)  # checked against the declared releases, privatised, accounted
            if phase == "train" and self.method.release_first and tensors:
                raise UploadViolation(f"client {cid}: {self.method.name} releases first, so its local_train must upload nothing "
                                      f"(it returned {sorted(tensors)}); the round's upload is what local_release returns")
            self.private[cid] = result.private
            self.dirty.add(cid)
            up = Upload(cid, tensors, int(result.num_samples))
            uploads.append(up)
            loss = float(result.metrics.get("loss", math.nan)) if phase == "train" else math.nan  # a release trains nothing
            reports.append(ClientReport(cid, loss, up.nbytes(), self.epsilon(cid), dict(result.metrics)))
        return uploads, reports

    def _local_train(self, round_idx: int, cid: int, shared: dict[str, torch.Tensor], privacy: Any, *,
                     phase: str = "train") -> tuple[str, Any]:
        """The method's local_train (or, phase="release", local_release) for one client: ("", result), or
        (what went wrong, None) when it raised, returned a non-finite upload (checked before the host's
        privacy check records anything), or took longer than cfg.execution.client_timeout wall-clock seconds
        (measured around the call, so enforced after it returns; its work is discarded). Each phase draws
        from its own stream, generator(seed, phase, round, client)."""
        step = self.method.local_release if phase == "release" else self.method.local_train
        t0 = time.perf_counter()
        try:
            result = step(
                self.env,
                shared,
                self._private(cid),
                self.data[cid],
                rng=generator(self.cfg.train.seed, phase, round_idx, cid),
                privacy=privacy,
            )
        except RaysimError:
            raise
        except Exception as e:  # noqa: BLE001 - any fault of the client's training is the policy's business
            log.debug("round %d: client %d raised", round_idx, cid, exc_info=True)  # the whole traceback, for debugging
            frame = traceback.extract_tb(e.__traceback__)[-1]
            return f"{type(e).__name__}: {e} (at {frame.filename}:{frame.lineno} in {frame.name})", None
        seconds = time.perf_counter() - t0
        for k, v in result.upload.items():
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and not bool(torch.isfinite(v).all()):
                return f"upload {k!r} is not finite ({int((~torch.isfinite(v)).sum())} of {v.numel()} values are nan or inf)", None
        if self.cfg.execution.client_timeout > 0 and seconds > self.cfg.execution.client_timeout:
            what = "local release" if phase == "release" else "local training"
            return f"{what} took {seconds:.2f} s, more than client_timeout={self.cfg.execution.client_timeout:g} s", None
        return "", result

    @torch.no_grad()
    def evaluate(self, shared: dict[str, torch.Tensor], client_ids: Optional[list[int]] = None,
                 among: Optional[list[int]] = None) -> list[dict[str, Any]]:
        """Each of `client_ids`' models (the method's predictor; default: every client here) scored by the
        run's evaluation protocol, among the evaluated clients `among` (None: all clients; a client's
        Cross-Client accuracy is on the other evaluated clients' test splits)."""
        shared = {k: v.to(self.device) for k, v in shared.items()}
        out = []
        for cid in sorted(client_ids if client_ids is not None else self.clients):
            predict = self.method.predictor(self.env, shared, self._private(cid), self.data[cid])
            out.append({"client": cid, **self.protocol.score(cid, predict, among), "epsilon": self.epsilon(cid)})
        return out

    @torch.no_grad()
    def global_hits(self, shared: dict[str, torch.Tensor], among: Optional[list[int]] = None, part: int = 0, parts: int = 1) -> Any:
        """For a method whose predictor is every client's (Method.predicts_globally): that one model's hits
        on part `part` of `parts` of the test rows the evaluated clients' scores read (cut at eval batch
        boundaries, so the parts' batches are the whole's). Scored per client by `score_hits`."""
        from raysim.engine.evaluation import block_part

        shared = {k: v.to(self.device) for k, v in shared.items()}
        c0 = self.clients[0]  # any client: the declaration says its state and data do not enter the predictor
        predict = self.method.predictor(self.env, shared, self._private(c0), self.data[c0])
        rows = block_part(self.protocol.rows(among), part, parts, self.protocol.batch_size)
        return self.protocol.hits(predict, rows)

    def score_hits(self, hits: Any, client_ids: list[int]) -> list[dict[str, Any]]:
        """The evaluation rows of `client_ids` from the global model's hits (`global_hits`, all parts merged)."""
        cids = sorted(client_ids)
        return [{"client": c, **row, "epsilon": self.epsilon(c)} for c, row in zip(cids, self.protocol.score_many(cids, hits))]

    def commit(self, round_idx: int) -> None:
        """Write the private state of every client that changed this round, then drop stale versions."""
        for cid in sorted(self.dirty):
            self.store.save_client(cid, round_idx, {"private": self.private[cid], "privacy": self.privacy.state(cid).to_dict()})
            self.store.prune_client(cid, round_idx - 1)
        self.dirty.clear()

    def device_info(self) -> dict[str, Any]:
        return {"device": str(self.device), "clients": self.clients, "cuda": torch.cuda.is_available()}


def check_round(cfg: RunConfig, round_idx: int, reports: list[ClientReport]) -> None:
    """The driver's side of on_client_error, before the round is aggregated: under `fail` the failed
    client with the lowest id stops the run; under `drop` the run stops when fewer than cfg.execution.min_clients
    of the round's participants are left. Raises ClientFailure."""
    failed = sorted((r for r in reports if r.dropped), key=lambda r: r.client_id)
    if not failed:
        return
    resume = f"continue with output.resume={cfg.output.out_dir}" if cfg.output.out_dir else "continue with output.resume=OUT_DIR"
    if cfg.execution.on_client_error != "drop":
        f = failed[0]
        raise ClientFailure(
            f"client {f.client_id} failed in round {round_idx}: {f.error}. on_client_error=fail stops the run; "
            f"fix the client or set on_client_error=drop to leave failing clients out of their round ({resume})",
            client_id=f.client_id, round_idx=round_idx, error=f.error,
        )
    left = len(reports) - len(failed)
    if left < cfg.execution.min_clients:
        which = "; ".join(f"client {r.client_id}: {r.error}" for r in failed)
        raise ClientFailure(
            f"round {round_idx}: {len(failed)} of {len(reports)} clients failed and were dropped, leaving {left}, "
            f"fewer than min_clients={cfg.execution.min_clients} ({which}); {resume} after fixing them, or lower min_clients",
            client_id=failed[0].client_id, round_idx=round_idx, error=failed[0].error,
        )


def merge_phases(released: list[ClientReport], trained: list[ClientReport]) -> list[ClientReport]:
    """One report per participant of a `release_first` round, in client order: a client whose release
    failed keeps that report (it did not train); the others get their training report (loss, metrics,
    epsilon after the round; dropped when training failed) with the release's bytes_up (what it sent)
    and any metrics the release reported."""
    by_id = {r.client_id: r for r in trained}
    out = []
    for r in sorted(released, key=lambda r: r.client_id):
        t = by_id.get(r.client_id)
        if r.dropped or t is None:
            out.append(r)
        else:
            out.append(dataclasses.replace(t, bytes_up=r.bytes_up, metrics={**r.metrics, **t.metrics}))
    return out


def server_classnames(method: Method, classnames: list[str]) -> list[str]:
    """What the server may know of the classes: their names, or only how many there are (a method
    whose privacy model hides class names from the server declares `Needs(server_classnames=False)`)."""
    if method.needs().server_classnames:
        return list(classnames)
    return [f"class {i}" for i in range(len(classnames))]


class ServerHost:
    """Holds the global state, aggregates uploads in client-id order, runs server-side training.

    Keys a method lists in `server_only` (e.g. a generator's weights) are kept and checkpointed here but
    never broadcast, so they do not count as communication."""

    def __init__(self, cfg: RunConfig, classnames: list[str], out_dir: str, resume_round: int = -1) -> None:
        torch.set_num_threads(cfg.execution.num_threads)
        self.cfg = cfg
        self.method = make_method(cfg)
        spec = env_spec(cfg, server_classnames(self.method, classnames))
        self.env = self.method.build_env(spec, role="server")
        self.store = StateStore(out_dir)
        saved = self.store.load_server(resume_round) if resume_round >= 0 else None
        if saved is not None:
            self.state = saved
        else:
            self.state = {
                k: v.detach().cpu() for k, v in self.method.init_shared(self.env, generator(cfg.train.seed, "server-init")).items()
            }

    def get_shared(self) -> dict[str, torch.Tensor]:
        """The broadcast part of the server state."""
        return broadcast_state(self.method, self.state)

    def aggregate(self, round_idx: int, *upload_lists: list[Upload]) -> dict[str, Any]:
        uploads = sorted((u for lst in upload_lists for u in lst), key=lambda u: u.client_id)
        for u in uploads:
            check_upload(self.method, u.client_id, u.tensors)
        pre = self.get_shared()
        down = sum(t.numel() * t.element_size() for t in pre.values()) * len(uploads)
        if self.cfg.output.record_uploads:  # the attacker's view: only checked, declared tensors
            self.store.save_uploads(round_idx, {
                "pre": pre,
                "uploads": {u.client_id: dict(u.tensors) for u in uploads},
                "num_samples": {u.client_id: u.num_samples for u in uploads},
            })
        metrics: dict[str, float] = {}
        if uploads:
            new = self.method.aggregate(self.env, self.state, uploads, generator(self.cfg.train.seed, "server", round_idx))
            if isinstance(new, ServerResult):
                metrics = dict(new.metrics)
                new = new.state
            self.state = {k: v.detach().cpu() for k, v in new.items()}
        return {"bytes_up": sum(u.nbytes() for u in uploads), "bytes_down": down, "server_metrics": metrics}

    def commit(self, round_idx: int) -> None:
        self.store.save_server(round_idx, self.state)
