"""Client-batched rounds planned from the participants alone (raysim/engine/batched.py stacked_round): a
stack's members of other hosts are brought to the host of its first member and back, so a batched run is
bitwise the same inline on one host, inline on several, and on Ray with 1, 2 and 3 actors, with and without
DP-SGD; a stack that falls back trains client by client on each client's own host; nothing of a guest is
kept or checkpointed by the host that trained it."""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import tiny_config

CLIENTS, STACK = 6, 4  # stacks [0..3] and [4, 5]: with 2 or 3 hosts both span hosts


def test_stacks_come_from_the_participants_alone():
    from raysim.engine.batched import plan_stacks, route_stacks

    assert plan_stacks([5, 0, 3, 1, 2], 2) == [[0, 1], [2, 3], [5]]
    assert plan_stacks([], 4) == []
    for hosts in (1, 2, 3):
        home = {c: c % hosts for c in range(CLIENTS)}
        r = route_stacks(range(CLIENTS), STACK, home)
        assert [s for t in sorted(r.lead) for s in r.lead[t]] == [[0, 1, 2, 3], [4, 5]] or hosts > 1
        for t, stacks in r.lead.items():
            assert all(home[s[0]] == t for s in stacks)  # the host of a stack's first member trains it
        guests = sorted(c for by in r.away.values() for cs in by.values() for c in cs)
        assert guests == sorted(c for s in plan_stacks(range(CLIENTS), STACK) for c in s if home[c] != home[s[0]])
    r = route_stacks(range(CLIENTS), STACK, {c: c % 3 for c in range(CLIENTS)})
    assert r.lead == {0: [[0, 1, 2, 3]], 1: [[4, 5]]} and r.away == {1: {0: [1]}, 2: {0: [2], 1: [5]}}


# tiny settings of the methods with private modules and image tokens: 2 images per class and client (steps
# of 1-3 batches), FedSEPT with 2 experts of rank 4 and its patch router (tokens, dropout 0.1, L_gate)
SMALL = {"fedotp": {"data": {"shots": 2}},
         "pfedmoap": {"data": {"shots": 2}, "pfedmoap": {"gating_dim": 32}},
         "fedsept": {"data": {"shots": 2}, "fedsept": {"experts": 2, "rank": 4, "router": "patch"}},
         "fedpha": {"data": {"shots": 2}, "fedpha": {"eot_quirk": True}}}  # local prompts of 4-16 tokens, the paper's quirk


def go(tmp_path, cache_dir, tag, *, dp=0.0, method="promptfl", **execution):
    """A tiny batched run of `method` (PromptFL by default) (6 clients, 4 of them a round, 3 rounds, stack_size 4): its results.csv
    rows without the wall clock, its final shared tensors and every client's last checkpoint."""
    from raysim.config import merge_config
    from raysim.engine.loop import run
    from raysim.storage.store import StateStore

    values = dict(method=method, train={"num_clients": CLIENTS, "rounds": 3, "batch_size": 8, "n_ctx": 4, "participation": 0.67},
                  data={"shots": 0, "partition": "dirichlet", "beta": 0.5}, eval={"every": 100, "last": 1},
                  execution={"batch_clients": True, "stack_size": STACK, **execution})
    values = merge_config(values, SMALL.get(method, {}))
    if dp:
        values["dp"] = {"epsilon": dp}
    cfg = tiny_config(tmp_path / tag, cache_dir, **values)
    out = run(cfg).out_dir
    with open(out / "results.csv") as f:
        rows = [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(f)]
    store = StateStore(out)
    return rows, store.load_server(2), {c: store.load_client(c, 2) for c in range(CLIENTS)}


def assert_bitwise(a, b, tag):
    rows_a, server_a, clients_a = a
    rows_b, server_b, clients_b = b
    assert rows_a == rows_b, tag  # every column as written, to the last digit
    assert server_a.keys() == server_b.keys()
    for k in server_a:
        assert torch.equal(server_a[k], server_b[k]), (tag, k)
    for c in clients_a:
        assert (clients_a[c] is None) == (clients_b[c] is None), (tag, c)
        if clients_a[c] is not None:
            assert clients_a[c]["privacy"] == clients_b[c]["privacy"], (tag, c)  # calibration and ledger
            assert clients_a[c]["private"].keys() == clients_b[c]["private"].keys()
            for k, v in clients_a[c]["private"].items():  # DP-FPL's U, V, S; FedPGP's U, V; FedSEPT's R, router
                w = clients_b[c]["private"][k]
                if isinstance(v, dict):  # a private module's state_dict
                    assert v.keys() == w.keys() and all(torch.equal(v[n], w[n]) for n in v), (tag, c, k)
                else:
                    assert not isinstance(v, torch.Tensor) or torch.equal(v, w), (tag, c, k)


@pytest.mark.parametrize("method", ["promptfl", "dpfpl", "fedpgp"])
def test_inline_on_one_host_or_three_is_bitwise_the_same(tmp_path, cache_dir, method):
    """Without DP; the DP-SGD case of these methods is in the Ray test below (inline on 1 and 3 hosts, then Ray)."""
    ref = go(tmp_path, cache_dir, "one", method=method)
    assert any(r["train_loss"] for r in ref[0])
    assert_bitwise(ref, go(tmp_path, cache_dir, "three", method=method, num_actors=3), f"{method}, inline, 3 hosts")


@pytest.mark.parametrize("method", ["fedotp", "pfedmoap", "fedpha"])
def test_fedotp_pfedmoap_fedpha_inline_on_one_host_or_three_are_bitwise_the_same(tmp_path, cache_dir, method):
    """Under DP-SGD, tiny (SMALL); FedSEPT's case is the Ray test below, on 1, 2 and 3 actors."""
    ref = go(tmp_path, cache_dir, "one", dp=4.0, method=method)
    assert all(ref[2][c] is None or ref[2][c]["privacy"]["ledger"] for c in ref[2])
    assert_bitwise(ref, go(tmp_path, cache_dir, "three", dp=4.0, method=method, num_actors=3), f"{method}, inline, 3 hosts")


def test_inline_batched_equals_client_by_client_within_float_tolerance(tmp_path, cache_dir):
    rows_b, server_b, _ = go(tmp_path, cache_dir, "bat", dp=4.0, num_actors=2)
    rows_s, server_s, _ = go(tmp_path, cache_dir, "seq", dp=4.0, num_actors=2, batch_clients=False)
    for a, b in zip(rows_b, rows_s):
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), abs=1e-5)  # float reassociation
    for k in server_b:
        torch.testing.assert_close(server_b[k], server_s[k], rtol=0, atol=1e-5)  # the same, in the stacked matmuls' order


def _two_hosts(tmp_path, cache_dir, *, policy="drop"):
    from raysim.build import make_method
    from raysim.engine.backends import InlineBackend
    from raysim.engine.loop import prepare_data

    cfg = tiny_config(tmp_path, cache_dir, train={"num_clients": 4, "batch_size": 8, "n_ctx": 4},
                      data={"shots": 0, "partition": "dirichlet", "beta": 0.5}, dp={"epsilon": 4.0},
                      execution={"num_actors": 2, "stack_size": 4, "on_client_error": policy})
    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    return InlineBackend(cfg, data, cfg.output.out_dir, -1)


def test_guests_are_settled_on_their_own_host(tmp_path, cache_dir):
    """Host 0 trains the stack [0, 1, 2, 3]; clients 1 and 3 (host 1) come back to host 1, which alone
    writes their checkpoint (at the end of its settling call); host 0 keeps nothing of them."""
    b = _two_hosts(tmp_path, cache_dir)
    written = {0: [], 1: []}
    for i, h in enumerate(b.hosts):
        save = h.store.save_client
        h.store.save_client = lambda cid, r, state, _save=save, _i=i: (written[_i].append((cid, r)), _save(cid, r, state))[1]
    reports, _ = b.train_round(0, [0, 1, 2, 3])
    assert [r.client_id for r in reports] == [0, 1, 2, 3] and not any(r.dropped for r in reports)
    h0, h1 = b.hosts
    assert written == {0: [(0, 0), (2, 0)], 1: [(1, 0), (3, 0)]} and not h0.dirty and not h1.dirty
    assert set(h0.private) == {0, 2} and set(h0.privacy.states) == {0, 2} and not h0.guests
    assert all(h1.privacy.state(c).ledger is not None for c in (1, 3))  # the guests' ledgers, back home
    assert reports[1].epsilon == h1.epsilon(1) > 0
    b.commit(0)
    assert sorted(p.name for p in (tmp_path / "run" / "state" / "clients").iterdir()) == ["0", "1", "2", "3"]


def test_a_raising_stack_goes_client_by_client_on_each_clients_own_host(tmp_path, cache_dir, monkeypatch):
    ref = _two_hosts(tmp_path / "ref", cache_dir)
    ref_reports, _ = ref.train_round(0, [0, 1, 2, 3])
    b = _two_hosts(tmp_path / "broken", cache_dir)
    seen = []

    def broken(*args, **kwargs):
        raise RuntimeError("the stack broke")

    for h in b.hosts:
        monkeypatch.setattr(h.method, "batched_local_train", broken)
        each = h._each_client

        def spy(round_idx, cids, shared, *, phase, _h=h, _each=each):
            seen.append((b.hosts.index(_h), list(cids)))
            return _each(round_idx, cids, shared, phase=phase)

        monkeypatch.setattr(h, "_each_client", spy)
    reports, _ = b.train_round(0, [0, 1, 2, 3])
    assert seen == [(1, [1, 3])]  # host 1's clients redone at home; host 0's (0, 2) in its own ClientRound
    assert [(r.client_id, r.dropped) for r in reports] == [(c, False) for c in range(4)]
    for r, want in zip(reports, ref_reports):
        assert r.loss == pytest.approx(want.loss, abs=1e-5)  # client by client vs stacked: float reassociation
    for c in range(4):  # each client's round-0 state written by its own host at the end of its call; nothing left over
        assert b.hosts[c % 2].store.client_rounds(c) == [0] and not b.hosts[c % 2].dirty


@pytest.mark.parametrize("method", ["promptfl", "dpfpl", "fedpgp", "fedsept"])
def test_batched_runs_are_bitwise_the_same_inline_and_on_1_and_3_ray_actors(tmp_path, cache_dir, ray_session, method):
    """The must-show of issue 29: with DP-SGD on (per-client noise streams and ledgers), stacks that span
    hosts (6 clients, stack_size 4, participation 2/3): results.csv, the final shared tensors and every
    client's ledger (and private tensors: DP-FPL's U, V, S, FedPGP's U, V, FedSEPT's R and router state_dict,
    carried between hosts as guests) are bitwise the same on every backend and pool size. FedSEPT (SMALL):
    its patch router's tokens, dropout (each client's own global-RNG state) and L_gate.

    Pool sizes: which host trains a stack comes from the participants alone (`route_stacks`, the same code for
    every method), so PromptFL is run on 1 and 3 actors (2: tests/engine/test_engine.py's pool sizes); the other
    methods add their own state carried as guests (private tensors, a module's state_dict, a client's RNG state),
    which 3 actors exercise (a round's stack of 4 of the 6 clients holds clients of other processes): each Ray
    run of these costs a minute or more of CI."""
    ref = go(tmp_path, cache_dir, "inline", dp=4.0, method=method)
    assert all(ref[2][c] is None or ref[2][c]["privacy"]["ledger"] for c in ref[2])
    assert_bitwise(ref, go(tmp_path, cache_dir, "inline3", dp=4.0, method=method, num_actors=3), f"{method}, inline, 3 hosts")
    for n in ((1, 3) if method == "promptfl" else (3,)):
        got = go(tmp_path, cache_dir, f"ray{n}", dp=4.0, method=method, backend="ray", num_actors=n, client_cpus=0.25)
        assert_bitwise(ref, got, f"{method}, ray, {n} actors")
