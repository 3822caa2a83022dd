"""Client-batched training of the prompt methods with private tensors (DP-FPL, FedPGP, FedOTP, pFedMoAP, FedSEPT, FedPHA;
PromptFL is tests/engine/test_batched_clients.py): a stack gives the uploads, the updated private state, the losses and
the per-client ledgers of training its clients one by one, with and without DP-SGD at epsilon 1, over two
rounds (one under DP-SGD) of 5 clients of unequal size (19 to 39 steps a round); the comparison is tight enough to catch a loss
term or a private-state update the stacked path would drop; the methods and modes that do not stack still
train client by client.

Tolerances. With the full forward over the stack (`stack_full_forward`: each client's rows computed as its own
forward computes them) and no DP, the stack is bitwise client by client: one summed backward, and the clients'
graphs share no trained tensor. That pins the stacking logic exactly (every loss term, every private update,
every draw from each client's stream). The default stacked forward (raysim/models/shared_prefix.py) computes
each context's prompt prefix once in matmuls of other shapes, so its features differ in the last bits (~1e-7
on unit-norm features), and training carries that on: FedPGP at mu=1 ends within 5e-6 (tolerance 1e-5, as
PromptFL), DP-FPL within 1e-4 (tolerance 2e-4: it trains four parametrisations of one prompt, G + U V + S,
at lr 0.05 while S grows from 0.02 to ~1, and re-factorises U V + S by Gram-Schmidt each epoch), FedPGP at its
default mu=100 past 1e-5 (its contrast's gradient is 100x; G grows ~1e3-fold in a round on random weights), so
mu=100 is tested with the full forward. Under DP-SGD the per-example gradients of all clients come from one
vmapped backward over the stack's rows, which reassociates too: with the full forward within 1e-5.

FedOTP, pFedMoAP and FedSEPT (tiny: 4 images per class and client, FedSEPT with 4 experts of rank 4) are bitwise
client by client with the full forward and no DP in every case tested: FedOTP's pooled and patch tokens,
pFedMoAP in its second round (its clients then have experts and train their gating head), FedSEPT's pooled
and patch routers with dropout 0.1 (each client's own global-RNG state: its masks are the same alone or in a
stack) and L_gate, its uniform, wo_r and single variants. Under DP-SGD (full forward) they stay within 1e-5
(measured at most 2.4e-6 on all the data, 19 to 39 steps a round). With the shared-prefix forward, on all the
data: pFedMoAP within 1e-5 (measured 6e-6 over two rounds); FedOTP pooled within 5e-5 (measured 1.0e-5: two
prompts per class, the OT logit their average); FedOTP with patch tokens within 5e-4 (measured 1.3e-4:
Sinkhorn stops when the mean change of its scaling drops below 1e-3, a step function of its input, so a
last-bit change can cost or save an iteration and move the plan by far more than the change); FedSEPT at
lambda_gate=1 within 5e-5 (measured 1.2e-5); at its default lambda_gate=10 its router (no weight decay,
lr 0.05) grows several-fold in a round and the last bits reach 1.6e-3 of it, so that case is tested with the
full forward, bitwise. FedSEPT-PF (fusion=prompt) does not stack: it trains client by client, bitwise.

FedPHA (tiny: 2 images per class and client) stacks clients whose local prompts have different lengths (5, 8,
10, 13 and 15 tokens; one forward per length), with the EOT quirk on and off: bitwise client by client with the
full forward and no DP; with the shared-prefix forward within 1e-5 (measured 4.8e-7, 1.4e-6 with the quirk,
two rounds); under DP-SGD (full forward) within 1e-5 (measured bitwise)."""

from __future__ import annotations

import pytest
import torch
from test_batched_clients import ATOL, hosts, ledgers, shared_of

EPS = 1.0


def train_rounds(seq, bat, rounds=2):
    """Both hosts train `rounds` rounds of all their clients from the same broadcasts (the client-by-client
    FedAvg carried on); returns the rounds' (uploads, reports) of each."""
    out = []
    shared = shared_of(seq)
    for r in range(rounds):
        a = seq.train(r, list(seq.clients), shared)
        b = bat.train(r, list(bat.clients), shared)
        out.append((a, b))
        if "bank" in shared:  # pFedMoAP: the server's bank of uploads too (the clients' experts)
            shared = seq.method.aggregate(seq.env, shared, a[0], None)
        else:
            shared = {k: torch.stack([u.tensors[k] for u in a[0]]).mean(0) for k in a[0][0].tensors}
    return out


def worst(seq, bat, rounds) -> float:
    """The largest difference between the two hosts over uploads, private tensors and losses; asserts what
    must be equal exactly (which clients, sample counts, ledgers: counts and multipliers)."""
    diff = 0.0
    for (ua, ra), (ub, rb) in rounds:
        def who(us):
            return [(u.client_id, u.num_samples, sorted(u.tensors)) for u in us]

        assert who(ua) == who(ub)
        assert [(r.client_id, r.dropped, r.bytes_up) for r in ra] == [(r.client_id, r.dropped, r.bytes_up) for r in rb]
        for x, y in zip(ua, ub):
            diff = max(diff, *((x.tensors[k] - y.tensors[k]).abs().max().item() for k in x.tensors))
        for x, y in zip(ra, rb):
            diff = max(diff, abs(x.loss - y.loss))
            assert x.epsilon == y.epsilon
    assert ledgers(seq) == ledgers(bat)  # the same releases (sigma, q, steps) recorded per client, exactly
    for c in seq.clients:
        diff = max(diff, gap(seq.private_state(c), bat.private_state(c)))
    assert seq.dirty == bat.dirty
    return diff


def gap(a, b) -> float:
    """The largest difference between two private states: tensors, state_dicts of private modules (FedSEPT's
    router, pFedMoAP's gating head), other values (pFedMoAP's client id) equal exactly."""
    if isinstance(a, torch.Tensor):
        return (a - b).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        assert sorted(a) == sorted(b)
        return max([gap(a[k], b[k]) for k in a], default=0.0)
    assert a == b
    return 0.0


FPL_TOL = 2e-4  # DP-FPL under the shared-prefix forward: the module docstring


@pytest.mark.parametrize("method,opts,dp,tol", [
    ("dpfpl", {}, 0.0, FPL_TOL), ("dpfpl", {}, EPS, FPL_TOL),
    ("fedpgp", {"weight": 1.0}, 0.0, ATOL), ("fedpgp", {"weight": 1.0}, EPS, ATOL),
    ("fedpgp", {"weight": 1.0, "contrast_outside_dp": True}, EPS, ATOL),
], ids=["dpfpl", "dpfpl-dp", "fedpgp-mu1", "fedpgp-mu1-dp", "fedpgp-mu1-public-dp"])
def test_stack_equals_client_by_client(tmp_path, cache_dir, method, opts, dp, tol):
    seq, bat = hosts(tmp_path, cache_dir, dp=dp, method=method, **{method: opts})
    assert bat.method.supports_batching() and bat.cfg.execution.batch_clients and not seq.cfg.execution.batch_clients
    assert not bat.method.stack_full_forward  # the default: the shared-prefix forward
    start = {c: {k: v.clone() for k, v in seq.private_state(c).items()} for c in seq.clients}
    rounds = train_rounds(seq, bat, rounds=1 if dp else 2)  # DP-SGD's rounds are slow: the private state's round trip is tested without
    assert worst(seq, bat, rounds) <= tol
    moved = min(gap(seq.private_state(c)[k], start[c][k]) for c in seq.clients for k in start[c])
    assert moved > 1e-4  # the private tensors did train: the comparison above is not of untouched copies
    if dp:
        assert all(ledgers(bat)[c]["ledger"] for c in bat.clients)


@pytest.mark.parametrize("method,opts,dp", [("dpfpl", {}, 0.0), ("fedpgp", {}, 0.0), ("fedpgp", {}, EPS)],
                         ids=["dpfpl", "fedpgp-mu100", "fedpgp-mu100-dp"])
def test_the_full_forward_over_the_stack_is_client_by_client(tmp_path, cache_dir, method, opts, dp):
    """Bitwise without DP; within 1e-5 with DP-SGD (the module docstring). FedPGP at its default mu=100."""
    seq, bat = hosts(tmp_path, cache_dir, dp=dp, method=method, **{method: opts})
    bat.method.stack_full_forward = True
    assert method != "fedpgp" or bat.method.opts.weight == 100.0
    diff = worst(seq, bat, train_rounds(seq, bat, rounds=1 if dp else 2))
    assert diff <= ATOL if dp else diff == 0.0


def test_a_dropped_term_or_update_in_the_stack_would_be_caught(tmp_path, cache_dir, monkeypatch):
    """The tolerance is tight enough to fail on a stacked path that loses FedPGP's contrast (at mu=1) or skips
    DP-FPL's re-factorisation of U V + S at the end of each epoch."""
    from raysim.methods.families.prompt import StepLoss

    seq, bat = hosts(tmp_path / "pgp", cache_dir, method="fedpgp", fedpgp={"weight": 1.0})
    full = bat.method.step_loss

    def no_contrast(env, c, text, x, y, *, tokens=None):
        part = full(env, c, text, x, y, tokens=tokens)
        ce = torch.nn.functional.cross_entropy(bat.method.logits(env, x, text[0]), y, reduction="none")
        return StepLoss(ce, None, part.terms)

    monkeypatch.setattr(bat.method, "step_loss", no_contrast)
    assert worst(seq, bat, train_rounds(seq, bat, rounds=1)) > 10 * ATOL

    seq, bat = hosts(tmp_path / "fpl", cache_dir, method="dpfpl", train={"local_epochs": 2})
    monkeypatch.setattr(bat.method, "step_epoch_end", lambda env, c, rng: None)
    assert worst(seq, bat, train_rounds(seq, bat, rounds=1)) > 10 * FPL_TOL


def test_methods_and_modes_that_do_not_stack_train_client_by_client(tmp_path, cache_dir):
    from raysim.engine.batched import train_stack

    for method, extra in (("dpfpl", {"dpfpl": {"dp_mode": "reference"}}),
                          ("fedsept", {"fedsept": {"fusion": "prompt", "rank": 4}})):
        _, h = hosts(tmp_path / method, cache_dir, method=method, **extra)
        assert not h.method.supports_batching(), method
        assert train_stack(h, 0, list(h.clients), shared_of(h)) is None, method


# -- FedOTP, pFedMoAP, FedSEPT: the image tokens, private modules, the router's param group, dropout and public terms
NEW = {  # tiny settings: FedSEPT with M = 4 experts of rank 4, its router pooled with dropout 0.1 and L_gate at 10
    "fedotp-pooled": ("fedotp", {"tokens": "pooled"}),
    "fedotp-patch": ("fedotp", {"tokens": "patch"}),  # raysim-tiny's ViT tower: 17 tokens per image
    "pfedmoap": ("pfedmoap", {"gating_dim": 32}),
    "fedsept": ("fedsept", {"rank": 4}),
    "fedsept-patch": ("fedsept", {"rank": 4, "router": "patch"}),
    "fedsept-uniform": ("fedsept", {"rank": 4, "variant": "uniform"}),
    "fedsept-wo_r": ("fedsept", {"rank": 4, "variant": "wo_r"}),
    "fedsept-single": ("fedsept", {"rank": 4, "variant": "single"}),
    "fedsept-div-outside": ("fedsept", {"rank": 4, "div_outside_dp": True}),
}


def new_hosts(tmp_path, cache_dir, case, *, dp=0.0, full=False, small=True, **opts):
    """The two hosts of a case; `small`: 4 images per class and client (1 to 5 batches a round, unequal)."""
    method, base = NEW[case]
    seq, bat = hosts(tmp_path, cache_dir, dp=dp, method=method, **{method: {**base, **opts}}, data={"shots": 4} if small else {})
    assert bat.method.supports_batching()
    bat.method.stack_full_forward = full
    return seq, bat


def rounds_of(case) -> int:
    return 2 if case == "pfedmoap" else 1  # pFedMoAP's clients have experts from their second round (a filled bank)


def check_trained(seq, start, case):
    """The private state did train (for pFedMoAP: the gating head, which trains only with experts)."""
    for c in seq.clients:
        for k, v in start[c].items():
            if k != "client":
                assert gap(seq.private_state(c)[k], v) > 1e-4, (case, c, k)


@pytest.mark.parametrize("case", [c for c in NEW if c != "fedsept-div-outside"])
def test_the_full_forward_stack_of_fedotp_pfedmoap_fedsept_is_bitwise_client_by_client(tmp_path, cache_dir, case):
    """Without DP the full forward over the stack is bitwise client by client (the module docstring): every
    client's image tokens, private module (its updated state_dict), the router's param group without weight
    decay, its dropout masks (each client's own global-RNG state, swapped in around its step: the same
    masks alone or in a stack) and L_gate (a public term reaching the router only)."""
    seq, bat = new_hosts(tmp_path, cache_dir, case, full=True)
    start = {c: seq.private_state(c) for c in seq.clients}
    assert worst(seq, bat, train_rounds(seq, bat, rounds=rounds_of(case))) == 0.0
    check_trained(seq, start, case)


SINKHORN_TOL = 5e-4  # FedOTP patch: Sinkhorn's stopping rule (mean change < 1e-3) is a step function of its input
GATE_TOL = 5e-5  # FedSEPT at lambda_gate=1: the router trains on its logits and L_gate with no weight decay


@pytest.mark.parametrize("case,opts,tol", [
    ("fedotp-pooled", {}, 5 * ATOL), ("fedotp-patch", {}, SINKHORN_TOL), ("pfedmoap", {}, ATOL),
    ("fedsept", {"lambda_gate": 1.0}, GATE_TOL),
], ids=["fedotp-pooled", "fedotp-patch", "pfedmoap", "fedsept-gate1"])
def test_the_shared_prefix_stack_of_fedotp_pfedmoap_fedsept_is_within_tolerance(tmp_path, cache_dir, case, opts, tol):
    """The default stacked forward (shared prefix): the module docstring says why each tolerance."""
    seq, bat = new_hosts(tmp_path, cache_dir, case, small=False, **opts)  # all the data: 19 to 39 steps a round
    assert worst(seq, bat, train_rounds(seq, bat, rounds=rounds_of(case))) <= tol


@pytest.mark.parametrize("case", ["fedotp-pooled", "fedotp-patch", "pfedmoap", "fedsept", "fedsept-div-outside"])
def test_the_stack_of_fedotp_pfedmoap_fedsept_under_dp_sgd(tmp_path, cache_dir, case):
    """DP-SGD at epsilon 1 with the full forward: within 1e-5 (the module docstring), the same ledgers."""
    seq, bat = new_hosts(tmp_path, cache_dir, case, dp=EPS, full=True)
    assert worst(seq, bat, train_rounds(seq, bat, rounds=rounds_of(case))) <= ATOL
    assert all(ledgers(bat)[c]["ledger"] for c in bat.clients)


def test_fedsept_pf_trains_client_by_client_with_batch_clients_on(tmp_path, cache_dir):
    """FedSEPT-PF encodes a fused prompt per image inside its loss: it does not stack, and a host with
    execution.batch_clients on trains it client by client, bitwise as with it off."""
    seq, bat = hosts(tmp_path, cache_dir, method="fedsept", fedsept={"fusion": "prompt", "rank": 4, "experts": 2},
                     train={"batch_size": 32})
    assert not bat.method.supports_batching() and bat.cfg.execution.batch_clients
    assert worst(seq, bat, train_rounds(seq, bat, rounds=1)) == 0.0


# -- FedPHA: the clients of one stack have local prompts of different lengths (one forward per length) --------
def fedpha_hosts(tmp_path, cache_dir, *, quirk, dp=0.0, full=False):
    """Tiny: 2 images per class and client (1 to 3 batches a round, unequal); the 5 clients' local lengths
    l_k (drawn in [4, 16]) differ, so a step of the stack encodes contexts of several lengths."""
    seq, bat = hosts(tmp_path, cache_dir, dp=dp, method="fedpha", fedpha={"eot_quirk": quirk}, data={"shots": 2})
    assert bat.method.supports_batching() and bat.cfg.execution.batch_clients
    lengths = [seq.private_state(c)["ctx_local"].shape[0] for c in seq.clients]
    assert lengths == [bat.method.local_length(c) for c in bat.clients] and len(set(lengths)) >= 3, lengths  # 10, 13, 5, 15, 8
    bat.method.stack_full_forward = full
    return seq, bat


@pytest.mark.parametrize("quirk", [False, True], ids=["plain", "eot-quirk"])
def test_the_full_forward_stack_of_fedpha_is_bitwise_client_by_client(tmp_path, cache_dir, quirk):
    """Without DP the full forward over the stack is bitwise client by client (the module docstring), with the
    clients' local prompts of different lengths in one stack, the EOT quirk on and off."""
    seq, bat = fedpha_hosts(tmp_path, cache_dir, quirk=quirk, full=True)
    start = {c: seq.private_state(c) for c in seq.clients}
    assert worst(seq, bat, train_rounds(seq, bat, rounds=2)) == 0.0
    check_trained(seq, start, "fedpha")


@pytest.mark.parametrize("quirk", [False, True], ids=["plain", "eot-quirk"])
def test_the_shared_prefix_stack_of_fedpha_is_within_tolerance(tmp_path, cache_dir, quirk):
    """The default stacked forward (shared prefix, per length): within 1e-5, float reassociation as PromptFL's
    (measured 4.8e-7 plain, 1.4e-6 with the EOT quirk over two rounds)."""
    seq, bat = fedpha_hosts(tmp_path, cache_dir, quirk=quirk)
    assert worst(seq, bat, train_rounds(seq, bat, rounds=2)) <= ATOL


@pytest.mark.parametrize("quirk", [False, True], ids=["plain", "eot-quirk"])
def test_the_stack_of_fedpha_under_dp_sgd(tmp_path, cache_dir, quirk):
    """DP-SGD at epsilon 1 (on G alone, P plain) with the full forward: within 1e-5, as for the other methods
    (the per-example gradients of the stack come from one vmapped backward, which may reassociate; measured
    bitwise equal here), the same ledgers."""
    seq, bat = fedpha_hosts(tmp_path, cache_dir, quirk=quirk, dp=EPS, full=True)
    assert worst(seq, bat, train_rounds(seq, bat, rounds=1)) <= ATOL
    assert all(ledgers(bat)[c]["ledger"] for c in bat.clients)
