"""pFedMoAP and DP-FPL, FedSEPT's baselines (SPEC 1.11): the gating head and the expert choice on worked
examples, the power-iteration factorisation, that only the declared tensors leave a client (and the
broadcast bank holds nothing but released tensors), DP-FPL's two privacy modes (their noise scales,
the reference mode marked invalid and warned about), and end-to-end runs with and without DP that give
identical results inline and on Ray."""

from __future__ import annotations

import logging
import math

import pandas as pd
import pytest
import torch
from conftest import tiny_config

from raysim.config import DPConfig
from raysim.methods import TrainConfig, get_method
from raysim.methods.fedsept.dpfpl import factorize, gram_schmidt
from raysim.methods.fedsept.pfedmoap import Gating, gated_logits, pool, select_experts
from raysim.privacy.host import HostPrivacy


def identity_gating(dim: int, heads: int, scaling: float = 10.0) -> Gating:
    g = Gating(dim, heads, scaling)
    with torch.no_grad():
        for lin in (g.W_q, g.W_k, g.W_v, g.W_o):
            lin.weight.copy_(torch.eye(dim))
            lin.bias.zero_()
    return g


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------------------- pFedMoAP
def test_pool_keeps_every_stride_th_dimension():
    t = torch.arange(8.0)
    assert pool(t, 2).tolist() == [0.0, 4.0]  # 8 // 2 = every 4th, as 512 -> 128 keeps every 4th
    assert pool(torch.arange(10.0), 4).tolist() == [0.0, 2.0, 4.0, 6.0]  # 10 // 4 = 2: the first 4 of every 2nd


def test_gating_head_on_a_worked_example():
    """d = 2, 2 heads (d_k = 1), identity projections, scale 10, one class, one image, keys = [own, expert].
    Image feature (width 8, pooled to its dims 0 and 4): q = (0.1, 0.2); own text pooled (1, 0), expert (0, 1).
    Head 1 (dim 0): scores 10 * 0.1 * (1, 0) = (1, 0) -> weights (sig(1), 1 - sig(1)) -> output sig(1).
    Head 2 (dim 1): scores 10 * 0.2 * (0, 1) = (0, 2) -> weights (1 - sig(2), sig(2)) -> output sig(2).
    Gated logit = 100 * (0.1 sig(1) + 0.2 sig(2))."""
    feats = torch.tensor([[0.1, 9, 9, 9, 0.2, 9, 9, 9]])
    own = torch.tensor([[1.0, 5, 5, 5, 0.0, 5, 5, 5]])  # (C=1, D=8)
    expert = torch.tensor([[[0.0, 7, 7, 7, 1.0, 7, 7, 7]]])  # (E=1, C=1, D=8)
    z = gated_logits(identity_gating(2, heads=2), 100.0, feats, own, expert, dim=2).detach()
    want = 100 * (0.1 * sigmoid(1.0) + 0.2 * sigmoid(2.0))  # = 24.93
    assert z.shape == (1, 1)
    assert abs(float(z) - want) < 1e-4  # float32 softmax and matmuls


def test_gating_one_head_per_class_and_image():
    """One head over d = 2: per class c the query attends over that class's keys only, and each image's
    logit depends only on its own query (what per-example DP-SGD needs)."""
    feats = torch.tensor([[0.1, 0.0], [0.0, 0.3]])  # two images (already width d: stride 1)
    own = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # two classes
    expert = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])
    z = gated_logits(identity_gating(2, heads=1), 100.0, feats, own, expert, dim=2).detach()
    # image 0, class 0: scores 10 * (0.1, 0) -> weights (sig(1), .) over keys (1,0), (0,1): out (sig(1), 1-sig(1))
    assert abs(float(z[0, 0]) - 100 * 0.1 * sigmoid(1.0)) < 1e-4
    # image 0, class 1: keys (0,1), (1,0): scores (0, 1) -> out (sig(1), 1 - sig(1)) swapped: <q, out> = 0.1 sig(1)
    assert abs(float(z[0, 1]) - 100 * 0.1 * sigmoid(1.0)) < 1e-4
    # image 1, class 0: keys (1,0), (0,1): scores 10 * 0.3 * (0, 1) = (0, 3) -> out dim 1 = sig(3)
    assert abs(float(z[1, 0]) - 100 * 0.3 * sigmoid(3.0)) < 1e-4
    z0 = gated_logits(identity_gating(2, heads=1), 100.0, feats[:1], own, expert, dim=2)
    assert torch.allclose(z0, z[:1])


def test_expert_selection_picks_the_nearest_uploaded_others():
    bank = torch.tensor([[0.0, 0.0], [5.0, 0.0], [1.0, 0.0], [0.5, 0.0], [3.0, 0.0], [0.1, 0.0]]).unsqueeze(1)  # (K=6, 1, 2)
    seen = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # client 5 never uploaded (its zero row would be nearest)
    own = torch.tensor([[0.2, 0.0]])
    assert select_experts(own, bank, seen, me=0, num_experts=3) == [3, 2]  # 2 = min(3, K) - 1 nearest, nearest first
    assert select_experts(own, bank, seen, me=3, num_experts=3) == [0, 2]  # never itself
    assert select_experts(own, bank, seen, me=0, num_experts=8) == [3, 2, 4, 1]  # fewer uploaded than experts: all
    assert select_experts(own, bank, seen, me=0, num_experts=1) == []


def _hosts(tmp_path, cache_dir, method, **extra):
    from raysim.build import make_method
    from raysim.engine.hosts import ClientHost, ServerHost
    from raysim.engine.loop import prepare_data

    cfg = tiny_config(tmp_path, cache_dir, method=method, train={"n_ctx": 4}, **extra)
    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    out = str(tmp_path / "hosts")
    return cfg, ServerHost(cfg, data.classnames, out), ClientHost(cfg, data, list(range(cfg.train.num_clients)), out)


@pytest.mark.parametrize("epsilon", [math.inf, 2.0])
def test_pfedmoap_uploads_only_ctx_and_broadcasts_only_released_tensors(tmp_path, cache_dir, epsilon):
    cfg, server, host = _hosts(tmp_path, cache_dir, "pfedmoap", dp={"epsilon": epsilon})
    gating = []
    for r in range(2):
        shared = server.get_shared()
        uploads, _ = host.train(r, [0, 1, 2], shared)
        gating.append({k: v.clone() for k, v in host.private[0]["gating"].items()})
        assert all(set(u.tensors) == {"ctx"} for u in uploads)  # the gating head and own ctx copy stay
        server.aggregate(r, uploads)
        after = server.get_shared()
        assert set(after) == {"ctx", "bank", "bank_seen"}
        n = [u.num_samples for u in uploads]  # ctx is the FedAvg of the released uploads
        fedavg = sum(u.tensors["ctx"] * k for u, k in zip(uploads, n)) / sum(n)
        torch.testing.assert_close(after["ctx"], fedavg, rtol=1e-5, atol=1e-6)  # float32 sums in another order
        for u in uploads:  # the bank is the released uploads themselves (post-processing), nothing else
            assert torch.equal(after["bank"][u.client_id], u.tensors["ctx"])
        assert after["bank_seen"].tolist() == [1.0, 1.0, 1.0, 0.0]
        assert float(after["bank"][3].abs().sum()) == 0.0  # client 3 never uploaded
    # round 1: the clients had their own last ctx, so each trained against experts (gating moved)
    init = host.method.init_private(host.env, host.data[0], torch.Generator().manual_seed(0))
    assert set(host.private[0]) == {"client", "ctx", "gating"}
    assert host.method.experts(host.env, server.get_shared(), host.private[0]).shape[0] == 2  # min(8, 4) - 1 = 3; 2 uploaded others
    assert set(host.private[0]["gating"]) == set(init["gating"])
    # without experts in round 0 the gate is unused (nothing moves it); with them in round 1 it trains
    assert any(not torch.equal(gating[1][k], gating[0][k]) for k in gating[0])


def test_pfedmoap_first_participation_uses_local_logits_only(tmp_path, cache_dir):
    cfg, server, host = _hosts(tmp_path, cache_dir, "pfedmoap")
    m, env = host.method, host.env
    priv = host.private_state(0)
    assert m.experts(env, server.get_shared(), priv) is None  # no own last ctx yet
    feats = host.data[0].x_test[:3]
    want = m.logits(env, feats, env.prompts.text_features(server.get_shared()["ctx"]))
    assert torch.allclose(m.predictor(env, server.get_shared(), priv)(feats), want, atol=1e-5)  # same float ops


# ----------------------------------------------------------------------------------------- DP-FPL
@pytest.mark.parametrize("shape", [(4, 32), (16, 64)])
def test_power_iteration_factorisation_reconstructs_and_is_orthonormal(shape):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(*shape, generator=g) * 0.02
    r = min(shape)
    U, V, S = factorize(X, r, g)
    assert U.shape == (shape[0], r) and V.shape == (r, shape[1]) and S.shape == shape
    assert torch.allclose(U @ V + S, X, atol=1e-6)  # float32: S is X - U V, so only rounding is left
    eye = torch.eye(r)
    assert torch.allclose(U.t() @ U, eye, atol=1e-4)  # Gram-Schmidt in float32 over up to 64 entries
    assert torch.allclose(V @ V.t(), eye, atol=1e-4)  # rows of V = columns of V^T, orthonormal
    U2, V2, S2 = factorize(X, r, g)  # fresh randomness: another factorisation of the same X
    assert not torch.allclose(V2, V) and torch.allclose(U2 @ V2 + S2, X, atol=1e-6)


def test_gram_schmidt_worked_example():
    M = torch.tensor([[3.0, 1.0], [4.0, 1.0]])
    Q = gram_schmidt(M)
    # column 0: (3, 4) / 5; column 1: (1, 1) - (7/5)(3/5, 4/5) = (4/25, -3/25), normalised (4/5, -3/5)
    assert torch.allclose(Q, torch.tensor([[0.6, 0.8], [0.8, -0.6]]), atol=1e-6)


def test_dpfpl_trains_all_parts_uploads_only_global_and_refactorises(tmp_path, cache_dir):
    cfg, server, host = _hosts(tmp_path, cache_dir, "dpfpl", dp={"epsilon": 2.0})
    assert host.method.rank(host.env) == 4  # rank 16 capped at n_ctx = 4
    before = {k: v.clone() for k, v in host.private_state(0).items()}
    uploads, _ = host.train(0, [0, 1], server.get_shared())
    assert all(set(u.tensors) == {"global_ctx"} for u in uploads)
    priv = host.private[0]
    assert set(priv) == {"U", "V", "residual"}
    assert not torch.allclose(priv["U"] @ priv["V"] + priv["residual"], before["U"] @ before["V"] + before["residual"])
    # re-factorised after the epoch's last batch: U and V^T have orthonormal columns again
    assert torch.allclose(priv["U"].t() @ priv["U"], torch.eye(4), atol=1e-4)
    assert torch.allclose(priv["V"] @ priv["V"].t(), torch.eye(4), atol=1e-4)
    ledger = host.privacy.ledger(0)
    assert ledger.valid and [r.mechanism for r in ledger.releases] == ["dpsgd"]


def _noise_std(mode: str, *, epsilon=1.0, rounds=3, B=8, n=40, clip=1.0):
    """Std of the noise one DP-FPL client step writes into the global prompt's gradient, with a loss whose
    gradient is 0 (so the gradient is the client's noise alone, divided by B for per-example DP-SGD)."""
    cls = get_method("dpfpl")
    dp = DPConfig(epsilon=epsilon, clip=clip, sampling="shuffle")
    method = cls(TrainConfig(batch_size=B, num_clients=2, rounds=rounds), cls.Options(dp_mode=mode), dp)
    host = HostPrivacy(dp=dp, method=method, seed=3, batch_size=B, releases_per_client=lambda cid: rounds)
    G = torch.zeros(400, 100, requires_grad=True)
    name = "global_grad" if mode == "reference" else "global_ctx"  # reference: the clipped gradient is uploaded
    h = host.open(0, 0, n, {"global_ctx": G.detach().clone()})
    loss = (G * 0).sum().expand(B).clone()  # B examples, each with a zero gradient
    h.backward(loss, dp_params={name: G})
    h.close({name: (G.grad if mode == "reference" else G).detach().clone()})
    return float(G.grad.std()), host


def test_dpfpl_modes_noise_where_each_code_puts_it():
    """per_example: DP-SGD on the client, noise sigma C on the clipped sum, sigma calibrated by the
    accountant for q = B/n over every step (SPEC 1.6), so std sigma C / B on the mean. reference: the DP-FPL
    code puts no noise on the client's upload (the server noises the K-client mean, tests/methods/
    test_dpfpl_reference.py), so the upload's local epsilon is inf and the code's claim is kept beside it."""
    from raysim.privacy.accountant import noise_multiplier

    B, n, rounds, eps = 8, 40, 3, 1.0
    std_ex, host_ex = _noise_std("per_example", epsilon=eps, rounds=rounds, B=B, n=n)
    std_ref, host_ref = _noise_std("reference", epsilon=eps, rounds=rounds, B=B, n=n)
    z = noise_multiplier(epsilon=eps, delta=1e-5, sample_rate=B / n, steps=rounds * (n // B))
    # 40,000 Gaussian draws: the sample std is within 2% of the true one (about 5 standard errors)
    assert abs(std_ex - z / B) / (z / B) < 0.02
    assert std_ref == 0.0  # the zero gradient leaves the client as it is: no client noise at all
    # the per-example ledger meets the target; the reference one is marked invalid: epsilon inf, claim kept
    assert host_ex.ledger(0).valid and host_ex.epsilon(0) <= eps
    ref = host_ref.ledger(0)
    assert not ref.valid and [(r.mechanism, r.valid) for r in ref.releases] == [("dpfpl_reference", False)]
    assert math.isinf(host_ref.epsilon(0)) and ref.claimed_epsilon() == eps


def test_dpfpl_reference_clips_the_batch_gradient_not_each_example():
    """Two examples with gradients (+3, 0) and (-1, 0): per example each is clipped to norm 1 -> mean 0;
    the reference clips the batch mean (1, 0), norm 1 -> (1, 0). Noise off (epsilon huge but finite is not
    zero noise), so the clipping is checked with the BatchClipSGD step itself."""
    from raysim.privacy.dpsgd import DPSGD, BatchClipSGD

    w = torch.zeros(2, requires_grad=True)
    a = torch.tensor([[3.0, 0.0], [-1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    BatchClipSGD(std=0.0, clip=1.0, generator=gen).backward(a @ w, dp_params={"w": w})
    assert torch.allclose(w.grad, torch.tensor([1.0, 0.0]))
    w.grad = None
    DPSGD(sigma=0.0, clip=1.0, sample_rate=1.0, generator=gen).backward(a @ w, dp_params={"w": w})
    assert torch.allclose(w.grad, torch.tensor([0.0, 0.0]))


def test_dpfpl_reference_mode_is_refused_at_client_level():
    from raysim.build import build_config
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="dp.level=sample"):
        build_config({"method": "dpfpl", "dpfpl": {"dp_mode": "reference"}, "dp": {"epsilon": 1.0, "level": "client"}})


# ------------------------------------------------------------------------------------- end to end
COLS = ["round", "in_client", "cross_client", "hm", "train_loss", "bytes_up", "bytes_down", "epsilon_max"]


@pytest.mark.parametrize("method", ["pfedmoap", "dpfpl"])
@pytest.mark.parametrize("epsilon", [math.inf, 1.0])
def test_end_to_end_identical_inline_and_on_ray(tmp_path, cache_dir, ray_session, method, epsilon):
    from raysim.engine.loop import run

    opts = dict(method=method, train={"n_ctx": 4, "rounds": 2}, dp={"epsilon": epsilon})
    a = run(tiny_config(tmp_path / "inline", cache_dir, **opts))
    b = run(tiny_config(tmp_path / "ray", cache_dir, execution={"backend": "ray", "num_actors": 2}, **opts))
    ra, rb = (pd.read_csv(r.out_dir / "results.csv")[COLS] for r in (a, b))
    pd.testing.assert_frame_equal(ra, rb)
    assert (ra["bytes_up"] > 0).all() and ra["train_loss"].notna().all()
    if math.isfinite(epsilon):
        assert (ra["epsilon_max"] <= epsilon * (1 + 1e-6)).all() and (ra["epsilon_max"] > 0).all()
    if method == "pfedmoap":  # the broadcast carries the bank: K ctx rows more than PromptFL's
        K, L, w = 4, 4, 128
        assert int(ra["bytes_down"].iloc[0]) == 4 * 4 * (L * w * (1 + K) + K)  # participants x float32 bytes


def test_dpfpl_reference_run_warns_once_and_records_no_local_guarantee(tmp_path, cache_dir, caplog):
    from raysim.engine.loop import run
    from raysim.privacy.ledger import PrivacyLedger
    from raysim.storage.store import StateStore

    cfg = tiny_config(tmp_path, cache_dir, method="dpfpl", train={"n_ctx": 4, "rounds": 2}, dpfpl={"dp_mode": "reference"},
                      dp={"epsilon": 1.0})
    with caplog.at_level(logging.WARNING, logger="raysim"):
        res = run(cfg)
    lines = [r.getMessage() for r in caplog.records if "dp_mode=reference" in r.getMessage()]
    assert len(lines) == 1  # said once per run, not once per step
    eps = pd.read_csv(res.out_dir / "results.csv")["epsilon_max"]
    assert eps.isna().all()  # no finite guarantee is printed for an un-noised upload
    for cid in range(cfg.train.num_clients):
        ledger = PrivacyLedger.from_dict(StateStore(res.out_dir).load_client(cid, 1)["privacy"]["ledger"])
        assert not ledger.valid and math.isinf(ledger.epsilon()) and ledger.claimed_epsilon() == 1.0
