"""FedTSP's heterogeneous-model baselines, part A: LG-FedAvg, FedGen, FedGH, FedDistill, and the HtFLlib
protocol of FedProto / FedTGP. For each method its distinctive step on a worked example, that only the
declared tensors leave a client (and are privatised under DP), and a short offline run on Ray."""

from __future__ import annotations

import math

import pytest
import torch

from raysim.methods.base import ClientData, TrainConfig, Upload
from raysim.privacy.dpsgd import NoDP

C, D = 3, 8  # classes, feature width of the small worked examples


def _env(method, num_classes=C, feature_dim=D):
    from raysim.methods.families.zoo import HtEnv

    return HtEnv(torch.device("cpu"), num_classes, feature_dim)


def _data(cid=0, n=12, num_classes=C, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.arange(n) % num_classes
    return ClientData(cid, x, y, x[:4], y[:4], num_classes)


def _method(name, train=None, dp=None, **opts):
    from raysim.methods import get_method

    cls = get_method(name)
    o = cls.Options(model_family="tiny", feature_dim=D, **opts)
    o.validate()
    return cls(train or TrainConfig(batch_size=4, local_epochs=1), o, dp)


# --------------------------------------------------------------------------------------- LG-FedAvg
def test_zoo_heads_have_one_shape_so_they_can_be_averaged():
    from raysim.models.zoo import FAMILIES, make_client_model

    archs = sorted({a for fam in FAMILIES.values() for a in fam}
                   - {"resnet101", "resnet152", "tv_resnet101", "tv_resnet152", "fedavgcnn_1x28"})  # 1x28: 1 channel
    shapes = {tuple(make_client_model(a, 16, 5).head.weight.shape) for a in archs}
    assert shapes == {(5, 16)}  # every extractor ends in the same Linear(d, C)


def test_lgfedavg_averages_only_the_head():
    from raysim.methods.families.zoo import HEAD_KEYS

    m = _method("lgfedavg")
    env = _env(m)
    shared = m.init_shared(env, torch.Generator().manual_seed(0))
    assert set(shared) == set(HEAD_KEYS) and shared["head.weight"].shape == (C, D)
    # the server: sum_k n_k head_k / sum_k n_k, nothing but the head
    up = [Upload(0, {"head.weight": torch.full((C, D), 1.0), "head.bias": torch.tensor([0.0, 4.0, 8.0])}, 1),
          Upload(1, {"head.weight": torch.full((C, D), 5.0), "head.bias": torch.tensor([4.0, 0.0, 0.0])}, 3)]
    new = m.aggregate(env, shared, up, torch.Generator())
    assert set(new) == set(HEAD_KEYS)
    assert torch.allclose(new["head.weight"], torch.full((C, D), (1 * 1 + 3 * 5) / 4))  # 4.0
    assert torch.allclose(new["head.bias"], torch.tensor([3.0, 1.0, 2.0]))
    # the client: starts from the broadcast head (0 epochs: uploads it unchanged), uploads the head only,
    # and keeps its own extractor; after training the extractor has moved but never left
    data = _data()
    private = m.init_private(env, data, torch.Generator().manual_seed(1))
    still = _method("lgfedavg", TrainConfig(batch_size=4, local_epochs=0))
    r0 = still.local_train(env, new, private, data, rng=torch.Generator(), privacy=NoDP())
    assert set(r0.upload) == set(HEAD_KEYS) and all(torch.equal(r0.upload[k], new[k]) for k in HEAD_KEYS)
    r1 = m.local_train(env, new, private, data, rng=torch.Generator(), privacy=NoDP())
    base = [k for k in private["model"] if not k.startswith("head.")]
    assert any(not torch.equal(r1.private["model"][k], private["model"][k]) for k in base)
    assert not torch.equal(r1.upload["head.weight"], new["head.weight"])
    # evaluation: the client's own extractor under the global head
    model = m.model(env, r1.private).eval()
    x = data.x_test
    with torch.no_grad():
        want = model.features(x) @ new["head.weight"].t() + new["head.bias"]
        got = m.predictor(env, new, r1.private, data)(x)
    assert torch.allclose(got, want, atol=1e-5)  # float32 matmul in two orders


# ------------------------------------------------------------------------------------------ FedGen
def test_fedgen_generator_shapes_and_its_server_step_lowers_the_ensemble_loss():
    from raysim.methods.fedtsp.fedgen import Generator, draw, ensemble_logits, train_generator

    g0 = torch.Generator().manual_seed(0)
    gen = Generator(noise_dim=4, num_classes=C, hidden=16, feature_dim=D)
    counts = torch.tensor([5.0, 0.0, 3.0])  # class 1 nobody holds: never drawn
    y, eps = draw(gen, counts, 64, "uniform", g0, "cpu")
    assert y.shape == (64,) and set(y.tolist()) <= {0, 2} and eps.shape == (64, 4)
    assert float(eps.min()) >= 0 and float(eps.max()) < 1  # U[0, 1) as the official torch.rand
    assert gen(y, eps).shape == (64, D)
    # the ensemble is the n-weighted sum of the heads' logits
    z = torch.randn(2, D, generator=g0)
    heads = [(torch.randn(C, D, generator=g0), torch.randn(C, generator=g0)) for _ in range(2)]
    w = torch.tensor([0.25, 0.75])
    want = 0.25 * (z @ heads[0][0].t() + heads[0][1]) + 0.75 * (z @ heads[1][0].t() + heads[1][1])
    assert torch.allclose(ensemble_logits(z, heads, w), want, atol=1e-6)
    # Adam on CE(ensemble(G(noise, y)), y): the fixed heads come to classify the generated features
    losses = train_generator(gen, heads, w, counts, steps=60, batch=32, lr=0.1, noise="uniform", rng=g0)
    assert len(losses) == 60 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, (first, last)  # measured: 0.27 -> 0.0003; a factor of 2 leaves a wide margin


def test_fedgen_round_trip_broadcasts_head_generator_and_label_counts():
    m = _method("fedgen", hidden_dim=16, server_epochs=5)
    env = _env(m)
    shared = m.init_shared(env, torch.Generator().manual_seed(0))
    assert float(shared["label_counts"].sum()) == 0 and "gen.fc.weight" in shared and m.server_only == ()
    data = [_data(0), _data(1, n=9, seed=1)]
    privs = [m.init_private(env, d, torch.Generator().manual_seed(i)) for i, d in enumerate(data)]
    res = [m.local_train(env, shared, p, d, rng=torch.Generator().manual_seed(2), privacy=NoDP()) for p, d in zip(privs, data)]
    assert res[0].metrics["gen"] == 0.0  # round 0: no label distribution yet, no generator term
    ups = [Upload(i, r.upload, r.num_samples) for i, r in enumerate(res)]
    out = m.aggregate(env, shared, ups, torch.Generator().manual_seed(3))
    st = out.state
    assert torch.equal(st["label_counts"], torch.tensor([7.0, 7.0, 7.0]))  # 4+3 per class
    w = torch.tensor([12 / 21, 9 / 21])
    assert torch.allclose(st["head.weight"], w[0] * ups[0].tensors["head.weight"] + w[1] * ups[1].tensors["head.weight"], atol=1e-6)
    assert not torch.equal(st["gen.fc.weight"], shared["gen.fc.weight"]) and math.isfinite(out.metrics["loss"])
    # round 1: the client's loss has the generator term, logged apart
    r = m.local_train(env, st, res[0].private, data[0], rng=torch.Generator().manual_seed(4), privacy=NoDP())
    assert r.metrics["gen"] > 0 and r.metrics["loss"] == pytest.approx(r.metrics["ce"] + r.metrics["gen"], rel=1e-6)


# ------------------------------------------------------------------------------------------- FedGH
def test_fedgh_server_head_update_worked_example():
    """One SGD step (lr 0.1) from W = 0, b = 0 on the pairs p1 = (1, 0) -> 0, p2 = (0, 2) -> 1, p3 = (2, 2)
    -> 0 (client 1 lacks class 1): softmax is (1/2, 1/2) for each, so grad_W[0] = mean_i (1/2 - [y_i = 0]) p_i
    = ((-1/2)(1, 0) + (1/2)(0, 2) + (-1/2)(2, 2)) / 3 = (-1/2, 0), grad_W[1] = (1/2, 0), grad_b = (-1/6, 1/6).
    The step: W = (0.05, 0; -0.05, 0), b = (1/60, -1/60)."""
    m = _method("fedgh", train=TrainConfig(batch_size=100), server_epochs=1, server_lr=0.1)
    env = _env(m, num_classes=2, feature_dim=2)
    shared = {"head.weight": torch.zeros(2, 2), "head.bias": torch.zeros(2)}
    ups = [Upload(0, {"protos": torch.tensor([[1.0, 0.0], [0.0, 2.0]]), "counts": torch.tensor([3.0, 1.0])}, 4),
           Upload(1, {"protos": torch.tensor([[2.0, 2.0], [9.0, 9.0]]), "counts": torch.tensor([2.0, 0.0])}, 2)]
    out = m.aggregate(env, shared, ups, torch.Generator().manual_seed(0))
    assert set(out.state) == {"head.weight", "head.bias"}
    assert torch.allclose(out.state["head.weight"], torch.tensor([[0.05, 0.0], [-0.05, 0.0]]), atol=1e-7)
    assert torch.allclose(out.state["head.bias"], torch.tensor([1 / 60, -1 / 60]), atol=1e-7)
    assert out.metrics["loss"] == pytest.approx(math.log(2), rel=1e-6)  # the loss before the step
    # more epochs keep lowering the loss on the prototypes (the head persists across rounds)
    m10 = _method("fedgh", train=TrainConfig(batch_size=2), server_epochs=50, server_lr=0.1)
    out10 = m10.aggregate(env, out.state, ups, torch.Generator().manual_seed(0))
    assert out10.metrics["loss"] < math.log(2)


def test_fedgh_client_trains_under_the_global_head_and_uploads_prototypes():
    m = _method("fedgh")
    env = _env(m)
    shared = m.init_shared(env, torch.Generator().manual_seed(0))
    data = _data()
    still = _method("fedgh", TrainConfig(batch_size=4, local_epochs=0))
    r = still.local_train(env, shared, still.init_private(env, data, torch.Generator()), data, rng=torch.Generator(),
                          privacy=NoDP())
    assert set(r.upload) == {"protos", "counts"} and r.upload["protos"].shape == (C, D)
    assert torch.equal(r.private["model"]["head.weight"], shared["head.weight"])  # the head was replaced


# -------------------------------------------------------------------------------------- FedDistill
def test_per_example_means_give_the_class_means_of_all_collected_rows():
    """Two epochs over n = 5 in batches of 2 (fixed order, drop_last): examples 0-3 are seen twice, example 4
    never. Labels (0, 0, 1, 1, 1). Class 0's mean of all four collected rows is the mean of the two
    examples' means; example 4 is not in any class mean, nor in the counts."""
    from raysim.methods.families.prototype import PerExampleMeans, release_class_means

    acc = PerExampleMeans(5, 2)
    acc.add(torch.tensor([0, 1]), torch.tensor([[1.0, 0.0], [3.0, 0.0]]))
    acc.add(torch.tensor([2, 3]), torch.tensor([[0.0, 2.0], [0.0, 4.0]]))
    acc.add(torch.tensor([0, 1]), torch.tensor([[5.0, 0.0], [7.0, 0.0]]))
    acc.add(torch.tensor([2, 3]), torch.tensor([[0.0, 6.0], [0.0, 8.0]]))
    rows, y = acc.rows(torch.tensor([0, 0, 1, 1, 1]))
    assert torch.equal(rows, torch.tensor([[3.0, 0.0], [5.0, 0.0], [0.0, 4.0], [0.0, 6.0]])) and y.tolist() == [0, 0, 1, 1]
    up = release_class_means(NoDP(), "logits", acc, torch.tensor([0, 0, 1, 1, 1]), 3)
    assert torch.allclose(up["logits"], torch.tensor([[4.0, 0.0], [0.0, 5.0], [0.0, 0.0]]))  # (1+3+5+7)/4, (2+4+6+8)/4
    assert up["counts"].tolist() == [2.0, 2.0, 0.0]


def test_feddistill_soft_target_ce_worked_example():
    """The code behind the tables: CE(z, softmax(Z_g[y])) over the batch; a row without global logits takes
    softmax(z) (detached) as its target: its entropy enters the value, nothing enters the gradient."""
    from raysim.methods.fedtsp.feddistill import distill_loss, soft_target_ce

    z = torch.tensor([[1.0, 0.0], [0.0, 0.0]], requires_grad=True)
    y = torch.tensor([0, 1])
    zg = torch.tensor([[math.log(3.0), 0.0], [5.0, -5.0]])  # softmax(Z_g[0]) = (3/4, 1/4); class 1 has none
    has = torch.tensor([True, False])
    # row 0: -(3/4)(1 - log(1 + e)) - (1/4)(-log(1 + e)) = log(1 + e) - 3/4; row 1: entropy of (1/2, 1/2) = log 2
    want = (math.log(1 + math.e) - 0.75 + math.log(2)) / 2
    loss = soft_target_ce(z, y, zg, has)
    assert loss.item() == pytest.approx(want, abs=1e-6)  # float32 logs
    (grad,) = torch.autograd.grad(loss, z)
    p0 = torch.tensor([math.e / (1 + math.e), 1 / (1 + math.e)])
    assert torch.allclose(grad[0], (p0 - torch.tensor([0.75, 0.25])) / 2, atol=1e-6)  # (softmax - target) / B
    assert torch.allclose(grad[1], torch.zeros(2), atol=1e-7)  # its own softmax as target: no pull
    assert distill_loss(z, y, zg, has).item() == pytest.approx(want, abs=1e-6)  # the default form
    # distill=mse (upstream HtFLlib): mean over batch x classes of (z - Z_g[y])^2, row 1 compared with itself
    mse = ((1 - math.log(3.0)) ** 2 + 0.0) / 4
    assert distill_loss(z, y, zg, has, "mse").item() == pytest.approx(mse, abs=1e-6)


def _feddistill_round(**opts):
    """Server aggregation of two hand-made uploads, then one client round at lr 0 (the model stays fixed,
    cnn_tiny has no BatchNorm: the logits collected in training are the model's eval logits)."""
    m = _method("feddistill", **opts)
    env = _env(m)
    ups = [Upload(0, {"logits": torch.tensor([[2.0, 0.0, 0.0], [0.0, 4.0, 0.0], [0.0, 0.0, 0.0]]),
                      "counts": torch.tensor([1.0, 9.0, 0.0])}, 10),
           Upload(1, {"logits": torch.tensor([[4.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
                      "counts": torch.tensor([3.0, 0.0, 0.0])}, 3)]
    st = m.aggregate(env, m.init_shared(env, torch.Generator()), ups, torch.Generator())
    still = _method("feddistill", TrainConfig(batch_size=4, local_epochs=2, lr=0.0), **opts)
    data = _data()
    private = still.init_private(env, data, torch.Generator().manual_seed(0))
    r = still.local_train(env, st, private, data, rng=torch.Generator(), privacy=NoDP())
    model = still.model(env, private).eval()
    with torch.no_grad():
        logits = model(data.x_train)[1]
    return st, r, data, logits


def test_feddistill_per_class_logit_average_client_and_server():
    st, r, data, logits = _feddistill_round()
    # server: plain mean over the holders of each class (HtFLlib's logit_aggregation), holders only
    assert torch.allclose(st["logits"][0], torch.tensor([3.0, 1.0, 0.0]))  # unweighted: counts 1 and 3 do not matter
    assert torch.allclose(st["logits"][1], torch.tensor([0.0, 4.0, 0.0])) and st["has"].tolist() == [1.0, 1.0, 0.0]
    # client: the class means of the logits collected during the epochs are the upload (12 = 3 batches of 4)
    want = torch.stack([logits[data.y_train == c].mean(0) for c in range(C)])
    assert torch.allclose(r.upload["logits"], want, atol=1e-5)  # float32 sums in another order
    assert r.upload["counts"].tolist() == [4.0, 4.0, 4.0]
    # the regulariser (the default, the code's): lam (1) x CE(z, softmax(Z_g[y])), class 2 without global
    # logits taking its own softmax; every batch holds the same model, so the batch mean is the set mean
    from raysim.methods.fedtsp.feddistill import soft_target_ce

    has = st["has"] > 0.5
    ce = float(soft_target_ce(logits, data.y_train, st["logits"], has))
    assert r.metrics["distill"] == pytest.approx(ce, rel=1e-4)  # float32, batch means vs the set mean
    assert r.metrics["loss"] == pytest.approx(r.metrics["ce"] + ce, rel=1e-4)


def test_feddistill_mse_option_is_lam_times_the_mse_to_the_global_logits():
    from raysim.methods.families.prototype import proto_mse

    st, r, data, logits = _feddistill_round(distill="mse", lam=2.0)
    has = st["has"] > 0.5
    mse = 2.0 * float(proto_mse(logits, data.y_train, st["logits"], has))  # lam x MSE over the classes with logits
    assert r.metrics["distill"] == pytest.approx(mse, rel=1e-4) and r.metrics["loss"] == pytest.approx(r.metrics["ce"] + mse, rel=1e-4)
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="feddistill.distill"):
        _method("feddistill", distill="kl")


# ---------------------------------------------------------------------- FedProto / FedTGP: htfllib
def test_nearest_prototype_logits_worked_example():
    from raysim.methods.families.prototype import nearest_prototype_logits

    f = torch.tensor([[0.0, 0.0], [2.0, 2.0]])
    P = torch.tensor([[1.0, 0.0], [2.0, 1.0], [0.0, 0.0]])
    has = torch.tensor([True, True, False])
    out = nearest_prototype_logits(f, P, has)
    # -mean_d (f - P_c)^2: row 0: -(1 + 0)/2, -(4 + 1)/2, -inf; row 1: -(1 + 4)/2, -(0 + 1)/2, -inf
    assert torch.allclose(out[:, :2], torch.tensor([[-0.5, -2.5], [-2.5, -0.5]]))
    assert bool(torch.isinf(out[:, 2]).all()) and out.argmax(1).tolist() == [0, 1]  # class 2 never predicted


@pytest.mark.parametrize("name", ["fedproto", "fedtgp"])
def test_htfllib_protocol_predicts_by_nearest_global_prototype(name):
    from raysim.methods.families.prototype import nearest_prototype_logits

    kw = {"server_epochs": 1} if name == "fedtgp" else {}
    head, htf = _method(name, **kw), _method(name, protocol="htfllib", **kw)
    env = _env(head)
    data = _data()
    private = head.init_private(env, data, torch.Generator().manual_seed(0))
    shared = head.init_shared(env, torch.Generator().manual_seed(0))
    x = data.x_test
    model = head.model(env, private).eval()
    with torch.no_grad():
        own = model(x)[1]
        # before any global prototype both protocols use the head
        assert torch.allclose(htf.predictor(env, shared, private, data)(x), own)
        shared = {**shared, "protos": torch.randn(C, D, generator=torch.Generator().manual_seed(1)),
                  "has": torch.tensor([1.0, 1.0, 0.0])}
        assert torch.allclose(head.predictor(env, shared, private, data)(x), own)
        got = htf.predictor(env, shared, private, data)(x)
        # FedProto: the classes with a prototype; FedTGP: G(c) of every class once trained (HtFLlib)
        mask = torch.tensor([True, True, name == "fedtgp"])
        assert torch.allclose(got, nearest_prototype_logits(model.features(x), shared["protos"], mask))


def test_htfllib_fedproto_collects_its_prototypes_during_training():
    """With lr 0 and no BatchNorm (cnn_tiny) the training batches' features are the model's features, so the
    two collections agree; with lr > 0 they differ (the model moves during the epoch)."""
    data = _data()
    outs = {}
    for lr in (0.0, 0.05):
        for protocol in ("head", "htfllib"):
            m = _method("fedproto", TrainConfig(batch_size=4, local_epochs=1, lr=lr), protocol=protocol)
            env = _env(m)
            private = m.init_private(env, data, torch.Generator().manual_seed(0))
            outs[lr, protocol] = m.local_train(env, m.init_shared(env, torch.Generator()), private, data, rng=torch.Generator(),
                                               privacy=NoDP()).upload
    assert torch.allclose(outs[0.0, "head"]["protos"], outs[0.0, "htfllib"]["protos"], atol=1e-5)
    assert not torch.allclose(outs[0.05, "head"]["protos"], outs[0.05, "htfllib"]["protos"], atol=1e-4)
    # FedTGP's htfllib client collects after training, as by default
    from raysim.methods.fedtsp.fedtgp import FedTGP

    assert FedTGP.htfllib_collects_during_training is False


def test_protocol_is_validated():
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="protocol"):
        _method("fedproto", protocol="nearest")


# ----------------------------------------------------------------------- only declared tensors leave
EXPECTED = {
    "lgfedavg": ({"head.weight", "head.bias"}, "client", {}),
    "fedgen": ({"head.weight", "head.bias", "counts"}, "client", {"hidden_dim": 16, "server_epochs": 2}),
    "fedgh": ({"protos", "counts"}, "sample", {"server_epochs": 2}),
    "feddistill": ({"logits", "counts"}, "sample", {}),
    "fedproto": ({"protos", "counts"}, "sample", {"protocol": "htfllib"}),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_only_declared_tensors_leave_and_are_privatised(name):
    """Through the host's privacy handle with local DP at the level the method's release supports: the
    upload is exactly the declared tensors (the extractor never), the host's fail-closed check passes,
    the private ones differ from the clean upload (noised) and the ledger has recorded the release."""
    from raysim.config import DPConfig
    from raysim.errors import ConfigError
    from raysim.privacy.host import HostPrivacy

    keys, level, opts = EXPECTED[name]
    dp = DPConfig(epsilon=4.0, level=level)
    m = _method(name, dp=dp, **opts)
    env = _env(m)
    data = _data()
    shared = m.init_shared(env, torch.Generator().manual_seed(0))
    private = m.init_private(env, data, torch.Generator().manual_seed(1))
    clean = m.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(2), privacy=NoDP()).upload
    host = HostPrivacy(dp=dp, method=m, seed=1, batch_size=4, releases_per_client=lambda cid: 3)
    handle = host.open(0, 0, data.num_train, shared)
    res = m.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(2), privacy=handle)
    up = handle.close(res.upload)
    assert set(up) == keys == set(clean)
    private_keys = keys - {"counts"}
    assert all(not torch.allclose(up[k], clean[k]) for k in private_keys)
    assert torch.equal(up.get("counts", torch.zeros(0)), clean.get("counts", torch.zeros(0)))  # public, unchanged
    assert host.ledger(0).releases and 0 < host.epsilon(0) <= 4.0
    # the other level cannot privatise these releases: refused at config time with a reason
    other = "sample" if level == "client" else "client"
    from raysim.privacy.mechanisms import check_method

    with pytest.raises(ConfigError, match="dp.level"):
        check_method(m, DPConfig(epsilon=4.0, level=other))


# ------------------------------------------------------------------------------- end to end on Ray
@pytest.mark.parametrize("name,section", [
    ("lgfedavg", {}),
    ("fedgen", {"server_epochs": 5, "hidden_dim": 64}),
    ("fedgh", {"server_epochs": 5}),
    ("feddistill", {}),
    ("fedproto", {"protocol": "htfllib", "proto_weighting": "uniform"}),
])
def test_end_to_end_on_ray(tmp_path, ray_session, name, section):
    """2 rounds, 3 clients, the tiny zoo on digits (Dirichlet 0.5) on the Ray backend: every client is
    evaluated each round, the server saw exactly the declared uploads, and the clients' own-split accuracy
    is above chance (10 classes)."""
    from zoo_runs import ray_zoo_run

    from raysim.storage.store import StateStore

    res, rows = ray_zoo_run(tmp_path, name, {"model_family": "tiny", "feature_dim": 64, **section}, out=name, num_actors=1)
    assert len(rows) == 2 * 3 and {r["round"] for r in rows} == {"0", "1"}
    keys = EXPECTED[name][0]
    store = StateStore(res.out_dir)
    for r in range(2):
        seen = store.load_uploads(r)["uploads"]
        assert len(seen) == 3 and all(set(u) == keys for u in seen.values()), (r, seen.keys())
    acc = sum(float(r["in_client"]) for r in rows if r["round"] == "1") / 3
    assert acc > 0.2, acc  # chance is 0.1


def test_fedproto_local_loss_is_ce_plus_lambda_times_the_prototype_mse():
    # one batch holding the whole client (batch 12 of 12), so the reported loss is the loss of the model the
    # client started from: CE(h(f(x)), y) + lam MSE(f(x), P_g[y]) over the classes with a global prototype
    # (fedtsp.txt Eq. 5, FedProto's regulariser). Tolerance: float32 forward passes of the same model, 1e-5 rel
    from raysim.methods.families.prototype import proto_mse

    data = _data()
    for lam in (0.0, 2.0):
        m = _method("fedproto", train=TrainConfig(batch_size=12, local_epochs=1), lam=lam)
        env = _env(m)
        private = m.init_private(env, data, torch.Generator().manual_seed(0))
        shared = {"protos": torch.randn(C, D, generator=torch.Generator().manual_seed(1)), "has": torch.tensor([1.0, 1.0, 0.0])}
        model = m.model(env, private).train()
        with torch.no_grad():
            feats, logits = model(data.x_train)
            want = float(torch.nn.functional.cross_entropy(logits, data.y_train))
            want += lam * float(proto_mse(feats, data.y_train, shared["protos"], shared["has"] > 0.5))
        r = m.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(2), privacy=NoDP())
        assert r.metrics["loss"] == pytest.approx(want, rel=1e-5)


def test_fedproto_head_protocol_uploads_the_trained_models_class_means_and_keeps_that_model():
    """protocol=head: the upload is the class means of f(x) over the training set from the model training
    produced (eval mode), and that model is what the client keeps; the run is a function of its rng
    (shuffled batches) and reports its sample count (the engine's weight)."""
    data = _data()
    m = _method("fedproto", TrainConfig(batch_size=4, local_epochs=1, lr=0.05), protocol="head", shuffle=True)
    env = _env(m)
    private = m.init_private(env, data, torch.Generator().manual_seed(0))
    shared = m.init_shared(env, torch.Generator())
    r = m.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(3), privacy=NoDP())
    assert r.num_samples == data.num_train
    assert any(not torch.equal(r.private["model"][k], private["model"][k]) for k in private["model"])
    kept = m.model(env, r.private).eval()
    with torch.no_grad():
        feats = kept.features(data.x_train)
    want = torch.stack([feats[data.y_train == c].mean(0) for c in range(C)])
    # the same float32 forward of the same weights, averaged over 4 rows a class: 1e-5
    torch.testing.assert_close(r.upload["protos"], want, rtol=1e-5, atol=1e-5)
    # the same rng gives the same run; another rng another batch order, so other weights
    again = m.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(3), privacy=NoDP())
    other = m.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(4), privacy=NoDP())
    torch.testing.assert_close(again.upload["protos"], r.upload["protos"], rtol=0, atol=1e-6)  # one CPU, same ops
    assert not torch.allclose(other.upload["protos"], r.upload["protos"], atol=1e-4)


# ------------------------------------------------------------- FedProto's server, start and options (mutation run)
@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_fedproto_server_averages_the_holders_prototypes_with_the_configured_weighting(weighting):
    # class 0: both clients hold it (3 and 1 samples); class 1: only client 1 (its mean alone, whatever the
    # weights); class 2: nobody (0, has = 0). samples: (3 x 1 + 1 x 5) / 4 = 2; uniform: (1 + 5) / 2 = 3.
    # The server's state is read back next round under the same keys. Exact: small integers and quarters
    m = _method("fedproto", proto_weighting=weighting)
    env = _env(m)
    shared = m.init_shared(env, torch.Generator().manual_seed(0))
    assert set(shared) == {"protos", "has"}
    assert shared["protos"].shape == (C, D) and shared["has"].shape == (C,) and not shared["has"].any()
    p0, p1 = torch.zeros(C, D), torch.zeros(C, D)
    p0[0], p1[0], p1[1] = 1.0, 5.0, 7.0
    up = [Upload(0, {"protos": p0, "counts": torch.tensor([3.0, 0.0, 0.0])}, 3),
          Upload(1, {"protos": p1, "counts": torch.tensor([1.0, 2.0, 0.0])}, 3)]
    new = m.aggregate(env, shared, up, torch.Generator())
    assert set(new) == {"protos", "has"}
    assert torch.equal(new["has"], torch.tensor([1.0, 1.0, 0.0]))
    c0 = 2.0 if weighting == "samples" else 3.0
    assert torch.equal(new["protos"], torch.stack([torch.full((D,), c0), torch.full((D,), 7.0), torch.zeros(D)]))
    assert torch.equal(m.prediction_classes(new), torch.tensor([True, True, False]))


def test_fedproto_options_errors_name_fedproto():
    from raysim.errors import ConfigError

    for bad, field in (({"lam": -1.0}, "fedproto.lam"), ({"proto_weighting": "median"}, "fedproto.proto_weighting")):
        with pytest.raises(ConfigError, match=rf"^{field} must be"):
            _method("fedproto", **bad)
