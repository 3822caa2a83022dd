import functools

import pytest
import torch
from torch import nn

from raysim.privacy import DPSGD, NoDP, clip_per_sample, per_sample_grads


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _data(b=11):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 5, generator=g), torch.randint(0, 3, (b,), generator=g)


def test_per_sample_grads_match_loop():
    m = _model()
    x, y = _data()
    params = list(m.parameters())
    loss = nn.functional.cross_entropy(m(x), y, reduction="none")
    got = per_sample_grads(loss, params, microbatch=4)  # 11 rows -> chunks 4, 4, 3
    for i in range(x.shape[0]):
        m.zero_grad()
        nn.functional.cross_entropy(m(x[i : i + 1]), y[i : i + 1]).backward()
        for g, p in zip(got, params):
            assert g.shape == (x.shape[0], *p.shape)
            torch.testing.assert_close(g[i], p.grad, rtol=1e-5, atol=1e-6)


def test_per_sample_grads_fallback_loop(monkeypatch):
    m = _model()
    x, y = _data(5)
    params = list(m.parameters())
    loss = nn.functional.cross_entropy(m(x), y, reduction="none")
    ref = per_sample_grads(loss, params)
    real = torch.autograd.grad

    def no_batched(*a, **k):
        if k.get("is_grads_batched"):
            raise RuntimeError("no vmap rule")
        return real(*a, **k)

    monkeypatch.setattr(torch.autograd, "grad", no_batched)
    got = per_sample_grads(loss, params)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_clipping_bounds_every_example():
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(16, 4, 3, generator=g) * 10, torch.randn(16, 5, generator=g) * 0.01]
    grads[0][3] = 0.0
    grads[1][3] = 1e-4  # tiny norm: left unchanged
    clipped = clip_per_sample(grads, 1.5)
    norms = torch.sqrt(sum(c.reshape(16, -1).pow(2).sum(1) for c in clipped))
    assert torch.all(norms <= 1.5 * (1 + 1e-5))
    torch.testing.assert_close(clipped[1][3], grads[1][3])
    assert torch.isfinite(torch.cat([c.reshape(16, -1) for c in clipped], 1)).all()


def test_dpsgd_noise_std_with_zero_grads():
    w = nn.Parameter(torch.zeros(200, 50))
    x = torch.randn(16, 50)
    sigma, clip, b = 3.0, 0.7, 16
    dp = DPSGD(sigma=sigma, clip=clip, sample_rate=0.1, generator=torch.Generator().manual_seed(5))
    loss = (x @ w.t()).sum(1) * 0.0  # zero per-example gradients
    dp.backward(loss, [w])
    std = w.grad.std().item()
    assert w.grad.mean().abs().item() < 0.05 * sigma * clip / b
    assert std == pytest.approx(sigma * clip / b, rel=0.03)


def test_dpsgd_step_values_reproducible_and_other_params():
    m = _model()
    x, y = _data(9)
    dp_params = list(m[2].parameters())
    other = list(m[0].parameters())
    calls = []

    def run(seed):
        loss = nn.functional.cross_entropy(m(x), y, reduction="none")
        h = DPSGD(sigma=1.3, clip=0.5, sample_rate=0.2, generator=torch.Generator().manual_seed(seed), microbatch=4,
                  on_step=lambda: calls.append(1))
        h.backward(loss, dp_params, other)
        return [p.grad.clone() for p in dp_params + other]

    a, b, c = run(7), run(7), run(8)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v)
    assert not torch.allclose(a[0], c[0])
    assert len(calls) == 3
    # the non-DP tensors get the plain mean gradient
    m.zero_grad()
    nn.functional.cross_entropy(m(x), y).backward()
    for p, g in zip(other, a[len(dp_params):]):
        torch.testing.assert_close(g, p.grad)
    # the DP tensors get (sum of clipped + noise) / B: check by reconstructing it
    loss = nn.functional.cross_entropy(m(x), y, reduction="none")
    clipped = clip_per_sample(per_sample_grads(loss, dp_params), 0.5)
    gen = torch.Generator().manual_seed(7)
    for p, g, cg in zip(dp_params, a, clipped):
        noise = torch.randn(p.shape, generator=gen) * 1.3 * 0.5
        torch.testing.assert_close(g, (cg.sum(0) + noise) / 9)


def test_dpsgd_overwrites_grad_and_nodp():
    m = _model()
    x, y = _data(6)
    params = list(m.parameters())
    for p in params:
        p.grad = torch.full_like(p, 100.0)
    NoDP().backward(nn.functional.cross_entropy(m(x), y, reduction="none"), params[:2], params[2:])
    got = [p.grad.clone() for p in params]
    m.zero_grad()
    nn.functional.cross_entropy(m(x), y).backward()
    for g, p in zip(got, params):
        torch.testing.assert_close(g, p.grad)
    assert NoDP.enabled is False and DPSGD.enabled is True


# --- the batched backward on a real text tower (layer norm, GELU, attention): every way of pulling the
# cotangents back, every microbatch, gives the same per-example gradients; DP steps are reproducible


@functools.lru_cache(maxsize=1)
def _tower_env():
    from raysim.models.clip import ModelSpec, build_clip_env

    return build_clip_env(ModelSpec("raysim-tiny", ""), ["circle", "zero", "square", "seven"], 3)


def _tower_loss(b=7):
    """Per-example CE loss of a CoOp prompt on a tiny random open_clip text tower, and the context."""
    env = _tower_env()
    g = torch.Generator().manual_seed(3)
    ctx = (torch.randn(3, env.ctx_width, generator=g) * 0.02).requires_grad_(True)
    local = (torch.randn(3, env.ctx_width, generator=g) * 0.02).requires_grad_(True)  # a second, non-DP prompt
    x = nn.functional.normalize(torch.randn(b, env.feature_dim, generator=g), dim=-1)
    y = torch.randint(0, 4, (b,), generator=g)

    def loss_fn():
        text = env.prompts.text_features(torch.stack([ctx, local]))  # (2, C, D): both prompts through the tower
        logits = env.logit_scale * x @ (text[0] + text[1]).t()
        return nn.functional.cross_entropy(logits, y, reduction="none")

    return loss_fn, ctx, local


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_vjp_modes_and_microbatches_agree_on_a_text_tower():
    import sys

    dpsgd_mod = sys.modules["raysim.privacy.dpsgd"]
    loss_fn, ctx, local = _tower_loss()
    loss = loss_fn()
    ref = dpsgd_mod._rows_vjp(loss, [ctx, local], 0, 7, "loop")  # one plain backward per example
    for mode in dpsgd_mod.VJP_MODES:
        got = dpsgd_mod._rows_vjp(loss, [ctx, local], 2, 7, mode)
        for a, r in zip(got, ref):
            # float32; batched and single-row products sum in different orders (seen: 1e-7 relative)
            assert _rel(a, r[2:]) < 1e-5, mode
    for mb in (1, 3, 0):
        (got,) = per_sample_grads(loss, [ctx], microbatch=mb)
        assert _rel(got, ref[0]) < 1e-5, mb


def test_dpsgd_step_same_for_every_microbatch_and_identical_when_repeated():
    """The released gradient of a DP-SGD step (clipped per example, plus the noise stream) and the other
    tensors' plain gradient do not depend on the microbatch beyond float32 summation order (1e-5 relative:
    the noise, sigma * clip / B ~ 0.1, dominates and is bit-identical), and a fixed setting repeats exactly."""

    def step(mb):
        loss_fn, ctx, local = _tower_loss()
        h = DPSGD(sigma=0.8, clip=0.05, sample_rate=0.5, generator=torch.Generator().manual_seed(11), microbatch=mb)
        h.backward(loss_fn(), {"ctx": ctx}, [local])
        return ctx.grad.clone(), local.grad.clone()

    base = step(8)
    for mb in (1, 3, 0):
        got = step(mb)
        assert _rel(got[0], base[0]) < 1e-5 and _rel(got[1], base[1]) < 1e-5
    again = step(3)
    assert torch.equal(again[0], step(3)[0]) and torch.equal(again[1], step(3)[1])  # determinism, not a value check
    # the non-DP prompt's gradient is the plain gradient of the mean loss, as a separate backward gives it
    loss_fn, ctx, local = _tower_loss()
    (plain,) = torch.autograd.grad(loss_fn().mean(), [local])
    assert _rel(base[1], plain) < 1e-5
    # and the DP prompt's is (sum of clipped per-example gradients + the generator's noise) / B
    loss_fn, ctx, local = _tower_loss()
    (per,) = per_sample_grads(loss_fn(), [ctx], microbatch=1)
    (clipped,) = clip_per_sample([per], 0.05)
    noise = torch.randn(ctx.shape, generator=torch.Generator().manual_seed(11)) * 0.8 * 0.05
    assert _rel(base[0], (clipped.sum(0) + noise) / 7) < 1e-5


def test_public_loss_reaches_dp_and_other_tensors():
    m = _model()
    x, y = _data(5)
    dp_params, other = list(m[2].parameters()), list(m[0].parameters())

    def public_of():
        return sum(p.pow(2).sum() for p in dp_params + other) * 0.1  # data-independent

    h = DPSGD(sigma=0.0, clip=100.0, sample_rate=1.0, generator=torch.Generator().manual_seed(0))
    h.backward(nn.functional.cross_entropy(m(x), y, reduction="none"), dp_params, other, public_loss=public_of())
    got = [p.grad.clone() for p in dp_params + other]
    m.zero_grad()
    (nn.functional.cross_entropy(m(x), y) + public_of()).backward()  # clip 100, no noise: the plain gradient
    for g, p in zip(got, dp_params + other):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_auto_microbatch_bounds_and_budget():
    from raysim.privacy.dpsgd import auto_microbatch

    loss_fn, ctx, local = _tower_loss(b=12)
    loss = loss_fn()
    assert auto_microbatch(loss) == 12  # the tiny graph fits 1 GiB many times over: the whole batch
    small = auto_microbatch(loss, budget_bytes=4 * 2**10)
    assert small == 1  # 4 KiB holds less than one row's activations
    mid = [auto_microbatch(loss, budget_bytes=b) for b in (2**18, 2**20, 2**22)]
    assert mid == sorted(mid) and all(1 <= v <= 12 for v in mid)
    assert mid == [auto_microbatch(loss, budget_bytes=b) for b in (2**18, 2**20, 2**22)]  # depends on shapes only
