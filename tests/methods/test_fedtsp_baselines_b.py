"""FedTSP's heterogeneous-model baselines with a shared small model or fixed prototypes (fedtsp.txt Table 1,
SPEC 2.9): FML, FedKD, FedMRL and AlignFed. Per method: its distinctive step on a worked example, that only
the declared tensors leave a client (and, under dp.level=client, leave noised), and a two-round run on Ray."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from raysim.config import DPConfig  # noqa: E402
from raysim.errors import ConfigError, UploadViolation  # noqa: E402
from raysim.methods.base import ClientData, EnvSpec, TrainConfig, Upload  # noqa: E402
from raysim.models.clip import ModelSpec  # noqa: E402
from raysim.privacy.host import HostPrivacy  # noqa: E402

C = 3
SPEC = EnvSpec(model=ModelSpec("raysim-tiny", ""), classnames=["zero", "one", "two"], dataset="digits")
NAMES = ("fml", "fedkd", "fedmrl", "alignfed")
# speed only: AlignFed's uniformity anchors take 100000 SGD steps by default (the code's); a few hundred here
SPEED = {"alignfed": {"anchor_iters": 300}}


def _data(cid: int, n: int = 24, seed: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed + cid)
    y = torch.arange(n) % C
    x = torch.randn(n, 3, 32, 32, generator=g) * 0.3 + y[:, None, None, None].float() * 0.5  # learnable
    return ClientData(cid, x, y, x[:6].clone(), y[:6].clone(), C)


def _method(name: str, rounds: int = 4, **opts):
    from raysim.methods import get_method

    cls = get_method(name)
    o = cls.Options(**{"model_family": "tiny", "feature_dim": 16, **({"sub_dim": 8} if name == "fedmrl" else {}), **SPEED.get(name, {}),
                       **opts})
    o.validate()
    return cls(TrainConfig(local_epochs=1, batch_size=8, seed=1, num_clients=2, rounds=rounds), o)


def _round(method, shared, cid: int = 0, dp: DPConfig | None = None, private=None):
    """One client round through the host's privacy layer: (checked upload, LocalResult, env)."""
    env = method.build_env(SPEC, role="client")
    data = _data(cid)
    private = private if private is not None else method.init_private(env, data, torch.Generator().manual_seed(5 + cid))
    host = HostPrivacy(dp=dp or DPConfig(), method=method, seed=1, batch_size=8, releases_per_client=lambda c: 4)
    handle = host.open(cid, 0, data.num_train, shared)
    res = method.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(7), privacy=handle)
    return handle.close(res.upload), res, env, host


def _shared(method):
    env = method.build_env(SPEC, role="server")
    return env, method.init_shared(env, torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------------ AlignFed
def test_alignfed_anchors_are_on_the_sphere_equidistant_and_seeded():
    from raysim.methods.fedtsp.alignfed import simplex_etf

    for c, d in [(3, 16), (10, 512), (5, 5)]:
        a = simplex_etf(c, d, torch.Generator().manual_seed(0))
        assert a.shape == (c, d)
        cos = a @ a.T
        # float32 anchors from a float64 construction: 1e-5 is a few float32 ulps of a unit dot product
        assert torch.allclose(cos.diagonal(), torch.ones(c), atol=1e-5)
        off = cos[~torch.eye(c, dtype=torch.bool)]
        assert torch.allclose(off, torch.full_like(off, -1.0 / (c - 1)), atol=1e-5)  # all pairs equidistant
        assert torch.allclose(a.sum(0), torch.zeros(d), atol=1e-5)  # centred: the simplex's vertices sum to 0
    same = simplex_etf(4, 8, torch.Generator().manual_seed(3))
    assert torch.equal(same, simplex_etf(4, 8, torch.Generator().manual_seed(3)))
    assert not torch.allclose(same, simplex_etf(4, 8, torch.Generator().manual_seed(4)))  # a seeded rotation
    with pytest.raises(ConfigError, match="feature_dim >= 10"):
        simplex_etf(10, 8, torch.Generator())


def test_alignfed_centre_contrastive_loss_worked_example():
    """The code's Contrastive_Loss_Center at tau 1: per centre a softmax over the batch, averaged over the
    centre's own samples, then over all centres (an absent class adds 0 but counts)."""
    from raysim.methods.fedtsp.alignfed import align_loss, center_contrastive_loss

    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    feats = torch.tensor([[2.0, 0.0], [0.0, 3.0], [0.0, 1.0]])  # cosines to (a0, a1): (1, 0), (0, 1), (0, 1)
    y = torch.tensor([0, 1, 0])
    # centre 0 sees s = (1, 0, 0) over the batch: log-normaliser log(e + 2); its samples are rows 0 and 2:
    #   mean(1 - log(e + 2), 0 - log(e + 2)) = 1/2 - log(e + 2)
    # centre 1 sees s = (0, 1, 1): log(1 + 2e); its sample is row 1: 1 - log(1 + 2e)
    want = -((0.5 - math.log(math.e + 2)) + (1 - math.log(1 + 2 * math.e))) / 2
    # the code's eps 1e-6 in the per-centre mean: a relative 1e-6 on each term
    assert center_contrastive_loss(feats, y, anchors, 1.0).item() == pytest.approx(want, abs=1e-5)
    assert align_loss(feats, y, anchors).item() == pytest.approx(want, abs=1e-5)  # the default form, at tau 1
    # a third centre no sample holds: its term is 0 and the mean is over 3 centres
    three = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])  # a2's cosines (-1, 0, 0)
    c0 = (1 - math.log(math.e + 2)) + (0 - math.log(math.e + 2))  # centre 0 unchanged: (1, 0, 0)
    want3 = -(c0 / 2 + (1 - math.log(1 + 2 * math.e))) / 3
    assert center_contrastive_loss(feats, y, three, 1.0).item() == pytest.approx(want3, abs=1e-5)
    # it is not the earlier CE over the classes (rows 1, 2: -log(e / (e + 1)); row 3: -log(1 / (1 + e)))
    ce = (2 * math.log(1 + math.exp(-1)) + math.log(1 + math.e)) / 3
    assert align_loss(feats, y, anchors, "ce", 1.0).item() == pytest.approx(ce, abs=1e-6)
    assert abs(ce - want) > 0.1
    # 1 - cos per row: 0, 0, 1 -> mean 1/3
    assert align_loss(feats, y, anchors, "cos").item() == pytest.approx(1 / 3, abs=1e-6)


def test_alignfed_lambda_schedules_and_head_average():
    m = _method("alignfed", rounds=10)  # the code: lam 20, final 2, exponential over R = 10 rounds
    for t in (0, 1, 5, 9):
        assert m.lam(t) == pytest.approx(20.0 * 0.1 ** (t / 10), rel=1e-9), t  # 20 exp(t ln(2 / 20) / 10)
    assert m.lam(5) == pytest.approx(6.324555, rel=1e-6)  # 20 / sqrt(10)
    lin = _method("alignfed", rounds=10, schedule="linear")
    assert [lin.lam(t) for t in (0, 9)] == [pytest.approx(20.0), pytest.approx(2.0)]
    assert lin.lam(3) == pytest.approx(20.0 - 18.0 * 3 / 9)  # linear in between
    assert _method("alignfed", lam=0.0).lam(3) == 0.0  # no alignment
    with pytest.raises(ConfigError, match="lam_final > 0"):
        _method("alignfed", lam_final=0.0)
    # the anchors stay fixed across rounds; the head is the average of the uploaded heads
    env, shared = _shared(m)
    ups = [Upload(k, {"head_weight": torch.full((C, 16), float(k)), "head_bias": torch.full((C,), float(k))}, n)
           for k, n in ((1, 10), (4, 30))]
    new = m.aggregate(env, shared, ups, torch.Generator())
    assert torch.equal(new["anchors"], shared["anchors"]) and new["round"].item() == 1.0
    assert torch.allclose(new["head_weight"], torch.full((C, 16), (1 * 10 + 4 * 30) / 40))  # sample-weighted


def test_alignfed_uniformity_anchors_spread_to_the_simplex_and_are_seeded():
    """The code's generate_target: SGD on the log-sum-exp of the pairwise dot products; C <= d + 1 points
    end at the regular simplex (pairwise cosine -1 / (C - 1)): antipodal pairs, 120 degrees, a tetrahedron."""
    from raysim.methods.fedtsp.alignfed import uniformity_anchors

    for c, d in ((2, 2), (3, 2), (4, 3), (4, 8)):
        a = uniformity_anchors(c, d, torch.Generator().manual_seed(0), iters=3000)
        assert a.shape == (c, d) and torch.allclose(a.norm(dim=1), torch.ones(c), atol=1e-5)
        cos = a @ a.T
        off = cos[~torch.eye(c, dtype=torch.bool)]
        # 3000 steps at lr 0.1 converge to the simplex to about 1e-3 in cosine (measured); 1e-2 leaves margin
        assert torch.allclose(off, torch.full_like(off, -1.0 / (c - 1)), atol=1e-2), (c, d, off)
    # one step returns the normalised uniform draw itself (the code returns u from before its last update)
    g = torch.Generator().manual_seed(3)
    v = torch.empty(3, 4).uniform_(-1.0, 1.0, generator=g)
    assert torch.allclose(uniformity_anchors(3, 4, torch.Generator().manual_seed(3), iters=1), v / v.norm(dim=1, keepdim=True))
    same = uniformity_anchors(3, 4, torch.Generator().manual_seed(3), iters=50)
    assert torch.equal(same, uniformity_anchors(3, 4, torch.Generator().manual_seed(3), iters=50))
    assert not torch.allclose(same, uniformity_anchors(3, 4, torch.Generator().manual_seed(4), iters=50))
    # the method's default is these anchors; anchors=etf keeps the earlier simplex ETF
    env, shared = _shared(_method("alignfed"))
    assert torch.allclose(shared["anchors"], uniformity_anchors(C, 16, torch.Generator().manual_seed(0), iters=300))
    from raysim.methods.fedtsp.alignfed import simplex_etf

    _, etf = _shared(_method("alignfed", anchors="etf"))
    assert torch.allclose(etf["anchors"], simplex_etf(C, 16, torch.Generator().manual_seed(0)))


def test_alignfed_training_pulls_features_onto_their_anchors():
    m = _method("alignfed")
    _, shared = _shared(m)
    up, res, env, _ = _round(m, shared)
    assert set(up) == {"head_weight", "head_bias"} and up["head_weight"].shape == (C, 16)
    assert res.metrics["lam"] == pytest.approx(20.0)
    private = res.private
    data = _data(0)
    for _ in range(1):
        _, res, _, _ = _round(m, shared, private=private)
        private = res.private
    model = m.model(env, private).eval()
    from raysim.methods.fedtsp.alignfed import align_loss

    with torch.no_grad():
        after = align_loss(model.features(data.x_train), data.y_train, shared["anchors"]).item()
        before = align_loss(m.model(env, m.init_private(env, data, torch.Generator().manual_seed(5))).eval().features(data.x_train),
                            data.y_train, shared["anchors"]).item()
    assert after < before - 0.1, (before, after)


# ------------------------------------------------------------------------------------ FML
def test_fml_mutual_kl_on_a_hand_example():
    from raysim.methods.fedtsp.fml import mutual_losses

    z_local = torch.tensor([[0.0, 0.0]], requires_grad=True)  # p = (1/2, 1/2)
    z_meme = torch.tensor([[math.log(3.0), 0.0]], requires_grad=True)  # q = (3/4, 1/4)
    y = torch.tensor([0])
    out = mutual_losses(z_local, z_meme, y, 0.5, 0.5)
    kl_q_p = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL(q || p) = 0.130812
    kl_p_q = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL(p || q) = 0.143841
    tol = 1e-6  # float32 logs of small numbers
    assert out["kl"].item() == pytest.approx(kl_q_p, abs=tol) and out["kl_meme"].item() == pytest.approx(kl_p_q, abs=tol)
    assert out["local"].item() == pytest.approx(0.5 * math.log(2) + 0.5 * kl_q_p, abs=tol)
    assert out["meme"].item() == pytest.approx(0.5 * -math.log(0.75) + 0.5 * kl_p_q, abs=tol)
    # each model learns only from its own objective: the other's distribution is a fixed target
    (g_meme,) = torch.autograd.grad(out["local"], z_meme, allow_unused=True)
    assert g_meme is None
    # HtFLlib's nn.KLDivLoss() averages over the C = 2 classes too, and lets the gradient through
    q = mutual_losses(z_local, z_meme, y, 0.5, 0.5, htfllib=True)
    assert q["kl"].item() == pytest.approx(kl_q_p / 2, abs=tol)
    assert torch.autograd.grad(q["local"], z_meme)[0].abs().sum() > 0


def test_fml_uploads_only_the_meme_model_and_averages_it():
    from raysim.methods.families.homogeneous import flatten_state

    m = _method("fml")
    env, shared = _shared(m)
    up, res, _, _ = _round(m, shared, cid=1)  # client 1 of the tiny family owns a resnet4
    assert set(up) == {"weights"} and up["weights"].shape == shared["weights"].shape
    assert not torch.equal(up["weights"], shared["weights"])  # it trained
    assert res.private["arch"] == "resnet4" and flatten_state(res.private["model"]).numel() != up["weights"].numel()
    a = Upload(0, {"weights": torch.zeros_like(up["weights"])}, 10)
    b = Upload(1, {"weights": torch.ones_like(up["weights"])}, 30)
    assert torch.allclose(m.aggregate(env, shared, [a, b], torch.Generator())["weights"], torch.full_like(up["weights"], 0.5))
    m2 = _method("fml", weighting="samples")
    assert torch.allclose(m2.aggregate(env, shared, [a, b], torch.Generator())["weights"], torch.full_like(up["weights"], 0.75))


# ------------------------------------------------------------------------------------ FedKD
def _matrix(singular: list[float], m: int = 8, n: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    s = torch.zeros(m, n, dtype=torch.float64)
    for i, x in enumerate(singular):
        s[i, i] = x
    return u @ s @ v.T


def test_fedkd_svd_keeps_at_least_T_of_the_energy_and_reconstructs():
    from raysim.methods.fedtsp.fedkd import compress_update, svd_compress, svd_rank

    s = torch.tensor([3.0, 2.0, 1.0, 0.0])  # energies 9, 4, 1 of 14: cumulative 0.643, 0.929, 1
    assert [svd_rank(s, t) for t in (0.5, 0.643, 0.9, 0.95, 1.0)] == [1, 2, 2, 3, 3]
    assert svd_rank(torch.zeros(3), 0.95) == 0
    mat = _matrix([3.0, 2.0, 1.0])
    total = float((mat**2).sum())
    for t, r in ((0.9, 2), (0.6, 1)):
        approx, cost = svd_compress(mat, t)
        kept = float((approx**2).sum()) / total
        err = float(((mat - approx) ** 2).sum()) / total
        assert kept >= t and err <= 1 - t + 1e-9 and cost == r * (8 + 6 + 1)
        assert err == pytest.approx({2: 1 / 14, 1: 5 / 14}[r], abs=1e-9)  # exactly the dropped singular values
    approx, _ = svd_compress(mat, 0.95)  # 95 % needs all three: the rank-3 matrix comes back exactly
    assert torch.allclose(approx, mat, atol=1e-10)
    # a flat update over a state_dict: the matrix is truncated, the vector goes as it is
    vec = torch.arange(4.0, dtype=torch.float64)
    flat = torch.cat([mat.reshape(-1), vec])
    out, sent = compress_update(flat, [torch.Size([8, 6]), torch.Size([4])], 0.9)
    assert torch.equal(out[48:], vec) and sent == 2 * 15 + 4
    assert torch.allclose(out[:48].view(8, 6), svd_compress(mat, 0.9)[0])
    same, sent = compress_update(flat, [torch.Size([8, 6]), torch.Size([4])], 1.0)
    assert torch.equal(same, flat) and sent == 52  # T = 1: nothing is compressed


def test_fedkd_default_uploads_the_full_trained_mentee_and_averages_it_uncompressed():
    """The code behind the tables: the client saves its mentee's full parameters, the server their 1/K mean,
    SVD commented out; the mentee trains at the client lr."""
    m = _method("fedkd", rounds=10)
    assert m.opts.compression == "none" and m.opts.mentee_lr == 0.0
    env, shared = _shared(m)
    up, res, cenv, _ = _round(m, shared)
    assert set(up) == {"weights"} and up["weights"].shape == shared["weights"].shape
    assert res.metrics["upload_ratio"] == 1.0
    # the same round under compression=svd at T = 1 sends broadcast + (trained - broadcast): the trained
    # weights up to float32 rounding of the subtraction and re-addition (1e-6 of the weights' scale)
    raw, _, _, _ = _round(_method("fedkd", rounds=10, T_start=1.0, T_end=1.0, compression="svd"), shared)
    scale = float(up["weights"].abs().max())
    assert torch.allclose(up["weights"], raw["weights"], atol=1e-6 * scale)
    # and not its 95 % truncation: the truncation drops up to 5 % of each matrix's energy (measured here:
    # 16 % of the update's norm); float32 rounding alone would be ~1e-6 of it
    svd95, _, _, _ = _round(_method("fedkd", rounds=10, compression="svd"), shared)
    full_delta, svd_delta = up["weights"] - shared["weights"], svd95["weights"] - shared["weights"]
    assert float((full_delta - svd_delta).norm()) > 0.01 * float(full_delta.norm())
    # the mentee at the client lr: the default equals an explicit mentee_lr = lr and differs from another lr
    lr = m.client_lr
    same, _, _, _ = _round(_method("fedkd", rounds=10, mentee_lr=lr), shared)
    other, _, _, _ = _round(_method("fedkd", rounds=10, mentee_lr=10 * lr), shared)
    assert torch.equal(same["weights"], up["weights"]) and not torch.allclose(other["weights"], up["weights"])
    # the server: the plain 1/K mean of the uploads (weights 1 and 4, samples 10 and 30 -> 2.5), not compressed
    n = shared["weights"].numel()
    ups = [Upload(0, {"weights": torch.full((n,), 1.0)}, 10), Upload(1, {"weights": torch.full((n,), 4.0) + torch.randn(n)}, 30)]
    new = m.aggregate(env, shared, ups, torch.Generator())
    assert torch.allclose(new["weights"], (ups[0].tensors["weights"] + ups[1].tensors["weights"]) / 2, atol=1e-6)
    assert new["round"].item() == 1.0
    with pytest.raises(ConfigError, match="fedkd.compression"):
        _method("fedkd", compression="zip")


def test_fedkd_svd_option_energy_schedule_and_upload_is_a_compressed_update():
    """compression=svd (the paper; the project's earlier default)."""
    m = _method("fedkd", rounds=10, compression="svd")
    assert {m.energy(t) for t in range(10)} == {0.95}  # T_start = T_end: the same threshold every round
    ramp = _method("fedkd", rounds=10, T_start=0.5, T_end=1.0, compression="svd")
    assert ramp.energy(0) == 0.5 and ramp.energy(5) == pytest.approx(0.75)
    env, shared = _shared(m)
    up, res, cenv, _ = _round(m, shared)
    assert set(up) == {"weights"} and set(res.private) >= {"model", "W_h"}
    assert 0 < res.metrics["upload_ratio"] < 1  # the factors are smaller than the dense update
    assert all(math.isfinite(res.metrics[k]) for k in m.client_metrics)
    # the same round at T = 1 gives the raw trained update: the upload is its per-matrix truncation at 95 %
    from raysim.methods.fedtsp.fedkd import svd_compress

    raw, full, _, _ = _round(_method("fedkd", rounds=10, T_start=1.0, T_end=1.0, compression="svd"), shared)
    assert full.metrics["upload_ratio"] == 1.0
    delta, raw_delta, i, truncated = up["weights"] - shared["weights"], raw["weights"] - shared["weights"], 0, 0
    for shape in m._shapes(cenv):
        n = shape.numel()
        got, want = delta[i : i + n], raw_delta[i : i + n]
        if len(shape) >= 2 and svd_compress(want.view(shape[0], -1), 0.95)[1] < n:
            want = svd_compress(want.view(shape[0], -1), 0.95)[0].reshape(-1)
            truncated += 1
        # float32 weights minus float32 broadcast: 1e-5 relative to the update's scale
        assert torch.allclose(got, want, atol=1e-5 * max(1.0, float(want.abs().max()))), shape
        i += n
    assert truncated >= 1
    new = m.aggregate(env, shared, [Upload(0, up, 24)], torch.Generator())
    assert new["round"].item() == 1.0 and new["weights"].shape == shared["weights"].shape


def test_fedkd_adaptive_weights_are_the_inverse_ce_sum():
    from raysim.methods.fedtsp.fedkd import adaptive_losses
    from raysim.methods.fedtsp.fml import kl_to

    torch.manual_seed(0)
    z_t, z_s, f_t, f_s = torch.randn(4, C), torch.randn(4, C), torch.randn(4, 5), torch.randn(4, 5)
    y = torch.tensor([0, 1, 2, 0])
    w_h = nn.Linear(5, 5, bias=False)
    out = adaptive_losses(z_t, z_s, f_t, f_s, y, w_h)
    ce = torch.nn.functional.cross_entropy
    w = 1.0 / (ce(z_t, y) + ce(z_s, y))
    assert out["kd"].item() == pytest.approx((kl_to(z_t, z_s) * w).item(), rel=1e-5)
    assert out["hidden"].item() == pytest.approx((torch.nn.functional.mse_loss(f_t, w_h(f_s)) * w).item(), rel=1e-5)
    assert out["mentor"].item() == pytest.approx((out["ce"] + out["kd"] + out["hidden"]).item(), rel=1e-6)


# ------------------------------------------------------------------------------------ FedMRL
def test_fedmrl_fusion_shapes_and_nested_head():
    from raysim.methods.fedtsp.fedmrl import fuse

    m = _method("fedmrl")  # d = 16, d1 = 8
    env = m.build_env(SPEC, role="client")
    data = _data(0)
    private = m.init_private(env, data, torch.Generator().manual_seed(1))
    f, g, proj = m.model(env, private), m.new_shared(env, 2), m.projector(env, private)
    assert proj.in_features == 8 + 16 and proj.out_features == 16
    assert g.feature_dim == 8 and g.head.in_features == 8 and f.head.in_features == 16
    x = data.x_train[:5]
    r, z_homo, z_hetero = fuse(g, f, proj, x, 8)
    assert r.shape == (5, 16) and z_homo.shape == (5, C) and z_hetero.shape == (5, C)
    assert torch.allclose(z_homo, g.head(r[:, :8])) and torch.allclose(z_hetero, f.head(r))
    with pytest.raises(ConfigError, match="sub_dim"):
        _method("fedmrl", sub_dim=32)


def test_fedmrl_only_the_shared_model_leaves_and_the_projector_stays():
    m = _method("fedmrl")
    env, shared = _shared(m)
    up, res, cenv, _ = _round(m, shared)
    assert set(up) == {"weights"} and up["weights"].shape == shared["weights"].shape
    assert not torch.equal(res.private["proj"]["weight"], res.private["proj_init"]["weight"])  # trained, kept
    predict = m.predictor(cenv, shared, res.private)
    assert predict(_data(0).x_test).shape == (6, C)
    quirk = _method("fedmrl", persist_projector=False)
    p = quirk.projector(cenv, res.private)
    assert torch.equal(p.weight.cpu(), res.private["proj_init"]["weight"])  # HtFLlib: back to the initial projector


# ------------------------------------------------------------------------------------ all four: the uploads
@pytest.mark.parametrize("name", NAMES)
def test_only_declared_tensors_leave_and_client_level_dp_noises_them(name):
    m = _method(name)
    _, shared = _shared(m)
    up, res, _, _ = _round(m, shared)
    assert set(up) == set(m.releases) and all(up[k].shape == shared[k].shape for k in up)  # updates of broadcast tensors
    # anything else is refused by the host (fail closed)
    host = HostPrivacy(dp=DPConfig(), method=m, seed=1, batch_size=8, releases_per_client=lambda c: 4)
    with pytest.raises(UploadViolation, match="does not declare"):
        host.open(0, 0, 24, shared).close({**up, "model": torch.zeros(3)})
    # under dp.level=client the host clips and noises the update; sample-level DP is refused at config time
    noised, raw, _, host = _round(m, shared, dp=DPConfig(epsilon=4.0, level="client"))
    assert set(noised) == set(up)
    assert any(not torch.allclose(noised[k], raw.upload[k]) for k in noised)
    assert 0 < host.epsilon(0) <= 4.0 * (1 + 1e-6)
    from raysim.build import build_config
    with pytest.raises(ConfigError, match="dp.level=client"):
        build_config({"method": name, "dp": {"epsilon": 4.0, "level": "sample"}, name: {"model_family": "tiny"}})


# ------------------------------------------------------------------------------------ end to end on Ray
@pytest.mark.parametrize("name", NAMES)
def test_end_to_end_on_ray(tmp_path, name, ray_session):
    """Two rounds, three clients (tiny family: cnn_tiny and resnet4 clients) on digits, on the Ray backend:
    every evaluated client row is there, the loss is finite, and every recorded upload is exactly the
    declared tensors at the broadcast shapes."""
    import csv

    from zoo_runs import ray_zoo_run

    from raysim.storage.store import StateStore

    res, rows = ray_zoo_run(tmp_path, name, {"model_family": "tiny", **SPEED.get(name, {})}, out="run", num_actors=2)
    assert len(rows) == 2 * 3 and {r["round"] for r in rows} == {"0", "1"}
    results = list(csv.DictReader(open(res.out_dir / "results.csv")))
    assert all(math.isfinite(float(r["train_loss"])) for r in results)
    assert res.summary["in_client"] > 0.0
    store = StateStore(res.out_dir)
    server = store.load_server(1)
    declared = set(get_releases(name))
    for r in (0, 1):
        seen = store.load_uploads(r)["uploads"]
        assert set(seen) == {0, 1, 2}
        for c, tensors in seen.items():
            assert set(tensors) == declared, (r, c)
            assert all(tensors[k].shape == server[k].shape for k in tensors)


def get_releases(name: str):
    from raysim.methods import get_method

    return get_method(name).releases
