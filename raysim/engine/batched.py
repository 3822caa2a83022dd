"""Client-batched local training: the clients of one host that share its frozen text tower train together.

A method that supports it (`supports_batching()`, e.g. PromptFL through `ClipPromptMethod.batched_context`)
trains the host's clients of a round with `batched_local_train`: one text-tower forward per step over the
stacked contexts of all clients (K x C prompts) instead of K forwards. What stays per client is everything
that makes a client: its own batches (from its own rng), loss, SGD state, privacy handle (`privacy.open` /
`close`, its calibrated multiplier, its DP-SGD noise stream, its ledger) and its report. `StackPrivacy`
is the privacy handle of a stack: one backward gives every client the gradient of its own loss alone,
or under DP-SGD every client's per-example gradients (the clients' examples side by side, one vmapped
backward), clipped and noised client by client by the client's own `DPSGD` (privacy/dpsgd.py).

Results equal the client-by-client path up to float reassociation (the stacked forward computes the
shared prompt prefix once, in matmuls of other shapes; tests allow 1e-5), and are bitwise reproducible for
a fixed setting. A host with one client of the round trains a stack of one, so that where the kernels
compute each row independently of the others (CPU BLAS, observed: the engine's results.csv is identical
for any num_actors, tested) a client's result does not depend on which clients share its host.

`ClientHost.train` calls `train_stack` when execution.batch_clients is on; it returns None, and the host
trains client by client, when the round cannot be stacked (a client_timeout, a step kind it does not
batch) or when anything in the stack raised: a failing client cannot be told apart from the others
inside one forward, so the whole round is replayed client by client from the same state (nothing was
charged or stored), which applies on_client_error exactly as always. Otherwise each client's result is
judged (a non-finite upload is a failure) and settled under the run's policy by raysim/engine/client_round.py,
the module the client-by-client path uses; this one touches the host only through its public interface
(`private_state`, `round_data`, `open_privacy`, ..., `client_round.RoundHost`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.engine.client_round import ClientRound, judge
from raysim.methods.families.prompt import ClientJob
from raysim.privacy.dpsgd import DPSGD, NoDP, per_sample_grads
from raysim.sampling import generator

if TYPE_CHECKING:
    from raysim.engine.client_round import ClientReport
    from raysim.engine.hosts import ClientHost
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
            return
        assert all(isinstance(s, DPSGD) for s in steppers), "StackPrivacy.supports admits only NoDP or DPSGD stacks"
        sizes = [int(loss.shape[0]) for loss in losses]
        for s, b in zip(steppers, sizes):
            if b == 0 and s.expected_batch is None:
                raise ValueError("DP-SGD step on an empty batch")
        flat = [t for named in dp_params for t in named.values()]
        pub_grads: list[Optional[Tensor]] = [None] * len(flat)
        if any(p is not None for p in public):
            pub = sum(p for p in public if p is not None)
            assert isinstance(pub, Tensor)
            pub_grads = list(torch.autograd.grad(pub, flat, retain_graph=True, allow_unused=True))
        rows = max(sizes, default=0)
        if rows:  # row r holds example r of every client: its gradient w.r.t. client a's tensors is that example's
            stacked = torch.stack([F.pad(loss, (0, rows - b)) for loss, b in zip(losses, sizes)], dim=1).sum(dim=1)
            grads = per_sample_grads(stacked, flat, microbatch=steppers[0].microbatch)
        else:
            grads = [torch.zeros((0, *t.shape), dtype=t.dtype, device=t.device) for t in flat]
        j = 0
        for s, named, b in zip(steppers, dp_params, sizes):
            n = len(named)
            s.apply_per_example(named, [g[:b] for g in grads[j:j + n]], b, pub_grads[j:j + n])
            j += n
        plain = [(loss.mean() + (p if p is not None else 0), o) for loss, p, o, b in zip(losses, public, others, sizes) if b > 0 and o]
        if plain:  # the other tensors get the plain gradient of their client's whole loss, as in DPSGD.backward
            _set_plain(sum(t for t, _ in plain), [t for _, o in plain for t in o])
        for s, named in zip(steppers, dp_params):
            s.record_step(named)


def _set_plain(loss: Any, params: list[Tensor]) -> None:
    params = [p for p in params if p.requires_grad]
    if not params or not isinstance(loss, Tensor):
        return
    for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
        p.grad = torch.zeros_like(p) if g is None else g.detach().to(p.dtype)


def batchable(host: "ClientHost") -> bool:
    """execution.batch_clients is on, the method stacks clients, and no per-client wall clock is asked for
    (client_timeout times each client's own local_train, which a stack does not have)."""
    x, m = host.cfg.execution, host.method
    return (bool(x.batch_clients) and host.policy.timeout <= 0 and not getattr(m, "release_first", False)
            and bool(getattr(m, "supports_batching", lambda: False)()))


def train_stack(host: "ClientHost", round_idx: int, client_ids: Sequence[int],
                shared: dict[str, Tensor]) -> Optional[tuple[list["Upload"], list["ClientReport"]]]:
    """`ClientHost.train` for a stack of clients (in id order, at most execution.stack_size per stack), with
    the same uploads, reports, private state and ledgers; None when the round is to go client by client.
    Each client's result is judged and settled by raysim/engine/client_round.py, as client by client."""
    cids = sorted(client_ids)
    if not cids or not batchable(host):  # a stack of one too: a client's result must not depend on its host's others
        return None
    clients = ClientRound(host, round_idx, shared, phase="train", policy=host.policy)
    saved = {cid: clients.save(cid, private=False) for cid in cids}  # a stack leaves the private states untouched

    def back_out(why: str) -> None:
        for cid in cids:
            clients.put_back(saved[cid])
        log.info("round %d: %s; training its %d clients one by one", round_idx, why, len(cids))

    handles: list["RoundPrivacy"] = []
    results = []
    try:
        for cid in cids:
            handles.append(host.open_privacy(cid, round_idx, shared))
        if not StackPrivacy.supports(handles):
            back_out("this round's privacy steps are not stackable")
            return None
        jobs = [ClientJob(host.private_state(cid), host.round_data(cid, round_idx), generator(host.cfg.train.seed, "train", round_idx, cid))
                for cid in cids]
        size = max(1, int(host.cfg.execution.stack_size))
        train = getattr(host.method, "batched_local_train")  # noqa: B009 - what supports_batching() promised
        for i in range(0, len(jobs), size):
            results += train(host.env, shared, jobs[i:i + size], privacy=StackPrivacy(handles[i:i + size]))
    except Exception as e:  # noqa: BLE001 - the client-by-client path replays the round and applies the policy
        log.debug("round %d: the client stack raised", round_idx, exc_info=True)
        back_out(f"a client in the stack raised ({type(e).__name__}: {e})")
        return None
    for n, (cid, privacy, result) in enumerate(zip(cids, handles, results)):
        if not clients.settle(judge(cid, result, clients.policy), privacy, saved[cid]):
            for later in cids[n + 1:]:  # under fail client by client they would not have been opened
                clients.put_back(saved[later])
            break
    return clients.result()
