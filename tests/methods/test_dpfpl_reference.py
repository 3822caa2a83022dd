"""DP-FPL's reference mode (`dpfpl.dp_mode=reference`) as the DP-FPL code does it (linhhtran/DP-FPL,
federated_main.py + trainers/DP_FPL.py): lock-step rounds, the client's clipped global-prompt gradient
uploaded without noise, the server's noise of std sigma C / (B K) on the K-client mean at every step, the
local U and V gradients clipped and noised, and the ledger saying it is not a local-DP guarantee."""

from __future__ import annotations

import math

import pandas as pd
import torch
import torch.nn.functional as F
from conftest import tiny_config

from raysim.config import DPConfig
from raysim.methods import TrainConfig, get_method
from raysim.privacy.host import HostPrivacy
from raysim.privacy.ledger import PrivacyLedger
from raysim.storage.store import StateStore

EPS, DELTA, C = 1.0, 1e-5, 10.0


def code_sigma(rounds: int, epsilon: float = EPS) -> float:
    """trainers/DP_FPL.py: sigma = q sqrt(steps ln(1/delta)) / NOISE with q = 1, steps = cfg.OPTIM.ROUND."""
    return 1.0 * math.sqrt(rounds * math.log(1 / DELTA)) / epsilon


def _reference_run(tmp_path, cache_dir, *, rounds=2, backend="inline", **extra):
    from raysim.engine.loop import run

    cfg = tiny_config(tmp_path, cache_dir, method="dpfpl", dpfpl={"dp_mode": "reference"}, dp={"epsilon": EPS},
                      train={"n_ctx": 4, "rounds": rounds, "momentum": 0.0, "weight_decay": 0.0, "lr": 0.05},
                      output={"record_uploads": True}, execution={"backend": backend, **extra})
    return cfg, run(cfg)


def test_server_noise_measured_from_recorded_updates_is_sigma_C_over_B_K(tmp_path, cache_dir):
    """With momentum and weight decay 0 the server's step is G' = G - lr (mean of the K uploaded clipped
    gradients + noise), so noise = (G - G') / lr - mean(uploads), from what the server recorded of the last
    lock-step of round 0 (its `pre` and the uploads) and the server's checkpoint after it."""
    cfg, res = _reference_run(tmp_path, cache_dir, rounds=1)
    store = StateStore(res.out_dir)
    r0, after = store.load_uploads(0), store.load_server(0)
    ups = list(r0["uploads"].values())
    K, B = len(ups), cfg.train.batch_size
    assert K == cfg.train.num_clients
    mean = sum(u["global_grad"] for u in ups) / K
    noise = (r0["pre"]["global_ctx"] - after["global_ctx"]) / cfg.train.lr - mean
    want = code_sigma(cfg.train.rounds) * C / (B * K)
    n = noise.numel()
    # n Gaussian draws: the sample std's relative standard error is 1/sqrt(2n) (1.6% at n = 2048); 6 of them
    tol = 6 / math.sqrt(2 * n)
    assert abs(float(noise.std()) - want) / want < tol, (float(noise.std()), want, n)
    assert abs(float(noise.mean())) < 6 * want / math.sqrt(n)  # zero-mean noise
    # what the client uploads is the clipped gradient, no noise: within the clip ball (noise of std
    # sigma C / B = 0.46 per coordinate would put it far outside: norm ~ 0.46 sqrt(n) = 21 > C)
    assert all(float(u["global_grad"].norm()) <= C * (1 + 1e-5) for u in ups)


def test_each_round_runs_its_lock_steps_and_the_ledger_says_not_local_dp(tmp_path, cache_dir):
    from raysim.build import make_method
    from raysim.engine.loop import prepare_data
    from raysim.sampling import batches_per_epoch

    cfg, res = _reference_run(tmp_path, cache_dir)
    method = make_method(cfg)
    sizes = [len(i) for i in prepare_data(cfg, method.needs(), progress=False).train_idx]
    S = cfg.train.local_epochs * max(batches_per_epoch(n, cfg.train.batch_size) for n in sizes)
    assert method.lockstep_steps(sizes) == S
    saved = StateStore(res.out_dir).load_client(0, cfg.train.rounds - 1)
    ledger = PrivacyLedger.from_dict(saved["privacy"]["ledger"])
    # every release is one lock-step of the clipped, un-noised upload
    assert ledger.releases and all(r.mechanism == "dpfpl_reference" and not r.valid for r in ledger.releases)
    assert all(r.steps == 1 and r.sigma == 0.0 for r in ledger.releases)
    rounds = sorted({r.round for r in ledger.releases})
    assert rounds == list(range(cfg.train.rounds))
    per_round = [sum(1 for r in ledger.releases if r.round == t) for t in rounds]
    assert per_round == [S] * cfg.train.rounds  # S lock-steps a round, each one upload
    assert saved["private"]["lockstep"]["step"] == S  # the client's step counter, reset each round
    # the true local epsilon of an un-noised upload is infinite; the code's claim is kept beside it
    assert math.isinf(ledger.epsilon()) and not ledger.valid
    assert ledger.claimed_epsilon() == EPS
    rows = pd.read_csv(res.out_dir / "results.csv")
    assert rows["epsilon_max"].isna().all()  # not a finite guarantee, so no finite epsilon is printed


def _one_step(mode: str, *, zero_grad: bool, rounds=3, B=8, n=40):
    """One local step of client 0 through the privacy host; returns its upload, the host and the method."""
    cls = get_method("dpfpl")
    dp = DPConfig(epsilon=EPS, sampling="shuffle")
    method = cls(TrainConfig(batch_size=B, num_clients=2, rounds=rounds), cls.Options(dp_mode=mode), dp)
    host = HostPrivacy(dp=dp, method=method, seed=3, batch_size=B, releases_per_client=lambda cid: rounds)
    G = torch.zeros(400, 100, requires_grad=True)
    name = "global_grad" if mode == "reference" else "global_ctx"
    h = host.open(0, 0, n, {"global_ctx": G.detach().clone()})
    w = torch.randn(400, 100, generator=torch.Generator().manual_seed(1))
    loss = ((G * 0).sum() if zero_grad else (G * w).sum()).expand(B).clone()  # every example's gradient: 0 or w
    h.backward(loss, dp_params={name: G})
    upload = G.grad.detach().clone() if mode == "reference" else G.detach().clone()
    h.close({name: upload})
    return upload, host, method


def test_client_upload_is_clipped_at_norm_thresh_and_carries_no_noise():
    up, host, _ = _one_step("reference", zero_grad=True)
    assert float(up.abs().max()) == 0.0  # a zero gradient stays zero: no client noise at all
    up, _, _ = _one_step("reference", zero_grad=False)
    raw = torch.randn(400, 100, generator=torch.Generator().manual_seed(1))  # the batch-mean gradient, w
    assert float(raw.norm()) > 10 * C  # norm ~ 200: the clip at NORM_THRESH binds
    torch.testing.assert_close(up, raw * (C / float(raw.norm())))  # clipped as a whole, nothing added


def test_server_std_formula_and_local_uv_noise():
    _, _, method = _one_step("reference", zero_grad=True, rounds=50, B=32)
    for K in (1, 10):
        assert abs(method.server_noise_std(K) - code_sigma(50) * C / (32 * K)) < 1e-12
    from raysim.privacy.mechanisms.dpfpl_reference import local_noise_std

    assert abs(local_noise_std(50, EPS, DELTA, C, 32) - code_sigma(50) * C / 32) < 1e-12


def test_reference_mode_identical_inline_and_on_ray(tmp_path, cache_dir, ray_session):
    """The lock-step round and its per-step streams give the same run on both backends."""
    cols = ["round", "in_client", "cross_client", "hm", "train_loss", "bytes_up", "bytes_down"]
    _, a = _reference_run(tmp_path / "inline", cache_dir)
    _, b = _reference_run(tmp_path / "ray", cache_dir, backend="ray", num_actors=2)
    ra, rb = (pd.read_csv(r.out_dir / "results.csv")[cols] for r in (a, b))
    pd.testing.assert_frame_equal(ra, rb)
    assert ra["train_loss"].notna().all()


# ---------------------------------------------------------------- the local step (Ray-free, a fake text tower)
# The DP-FPL code (trainers/DP_FPL.py): every forward re-factorises the local prompt X (local_ctx) afresh,
# U, V, S = factorize(X, r); the prompt is G + U V + S with S a constant of the forward; U and V are clipped
# to C and noised under DP; X steps with compute_full_grad = (gU V + U gV + U U^T gU V) / 10. A text tower
# that is the identity (class c's feature is row c of the prompt, d = w) makes the prompt's gradient g
# a closed form, so the step can be computed by hand. L = 4 classes and tokens, w = 6, 5 examples.
L, W, B_LOCAL = 4, 6, 5
LR, WD, SCALE = 0.1, 5e-4, 3.0


def _local_setup(*, rank: int, epsilon: float, norm_thresh: float = C):
    from types import SimpleNamespace

    from raysim.data.client import ClientData

    cls = get_method("dpfpl")
    dp = DPConfig(epsilon=epsilon, sampling="shuffle")
    train = TrainConfig(batch_size=B_LOCAL, num_clients=2, rounds=3, n_ctx=L, lr=LR, momentum=0.9, weight_decay=WD)
    method = cls(train, cls.Options(dp_mode="reference", rank=rank, norm_thresh=norm_thresh), dp)
    env = SimpleNamespace(ctx_width=W, device=torch.device("cpu"), logit_scale=SCALE,
                          prompts=SimpleNamespace(text_features=lambda P: P))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(B_LOCAL, W, generator=g), torch.tensor([0, 1, 2, 3, 1])
    data = ClientData(0, x, y, x, y, L)
    shared = method.init_shared(env, torch.Generator().manual_seed(1))
    private = method.init_private(env, data, torch.Generator().manual_seed(2))
    return method, env, data, shared, private


def _local_step(method, env, data, shared, private):
    """One lock-step of client 0 (its whole batch: n = B) through the privacy host; (result, the step's rng)."""
    host = HostPrivacy(dp=method.dp, method=method, seed=3, batch_size=B_LOCAL, releases_per_client=lambda cid: 3)
    h = host.open(0, 0, data.num_train, {"global_ctx": shared["global_ctx"].clone()})
    rng = torch.Generator().manual_seed(4)
    start = rng.get_state()
    res = method.local_train(env, shared, private, data, rng=rng, privacy=h)
    h.close(res.upload)
    return res, start


def _prompt_grad(G, X, data):
    """d mean CE / dP for logits s x P^T (P = G + X): s (softmax - onehot)^T x / B, by hand."""
    logits = SCALE * data.x_train @ (G + X).t()
    p = torch.softmax(logits, dim=1) - F.one_hot(data.y_train, L).float()
    return SCALE * p.t() @ data.x_train / data.num_train


def _X(private):
    return private["U"] @ private["V"] + private["residual"]


# float32 through Gram-Schmidt and a few 4 x 6 products: errors ~1e-6 of entries ~0.01-0.1
TOL = dict(rtol=1e-4, atol=1e-6)


def test_reference_local_step_at_full_rank_is_g_plus_twice_its_row_projection_over_10():
    """r = L: U is square orthogonal (P_U = I) and V's rows span X's row space, so the code's gradient of X
    is (g + 2 g P_X) / 10, P_X = X^T (X X^T)^-1 X, whatever the factorisation's randomness; no DP: nothing
    clipped. The first SGD step (buffer = the step's gradient): X' = X - lr (grad + wd X). The old step
    (U, V, S each stepped by their own gradients, S's being g itself) gives a different X'."""
    method, env, data, shared, private = _local_setup(rank=L, epsilon=math.inf)
    G, X = shared["global_ctx"], _X(private)
    g = _prompt_grad(G, X, data)
    P = X.t() @ torch.linalg.inv(X @ X.t()) @ X
    want = X - LR * ((g + 2 * g @ P) / 10 + WD * X)
    res, _ = _local_step(method, env, data, shared, private)
    torch.testing.assert_close(_X(res.private), want, **TOL)
    torch.testing.assert_close(res.upload["global_grad"], g, **TOL)  # no DP: G's plain gradient is uploaded


def test_reference_local_step_clips_u_and_v_gradients_apart_and_never_s():
    """DP on (epsilon 1e9: noise std sigma C/B ~ 1e-9, far under the tolerance), C below both norms: at r = L
    gU = g V^T has the norm of g P_X and gV = U^T g the norm of g, so the code's step of X is
    (2 c_U g P_X + c_V g) / 10 with c_U = C/|g P_X|, c_V = C/|g|; G's gradient is clipped as a whole to C.
    The residual S gets no gradient (a clipped or unclipped g of its own would add to X's step)."""
    method, env, data, shared, private = _local_setup(rank=L, epsilon=1e9)
    G, X = shared["global_ctx"], _X(private)
    g = _prompt_grad(G, X, data)
    P = X.t() @ torch.linalg.inv(X @ X.t()) @ X
    Cs = 0.5 * float((g @ P).norm())  # binds for both: |g P| <= |g|
    assert float((g @ P).norm()) < 0.95 * float(g.norm())  # so c_U and c_V differ: swapping them would show
    method, env, data, shared, private = _local_setup(rank=L, epsilon=1e9, norm_thresh=Cs)
    cU, cV = Cs / float((g @ P).norm()), Cs / float(g.norm())
    want = X - LR * ((2 * cU * g @ P + cV * g) / 10 + WD * X)
    res, _ = _local_step(method, env, data, shared, private)
    torch.testing.assert_close(_X(res.private), want, **TOL)
    torch.testing.assert_close(res.upload["global_grad"], g * (Cs / float(g.norm())), **TOL)


def test_reference_local_step_refactorises_at_rank_r_in_every_forward():
    """r = 2 < L: the projections depend on this forward's draw V0. Re-drawing it from the step's
    `refactorize` stream, the hand computation of the code's formula: gU = g V^T, gV = U^T g,
    grad X = (gU V + U gV + U U^T gU V) / 10, and U, V are not the stored ones (those of the last
    factorisation). The stored U, V hold this forward's factorisation and U V + residual = X'."""
    from raysim.methods.fedsept.dpfpl import _round_tag, factorize
    from raysim.sampling import generator

    method, env, data, shared, private = _local_setup(rank=2, epsilon=math.inf)
    G, X = shared["global_ctx"], _X(private)
    res, start = _local_step(method, env, data, shared, private)
    rng = torch.Generator()
    rng.set_state(start)
    U, V, _ = factorize(X, 2, generator(_round_tag(rng), "refactorize", 0))
    assert not torch.allclose(U, private["U"], atol=1e-3)  # a fresh factorisation, not the stored one
    g = _prompt_grad(G, X, data)
    gU, gV = g @ V.t() / 10, U.t() @ g / 10
    grad = gU @ V + U @ gV + U @ U.t() @ gU @ V
    torch.testing.assert_close(_X(res.private), X - LR * (grad + WD * X), **TOL)
    torch.testing.assert_close(res.private["U"], U, **TOL)
    torch.testing.assert_close(res.private["V"], V, **TOL)
