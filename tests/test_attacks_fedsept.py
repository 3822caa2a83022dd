"""The privacy attacks of fedsept.txt section 5.5 (SPEC 1.12): what an honest-but-curious server records,
update-based membership inference, and gradient inversion from one client's update."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import tiny_config
from raysim.attacks.update_mia import (
    QUERY_FEATURES,
    UPDATE_FEATURES,
    audit_run,
    main,
    membership_pairs,
    query_features,
    recorded_update_features,
    update_features,
)
from raysim.engine import run
from raysim.errors import ConfigError
from raysim.sampling import participants
from raysim.store import StateStore


def records(out_dir) -> dict[int, dict]:
    store = StateStore(out_dir)
    return {r: store.load_uploads(r) for r in store.upload_rounds()}


def test_record_uploads_writes_the_declared_uploads_the_same_on_any_pool(tmp_path, cache_dir):
    base = dict(rounds=2, n_ctx=4, participation=0.5, eval_every=2)
    one = records(run(tiny_config(tmp_path / "one", cache_dir, record_uploads=True, **base)).out_dir)
    two = records(run(tiny_config(tmp_path / "two", cache_dir, record_uploads=True, num_actors=2, **base)).out_dir)
    off = run(tiny_config(tmp_path / "off", cache_dir, **base)).out_dir
    assert not (off / "uploads").exists()
    assert sorted(one) == sorted(two) == [0, 1]
    for r, rec in one.items():
        assert set(rec) == {"pre", "uploads", "num_samples"}
        assert list(rec["uploads"]) == participants(1, r, 4, 0.5)  # every participant, in client-id order
        assert all(set(t) == {"ctx"} for t in rec["uploads"].values())  # only the declared upload
        assert list(rec["pre"]) == ["ctx"]
        assert torch.equal(rec["pre"]["ctx"], two[r]["pre"]["ctx"]) and rec["num_samples"] == two[r]["num_samples"]
        assert rec["uploads"].keys() == two[r]["uploads"].keys()
        assert all(torch.equal(rec["uploads"][c]["ctx"], two[r]["uploads"][c]["ctx"]) for c in rec["uploads"])
    # the broadcast state of round 1 is PromptFL's weighted mean of round 0's uploads
    ups, n = one[0]["uploads"], one[0]["num_samples"]
    mean = sum(ups[c]["ctx"] * n[c] for c in ups) / sum(n.values())
    assert torch.allclose(one[1]["pre"]["ctx"], mean, atol=1e-6)


def test_update_features_by_hand():
    posts = [[3.0, 4.0, 0.0, 0.0], [3.0, 4.0, 1.0, 0.0], [3.0, 4.0, 3.0, 1e-7], [3.0, 4.0, 4.0, 0.0]]
    pres = [[0.0] * 4] + posts[:-1]
    f = update_features([(np.array(a), np.array(b)) for a, b in zip(pres, posts)], window=3)
    col = {k: f[:, i] for i, k in enumerate(UPDATE_FEATURES)}
    assert f.shape == (4, 11)
    np.testing.assert_allclose(col["delta_norm"], [5, 1, 2, 1])
    np.testing.assert_allclose(col["q0"], [0, 0, 1e-7, 0])
    np.testing.assert_allclose(col["q100"], [4, 4, 4, 4])
    np.testing.assert_allclose(col["q50"], [1.5, 2, 3, 3.5])
    np.testing.assert_allclose(col["q25"], np.quantile(posts, 0.25, axis=1))
    np.testing.assert_allclose(col["sparsity"], [0.5, 0.25, 0.25, 0.25])  # 1e-7 counts as zero
    np.testing.assert_allclose(col["drift"], [0, 1, 2, 1], atol=1e-6)
    # deltas: (3,4,0,0), (0,0,1,0), (0,0,2,0), (0,0,1,0); the window of 3 drops the first one at round 3
    np.testing.assert_allclose(col["window_cos"], [0, 0, 0.5, 1], atol=1e-6)


def test_query_features_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]])
    q = query_features(probs.log(), torch.tensor([1, 2]))
    col = {k: q[:, i] for i, k in enumerate(QUERY_FEATURES)}
    np.testing.assert_allclose(col["max_prob"], [0.7, 0.5])
    np.testing.assert_allclose(col["margin"], [0.5, 0.25])
    np.testing.assert_allclose(col["entropy"], -(probs * probs.log()).sum(1).numpy(), rtol=1e-6)
    np.testing.assert_allclose(col["true_prob"], [0.2, 0.5])
    np.testing.assert_allclose(col["ce_loss"], -np.log([0.2, 0.5]), rtol=1e-6)


def test_membership_pairs_are_balanced_and_split_in_half():
    train_idx = [np.arange(0, 10), np.arange(10, 16), np.arange(16, 40)]
    p = membership_pairs(train_idx, [0, 1, 2], seed=3)
    assert len(p) == 2 * (10 + 6 + 24 - 8)  # client 2 has 24 samples, but only 16 outside it
    for t, idx in enumerate(train_idx):
        mine = p.target == t
        assert p.member[mine].sum() == (~p.member[mine]).sum()
        assert np.isin(p.sample[mine & p.member], idx).all() and not np.isin(p.sample[mine & ~p.member], idx).any()
        assert (p.owner[mine & p.member] == t).all()
    assert p.train.sum() == len(p) // 2 and p.member[p.train].sum() == p.member[~p.train].sum()
    again = membership_pairs(train_idx, [0, 1, 2], seed=3)
    assert np.array_equal(p.sample, again.sample) and np.array_equal(p.train, again.train)


@pytest.fixture(scope="module")
def fedsept_run(tmp_path_factory, cache_dir):
    """Three recorded FedSEPT rounds whose personalised models fit their own few-shot data."""
    cfg = tiny_config(
        tmp_path_factory.mktemp("fedsept-mia"), cache_dir, method="fedsept", record_uploads=True, rounds=3, n_ctx=4,
        local_epochs=3, fedsept={"rank": 8},
    )
    return run(cfg).out_dir


def test_update_mia_near_chance_and_query_attack_succeeds_without_dp(fedsept_run):
    feats = recorded_update_features(fedsept_run)
    assert sorted(feats) == [0, 1, 2] and all(sorted(f) == [0, 1, 2, 3] for f in feats.values())
    df = audit_run(fedsept_run).set_index("attack")
    assert list(df.index) == ["update-only", "update-and-query"]
    assert ((df[["mean_auc", "final_auc"]] >= 0) & (df[["mean_auc", "final_auc"]] <= 1)).all().all()
    assert (df["rounds"] == 3).all() and (df["targets"] == 4).all()
    only, query = df.loc["update-only"], df.loc["update-and-query"]
    assert query["final_auc"] > 0.8 and query["final_auc"] > only["final_auc"] + 0.2
    assert 0.3 < only["mean_auc"] < 0.7  # client-level features: near chance (paper 0.45-0.50)


def test_update_mia_cli_and_unrecorded_runs(fedsept_run, tmp_path, capsys):
    assert main([str(fedsept_run), "--targets", "0", "1", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| attack | mean_auc | final_auc |") and "| update-and-query |" in out
    with pytest.raises(ConfigError, match="record_uploads=true"):
        recorded_update_features(tmp_path)
    assert main([str(tmp_path)]) == 2
    assert "config.yaml" in capsys.readouterr().err


# -- gradient inversion -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_step_client(cache_dir):
    """One FedSEPT client (4 digits of distinct classes) taking one plain SGD step on all of its data,
    with and without DP-SGD (epsilon=1 for this one step); the server sees theta_pre and the theta_post.

    raysim-tiny is a random CLIP, so any two images have CLIP embeddings with cosine near 1; CLIPCos
    here measures how closely the attack recovers the images' features, not semantics."""
    from raysim.attacks.gradient_inversion import image_features, observed_gradient, prompt_shared_grad
    from raysim.data import DATASETS, LoadSpec
    from raysim.methods import ClientData, EnvSpec, TrainConfig, get_method
    from raysim.models.clip import ModelSpec, load_clip
    from raysim.privacy import DPSGD, NoDP, noise_multiplier

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine's hosts run (num_threads=1); small ops crawl when oversubscribed
    torch.manual_seed(0)
    spec = ModelSpec("raysim-tiny", "", cache_dir=cache_dir)
    bundle = DATASETS.get("digits")(LoadSpec(data_root=".", image_size=32, cache_dir=cache_dir))
    rows = [int(np.flatnonzero(bundle.train.labels == c)[0]) for c in (0, 3, 5, 8)]
    images = torch.stack([bundle.train.images[i] for i in rows])
    labels = torch.as_tensor(bundle.train.labels[rows])
    clip = load_clip(spec)
    eta = 1e-3
    cls = get_method("fedsept")
    # no momentum, no weight decay, one batch: g^ is exact; no router dropout: the attacker's router matches
    method = cls(TrainConfig(lr=eta, momentum=0.0, weight_decay=0.0, batch_size=4, n_ctx=4),
                 cls.Options(experts=4, rank=16, router_dropout=0.0))
    env = method.build_env(EnvSpec(spec, bundle.classnames), role="client")
    with torch.no_grad():
        feats = image_features(clip, images)
    data = ClientData(0, feats, labels, feats, labels, len(bundle.classnames))
    shared = method.init_shared(env, torch.Generator().manual_seed(1))
    private = method.init_private(env, data, torch.Generator().manual_seed(2))
    sigma = noise_multiplier(epsilon=1.0, delta=1e-5, sample_rate=1.0, steps=1)
    dp = DPSGD(sigma=sigma, clip=1.0, sample_rate=1.0, generator=torch.Generator().manual_seed(3))
    post = {name: method.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(4), privacy=h).upload["A"]
            for name, h in (("clean", NoDP()), ("dp", dp))}
    grad = prompt_shared_grad(method, env, clip, shared, private)
    targets = {k: grad.target(observed_gradient(shared["A"], v, lr=eta)) for k, v in post.items()}
    yield dict(clip=clip, env=env, images=images, labels=labels, grad=grad, targets=targets)
    torch.set_num_threads(threads)


def test_gradient_builder_reproduces_the_observed_update(one_step_client):
    c = one_step_client
    exact = c["grad"].fn(c["images"], c["labels"]).detach()
    cos = torch.nn.functional.cosine_similarity(exact.reshape(-1), c["targets"]["clean"].reshape(-1), dim=0)
    assert cos > 0.9999 and torch.allclose(exact, c["targets"]["clean"], rtol=1e-3, atol=1e-4)
    assert c["grad"].offset.norm() > 10 * exact.norm()  # L_div dominates g^ until the server removes it


def test_gradient_inversion_leaks_without_dp_and_not_under_dp(one_step_client):
    from raysim.attacks.gradient_inversion import ClientView, multi_client_gia, pixel_range, reconstruction_metrics

    c = one_step_client
    views = [ClientView(c["grad"].fn, c["targets"][k], c["labels"], c["images"]) for k in ("clean", "dp")]
    clean, dp = multi_client_gia(views, clip=c["clip"], env=c["env"], image_size=32, iterations=120, restarts=2, seed=0)
    low, high = pixel_range()
    noise = torch.randn(c["images"].shape, generator=torch.Generator().manual_seed(5))
    baseline = reconstruction_metrics(torch.max(torch.min(noise, high), low), c["images"], clip=c["clip"], env=c["env"])
    assert clean.grad_cos > 0.99
    # the reconstructions' features are much closer to the originals' than random images' are
    assert 1 - clean.clip_cos < 0.75 * (1 - baseline.clip_cos)
    assert dp.grad_cos < clean.grad_cos - 0.1 and dp.clip_cos < baseline.clip_cos < clean.clip_cos
    assert all(math.isfinite(m.psnr) and 0 <= m.top1 <= 1 for m in (clean, dp, baseline))
