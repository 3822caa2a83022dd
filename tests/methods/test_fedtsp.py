"""FedTSP, FedProto, FedTGP and local training: prompt insertion, server loss, prototype aggregation, the
client zoo, the private embedding release, and short end-to-end runs on the bundled digits."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import run_on_digits

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from raysim.methods.base import ClientData, EnvSpec, TrainConfig, Upload  # noqa: E402
from raysim.models.clip import ModelSpec  # noqa: E402


# ---------------------------------------------------------------------------------------------- PLMs
@pytest.fixture(scope="module")
def clip_plm():
    from raysim.models.plm import load_plm

    return load_plm("clip")  # the default ModelSpec: raysim-tiny, random weights


@pytest.fixture(scope="module")
def bert_plm():
    from raysim.models.plm import load_plm

    return load_plm("bert")


PROMPTS = [["A photo of a zero: a round loop.", "A photo of a zero: an oval."], ["A photo of a one: a line."],
           ["A photo of a two: a hook over a bar.", "A photo of a two: curved."]]


@pytest.mark.parametrize("which", ["clip", "bert"])
def test_prompt_insertion_overwrites_exactly_positions_0_to_m_minus_1(which, clip_plm, bert_plm):
    from raysim.models.plm import TextPrototypes

    plm = clip_plm if which == "clip" else bert_plm
    text = TextPrototypes.from_texts(plm, PROMPTS)
    m = 3
    prompts = torch.randn(3, m, plm.width)
    full = text.embeddings(prompts)
    assert full.shape == text.base.shape
    for n, c in enumerate(text.class_index.tolist()):
        assert torch.equal(full[n, :m], prompts[c])  # the class's own vectors, SOT/[CLS] included
        assert torch.equal(full[n, m:], text.base[n, m:])  # everything after is untouched
    # m = 0 leaves the prompts alone; the prototypes are the mean of the k raw features per class
    assert torch.equal(text.embeddings(prompts[:, :0]), text.base)
    with torch.no_grad():
        feats = plm.encode(full, text.aux)
        protos = text(prompts)
    assert protos.shape == (3, plm.out_dim)
    assert torch.allclose(protos[0], feats[:2].mean(0), atol=1e-5)
    assert torch.allclose(protos[2], feats[3:5].mean(0), atol=1e-5)
    # gradients reach the prompt vectors through the frozen PLM, and nothing else trains
    v = prompts.clone().requires_grad_(True)
    text(v).sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert all(p.grad is None for p in plm.parameters())


def test_clip_eot_pooling_and_bert_features(clip_plm, bert_plm):
    texts = ["A photo of a cat.", "A photo of a very small dog."]
    emb, eot = clip_plm.embed(texts)
    assert eot.tolist() == [7, 9] and emb.shape[-1] == clip_plm.width
    # pooling at the EOT token reproduces the tower's own encoding of the texts
    feats = torch.nn.functional.normalize(clip_plm.encode(emb, eot), dim=-1)
    assert torch.allclose(feats, clip_plm.tower.encode_texts(texts), atol=1e-5)
    emb, lengths = bert_plm.embed(["a cat", "a very small dog"])
    assert bert_plm.out_dim == 384 and emb.shape[-1] == 384 and lengths.tolist() == [4, 6]
    # the clean option feeds word embeddings; the quirk feeds the full embedding-module output
    from raysim.models.plm import BertPLM

    quirk = BertPLM(double_embedding=True)
    e2, _ = quirk.embed(["a cat"])
    assert not torch.allclose(e2, bert_plm.embed(["a cat"])[0])


# ---------------------------------------------------------------------------------------- server loss
def _hand_loss(img, text, s, direction):
    def cos(a, b):
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    n = len(img)
    L = [[math.exp(s) * cos(img[i], text[j]) for j in range(n)] for i in range(n)]

    def ce_rows(M):
        return sum(-M[i][i] + math.log(sum(math.exp(v) for v in M[i])) for i in range(n)) / n

    i2t = ce_rows(L)
    t2i = ce_rows([[L[j][i] for j in range(n)] for i in range(n)])
    return {"image_to_text": i2t, "text_to_image": t2i, "symmetric": (i2t + t2i) / 2}[direction]


@pytest.mark.parametrize("direction", ["image_to_text", "text_to_image", "symmetric"])
def test_server_loss_matches_hand_computation(direction):
    from raysim.methods.fedtsp.fedtsp import alignment_loss

    img = [[1.0, 0.0], [0.6, 0.8], [0.0, -1.0]]
    text = [[1.0, 0.2], [0.0, 1.0], [-0.5, -1.0]]
    s = math.log(3.0)
    got = alignment_loss(torch.tensor(img), torch.tensor(text), torch.tensor([s]), direction=direction)
    assert float(got) == pytest.approx(_hand_loss(img, text, s, direction), rel=1e-5)


def test_server_loss_directions_differ_and_subset_labels():
    from raysim.methods.fedtsp.fedtsp import alignment_loss

    img = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, -1.0]])
    text = torch.tensor([[1.0, 0.2], [0.0, 1.0], [-0.5, -1.0]])
    s = torch.tensor([math.log(3.0)])
    a = alignment_loss(img, text, s, direction="image_to_text")
    b = alignment_loss(img, text, s, direction="text_to_image")
    assert abs(float(a) - float(b)) > 1e-3  # L is not symmetric, so the direction matters
    # image prototypes of classes {0, 2} only: image->text still normalises over all 3 text classes
    sub = alignment_loss(img[[0, 2]], text, s, torch.tensor([0, 2]), "image_to_text")
    L = s.exp() * torch.nn.functional.normalize(img[[0, 2]], dim=-1) @ torch.nn.functional.normalize(text, dim=-1).t()
    want = -(L[0, 0] - L[0].logsumexp(0) + L[1, 2] - L[1].logsumexp(0)) / 2
    assert float(sub) == pytest.approx(float(want), rel=1e-6)


# --------------------------------------------------------------------------------- prototype averaging
def test_prototype_aggregation_holders_only_weighted_and_uniform():
    from raysim.methods.families.prototype import aggregate_prototypes

    protos = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [9.0, 9.0]],
                           [[3.0, 0.0], [0.0, 2.0], [0.0, 0.0]]])  # (K=2, C=3, d=2)
    counts = torch.tensor([[1.0, 0.0, 4.0], [3.0, 5.0, 0.0]])
    p, has = aggregate_prototypes(protos, counts, "samples")
    assert has.tolist() == [True, True, True]
    assert torch.allclose(p[0], torch.tensor([(1 * 1 + 3 * 3) / 4, 0.0]))  # Eq. 6: n_{k,c} weights
    assert torch.allclose(p[1], torch.tensor([0.0, 2.0]))  # only the holder counts (no shrinkage)
    assert torch.allclose(p[2], torch.tensor([9.0, 9.0]))
    q, _ = aggregate_prototypes(protos, counts, "uniform")
    assert torch.allclose(q[0], torch.tensor([2.0, 0.0])) and torch.allclose(q[1], p[1])
    _, has = aggregate_prototypes(protos, torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert has.tolist() == [True, False, False]


def test_fedproto_mse_and_fedtgp_margin():
    from raysim.methods.families.prototype import proto_mse
    from raysim.methods.fedtsp.fedtgp import adaptive_margin, margin_loss

    f = torch.tensor([[1.0, 1.0], [2.0, 0.0]])
    P = torch.tensor([[0.0, 1.0], [5.0, 5.0]])
    has = torch.tensor([True, False])
    assert float(proto_mse(f, torch.tensor([0, 1]), P, has)) == pytest.approx((1.0 + 0 + 0 + 0) / 4)
    avg = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    assert adaptive_margin(avg, torch.tensor([True, True, True]), 100.0) == pytest.approx(math.sqrt(9 + 9))
    assert adaptive_margin(avg, torch.tensor([True, True, True]), 2.0) == 2.0
    loss = margin_loss(torch.zeros(1, 2), torch.tensor([0]), torch.tensor([[1.0, 0.0], [0.0, 2.0]]), 1.0)
    assert float(loss) == pytest.approx(-math.log(math.exp(-2.0) / (math.exp(-2.0) + math.exp(-2.0))))


# ----------------------------------------------------------------------------------------------- zoo
def test_zoo_families_give_common_features_at_32px():
    from raysim.models.zoo import FAMILIES, arch_of, make_client_model

    assert arch_of("HtFE4", 5) == "googlenet" and arch_of("HtFE9", 10) == "resnet6"
    archs = sorted({a for fam in FAMILIES.values() for a in fam}
                   - {"resnet101", "resnet152", "tv_resnet101", "tv_resnet152", "fedavgcnn_1x28"})  # 1x28: 1 channel
    for arch in archs:  # (resnet101/152 only add Bottleneck blocks, covered by resnet50)
        m = make_client_model(arch, 48, 7, seed=0).eval()
        f, logits = m(torch.randn(2, 3, 32, 32))
        assert f.shape == (2, 48) and logits.shape == (2, 7), arch
    a = make_client_model("cnn_tiny", 16, 3, seed=1).state_dict()
    b = make_client_model("cnn_tiny", 16, 3, seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the init depends on the seed only


# ------------------------------------------------------------------------ private variant (section 3.5)
class _Guarded(list):
    """A class-name list whose only allowed use is len(): the server must never read a name."""

    def __iter__(self):
        raise AssertionError("the server read a class name")

    def __getitem__(self, i):
        raise AssertionError("the server read a class name")


def test_private_release_path_server_never_sees_class_names():
    """The private variant (dp.epsilon < inf): the server env is built from the class count only; the dp
    client's release goes through the host (clipped, noised, in its ledger) and carries only the padded
    noised embeddings; the server derives the rest by post-processing; the client never re-releases."""
    from raysim.config import DPConfig
    from raysim.methods.fedtsp.fedtsp import FedTSP, Options
    from raysim.privacy.accountant import epsilon_spent
    from raysim.privacy.host import HostPrivacy

    names = ["zero", "one", "two"]
    dp = DPConfig(epsilon=2.0)
    opts = Options(plm="bert", model_family="tiny", len_prompt=2, dp_budget="joint")  # one multiplier for all (before #25)
    opts.validate()
    method = FedTSP(TrainConfig(batch_size=8, num_clients=2), opts, dp)
    assert method.needs().server_classnames is False
    server_env = method.build_env(EnvSpec(ModelSpec(), _Guarded(names), dataset="digits"), role="server")
    assert server_env.text is None and server_env.classnames == []
    shared = method.init_shared(server_env, torch.Generator().manual_seed(0))
    assert "text_protos" not in shared  # no P^T before the release

    client_env = method.build_env(EnvSpec(ModelSpec(), names, dataset="digits"), role="client")
    rounds = 3
    host = HostPrivacy(dp=dp, method=method, seed=1, batch_size=8, releases_per_client=lambda cid: rounds)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, 32, 32)
    y = torch.tensor([0, 1, 2] * 4)
    data = ClientData(0, x, y, x[:3], y[:3], 3)
    private = method.init_private(client_env, data, g)
    assert method.setup_clients() == (0,)  # Step 0: the dp client releases before round 0 trains
    handle = host.open(0, 0, data.num_train, shared)
    up = handle.close(method.local_setup(client_env, shared, private, data, rng=g, privacy=handle).upload)
    assert set(up) == {"text_emb"}  # no lengths, EOT positions or class indices
    # 3 descriptions per class, every sequence at the fixed release length (77 for BERT)
    assert up["text_emb"].shape[:2] == (9, 77)
    ledger = host.ledger(0)
    assert [r.mechanism for r in ledger.releases] == ["embedding"]
    z = host.multiplier(0, data.num_train)
    # the noise on the embeddings is N(0, (2 C z)^2): the clipped signal (norm <= C = 2.5) is tiny next to it
    assert float(up["text_emb"].std()) == pytest.approx(2 * 2.5 * z, rel=0.02)
    # the server builds its text side from the release alone and P^T from its initial prompts: round 0 has P^T
    start = method.aggregate_setup(server_env, shared, [Upload(0, up, 12)], torch.Generator().manual_seed(1))
    assert server_env.text is not None and start["text_protos"].shape == (3, 384)
    assert torch.equal(start["prompts"], shared["prompts"]) and "text_release" in method.server_only
    # round 0: the client trains against P^T and does not release again
    broadcast = {k: v for k, v in start.items() if k not in method.server_only}
    handle = host.open(0, 0, data.num_train, broadcast)
    res = method.local_train(client_env, broadcast, private, data, rng=g, privacy=handle)
    up0 = handle.close(res.upload)
    assert set(up0) == {"protos", "counts"}
    assert [r.mechanism for r in ledger.releases] == ["embedding", "igpp"]
    # the client's whole run: 1 embedding release + 3 prototype releases at the common multiplier z;
    # after round 0 it has spent 2 of those 4 compositions, as Opacus computes it directly
    assert ledger.epsilon() == pytest.approx(epsilon_spent([(z, 1.0, 2)], delta=1e-5, accountant="rdp"), rel=1e-9)
    assert epsilon_spent([(z, 1.0, 4)], delta=1e-5) == pytest.approx(2.0, abs=0.011)  # calibrated to the target
    # a client that is not the selected one releases no text
    other = ClientData(1, x, y, x[:3], y[:3], 3)
    assert 1 not in method.setup_clients()
    h1 = host.open(1, 0, other.num_train, broadcast)
    up1 = h1.close(method.local_train(client_env, broadcast, method.init_private(client_env, other, g), other, rng=g,
                                      privacy=h1).upload)
    assert set(up1) == {"protos", "counts"}
    # the server trains its prompts on the class means, and keeps the release server-side
    new = method.aggregate(server_env, start, [Upload(0, up0, 12), Upload(1, up1, 12)], torch.Generator().manual_seed(1))
    assert math.isfinite(new.metrics["loss"]) and not torch.equal(new.state["prompts"], shared["prompts"])
    assert torch.equal(new.state["text_release"], start["text_release"])
    # the next round: no release again
    broadcast = {k: v for k, v in new.state.items() if k not in method.server_only}
    h2 = host.open(0, 1, data.num_train, broadcast)
    up2 = h2.close(method.local_train(client_env, broadcast, res.private, data, rng=g, privacy=h2).upload)
    assert set(up2) == {"protos", "counts"}
    assert [r.mechanism for r in ledger.releases] == ["embedding", "igpp", "igpp"]


def test_private_variant_end_to_end_shows_its_epsilon(tmp_path):
    """fedtsp with dp.epsilon: the epsilon lands in results.csv; what the server saw is only the noised
    release and the class means / counts; the old fedtsp.dp_epsilon key is refused with the new name."""
    import csv

    from raysim.build import build_config
    from raysim.engine.loop import run
    from raysim.errors import ConfigError
    from raysim.storage.store import StateStore

    with pytest.raises(ConfigError, match="dp.epsilon"):
        build_config({"method": "fedtsp", "fedtsp": {"dp_epsilon": 1.0}})
    cfg = build_config({
        "method": "fedtsp", "data": {"dataset": "digits", "shots": 8}, "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"num_clients": 3, "rounds": 2}, "execution": {"backend": "inline"},
        "output": {"out_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False, "cache_dir": str(tmp_path / "c"),
                   "record_uploads": True},
        "dp": {"epsilon": 2.0}, "fedtsp": {"plm": "clip", "model_family": "tiny"},
    })
    res = run(cfg)
    rows = list(csv.DictReader(open(res.out_dir / "results.csv")))
    eps = [float(r["epsilon_max"]) for r in rows]
    # dp_budget=split (default): the embedding (1 release at 0.5 x 2) and the class means (2 releases at 0.5 x 2)
    # are calibrated apart; the ledger composes both by RDP, which lands below the sum of the shares (1.45
    # measured) but above either share alone (each spends 1.0 at the end of the run)
    assert 0 < eps[0] < eps[1] <= 2.0 * (1 + 1e-6) and eps[1] > 1.0 * (1 + 1e-3)
    store = StateStore(res.out_dir)
    seen = store.load_uploads(0)["uploads"]
    assert set(seen[0]) == {"protos", "counts", "text_emb"} and all(set(seen[c]) == {"protos", "counts"} for c in (1, 2))
    assert set(store.load_uploads(1)["uploads"][0]) == {"protos", "counts"}


# ------------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("plm", ["bert", "clip"])
def test_fedtsp_end_to_end(tmp_path, plm):
    res, rows = run_on_digits(tmp_path, "fedtsp", {"plm": plm, "model_family": "tiny", "lam": 1.0})
    assert len(rows) == 2 * 4 and {r["round"] for r in rows} == {"0", "1"}
    assert res.summary["in_client"] > 0.2  # 10 classes: well above chance after two rounds
    assert all(float(r["in_top5"]) >= float(r["in_client"]) for r in rows)
    from raysim.storage.store import StateStore

    server = StateStore(res.out_dir).load_server(1)  # the server trained its prompts and temperature
    assert server["text_protos"].shape == (10, 384 if plm == "bert" else 128)
    import csv

    losses = [float(r["server_loss"]) for r in csv.DictReader(open(res.out_dir / "results.csv"))]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("method,section", [
    ("fedproto", {"model_family": "tiny"}),
    ("fedtgp", {"model_family": "tiny", "server_epochs": 3}),
    ("local", {"model_family": "tiny"}),
])
def test_baselines_end_to_end(tmp_path, method, section):
    """Two rounds on digits (Dirichlet 0.5, 3 clients): the clients' own-split accuracy beats what
    predicting each client's majority class would score (measured 0.50 against 0.31; the margin of 0.1
    leaves room for kernels that round differently)."""
    import numpy as np

    from raysim.build import build_config, make_method
    from raysim.engine.loop import prepare_data

    res, rows = run_on_digits(tmp_path, method, section, rounds=2, clients=3)
    assert len(rows) == 2 * 3
    cfg = build_config({"method": method, "data": {"dataset": "digits", "partition": "dirichlet", "beta": 0.5, "shots": 0},
                        "train": {"num_clients": 3}, "model": {"name": "raysim-tiny", "pretrained": ""},
                        "output": {"cache_dir": str(tmp_path / "c")}, method: section})
    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    majority = np.mean([np.bincount(data.y_test[te]).max() / len(te) for te in data.test_idx])
    in_client = np.mean([float(r["in_client"]) for r in rows if r["round"] == "1"])
    assert in_client > majority + 0.1, (in_client, majority)


# ------------------------------------------------------------------------------- semantic structure
def test_semantic_measures_on_toy_hierarchy():
    from raysim.methods.fedtsp.fedtsp_semantics import hierarchy_paths, semantic_alignment, semantic_gap, semantic_report, wu_palmer

    paths = [("animal", "mammal", "cat"), ("animal", "mammal", "dog"), ("animal", "bird"), ("vehicle", "car")]
    ref = wu_palmer(paths)
    assert ref[0, 1] == pytest.approx(2 * 2 / 6) and ref[0, 2] == pytest.approx(2 * 1 / 5) and ref[0, 3] == 0
    good = torch.tensor([[1.0, 0.1, 0.0], [1.0, 0.0, 0.1], [0.7, 0.7, 0.0], [-1.0, 0.0, 0.2]])
    bad = good[[3, 1, 2, 0]]  # cat and car swapped
    assert semantic_alignment(good, ref) > 0.8 > semantic_alignment(bad, ref)
    sim = torch.tensor([[1.0, 0.8, 0.6, 0.1], [0.8, 1.0, 0.4, 0.3], [0.6, 0.4, 1.0, 0.2], [0.1, 0.3, 0.2, 1.0]])
    groups = ["animal", "animal", "animal", "vehicle"]
    assert semantic_gap(sim, groups) == pytest.approx((0.8 + 0.6 + 0.4) / 3 - (0.1 + 0.3 + 0.2) / 3)
    names = ["cat", "dog", "airplane", "truck"]
    assert [p[0] for p in hierarchy_paths("cifar10", names)] == ["animal", "animal", "vehicle", "vehicle"]
    assert hierarchy_paths("cifar100", ["aquarium fish"])[0][1] == "fish"
    rep = semantic_report(torch.randn(4, 8), "cifar10", names)
    assert set(rep) == {"spearman", "semantic_gap"}


def test_bundled_descriptions_cover_datasets():
    from raysim.data.digits import DIGIT_NAMES
    from raysim.data.synthetic import CLASS_POOL
    from raysim.methods.fedtsp.fedtsp_descriptions import class_prompts, load_descriptions
    from raysim.methods.fedtsp.fedtsp_semantics import CIFAR10_PATHS, CIFAR100_SUPERCLASSES

    c100 = [c for cs in CIFAR100_SUPERCLASSES.values() for c in cs.split()]
    for ds, names in [("digits", DIGIT_NAMES), ("cifar10", list(CIFAR10_PATHS)), ("cifar100", c100),
                      ("synthetic-large", CLASS_POOL)]:
        prompts = class_prompts(names, dataset=ds)
        assert len(prompts) == len(names) and all(len(p) == 3 for p in prompts)
    assert len(load_descriptions("cifar100")) == 100
    assert class_prompts(["aquarium_fish"], dataset="cifar100")[0][0].startswith("A photo of a aquarium fish: ")
    assert class_prompts(["sweet pepper"], handcrafted=True) == [["A photo of a sweet pepper."]]
