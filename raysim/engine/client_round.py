"""A client's part of a round, and what the run does when it fails (execution.on_client_error, client_timeout,
min_clients).

Both ways a host trains its clients go through this module: client by client (`ClientRound.run`, called by
`ClientHost.train` / `release` in raysim/engine/hosts.py) and in stacks (raysim/engine/batched.py, which
trains the stack itself and hands each client's result to `ClientRound.settle`). Neither re-implements
any of the policy:

- `ClientPolicy`: the three execution keys, and the driver's check of a round's reports (`check`).
- `ClientOutcome`: what became of one client's local step: ok, failed (it raised), timed_out (it ran past
  client_timeout) or non_finite (its upload holds a nan or an inf). `attempt` runs a step and judges it;
  `judge` judges a result computed elsewhere (a stack).
- `ClientRound`: one phase ("train", "release", or Step 0's "setup") of a round on one host. It settles each client's outcome
  in id order: an ok client's upload is checked, privatised and accounted (`privacy.close`) and its new
  private state kept; a failed client sends nothing and gets a dropped report; under drop what the round
  changed of it is put back (`save` / `put_back`), under fail the host stops at it (the run stops anyway).
- `RoundHost`: what a ClientRound needs of its host: the public interface `ClientHost` implements.
- `ClientReport` (what the driver learns of a client's round) and `merge_phases` (a release_first round's two
  phases, one report per client).

Privacy errors (UploadViolation, PrivacyBudgetExceeded) and other RaysimErrors are never a client's failure:
they propagate, because they are the privacy checks doing their job.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional, Protocol

import torch

from raysim.errors import ClientFailure, RaysimError, UploadViolation
from raysim.methods.base import Upload

if TYPE_CHECKING:
    from raysim.config import RunConfig
    from raysim.methods import ClientData, Method
    from raysim.methods.base import LocalResult
    from raysim.privacy.host import RoundPrivacy

log = logging.getLogger(__name__)

Phase = Literal["train", "release", "setup"]  # setup: Step 0 (Method.setup_clients), before round 0 trains
Status = Literal["ok", "failed", "timed_out", "non_finite"]


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


@dataclass(frozen=True)
class ClientPolicy:
    """What a failing client does to the run: `on_error="fail"` stops it naming the client, `"drop"` leaves the
    client out of its round (and the run stops when fewer than `min_clients` of the round's participants are
    left); `timeout` is the most wall-clock seconds a client's local step may take (0: no limit)."""

    on_error: str = "fail"  # fail | drop
    timeout: float = 0.0
    min_clients: int = 1

    @classmethod
    def of(cls, execution: Any) -> "ClientPolicy":
        """The policy of a run's execution section (on_client_error, client_timeout, min_clients)."""
        return cls(on_error=execution.on_client_error, timeout=float(execution.client_timeout),
                   min_clients=int(execution.min_clients))

    @property
    def drop(self) -> bool:
        return self.on_error == "drop"

    def check(self, round_idx: int, reports: Sequence[ClientReport], *, out_dir: str = "") -> None:
        """The driver's side, before the round is aggregated: under fail the failed client with the lowest id
        stops the run; under drop the run stops when fewer than min_clients of the round's participants
        (`reports`) are left. Raises ClientFailure; `out_dir` goes into the message's resume hint."""
        failed = sorted((r for r in reports if r.dropped), key=lambda r: r.client_id)
        if not failed:
            return
        resume = f"continue with output.resume={out_dir}" if out_dir else "continue with output.resume=OUT_DIR"
        if not self.drop:
            f = failed[0]
            raise ClientFailure(
                f"client {f.client_id} failed in round {round_idx}: {f.error}. on_client_error=fail stops the run; "
                f"fix the client or set execution.on_client_error=drop to leave failing clients out of their round ({resume})",
                client_id=f.client_id, round_idx=round_idx, error=f.error,
            )
        left = len(reports) - len(failed)
        if left < self.min_clients:
            which = "; ".join(f"client {r.client_id}: {r.error}" for r in failed)
            raise ClientFailure(
                f"round {round_idx}: {len(failed)} of {len(reports)} clients failed and were dropped, leaving {left}, "
                f"fewer than min_clients={self.min_clients} ({which}); {resume} after fixing them, or lower min_clients",
                client_id=failed[0].client_id, round_idx=round_idx, error=failed[0].error,
            )


def check_round(cfg: "RunConfig", round_idx: int, reports: Sequence[ClientReport]) -> None:
    """`ClientPolicy.check` with the run's policy (cfg.execution) and run folder (cfg.output.out_dir)."""
    ClientPolicy.of(cfg.execution).check(round_idx, reports, out_dir=cfg.output.out_dir)


# -- one client's outcome --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientOutcome:
    """What became of one client's local step: `result` (the method's LocalResult) when ok, else `error`, the
    message its dropped report and the ClientFailure carry."""

    client_id: int
    status: Status
    error: str = ""
    result: Any = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def non_finite(upload: Mapping[str, Any]) -> str:
    """What is wrong with an upload holding a nan or inf in a floating tensor ("" when all are finite)."""
    for k, v in upload.items():
        if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and not bool(torch.isfinite(v).all()):
            return f"upload {k!r} is not finite ({int((~torch.isfinite(v)).sum())} of {v.numel()} values are nan or inf)"
    return ""


def judge(client_id: int, result: Any, policy: ClientPolicy, *, seconds: Optional[float] = None,
          phase: Phase = "train") -> ClientOutcome:
    """The outcome of a step that returned `result` after `seconds` (None: not timed): non_finite when its
    upload is not finite (checked before the host's privacy check records anything), timed_out when it took
    longer than policy.timeout (enforced after it returns; its work is discarded), else ok."""
    error = non_finite(result.upload)
    if error:
        return ClientOutcome(client_id, "non_finite", error)
    if seconds is not None and policy.timeout > 0 and seconds > policy.timeout:
        what = "local release" if phase == "release" else "local training"
        return ClientOutcome(client_id, "timed_out", f"{what} took {seconds:.2f} s, more than client_timeout={policy.timeout:g} s")
    return ClientOutcome(client_id, "ok", result=result)


def attempt(client_id: int, step: Callable[[], Any], policy: ClientPolicy, *, phase: Phase = "train",
            round_idx: int = -1) -> ClientOutcome:
    """Run one client's local step (`step()`, timed) and judge it: failed when it raised (the message names the
    exception and where it was raised; the whole traceback is logged at debug), else as `judge`. A
    RaysimError propagates: it is not a client fault."""
    t0 = time.perf_counter()
    try:
        result = step()
    except RaysimError:
        raise
    except Exception as e:  # noqa: BLE001 - any fault of the client's training is the policy's business
        log.debug("round %d: client %d raised", round_idx, client_id, exc_info=True)
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return ClientOutcome(client_id, "failed", f"{type(e).__name__}: {e} (at {frame.filename}:{frame.lineno} in {frame.name})")
    return judge(client_id, result, policy, seconds=time.perf_counter() - t0, phase=phase)


# -- one phase of a round on one host ----------------------------------------------------------------------------
class RoundHost(Protocol):
    """What a ClientRound needs of the host of its clients (raysim/engine/hosts.py ClientHost)."""

    method: "Method"

    def client_data(self, cid: int) -> "ClientData":
        """The client's data slice."""

    def round_data(self, cid: int, round_idx: int) -> "ClientData":
        """The client's data for its local step in round `round_idx` (its augmented views drawn, data.augment)."""

    def private_state(self, cid: int) -> dict[str, Any]:
        """The client's private state (its initial one before its first participation)."""

    def update_private(self, cid: int, state: dict[str, Any]) -> None:
        """The client's new private state after its round: kept, and checkpointed at the host's next commit."""

    def restore_private(self, cid: int, state: dict[str, Any]) -> None:
        """Put back the private state the client had before a round it failed (nothing new to checkpoint)."""

    def open_privacy(self, cid: int, round_idx: int, shared: dict[str, torch.Tensor]) -> "RoundPrivacy":
        """The client's privacy handle for the round (privacy/host.py RoundPrivacy)."""

    def privacy_snapshot(self, cid: int) -> Any:
        """A copy of the client's privacy state (calibration, ledger), for `restore_privacy`."""

    def restore_privacy(self, cid: int, snapshot: Any) -> None:
        """Put back a `privacy_snapshot`."""

    def epsilon(self, cid: int) -> float:
        """The client's privacy spent so far."""


class StackHost(RoundHost, Protocol):
    """What client-batched training (raysim/engine/batched.py) needs of a host beyond a ClientRound's: the run's
    config, the frozen parts, the policy, whose clients it keeps and the client-by-client step. ClientHost
    (raysim/engine/hosts.py) implements it; the type lives here, below both, so neither imports the other's."""

    cfg: "RunConfig"
    env: Any

    @property
    def policy(self) -> "ClientPolicy":
        """The run's client policy (fail / drop, timeout)."""

    def is_home(self, cid: int) -> bool:
        """Whether client `cid`'s state lives on this host (else it is a guest, brought for one stack)."""

    def local_step(self, phase: Phase, round_idx: int, shared: dict[str, torch.Tensor]) -> Any:
        """The client-by-client step of `phase` for a ClientRound."""


@dataclass(frozen=True)
class Saved:
    """What a round may change of a client, kept to be put back if the client fails under drop: its privacy
    state, and its private state (None where the step does not change it in place, as a stack's)."""

    client_id: int
    privacy: Any
    private: Optional[dict[str, Any]] = None


class ClientRound:
    """One phase ("train" or "release") of round `round_idx` on one host, from the broadcast `shared`:
    settles its clients' outcomes in id order and collects their uploads and reports."""

    def __init__(self, host: RoundHost, round_idx: int, shared: dict[str, torch.Tensor], *, phase: Phase,
                 policy: ClientPolicy) -> None:
        self.host, self.round_idx, self.shared, self.phase, self.policy = host, round_idx, shared, phase, policy
        self.uploads: list[Upload] = []
        self.reports: list[ClientReport] = []

    def save(self, cid: int, *, private: bool = True) -> Saved:
        """What the round may change of client `cid` (its private state too unless `private=False`)."""
        state = copy.deepcopy(self.host.private_state(cid)) if private else None
        return Saved(cid, self.host.privacy_snapshot(cid), state)

    def put_back(self, saved: Saved) -> None:
        if saved.private is not None:
            self.host.restore_private(saved.client_id, saved.private)
        self.host.restore_privacy(saved.client_id, saved.privacy)

    def settle(self, outcome: ClientOutcome, privacy: "RoundPrivacy", saved: Optional[Saved] = None) -> bool:
        """Apply the policy to one client's outcome; False when the host is to stop (a failure under fail).

        Ok: the upload is checked against the declared releases, privatised and accounted (`privacy.close`),
        the new private state kept, and an upload and a report added. Failed: a dropped report with the error,
        and under drop `saved` put back (its ledger charged nothing: nothing left the client). A release_first
        method's train phase must upload nothing (UploadViolation)."""
        cid, host = outcome.client_id, self.host
        if not outcome.ok:
            if self.policy.drop and saved is not None:
                self.put_back(saved)
            self.reports.append(ClientReport(cid, math.nan, 0, host.epsilon(cid), {}, dropped=True, error=outcome.error))
            return self.policy.drop
        result = outcome.result
        tensors = privacy.close(result.upload)  # checked against the declared releases, privatised, accounted
        if self.phase == "train" and host.method.release_first and tensors:
            raise UploadViolation(f"client {cid}: {host.method.name} releases first, so its local_train must upload nothing "
                                  f"(it returned {sorted(tensors)}); the round's upload is what local_release returns")
        host.update_private(cid, result.private)
        up = Upload(cid, tensors, int(result.num_samples))
        self.uploads.append(up)
        loss = float(result.metrics.get("loss", math.nan)) if self.phase == "train" else math.nan  # a release trains nothing
        self.reports.append(ClientReport(cid, loss, up.nbytes(), host.epsilon(cid), dict(result.metrics)))
        return True

    def run(self, client_ids: Sequence[int], step: Callable[[int, "RoundPrivacy"], "LocalResult"], *,
            workers: int = 1) -> tuple[list[Upload], list[ClientReport]]:
        """Client by client, in id order: open the client's privacy handle, `attempt` its `step(cid, privacy)`
        (timed, its upload's finiteness checked) and `settle` the outcome (under drop, what the round may change
        is saved first); under fail, stop at the first failed client. With `workers` > 1 (the host's method
        declares independent clients) the steps run at once on that many threads (`run_concurrently`)."""
        ids = sorted(client_ids)
        if workers > 1 and len(ids) > 1:
            return self.run_concurrently(ids, step, workers)
        for cid in ids:
            saved = self.save(cid) if self.policy.drop else None
            privacy = self.host.open_privacy(cid, self.round_idx, self.shared)
            outcome = attempt(cid, lambda: step(cid, privacy), self.policy, phase=self.phase, round_idx=self.round_idx)  # noqa: B023 - called at once
            if not self.settle(outcome, privacy, saved):
                break
        return self.result()

    def run_concurrently(self, ids: list[int], step: Callable[[int, "RoundPrivacy"], "LocalResult"],
                         workers: int) -> tuple[list[Upload], list[ClientReport]]:
        """`run` with the clients' steps on `workers` threads. This thread does everything that touches the
        host's shared state, in id order: before the steps, each client's saved state, private state (made
        from its own stream on first use), data slice and privacy handle; after them, `settle` (its upload
        checked, privatised and accounted, its private state kept). The threads run only the steps, each a
        function of its client's own inputs and stream (Method.independent_clients), so every client computes
        exactly what it computes client by client, and the uploads and reports come out in the same order:
        the results are bitwise the same. Under fail the settling stops at the first failed client, as
        client by client; the clients after it trained but are not settled (nothing of theirs is kept; their
        privacy state is put back). A step's time (client_timeout) is its wall time on its thread, which
        the other threads' load lengthens."""
        from concurrent.futures import ThreadPoolExecutor

        host = self.host
        opened = []
        for cid in ids:
            saved = self.save(cid, private=self.policy.drop)
            host.private_state(cid)
            host.client_data(cid)
            opened.append((cid, saved, host.open_privacy(cid, self.round_idx, self.shared)))

        def one(cid: int, privacy: "RoundPrivacy") -> ClientOutcome:
            return attempt(cid, lambda: step(cid, privacy), self.policy, phase=self.phase, round_idx=self.round_idx)

        unsettled: list[tuple[int, Saved, "RoundPrivacy"]] = []
        with ThreadPoolExecutor(max_workers=min(workers, len(ids)), thread_name_prefix="raysim-client") as pool:
            futures = [pool.submit(one, cid, privacy) for cid, _, privacy in opened]
            try:
                for k, ((_, saved, privacy), fut) in enumerate(zip(opened, futures)):
                    if not self.settle(fut.result(), privacy, saved if self.policy.drop else None):
                        unsettled = opened[k + 1:]
                        break
            finally:
                for fut in futures:
                    fut.cancel()
        for cid, saved, _ in unsettled:  # every step has returned (the pool waited): nothing writes their state now
            host.restore_privacy(cid, saved.privacy)
        return self.result()

    def result(self) -> tuple[list[Upload], list[ClientReport]]:
        """(uploads, reports) of the clients settled so far, in id order."""
        return self.uploads, self.reports


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
