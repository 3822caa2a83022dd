"""FedSEPT's baselines FedPGP, FedOTP and FedPHA (SPEC 1.11): each loss on a worked example, FedOTP's
Sinkhorn against a hand-solved case and its pooled mode against the mean of the two prompts' logits,
only the declared tensors leave a client, and runs agree inline and on Ray, with and without DP."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import tiny_config  # noqa: E402

from raysim.methods import ClientData, TrainConfig, get_method  # noqa: E402
from raysim.methods.fedsept.fedotp import ot_logits, sinkhorn  # noqa: E402
from raysim.methods.fedsept.fedpgp import prompt_contrast  # noqa: E402
from raysim.methods.fedsept.fedpha import projection_basis, pull_push  # noqa: E402
from raysim.models.clip import ModelSpec, TokenHead, build_clip_env, encode_images, load_clip  # noqa: E402
from raysim.privacy.dpsgd import DPSGD, NoDP  # noqa: E402

CLASSES = ["zero", "one", "two", "three", "four"]
TOL = dict(atol=1e-5, rtol=1e-5)  # float32 arithmetic on O(1) numbers, a few dozen operations deep


class Recorder(NoDP):
    """NoDP that keeps what the method hands to `backward` (the per-example loss and the public term)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def backward(self, per_sample_loss, dp_params, other_params=(), public_loss=None):
        self.calls.append((per_sample_loss.detach().clone(), None if public_loss is None else public_loss.detach().clone(),
                           sorted(dp_params), len(other_params)))
        super().backward(per_sample_loss, dp_params, other_params, public_loss)


@pytest.fixture(scope="module")
def env():
    return build_clip_env(ModelSpec("raysim-tiny"), CLASSES, 4)


@pytest.fixture(scope="module")
def tiny():
    return load_clip(ModelSpec("raysim-tiny"))


def data(n=8, tokens=None, cid=0):
    g = torch.Generator().manual_seed(cid)
    x = F.normalize(torch.randn(n, 128, generator=g), dim=-1)
    y = torch.arange(n) % len(CLASSES)
    return ClientData(cid, x, y, x[:4], y[:4], len(CLASSES), tokens_train=tokens, tokens_test=None if tokens is None else tokens[:4])


def method(name, n_ctx=4, **opts):
    cls = get_method(name)
    # batch 8 = n: one full batch per epoch, so the recorded step sees the starting parameters
    return cls(TrainConfig(n_ctx=n_ctx, batch_size=8, lr=0.05, num_clients=10, seed=1), cls.Options(**opts))


def start(m, env, d):
    return m.init_shared(env, torch.Generator().manual_seed(0)), m.init_private(env, d, torch.Generator().manual_seed(1))


# -- FedPGP ----------------------------------------------------------------------------------

def test_fedpgp_contrast_worked_example():
    t0 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    tg = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    tf = torch.tensor([[0.0, 1.0], [0.8, 0.6]])
    # class 0: pos = 1, neg = 0 -> CE([2, 0], 0) = log(1 + e^-2); class 1: pos = 0.8, neg = 0.96
    # -> CE([1.6, 1.92], 0) = log(1 + e^0.32)
    want = (math.log(1 + math.exp(-2.0)) + math.log(1 + math.exp(0.32))) / 2
    assert prompt_contrast(t0, tg, tf, 0.5).item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("outside", [False, True])
def test_fedpgp_per_example_loss_is_ce_plus_weighted_contrast(env, outside):
    m = method("fedpgp", contrast_outside_dp=outside)
    d = data()
    shared, private = start(m, env, d)
    rec = Recorder()
    out = m.local_train(env, shared, private, d, rng=torch.Generator().manual_seed(2), privacy=rec)
    loss, public, dp_names, n_other = rec.calls[0]
    assert dp_names == ["global_ctx"] and n_other == 2  # DP on G; U and V as other_params
    with torch.no_grad():  # recomputed from the definitions at the starting point
        G, U, V = shared["global_ctx"], private["U"], private["V"]
        t_full = env.prompts.text_features(G + U @ V)
        t_g = env.prompts.text_features(G)
        t0 = env.prompts.text_features(env.prompts.placeholder, per_class=True)  # "X X X X <class>."
        ce = F.cross_entropy(env.logit_scale * d.x_train @ t_full.t(), d.y_train, reduction="none")
        con = prompt_contrast(t0, t_g, t_full, 0.5)
    # the batch order is a permutation of the 8 examples: compare sorted per-example values
    got_ce = loss if outside else loss - 100 * con
    torch.testing.assert_close(got_ce.sort().values, ce.sort().values, **TOL)
    if outside:
        torch.testing.assert_close(public, 100 * con, **TOL)
    else:
        assert public is None
    assert out.metrics["contrast"] == pytest.approx(con.item(), rel=1e-5)
    assert out.metrics["loss"] == pytest.approx(out.metrics["ce"] + 100 * out.metrics["contrast"], rel=1e-5)
    assert set(out.upload) == {"global_ctx"} and set(out.private) == {"U", "V"}


def test_fedpgp_contrast_dominates_every_per_example_gradient(env):
    """The docstring's claim, at the starting point: inside the per-example loss, 100 * grad L_con (norm ~1e3
    here) swamps grad CE_i (~20), so every example's gradient, and hence its clipped version, points along
    the same data-independent direction."""
    from raysim.privacy.dpsgd import per_sample_grads

    m = method("fedpgp")
    d = data()
    shared, private = start(m, env, d)
    G = shared["global_ctx"].clone().requires_grad_(True)
    UV = private["U"] @ private["V"]
    t_full, t_g = env.prompts.text_features(torch.stack([G + UV, G])).unbind(0)
    contrast = 100 * prompt_contrast(env.prompts.plain_text_features(), t_g, t_full, 0.5)
    ce = F.cross_entropy(env.logit_scale * d.x_train @ t_full.t(), d.y_train, reduction="none")
    g_con = torch.autograd.grad(contrast, G, retain_graph=True)[0].reshape(1, -1)
    per_example = per_sample_grads(ce + contrast, [G])[0].reshape(len(ce), -1)
    assert (F.cosine_similarity(per_example, g_con) > 0.99).all()  # measured 0.9999 for each of the 8


def test_public_loss_reaches_the_local_tensors_under_dp_as_without():
    """privacy/dpsgd.py: a data-independent term passed as public_loss gives other_params its gradient under
    DP-SGD as it does without DP (FedPGP's contrast reads U and V; FedSEPT's L_div reads A only)."""
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    u = torch.tensor([0.5], requires_grad=True)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    per = (x @ w) * u  # three examples
    public = (u * w.sum()) ** 2  # data-independent
    DPSGD(sigma=0.0, clip=100.0, sample_rate=1.0, generator=torch.Generator()).backward(per, {"w": w}, [u], public_loss=public)
    g_dp = u.grad.clone()
    w.grad = u.grad = None
    per = (x @ w) * u
    NoDP().backward(per, {"w": w}, [u], public_loss=(u * w.sum()) ** 2)
    # d/du [mean((x w) u) + (u sum w)^2] = mean(x w) + 2 u (sum w)^2 = -2/3 + 2 * 0.5 * 1 = 1/3
    # (without the public term's gradient it would be -2/3)
    assert g_dp.item() == pytest.approx(u.grad.item(), abs=1e-6) and g_dp.item() == pytest.approx(1 / 3, abs=1e-6)


# -- FedOTP ----------------------------------------------------------------------------------

def test_sinkhorn_solves_a_2x2_case_by_hand():
    # uniform marginals: T = [[t, 1/2 - t], [1/2 - t, t]] and T11 T22 / (T12 T21) = K11 K22 / (K12 K21) = 9
    # -> t / (1/2 - t) = 3 -> t = 3/8
    K = torch.tensor([[0.9, 0.2], [0.3, 0.6]], dtype=torch.float64)
    half = torch.full((2,), 0.5, dtype=torch.float64)
    T = sinkhorn(K, half, half, max_iter=1000, thresh=1e-12)
    torch.testing.assert_close(T, torch.tensor([[0.375, 0.125], [0.125, 0.375]], dtype=torch.float64), atol=1e-9, rtol=0)


def test_sinkhorn_marginals_within_tolerance():
    g = torch.Generator().manual_seed(0)
    cost = 1 - F.normalize(torch.randn(6, 17, 8, generator=g), dim=-1) @ F.normalize(torch.randn(6, 8, 2, generator=g), dim=1)
    K = torch.exp(-cost / 0.1)  # (6, 17, 2): six problems of 17 points to 2
    a, b = torch.full((6, 17), 1 / 17), torch.full((6, 2), 0.5)
    T = sinkhorn(K, a, b)  # the defaults: 100 iterations, thresh 1e-3
    torch.testing.assert_close(T.sum(-2), b, atol=1e-6, rtol=0)  # the last update matches the columns
    torch.testing.assert_close(T.sum(-1), a, atol=2e-3 / 17, rtol=0)  # rows: within the stopping rule's slack
    tight = sinkhorn(K.double(), a.double(), b.double(), max_iter=5000, thresh=1e-14)
    torch.testing.assert_close(tight.sum(-1), a.double(), atol=1e-8, rtol=0)  # converged: rows too
    assert float(T.sum(dim=(-1, -2)).sub(1).abs().max()) < 1e-5


def test_ot_logit_worked_example_and_pooled_mode_is_the_mean_of_the_two_prompts():
    # two local features f1 = (1, 0), f2 = (0.6, 0.8) and two prompts t1 = (1, 0), t2 = (0, 1) for one class:
    # S = [[1, 0], [0.6, 0.8]]; with uniform marginals the plan is [[t, 1/2 - t], [1/2 - t, t]] where
    # t / (1/2 - t) = sqrt(exp((S11 + S22 - S12 - S21) / eps)) = e^1.2 at eps = 0.5 (a plan this far from
    # uniform converges in a few dozen iterations; at eps = 0.1 it would take thousands)
    local = torch.tensor([[[1.0, 0.0], [0.6, 0.8]]], dtype=torch.float64)
    text = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)  # (N=2, C=1, D=2)
    r = math.exp(1.2)
    t = r / (2 * (1 + r))
    want = 100 * (t * 1.0 + (0.5 - t) * 0.0 + (0.5 - t) * 0.6 + t * 0.8)
    got = ot_logits(100.0, local, text, eps=0.5, thresh=1e-13, max_iter=1000)
    assert got.shape == (1, 1) and got.item() == pytest.approx(want, rel=1e-9)
    # pooled: one local point, the plan is 1/N whatever the costs: the mean of the prompts' logits
    g = torch.Generator().manual_seed(0)
    feats = F.normalize(torch.randn(7, 16, generator=g), dim=-1)
    text = F.normalize(torch.randn(2, 5, 16, generator=g), dim=-1)
    got = ot_logits(100.0, feats.unsqueeze(1), text, eps=0.1, thresh=1e-3, max_iter=100)
    mean = 100 * (feats @ text[0].t() + feats @ text[1].t()) / 2
    torch.testing.assert_close(got, mean, atol=1e-4, rtol=1e-6)  # float32 logits of size ~10: 1e-4 is a few ulps


def test_token_head_maps_patches_like_the_pooled_feature(tiny):
    images = torch.utils.data.TensorDataset(torch.randn(3, 3, 32, 32))
    feats, tokens = encode_images(tiny, images, tokens=True)
    head = TokenHead(tiny.visual)
    patches = head(tokens)
    assert patches.shape == (3, tokens.shape[1] - 1, feats.shape[1])  # CLS dropped: the 16 patch tokens
    # the same map on the CLS token gives the pooled feature (tokens are float16: 5e-3)
    v = tiny.visual
    torch.testing.assert_close(F.normalize(v.ln_post(tokens[:, 0].float()) @ v.proj, dim=-1), feats, atol=5e-3, rtol=0)
    cnn = load_clip(ModelSpec("raysim-clip"))  # timm CNN, average pooling, linear head (random weights)
    feats, tokens = encode_images(cnn, torch.utils.data.TensorDataset(torch.randn(2, 3, 64, 64)), tokens=True)
    mapped = TokenHead(cnn.visual)(tokens)
    assert mapped.shape[1] == tokens.shape[1] > 1
    # linear head: the mean of the mapped locations is the pooled feature (float16 tokens: 5e-3)
    torch.testing.assert_close(F.normalize(mapped.mean(1), dim=-1), feats, atol=5e-3, rtol=0)


@pytest.mark.parametrize("tokens", ["patch", "pooled"])
def test_fedotp_trains_both_prompts_and_uploads_prompt_0(tiny, tokens):
    m = method("fedotp", tokens=tokens)
    assert m.needs().tokens == (tokens == "patch")
    env = m.build_env(type("S", (), {"model": ModelSpec("raysim-tiny"), "classnames": CLASSES, "device": "cpu"})(), role="client")
    imgs = torch.utils.data.TensorDataset(torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    feats, toks = encode_images(tiny, imgs, tokens=True)
    d = data(tokens=toks if tokens == "patch" else None)
    d.x_train, d.x_test = feats, feats[:4]
    shared, private = start(m, env, d)
    rec = Recorder()
    out = m.local_train(env, shared, private, d, rng=torch.Generator().manual_seed(2), privacy=rec)
    assert rec.calls[0][2] == ["ctx"] and rec.calls[0][3] == 1
    assert set(out.upload) == {"ctx"} and set(out.private) == {"ctx_local"}
    assert not torch.equal(out.upload["ctx"], shared["ctx"]) and not torch.equal(out.private["ctx_local"], private["ctx_local"])
    predict = m.predictor(env, shared, out.private)
    logits = predict(d.x_test, d.tokens_test) if tokens == "patch" else predict(d.x_test)
    assert logits.shape == (4, len(CLASSES))
    # the evaluated model is built from both prompts (in either token mode): moving either moves the logits
    g = torch.Generator().manual_seed(4)
    ctx, local = shared["ctx"], out.private["ctx_local"]
    for moved_shared, moved_private in (({"ctx": ctx + 0.5 * torch.randn(ctx.shape, generator=g)}, out.private),
                                        ({}, {"ctx_local": local + 0.5 * torch.randn(local.shape, generator=g)})):
        p2 = m.predictor(env, {**shared, **moved_shared}, moved_private)
        other = p2(d.x_test, d.tokens_test) if tokens == "patch" else p2(d.x_test)
        assert (other - logits).abs().max() > 1e-4 * logits.abs().max()  # float32 logits; a read prompt moves them far more
    if tokens == "pooled":  # the official degenerate transport: the mean of the two prompts' logits
        text = env.prompts.text_features(torch.stack([shared["ctx"], out.private["ctx_local"]]))
        s = env.logit_scale
        torch.testing.assert_close(logits, s * (d.x_test @ text[0].t() + d.x_test @ text[1].t()) / 2, atol=1e-4, rtol=1e-6)


# -- FedPHA ----------------------------------------------------------------------------------

def test_fedpha_projection_and_terms_worked_example():
    G = torch.tensor([[3.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 1.0, 0]])  # singular values 3, 2, 1 along e1, e2, e3
    V2 = projection_basis(G, ratio=0.5)  # cutoff floor(3 * 0.5) = 1: keep e2, e3
    proj = torch.tensor([[1.0, 1, 1, 1]]) @ V2 @ V2.t()
    torch.testing.assert_close(proj, torch.tensor([[0.0, 1, 1, 0]]), atol=1e-6, rtol=0)
    assert projection_basis(torch.randn(16, 512), ratio=0.8).shape == (512, 13)  # SPEC 1.11: floor(16 * 0.2) = 3 dropped
    assert projection_basis(torch.randn(4, 32), ratio=0.8).shape == (32, 4)  # floor(0.8) = 0: nothing dropped
    t_local = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    t_proj = torch.tensor([[0.6, 0.8], [0.0, 1.0]])
    t_global = torch.tensor([[0.8, 0.6], [1.0, 0.0]])
    pull, push = pull_push(t_local, t_proj, t_global, alpha=1.0)
    assert pull.item() == pytest.approx((0.4**2 + 0.8**2) / 4, rel=1e-6)  # mean over the 4 entries
    # ||t_local - t_global|| = sqrt(0.04 + 0.36) and sqrt(2): relu(1 - 0.6325) and 0
    assert push.item() == pytest.approx((1 - math.sqrt(0.4)) / 2, rel=1e-6)


def test_fedpha_per_example_loss_is_the_four_terms(env):
    m = method("fedpha")
    d = data(cid=3)
    shared, private = start(m, env, d)
    assert private["ctx_local"].shape == (m.local_length(3), env.ctx_width)
    rec = Recorder()
    out = m.local_train(env, shared, private, d, rng=torch.Generator().manual_seed(2), privacy=rec)
    loss, public, dp_names, n_other = rec.calls[0]
    assert dp_names == ["ctx_global"] and n_other == 1 and public is None
    with torch.no_grad():
        G, P = shared["ctx_global"], private["ctx_local"]
        Ul, S, Vh = torch.linalg.svd(G, full_matrices=False)
        V2 = Vh[int(4 * 0.2):].t()
        t_l = m.prompts(env, P.shape[0]).text_features(P)
        t_g = env.prompts.text_features(G)
        t_p = m.prompts(env, P.shape[0]).text_features(P @ V2 @ V2.t())
        s = env.logit_scale
        ce = F.cross_entropy(s * d.x_train @ t_l.t(), d.y_train, reduction="none") + F.cross_entropy(s * d.x_train @ t_g.t(), d.y_train,
                                                                                                     reduction="none")
        reg = F.mse_loss(t_l, t_p) + F.relu(1 - (t_l - t_g).norm(dim=-1)).mean()
    torch.testing.assert_close(loss.sort().values, (ce + reg).sort().values, **TOL)
    assert set(out.metrics) == {"loss", "ce_local", "ce_global", "pull", "push"}
    assert out.metrics["pull"] == pytest.approx(F.mse_loss(t_l, t_p).item(), rel=1e-4)
    assert set(out.upload) == {"ctx_global"} and set(out.private) == {"ctx_local"}


def test_fedpha_local_lengths_are_seeded_per_client_and_the_eot_quirk(env):
    m = method("fedpha")
    lengths = [m.local_length(k) for k in range(10)]
    assert all(4 <= n <= 16 for n in lengths) and len(set(lengths)) > 1
    assert lengths == [method("fedpha").local_length(k) for k in range(10)]  # a function of (seed, client) only
    q = method("fedpha", eot_quirk=True)
    Lmax = q.quirk_length()
    assert Lmax == max([4] + lengths)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(Lmax, env.ctx_width, generator=g) * 0.02
    torch.testing.assert_close(q.text(env, full), m.text(env, full), atol=1e-6, rtol=0)  # Lmax tokens: no quirk
    short = full[:4]
    assert not torch.allclose(q.text(env, short), m.text(env, short), atol=1e-4)
    # the official pooling position: Lmax - l past the real end-of-text token
    assert torch.equal(q.prompts(env, Lmax).meta - m.prompts(env, 4).meta, torch.full((len(CLASSES),), Lmax - 4))


# -- what leaves the client, and the engine end to end ----------------------------------------

@pytest.mark.parametrize("name", ["fedpgp", "fedotp", "fedpha"])
def test_only_the_shared_prompt_crosses(tmp_path, cache_dir, name):
    """bytes_up is exactly one L x w float32 tensor per participant: nothing else leaves the clients."""
    from raysim.engine.loop import run

    res = run(tiny_config(tmp_path, cache_dir, method=name, train={"n_ctx": 4, "rounds": 1, "num_clients": 3}))
    rows = pd.read_csv(res.out_dir / "results.csv")
    ctx_width = build_clip_env(ModelSpec("raysim-tiny"), CLASSES, 4).ctx_width
    assert (rows["bytes_up"] == 3 * 4 * ctx_width * 4).all()  # 3 clients x (L=4 x w) x 4 bytes


@pytest.mark.parametrize("epsilon", [None, 1.0])
@pytest.mark.parametrize("name", ["fedotp", "fedpgp", "fedpha"])
def test_same_results_inline_and_on_ray(tmp_path, cache_dir, ray_session, name, epsilon):
    """Each baseline through both backends, with and without DP (FedOTP with patch tokens: the token cache,
    the per-token head, two prompts); FedPGP and FedPHA for one round (their private parts and DP-SGD)."""
    from raysim.engine.loop import run

    opts = dict(method=name, train={"n_ctx": 4, "rounds": 2 if name == "fedotp" else 1})
    if epsilon is not None:
        opts["dp"] = {"epsilon": epsilon}
    a = run(tiny_config(tmp_path / "inline", cache_dir, **opts))
    b = run(tiny_config(tmp_path / "ray", cache_dir, execution={"backend": "ray", "num_actors": 2}, **opts))
    method_cols = [f"train_{k}" for k in get_method(name).client_metrics if k != "loss"]
    cols = ["round", "in_client", "cross_client", "hm", "train_loss", "bytes_up", "bytes_down"] + method_cols
    ra, rb = (pd.read_csv(r.out_dir / "results.csv")[cols] for r in (a, b))
    pd.testing.assert_frame_equal(ra, rb)
    assert ra["train_loss"].notna().all() and (ra["bytes_up"] > 0).all()
    if epsilon is None and name == "fedotp":
        assert ra["in_client"].iloc[-1] > 0.2  # it learns its clients' classes (0.33 measured at round 1; 10 digits)


def test_fedotp_patch_on_a_one_token_tower_is_refused_with_the_pooled_way_out(tmp_path, cache_dir):
    from raysim.engine.loop import run
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="1 token per image.*fedotp.tokens=pooled"):
        run(tiny_config(tmp_path, cache_dir, method="fedotp", model={"name": "raysim-clip"}))
