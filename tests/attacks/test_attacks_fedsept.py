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
    final_model_logits,
    main,
    membership_pairs,
    query_features,
    recorded_update_features,
    update_features,
)
from raysim.engine.loop import run
from raysim.errors import ConfigError
from raysim.sampling import participants
from raysim.storage.store import StateStore


def records(out_dir) -> dict[int, dict]:
    store = StateStore(out_dir)
    return {r: store.load_uploads(r) for r in store.upload_rounds()}


def test_record_uploads_writes_the_declared_uploads_the_same_on_any_pool(tmp_path, cache_dir):
    base = dict(train={"rounds": 2, "n_ctx": 4, "participation": 0.5}, eval={"every": 2})
    one = records(run(tiny_config(tmp_path / "one", cache_dir, output={"record_uploads": True}, **base)).out_dir)
    two = records(run(tiny_config(tmp_path / "two", cache_dir, output={"record_uploads": True}, execution={"num_actors": 2},
                                  **base)).out_dir)
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


def test_own_test_nonmembers_are_the_targets_unseen_samples_of_its_classes():
    y_train = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3])
    y_test = np.array([0, 0, 1, 2, 0, 1, 1, 2, 3, 3, 3, 3, 3])
    train_idx = [np.arange(0, 5), np.arange(5, 12)]  # client 0: classes 0, 1; client 1: classes 2, 3
    test_idx = [np.array([0, 1, 2, 4, 5]), np.array([3, 7, 8, 9, 10, 11, 12])]
    p = membership_pairs(train_idx, [0, 1], seed=1, nonmembers="own_test", test_idx=test_idx, y_train=y_train, y_test=y_test)
    assert p.nonmembers == "own_test" and (p.in_test == ~p.member).all() and (p.owner == p.target).all()
    for t in (0, 1):
        mine = p.target == t
        mem, non = p.sample[mine & p.member], p.sample[mine & ~p.member]
        assert np.isin(mem, train_idx[t]).all() and np.isin(non, test_idx[t]).all()
        # class by class, min(#train, #test) of each
        assert sorted(y_train[mem]) == sorted(y_test[non]) == {0: [0, 0, 0, 1, 1], 1: [2, 2, 3, 3, 3]}[t]
    assert p.train.sum() == len(p) // 2 and p.member[p.train].sum() == p.member[~p.train].sum()
    # the default is SPEC 1.12's
    d = membership_pairs(train_idx, [0, 1], seed=1)
    assert d.nonmembers == "other_clients" and not d.in_test.any()
    with pytest.raises(ConfigError, match="nonmembers must be one of other_clients, own_test.*'own-test'"):
        membership_pairs(train_idx, [0], nonmembers="own-test")
    with pytest.raises(ConfigError, match="needs the clients' test_idx"):
        membership_pairs(train_idx, [0], nonmembers="own_test")


@pytest.fixture(scope="module")
def fedsept_run(tmp_path_factory, cache_dir):
    """Three recorded FedSEPT rounds whose personalised models fit their own few-shot data."""
    cfg = tiny_config(
        tmp_path_factory.mktemp("fedsept-mia"), cache_dir, method="fedsept", output={"record_uploads": True},
        train={"rounds": 3, "n_ctx": 4, "local_epochs": 3}, fedsept={"rank": 8},
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


def test_own_test_nonmembers_remove_the_class_signal(fedsept_run, capsys):
    """Under label skew, other clients' samples are of other classes: the query attacker reads the class.
    The target's own unseen test samples of its classes leave it only memorisation, which this short run
    barely has (measured: other_clients final AUC 0.96-0.99, own_test 0.42-0.46, over seeds 0-2)."""
    other = audit_run(fedsept_run).set_index("attack")
    own = audit_run(fedsept_run, nonmembers="own_test").set_index("attack")
    assert (own["nonmembers"] == "own_test").all() and (other["nonmembers"] == "other_clients").all()
    assert (own["pairs"] > 0).all() and (own["rounds"] == 3).all()
    for col in ("mean_auc", "final_auc"):
        assert own[col].between(0, 1).all()  # valid numbers, not nan
        assert own.loc["update-and-query", col] < other.loc["update-and-query", col] - 0.3
    # members and non-members carry the same (the target's) update features: chance up to the split's noise
    assert 0.3 < own.loc["update-only", "mean_auc"] < 0.7
    assert main([str(fedsept_run), "--nonmembers", "own_test"]) == 0
    assert "own_test |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(fedsept_run), "--nonmembers", "test"])
    assert "invalid choice: 'test'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="nonmembers must be one of"):
        audit_run(fedsept_run, nonmembers="test")


def test_final_model_logits_reads_test_rows_where_asked(fedsept_run):
    from raysim.build import build_config, make_method
    from raysim.config import load_yaml
    from raysim.engine.loop import prepare_data

    cfg = build_config(load_yaml(fedsept_run / "config.yaml"))
    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    tr, te = data.train_idx[1][:3], data.test_idx[1][:2]
    mixed = final_model_logits(fedsept_run, cfg, data, {1: np.r_[tr, te]}, in_test={1: np.r_[[False] * 3, [True] * 2]})[1]
    train_only = final_model_logits(fedsept_run, cfg, data, {1: tr})[1]
    test_only = final_model_logits(fedsept_run, cfg, data, {1: te}, in_test={1: np.ones(2, dtype=bool)})[1]
    torch.testing.assert_close(mixed, torch.cat([train_only, test_only]))
    assert not torch.allclose(test_only, final_model_logits(fedsept_run, cfg, data, {1: te})[1])  # other rows


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
    yield dict(clip=clip, env=env, images=images, labels=labels, grad=grad, targets=targets, method=method, shared=shared,
               data=data)
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


def test_text_jacobian_cache_is_shared_only_where_it_is_the_same(one_step_client):
    """The text Jacobian depends on theta_pre and R, not on the router: clients with the same theta_pre and
    R share one, and the gradient with the shared Jacobian equals the one computed afresh."""
    from raysim.attacks.gradient_inversion import TextJacobianCache, prompt_shared_grad

    c = one_step_client
    method, env, clip, shared = c["method"], c["env"], c["clip"], c["shared"]

    def client(seed: int, R_scale: float = 0.0) -> dict:
        private = method.init_private(env, c["data"], torch.Generator().manual_seed(seed))  # own router, R = 0
        private["R"] = private["R"] + R_scale * torch.randn(private["R"].shape, generator=torch.Generator().manual_seed(seed))
        return private

    def grad(private, cache=None):
        return prompt_shared_grad(method, env, clip, shared, private, cache=cache).fn(c["images"], c["labels"]).detach()

    cache = TextJacobianCache()
    clients = [client(10), client(11), client(12, R_scale=0.02), client(13)]
    cached = [grad(p, cache) for p in clients]
    for private, g in zip(clients, cached):
        fresh = grad(private)
        torch.testing.assert_close(g, fresh, rtol=1e-5, atol=1e-7)
        assert g.norm() > 0
    assert (cache.misses, cache.hits, len(cache)) == (2, 2, 2)  # R = 0 once, the client with its own R once
    assert not torch.allclose(cached[0], cached[1])  # the routers differ, so do the gradients
    assert not torch.allclose(cached[0], cached[2])
    # a different theta_pre is a different Jacobian
    other = {"A": shared["A"] + 0.01}
    prompt_shared_grad(method, env, clip, other, clients[0], cache=cache)
    assert cache.misses == 3
    small = TextJacobianCache(maxsize=1)
    for p in clients[:3]:
        prompt_shared_grad(method, env, clip, shared, p, cache=small)
    assert (small.misses, small.hits, len(small)) == (2, 1, 1)
