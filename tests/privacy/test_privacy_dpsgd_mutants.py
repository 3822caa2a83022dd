"""privacy/dpsgd.py beyond the main path of test_privacy_dpsgd.py: the settings each handle refuses, the edges of a
step (one example, an empty Poisson batch, a tensor the loss does not reach, `public_loss` with only DP or only
other tensors), BatchClipSGD's whole-batch clipping and its public term, the fallback between the ways of pulling
rows back, the memory estimate of `auto_microbatch`, and the standalone handle's batches and clean releases.
Small CPU models, seeded; every float comparison has a tolerance and says why."""

import importlib
import math
import re
import warnings

import pytest
import torch
from torch import nn

from raysim.errors import ConfigError
from raysim.privacy import DPSGD, NoDP, clip_per_sample, per_sample_grads

dpsgd_mod = importlib.import_module("raysim.privacy.dpsgd")  # `raysim.privacy.dpsgd` the attribute is a mechanism
BatchClipSGD = dpsgd_mod.BatchClipSGD


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _data(b=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 5, generator=g), torch.randint(0, 3, (b,), generator=g)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _state_unchanged(gen, seed):
    return torch.equal(gen.get_state(), _gen(seed).get_state())


# --------------------------------------------------------------------------- settings refused, with their message


@pytest.mark.parametrize("kwargs, match", [
    ({"sigma": math.inf}, "noise multiplier must be a finite number >= 0"),
    ({"sigma": -0.1}, "noise multiplier must be a finite number >= 0"),
    ({"clip": 0.0}, "clipping norm must be > 0"),
    ({"clip": math.inf}, "clipping norm must be > 0"),
    ({"sample_rate": 0.0}, r"sample rate must lie in \(0, 1\]"),
    ({"sample_rate": 1.5}, r"sample rate must lie in \(0, 1\]"),
    ({"microbatch": -1}, r"microbatch must be >= 1 \(or 0 = automatic\)"),
])
def test_dpsgd_refuses_settings_outside_their_range(kwargs, match):
    """A DP-SGD handle refuses an infinite noise multiplier, a clip of 0 or infinity, a sampling rate outside (0, 1]
    and a negative microbatch, naming the setting; the edges inside the ranges are accepted."""
    base = {"sigma": 1.0, "clip": 1.0, "sample_rate": 0.5, "generator": _gen()}
    with pytest.raises(ConfigError, match=match):
        DPSGD(**{**base, **kwargs})
    h = DPSGD(sigma=0.0, clip=0.5, sample_rate=1.0, generator=_gen(), microbatch=0)
    assert (h.sigma, h.clip, h.sample_rate, h.microbatch) == (0.0, 0.5, 1.0, 0)


@pytest.mark.parametrize("kwargs, match", [
    ({"std": math.inf}, "noise std must be a finite number >= 0"),
    ({"clip": 0.0}, "clipping norm must be > 0"),
    ({"clip": math.inf}, "clipping norm must be > 0"),
])
def test_batch_clip_refuses_settings_outside_their_range(kwargs, match):
    """BatchClipSGD refuses an infinite noise std and a clip of 0 or infinity; a clip below 1 and std 0 are fine."""
    with pytest.raises(ConfigError, match=match):
        BatchClipSGD(**{"std": 0.1, "clip": 1.0, "generator": _gen(), **kwargs})
    h = BatchClipSGD(std=0.0, clip=0.5, generator=_gen())
    assert (h.std, h.clip) == (0.0, 0.5)


# --------------------------------------------------------------------------- BatchClipSGD


def _lin(b=6, scale=1.0):
    """A linear per-example loss (scaled, so the batch gradient's norm can be set) and its weight."""
    torch.manual_seed(3)
    w = nn.Parameter(torch.randn(4, 5) * 0.3)
    x, _ = _data(b, seed=2)
    return lambda: scale * torch.tanh(x @ w.t()).sum(1), w


def test_batch_clip_scales_the_mean_gradient_to_clip_and_never_up():
    """The batch-mean gradient is scaled by min(1, clip / ||g||), the norm over every dp tensor (a dp tensor the
    loss does not reach gets 0 and adds nothing to the norm); a gradient inside the ball is left as it is,
    also when its norm is below 1."""
    for scale, ratio in ((0.05, 0.5), (0.05, 1.5), (3.0, 0.5), (3.0, 1.5)):
        loss_fn, w = _lin(scale=scale)
        spare = nn.Parameter(torch.ones(3))  # privatised, but not in this loss
        (g,) = torch.autograd.grad(loss_fn().mean(), [w])
        norm = float(g.norm())
        assert (norm < 1) == (scale < 1)  # both sides of 1 are covered
        clip = ratio * norm
        h = BatchClipSGD(std=0.0, clip=clip, generator=_gen())
        h.backward(loss_fn(), {"w": w, "spare": spare})
        # float32 gradients, one rescale: 1e-6 relative
        torch.testing.assert_close(w.grad, g * min(1.0, clip / norm), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(spare.grad, torch.zeros(3))
        torch.testing.assert_close(h.grads["w"], w.grad)


def test_batch_clip_one_example_works_and_an_empty_batch_is_refused():
    """A batch of one example is a batch (its gradient, clipped); an empty one is refused with a message."""
    loss_fn, w = _lin(b=1)
    (g,) = torch.autograd.grad(loss_fn().mean(), [w])
    BatchClipSGD(std=0.0, clip=1e6, generator=_gen()).backward(loss_fn(), [w])
    torch.testing.assert_close(w.grad, g)  # no clipping at 1e6, no noise: the same float32 gradient
    with pytest.raises(ValueError, match="a batch-clipped step needs a non-empty batch"):
        BatchClipSGD(std=0.0, clip=1.0, generator=_gen()).backward(loss_fn()[:0], [w])


def test_batch_clip_adds_the_public_gradient_after_clipping():
    """`public_loss`'s gradient is added to each dp tensor after the clipping, neither clipped nor noised; a dp
    tensor the public term does not reach gets none, and the public term may share graph nodes with the data
    loss (here tanh(w), whose saved output both backward passes need)."""
    torch.manual_seed(4)
    w = nn.Parameter(torch.randn(4, 5) * 0.3)
    spare = nn.Parameter(torch.randn(3))  # reached by the data loss only
    other = nn.Parameter(torch.randn(4))
    x, _ = _data(6, seed=5)

    def losses():
        t = torch.tanh(w)  # shared by the data loss and the public term
        per = (x @ t.t()).pow(2).sum(1) + (x[:, :3] @ spare) + (x[:, :4] @ other)
        return per, 0.7 * t.pow(2).sum()

    per, public = losses()
    g_w, g_s = torch.autograd.grad(per.mean(), [w, spare], retain_graph=True)
    (p_w,) = torch.autograd.grad(public, [w])
    norm = float(torch.sqrt(g_w.pow(2).sum() + g_s.pow(2).sum()))
    clip = 0.25 * norm
    per, public = losses()
    BatchClipSGD(std=0.0, clip=clip, generator=_gen()).backward(per, {"w": w, "spare": spare}, [other], public_loss=public)
    # float32, a handful of ops: 1e-5 relative
    torch.testing.assert_close(w.grad, g_w * clip / norm + p_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(spare.grad, g_s * clip / norm, rtol=1e-5, atol=1e-6)
    (g_o,) = torch.autograd.grad(losses()[0].mean(), [other])
    torch.testing.assert_close(other.grad, g_o, rtol=1e-5, atol=1e-6)  # the plain gradient, no public term here


def test_batch_clip_noise_has_std_and_comes_from_the_generator():
    """The noise is N(0, std^2) per coordinate (std below 1 too), drawn from the handle's generator in order, so a
    seed fixes it; with std 0 the generator is not drawn from."""
    w = nn.Parameter(torch.zeros(200, 50))
    x = torch.randn(8, 50)
    h = BatchClipSGD(std=0.4, clip=1.0, generator=_gen(9))
    h.backward((x @ w.t()).sum(1) * 0.0, {"w": w})  # a zero gradient: the grad is the noise alone
    expected = torch.randn(200, 50, generator=_gen(9)) * 0.4
    torch.testing.assert_close(w.grad, expected)  # the same float32 draws times 0.4: equal to rounding
    assert w.grad.std().item() == pytest.approx(0.4, rel=0.03)  # 10,000 draws: the std within 3 %
    quiet = _gen(9)
    BatchClipSGD(std=0.0, clip=1.0, generator=quiet).backward((x @ w.t()).sum(1), {"w": w})
    assert _state_unchanged(quiet, 9)


def test_batch_clip_counts_steps_and_names():
    """Each step counts once, calls on_step, and records the names it privatised (what the host checks)."""
    loss_fn, w = _lin()
    calls = []
    h = BatchClipSGD(std=0.0, clip=1.0, generator=_gen(), on_step=lambda: calls.append(1))
    for _ in range(3):
        h.backward(loss_fn(), {"w": w})
    assert h.steps == 3 and len(calls) == 3
    assert h.names_each_step == [frozenset({"w"})] * 3 and h.trained == {"w": w}


# --------------------------------------------------------------------------- NoDP


def test_nodp_adds_public_loss_counts_steps_and_zeroes_unused():
    """NoDP: every tensor gets the plain gradient of mean(loss) + public_loss, `.grad` overwritten (a tensor the
    loss does not reach gets zeros, not its stale gradient); each step counts once and calls on_step."""
    m = _model()
    x, y = _data()
    params = list(m.parameters())
    unused = nn.Parameter(torch.ones(2))
    unused.grad = torch.full((2,), 100.0)
    calls = []
    h = NoDP(on_step=lambda: calls.append(1))

    def public():
        return 0.3 * sum(p.pow(2).sum() for p in params)

    for _ in range(2):
        h.backward(nn.functional.cross_entropy(m(x), y, reduction="none"), params[:2], params[2:] + [unused],
                   public_loss=public())
    got = [p.grad.clone() for p in params]
    m.zero_grad()
    (nn.functional.cross_entropy(m(x), y) + public()).backward()
    for g, p in zip(got, params):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)  # the same float32 sums, in another order
    torch.testing.assert_close(unused.grad, torch.zeros(2))
    assert h.steps == 2 and len(calls) == 2


# --------------------------------------------------------------------------- DPSGD edges


def _parts(b, seed=6):
    """A two-layer model split into a DP layer and an other layer, with a data-independent public term that shares
    a node (tanh of the DP weight) with the forward."""
    torch.manual_seed(seed)
    w1, w2 = nn.Parameter(torch.randn(7, 5) * 0.5), nn.Parameter(torch.randn(3, 7) * 0.5)
    spare = nn.Parameter(torch.randn(3))  # privatised, reached by the data loss, not by the public term
    x, y = _data(b, seed=seed)

    def losses():
        t = torch.tanh(w2)
        logits = torch.tanh(x @ w1.t()) @ t.t() + spare
        return nn.functional.cross_entropy(logits, y, reduction="none"), 0.2 * t.pow(2).sum()

    return losses, w1, w2, spare


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("with_others", [True, False])
def test_dpsgd_step_with_public_loss_matches_its_definition(b, with_others):
    """sigma 0, a clip no example reaches: each DP tensor gets mean gradient + public gradient, each other tensor
    the plain gradient of mean(loss) + public_loss; for a batch of one example too, and with or without other
    tensors; a DP tensor the public term does not reach gets no public part."""
    losses, w1, w2, spare = _parts(b)
    per, public = losses()
    g1, g2, gs = torch.autograd.grad(per.mean(), [w1, w2, spare], retain_graph=True)
    p1, p2 = torch.autograd.grad(public, [w1, w2], allow_unused=True)
    assert p1 is None  # w1 only feeds the data loss
    h = DPSGD(sigma=0.0, clip=1e6, sample_rate=0.5, generator=_gen())
    per, public = losses()
    dp = {"w2": w2, "spare": spare} if with_others else {"w1": w1, "w2": w2, "spare": spare}
    h.backward(per, dp, [w1] if with_others else [], public_loss=public)
    # float32 sums of b per-example gradients against one mean backward: 1e-5 relative
    close = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(w2.grad, g2 + p2, **close)
    torch.testing.assert_close(spare.grad, gs, **close)
    torch.testing.assert_close(w1.grad, g1, **close)
    assert h.steps == 1 and h.names_each_step == [frozenset(dp)]


@pytest.mark.parametrize("b", [1, 3])
def test_dpsgd_without_dp_tensors_gives_others_the_plain_gradient(b):
    """With no privatised tensor (all trainable tensors public), the others get the plain gradient of
    mean(loss) + public_loss, from one example up."""
    losses, w1, w2, spare = _parts(b)
    per, public = losses()
    expected = torch.autograd.grad(per.mean() + public, [w1, w2, spare])
    per, public = losses()
    DPSGD(sigma=1.0, clip=1.0, sample_rate=0.5, generator=_gen()).backward(per, {}, [w1, w2, spare], public_loss=public)
    for p, e in zip((w1, w2, spare), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-6)  # float32 sums in another order


def test_dpsgd_empty_poisson_batch_releases_noise_over_the_expected_size():
    """An empty Poisson batch is still a step when the expected batch size is set: each DP tensor gets
    noise / expected_batch plus the public gradient; without expected_batch it is
    refused with a message. Tensors outside DP with no public term reaching them do not fail the step."""
    losses, w1, w2, spare = _parts(4)
    per, public = losses()
    (p2,) = torch.autograd.grad(public, [w2])
    h = DPSGD(sigma=2.0, clip=0.5, sample_rate=0.1, generator=_gen(3), expected_batch=2.5)
    per, public = losses()
    h.backward(per[:0], {"w2": w2}, [w1, spare], public_loss=public)
    noise = torch.randn(w2.shape, generator=_gen(3)) * 2.0 * 0.5
    torch.testing.assert_close(w2.grad, noise / 2.5 + p2, rtol=1e-5, atol=1e-6)  # float32 divide and add
    assert h.steps == 1
    # nothing privatised, other tensors only: still a (counted) step, public term and all
    h2 = DPSGD(sigma=2.0, clip=0.5, sample_rate=0.1, generator=_gen(3), expected_batch=2.5)
    per, public = losses()
    h2.backward(per[:0], {}, [w1, w2], public_loss=public)
    assert h2.steps == 1
    with pytest.raises(ValueError, match="DP-SGD step on an empty batch"):
        DPSGD(sigma=1.0, clip=1.0, sample_rate=0.1, generator=_gen()).backward(losses()[0][:0], [w2])
    # the other tensors have no loss in an empty batch: no gradient, and never the previous step's left behind
    w1.grad = torch.ones_like(w1)
    per, public = losses()
    DPSGD(sigma=2.0, clip=0.5, sample_rate=0.1, generator=_gen(3), expected_batch=2.5).backward(per[:0], {"w2": w2}, [w1])
    assert w1.grad is None


def test_apply_per_example_directly():
    """`apply_per_example` (the client-batched path calls it with per-example gradients it computed): clip, sum,
    noise, divide by the batch (or the expected batch), no public gradients needed; one example is a batch; an
    empty batch without an expected size is refused."""
    g = torch.Generator().manual_seed(8)
    w = nn.Parameter(torch.zeros(3, 4))
    per = torch.randn(5, 3, 4, generator=g)
    h = DPSGD(sigma=0.5, clip=0.3, sample_rate=0.5, generator=_gen(2))
    h.apply_per_example({"w": w}, [per], 5)
    noise = torch.randn(3, 4, generator=_gen(2)) * 0.5 * 0.3
    torch.testing.assert_close(w.grad, (clip_per_sample([per], 0.3)[0].sum(0) + noise) / 5)  # float32, same ops
    h.apply_per_example({"w": w}, [per[:1]], 1)
    stream = _gen(2)
    torch.randn(3, 4, generator=stream)  # the first step's draw: the stream goes on
    noise = torch.randn(3, 4, generator=stream) * 0.5 * 0.3
    torch.testing.assert_close(w.grad, clip_per_sample([per[:1]], 0.3)[0][0] + noise)  # float32, same ops
    with pytest.raises(ValueError, match="DP-SGD step on an empty batch"):
        h.apply_per_example({"w": w}, [per[:0]], 0)
    e = DPSGD(sigma=0.5, clip=0.3, sample_rate=0.5, generator=_gen(2), expected_batch=4.0)
    e.apply_per_example({"w": w}, [per[:0]], 0)
    torch.testing.assert_close(w.grad, torch.randn(3, 4, generator=_gen(2)) * 0.5 * 0.3 / 4.0)  # noise alone


def test_dpsgd_without_noise_does_not_draw_from_the_generator():
    """sigma 0: no noise is drawn, so the generator's stream is left for whatever uses it next."""
    losses, w1, w2, spare = _parts(3)
    gen = _gen(4)
    DPSGD(sigma=0.0, clip=0.1, sample_rate=0.5, generator=gen).backward(losses()[0], [w2], [w1])
    assert _state_unchanged(gen, 4)


# --------------------------------------------------------------------------- per-example gradients


def _lin_loss(b, seed=7):
    """Per-example loss tanh(x w) . 1 of a linear layer, a float64 tensor the loss does not reach, and the
    loop reference (one backward per example)."""
    torch.manual_seed(seed)
    w = nn.Parameter(torch.randn(4, 5) * 0.5)
    spare = nn.Parameter(torch.ones(2, 3, dtype=torch.float64))
    x, _ = _data(b, seed=seed)
    loss = torch.tanh(x @ w.t()).sum(1)
    ref = torch.stack([torch.autograd.grad(loss[i], [w], retain_graph=True)[0] for i in range(b)])
    return loss, w, spare, ref


def test_every_way_gives_zeros_of_the_right_shape_for_a_tensor_the_loss_does_not_reach():
    """Each way of pulling rows back (VJP_MODES) gives, for rows [1, 4), the per-example gradients of a tensor the
    loss reaches and zeros of shape (3, *shape) and the tensor's own dtype for one it does not reach."""
    loss, w, spare, ref = _lin_loss(5)
    for mode in dpsgd_mod.VJP_MODES:
        gw, gs = dpsgd_mod._rows_vjp(loss, [w, spare], 1, 4, mode)
        torch.testing.assert_close(gw, ref[1:4], rtol=1e-5, atol=1e-6)  # float32, batched vs single rows
        assert gs.shape == (3, 2, 3) and gs.dtype == torch.float64, mode
        assert not gs.any(), mode


def _disable(monkeypatch, *, vmap=False, batched=False, every=False):
    """Make a way of pulling back fail as an op without a batching rule would: torch.func.vmap (the "func" way),
    autograd.grad(is_grads_batched=True) (the "legacy" way), or every autograd.grad call."""
    real_grad = torch.autograd.grad

    def grad(*a, **k):
        if every or (batched and k.get("is_grads_batched")):
            raise RuntimeError("no backward here")
        return real_grad(*a, **k)

    def no_vmap(*a, **k):
        raise RuntimeError("no batching rule here")

    monkeypatch.setattr(torch.autograd, "grad", grad)
    if vmap:
        monkeypatch.setattr(torch.func, "vmap", no_vmap)


@pytest.mark.parametrize("mode, kwargs", [
    ("loop", {"vmap": True, "batched": True}),  # the loop needs neither vmap nor batched grads
    ("legacy", {"vmap": True}),  # the legacy way does not use torch.func.vmap
    ("func", {"batched": True}),  # the func way does not use is_grads_batched
])
def test_each_way_uses_only_its_own_machinery(monkeypatch, mode, kwargs):
    """A way of pulling rows back keeps working when the other ways' machinery is unavailable: that is what makes
    each a fallback for the one before."""
    loss, w, spare, ref = _lin_loss(4)
    _disable(monkeypatch, **kwargs)
    (gw,) = dpsgd_mod._rows_vjp(loss, [w], 0, 4, mode)
    torch.testing.assert_close(gw, ref, rtol=1e-5, atol=1e-6)  # float32, batched vs single rows


def _record_ways(monkeypatch):
    """Record (mode, start, stop) of every _rows_vjp call of per_sample_grads_and_sums; fail fast on a retry loop."""
    real = dpsgd_mod._rows_vjp
    calls = []

    def rows_vjp(loss, params, start, stop, mode):
        calls.append((mode, start, stop))
        if len(calls) > 30:
            raise AssertionError("the same rows retried without end")
        return real(loss, params, start, stop, mode)

    monkeypatch.setattr(dpsgd_mod, "_rows_vjp", rows_vjp)
    return calls


def test_microbatch_sets_the_rows_per_backward_and_func_is_tried_first(monkeypatch):
    """`microbatch` rows are pulled back per batched backward (the memory bound), the last chunk shorter, each
    with the best way ("func") while it works; per-example gradients and sums come out whole."""
    loss, w, spare, ref = _lin_loss(7)
    calls = _record_ways(monkeypatch)
    per, sums = dpsgd_mod.per_sample_grads_and_sums(loss, [w], [spare], microbatch=3)
    assert calls == [("func", 0, 3), ("func", 3, 6), ("func", 6, 7)]
    torch.testing.assert_close(per[0], ref, rtol=1e-5, atol=1e-6)  # float32, batched vs single rows
    assert sums[0].shape == spare.shape and not sums[0].any()


@pytest.mark.parametrize("kwargs, ways", [
    ({"vmap": True}, ["func", "legacy", "legacy", "legacy"]),
    ({"vmap": True, "batched": True}, ["func", "legacy", "loop", "loop", "loop"]),
])
def test_a_way_that_fails_falls_back_to_the_next_for_the_rest_of_the_batch(monkeypatch, kwargs, ways):
    """When a way cannot pull the rows back, the next one in VJP_MODES is tried for those rows, and kept for the
    later microbatches; the gradients are the same."""
    loss, w, spare, ref = _lin_loss(5)
    _disable(monkeypatch, **kwargs)
    calls = _record_ways(monkeypatch)
    (per,) = per_sample_grads(loss, [w], microbatch=2)
    assert [mode for mode, _, _ in calls] == ways
    torch.testing.assert_close(per, ref, rtol=1e-5, atol=1e-6)  # float32, batched vs single rows


def test_when_every_way_fails_the_last_error_is_raised(monkeypatch):
    """If even one backward per row fails, that error reaches the caller (no endless retry, no other error)."""
    loss, w, spare, ref = _lin_loss(3)
    _disable(monkeypatch, vmap=True, every=True)
    _record_ways(monkeypatch)
    with pytest.raises(RuntimeError, match="no backward here"):
        per_sample_grads(loss, [w], microbatch=2)


def test_only_the_known_vmap_performance_warning_is_hidden():
    """The func way hides the warning torch gives for an op without a batching rule (its text, as torch 2.x
    prints it, is simulated here by a gradient hook), and no other warning: a hook's own warning still reaches
    the user."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3))
    x = torch.randn(4, 3)
    h = x * w
    h.register_hook(lambda g: warnings.warn("There is a performance drop because we have not yet implemented the "
                                            "batching rule for aten::fake. Please file us an issue", UserWarning, stacklevel=2))
    h.register_hook(lambda g: warnings.warn("the user's hook saw a gradient", UserWarning, stacklevel=2))
    loss = h.sum(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dpsgd_mod._rows_vjp(loss, [w], 0, 4, "func")
    texts = [str(r.message) for r in seen]
    assert any("the user's hook saw a gradient" in t for t in texts)
    assert not any("performance drop" in t for t in texts)


def test_per_sample_grads_and_sums_edges():
    """One example gives its gradient; only summed tensors (no per-example ones) give the gradient of the summed
    loss; an empty batch gives (0, *shape) per-example tensors and zero sums in each tensor's dtype, on its device
    even when torch's default device is another one."""
    loss, w, spare, ref = _lin_loss(1)
    (per,), () = dpsgd_mod.per_sample_grads_and_sums(loss, [w], [], microbatch=8)
    torch.testing.assert_close(per, ref)  # one row: the same float32 backward
    loss, w, spare, ref = _lin_loss(5)
    (), (total,) = dpsgd_mod.per_sample_grads_and_sums(loss, [], [w], microbatch=2)
    torch.testing.assert_close(total, ref.sum(0), rtol=1e-5, atol=1e-6)  # float32 sums in another order
    empty = loss[:0]
    with torch.device("meta"):  # another default device: the results still follow the tensors
        (pw, ps), (sw,) = dpsgd_mod.per_sample_grads_and_sums(empty, [w, spare], [spare], microbatch=0)
    assert pw.shape == (0, 4, 5) and ps.shape == (0, 2, 3) and ps.dtype == torch.float64
    assert pw.device == w.device and ps.device == spare.device
    assert sw.shape == (2, 3) and sw.dtype == torch.float64 and not sw.any()


# --------------------------------------------------------------------------- auto_microbatch, default_budget


def test_auto_microbatch_is_the_budget_over_the_bytes_saved_for_backward():
    """The rows per backward = budget // (bytes of the distinct tensors the graph saved for backward), in [1, B].
    The graph here saves x (twice: counted once), the row sums (B floats) and the 0-dim scalar s; the leaves
    themselves are not saved activations."""
    b, d = 8, 6
    torch.manual_seed(1)
    x = torch.randn(b, d)
    w, v = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))
    s = nn.Parameter(torch.tensor(0.5))
    loss = (x * w).sum(1) * s + (x * v).sum(1)
    saved = x.numel() * 4 + b * 4 + 1 * 4  # float32: x, the sums of x * w, s
    assert dpsgd_mod.auto_microbatch(loss, budget_bytes=3 * saved) == 3
    assert dpsgd_mod.auto_microbatch(loss, budget_bytes=3 * saved - 1) == 2
    assert dpsgd_mod.auto_microbatch(loss, budget_bytes=100 * saved) == b
    assert dpsgd_mod.auto_microbatch(loss, budget_bytes=1) == 1


def test_auto_microbatch_small_batches_and_graphless_losses():
    """No batched backward is worth measuring for fewer than 2 rows or a loss without a graph: the whole batch (at
    least 1); two rows are measured like any batch."""
    x = torch.randn(5, 3)
    w = nn.Parameter(torch.randn(3))
    loss = torch.tanh(x @ w)
    assert dpsgd_mod.auto_microbatch(loss[:0], budget_bytes=1) == 1
    assert dpsgd_mod.auto_microbatch(loss[:1], budget_bytes=1) == 1
    assert dpsgd_mod.auto_microbatch(loss.detach(), budget_bytes=1) == 5
    assert dpsgd_mod.auto_microbatch(loss[:2], budget_bytes=1) == 1
    assert dpsgd_mod.auto_microbatch(loss[:2], budget_bytes=2**30) == 2


def test_auto_microbatch_visits_each_graph_node_once(monkeypatch):
    """The graph walk inspects each autograd node once, so a residual chain (2^depth paths through its nodes) is
    measured in time linear in its size."""
    torch.manual_seed(2)
    h = torch.randn(4, 3)
    ws = [nn.Parameter(torch.randn(3, 3) * 0.1) for _ in range(12)]
    for w in ws:
        h = h + torch.tanh(h @ w)  # h feeds both the branch and the skip
    loss = h.sum(1)
    inspected = []
    real_dir = dir
    monkeypatch.setattr(dpsgd_mod, "dir", lambda node: inspected.append(id(node)) or real_dir(node), raising=False)
    dpsgd_mod.auto_microbatch(loss, budget_bytes=2**20)
    assert 0 < len(inspected) == len(set(inspected)) < 100


def test_default_budget_is_a_gib_on_cpu_and_an_eighth_of_a_gpu(monkeypatch):
    """The backward's memory budget: 1 GiB on a CPU; on a GPU an eighth of the device's total memory (its size,
    asked of that device), read here from a stand-in for torch.cuda.get_device_properties."""
    assert dpsgd_mod.default_budget(torch.device("cpu")) == 2**30
    gpu = torch.device("cuda", 1)

    class Props:
        total_memory = 80 * 2**30

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: asked.append(dev) or Props())
    assert dpsgd_mod.default_budget(gpu) == 10 * 2**30
    assert asked == [gpu]


# --------------------------------------------------------------------------- clipping, noise


def test_clipping_below_norm_one_reaches_exactly_clip():
    """Per-example norms below 1 above the clip are scaled to the clip exactly (the 1e-12 guard only protects a
    zero norm), in the example's direction."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(6, 4, generator=g), torch.randn(6, 2, 3, generator=g)]
    norms = torch.sqrt(sum(t.flatten(1).pow(2).sum(1) for t in grads))
    grads = [t * (0.5 / norms).view(-1, *([1] * (t.dim() - 1))) for t in grads]  # every example: norm 0.5
    clipped = clip_per_sample(grads, 0.2)
    for c, t in zip(clipped, grads):
        torch.testing.assert_close(c, t * 0.4, rtol=1e-5, atol=1e-7)  # float32 rescale by 0.2 / 0.5


def test_noise_without_a_generator_uses_torchs_global_stream():
    """gaussian_noise_like with no generator draws N(0, std^2) from torch's global generator (seeded by
    torch.manual_seed), in p's dtype."""
    p = torch.zeros(3, 4, dtype=torch.float64)
    torch.manual_seed(11)
    got = dpsgd_mod.gaussian_noise_like(p, 2.0, None)
    torch.manual_seed(11)
    expected = torch.randn(3, 4) * 2.0
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected.double())  # the same float32 draws, cast: equal


def test_noise_comes_from_the_generators_device_not_the_default_device():
    """The noise is drawn where the generator lives (here the CPU) even under another default device, so the
    seeded stream, not the default device's, gives it; the result lies on p's device."""
    p = torch.zeros(3, 4)
    with torch.device("meta"):
        got = dpsgd_mod.gaussian_noise_like(p, 0.5, _gen(12))
    assert got.device == p.device
    torch.testing.assert_close(got, torch.randn(3, 4, generator=_gen(12)) * 0.5)  # same float32 draws


# --------------------------------------------------------------------------- the standalone handle


def test_standalone_batches_are_the_seeded_shuffled_epoch():
    """A handle on its own gives the shuffled fixed-size batches of one epoch (drop_last) from the given
    generator, so a seed fixes them."""
    got = list(NoDP().batches(10, 3, _gen(5)))
    perm = torch.randperm(10, generator=_gen(5))
    assert [t.tolist() for t in got] == [perm[0:3].tolist(), perm[3:6].tolist(), perm[6:9].tolist()]


def test_standalone_release_of_features_is_the_clean_class_means():
    """Without noise, a prototype release is each class's mean feature (float32, CPU, detached); a class with one
    example is that example, a class with none (the last one included) is zero."""
    g = torch.Generator().manual_seed(6)
    feats = torch.randn(5, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    labels = torch.tensor([0, 0, 2, 0, 1], dtype=torch.int32)
    got = DPSGD(sigma=1.0, clip=1.0, sample_rate=0.5, generator=_gen()).release("protos", features=feats,
                                                                              labels=labels, num_classes=4)
    f = feats.detach().float()
    expected = torch.stack([f[[0, 1, 3]].mean(0), f[4], f[2], torch.zeros(3)])
    assert got.dtype == torch.float32 and got.shape == (4, 3) and not got.requires_grad
    torch.testing.assert_close(got, expected)  # float32 means of 3 rows: rounding only


def test_standalone_release_of_clustered_features_and_of_values():
    """With cluster assignments the clean centres (prototypes.clean_centres); features without labels are refused
    with a message; a tensor (or a function giving it) is released as a detached float32 CPU copy."""
    from raysim.privacy.prototypes import clean_centres

    g = torch.Generator().manual_seed(7)
    feats = torch.randn(6, 3, generator=g)
    labels = torch.tensor([0, 0, 1, 1, 1, 0])
    assign = torch.tensor([0, 1, 0, 0, 1, 1])
    h = NoDP()
    got = h.release("centres", features=feats, labels=labels, num_classes=2, assignments=assign)
    torch.testing.assert_close(got, clean_centres(feats, labels, assign))  # the same function on the same inputs
    with pytest.raises(AssertionError, match=r"^a prototype release needs the labels of its features$"):
        h.release("protos", features=feats, num_classes=2)
    value = torch.randn(2, 2, generator=g, dtype=torch.float64).requires_grad_(True)
    for given in (value, lambda: value):
        out = h.release("emb", given)
        assert out.dtype == torch.float32 and not out.requires_grad
        torch.testing.assert_close(out, value.detach().float())  # a cast copy
        out += 1.0
        torch.testing.assert_close(value.detach().float(), out - 1.0)  # the copy is not the tensor: value unchanged


def test_an_unlimited_budget_pulls_the_whole_batch_back_at_once():
    # budget_bytes=inf is "no limit": B rows per backward (inf // bytes is nan in Python, which max() turned into 1)
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    w = nn.Parameter(torch.ones(3))
    assert dpsgd_mod.auto_microbatch((x @ w) ** 2, budget_bytes=math.inf) == 6


def test_a_standalone_prototype_release_needs_the_class_count_of_its_labels():
    feats, labels = torch.randn(6, 2), torch.tensor([0, 1, 2, 0, 1, 2])
    for kw, shown in (({}, "num_classes=0, labels in [0, 2]"), ({"num_classes": 2}, "num_classes=2, labels in [0, 2]")):
        with pytest.raises(ValueError, match=re.escape(shown)):
            NoDP().release("protos", features=feats, labels=labels, **kw)
    with pytest.raises(ValueError, match=re.escape("labels in [-1, 2]")):
        NoDP().release("protos", features=feats, labels=labels - (labels == 1).long() * 2, num_classes=3)
    assert NoDP().release("protos", features=feats, labels=labels, num_classes=3).shape == (3, 2)
