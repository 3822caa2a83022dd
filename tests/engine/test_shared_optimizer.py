"""train.optimizer_state=shared (methods/base.py OptimizerCarry): the FedSEPT code's one SGD for all clients. Each client's
round continues the SGD state the previous client (in id order) left, round after round, exactly as one torch SGD
stepping them in turn; the state survives a resume; under DP every ledger records it as voiding the guarantee;
and it is refused where it cannot be honoured (several client hosts, a method without one SGD, dropped clients)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_config

from raysim.errors import ConfigError
from raysim.methods.base import OptimizerCarry

# a client-by-client fresh run (execution.batch_clients=false) computes what the shared one does, but for the carry
FEDSEPT = {"method": "fedsept", "fedsept": {"experts": 2, "rank": 4, "lambda_gate": 0.0}, "data": {"shots": 2},
           "train": {"num_clients": 3, "batch_size": 4, "n_ctx": 4, "momentum": 0.9, "weight_decay": 5e-4},
           "execution": {"batch_clients": False}}


def test_carried_state_continues_one_sgd_across_clients():
    """Client A steps, then client B starts from its own weights (the code reloads each client's weights) but A's
    momentum: the same as one torch SGD over one parameter stepping A's gradients, then B's. Fresh: B alone."""
    torch.manual_seed(0)
    grads_a, grads_b = torch.randn(3, 5), torch.randn(2, 5)
    start_a, start_b = torch.randn(5), torch.randn(5)

    def steps(p, opt, grads):
        for g in grads:
            p.grad = g.clone()
            opt.step()

    one = torch.nn.Parameter(start_a.clone())
    opt = torch.optim.SGD([one], lr=0.1, momentum=0.9, weight_decay=5e-4)
    steps(one, opt, grads_a)
    with torch.no_grad():
        one.copy_(start_b)
    steps(one, opt, grads_b)

    carry = OptimizerCarry()
    for start, grads in ((start_a, grads_a), (start_b, grads_b)):
        p = torch.nn.Parameter(start.clone())
        o = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=5e-4)
        carry.load_into(o)
        steps(p, o, grads)
        carry.take_from(o)
    assert torch.equal(p.detach(), one.detach())  # the same float operations in the same order: bitwise

    fresh = torch.nn.Parameter(start_b.clone())
    steps(fresh, torch.optim.SGD([fresh], lr=0.1, momentum=0.9, weight_decay=5e-4), grads_b)
    assert not torch.allclose(fresh, one)  # without the carry B's steps are its own


def _host(tmp_path, cache_dir, name, *, state, dp=0.0, resume_round=-1):
    from raysim.build import make_method
    from raysim.config import merge_config
    from raysim.engine.hosts import ClientHost
    from raysim.engine.loop import prepare_data

    values = merge_config(FEDSEPT, {"train": {"optimizer_state": state}})
    if dp:
        values["dp"] = {"epsilon": dp}
    cfg = tiny_config(tmp_path / name, cache_dir, **values)
    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    return ClientHost(cfg, data, list(range(3)), cfg.output.out_dir, resume_round)


def _uploads(got):
    return {u.client_id: u.tensors["A"] for u in got[0]}


def test_each_client_continues_the_previous_ones_sgd_round_after_round_and_on_resume(tmp_path, cache_dir):
    from raysim.sampling import generator

    fresh = _host(tmp_path, cache_dir, "fresh", state="fresh")
    shared = _host(tmp_path, cache_dir, "shared", state="shared")
    broadcast = fresh.method.init_shared(fresh.env, generator(1, "server-init"))
    a, b = _uploads(fresh.train(0, [0, 1, 2], broadcast)), _uploads(shared.train(0, [0, 1, 2], broadcast))
    assert torch.equal(a[0], b[0])  # nothing before the first client: it starts fresh either way
    for c in (1, 2):  # the later ones continue the momentum of the clients before them
        assert not torch.allclose(a[c], b[c], atol=1e-6), c
    assert shared.carry is not None and shared.carry.buffers is not None
    assert all(buf is not None for buf in shared.carry.buffers)  # A, R and the router all stepped

    # round 1: client 0 now continues client 2's state of round 0; a host resumed after round 0 does the same
    resumed = _host(tmp_path, cache_dir, "shared", state="shared", resume_round=0)
    assert resumed.carry is not None and resumed.carry.buffers is not None
    for x, y in zip(shared.carry.buffers, resumed.carry.buffers):
        assert x is not None and y is not None and torch.equal(x, y)
    a1 = _uploads(fresh.train(1, [0], broadcast))
    b1, r1 = _uploads(shared.train(1, [0], broadcast)), _uploads(resumed.train(1, [0], broadcast))
    assert not torch.allclose(a1[0], b1[0], atol=1e-6)
    assert torch.equal(b1[0], r1[0])  # the checkpointed state is the one the run goes on with


def test_under_dp_every_ledger_records_that_the_guarantee_does_not_hold(tmp_path, cache_dir):
    shared = _host(tmp_path, cache_dir, "dp", state="shared", dp=1.0)
    from raysim.sampling import generator

    shared.train(0, [0, 1, 2], shared.method.init_shared(shared.env, generator(1, "server-init")))
    for c in range(3):
        ledger = shared.privacy.ledger(c)
        assert not ledger.valid and math.isinf(shared.epsilon(c)) and ledger.claimed_epsilon() == 1.0
        assert any(r.mechanism == "shared_optimizer_state" for r in ledger.releases)


@pytest.mark.parametrize("extra,match", [
    ({"execution": {"backend": "ray", "num_actors": 0}}, "one host"),
    ({"execution": {"backend": "ray", "num_actors": 2}}, "one host"),
    ({"execution": {"on_client_error": "drop"}}, "on_client_error"),
    ({"method": "fedpha"}, "fedpha"),
    ({"train": {"optimizer_state": "carried"}}, "fresh .* or shared"),
])
def test_refused_where_it_cannot_be_honoured(tmp_path, cache_dir, extra, match):
    from raysim.config import merge_config

    values = merge_config(merge_config(FEDSEPT, {"train": {"optimizer_state": "shared"}}), extra)
    with pytest.raises(ConfigError, match=match):
        tiny_config(tmp_path, cache_dir, **values)


def test_honoured_on_one_host(tmp_path, cache_dir):
    from raysim.config import merge_config

    for execution in ({"backend": "inline"}, {"backend": "ray", "num_actors": 1}):
        cfg = tiny_config(tmp_path, cache_dir, **merge_config(FEDSEPT, {"train": {"optimizer_state": "shared"},
                                                                       "execution": execution}))
        assert cfg.train.optimizer_state == "shared"
