"""Client-batched local training: the clients of a stack share one frozen text tower and train together.

A method that supports it (`supports_batching()`: PromptFL, DP-FPL with dp_mode=per_example, FedPGP, FedOTP,
pFedMoAP, FedSEPT but FedSEPT-PF, and FedPHA, through `ClipPromptMethod.batched_context` and its step hooks) trains
a stack of clients with `batched_local_train`: one text-tower forward per step over the stacked contexts of all
clients (K x n x C prompts) instead of K forwards (one per context length: FedPHA's local prompts differ in
length from client to client).
What stays per client is everything that makes a client: its own batches (from its own rng), loss, SGD
state, privacy handle (`privacy.open` / `close`, its calibrated multiplier, its DP-SGD noise stream, its
ledger) and its report. `StackPrivacy` is the privacy handle of a stack: one backward gives every client the gradient of its own loss alone,
or under DP-SGD every client's per-example gradients (the clients' examples side by side, one vmapped
backward), clipped and noised client by client by the client's own `DPSGD` (privacy/dpsgd.py); a client's
private tensors and modules (`other_params`) take the plain gradient of its whole loss, from the same backward,
and a client's public term (its gradient joins after clipping: FedSEPT's L_gate, on its router alone, and its
L_div under div_outside_dp, on A) is differentiated once for the stack.

Results equal the client-by-client path up to float reassociation (the stacked forward computes the
shared prompt prefix once, in matmuls of other shapes; tests allow 1e-5 for PromptFL, FedPGP at mu=1 and
pFedMoAP, more where training magnifies the last bits (DP-FPL, FedOTP's Sinkhorn stopping rule, FedSEPT's
router: tests/engine/test_batched_prompt_methods.py); with the full forward and no DP they are bitwise
equal), and are bitwise the same on any backend and pool size: a round's stacks are its sorted participants
cut into chunks of execution.stack_size (`plan_stacks`), whichever hosts hold them. The host of a stack's
first member trains it (`route_stacks`);
the stack's members of other hosts are its guests for that call (`stacked_round`, the driver's side for both
backends): their own host exports a copy of their private state, privacy state and calibration count
(`GuestState`), the training host holds them only for `ClientHost.train_stacks`, and their own host takes the
results back (`GuestResult`, `ClientHost.settle_guests`), keeping their ledgers and checkpointing them.

`ClientHost.train` (one host's own clients, in stacks) and `ClientHost.train_stacks` call `train_stacks` here.
A stack goes client by client when it cannot be stacked (a step kind it does not batch) or when anything in
it raised: a failing client cannot be told apart from the others inside one forward, so the stack is
replayed client by client from the same state (nothing was charged or stored), each client on its own host,
which applies on_client_error exactly as always; a run with a client_timeout never stacks. Otherwise each
client's result is judged (a non-finite upload is a failure) and settled under the run's policy by
raysim/engine/client_round.py, the module the client-by-client path uses; this one touches the host only
through its public interface (`private_state`, `round_data`, `open_privacy`, `is_home`, `local_step`, ...,
`client_round.RoundHost`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.engine.client_round import ClientRound, StackHost, judge
from raysim.methods.families.prompt import ClientJob
from raysim.privacy.dpsgd import DPSGD, NoDP, per_sample_grads_and_sums
from raysim.sampling import generator

if TYPE_CHECKING:
    from raysim.engine.client_round import ClientReport
    from raysim.methods.base import Upload
    from raysim.privacy.host import RoundPrivacy

log = logging.getLogger(__name__)


class StackPrivacy:
    """The privacy handle of a stack of clients: `batches` and `backward` of each client's own RoundPrivacy,
    with the backward of all clients' losses done at once."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)

    @staticmethod
    def supports(handles: Sequence[Any]) -> bool:
        """Plain steps for all (DP off) or per-example DP-SGD for all; anything else goes client by client."""
        kinds = {type(h.stepper) for h in handles}
        return kinds in ({NoDP}, {DPSGD})

    def batches(self, k: int, n: int, batch_size: int, rng: torch.Generator):
        return self.handles[k].batches(n, batch_size, rng)

    def backward(self, clients: Sequence[int], losses: Sequence[Tensor], dp_params: Sequence[dict[str, Tensor]],
                 other_params: Optional[Sequence[Sequence[Tensor]]] = None,
                 public_loss: Optional[Sequence[Optional[Tensor]]] = None) -> None:
        """`privacy.backward(losses[a], dp_params[a], other_params[a], public_loss[a])` for every client
        `clients[a]` (an index into the handles), in one backward over the stack. The clients' graphs share
        only frozen tensors, so the gradient of a sum of their losses w.r.t. client a's tensors is the
        gradient of client a's loss alone."""
        steppers = [self.handles[k].stepper for k in clients]
        others = [list(o) for o in other_params] if other_params is not None else [[] for _ in clients]
        public = list(public_loss) if public_loss is not None else [None] * len(clients)
        if all(isinstance(s, NoDP) for s in steppers):
            terms = [loss.mean() + (p if p is not None else 0) for loss, p in zip(losses, public)]
            _set_plain(sum(terms), [t for named, o in zip(dp_params, others) for t in [*named.values(), *o]])
            for s in steppers:
                s.steps += 1
                if s.on_step is not None:
                    s.on_step()
            return
        assert all(isinstance(s, DPSGD) for s in steppers), "StackPrivacy.supports admits only NoDP or DPSGD stacks"
        sizes = [int(loss.shape[0]) for loss in losses]
        for s, b in zip(steppers, sizes):
            if b == 0 and s.expected_batch is None:
                raise ValueError("DP-SGD step on an empty batch")
        flat = [t for named in dp_params for t in named.values()]
        # the other tensors of the clients with examples take the plain gradient of their client's whole loss,
        # from the same batched backward passes as the per-example gradients (as in DPSGD.backward)
        mine = [[p for p in o if p.requires_grad] if b > 0 else [] for o, b in zip(others, sizes)]
        flat_others = [p for o in mine for p in o]
        pub_grads: list[Optional[Tensor]] = [None] * (len(flat) + len(flat_others))
        if any(p is not None for p in public):
            pub = sum(p for p in public if p is not None)
            assert isinstance(pub, Tensor)
            pub_grads = list(torch.autograd.grad(pub, flat + flat_others, retain_graph=True, allow_unused=True))
        rows = max(sizes, default=0)
        if rows:  # row r holds example r of every client: its gradient w.r.t. client a's tensors is that example's
            stacked = torch.stack([F.pad(loss, (0, rows - b)) for loss, b in zip(losses, sizes)], dim=1).sum(dim=1)
            grads, sums = per_sample_grads_and_sums(stacked, flat, flat_others, microbatch=steppers[0].microbatch)
        else:
            grads = [torch.zeros((0, *t.shape), dtype=t.dtype, device=t.device) for t in flat]
            sums = []
        j = 0
        for s, named, b in zip(steppers, dp_params, sizes):
            n = len(named)
            s.apply_per_example(named, [g[:b] for g in grads[j:j + n]], b, pub_grads[j:j + n])
            j += n
        for o, b in zip(others, sizes):  # an empty Poisson batch: no gradient for its client's other tensors
            if b == 0:
                for p in o:
                    p.grad = None
        for o, b in zip(mine, sizes):
            for p in o:
                total = sums[j - len(flat)] / b
                pg = pub_grads[j]
                if pg is not None:
                    total = total + pg.detach()
                p.grad = total.detach().to(p.dtype)
                j += 1
        for s, named in zip(steppers, dp_params):
            s.record_step(named)


def _set_plain(loss: Any, params: list[Tensor]) -> None:
    params = [p for p in params if p.requires_grad]
    if not params or not isinstance(loss, Tensor):
        return
    for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
        p.grad = torch.zeros_like(p) if g is None else g.detach().to(p.dtype)


def batchable(host: StackHost) -> bool:
    """`stacks_clients` of the host's run config and method."""
    return stacks_clients(host.cfg, host.method)


def stacks_clients(cfg: Any, method: Any) -> bool:
    """execution.batch_clients is on, the method stacks clients, no per-client wall clock is asked for
    (client_timeout times each client's own local_train, which a stack does not have), and each client starts from a
    fresh SGD state (train.optimizer_state=shared chains them: client by client)."""
    x = cfg.execution
    return (bool(x.batch_clients) and float(x.client_timeout) <= 0 and not getattr(method, "release_first", False)
            and cfg.train.optimizer_state == "fresh"  # shared: each client continues the previous one's SGD state
            and bool(getattr(method, "supports_batching", lambda: False)()))


# -- the round's stacks, planned from its participants alone ---------------------------------------------------
def plan_stacks(participants: Sequence[int], stack_size: int) -> list[list[int]]:
    """The round's stacks: its participants in id order, cut into chunks of `stack_size` (the last one may be
    shorter). Which host holds which client plays no part, so neither does the pool size."""
    cids = sorted(set(int(c) for c in participants))
    size = max(1, int(stack_size))
    return [cids[i:i + size] for i in range(0, len(cids), size)]


@dataclass
class RoundStacks:
    """Who trains what in a stacked round: `lead[t]` the stacks host t trains (those whose first member it
    holds), `away[h][t]` the clients of host h that are guests of host t's stacks this round."""

    lead: dict[int, list[list[int]]]
    away: dict[int, dict[int, list[int]]]


def route_stacks(participants: Sequence[int], stack_size: int, home: Mapping[int, int]) -> RoundStacks:
    """`plan_stacks`, each stack given to the host (`home[c]`: the host index of client c) of its first member."""
    lead: dict[int, list[list[int]]] = {}
    away: dict[int, dict[int, list[int]]] = {}
    for stack in plan_stacks(participants, stack_size):
        t = home[stack[0]]
        lead.setdefault(t, []).append(stack)
        for c in stack[1:]:
            if home[c] != t:
                away.setdefault(home[c], {}).setdefault(t, []).append(c)
    return RoundStacks(lead, away)


@dataclass
class GuestState:
    """What a client's own host sends with it to the host that trains its stack: its private state, its
    privacy state (`HostPrivacy.snapshot`: calibration, ledger, one-shot releases) and the number of rounds
    its DP calibration covers (its own host's participation count); and whether that state is its own host's
    checkpoint on disk (then, if the stack leaves it unchanged, nothing needs to come back)."""

    client_id: int
    private: dict[str, Any]
    privacy: Any
    rounds: int
    on_disk: bool = False


@dataclass
class GuestResult:
    """What comes back to the client's own host after its stack: its private and privacy state as the
    training host left them, and whether its private state changed (to be checkpointed by its own host)."""

    client_id: int
    private: dict[str, Any]
    privacy: Any
    changed: bool


Call = Callable[[str, dict[int, tuple], int], dict[int, tuple]]


def stacked_round(round_idx: int, participants: Sequence[int], stack_size: int, home: Mapping[int, int], shared: Any,
                  call: Call, value: Callable[[Any], Any]) -> tuple[list[Any], list["ClientReport"]]:
    """The driver's side of a stacked round, for either backend. `call(name, {host: args}, returns)` runs the
    ClientHost method `name` on each listed host and gives {host: its `returns` results (handles)}; `value`
    reads a handle (identity inline, ray.get on Ray). Three steps: the guests' own hosts export their state
    (`export_guests`), each host trains the stacks it leads with its guests (`train_stacks`), and the guests'
    own hosts take back their results and train client by client those whose stack fell back
    (`settle_guests`). Returns the upload handles (for the server's aggregate) and the reports."""
    routes = route_stacks(participants, stack_size, home)
    exported = call("export_guests", {h: (round_idx, by) for h, by in routes.away.items()}, 1)
    gone = {h: value(out[0]) for h, out in exported.items()}
    guests = {t: [g for h in sorted(gone) for g in gone[h].get(t, [])] for t in routes.lead}
    trained = call("train_stacks", {t: (round_idx, routes.lead[t], shared, guests[t]) for t in routes.lead}, 3)
    uploads = [trained[t][0] for t in sorted(trained)]
    reports = [r for t in sorted(trained) for r in value(trained[t][1])]
    back: dict[int, list[GuestResult]] = {}
    redo: dict[int, list[int]] = {}
    for t in sorted(trained):
        carry = value(trained[t][2])
        for g in carry["back"]:
            back.setdefault(home[g.client_id], []).append(g)
        for c in carry["redo"]:
            redo.setdefault(home[c], []).append(c)
    homes = sorted(set(back) | set(redo))
    settled = call("settle_guests", {h: (round_idx, back.get(h, []), sorted(redo.get(h, [])), shared) for h in homes}, 2)
    uploads += [settled[h][0] for h in sorted(settled)]
    reports += [r for h in sorted(settled) for r in value(settled[h][1])]
    return uploads, sorted(reports, key=lambda r: r.client_id)


# -- a host's side ---------------------------------------------------------------------------------------------
def train_stack(host: StackHost, round_idx: int, client_ids: Sequence[int],
                shared: dict[str, Tensor]) -> Optional[tuple[list["Upload"], list["ClientReport"]]]:
    """`ClientHost.train` for the clients `client_ids` of this host, in stacks of execution.stack_size in id
    order; None when the run does not stack (the host then trains client by client)."""
    if not client_ids or not batchable(host):
        return None
    uploads, reports, redo = train_stacks(host, round_idx, plan_stacks(client_ids, host.cfg.execution.stack_size), shared)
    assert not redo, "a host's own clients fall back on the host itself"
    return uploads, reports


def train_stacks(host: StackHost, round_idx: int, stacks: Sequence[Sequence[int]],
                 shared: dict[str, Tensor]) -> tuple[list["Upload"], list["ClientReport"], list[int]]:
    """Train `stacks` (each in one `batched_local_train`) on `host`, which holds every member (its own
    clients, and its guests brought by `ClientHost.train_stacks`). Each client's result is judged and settled
    by raysim/engine/client_round.py, as client by client. A stack that cannot be stacked (its privacy steps)
    or raised goes client by client: the host's own members here, the guests (returned as `redo`, their
    state untouched) on their own hosts. Under on_client_error=fail the host stops at its first failed client."""
    clients = ClientRound(host, round_idx, shared, phase="train", policy=host.policy)
    redo: list[int] = []
    for stack in stacks:
        cids = sorted(stack)
        done = _one_stack(host, clients, round_idx, cids, shared)
        if done is None:  # client by client, each on its own host
            mine = [c for c in cids if host.is_home(c)]
            redo += [c for c in cids if not host.is_home(c)]
            if mine:
                clients.run(mine, host.local_step("train", round_idx, shared))
            done = clients.policy.drop or not any(r.dropped for r in clients.reports)
        if not done:
            break
    uploads, reports = clients.result()
    return uploads, reports, redo


def _one_stack(host: StackHost, clients: ClientRound, round_idx: int, cids: list[int],
               shared: dict[str, Tensor]) -> Optional[bool]:
    """One stack trained and settled: True to go on, False to stop (a failure under fail), None when it is to
    go client by client (nothing of it was charged or kept)."""
    saved = {cid: clients.save(cid, private=False) for cid in cids}  # a stack leaves the private states untouched

    def back_out(why: str) -> None:
        for cid in cids:
            clients.put_back(saved[cid])
        log.info("round %d: %s; training its %d clients one by one", round_idx, why, len(cids))

    handles: list["RoundPrivacy"] = []
    try:
        for cid in cids:
            handles.append(host.open_privacy(cid, round_idx, shared))
        if not StackPrivacy.supports(handles):
            back_out("this round's privacy steps are not stackable")
            return None
        jobs = [ClientJob(host.private_state(cid), host.round_data(cid, round_idx), generator(host.cfg.train.seed, "train", round_idx, cid))
                for cid in cids]
        train = getattr(host.method, "batched_local_train")  # noqa: B009 - what supports_batching() promised
        results = train(host.env, shared, jobs, privacy=StackPrivacy(handles))
    except Exception as e:  # noqa: BLE001 - the client-by-client path replays the stack and applies the policy
        log.debug("round %d: the client stack raised", round_idx, exc_info=True)
        back_out(f"a client in the stack raised ({type(e).__name__}: {e})")
        return None
    for n, (cid, privacy, result) in enumerate(zip(cids, handles, results)):
        if not clients.settle(judge(cid, result, clients.policy), privacy, saved[cid]):
            for later in cids[n + 1:]:  # under fail client by client they would not have been opened
                clients.put_back(saved[later])
            return False
    return True
