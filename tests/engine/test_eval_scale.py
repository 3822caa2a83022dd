"""Evaluation that scales (issue 17 item 3): a method whose predictor is every client's (a global model)
is scored once per test row instead of once per client, with the same numbers; `eval.clients=N`
evaluates a seeded sample of N clients, the same every evaluated round, whatever the backend or pool."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
from conftest import tiny_config

from raysim.engine.loop import run
from raysim.metrics import TIMING_COLUMNS
from raysim.sampling import eval_clients

# accuracies are ratios of hit counts: the same hits give the same ratio, so agreement is to rounding only
SAME = 1e-12


def read_rows(path):
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in csv.DictReader(f)]


def assert_rows_equal(a, b):
    assert [r["client"] for r in a] == [r["client"] for r in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], float):
                assert (math.isnan(x[k]) and math.isnan(y[k])) or x[k] == pytest.approx(y[k], abs=SAME), (x["client"], k)
            else:
                assert x[k] == y[k], (x["client"], k)


# -- the sample --------------------------------------------------------------------------------------


def test_eval_sample_is_a_pure_function_of_the_seed():
    s = eval_clients(1, 100, 10)
    assert s == sorted(set(s)) and len(s) == 10 and all(0 <= c < 100 for c in s)
    assert eval_clients(1, 100, 10) == s  # no hidden state
    assert eval_clients(2, 100, 10) != s  # another seed, another sample
    assert eval_clients(1, 100, 0) == list(range(100)) == eval_clients(1, 100, 100)  # 0 (or all): every client
    np.random.seed(123)
    torch.manual_seed(123)
    assert eval_clients(1, 100, 10) == s  # the global RNGs play no part


def test_sample_is_the_same_every_round_and_written_in_results_and_summary(tmp_path, cache_dir):
    cfg = tiny_config(tmp_path, cache_dir, train={"num_clients": 6, "rounds": 2}, eval={"clients": 3, "every": 1})
    res = run(cfg)
    want = eval_clients(cfg.train.seed, 6, 3)
    clients = read_rows(res.out_dir / "client_results.csv")
    for r in range(2):
        assert [int(c["client"]) for c in clients if int(c["round"]) == r] == want
        # Cross-Client of a sampled client is on the other sampled clients' test splits only
        n_test = {c: len(t) for c, t in enumerate(_test_sizes(cfg))}
        for c in (c for c in clients if int(c["round"]) == r):
            me = int(c["client"])
            assert int(c["n_cross"]) == sum(n_test[o] for o in want if o != me)
    results = read_rows(res.out_dir / "results.csv")
    assert [int(r["eval_clients"]) for r in results] == [3, 3]
    assert res.info["eval_clients"] == 3
    summary = (res.out_dir / "summary.md").read_text()
    assert "a sample of 3 of the 6 clients (eval.clients=3" in summary
    full = run(tiny_config(tmp_path / "all", cache_dir, train={"num_clients": 6, "rounds": 1}))
    assert "Evaluated per evaluated round: all 6 clients." in (full.out_dir / "summary.md").read_text()


def _test_sizes(cfg):
    from raysim.build import make_method
    from raysim.engine.loop import prepare_data

    return prepare_data(cfg, make_method(cfg).needs(), progress=False).test_idx


@pytest.mark.parametrize("value", ["-1", "7"])
def test_bad_eval_clients_is_refused_with_exit_2(tmp_path, capsys, value):
    from raysim.run import main

    out = tmp_path / "refused"
    code = main([f"eval.clients={value}", "train.num_clients=6", "execution.backend=inline", "data.dataset=digits",
                 f"output.out_dir={out}", "output.progress=false", f"output.cache_dir={tmp_path / 'c'}"])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "eval.clients" in err and "train.num_clients=6" in err and value in err


# -- the global-model path ---------------------------------------------------------------------------


def _trained_backend(cfg, rounds=1):
    from raysim.build import make_method
    from raysim.engine.backends import BACKENDS
    from raysim.engine.loop import prepare_data
    from raysim.sampling import participants

    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    b = BACKENDS[cfg.execution.backend](cfg, data, cfg.output.out_dir, -1)
    for r in range(rounds):
        b.train_round(r, participants(cfg.train.seed, r, cfg.train.num_clients, cfg.train.participation))
    return b


@pytest.mark.parametrize("protocol", ["in_cross", "vpdr", "fedtsp"])
def test_global_model_path_equals_the_per_client_path(tmp_path, cache_dir, protocol):
    cfg = tiny_config(tmp_path, cache_dir, train={"num_clients": 5}, eval={"protocol": protocol, "batch_size": 7},
                      execution={"num_actors": 2})  # two inline hosts, batches of 7: every cut is tested
    b = _trained_backend(cfg)
    assert b.global_eval  # promptfl declares it
    for among in (None, eval_clients(cfg.train.seed, 5, 3)):
        fast = b.evaluate(among)
        b.global_eval = False
        slow = b.evaluate(among)
        b.global_eval = True
        assert len(fast) == (5 if among is None else 3)
        assert_rows_equal(fast, slow)


def test_parts_of_the_rows_cut_at_batch_boundaries_merge_to_the_whole():
    from raysim.engine.evaluation import Hits, block_part, merge_hits

    rows = np.array([0, 2, 3, 5, 8, 9, 11, 12, 13, 20, 21])
    for parts in (1, 2, 3, 5, 12):
        pieces = [block_part(rows, p, parts, 3) for p in range(parts)]
        assert all(len(p) % 3 == 0 for p in pieces[:-1])  # every cut is at a batch boundary
        assert np.array_equal(np.concatenate(pieces), rows)
        merged = merge_hits([Hits(p, p % 2 == 0, p % 3 == 0) for p in reversed(pieces)])
        assert np.array_equal(merged.rows, rows) and np.array_equal(merged.top1, rows % 2 == 0)
    with pytest.raises(ValueError):
        Hits(rows, rows > 0, rows > 0).part(np.array([1]))  # a row the hits do not cover


def test_eval_is_the_same_inline_on_ray_and_for_any_pool_size(tmp_path, cache_dir, ray_session):
    """A sampled evaluation after a round, through both paths (the global model's hits split over the
    hosts, and per client), inline on 1 and 3 hosts and on Ray with 2 actors: the same rows. (The engine
    passes the same sample to every backend: `eval_clients` depends on train.seed alone.)"""
    among = eval_clients(1, 5, 3)
    ref = None
    for name, extra in {"inline": {}, "inline3": dict(num_actors=3),
                        "ray2": dict(backend="ray", num_actors=2, client_cpus=0.5)}.items():
        cfg = tiny_config(tmp_path / name, cache_dir, train={"num_clients": 5, "n_ctx": 4}, execution=extra)
        b = _trained_backend(cfg)
        try:
            got = []
            for global_path in (True, False):
                b.global_eval = global_path
                got.append(b.evaluate(among))
        finally:
            b.shutdown()
        assert [r["client"] for r in got[0]] == among, name
        assert_rows_equal(got[0], got[1])
        if ref is None:
            ref = got[0]
        assert_rows_equal(got[0], ref)


# -- the declaration, checked against behaviour ------------------------------------------------------


def _declared_global():
    from raysim.methods import get_method, method_names

    return [n for n in method_names() if get_method(n).global_predictor]


def test_the_methods_declaring_a_global_model():
    assert {"promptfl", "zeroshot", "fedavg", "fedbabu", "fedetf", "fedfa", "fedtsp_gfl"} <= set(_declared_global())
    assert not {"fedsept", "fedpgp", "fedpac", "fedproto", "local", "dpfpl"} & set(_declared_global())


@pytest.mark.parametrize("name", _declared_global())
def test_a_declared_global_predictor_is_the_same_for_every_client(tmp_path, name):
    """Two clients with different data and private state after a round predict the same logits; and an
    option that personalises the model (-FT) turns the declaration off."""
    config, hosts = _conformance().config, _conformance().hosts
    cfg = config(tmp_path, name)
    _, server, host = hosts(cfg, str(tmp_path / "a"))
    assert host.method.predicts_globally()
    uploads, _ = host.train(0, [0, 1], server.get_shared())
    server.aggregate(0, uploads)
    shared = server.get_shared()
    d0, d1 = host.data[0], host.data[1]
    x = torch.cat([d0.x_test[:4], d1.x_test[:4]])
    extra = (torch.cat([d0.tokens_test[:4], d1.tokens_test[:4]]),) if d0.tokens_test is not None else ()
    with torch.no_grad():
        a = host.method.predictor(host.env, shared, host.private[0], d0)(x, *extra)
        b = host.method.predictor(host.env, shared, host.private[1], d1)(x, *extra)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # one model, the same inputs: equal up to kernel rounding
    from raysim.build import make_method, method_options
    if hasattr(method_options(cfg), "finetune_epochs"):
        ft = config(tmp_path / "ft", name, **{name: {**_fast(name), "finetune_epochs": 1}})

        assert not make_method(ft).predicts_globally()


def _fast(name):
    return dict(_conformance().FAST.get(name, {}))


def _conformance():
    """tests/methods/test_conformance.py (its FAST options and host builders), imported by path."""
    import importlib.util
    import sys
    from pathlib import Path

    if "raysim_test_conformance" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "raysim_test_conformance", Path(__file__).parent.parent / "methods" / "test_conformance.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["raysim_test_conformance"] = mod
    return sys.modules["raysim_test_conformance"]


def test_scoring_many_clients_in_one_pass_equals_scoring_each():
    """InCross.score_many (per-owner hit counts) against score_hits (masks), with a client that has no
    test rows and one that is not evaluated; on all rows and on an evaluated subset's rows."""
    from raysim.data.federation import FederationData
    from raysim.engine.evaluation import Hits, InCross

    owner = np.array([0, 0, 1, 1, 1, 3, 3, 0, 1, 3])
    fed = FederationData(
        x_train=np.zeros((0, 1), np.float32), y_train=np.zeros(0, np.int64),
        x_test=np.zeros((len(owner), 1), np.float32), y_test=np.zeros(len(owner), np.int64),
        train_idx=[np.zeros(0, np.int64)] * 4, test_idx=[np.flatnonzero(owner == c) for c in range(4)],
        classnames=["a", "b"],
    )
    p = InCross(fed, batch_size=3)
    rng = np.random.default_rng(0)
    for among in (None, [0, 2, 3]):
        rows = p.rows(among)
        hits = Hits(rows, rng.random(len(rows)) < 0.5, rng.random(len(rows)) < 0.8)
        clients = [0, 1, 2, 3] if among is None else among
        fast, slow = p.score_many(clients, hits), [p.score_hits(c, hits) for c in clients]
        for c, a, b in zip(clients, fast, slow):
            assert (a["n_in"], a["n_cross"]) == (b["n_in"], b["n_cross"]), c
            for k in ("in_client", "cross_client", "in_top5", "cross_top5"):
                assert (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == pytest.approx(b[k], abs=SAME), (c, k)
        assert math.isnan(fast[clients.index(2)]["in_client"])  # client 2 has no test rows
