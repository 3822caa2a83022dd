"""The two kinds of host: `ClientHost` (home of one or many clients) and `ServerHost`.

They are plain Python classes. The Ray backend wraps them with `ray.remote` (ClientActor, ServerActor);
the inline backend calls them directly, so both backends run exactly the same code.

A ClientHost holds the method's frozen parts once, and per client: the data slice and the private state;
its `HostPrivacy` (privacy/host.py) holds each client's calibrated noise and ledger and checks every upload
against the method's declared releases. Private state leaves the host only into the client's own
checkpoint; metrics go to the driver, never to the server. What a client's failure does (on_client_error,
client_timeout, min_clients) is raysim/engine/client_round.py. A round is one `train` call per host, or for a
method that releases first (`Method.release_first`, SPEC 3.4) a `release` call, the server's
aggregation, then a `train` call whose uploads are empty (raysim/engine/backends.py). A client-batched round
(raysim/engine/batched.py `stacked_round`) is `export_guests` on the hosts whose clients join other hosts'
stacks, `train_stacks` on the hosts that lead stacks (with those guests, held for the call only), and
`settle_guests` on the guests' own hosts (their results back, and the clients of a stack that fell back
trained client by client).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch

from raysim.build import env_spec, make_method
from raysim.config import RunConfig, keeps_all_client_states
from raysim.data.federation import ClientSlices, FederationData
from raysim.engine.client_round import ClientPolicy, ClientReport, ClientRound, Phase
from raysim.errors import RaysimError, UploadViolation
from raysim.methods import ClientData, Method, Upload
from raysim.methods.base import OptimizerCarry, ServerResult, broadcast_state, carrying, initial_private
from raysim.safeio import serialize
from raysim.sampling import generator, schedule
from raysim.storage.store import StateStore

if TYPE_CHECKING:
    from raysim.engine.batched import GuestResult, GuestState
    from raysim.privacy.host import RoundPrivacy


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
        torch.set_num_threads(cfg.execution.num_threads)  # process-wide: every client thread's torch ops use as many
        self.client_threads = host_client_threads(cfg.execution)
        self.cfg = cfg
        self.method = make_method(cfg)
        spec = env_spec(cfg, data.classnames)
        self.device = torch.device(spec.device)
        self.env = self.method.build_env(spec, role="client")
        self.num_classes = len(data.classnames)
        self.clients = sorted(client_ids)
        self.federation = data
        self.data: Mapping[int, ClientData] = ClientSlices(data, self.clients)  # each client's slice, made on first use
        self.guests: dict[int, int] = {}  # this round's guests (clients of other hosts in its stacks): rounds calibrated for
        self._guest_data = ClientSlices(data, list(range(cfg.train.num_clients)), keep=int(cfg.execution.stack_size))
        from raysim.engine.evaluation import PROTOCOLS

        self.protocol = PROTOCOLS.get(cfg.eval.protocol)(data, batch_size=cfg.eval.batch_size)
        self.store = StateStore(out_dir, keep_all_clients=keeps_all_client_states(cfg.output))
        self.private: dict[int, dict[str, Any]] = {}
        self.dirty: set[int] = set()
        # train.optimizer_state=shared: the one SGD state every client's round continues, in id order (config checks: one
        # host holds every client), as of the end of `resume_round` on a resume
        self.carry: Optional[OptimizerCarry] = None
        if cfg.train.optimizer_state == "shared":
            self.carry = OptimizerCarry.from_dict(self.store.load_shared_optimizer(resume_round) if resume_round >= 0 else None)
        self._participation: Optional[dict[int, int]] = None  # computed when a calibration first needs it
        from raysim.privacy.host import HostPrivacy

        self.privacy = HostPrivacy(dp=self.method.dp, method=self.method, seed=cfg.train.seed, batch_size=cfg.train.batch_size,
                                   releases_per_client=self._rounds_for_calibration)
        for cid in self.clients:
            saved = self.store.load_client(cid, resume_round) if resume_round >= 0 else None
            if saved is not None:
                self.private[cid] = saved["private"]
                legacy = {"multiplier": saved.get("sigma"), "ledger": saved.get("ledger")}  # checkpoints before declared releases
                self.privacy.load(cid, saved.get("privacy", legacy))

    @property
    def participation(self) -> dict[int, int]:
        """How many rounds each of the host's clients takes part in (the whole schedule, walked once, lazily:
        only DP calibration over the participated rounds needs it; every client takes part in every round at
        participation 1)."""
        if self._participation is None:
            self._participation = self._participation_counts()
        return self._participation

    def _participation_counts(self) -> dict[int, int]:
        if self.cfg.train.participation >= 1.0:
            return {cid: self.cfg.train.rounds for cid in self.clients}
        sched = schedule(self.cfg.train.seed, self.cfg.train.rounds, self.cfg.train.num_clients, self.cfg.train.participation)
        counts = {cid: 0 for cid in self.clients}
        for part in sched:
            for cid in part:
                if cid in counts:
                    counts[cid] += 1
        return counts

    # -- a client's state, for its round (the RoundHost interface of raysim/engine/client_round.py) ------------
    def client_data(self, cid: int) -> ClientData:
        """The client's data slice (a guest's as its own host would read it: the same arrays, the same slice)."""
        return self._guest_data[cid] if cid in self.guests else self.data[cid]

    def is_home(self, cid: int) -> bool:
        """The client lives on this host (not a guest of its stacks)."""
        return cid in self.data

    def round_data(self, cid: int, round_idx: int) -> ClientData:
        """The client's data for its local step in round `round_idx`: its slice, with one augmented view per
        training image per local epoch drawn from the (round, client) stream when data.augment is on
        (`ClientData.for_round`; the slice itself otherwise)."""
        return self.client_data(cid).for_round(self.cfg.train.seed, round_idx, self.cfg.train.local_epochs)

    def private_state(self, cid: int) -> dict[str, Any]:
        """The client's private state (its initial one, from its own seeded stream, before its first participation)."""
        if cid not in self.private:
            self.private[cid] = initial_private(self.method, self.env, self.client_data(cid), self.cfg.train.seed)
        return self.private[cid]

    def update_private(self, cid: int, state: dict[str, Any]) -> None:
        """The client's new private state after its round: kept, and checkpointed at the next `commit`."""
        self.private[cid] = state
        self.dirty.add(cid)

    def restore_private(self, cid: int, state: dict[str, Any]) -> None:
        """Put back the private state the client had before a round it failed (nothing new to checkpoint)."""
        self.private[cid] = state

    def open_privacy(self, cid: int, round_idx: int, shared: dict[str, torch.Tensor]) -> RoundPrivacy:
        """The client's privacy handle for round `round_idx` (privacy/host.py RoundPrivacy)."""
        return self.privacy.open(cid, round_idx, self.client_data(cid).num_train, shared)

    def privacy_snapshot(self, cid: int) -> Any:
        """A copy of the client's privacy state (calibration, ledger, one-shot releases), for `restore_privacy`."""
        return self.privacy.snapshot(cid)

    def restore_privacy(self, cid: int, snapshot: Any) -> None:
        """Put back a `privacy_snapshot` (the client's round was abandoned before anything left it)."""
        self.privacy.restore(cid, snapshot)

    @property
    def policy(self) -> ClientPolicy:
        """What a failing client does to the run (execution.on_client_error, client_timeout, min_clients)."""
        return ClientPolicy.of(self.cfg.execution)

    def _rounds_for_calibration(self, cid: int) -> int:
        if cid in self.guests:
            return self.guests[cid]  # its own host's count, brought with it
        return self.participation[cid] if self.cfg.dp.calibration == "participated" else self.cfg.train.rounds

    def epsilon(self, cid: int) -> float:
        return self.privacy.epsilon(cid)

    # -- one round --------------------------------------------------------------------------
    def train(self, round_idx: int, client_ids: list[int], shared: dict[str, torch.Tensor], *,
              stacked: bool = True) -> tuple[list[Upload], list[ClientReport]]:
        """Train each of `client_ids` (in id order) from `shared`. A client whose local training fails
        (raises, returns a non-finite upload, or takes longer than cfg.execution.client_timeout) sends nothing and
        gets a report with `dropped=True` and the error; its private state and privacy ledger stay as
        before the round (nothing left it, so nothing is charged). The driver applies the policy
        (raysim/engine/client_round.py `check_round`). Under on_client_error=fail the host stops at its
        first failed client: the run stops anyway. Privacy errors (UploadViolation, PrivacyBudgetExceeded) and other RaysimErrors
        always propagate: they are not client faults but the privacy checks doing their job.
        For a `release_first` method this is the round's second half, after the server aggregated the
        clients' `release`: local_train must upload nothing, and a failed client keeps its state and ledger
        as after its release (which was sent, so stays charged).
        With execution.batch_clients (and `stacked`) the clients train in stacks of execution.stack_size
        (raysim/engine/batched.py); the backends plan a round's stacks across hosts with `train_stacks`."""
        shared = {k: v.to(self.device) for k, v in shared.items()}
        from raysim.engine.batched import train_stack

        got = train_stack(self, round_idx, client_ids, shared) if stacked else None  # None: client by client
        if got is None:
            got = self._each_client(round_idx, client_ids, shared, phase="train")
        self.commit(round_idx)
        return got

    # -- a stacked round across hosts (raysim/engine/batched.py stacked_round) --------------------------------
    def export_guests(self, round_idx: int, by_trainer: dict[int, list[int]]) -> dict[int, list[GuestState]]:
        """What host t needs of this host's clients `by_trainer[t]`, guests of its stacks in round `round_idx`:
        a copy of each one's private state, privacy state and calibration count (the clients' own state stays
        here, unchanged until `settle_guests`)."""
        from raysim.engine.batched import GuestState

        return {t: [GuestState(cid, copy.deepcopy(self.private_state(cid)), self.privacy_snapshot(cid),
                               self._rounds_for_calibration(cid), self._on_disk(cid)) for cid in sorted(cids)]
                for t, cids in by_trainer.items()}

    def _checkpoint(self, cid: int) -> dict[str, Any]:
        """What `commit` writes of client `cid`."""
        return {"private": self.private[cid], "privacy": self.privacy.state(cid).to_dict()}

    def _on_disk(self, cid: int) -> bool:
        """The client's state as it is now is its checkpoint on disk (written by this host, byte for byte)."""
        return cid in self.private and cid in self.privacy.states and self.store.holds(cid, self._checkpoint(cid))

    def train_stacks(self, round_idx: int, stacks: list[list[int]], shared: dict[str, torch.Tensor],
                     guests: list[GuestState]) -> tuple[list[Upload], list[ClientReport], dict[str, Any]]:
        """Train the round's `stacks` this host leads (their first member is its own), with their members of
        other hosts, `guests`, held here for the call: (uploads, reports, {"back": a GuestResult per guest not
        to be redone, "redo": the guests whose stack fell back, to train client by client on their own
        hosts}). Nothing of a guest stays here, nor is checkpointed here. A guest whose private and privacy
        state left the stack byte for byte as they came, and came as its own host's checkpoint on disk
        (PromptFL without DP after a client's first round: no private state, no ledger), is not sent back: its
        own host would have nothing to settle or write (one call less a round on Ray)."""
        from raysim.engine.batched import GuestResult, train_stacks

        shared = {k: v.to(self.device) for k, v in shared.items()}
        came = {g.client_id: serialize((g.private, g.privacy)) for g in guests if g.on_disk}
        for g in guests:
            if g.client_id in self.data:
                raise RaysimError(f"client {g.client_id} lives on this host; it cannot be its guest")
            self.guests[g.client_id] = int(g.rounds)
            self.private[g.client_id] = g.private
            self.privacy.restore(g.client_id, g.privacy)
        try:
            uploads, reports, redo = train_stacks(self, round_idx, stacks, shared)
            again = set(redo)
            back = [GuestResult(cid, self.private[cid], self.privacy_snapshot(cid), cid in self.dirty)
                    for cid in sorted(self.guests) if cid not in again]
            back = [g for g in back if came.get(g.client_id) != serialize((g.private, g.privacy))]
        finally:
            for cid in list(self.guests):
                self.private.pop(cid, None)
                self.privacy.restore(cid, None)
                self.dirty.discard(cid)
            self.guests.clear()
        self.commit(round_idx)
        return uploads, reports, {"back": back, "redo": sorted(redo)}

    def settle_guests(self, round_idx: int, back: list[GuestResult], redo: list[int],
                      shared: dict[str, torch.Tensor]) -> tuple[list[Upload], list[ClientReport]]:
        """This host's clients back from other hosts' stacks: their private and privacy state as trained there
        (checkpointed here at the next `commit` when it changed); then the clients of `redo`, whose stack fell
        back, client by client here."""
        for g in back:
            if g.client_id not in self.data:
                raise RaysimError(f"client {g.client_id} does not live on this host")
            self.private[g.client_id] = g.private
            self.privacy.restore(g.client_id, g.privacy)
            if g.changed:
                self.dirty.add(g.client_id)
        got: tuple[list[Upload], list[ClientReport]] = ([], [])
        if redo:
            shared = {k: v.to(self.device) for k, v in shared.items()}
            got = self._each_client(round_idx, redo, shared, phase="train")
        self.commit(round_idx)
        return got

    def local_step(self, phase: Phase, round_idx: int, shared: dict[str, torch.Tensor]) -> Any:
        """The client-by-client step of `phase` for a ClientRound: step(cid, privacy) -> the method's LocalResult,
        drawing from its own stream, generator(seed, phase, round, client)."""
        step = {"release": self.method.local_release, "setup": self.method.local_setup}.get(phase, self.method.local_train)

        def one(cid: int, privacy: Any) -> Any:
            return step(self.env, shared, self.private_state(cid), self.round_data(cid, round_idx),
                        rng=generator(self.cfg.train.seed, phase, round_idx, cid), privacy=privacy)

        if self.carry is None or phase != "train":
            return one
        carry = self.carry

        def continuing(cid: int, privacy: Any) -> Any:  # the client continues the previous one's SGD state and leaves its own
            before = OptimizerCarry(carry.buffers)
            try:
                with carrying(carry):
                    result = one(cid, privacy)
            except BaseException:
                carry.buffers = before.buffers  # a failed client hands nothing on (the run stops: on_client_error=fail)
                raise
            privacy.hand_on_optimizer()  # under DP: its ledger records that this voids its guarantee
            return result

        return continuing

    def release(self, round_idx: int, client_ids: list[int], shared: dict[str, torch.Tensor]) -> tuple[list[Upload], list[ClientReport]]:
        """The first half of a `release_first` method's round: each of `client_ids` (in id order) makes its
        upload from its current state (`local_release`, rng stream "release"), checked, privatised and
        accounted by the host like any upload; the server aggregates these, then `train` runs on the new
        broadcast. Failures as in `train`: a client whose release fails sends nothing and keeps its state
        and ledger (the driver leaves it out of the round's training)."""
        if not self.method.release_first:
            raise RaysimError(f"{self.method.name} does not release first (release_first is False): its uploads come from train")
        shared = {k: v.to(self.device) for k, v in shared.items()}
        got = self._each_client(round_idx, client_ids, shared, phase="release")
        self.commit(round_idx)
        return got

    def setup(self, round_idx: int, client_ids: list[int], shared: dict[str, torch.Tensor]) -> tuple[list[Upload], list[ClientReport]]:
        """Step 0 (Method.setup_clients), before round `round_idx` (0) trains: each of `client_ids` runs
        `local_setup` (rng stream "setup"), its upload checked, privatised and accounted in that round's ledger like
        any upload; the server's `setup` turns these into the broadcast the round trains on. Failures as in `train`."""
        shared = {k: v.to(self.device) for k, v in shared.items()}
        got = self._each_client(round_idx, client_ids, shared, phase="setup")
        self.commit(round_idx)
        return got

    def _each_client(self, round_idx: int, client_ids: list[int], shared: dict[str, torch.Tensor], *,
                     phase: Phase) -> tuple[list[Upload], list[ClientReport]]:
        """One phase ("train" or "release") for each of `client_ids` in id order, client by client, under the
        run's client policy (raysim/engine/client_round.py). Each phase draws from its own stream,
        generator(seed, phase, round, client)."""
        step = self.local_step(phase, round_idx, shared)
        workers = self.client_threads if self.method.independent_clients() and self.carry is None else 1
        if workers > 1 and self.privacy.dp.enabled:
            self.participation  # noqa: B018 - computed here, once, before the client threads read it
        return ClientRound(self, round_idx, shared, phase=phase, policy=self.policy).run(client_ids, step, workers=workers)

    @torch.no_grad()
    def evaluate(self, shared: dict[str, torch.Tensor], client_ids: Optional[list[int]] = None,
                 among: Optional[list[int]] = None) -> list[dict[str, Any]]:
        """Each of `client_ids`' models (the method's predictor; default: every client here) scored by the
        run's evaluation protocol, among the evaluated clients `among` (None: all clients; a client's
        Cross-Client accuracy is on the other evaluated clients' test splits)."""
        shared = {k: v.to(self.device) for k, v in shared.items()}
        out = []
        for cid in sorted(client_ids if client_ids is not None else self.clients):
            predict = self.method.predictor(self.env, shared, self.private_state(cid), self.data[cid])
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
        predict = self.method.predictor(self.env, shared, self.private_state(c0), self.data[c0])
        rows = block_part(self.protocol.rows(among), part, parts, self.protocol.batch_size)
        return self.protocol.hits(predict, rows)

    def score_hits(self, hits: Any, client_ids: list[int]) -> list[dict[str, Any]]:
        """The evaluation rows of `client_ids` from the global model's hits (`global_hits`, all parts merged)."""
        cids = sorted(client_ids)
        return [{"client": c, **row, "epsilon": self.epsilon(c)} for c, row in zip(cids, self.protocol.score_many(cids, hits))]

    def commit(self, round_idx: int) -> None:
        """Write the private state of every client that changed this round, then drop stale versions (only
        this host's own clients: a guest's state went back to its own host). Every call that changes a client's
        state (`train`, `release`, `train_stacks`, `settle_guests`) ends with it, so a round's client checkpoints
        are on disk when the host's last call of the round returns, with no call of its own (one round trip
        less a round on Ray). Writing before the round is complete is safe: a resume reads the versions up to
        the last completed round (state/progress.json) and ignores newer ones."""
        assert not self.guests, "guests are held only during train_stacks"
        for cid in sorted(self.dirty):
            self.store.save_client(cid, round_idx, self._checkpoint(cid))
            self.store.prune_client(cid, round_idx - 1)
        if self.dirty and self.carry is not None:
            self.store.save_shared_optimizer(round_idx, self.carry.to_dict())
        self.dirty.clear()

    def device_info(self) -> dict[str, Any]:
        return {"device": str(self.device), "clients": self.clients, "cuda": torch.cuda.is_available()}


def host_client_threads(execution: Any) -> int:
    """How many clients a host trains at once (execution.client_threads; 0: as many as the host has CPUs, i.e.
    the cores this process may use on the inline backend, the actor's client_cpus on Ray, at least 1)."""
    n = int(execution.client_threads)
    if n > 0:
        return n
    if execution.backend == "ray":
        return max(1, int(execution.client_cpus))
    return available_cores()


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it, else os.cpu_count())."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


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
        self.setup_uploads: list[Upload] = []  # Step 0's uploads, until round 0's aggregate records them
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
        """Aggregate the round's uploads (every host's list) in client-id order into the new state, and write
        it (`commit`: nothing changes the server's state after its round's aggregate, and a resume ignores a
        version newer than the last completed round). The round's stats: bytes up and down, server metrics."""
        stats = self._aggregate(round_idx, *upload_lists)
        self.commit(round_idx)
        return stats

    def setup(self, round_idx: int, *upload_lists: list[Upload]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Step 0's server half (Method.aggregate_setup) on the hosts' `setup` uploads, before round `round_idx` (0)
        trains: (its stats, the new broadcast state). Not written by itself: round 0's `aggregate` writes the state,
        so a run stopped before round 0 completed makes Step 0 again. Under output.record_uploads the Step 0
        uploads are recorded with round 0's."""
        uploads = sorted((u for lst in upload_lists for u in lst), key=lambda u: u.client_id)
        for u in uploads:
            check_upload(self.method, u.client_id, u.tensors)
        down = sum(t.numel() * t.element_size() for t in self.get_shared().values()) * len(uploads)
        self.setup_uploads = uploads
        if uploads:
            new = self.method.aggregate_setup(self.env, self.state, uploads, generator(self.cfg.train.seed, "server-setup", round_idx))
            self.state = {k: v.detach().cpu() for k, v in new.items()}
        return {"bytes_up": sum(u.nbytes() for u in uploads), "bytes_down": down, "server_metrics": {}}, self.get_shared()

    def aggregate_and_share(self, round_idx: int, *upload_lists: list[Upload]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """`aggregate`, and the new broadcast state (what `get_shared` would answer next): the Ray backend keeps
        it in the object store for the next round's hosts, one server call a round less."""
        return self.aggregate(round_idx, *upload_lists), self.get_shared()

    def _aggregate(self, round_idx: int, *upload_lists: list[Upload]) -> dict[str, Any]:
        uploads = sorted((u for lst in upload_lists for u in lst), key=lambda u: u.client_id)
        for u in uploads:
            check_upload(self.method, u.client_id, u.tensors)
        pre = self.get_shared()
        down = sum(t.numel() * t.element_size() for t in pre.values()) * len(uploads)
        if self.cfg.output.record_uploads:  # the attacker's view: only checked, declared tensors (Step 0's with round 0's)
            seen: dict[int, dict[str, torch.Tensor]] = {}
            for u in [*self.setup_uploads, *uploads]:
                seen.setdefault(u.client_id, {}).update(u.tensors)
            self.store.save_uploads(round_idx, {
                "pre": pre,
                "uploads": seen,
                "num_samples": {u.client_id: u.num_samples for u in [*self.setup_uploads, *uploads]},
            })
        self.setup_uploads = []
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
