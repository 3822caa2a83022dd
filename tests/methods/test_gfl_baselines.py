"""The model-homogeneous GFL / PFL baselines of fedtsp.txt Table 3: FedBABU, FedETF, FedFA, FedPCL, FedPAC.

Each method's distinctive step on a worked example, a check that only declared tensors leave a client,
and a short end-to-end run on Ray (cnn_tiny, 2 rounds, 3 clients on digits)."""

from __future__ import annotations

import csv
import math
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from raysim.methods.base import ClientData, EnvSpec, ServerResult, TrainConfig, Upload  # noqa: E402
from raysim.models.clip import ModelSpec  # noqa: E402
from raysim.privacy import NoDP  # noqa: E402

C = 3
SPEC = EnvSpec(model=ModelSpec("raysim-tiny", ""), classnames=["zero", "one", "two"], dataset="digits")
NAMES = ("fedbabu", "fedetf", "fedfa", "fedpcl", "fedpac")


def _data(cid: int, n: int, seed: int, classes: int = C) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    x = torch.randn(n, 3, 32, 32, generator=g) * 0.3 + y[:, None, None, None].float() * 0.5  # learnable
    return ClientData(cid, x, y, x[:6].clone(), y[:6].clone(), C)


def _method(name: str, **opts):
    from raysim.methods import get_method

    cls = get_method(name)
    o = cls.Options(**{"model": "cnn_tiny", "feature_dim": 16, **opts})
    o.validate()
    return cls(TrainConfig(local_epochs=1, batch_size=8, seed=1, num_clients=2), o)


def _setup(name: str, **opts):
    m = _method(name, **opts)
    env = m.build_env(SPEC, role="client")
    return m, env, m.init_shared(env, torch.Generator().manual_seed(0))


def _train(m, env, shared, data, private=None, seed=0):
    private = private if private is not None else m.init_private(env, data, torch.Generator().manual_seed(data.client_id))
    return m.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(seed), privacy=NoDP())


def _state(out):
    return out.state if isinstance(out, ServerResult) else out


# ------------------------------------------------------------------------------------ FedBABU
def test_fedbabu_head_stays_frozen_and_only_the_body_is_averaged():
    m, env, shared = _setup("fedbabu")
    head0 = shared["head"].clone()
    ups = []
    for cid, n in ((0, 16), (1, 48)):
        res = _train(m, env, shared, _data(cid, n, seed=cid))
        assert set(res.upload) == {"body"} and res.upload["body"].shape == shared["body"].shape
        ups.append(Upload(cid, res.upload, res.num_samples))
        # the host's cached module still has the random head it was given, and learns again afterwards
        glob = env.extra["global_model"]
        assert torch.equal(glob.head.weight.detach().cpu().reshape(-1), head0[: glob.head.weight.numel()])
        assert all(p.requires_grad for p in glob.parameters())
    assert not torch.equal(ups[0].tensors["body"], shared["body"])
    new = _state(m.aggregate(env, shared, ups, torch.Generator()))
    assert torch.equal(new["head"], head0)  # never updated
    b0, b1 = ups[0].tensors["body"], ups[1].tensors["body"]
    assert torch.allclose(new["body"], 0.25 * b0 + 0.75 * b1, atol=1e-6)  # 16 : 48 samples


def test_fedbabu_ft_finetunes_the_frozen_head_privately():
    m, env, shared = _setup("fedbabu", finetune_epochs=3, finetune_lr=0.1)
    data = _data(0, 24, seed=3)
    private = m.init_private(env, data, torch.Generator())
    with torch.no_grad():
        out = m.predictor(env, shared, private, data)(data.x_train)
    assert set(private["head_ft"]) == {"weight", "bias"}
    plain = _method("fedbabu")
    with torch.no_grad():
        out0 = plain.predictor(env, shared, plain.init_private(env, data, torch.Generator()), data)(data.x_train)
    assert F.cross_entropy(out, data.y_train) < F.cross_entropy(out0, data.y_train)


# ------------------------------------------------------------------------------------ FedETF
@pytest.mark.parametrize("classes,dim", [(3, 3), (4, 7), (10, 10)])
def test_simplex_etf_is_equiangular_with_cosine_minus_one_over_c_minus_one(classes, dim):
    from raysim.methods.fedtsp.fedetf import simplex_etf

    M = simplex_etf(dim, classes, torch.Generator().manual_seed(2)).double()
    assert M.shape == (dim, classes)
    gram = M.t() @ M
    # float32 storage of M: 1e-6 tolerance on unit norms and cosines
    assert torch.allclose(torch.diagonal(gram), torch.ones(classes, dtype=torch.float64), atol=1e-6)
    off = gram[~torch.eye(classes, dtype=torch.bool)]
    assert torch.allclose(off, torch.full_like(off, -1.0 / (classes - 1)), atol=1e-6)
    assert torch.allclose(M.sum(1), torch.zeros(dim, dtype=torch.float64), atol=1e-6)  # centred: columns sum to 0


def test_simplex_etf_needs_proj_dim_at_least_c():
    from raysim.errors import ConfigError
    from raysim.methods.fedtsp.fedetf import simplex_etf

    with pytest.raises(ConfigError, match="proj_dim"):
        simplex_etf(2, 3, torch.Generator())


def test_balanced_softmax_adds_log_counts_and_drops_absent_classes():
    from raysim.methods.fedtsp.fedetf import balanced_softmax_ce

    logits = torch.tensor([[0.0, 0.0, 5.0]])
    counts = torch.tensor([3.0, 1.0, 0.0])  # class 2 absent on this client: its logit leaves the softmax
    # hand: softmax over (0 + ln 3, 0 + ln 1) -> p(class 0) = 3/4
    assert math.isclose(float(balanced_softmax_ce(logits, torch.tensor([0]), counts)), -math.log(0.75), rel_tol=1e-6)


def test_fedetf_trains_model_and_temperature_but_never_the_etf():
    m, env, shared = _setup("fedetf")
    assert shared["etf"].shape == (C, C) and float(shared["beta"]) == 1.0
    res = _train(m, env, shared, _data(0, 24, seed=1))
    assert set(res.upload) == {"weights", "beta"}
    assert not torch.equal(res.upload["beta"], shared["beta"]) and not torch.equal(res.upload["weights"], shared["weights"])
    new = _state(m.aggregate(env, shared, [Upload(0, res.upload, 24)], torch.Generator()))
    assert torch.equal(new["etf"], shared["etf"]) and torch.equal(new["beta"], res.upload["beta"])


def test_fedetf_per_personalises_etf_and_projection_privately():
    m, env, shared = _setup("fedetf", finetune_epochs=2, finetune_inner=2)
    data = _data(0, 24, seed=4)
    private = m.init_private(env, data, torch.Generator())
    before = {k: v.clone() for k, v in shared.items()}
    with torch.no_grad():
        out = m.predictor(env, shared, private, data)(data.x_train)
        out0 = _method("fedetf").predictor(env, shared, {}, data)(data.x_train)
    assert set(private["per"]) == {"proj", "etf"} and not torch.equal(private["per"]["etf"], shared["etf"])
    assert all(torch.equal(before[k], shared[k]) for k in shared)  # the broadcast is untouched
    assert F.cross_entropy(out, data.y_train) < F.cross_entropy(out0, data.y_train)


# ------------------------------------------------------------------------------------ FedFA
def test_fedfa_anchor_loss_on_a_worked_example():
    from raysim.methods.fedtsp.fedfa import anchor_loss

    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    feats = torch.tensor([[1.0, 1.0], [3.0, 0.0], [0.0, 2.0]])
    y = torch.tensor([0, 0, 1])
    # class 0: distances 1 and 4, two samples -> 2.5; class 1: distance 1, one sample -> 1; /C = 3
    assert math.isclose(float(anchor_loss(feats, y, anchors)), 3.5 / 3, rel_tol=1e-6)


def test_fedfa_anchor_update_on_a_worked_example():
    from raysim.methods.fedtsp.fedfa import anchor_update

    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    # two batches: class 0 has batch means (2, 0) and (4, 2); class 1 appears in one batch with mean (0, 3)
    sums = torch.tensor([[6.0, 2.0], [0.0, 3.0], [0.0, 0.0]])
    held = torch.tensor([True, True, False])
    new = anchor_update(anchors, sums, 2, held, 0.5)
    # a_0 = 0.5 (1, 0) + 0.5 (6, 2)/2 = (2, 0.5); a_1 = 0.5 (0, 1) + 0.5 (0, 3)/2 = (0, 1.25) (divided by all
    # B = 2 batches, the official quirk); class 2 is not held: kept
    assert torch.allclose(new, torch.tensor([[2.0, 0.5], [0.0, 1.25], [5.0, 5.0]]))


def test_fedfa_anchors_start_distinct_one_hot_and_are_averaged_by_samples():
    from raysim.methods.fedtsp.fedfa import init_anchors

    a = init_anchors(3, 16, torch.Generator().manual_seed(0))
    assert torch.equal(a.sum(1), torch.ones(3)) and torch.equal((a > 0).sum(0).max(), torch.tensor(1))
    m, env, shared = _setup("fedfa")
    d0, d1 = _data(0, 16, seed=0, classes=2), _data(1, 48, seed=1)  # client 0 lacks class 2
    r0, r1 = _train(m, env, shared, d0), _train(m, env, shared, d1)
    assert torch.equal(r0.upload["anchors"][2], shared["anchors"][2])  # a class it lacks keeps the broadcast anchor
    assert not torch.equal(r0.upload["anchors"][0], shared["anchors"][0])
    assert set(r0.metrics) == {"loss", "ce", "anchor", "calib"} and all(math.isfinite(v) for v in r0.metrics.values())
    new = _state(m.aggregate(env, shared, [Upload(0, r0.upload, 16), Upload(1, r1.upload, 48)], torch.Generator()))
    assert torch.allclose(new["anchors"], 0.25 * r0.upload["anchors"] + 0.75 * r1.upload["anchors"], atol=1e-6)


def test_fedfa_calibration_pulls_the_head_towards_classifying_the_anchors():
    anchors_ce = []
    for calib_lr in (0.0, 0.05):
        m, env, shared = _setup("fedfa", calib_lr=calib_lr)
        res = _train(m, env, shared, _data(0, 32, seed=2))
        from raysim.methods.families.homogeneous import load_flat

        model = load_flat(m.new_model(env), res.upload["weights"])
        with torch.no_grad():
            anchors_ce.append(float(F.cross_entropy(model.head(shared["anchors"]), torch.arange(C))))
    assert anchors_ce[1] < anchors_ce[0]


# ------------------------------------------------------------------------------------ FedPCL
def test_fedpcl_contrastive_loss_on_a_tiny_example():
    from raysim.methods.fedtsp.fedpcl import contrastive_loss, pcl_loss

    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    y = torch.tensor([0, 1])
    has = torch.tensor([True, True, True])
    # sample 0: logits (1, 0, 0.6); sample 1: logits (0, 1, 0.8); tau = 1
    hand = (-math.log(math.e / (math.e + 1 + math.exp(0.6))) - math.log(math.e / (1 + math.e + math.exp(0.8)))) / 2
    assert math.isclose(float(contrastive_loss(z, y, protos, has, 1.0)), hand, rel_tol=1e-6)
    # a class without a prototype leaves the softmax: logits (1, 0) and (0, 1)
    no2 = torch.tensor([True, True, False])
    assert math.isclose(float(contrastive_loss(z, y, protos, no2, 1.0)), math.log(1 + math.exp(-1)), rel_tol=1e-6)
    # tau scales the logits
    assert math.isclose(float(contrastive_loss(z, y, protos, no2, 0.5)), math.log(1 + math.exp(-2)), rel_tol=1e-6)
    # L_p is the mean over the clients' prototype sets
    lg, lp = pcl_loss(z, y, protos, torch.stack([protos, protos.flip(0)]), no2, 1.0)
    other = float(contrastive_loss(z, y, protos.flip(0), no2, 1.0))
    assert math.isclose(float(lp), (float(lg) + other) / 2, rel_tol=1e-6)


def test_fedpcl_first_participation_only_uploads_prototypes_then_trains():
    m, env, shared = _setup("fedpcl", feature_dim=16)
    m.train.num_clients = 2
    shared = m.init_shared(env, torch.Generator())
    data = [_data(0, 24, seed=0, classes=2), _data(1, 24, seed=1)]
    first = [_train(m, env, shared, d) for d in data]
    for r in first:
        assert set(r.upload) == {"protos", "counts"} and math.isnan(r.metrics["loss"])  # no training yet
        norms = r.upload["protos"][r.upload["counts"] > 0].norm(dim=1)
        assert torch.all(norms <= 1 + 1e-5)  # means of normalised features
    new = _state(m.aggregate(env, shared, [Upload(i, r.upload, 24) for i, r in enumerate(first)], torch.Generator()))
    assert torch.allclose(new["protos"][2], first[1].upload["protos"][2])  # only client 1 holds class 2
    assert torch.allclose(new["protos"][0], (first[0].upload["protos"][0] + first[1].upload["protos"][0]) / 2)  # plain mean
    assert torch.equal(new["client_protos"][0][2], new["protos"][2])  # client 0's row padded with the global prototype
    second = _train(m, env, new, data[0], private=first[0].private)
    assert math.isfinite(second.metrics["loss"]) and not torch.equal(second.upload["protos"], first[0].upload["protos"])
    # the predictor scores by its own exact prototypes, padded with the global one for class 2
    with torch.no_grad():
        logits = m.predictor(env, new, second.private, data[0])(data[0].x_test)
    assert logits.shape == (6, C)


# ------------------------------------------------------------------------------------ FedPAC
def test_simplex_projection_and_qp_on_hand_examples():
    from raysim.methods.fedtsp.fedpac import project_simplex, simplex_qp

    assert torch.allclose(project_simplex(torch.tensor([0.5, 0.5], dtype=torch.float64)), torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert torch.allclose(project_simplex(torch.tensor([2.0, 0.0], dtype=torch.float64)), torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert torch.allclose(project_simplex(torch.tensor([0.3, -0.5, 0.6], dtype=torch.float64)),
                          torch.tensor([0.35, 0.0, 0.65], dtype=torch.float64))
    # diagonal P: a_j proportional to 1 / P_jj
    a = simplex_qp(torch.diag(torch.tensor([1.0, 3.0])))
    assert torch.allclose(a, torch.tensor([0.75, 0.25], dtype=torch.float64), atol=1e-6)
    # 2 x 2 with correlation: a_0 = (c - b) / (a - 2b + c) = (4 - 1) / (2 - 2 + 4) = 0.75
    a = simplex_qp(torch.tensor([[2.0, 1.0], [1.0, 4.0]]))
    assert torch.allclose(a, torch.tensor([0.75, 0.25], dtype=torch.float64), atol=1e-6)
    # the unconstrained optimum is outside the simplex: a corner
    a = simplex_qp(torch.tensor([[1.0, 2.0], [2.0, 9.0]]))
    assert torch.allclose(a, torch.tensor([1.0, 0.0], dtype=torch.float64), atol=1e-6)


def test_fedpac_combination_weights_on_a_hand_example():
    from raysim.methods.fedtsp.fedpac import combination_weights

    V = torch.tensor([1.0, 1.0, 2.0])
    # h of clients 0 and 1 equal; client 2's differs by a vector of squared norm 2 (over C = 2 classes)
    H = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 1.0]]])
    W = combination_weights(V, H)
    assert torch.all(W >= 0) and torch.allclose(W.sum(1), torch.ones(3), atol=1e-6)
    # row 0: P = diag(1, 1, 2) + D_0, D_0 = delta delta^T with delta = (0, 0, h0 - h2): P = diag(1, 1, 4)
    # -> a proportional to (1, 1, 1/4) = (4/9, 4/9, 1/9)
    assert torch.allclose(W[0], torch.tensor([4 / 9, 4 / 9, 1 / 9]), atol=1e-5)
    # row 2: delta_0 = delta_1 = h2 - h0 (norm^2 2), delta_2 = 0: P = [[3, 2, 0], [2, 3, 0], [0, 0, 2]]
    # -> by symmetry a_0 = a_1 = t, a_2 = 1 - 2t; minimise 10 t^2 + 2 (1 - 2t)^2: t = 2/9
    assert torch.allclose(W[2], torch.tensor([2 / 9, 2 / 9, 5 / 9]), atol=1e-5)


def test_fedpac_statistics_on_a_hand_example():
    from raysim.methods.fedtsp.fedpac import pac_statistics

    feats = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]])
    y = torch.tensor([0, 0, 1])
    v, mu = pac_statistics(feats, y, 3)
    assert torch.allclose(mu, torch.tensor([[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]]))
    # p = (2/3, 1/3, 0); E||f||^2 = (5, 4); ||mu||^2 = (4, 4)
    # V = [2/3 * 5 - 4/9 * 4 + 1/3 * 4 - 1/9 * 4] / 3 = (10/3 - 16/9 + 4/3 - 4/9) / 3 = (22/9) / 3
    assert math.isclose(float(v), 22 / 27, rel_tol=1e-6)


def test_fedpac_round_trains_head_then_body_and_combines_heads():
    m, env, shared = _setup("fedpac")
    data = [_data(0, 16, seed=0), _data(1, 32, seed=1, classes=2)]
    res = [_train(m, env, shared, d) for d in data]
    for r in res:
        assert set(r.upload) == {"body", "head", "protos", "counts", "stat_protos", "v"}
        assert math.isfinite(r.metrics["head_ce"]) and float(r.upload["v"]) >= 0
    assert not torch.equal(res[0].upload["head"], shared["heads"][0])
    ups = [Upload(i, r.upload, d.num_train) for i, (r, d) in enumerate(zip(res, data))]
    new = _state(m.aggregate(env, shared, ups, torch.Generator()))
    assert new["heads"].shape == shared["heads"].shape
    heads = torch.stack([r.upload["head"] for r in res])
    for i in range(2):  # each new head is a convex combination of the uploaded heads
        w = torch.linalg.lstsq(heads.t().double(), new["heads"][i].double()).solution
        assert torch.all(w >= -1e-4) and math.isclose(float(w.sum()), 1.0, abs_tol=1e-4)
    assert torch.allclose(new["body"], (16 * res[0].upload["body"] + 32 * res[1].upload["body"]) / 48, atol=1e-6)
    assert bool(new["has"].all())


# ------------------------------------------------------------------------------------ declared uploads
EXPECTED = {
    "fedbabu": {"body"},
    "fedetf": {"weights", "beta"},
    "fedfa": {"weights", "anchors"},
    "fedpcl": {"protos", "counts"},
    "fedpac": {"body", "head", "protos", "counts", "stat_protos", "v"},
}


@pytest.mark.parametrize("name", NAMES)
def test_only_declared_tensors_leave_the_client(name):
    from raysim.engine.hosts import check_upload
    from raysim.errors import UploadViolation

    m, env, shared = _setup(name)
    data = _data(0, 24, seed=5)
    res = _train(m, env, shared, data)
    assert set(res.upload) == EXPECTED[name] and set(res.upload) <= set(m.releases)
    check_upload(m, 0, res.upload)
    # an undeclared tensor (here: a stand-in for the model) is refused
    with pytest.raises(UploadViolation, match="does not declare"):
        check_upload(m, 0, {**res.upload, "model": torch.zeros(3)})


# ------------------------------------------------------------------------------------ end to end on Ray
@pytest.mark.parametrize("name,section", [
    ("fedbabu", {"finetune_epochs": 1}),
    ("fedetf", {"finetune_epochs": 1, "finetune_inner": 1}),
    ("fedfa", {"finetune_epochs": 1}),
    ("fedpcl", {}),
    ("fedpac", {"qp_iters": 200}),
])
def test_end_to_end_on_ray(tmp_path, cache_dir, ray_session, name, section):
    from raysim.build import build_config
    from raysim.engine.loop import run
    from raysim.storage.store import StateStore

    cfg = build_config({
        "method": name, "data": {"dataset": "digits", "partition": "dirichlet", "beta": 0.5, "shots": 0},
        "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"num_clients": 3, "rounds": 2, "batch_size": 32},
        "eval": {"every": 1, "last": 1},
        "execution": {"backend": "ray", "num_actors": 2},
        "output": {"progress": False, "tensorboard": False, "cache_dir": cache_dir, "out_dir": str(tmp_path / name)},
        name: {"model": "cnn_tiny", "feature_dim": 64, **section},
    })
    res = run(cfg)
    with open(res.out_dir / "client_results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 3 and {r["round"] for r in rows} == {"0", "1"}
    assert all(0.0 <= float(r["in_client"]) <= 1.0 for r in rows)
    assert math.isfinite(res.summary["in_client"])
    store = StateStore(res.out_dir)
    s0, s1 = store.load_server(0), store.load_server(1)
    if name == "fedbabu":
        assert torch.equal(s0["head"], s1["head"]) and not torch.equal(s0["body"], s1["body"])
        assert "head_ft" in store.load_client(0, 1)["private"]
    if name == "fedetf":
        assert torch.equal(s0["etf"], s1["etf"]) and "per" in store.load_client(0, 1)["private"]
    if name == "fedfa":
        assert not torch.equal(s0["anchors"], s1["anchors"])
    if name == "fedpcl":  # round 0 only collects prototypes; round 1 trains on them
        assert bool(s0["has"].any()) and s1["client_protos"].shape[0] == 3
        losses = [r["train_loss"] for r in csv.DictReader(open(res.out_dir / "results.csv"))]
        assert losses[0] == "" and math.isfinite(float(losses[1]))
    if name == "fedpac":
        assert s1["heads"].shape[0] == 3 and not torch.equal(s1["heads"][0], s1["heads"][1])
