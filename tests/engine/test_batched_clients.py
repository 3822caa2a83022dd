"""Client-batched local training (execution.batch_clients, raysim/engine/batched.py): a host that trains its clients
in one stack gives the uploads, losses, private states, ledgers and DP noise of training them one by one
(within 1e-5: float reassociation in the stacked matmuls, which sum over A x C rows instead of C), with
unequal client sizes, with and without DP-SGD, inline and on Ray; is bitwise reproducible; handles a failing
client as client by client does; and leaves methods that do not stack untouched."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_config

from raysim.errors import ConfigError

ATOL = 1e-5  # float reassociation: a stacked matmul / attention sums in another order than K small ones
CLIENTS = 5


def hosts(tmp_path, cache_dir, *, dp=0.0, sampling="poisson", **extra):
    """A client-by-client host and a batched host over the same 5 clients of unequal size (Dirichlet
    skew, batch 8: from one to several batches each)."""
    from raysim.build import make_method
    from raysim.engine.hosts import ClientHost
    from raysim.engine.loop import prepare_data

    out = []
    execution = extra.pop("execution", {})
    train = extra.pop("train", {})
    data_opts = extra.pop("data", {})
    for batch in (False, True):
        values = dict(train={"num_clients": CLIENTS, "batch_size": 8, "n_ctx": 4, **train},
                      data={"shots": 0, "partition": "dirichlet", "beta": 0.5, **data_opts},
                      execution={"batch_clients": batch, **execution}, **extra)
        if dp:
            values["dp"] = {"epsilon": dp, "sampling": sampling}
        cfg = tiny_config(tmp_path / f"b{batch}", cache_dir, **values)
        data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
        out.append(ClientHost(cfg, data, list(range(CLIENTS)), cfg.output.out_dir))
    return out


def shared_of(host):
    from raysim.sampling import generator

    return host.method.init_shared(host.env, generator(host.cfg.train.seed, "server-init"))


def assert_same_round(a, b, *, exact=False):
    (ua, ra), (ub, rb) = a, b
    assert [u.client_id for u in ua] == [u.client_id for u in ub]
    assert [u.num_samples for u in ua] == [u.num_samples for u in ub]
    for x, y in zip(ua, ub):
        assert x.tensors.keys() == y.tensors.keys()
        for k in x.tensors:
            if exact:
                assert torch.equal(x.tensors[k], y.tensors[k]), (x.client_id, k)
            else:
                torch.testing.assert_close(y.tensors[k], x.tensors[k], rtol=0, atol=ATOL)
    assert [(r.client_id, r.dropped, r.error, r.bytes_up) for r in ra] == [(r.client_id, r.dropped, r.error, r.bytes_up) for r in rb]
    for x, y in zip(ra, rb):
        assert (math.isnan(x.loss) and math.isnan(y.loss)) or abs(x.loss - y.loss) <= ATOL, (x.client_id, x.loss, y.loss)
        assert x.epsilon == pytest.approx(y.epsilon, rel=1e-12)  # the same releases, accounted the same way


def ledgers(host):
    return {c: host.privacy.snapshot(c) for c in host.clients}


@pytest.mark.parametrize("dp,sampling", [(0.0, ""), (2.0, "poisson"), (2.0, "shuffle")])
def test_stack_equals_client_by_client(tmp_path, cache_dir, dp, sampling):
    seq, bat = hosts(tmp_path, cache_dir, dp=dp, sampling=sampling)
    sizes = sorted({seq.data[c].num_train // 8 for c in seq.clients})
    assert len(sizes) > 1, "the clients must take different numbers of steps"
    shared = shared_of(seq)
    for r in range(2):
        a = seq.train(r, list(seq.clients), shared)
        b = bat.train(r, list(bat.clients), shared)
        assert_same_round(a, b)
        assert ledgers(seq) == ledgers(bat)  # the same DP-SGD releases (sigma, q, steps) recorded per client
        assert seq.dirty == bat.dirty
        shared = {"ctx": torch.stack([u.tensors["ctx"] for u in a[0]]).mean(0)}


def test_dp_noise_streams_are_each_clients_own(tmp_path, cache_dir):
    """With a huge noise multiplier the upload is mostly noise: equal uploads mean each client drew its
    own noise stream, in the same order, in the stack."""
    from raysim.privacy.host import HostPrivacy

    seq, bat = hosts(tmp_path, cache_dir, dp=2.0)
    for h in (seq, bat):
        h.privacy.multiplier = lambda cid, n, _h=h: 50.0  # type: ignore[method-assign]
        assert isinstance(h.privacy, HostPrivacy)
    shared = shared_of(seq)
    a, b = seq.train(0, list(seq.clients), shared), bat.train(0, list(bat.clients), shared)
    assert_same_round(a, b)
    moved = [(u.tensors["ctx"] - shared["ctx"]).abs().max().item() for u in a[0]]
    assert min(moved) > 0.01  # the noise did move every client's context (lr 0.05, sigma 50)


def test_stack_privacy_backward_is_per_client_dpsgd():
    """StackPrivacy.backward on a toy stack (client k's loss_i = ||w_k * x_i - y_i||^2 plus a public
    term and a plain local tensor) against DPSGD.backward client by client: same clipped, noised .grad
    (to float reassociation), same noise draws (the generators end in the same state), same bookkeeping."""
    from raysim.engine.batched import StackPrivacy
    from raysim.privacy.dpsgd import DPSGD

    g = torch.Generator().manual_seed(0)
    sizes = [3, 0, 5]  # a Poisson batch may be empty
    xs = [torch.randn(b, 4, generator=g) for b in sizes]
    w0 = [torch.randn(4, generator=g) for _ in sizes]
    u0 = [torch.randn(4, generator=g) for _ in sizes]

    def losses(ks, ws, us):
        per = [((w * xs[k] + u).sum(-1) - 1.0).pow(2) for k, w, u in zip(ks, ws, us)]
        pub = [0.1 * w.pow(2).sum() for w in ws]
        return per, pub

    def sgd(k):
        return DPSGD(sigma=0.7, clip=0.5, sample_rate=0.5, generator=torch.Generator().manual_seed(100 + k), expected_batch=4.0)

    want, want_gen = [], []
    for k in range(len(sizes)):
        w, u = w0[k].clone().requires_grad_(True), u0[k].clone().requires_grad_(True)
        per, pub = losses([k], [w], [u])
        s = sgd(k)
        s.backward(per[0], {"w": w}, [u], public_loss=pub[0])
        want.append((w.grad, u.grad, s.steps, s.names_each_step))
        want_gen.append(torch.rand(3, generator=s.generator))

    class Handle:
        def __init__(self, s):
            self.stepper = s

    ws = [w.clone().requires_grad_(True) for w in w0]
    us = [u.clone().requires_grad_(True) for u in u0]
    steppers = [sgd(k) for k in range(len(sizes))]
    per, pub = losses(range(len(sizes)), ws, us)
    StackPrivacy([Handle(s) for s in steppers]).backward(range(len(sizes)), per, [{"w": w} for w in ws], [[u] for u in us], pub)
    for k, (wg, ug, steps, names) in enumerate(want):
        torch.testing.assert_close(ws[k].grad, wg, rtol=0, atol=1e-6)
        if sizes[k]:
            torch.testing.assert_close(us[k].grad, ug, rtol=0, atol=1e-6)
        else:
            assert us[k].grad is None and ug is None  # an empty batch leaves the plain tensors alone, as DPSGD does
        assert steppers[k].steps == steps and steppers[k].names_each_step == names
        assert torch.equal(torch.rand(3, generator=steppers[k].generator), want_gen[k])


def test_stack_is_bitwise_reproducible_and_chunked_stacks_agree(tmp_path, cache_dir):
    _, one = hosts(tmp_path / "a", cache_dir, dp=2.0)
    _, two = hosts(tmp_path / "b", cache_dir, dp=2.0)
    seq, chunked = hosts(tmp_path / "c", cache_dir, dp=2.0, execution={"stack_size": 2})
    shared = shared_of(one)
    first = one.train(0, list(one.clients), shared)
    assert_same_round(first, two.train(0, list(two.clients), shared), exact=True)
    assert_same_round(seq.train(0, list(seq.clients), shared), chunked.train(0, list(chunked.clients), shared))


def test_a_failing_client_in_the_stack_is_dropped_as_client_by_client(tmp_path, cache_dir):
    """A client whose upload is not finite (its data hold a nan) is dropped and the others keep their
    results; under fail the round stops at it, the later clients untouched, as client by client."""
    for policy in ("drop", "fail"):
        seq, bat = hosts(tmp_path / policy, cache_dir, dp=2.0, execution={"on_client_error": policy})
        for h in (seq, bat):
            h.data[2].x_train = h.data[2].x_train.clone()
            h.data[2].x_train[0, 0] = float("nan")
        shared = shared_of(seq)
        a, b = seq.train(0, list(seq.clients), shared), bat.train(0, list(bat.clients), shared)
        assert_same_round(a, b)
        assert [r.client_id for r in b[1] if r.dropped] == [2] and "not finite" in b[1][2].error
        assert len(b[1]) == (CLIENTS if policy == "drop" else 3)
        assert ledgers(seq) == ledgers(bat)


def test_a_raising_stack_replays_the_round_client_by_client(tmp_path, cache_dir, monkeypatch, caplog):
    import logging

    seq, bat = hosts(tmp_path, cache_dir, dp=2.0, execution={"on_client_error": "drop"})

    def broken(*args, **kwargs):
        raise RuntimeError("a client in the stack broke")

    monkeypatch.setattr(bat.method, "batched_local_train", broken)
    shared = shared_of(seq)
    with caplog.at_level(logging.INFO, logger="raysim.engine.batched"):
        b = bat.train(0, list(bat.clients), shared)
    assert "one by one" in caplog.text
    assert_same_round(seq.train(0, list(seq.clients), shared), b, exact=True)  # it is the client-by-client path
    assert ledgers(seq) == ledgers(bat)


def test_methods_that_do_not_stack_are_unaffected(tmp_path, cache_dir):
    import flaky_method  # noqa: F401 - registers `flaky`: PromptFL with its own local_train

    from raysim.engine.batched import train_stack

    for method, extra in (("dpfpl", {"dpfpl": {"dp_mode": "reference"}}), ("flaky", {}),
                          ("promptfl", {"execution": {"client_timeout": 100.0}})):
        _, h = hosts(tmp_path / method, cache_dir, method=method, **extra)
        assert train_stack(h, 0, list(h.clients), shared_of(h)) is None, method
    _, h = hosts(tmp_path / "pfl", cache_dir)
    assert h.method.supports_batching()
    with pytest.raises(ConfigError, match="stack_size"):
        tiny_config(tmp_path, cache_dir, execution={"stack_size": 0})


def test_engine_batched_equals_client_by_client_inline_and_on_ray(tmp_path, cache_dir, ray_session):
    """Whole runs, 8 clients: inline (one host) and Ray with 2 actors (4 clients a host, pooled): the recorded
    uploads and the train losses match client by client's within 1e-5."""
    import csv

    from raysim.engine.loop import run
    from raysim.storage.store import StateStore

    def go(tag, **extra):
        cfg = tiny_config(tmp_path / tag, cache_dir, train={"num_clients": 8, "rounds": 2, "batch_size": 8, "n_ctx": 4},
                          data={"shots": 0, "partition": "dirichlet", "beta": 0.5}, output={"record_uploads": True},
                          eval={"every": 100, "last": 0},
                          **{"dp": {"epsilon": 4.0}}, **extra)
        out = run(cfg).out_dir
        with open(out / "results.csv") as f:
            loss = [float(r["train_loss"]) for r in csv.DictReader(f)]
        return loss, [StateStore(out).load_uploads(r)["uploads"] for r in range(2)]

    ref_loss, ref_up = go("seq", execution={"batch_clients": False})
    for tag, x in {"inline": {}, "ray": {"backend": "ray", "num_actors": 2, "client_cpus": 0.5}}.items():
        loss, up = go(tag, execution={"batch_clients": True, **x})
        assert loss == pytest.approx(ref_loss, abs=ATOL), tag
        for r in range(2):
            assert up[r].keys() == ref_up[r].keys()
            for c in up[r]:
                torch.testing.assert_close(up[r][c]["ctx"], ref_up[r][c]["ctx"], rtol=0, atol=ATOL)


def test_shared_prefix_features_equal_the_full_forward():
    """stacked_text_features (prefix once per context, EOT rows only in the last layer) against
    CoOpPrompts.text_features: features and context gradients, classes whose prompts end at different
    positions ("guinea pig" is two tokens), to float reassociation."""
    from raysim.models.clip import ModelSpec, build_clip_env
    from raysim.models.shared_prefix import shares_prefix, stacked_text_features

    env = build_clip_env(ModelSpec("raysim-tiny", ""), ["zero", "one", "guinea pig", "fire truck"], n_ctx=3)
    assert shares_prefix(env.prompts) and len(set(env.prompts.meta.tolist())) == 2
    ctx = torch.randn(5, 3, env.ctx_width, generator=torch.Generator().manual_seed(0)) * 0.5
    a, b = ctx.clone().requires_grad_(True), ctx.clone().requires_grad_(True)
    full, shared = env.prompts.text_features(a), stacked_text_features(env.prompts, b)
    torch.testing.assert_close(shared, full, rtol=0, atol=ATOL)
    weights = torch.randn(full.shape, generator=torch.Generator().manual_seed(1))
    (full * weights).sum().backward()
    (shared * weights).sum().backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=ATOL)


def test_shared_prefix_follows_the_towers_fast_paths():
    """Under execution.autocast=bf16 the stacked forward runs in bf16 as the full one does (agreeing to bf16
    precision, 3e-2 on unit-norm features: 8 mantissa bits through two layers); with execution.compile it is
    the (compiled) full forward itself."""
    from raysim.models.clip import FastPaths, ModelSpec, build_clip_env
    from raysim.models.shared_prefix import stacked_text_features

    names = ["zero", "one", "guinea pig"]
    ctx = torch.randn(3, 3, 128, generator=torch.Generator().manual_seed(0)) * 0.5
    env = build_clip_env(ModelSpec("raysim-tiny", "", fast=FastPaths(autocast="bf16")), names, n_ctx=3)
    full, shared = env.prompts.text_features(ctx), stacked_text_features(env.prompts, ctx)
    assert shared.dtype == torch.float32
    torch.testing.assert_close(shared, full, rtol=0, atol=3e-2)
    env = build_clip_env(ModelSpec("raysim-tiny", "", fast=FastPaths(compile=True, compile_backend="eager")), names, n_ctx=3)
    assert torch.equal(stacked_text_features(env.prompts, ctx), env.prompts.text_features(ctx))
