"""FedSEPT: SEM, router, losses, DP placement, communication, variants, and an engine run."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from raysim.engine.hosts import check_upload
from raysim.errors import ConfigError, UploadViolation
from raysim.methods import ClientData, EnvSpec, TrainConfig, get_method
from raysim.methods.fedsept.fedsept_parts import Router, diversity_loss, gate_loss
from raysim.models.clip import ModelSpec, build_clip_env
from raysim.privacy.dpsgd import DPSGD, NoDP, per_sample_grads

CLASSES = ["zero", "one", "two", "three", "four"]
L = 4  # short prompts keep the tiny text tower fast


@pytest.fixture(scope="module")
def env():
    return build_clip_env(ModelSpec("raysim-tiny"), CLASSES, L)


def make(**opts):
    cls = get_method("fedsept")
    return cls(TrainConfig(n_ctx=L, batch_size=4, lr=0.01), cls.Options(**{"rank": 8, **opts}))


def client_data(env, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(n, env.feature_dim, generator=g), dim=-1)
    y = torch.arange(n) % len(CLASSES)
    return ClientData(0, x, y, x[:4], y[:4], len(CLASSES))


def setup(method, env, seed=0):
    shared = method.init_shared(env, torch.Generator().manual_seed(seed))
    private = method.init_private(env, client_data(env), torch.Generator().manual_seed(seed + 1))
    return shared, private


def per_sample_loss(method, env, A, R, router, x, y):
    logits, _ = method.forward(env, A, R, router, x)
    return F.cross_entropy(logits, y, reduction="none") + method.opts.lambda_div * diversity_loss(
        A, method.M, method.div_reduction
    )


def test_per_example_grads_equal_single_example_loop(env):
    m = make()
    shared, private = setup(m, env)
    A = shared["A"].clone().requires_grad_(True)
    noise = torch.randn(private["R"].shape, generator=torch.Generator().manual_seed(0))
    R = (private["R"] + 0.01 * noise).requires_grad_(True)
    router = m._router(env, torch.Generator(), private["router"]).eval()
    data = client_data(env, n=6)
    loss = per_sample_loss(m, env, A, R, router, data.x_train, data.y_train)
    (batched,) = per_sample_grads(loss, [A], microbatch=4)  # two chunks, the second one short
    for i in range(6):
        li = per_sample_loss(m, env, A, R, router, data.x_train[i : i + 1], data.y_train[i : i + 1])
        (gi,) = torch.autograd.grad(li.sum(), [A])
        # float32: a batch of 6 and a batch of 1 sum in different orders (seen: 1.4e-7 on entries ~4e-3)
        torch.testing.assert_close(batched[i], gi, rtol=1e-5, atol=1e-6)


def test_dp_noise_on_A_has_calibrated_std_and_R_router_are_noise_free(env):
    m = make(rank=32)
    shared, private = setup(m, env)
    A = shared["A"].clone().requires_grad_(True)
    R = private["R"].clone().requires_grad_(True)
    router = m._router(env, torch.Generator(), private["router"]).eval()
    data = client_data(env, n=4)
    loss = 0.0 * per_sample_loss(m, env, A, R, router, data.x_train, data.y_train)  # zero gradients
    sigma, clip, B = 3.0, 0.5, 4
    dp = DPSGD(sigma=sigma, clip=clip, sample_rate=0.5, generator=torch.Generator().manual_seed(7))
    dp.backward(loss, dp_params=[A], other_params=[R, *router.parameters()])
    expected = sigma * clip / B
    assert A.grad.numel() == m.M * L * 32
    assert A.grad.std().item() == pytest.approx(expected, rel=0.06)
    assert abs(A.grad.mean().item()) < 4 * expected / math.sqrt(A.grad.numel())
    # R and the router get no noise: their gradient (of a zero loss) stays far below the noise
    # level sigma * clip / B = 0.375 that DP-SGD puts on A
    assert R.grad.abs().max().item() < 1e-6 * expected
    assert all(p.grad.abs().max().item() < 1e-6 * expected for p in router.parameters())


def test_public_basis_bit_identical_across_hosts():
    spec = EnvSpec(model=ModelSpec("raysim-tiny"), classnames=CLASSES)
    hosts = []
    for role in ("client", "client", "server"):
        m = make(rank=16)
        m.build_env(spec, role=role)
        hosts.append(m.B0)
    assert hosts[0].shape == (16, 128)
    assert torch.equal(hosts[0], hosts[1]) and torch.equal(hosts[0], hosts[2])
    assert hosts[0].std().item() == pytest.approx(0.02, rel=0.1)  # N(0, 0.02^2), not orthonormalised
    other = make(rank=16, basis_seed=2)
    other.build_env(spec, role="client")
    assert not torch.equal(hosts[0], other.B0)


def test_only_A_is_uploaded(env):
    m = make()
    shared, private = setup(m, env)
    res = m.local_train(env, shared, private, client_data(env), rng=torch.Generator().manual_seed(3), privacy=NoDP())
    assert set(res.upload) == {"A"} and m.uploads == ("A",)
    clean = check_upload(m, 0, res.upload)
    assert clean["A"].shape == (m.M * L, 8)
    assert set(res.private) == {"R", "router"}
    assert not torch.equal(res.private["R"], private["R"])  # R trained, kept local
    B0 = m.basis(env)
    for bad in ({"A": clean["A"], "R": res.private["R"]}, {"B0": B0}, {"router.gate.weight": res.private["router"]["gate.weight"]}):
        with pytest.raises(UploadViolation):
            check_upload(m, 0, bad)


def test_communication_per_round_matches_the_paper():
    wide = SimpleNamespace(ctx_width=512, device=torch.device("cpu"))  # ViT-B/16's text width, L=16
    wide.prompts = SimpleNamespace(initial_context=lambda rng: torch.randn(16, 512, generator=rng) * 0.02)
    cls = get_method("fedsept")
    fed = cls(TrainConfig(n_ctx=16), cls.Options(experts=4, rank=16))
    pfl = get_method("promptfl")(TrainConfig(n_ctx=16), None)

    def per_round(method):  # upload + download of the broadcast state, fp32
        shared = method.init_shared(wide, torch.Generator().manual_seed(0))
        floats = 2 * sum(t.numel() for t in shared.values())
        return floats, 2 * sum(t.numel() * t.element_size() for t in shared.values()) / 1024

    assert per_round(fed) == (2048, 8.0)
    assert per_round(pfl) == (16384, 64.0)


def test_diversity_sum_is_M_M_minus_1_times_mean():
    A = torch.randn(4 * L, 8)
    s, m = diversity_loss(A, 4, "sum"), diversity_loss(A, 4, "mean")
    torch.testing.assert_close(s, 12 * m)
    same = torch.randn(L, 8).repeat(4, 1)  # collapsed experts: every off-diagonal cosine is 1
    assert diversity_loss(same, 4, "sum").item() == pytest.approx(12.0)
    # one expert: no off-diagonal pairs, so nothing to penalise
    assert diversity_loss(torch.randn(L, 8), 1, "sum").item() == pytest.approx(0.0, abs=1e-12)


def test_gate_loss_zero_iff_batch_mean_routing_is_uniform():
    balanced = torch.eye(4)[[0, 1, 2, 3, 3, 2, 1, 0]]  # confident per input, uniform on average
    assert gate_loss(balanced).item() == pytest.approx(0.0, abs=1e-6)
    assert gate_loss(torch.full((5, 4), 0.25)).item() == pytest.approx(0.0, abs=1e-6)
    skewed = torch.softmax(torch.tensor([[2.0, 0.0, 0.0, 0.0]] * 3), dim=-1)
    assert gate_loss(skewed).item() > 0.1


def test_gate_loss_reaches_the_router_only(env):
    grads = {}
    for lg in (0.0, 10.0):
        m = make(lambda_gate=lg, router_dropout=0.0)
        shared, private = setup(m, env)
        res = m.local_train(env, shared, private, client_data(env, n=4), rng=torch.Generator().manual_seed(5), privacy=NoDP())
        grads[lg] = res
    torch.testing.assert_close(grads[0.0].upload["A"], grads[10.0].upload["A"])
    torch.testing.assert_close(grads[0.0].private["R"], grads[10.0].private["R"])
    assert not torch.equal(grads[0.0].private["router"]["gate.weight"], grads[10.0].private["router"]["gate.weight"])


@pytest.mark.parametrize(
    "opts,shape,private_keys",
    [
        (dict(), (4 * L, 8), {"R", "router"}),
        (dict(variant="single"), (L, 128), set()),
        (dict(variant="full_meps"), (4 * L, 128), {"R", "router"}),
        (dict(variant="wo_r"), (4 * L, 8), {"router"}),
        (dict(variant="top1"), (4 * L, 8), {"R", "router"}),
        (dict(variant="uniform"), (4 * L, 8), {"R"}),
        (dict(fusion="prompt"), (4 * L, 8), {"R", "router"}),
        (dict(cache_text=False, div_reduction="mean", lambda_gate=0.0), (4 * L, 8), {"R", "router"}),
    ],
)
def test_each_variant_trains_under_dp(env, opts, shape, private_keys):
    m = make(**opts)
    shared, private = setup(m, env)
    assert shared["A"].shape == shape and set(private) == private_keys
    dp = DPSGD(sigma=1.0, clip=1.0, sample_rate=0.5, generator=torch.Generator().manual_seed(1))
    res = m.local_train(env, shared, private, client_data(env), rng=torch.Generator().manual_seed(2), privacy=dp)
    assert dp.steps == 2 == m.dp_steps_per_round(8)
    assert res.upload["A"].shape == shape and not torch.equal(res.upload["A"], shared["A"])
    assert math.isfinite(res.metrics["loss"])
    x = client_data(env).x_test
    logits = m.predictor(env, res.upload, res.private)(x)
    assert logits.shape == (4, len(CLASSES)) and torch.isfinite(logits).all()
    # DP-SGD noised A: the same round without DP (same batches: same rng) uploads a different A
    clean = m.local_train(env, shared, private, client_data(env), rng=torch.Generator().manual_seed(2), privacy=NoDP())
    assert (clean.upload["A"] - res.upload["A"]).abs().max() > 1e-4 * clean.upload["A"].abs().max()
    if "R" in res.private:  # the private residual is part of the evaluated prompts
        # (a random move: a constant shift of every entry would be removed by the text tower's LayerNorms)
        R = res.private["R"]
        moved = {**res.private, "R": R + 0.5 * torch.randn(R.shape, generator=torch.Generator().manual_seed(3))}
        assert (m.predictor(env, res.upload, moved)(x) - logits).abs().max() > 1e-4 * logits.abs().max()


def test_cache_uncached_and_fusion_semantics(env):
    base = make()
    shared, private = setup(base, env)
    shared = {"A": shared["A"] * 50}  # experts that differ visibly
    x = client_data(env).x_test
    cached = base.predictor(env, shared, private)(x)
    nc = make(cache_text=False).predictor(env, shared, private)(x)
    torch.testing.assert_close(cached, nc)
    # top-1 keeps the arg-max expert's logits only
    m = make(variant="top1")
    router = m._router(env, torch.Generator(), private["router"]).eval()
    P = m.basis(env)
    text = env.prompts.text_features(shared["A"].view(4, L, -1) @ P + private["R"])
    with torch.no_grad():
        best = router(x).argmax(-1)
    expect = env.logit_scale * torch.stack([x[i] @ text[best[i]].t() for i in range(len(x))])
    torch.testing.assert_close(m.predictor(env, shared, private)(x), expect, rtol=1e-5, atol=1e-5)
    # uniform weights: logit fusion is the mean of the M experts' logits (Eq. 9 at pi = 1/M), prompt fusion
    # (FedSEPT-PF) the logits of the mean prompt; they are different models
    pf = make(fusion="prompt", variant="uniform").predictor(env, shared, {"R": private["R"]})(x)
    lf = make(variant="uniform").predictor(env, shared, {"R": private["R"]})(x)
    prompts = shared["A"].view(4, L, -1) @ P + private["R"]
    mean_logits = env.logit_scale * torch.einsum("bd,mcd->bc", x, env.prompts.text_features(prompts)) / 4
    mean_prompt = env.logit_scale * x @ env.prompts.text_features(prompts.mean(0)).t()
    torch.testing.assert_close(lf, mean_logits, rtol=1e-5, atol=1e-5)  # float32, reassociated sums
    torch.testing.assert_close(pf, mean_prompt, rtol=1e-5, atol=1e-5)
    assert (pf - lf).abs().max() > 1e-3 * lf.abs().max()


def test_options_are_validated_and_the_probe_is_inert_with_one_key():
    from raysim.build import build_config, method_options
    assert method_options(build_config(dict(method="fedsept", fedsept={"router": "patch"}))).router == "patch"
    assert method_options(build_config(dict(method="fedsept", fedsept={"rank": 8}))).rank == 8
    for bad in (dict(experts=0), dict(variant="moe"), dict(fusion="x"), dict(div_reduction="max"), dict(lambda_gate=-1)):
        with pytest.raises(ConfigError):
            dataclasses.replace(get_method("fedsept").Options(), **bad).validate()
    # the module itself: with K patch tokens the probe query matters (it gets a gradient). Both
    # checks are relative to the gradient of the attention's in-projection, the router's own scale.
    torch.manual_seed(0)
    r = Router(32, 4, heads=4, dropout=0.0, mode="patch")
    r(torch.randn(3, 7, 32)).pow(2).sum().backward()
    # K keys: u's gradient is a real fraction of the router's (seen 0.04-0.06), not round-off
    assert r.probe.grad.norm() > 1e-3 * r.attn.in_proj_weight.grad.norm()
    pooled = Router(32, 4, heads=4, dropout=0.0, mode="pooled")
    pooled(torch.randn(3, 32)).pow(2).sum().backward()
    # one key: the softmax weight is 1 whatever u is, so u's gradient is 0 up to float32 round-off
    # (seen 2e-11 to 8e-11 depending on the CPU, against ~1e-2 for the in-projection)
    assert pooled.probe.grad is not None  # u is in the graph (through the query), so it gets a gradient
    assert pooled.probe.grad.norm() <= 1e-6 * pooled.attn.in_proj_weight.grad.norm()
    feats = torch.randn(3, 32)
    before = pooled(feats)
    with torch.no_grad():
        pooled.probe.mul_(-3.0).add_(1.0)
    torch.testing.assert_close(pooled(feats), before)  # and moving it changes nothing (float32 round-off)
    with pytest.raises(ConfigError):
        r(torch.randn(3, 32))


def test_engine_run_with_dp_stays_within_budget(tmp_path):
    from raysim.build import build_config, method_options
    from raysim.engine.loop import run

    cfg = build_config(
        dict(
            method="fedsept", train={"rounds": 2, "n_ctx": 16}, execution={"backend": "inline"},
            output={"out_dir": str(tmp_path / "r"), "progress": False, "tensorboard": False, "cache_dir": str(tmp_path / "cache")},
            data={"dataset": "digits"}, model={"name": "raysim-tiny", "pretrained": ""}, dp={"epsilon": 1.0},
        )
    )
    result = run(cfg)
    rows = pd.read_csv(tmp_path / "r" / "results.csv")
    assert len(rows) == 2
    o = method_options(cfg)
    per_client = o.experts * cfg.train.n_ctx * o.rank * 4
    assert (rows["bytes_up"] == cfg.train.num_clients * per_client).all()
    assert (rows["bytes_down"] == cfg.train.num_clients * per_client).all()
    eps = pd.read_csv(tmp_path / "r" / "client_results.csv")["epsilon"]
    assert len(eps) > 0 and (eps > 0).all() and (eps <= 1.0 + 1e-9).all()
    assert math.isfinite(result.summary["hm"])


def test_orthonormal_basis_spans_the_gaussian_basis_rows():
    """fedsept.basis=orthonormal (an analysis option) keeps B0's row space and makes the rows orthonormal,
    so a step on A moves P by g's projection on that space; the default stays the official N(0, 0.02^2)."""
    import torch

    from raysim.methods.fedsept.fedsept_parts import public_basis

    G = public_basis(1, 16, 384)
    Q = public_basis(1, 16, 384, kind="orthonormal")
    assert abs(float(G.std()) - 0.02) < 0.002  # 6,144 draws: the std estimate is within ~1% (2e-4)
    assert torch.allclose(Q @ Q.t(), torch.eye(16), atol=1e-5)  # float32 QR: orthonormal to rounding
    # the same row space: projecting G's rows onto Q's span gives G back
    assert torch.allclose(G @ Q.t() @ Q, G, atol=1e-6)


def test_r_init_phrase_starts_the_residual_at_the_phrase_embeddings():
    """fedsept.r_init=phrase: R starts at train.ctx_init's token embeddings (the prompt PromptFL starts from),
    the shared A and the router are drawn as before; r_init=zeros (default, official) keeps R = 0."""
    cls = get_method("fedsept")
    spec = EnvSpec(model=ModelSpec("raysim-tiny"), classnames=CLASSES)
    phrase = cls(TrainConfig(n_ctx=L, ctx_init="a photo of a"), cls.Options(rank=8, r_init="phrase"))
    penv = phrase.build_env(spec, role="client")
    R = phrase.init_private(penv, client_data(penv), torch.Generator().manual_seed(1))["R"]
    assert torch.equal(R, penv.prompts.init_ctx)  # a copy of the phrase's embeddings
    assert float(R.norm()) > 0
    plain = cls(TrainConfig(n_ctx=L, ctx_init="a photo of a"), cls.Options(rank=8))
    zenv = plain.build_env(spec, role="client")
    assert float(plain.init_private(zenv, client_data(zenv), torch.Generator().manual_seed(1))["R"].abs().sum()) == 0
    with pytest.raises(ConfigError, match="r_init"):
        cls.Options(r_init="ones").validate()
