"""Worked examples for the ProtoPFL frameworks of SPEC 3.5 (FedPCL, FPL, FedPLVM, FedTGP, MPFT) and
the FINCH clustering FPL / FedPLVM use: small tensors whose values are computed by hand in the comments.

Tolerances: expected values are written to 6 decimals, so comparisons allow 1e-5 (the rounding of the
hand computation), unless the check is exact by construction (integer partitions, masks)."""

from __future__ import annotations

import math

import pytest
import torch

from raysim.methods.fedtsp.fedtgp import PrototypeGenerator, margin_loss
from raysim.methods.vpdr import finch as fn
from raysim.methods.vpdr import vpdr_fedpcl as pcl
from raysim.methods.vpdr import vpdr_fedplvm as plvm
from raysim.methods.vpdr import vpdr_fedtgp as tgp
from raysim.methods.vpdr import vpdr_fpl as fpl
from raysim.methods.vpdr import vpdr_mpft as mpft

TOL = 1e-5  # the hand values below are rounded to 6 decimals


def unit(*degrees: float) -> torch.Tensor:
    """Unit vectors in the plane at the given angles: cosine distance is 1 - cos(angle between)."""
    r = torch.tensor(degrees, dtype=torch.float64) * math.pi / 180
    return torch.stack([r.cos(), r.sin()], dim=1)


# ------------------------------------------------------------------------------------------ FINCH


def test_first_neighbour_graph_links_neighbours_and_siblings():
    # A = 0deg, B = 10deg, C = 30deg: kappa_A = B, kappa_B = A (10 < 20 deg), kappa_C = B (20 < 30 deg).
    # A(A,B) = [kA=B] + [kB=A] = 2 (mutual); A(B,C) = [kC=B] = 1; A(A,C) = [kA = kC = B] = 1.
    kappa = fn.first_neighbours(fn.cosine_distances(unit(0, 10, 30)))
    assert kappa.tolist() == [1, 0, 1]
    assert fn.first_neighbour_graph(kappa).tolist() == [[0, 2, 1], [2, 0, 1], [1, 1, 0]]


def test_finch_worked_example_with_and_without_early_exit():
    # Pairs at 0/4, 20/24, 100/104, 120/124 deg. Level 0: each point's first neighbour is its partner
    # (4 deg away; the next point is >= 16 deg away): 4 clusters, all mutual pairs (weight 2), so the
    # early-exit threshold is t = 2 (1 - cos 4deg) = 0.004872.
    # Level 1: means at 2, 22, 102, 122 deg; first neighbours 2<->22 and 102<->122 (20 deg), mutual,
    # d * A = 2 (1 - cos 20deg) = 0.120615 > t: with early exit every edge is cut, nothing merges, the
    # level is dropped and the coarsest partition is level 0. Without: 2 clusters; level 2 (means at
    # 12 and 112 deg) merges into 1 cluster and is dropped.
    x = unit(0, 4, 20, 24, 100, 104, 120, 124)
    assert [p.tolist() for p in fn.finch(x)] == [[0, 0, 1, 1, 2, 2, 3, 3]]
    assert [p.tolist() for p in fn.finch(x, early_exit=False)] == [[0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1]]
    # the centres are means of the original points: {0, 4deg} -> ((1 + cos 4) / 2, sin 4 / 2)
    centres, sizes, labels = fn.finch_centres(x.float())
    assert sizes.tolist() == [2, 2, 2, 2] and labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.allclose(centres[0].double(), torch.tensor([0.998782, 0.034878], dtype=torch.float64), atol=TOL)


def test_finch_small_inputs_and_label_order():
    assert [p.tolist() for p in fn.finch(unit(10))] == [[0]]
    assert fn.finch_coarsest(unit(0, 50)).tolist() == [0, 0]  # two points are each other's first neighbour
    # components are numbered by their smallest member: the group holding point 0 is cluster 0
    assert fn.finch_coarsest(unit(100, 0, 104, 4)).tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError):
        fn.finch(torch.zeros(0, 2))


# ----------------------------------------------------------------------------------------- FedPCL


def test_fedpcl_server_step_means_over_holders_and_fills_missing_classes():
    # client 0 holds classes 0, 1; client 1 holds class 0 only (its class-1 row is junk); nobody holds 2.
    protos = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [5.0, 5.0]], [[4.0, 2.0], [9.0, 9.0], [7.0, 7.0]]])
    counts = torch.tensor([[5.0, 1.0, 0.0], [3.0, 0.0, 0.0]])
    glob, has, filled = pcl.fedpcl_aggregate(protos, counts)
    # unweighted: P0 = ((2,0) + (4,2)) / 2 = (3, 1) whatever the counts; P1 = (0, 2); P2 = 0 (no holder)
    assert torch.allclose(glob, torch.tensor([[3.0, 1.0], [0.0, 2.0], [0.0, 0.0]]))
    assert has.tolist() == [True, True, False]
    # client 1's missing class 1 is the global (0, 2); its own class 0 stays (4, 2)
    assert torch.allclose(filled[1, :2], torch.tensor([[4.0, 2.0], [0.0, 2.0]]))
    assert torch.allclose(filled[0, :2], protos[0, :2])


def test_fedpcl_client_loss_worked_example():
    # f1 = (1, 0) of class 0, f2 = (0, 2) of class 1; class 2 has no prototype (masked out). tau = 1 here
    # so the values are not vanishingly small. For two live classes CE = softplus(cos_other - cos_true).
    # L_g vs P = {(3,1), (0,2)}: f1: softplus(0 - 3/sqrt10) = 0.327324, f2: softplus(1/sqrt10 - 1) = 0.408600;
    #   mean 0.367962.
    # L_p: client 0 {(2,0), (0,2)}: both samples softplus(-1) = 0.313262;
    #   client 1 {(4,2), (0,2)}: f1 softplus(-4/sqrt20) = 0.342768, f2 softplus(2/sqrt20 - 1) = 0.454474,
    #   mean 0.398621; L_p = (0.313262 + 0.398621) / 2 = 0.355941.
    feats = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    y = torch.tensor([0, 1])
    glob = torch.tensor([[3.0, 1.0], [0.0, 2.0], [0.0, 0.0]])
    has = torch.tensor([True, True, False])
    clients = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]], [[4.0, 2.0], [0.0, 2.0], [0.0, 0.0]]])
    lg, lp, logits = pcl.fedpcl_losses(feats, y, glob, has, clients, tau=1.0)
    assert abs(float(lg) - 0.367962) < TOL
    assert abs(float(lp) - 0.355941) < TOL
    assert logits.argmax(1).tolist() == [0, 1] and bool((logits[:, 2] < -1e3).all())
    assert pcl.TAU == 0.07  # the paper's table


def test_fedpcl_tests_by_nearest_local_prototype():
    local = torch.tensor([[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    has = torch.tensor([True, True, False])  # the client has no class-2 examples: never predicted
    logits = pcl.nearest_prototype_logits(torch.tensor([[3.0, 1.0], [1.0, 3.0], [-1.0, -1.0]]), local, has)
    assert logits.argmax(1).tolist() == [0, 1, 0]  # (-1,-1) is 135 deg from both: first index on the tie


# -------------------------------------------------------------------------------------------- FPL


def fpl_uploads() -> tuple[torch.Tensor, torch.Tensor]:
    # 4 clients, 2 classes: class 0 at 0, 5, 80, 90 deg; class 1 held by clients 0 and 1 at 180, 190 deg.
    protos = torch.zeros(4, 2, 2)
    protos[:, 0] = unit(0, 5, 80, 90).float()
    protos[:2, 1] = unit(180, 190).float()
    counts = torch.tensor([[10.0, 10.0], [10.0, 10.0], [10.0, 0.0], [10.0, 0.0]])
    return protos, counts


def test_fpl_server_step_clusters_each_class_and_averages_the_centres():
    # Class 0: FINCH pairs {0, 5deg} and {80, 90deg} (level 1 would merge the two: 1 cluster, dropped), so
    # centres c_a = ((1 + cos5) / 2, sin5 / 2) = (0.998097, 0.043578) and
    # c_b = (cos80 / 2, (sin80 + 1) / 2) = (0.086824, 0.992404); unbiased u_0 = (0.542461, 0.517991).
    # Class 1: two points -> one cluster, centre ((-1 + cos190) / 2, sin190 / 2) = (-0.992404, -0.086824).
    # 6 uploads: with cluster_rate 1, int(6) > 1 so FINCH runs.
    protos, counts = fpl_uploads()
    out = fpl.fpl_aggregate(protos, counts, cluster_rate=1.0)
    assert out["centre_labels"].tolist() == [0, 0, 1]
    want = torch.tensor([[0.998097, 0.043578], [0.086824, 0.992404], [-0.992404, -0.086824]])
    assert torch.allclose(out["centres"], want, atol=TOL)
    assert torch.allclose(out["unbiased"], torch.tensor([[0.542461, 0.517991], [-0.992404, -0.086824]]), atol=TOL)
    assert out["has"].tolist() == [True, True]
    # the code's default cluster_rate 0.1: int(0.6) = 0 -> max(1, 0) = 1 cluster -> plain mean per class
    plain = fpl.fpl_aggregate(protos, counts)
    assert plain["centre_labels"].tolist() == [0, 1]
    assert torch.allclose(plain["centres"][0], protos[:, 0].mean(0), atol=1e-6)
    assert fpl.finch_active(20) and not fpl.finch_active(19)


def test_fpl_client_loss_worked_example():
    # f = (1, 0) of class 0 against the centres above, tau = 1: cosines cos2.5 = 0.999048 and
    # cos85 = 0.087156 (positives), cos185 = -0.996195 (negative).
    # InfoNCE = log(1 + e^-0.996195 / (e^0.999048 + e^0.087156)) = 0.092585.
    # MSE(f, u_0) = ((1 - 0.542461)^2 + 0.517991^2) / 2 = 0.238828.
    centres = torch.tensor([[0.998097, 0.043578], [0.086824, 0.992404], [-0.992404, -0.086824]])
    labels = torch.tensor([0, 0, 1])
    unbiased = torch.tensor([[0.542461, 0.517991], [-0.992404, -0.086824], [0.0, 0.0]])
    has = torch.tensor([True, True, False])
    contra, mse = fpl.fpl_losses(torch.tensor([[1.0, 0.0]]), torch.tensor([0]), centres, labels, unbiased, has, tau=1.0)
    assert abs(float(contra) - 0.092585) < TOL
    assert abs(float(mse) - 0.238828) < TOL
    # a batch with a class nobody uploaded (2): no MSE at all (the all-labels rule), and that sample adds
    # no InfoNCE term, so the InfoNCE is the first sample's alone
    contra2, mse2 = fpl.fpl_losses(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 2]), centres, labels, unbiased,
                                   has, tau=1.0)
    assert abs(float(contra2) - 0.092585) < TOL and float(mse2) == 0.0
    assert (fpl.TAU, fpl.CONTRA_WEIGHT, fpl.MSE_WEIGHT) == (0.07, 0.5, 0.5)


# ---------------------------------------------------------------------------------------- FedPLVM


def test_fedplvm_local_centres_and_server_step():
    # one client's class-0 features at 0, 5, 80, 90 deg -> FINCH clusters {0, 5} and {80, 90};
    # its single class-1 example is its own centre
    feats = torch.cat([unit(0, 5, 80, 90), unit(180)]).float()
    labels = torch.tensor([0, 0, 0, 0, 1])
    assert plvm.local_assignments(feats, labels).tolist() == [0, 0, 1, 1, 0]
    # the server clusters all uploaded class-c centres again: here the FPL example's points as centres
    protos, counts = fpl_uploads()
    held = counts > 0
    g, gy = plvm.fedplvm_aggregate(protos[held], held.nonzero()[:, 1], 2, cluster_rate=1.0)
    assert gy.tolist() == [0, 0, 1]
    assert torch.allclose(g[0], torch.tensor([0.998097, 0.043578]), atol=TOL)


def test_fedplvm_client_loss_worked_example():
    # f = (1, 0) of class 0; global centres: class 0 at 0 and 60 deg, class 1 at 180 deg; tau = 1.
    # cos = (1, 0.5, -1), clamped to +-(1 - 1e-6); s_alpha = sign * |cos|^0.25 = (0.99999975, 0.840896, -0.99999975).
    # lse = log(e^s1 + e^s2 + e^s3) = log(2.718281 + 2.318437 + 0.367880) = 1.687250;
    # L_contra = ((lse - s1) + (lse - s2)) / 2 = 0.766803; L_corr = |s1 + s2 - 2| = 0.159104.
    centres = unit(0, 60, 180).float()
    contra, corr = plvm.fedplvm_losses(torch.tensor([[1.0, 0.0]]), torch.tensor([0]), centres, torch.tensor([0, 0, 1]), tau=1.0)
    assert abs(float(contra) - 0.766803) < TOL
    assert abs(float(corr) - 0.159104) < TOL
    # a sample whose class has no centre adds 0 to both terms but counts in the batch mean (as coded)
    contra2, corr2 = plvm.fedplvm_losses(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 2]), centres,
                                         torch.tensor([0, 0, 1]), tau=1.0)
    assert abs(float(contra2) - 0.766803 / 2) < TOL and abs(float(corr2) - 0.159104 / 2) < TOL
    assert (plvm.ALPHA, plvm.TAU, plvm.WEIGHT) == (0.25, 0.07, 0.5)


# ----------------------------------------------------------------------------------------- FedTGP


def test_fedtgp_margin_worked_example():
    # class averages (1, 0) (from (0,0) and (2,0)) and (0, 3); class 2 uploaded by nobody.
    # gap_0 = gap_1 = sqrt(1 + 9) = 3.162278 -> margin = min(3.162278, 100); capped at 2 with threshold 2.
    protos = torch.tensor([[[0.0, 0.0], [0.0, 3.0], [0.0, 0.0]], [[2.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    counts = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    from raysim.methods.families.prototype import aggregate_prototypes

    avg, has = aggregate_prototypes(protos, counts, "uniform")
    assert abs(tgp.vpdr_margin(avg, has) - 3.162278) < TOL
    assert tgp.vpdr_margin(avg, has, 2.0) == 2.0
    # one class only: every gap is the code's 1e9 sentinel, so the margin is the threshold
    assert tgp.vpdr_margin(avg, torch.tensor([True, False, False])) == 100.0


def test_fedtgp_margin_loss_worked_example():
    # p = (0, 0) of class 0, G = {(1, 0), (0, 1)}, margin 1: distances (1, 1) + margin on the true class
    # = (2, 1); CE(-(2, 1), 0) = log(1 + e^1) = 1.313262.
    loss = margin_loss(torch.zeros(1, 2), torch.tensor([0]), torch.eye(2), 1.0)
    assert abs(float(loss) - 1.313262) < TOL


def test_fedtgp_server_step_is_one_sgd_step_per_batch_at_the_given_lr():
    torch.manual_seed(0)  # only builds the generator's initial weights for this test
    g = PrototypeGenerator(3, 4, 4)
    ref = PrototypeGenerator(3, 4, 4)
    ref.load_state_dict(g.state_dict())
    protos = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    counts = torch.tensor([[2.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out, margin, loss = tgp.tgp_aggregate(g, protos, counts, epochs=1, lr=1e-3, batch_size=64, rng=torch.Generator().manual_seed(2))
    # one epoch, one batch holding all four (client, class) pairs: G' = G - lr * grad of the margin loss
    held = counts > 0
    want_loss = margin_loss(protos[held], held.nonzero()[:, 1], ref(), margin)
    want_loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 1e-3 * p.grad
        want = ref()
    assert abs(float(loss) - float(want_loss.detach())) < 1e-6  # same float32 computation, order of batch aside
    assert torch.allclose(out, want, atol=1e-6)
    assert (tgp.LAMBDA, tgp.SERVER_EPOCHS, tgp.MARGIN_THRESHOLD) == (1.0, 100, 100.0)


# ------------------------------------------------------------------------------------------- MPFT


def test_mpft_adapter_starts_as_identity_with_the_spec_width():
    a = mpft.LinearAdapter(512)
    assert a.down.weight.shape == (64, 512) and a.up.bias is None and a.down.bias is None
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(a.train()(x), x)  # W_up = 0: the residual branch adds exactly 0


def test_mpft_kd_worked_example():
    # T = 4, teacher logits (4 ln 3, 0) -> softmax(t / 4) = (3/4, 1/4); student (0, 0) -> (1/2, 1/2).
    # KL = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.130812; times T^2 = 16: 2.092993.
    kd = mpft.mpft_kd(torch.zeros(1, 2), torch.tensor([[4 * math.log(3.0), 0.0]]))
    assert abs(float(kd) - 2.092993) < TOL
    assert (mpft.KD_T, mpft.KD_WEIGHT) == (4.0, 0.3)


def test_mpft_server_step_worked_example():
    # Head Linear(2, 2) at zero, adapter at init (identity), prototypes (1, 0) of class 0 and (0, 1) of
    # class 1, one epoch, one batch. Logits 0 -> softmax (1/2, 1/2), loss ln 2 = 0.693147.
    # dL/dlogits: sample 1 (-1/2, 1/2), sample 2 (1/2, -1/2); grad W = mean of dlogits^T p =
    # [[-1/4, 1/4], [1/4, -1/4]], grad b = 0. First SGD step (momentum buffer = grad, weight decay on
    # zero weights adds 0): W' = -1e-3 * grad = [[2.5e-4, -2.5e-4], [-2.5e-4, 2.5e-4]]. The adapter's
    # gradients are 0 (the head's input gradient is W^T (.) = 0), so only weight decay moves it:
    # W_down' = (1 - 1e-3 * 5e-4) W_down, and W_up stays 0.
    # float64 so that the 5e-7 relative weight-decay step is far above rounding (rtol 1e-12 below)
    head = torch.nn.Linear(2, 2).double()
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    adapter = mpft.LinearAdapter(2, reduction=1).double()
    before = adapter.down.weight.detach().clone()
    protos = torch.eye(2, dtype=torch.float64)
    loss = mpft.server_finetune(head, adapter, protos, torch.tensor([0, 1]), epochs=1, rng=torch.Generator().manual_seed(0))
    assert abs(float(loss) - 0.693147) < TOL
    want = torch.tensor([[2.5e-4, -2.5e-4], [-2.5e-4, 2.5e-4]], dtype=torch.float64)
    assert torch.allclose(head.weight, want, rtol=1e-12, atol=1e-15)
    assert torch.allclose(head.bias, torch.zeros(2, dtype=torch.float64))
    assert torch.allclose(adapter.down.weight, before * (1 - 1e-3 * 5e-4), rtol=1e-12, atol=0)
    assert not torch.equal(adapter.down.weight, before) and not adapter.up.weight.any()
    assert (mpft.SERVER_EPOCHS, mpft.SERVER_LR, mpft.SERVER_BATCH, mpft.MILESTONES) == (20, 1e-3, 64, (20, 40))


def test_mpft_server_step_is_reproducible_and_can_freeze_the_adapter():
    def run(train_adapter: bool):
        torch.manual_seed(0)  # builds the same initial modules for both runs
        head, adapter = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 3)), mpft.LinearAdapter(8, 2)
        torch.nn.init.normal_(adapter.up.weight)
        protos = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
        labels = torch.arange(10) % 3
        mpft.server_finetune(head, adapter, protos, labels, epochs=3, batch_size=4, rng=torch.Generator().manual_seed(5),
                             train_adapter=train_adapter)
        return head.state_dict(), adapter.state_dict()

    h1, a1 = run(True)
    h2, a2 = run(True)
    assert all(torch.equal(h1[k], h2[k]) for k in h1) and all(torch.equal(a1[k], a2[k]) for k in a1)
    _, a3 = run(False)
    torch.manual_seed(0)
    torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 3))
    init = mpft.LinearAdapter(8, 2)
    assert torch.equal(a3["down.weight"], init.down.weight)  # not in the optimiser: untouched


def test_clustered_release_stacks_centres_class_by_class():
    # class 0: clusters {(0,0), (2,0)} -> (1, 0) and {(0,4)} -> (0, 4); class 1: one cluster {(6,6)}.
    # DP off, the release is the clean centres in (class, cluster id) order; under IGPP with sigma 0 the
    # features are first clipped to R = 3: (0,4) -> (0,3), (6,6) -> (3/sqrt2, 3/sqrt2) = (2.121320, 2.121320).
    from raysim.privacy.dpsgd import NoDP
    from raysim.privacy.prototypes import igpp_release, stack_centres

    feats = torch.tensor([[0.0, 0.0], [6.0, 6.0], [2.0, 0.0], [0.0, 4.0]])
    labels = torch.tensor([0, 1, 0, 0])
    assign = torch.tensor([0, 0, 0, 1])
    clean = NoDP().release("centres", features=feats, labels=labels, num_classes=2, assignments=assign)
    assert torch.allclose(clean, torch.tensor([[1.0, 0.0], [0.0, 4.0], [6.0, 6.0]]))
    noisy = stack_centres(igpp_release(feats, labels, clip=3.0, sigma=0.0, generator=None, assignments=assign))
    assert torch.allclose(noisy, torch.tensor([[1.0, 0.0], [0.0, 3.0], [2.121320, 2.121320]]), atol=TOL)
