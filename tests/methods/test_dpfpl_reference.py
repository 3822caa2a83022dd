"""DP-FPL's reference mode (`dpfpl.dp_mode=reference`) as the DP-FPL code does it (linhhtran/DP-FPL,
federated_main.py + trainers/DP_FPL.py): lock-step rounds, the client's clipped global-prompt gradient
uploaded without noise, the server's noise of std sigma C / (B K) on the K-client mean at every step, the
local U and V gradients clipped and noised, and the ledger saying it is not a local-DP guarantee."""

from __future__ import annotations

import math

import pandas as pd
import torch
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
    from raysim.config.checks import make_method
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
