"""The host's privacy handle without Ray (privacy/host.py): what `privacy.release(...)` returns and records
for each kind of release (prototypes, cluster centres, the one-shot embedding), the budget shares a method
splits dp.epsilon into (FedTSP's split and paper budgets), the seeded streams every release draws from, what
a client's privacy state keeps through a checkpoint, and the refusals that keep a release where it is
declared. The end-to-end runs (tests/methods/test_fedtsp_private.py) reach the same code through Ray; these
pin it with numbers computed independently."""

from __future__ import annotations

import math
import re

import pytest
import torch

from raysim.config import DPConfig
from raysim.errors import ConfigError, UploadViolation
from raysim.methods import TrainConfig, get_method
from raysim.privacy.accountant import analytic_gaussian_epsilon, calibrate_multiplier, classic_gaussian_multiplier
from raysim.privacy.host import HostPrivacy
from raysim.sampling import batch_indices, generator, poisson_batches

DELTA = 1e-5
SEED = 7


def fedtsp_host(dp, *, rounds=4, **opts):
    cls = get_method("fedtsp")
    method = cls(TrainConfig(batch_size=8, num_clients=3), cls.Options(**opts), dp)
    return method, HostPrivacy(dp=dp, method=method, seed=SEED, batch_size=8, releases_per_client=lambda cid: rounds)


def host_of(name, dp, *, rounds=3, batch_size=8, num_clients=3):
    cls = get_method(name)
    method = cls(TrainConfig(batch_size=batch_size, num_clients=num_clients), cls.Options(), dp)
    return method, HostPrivacy(dp=dp, method=method, seed=SEED, batch_size=batch_size,
                               releases_per_client=lambda cid: rounds)


def features_and_labels(n=24, d=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.arange(n) % classes


# ------------------------------------------------------------------------------------ budget shares
def test_fedtsp_split_calibrates_each_release_at_its_renormalised_share_of_epsilon():
    # dp_budget=split: the dp client's one embedding release and its T prototype releases each get their
    # share of dp.epsilon (renormalised over the releases it makes); a client that releases no embedding
    # spends its whole epsilon on its prototypes
    dp = DPConfig(epsilon=2.0, delta=DELTA)
    method, host = fedtsp_host(dp, rounds=4, dp_share_embedding=0.3, dp_share_prototypes=0.5)
    assert set(host.shares()) == {"text_emb", "protos"}
    eps_emb, eps_protos = 2.0 * 0.3 / 0.8, 2.0 * 0.5 / 0.8
    want_emb = calibrate_multiplier(epsilon=eps_emb, delta=DELTA, plan=[(1.0, 1)])
    want_protos = calibrate_multiplier(epsilon=eps_protos, delta=DELTA, plan=[(1.0, 4)])
    want_other = calibrate_multiplier(epsilon=2.0, delta=DELTA, plan=[(1.0, 4)])
    # the multipliers are the same floats the calibration gives, up to its own bisection tolerance
    assert host.multiplier(0, 24, "text_emb") == pytest.approx(want_emb, rel=1e-9)
    assert host.multiplier(0, 24, "protos") == pytest.approx(want_protos, rel=1e-9)
    assert host.multiplier(1, 24, "protos") == pytest.approx(want_other, rel=1e-9)
    assert want_emb > want_protos / 2 and want_other < want_protos  # the three are different numbers
    # calibrated once: kept in the client's state, per release
    assert set(host.state(0).multipliers) == {"text_emb", "protos"} and host.state(0).multiplier is None
    # a step (name=None) or a release without a share is refused with what to do
    with pytest.raises(ConfigError, match="has no share"):
        host.multiplier(0, 24)
    with pytest.raises(ConfigError, match="'counts' has no share"):
        host.multiplier(0, 24, "counts")


def test_fedtsp_split_spends_the_clients_whole_epsilon_over_its_run():
    dp = DPConfig(epsilon=2.0, delta=DELTA)
    _, host = fedtsp_host(dp, rounds=3)
    feats, labels = features_and_labels()
    emb = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    for r in range(3):
        h = host.open(0, r, 24, {})
        protos = h.release("protos", features=feats, labels=labels, num_classes=3)
        text = h.release("text_emb", value=emb, clip=2.5)
        h.close({"protos": protos, "text_emb": text, "counts": torch.ones(3)})
    ledger = host.ledger(0)
    kinds = [(r.mechanism, r.round, r.sample_rate, r.steps) for r in ledger.releases]
    # one embedding release (round 0 only: it is one-shot), one prototype release per round
    assert sorted(kinds) == sorted([("embedding", 0, 1.0, 1), ("igpp", 0, 1.0, 1), ("igpp", 1, 1.0, 1), ("igpp", 2, 1.0, 1)])
    # each share is calibrated to spend its half (1.0) alone; composed together by the ledger's accountant the
    # client spends more than either and at most their sum, the target (RDP composes tighter than adding)
    alone = [calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=plan) for plan in ([(1.0, 1)], [(1.0, 3)])]
    assert [r.sigma for r in ledger.releases if r.mechanism == "embedding"] == [pytest.approx(alone[0], rel=1e-9)]
    assert [r.sigma for r in ledger.releases if r.mechanism == "igpp"] == [pytest.approx(alone[1], rel=1e-9)] * 3
    assert 1.0 < ledger.epsilon() <= 2.0
    assert host.epsilon(0) == pytest.approx(ledger.epsilon(), rel=1e-12)


def test_fedtsp_paper_budget_is_the_classical_gaussian_at_the_whole_epsilon_with_its_exact_cost():
    # dp_budget=paper (fedtsp.txt Eq. 11): the embedding alone, sigma = sqrt(2 ln(1.25/delta)) / epsilon, and
    # the ledger records what that noise really spends (the analytic Gaussian epsilon at delta), with a note
    dp = DPConfig(epsilon=0.5, delta=DELTA)
    method, host = fedtsp_host(dp, rounds=4, dp_budget="paper")
    z = host.multiplier(0, 24, "text_emb")
    assert z == pytest.approx(math.sqrt(2 * math.log(1.25 / DELTA)) / 0.5, rel=1e-12)
    assert z == pytest.approx(classic_gaussian_multiplier(epsilon=0.5, delta=DELTA), rel=1e-12)
    rel = host.gaussian_release(0, "text_emb", "embedding", z, 3)
    assert (rel.mechanism, rel.sigma, rel.sample_rate, rel.steps, rel.round) == ("embedding", z, 1.0, 1, 3)
    assert rel.epsilon == pytest.approx(analytic_gaussian_epsilon(z, delta=DELTA), rel=1e-12)
    assert 0 < rel.epsilon < 0.5  # the classical bound is loose: the release costs less than the target
    assert rel.delta == pytest.approx(DELTA, rel=1e-12) and isinstance(rel.delta, float)
    assert rel.note and "description embedding only" in rel.note
    # a release the shares do not cover is an ordinary Gaussian entry: its epsilon is left to the accountant
    plain = host.gaussian_release(0, "protos", "igpp", 1.5, 2)
    assert (plain.mechanism, plain.sigma, plain.sample_rate, plain.steps, plain.round) == ("igpp", 1.5, 1.0, 1, 2)
    assert plain.epsilon is None and plain.delta == 0.0 and plain.note == ""
    # a split share is composed by the accountant and carries its note, if it has one
    from raysim.privacy.mechanisms.base import BudgetShare

    m, split = fedtsp_host(dp, rounds=4)
    s = split.gaussian_release(0, "text_emb", "embedding", 2.0, 0)
    assert s.epsilon is None and s.note == "" and s.round == 0
    m.budget_shares = lambda: {"text_emb": BudgetShare(0.5, note="the embedding only"), "protos": BudgetShare(0.5)}
    assert split.gaussian_release(0, "text_emb", "embedding", 2.0, 0).note == "the embedding only"
    # under the paper budget the class means are a public upload the client sends itself, not a host release
    with pytest.raises(UploadViolation, match="does not declare 'protos'"):
        host.open(1, 0, 24, {}).release("protos", features=torch.zeros(2, 3), labels=torch.zeros(2).long(), num_classes=1)


def test_fedtsp_paper_budget_refuses_a_classical_share_over_more_than_one_release():
    from raysim.privacy.mechanisms.base import BudgetShare

    dp = DPConfig(epsilon=0.5, delta=DELTA)
    method, host = fedtsp_host(dp, rounds=4, dp_budget="paper")
    # a method whose classical-Gaussian share is not its client's only private release is refused
    method.releases = {**type(method).releases}  # protos private again
    host2 = HostPrivacy(dp=dp, method=method, seed=SEED, batch_size=8, releases_per_client=lambda cid: 4)
    with pytest.raises(ConfigError, match="classical Gaussian calibration covers one release"):
        host2.multiplier(0, 24, "text_emb")
    # a share over a release with a pure-DP part (VPP's top-k) is refused, naming igpp
    dp_vpp = DPConfig(epsilon=0.5, delta=DELTA, prototypes="vpp")
    method3, _ = fedtsp_host(dp_vpp, rounds=4)
    method3.budget_shares = lambda: {"protos": BudgetShare(0.5), "text_emb": BudgetShare(0.5)}
    host3 = HostPrivacy(dp=dp_vpp, method=method3, seed=SEED, batch_size=8, releases_per_client=lambda cid: 4)
    with pytest.raises(ConfigError, match="use dp.prototypes=igpp"):
        host3.multiplier(0, 24, "protos")


# ------------------------------------------------------------------------------------- releases
def test_the_embedding_release_is_the_mechanism_applied_on_the_release_stream_and_made_once():
    from raysim.privacy.mechanisms.embedding_release import EmbeddingRelease

    dp = DPConfig(epsilon=1.0, delta=DELTA)
    _, host = fedtsp_host(dp, rounds=4)
    value = torch.randn(3, 5, generator=torch.Generator().manual_seed(2)) * 4  # norm > C: clipped
    calls = []

    def embed():
        calls.append(1)
        return value

    h = host.open(0, 1, 24, {})
    out = h.release("text_emb", embed, clip=2.5)
    z = host.multiplier(0, 24, "text_emb")
    want = EmbeddingRelease(dp).apply(value, clip=2.5, multiplier=z, generator=generator(SEED, "dp-release", "text_emb", 1, 0))
    # the same float64 draws scaled the same way: equal up to float32 rounding of the output
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert calls == [1] and out.shape == value.shape and out.dtype == value.dtype
    assert not torch.allclose(out, value)  # noised
    assert len(h.pending) == 1 and h.pending[0].mechanism == "embedding" and h.pending[0].sigma == pytest.approx(z, rel=1e-12)
    h.close({"text_emb": out})
    # the next round: the one-shot release is sent again as it was (post-processing), the function is not called
    h2 = host.open(0, 2, 24, {})
    again = h2.release("text_emb", embed, clip=2.5)
    assert calls == [1] and torch.equal(again, out) and h2.pending == []
    h2.close({"text_emb": again})
    assert len(host.ledger(0).releases) == 1
    # the release returned is a copy: changing it does not change what the host keeps
    again.add_(1.0)
    assert torch.equal(host.state(0).once["text_emb"], out)


def test_a_release_is_refused_unless_declared_as_host_made_and_needs_its_inputs():
    dp = DPConfig(epsilon=1.0, delta=DELTA)
    _, host = fedtsp_host(dp)
    h = host.open(0, 0, 24, {})
    with pytest.raises(UploadViolation, match="does not declare 'weights'"):
        h.release("weights", torch.zeros(2))
    with pytest.raises(UploadViolation, match="does not declare 'counts'"):  # a public upload the client sends itself
        h.release("counts", torch.zeros(3))
    feats, _ = features_and_labels()
    with pytest.raises(AssertionError, match="needs features and labels"):
        h.release("protos", features=feats, num_classes=3)
    with pytest.raises(AssertionError, match="needs a value"):
        h.release("text_emb", clip=2.5)
    # the class count bounds the labels; the embedding's clip radius is its sensitivity: both given, both valid
    labels = torch.arange(24) % 3
    for bad, shown in ((dict(), "num_classes=0, labels in [0, 2]"), (dict(num_classes=2), "num_classes=2, labels in [0, 2]")):
        with pytest.raises(ValueError, match=re.escape(shown)):
            h.release("protos", features=feats, labels=labels, **bad)
    with pytest.raises(ValueError, match=re.escape("labels in [-1, 2]")):
        h.release("protos", features=feats, labels=labels - (labels == 1).long() * 2, num_classes=3)
    assert h.release("protos", features=feats, labels=labels, num_classes=3).shape == (3, 6)  # the edge: max label 2
    for clip in (None, 0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="needs a clip radius C > 0"):
            h.release("text_emb", torch.ones(3, 5), **({} if clip is None else {"clip": clip}))
    assert h.release("text_emb", torch.ones(3, 5), clip=1e-6).shape == (3, 5)


def test_a_private_release_is_refused_from_a_client_that_does_not_make_it():
    # FedTSP's text embedding is released by dp_client only; from another client it would leave un-noised
    dp = DPConfig(epsilon=1.0, delta=DELTA)
    _, host = fedtsp_host(dp, dp_client=0)
    h = host.open(1, 0, 24, {})
    with pytest.raises(UploadViolation, match="client 1 does not release 'text_emb'"):
        h.release("text_emb", torch.randn(3, 5), clip=2.5)
    assert h.released == {} and h.pending == []


def test_dp_prototypes_are_the_mechanism_on_the_round_and_client_stream_and_dp_off_ones_are_the_clean_means():
    from raysim.privacy.mechanisms.igpp import IGPP

    feats, labels = features_and_labels()
    dp = DPConfig(epsilon=1.0, delta=DELTA)
    _, host = host_of("fedproto", dp, rounds=1)
    h = host.open(2, 5, 24, {})
    out = h.release("protos", features=feats, labels=labels, num_classes=3)
    z = host.multiplier(2, 24)
    want, _ = IGPP(dp).apply(feats, labels, 3, multiplier=z, generator=generator(SEED, "dp-release", "protos", 5, 2), rounds=1)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # the same draws: float32 rounding only
    assert h.pending[-1].round == 5 and h.pending[-1].sigma == pytest.approx(z, rel=1e-12)
    # another round or another client draws other noise
    other = host.open(1, 5, 24, {}).release("protos", features=feats, labels=labels, num_classes=3)
    assert not torch.allclose(other, out)
    # DP off: the class means, exactly what the features give
    _, clean_host = host_of("fedproto", DPConfig(), rounds=1)
    clean = clean_host.open(2, 5, 24, {}).release("protos", features=feats, labels=labels, num_classes=4)
    means = torch.stack([feats[labels == c].mean(0) for c in range(3)] + [torch.zeros(6)])
    torch.testing.assert_close(clean, means, rtol=1e-6, atol=1e-6)  # a mean of 8 rows: float32 summation order


def test_vpp_prototypes_are_its_mechanism_at_the_calibrated_rounds_with_its_pure_part_on_record():
    from raysim.privacy.mechanisms.vpp import VPP

    feats, labels = features_and_labels(n=30, classes=3)
    dp = DPConfig(epsilon=4.0, delta=DELTA, prototypes="vpp")
    _, host = host_of("fedproto", dp, rounds=1)  # calibrated for one release: VPP's top-k budget is eps1 / 1
    h = host.open(0, 0, 30, {})
    out = h.release("protos", features=feats, labels=labels, num_classes=3)
    z = host.multiplier(0, 30)
    want, extra = VPP(dp).apply(feats, labels, 3, multiplier=z, generator=generator(SEED, "dp-release", "protos", 0, 0), rounds=1)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # the same draws: float32 rounding only
    topk, gauss = h.pending
    assert topk.mechanism == "vpp_topk" and topk.epsilon == pytest.approx(extra["pure_epsilon"], rel=1e-12)
    assert extra["pure_epsilon"] > 0
    assert gauss.mechanism == "vpp" and gauss.sigma == pytest.approx(z, rel=1e-12)


def test_dp_prototypes_with_assignments_are_the_noised_cluster_centres():
    from raysim.privacy.mechanisms.igpp import IGPP

    feats, labels = features_and_labels(n=24, classes=2)
    assign = (torch.arange(24) // 2) % 2
    dp = DPConfig(epsilon=1.0, delta=DELTA)
    _, host = host_of("vpdr_fedplvm", dp, rounds=1)
    h = host.open(0, 0, 24, {})
    name = next(iter(n for n, spec in host.method.releases.items() if spec.kind == "prototype"))
    out = h.release(name, features=feats, labels=labels, num_classes=2, assignments=assign)
    z = host.multiplier(0, 24)
    want, _ = IGPP(dp).apply(feats, labels, 2, multiplier=z, generator=generator(SEED, "dp-release", name, 0, 0), rounds=1,
                             assignments=assign)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # the same draws: float32 rounding only
    plain, _ = IGPP(dp).apply(feats, labels, 2, multiplier=z, generator=generator(SEED, "dp-release", name, 0, 0), rounds=1)
    assert out.shape != plain.shape or not torch.allclose(out, plain)


def test_dp_off_cluster_centres_follow_the_assignments():
    # with `assignments`, the release is the (M, d) centres, class by class; DP off, the plain centre means
    feats, labels = features_and_labels(n=24, classes=2)
    assign = (torch.arange(24) // 2) % 2  # two clusters within each class
    _, host = host_of("fedproto", DPConfig(), rounds=1)
    h = host.open(0, 0, 24, {})
    centres = h.release("protos", features=feats, labels=labels, num_classes=2, assignments=assign)
    from raysim.privacy.dpsgd import NoDP

    want = NoDP().release("protos", features=feats, labels=labels, num_classes=2, assignments=assign)
    plain = NoDP().release("protos", features=feats, labels=labels, num_classes=2)
    torch.testing.assert_close(centres, want, rtol=0, atol=0)  # the same function on the same inputs
    assert centres.shape != plain.shape or not torch.allclose(centres, plain)


# --------------------------------------------------------------------------- batches, backward, state
@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
def test_the_rounds_batches_are_drawn_from_the_generator_given(sampling):
    from raysim.sampling import batches_per_epoch

    _, host = host_of("promptfl", DPConfig(epsilon=1.0, sampling=sampling))
    h = host.open(0, 0, 40, {"ctx": torch.zeros(2, 3)})
    got = [b.tolist() for b in h.batches(40, 8, torch.Generator().manual_seed(11))]
    g = torch.Generator().manual_seed(11)
    ref = poisson_batches(40, 8, g, batches_per_epoch(40, 8)) if sampling == "poisson" else batch_indices(40, 8, g)
    assert got == [b.tolist() for b in ref]
    # and a DP-off round shuffles fixed-size batches from it
    _, off = host_of("promptfl", DPConfig())
    got_off = [b.tolist() for b in off.open(0, 0, 40, {}).batches(40, 8, torch.Generator().manual_seed(11))]
    assert got_off == [b.tolist() for b in batch_indices(40, 8, torch.Generator().manual_seed(11))]


def test_a_dp_off_backward_gives_every_tensor_the_gradient_of_the_mean_loss_plus_the_public_loss():
    _, host = host_of("promptfl", DPConfig())
    h = host.open(0, 0, 16, {})
    g = torch.Generator().manual_seed(0)
    x, ctx0, w0 = torch.randn(6, 4, generator=g), torch.randn(4, generator=g), torch.randn(4, generator=g)
    ctx, w = ctx0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    h.backward((x @ ctx) ** 2 + x @ w, dp_params={"ctx": ctx}, other_params=[w], public_loss=(ctx * w).sum())
    c2, w2 = ctx0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    (((x @ c2) ** 2 + x @ w2).mean() + (c2 * w2).sum()).backward()
    # the same few float32 products summed in another order: a few ulps
    torch.testing.assert_close(ctx.grad, c2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)


def test_a_clients_privacy_state_survives_a_checkpoint_and_an_abandoned_round_is_undone():
    dp = DPConfig(epsilon=2.0, delta=DELTA)
    _, host = fedtsp_host(dp, rounds=3)
    feats, labels = features_and_labels()
    h = host.open(0, 0, 24, {})
    h.close({"protos": h.release("protos", features=feats, labels=labels, num_classes=3),
             "text_emb": h.release("text_emb", torch.randn(3, 5), clip=2.5), "counts": torch.ones(3)})
    saved = host.snapshot(0)
    fresh = fedtsp_host(dp, rounds=3)[1]
    fresh.load(0, saved)
    st, st0 = fresh.state(0), host.state(0)
    assert st.multipliers == st0.multipliers and set(st.multipliers) == {"text_emb", "protos"}
    assert torch.equal(st.once["text_emb"], st0.once["text_emb"])
    assert fresh.epsilon(0) == pytest.approx(host.epsilon(0), rel=1e-12)
    # restore(None): the client had no state before the abandoned round (also when it never had one)
    host.restore(0, None)
    assert 0 not in host.states
    host.restore(2, None)
    assert 2 not in host.states
    # restore(snapshot): back to the snapshot, not to what the round changed since
    fresh.state(0).multipliers["protos"] = 99.0
    fresh.restore(0, saved)
    assert fresh.state(0).multipliers == st0.multipliers


# ------------------------------------------------------------------- from the stepper scope's survivors
def test_a_share_is_calibrated_under_the_runs_accountant_and_conversion():
    # dp.accountant / dp.conversion reach a share's calibration (not only the one-multiplier path)
    for dp in (DPConfig(epsilon=2.0, delta=DELTA, accountant="prv"), DPConfig(epsilon=2.0, delta=DELTA, conversion="classic")):
        _, host = fedtsp_host(dp, rounds=4)
        want = calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=[(1.0, 4)], accountant=dp.accountant, conversion=dp.conversion)
        plain = calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=[(1.0, 4)])
        assert host.multiplier(0, 24, "protos") == pytest.approx(want, rel=1e-9)
        assert abs(want - plain) > 1e-3 * plain  # the setting matters at these values


def test_the_refusals_of_a_share_name_what_to_do():
    dp = DPConfig(epsilon=2.0, delta=DELTA)
    _, host = fedtsp_host(dp, rounds=4)
    with pytest.raises(ConfigError, match=re.escape("every private release (protos, text_emb) needs one")):
        host.multiplier(0, 24)
    dp_vpp = DPConfig(epsilon=0.5, delta=DELTA, prototypes="vpp")
    method, _ = fedtsp_host(dp_vpp, rounds=4)
    host2 = HostPrivacy(dp=dp_vpp, method=method, seed=SEED, batch_size=8, releases_per_client=lambda cid: 4)
    with pytest.raises(ConfigError, match=r"spends dp\.epsilon itself\); use dp\.prototypes=igpp$"):
        host2.multiplier(0, 24, "protos")
    # under the paper budget a client that makes no embedding release holds no share: asking for one is refused
    _, paper = fedtsp_host(DPConfig(epsilon=0.5, delta=DELTA), rounds=4, dp_budget="paper")
    with pytest.raises(ConfigError, match="covers one release that is the client's only private one"):
        paper.multiplier(1, 24, "text_emb")


def test_a_method_splits_its_budget_only_when_dp_is_on():
    _, off = fedtsp_host(DPConfig(), rounds=4)
    assert off.shares() is None
    _, on = fedtsp_host(DPConfig(epsilon=1.0, delta=DELTA), rounds=4, dp_budget="joint")
    assert on.shares() is None  # joint: one multiplier for every release


def test_the_paper_budgets_embedding_release_is_recorded_at_its_exact_cost_and_a_shares_note_follows_its_release():
    from raysim.privacy.mechanisms.base import BudgetShare

    _, host = fedtsp_host(DPConfig(epsilon=0.5, delta=DELTA), rounds=4, dp_budget="paper")
    h = host.open(0, 2, 24, {})
    h.release("text_emb", torch.randn(3, 5), clip=2.5)
    (rel,) = h.pending
    z = host.multiplier(0, 24, "text_emb")
    assert rel.epsilon == pytest.approx(analytic_gaussian_epsilon(z, delta=DELTA), rel=1e-12) and rel.note
    method, split = fedtsp_host(DPConfig(epsilon=2.0, delta=DELTA), rounds=4)
    method.budget_shares = lambda: {"text_emb": BudgetShare(0.5), "protos": BudgetShare(0.5, note="class means")}
    feats, labels = features_and_labels()
    h2 = split.open(0, 0, 24, {})
    h2.release("protos", features=feats, labels=labels, num_classes=3)
    assert [r.note for r in h2.pending] == ["class means"]


def test_a_dp_off_embedding_release_is_the_value_itself():
    _, host = fedtsp_host(DPConfig(), rounds=4)
    value = torch.randn(3, 5)
    out = host.open(0, 0, 24, {}).release("text_emb", value)
    torch.testing.assert_close(out, value, rtol=0, atol=0)  # a copy of the same floats
    assert out.data_ptr() != value.data_ptr()


def test_vpps_top_k_part_is_recorded_as_a_pure_release_of_its_round():
    feats, labels = features_and_labels(n=30, classes=3)
    _, host = host_of("fedproto", DPConfig(epsilon=4.0, delta=DELTA, prototypes="vpp"), rounds=2)
    h = host.open(0, 3, 30, {})
    h.release("protos", features=feats, labels=labels, num_classes=3)
    topk = h.pending[0]
    assert (topk.sigma, topk.sample_rate, topk.steps, topk.round, topk.delta) == (0.0, 1.0, 1, 3, 0.0)
    # the plan takes the pure part as its share of dp.epsilon (4.0 here: a share times 4, not over 4)
    from raysim.privacy.mechanisms.vpp import VPP

    share = VPP(host.dp).plan(num_train=30, steps_per_round=1, batch_size=8).pure_share
    entries, pure, rounds = host.plan(0, 30)
    assert pure == pytest.approx(share * 4.0, rel=1e-12) and 0 < share < 1 and rounds == 2


def test_a_prototype_release_is_checked_against_the_clients_own_ledger():
    # calibrated for one release, a client's second one would take it past its budget: refused before it leaves
    from raysim.privacy.ledger import PrivacyBudgetExceeded

    feats, labels = features_and_labels()
    _, host = host_of("fedproto", DPConfig(epsilon=1.0, delta=DELTA), rounds=1)
    h = host.open(0, 0, 24, {})
    h.close({"protos": h.release("protos", features=feats, labels=labels, num_classes=3), "counts": torch.ones(3)})
    with pytest.raises(PrivacyBudgetExceeded, match="igpp release in round 1"):
        host.open(0, 1, 24, {}).release("protos", features=feats, labels=labels, num_classes=3)
    host.open(1, 1, 24, {}).release("protos", features=feats, labels=labels, num_classes=3)  # another client: its own


def test_prototype_releases_at_their_class_count_edges():
    _, host = host_of("fedproto", DPConfig(), rounds=1)
    h = host.open(0, 0, 24, {})
    out = h.release("protos", features=torch.randn(5, 4), labels=torch.zeros(5).long(), num_classes=1)
    assert out.shape == (1, 4)  # one class is a valid class count
    empty = h.release("protos", features=torch.zeros(0, 4), labels=torch.zeros(0).long(), num_classes=1)
    torch.testing.assert_close(empty, torch.zeros(1, 4), rtol=0, atol=0)  # no examples: the class is 0


def test_the_refusal_of_a_release_a_client_does_not_make_says_why():
    _, host = fedtsp_host(DPConfig(epsilon=1.0, delta=DELTA), dp_client=0)
    with pytest.raises(UploadViolation, match=r"a private release is made only by the clients that declare it$"):
        host.open(2, 0, 24, {}).release("text_emb", torch.randn(3, 5), clip=2.5)


def test_a_joint_mechanism_is_planned_once_and_the_releases_after_it_still_count():
    from raysim.privacy.mechanisms.base import dpsgd, prototype

    cls = get_method("promptfl")
    stub = type("TwoTensorsAndProtos", (cls,), {"releases": {"a": dpsgd(), "b": dpsgd(), "protos": prototype()}})
    dp = DPConfig(epsilon=1.0, delta=DELTA)
    method = stub(TrainConfig(batch_size=8, num_clients=2), cls.Options(), dp)
    host = HostPrivacy(dp=dp, method=method, seed=SEED, batch_size=8, releases_per_client=lambda cid: 3)
    entries, pure, rounds = host.plan(0, 40)
    steps = method.dp_steps_per_round(40)
    assert entries == [(pytest.approx(0.2), steps * 3), (1.0, 3)] and pure == 0.0 and rounds == 3


def test_the_client_level_update_release_is_the_mechanism_on_the_update_stream_around_the_broadcast():
    from raysim.privacy.mechanisms.client_update import ClientUpdate

    dp = DPConfig(epsilon=1.0, delta=DELTA, level="client", clip=0.5)
    per_client = {0: 2, 1: 5}
    cls = get_method("lgfedavg")
    method = cls(TrainConfig(batch_size=8, num_clients=2), cls.Options(), dp)
    host = HostPrivacy(dp=dp, method=method, seed=SEED, batch_size=8, releases_per_client=per_client.__getitem__)
    g = torch.Generator().manual_seed(4)
    names = host._private_names(1)
    shared = {k: torch.randn(3, 2, generator=g) for k in names}
    trained = {k: v + torch.randn(3, 2, generator=g) for k, v in shared.items()}
    h = host.open(1, 6, 24, shared)
    out = h.close(dict(trained))
    z = host.multiplier(1, 24)
    assert z == pytest.approx(calibrate_multiplier(epsilon=1.0, delta=DELTA, plan=[(1.0, 5)]), rel=1e-9)  # its 5, not 2
    noisy = ClientUpdate(dp).apply({k: trained[k] - shared[k] for k in names}, multiplier=z,
                                   generator=generator(SEED, "dp-update", 6, 1))
    for k in names:  # base + noised(update): float32 sums in the same order
        torch.testing.assert_close(out[k], shared[k] + noisy[k], rtol=1e-6, atol=1e-6)
    (rel,) = host.ledger(1).releases
    assert (rel.mechanism, rel.round, rel.sample_rate, rel.steps) == ("client_update", 6, 1.0, 1)
    assert rel.sigma == pytest.approx(z, rel=1e-12)
    # an update-released tensor that is not an update of a broadcast tensor is refused
    for bad_shared in ({}, {k: torch.zeros(4, 2) for k in names}):
        with pytest.raises(UploadViolation, match="is released as an update but is not an update of a broadcast tensor"):
            host.open(0, 6, 24, bad_shared).close(dict(trained))


def test_the_pure_parts_of_several_releases_add_up_in_the_plan():
    from raysim.privacy.mechanisms.base import prototype
    from raysim.privacy.mechanisms.vpp import VPP

    cls = get_method("fedproto")
    stub = type("TwoPrototypeReleases", (cls,), {"releases": {"protos": prototype(), "more": prototype()}})
    dp = DPConfig(epsilon=4.0, delta=DELTA, prototypes="vpp")
    method = stub(TrainConfig(batch_size=8, num_clients=2), cls.Options(), dp)
    host = HostPrivacy(dp=dp, method=method, seed=SEED, batch_size=8, releases_per_client=lambda cid: 3)
    share = VPP(dp).plan(num_train=30, steps_per_round=1, batch_size=8).pure_share
    entries, pure, _ = host.plan(0, 30)
    assert pure == pytest.approx(2 * share * 4.0, rel=1e-12) and entries == [(1.0, 3), (1.0, 3)]


def test_a_round_trains_under_dp_sgd_only_the_uploads_its_own_client_declares():
    # releases_of is per client: a client that does not upload the DP-SGD-trained tensor runs no DP-SGD
    cls = get_method("promptfl")
    stub = type("FirstClientOnly", (cls,), {"releases_of": lambda self, cid: ["ctx"] if cid == 0 else []})
    dp = DPConfig(epsilon=1.0, delta=DELTA)
    method = stub(TrainConfig(batch_size=8, num_clients=2), cls.Options(), dp)
    host = HostPrivacy(dp=dp, method=method, seed=SEED, batch_size=8, releases_per_client=lambda cid: 3)
    first, second = host.open(0, 0, 40, {"ctx": torch.zeros(2, 3)}), host.open(1, 0, 40, {"ctx": torch.zeros(2, 3)})
    assert first.enabled and first.trained_by == ["ctx"] and first.stepper.sigma > 0
    assert not second.enabled and second.trained_by == []
