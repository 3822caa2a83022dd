"""FedTSP's private variant (fedtsp.txt 3.5, Table 4): `fedtsp.dp_budget=paper` releases only the
description embedding, once, with Eq. 11's sigma, sends the class means unnoised and says in its ledger that
its epsilon covers the descriptions only; `split` (the default) gives the embedding and the class means their
own shares of dp.epsilon, each calibrated on its own compositions. Noise is measured from the released tensor
against the clean one."""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from raysim.methods.base import ClientData, EnvSpec, TrainConfig  # noqa: E402
from raysim.models.clip import ModelSpec  # noqa: E402

C_CLIP, DELTA = 2.5, 1e-5  # the paper's C and delta (fedtsp.txt 4.6)
NAMES = ["zero", "one", "two"]


def eq11_sigma(epsilon: float, clip: float = C_CLIP, delta: float = DELTA) -> float:
    """fedtsp.txt Eq. 11: sigma = 2C sqrt(2 ln(1.25/delta)) / epsilon."""
    return 2.0 * clip * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def _setup(epsilon: float, rounds: int = 300, **opts):
    from raysim.config import DPConfig
    from raysim.methods.fedtsp.fedtsp import FedTSP, Options
    from raysim.privacy.host import HostPrivacy

    dp = DPConfig(epsilon=epsilon, delta=DELTA)
    o = Options(plm="bert", model_family="tiny", len_prompt=2, dp_clip=C_CLIP, **opts)
    o.validate()
    method = FedTSP(TrainConfig(batch_size=8, num_clients=2), o, dp)
    env = method.build_env(EnvSpec(ModelSpec(), NAMES, dataset="digits"), role="client")
    host = HostPrivacy(dp=dp, method=method, seed=1, batch_size=8, releases_per_client=lambda cid: rounds)
    return method, env, host


def _round(method, env, host, cid: int = 0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([0, 1, 2] * 4)
    data = ClientData(cid, x, y, x[:3], y[:3], 3)
    private = method.init_private(env, data, g)
    shared = method.init_shared(env, torch.Generator().manual_seed(0))
    up = {}
    if cid in method.setup_clients():  # Step 0, then round 0's training: each opened and closed as the engine does
        handle = host.open(cid, 0, data.num_train, shared)
        up.update(handle.close(method.local_setup(env, shared, private, data, rng=torch.Generator().manual_seed(1),
                                                  privacy=handle).upload))
    handle = host.open(cid, 0, data.num_train, shared)
    res = method.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(2), privacy=handle)
    return {**up, **handle.close(res.upload)}, res, data, private, shared


def _measured_embedding_std(method, env, released: torch.Tensor) -> tuple[float, int]:
    clean = method.embed_descriptions(env).double().reshape(-1)
    clipped = clean * min(1.0, C_CLIP / float(clean.norm()))
    noise = released.double().reshape(-1) - clipped
    return float(noise.std()), noise.numel()


@pytest.mark.parametrize("epsilon", [1.0, 8.0])
def test_paper_mode_noises_the_embedding_with_eq11_sigma_only(epsilon):
    from raysim.privacy.accountant import analytic_gaussian_delta
    from raysim.privacy.dpsgd import NoDP

    method, env, host = _setup(epsilon, dp_budget="paper")
    up, res, data, private, shared = _round(method, env, host)
    std, n = _measured_embedding_std(method, env, up["text_emb"])
    # n = 9 sequences x 77 positions x 384 = 266,112 coordinates: the std's relative standard error is
    # 1/sqrt(2n) = 0.14%, so the 2% tolerance is about 14 standard errors
    assert n > 200_000 and 0.02 > 5 / math.sqrt(2 * n)
    assert std == pytest.approx(eq11_sigma(epsilon), rel=0.02)
    # the class means leave unnoised, as the paper sends them (the same as without DP)
    clean = method.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(2), privacy=NoDP()).upload
    assert torch.allclose(up["protos"], clean["protos"], atol=1e-5)  # float32 recomputation
    # the ledger: one release, the embedding, whose epsilon is the exact one of that noise and says what it covers
    ledger = host.ledger(0)
    (r,) = ledger.releases
    assert r.mechanism == "embedding" and "description embedding only" in r.note and ledger.scope() == [r.note]
    assert r.sigma == pytest.approx(eq11_sigma(epsilon) / (2 * C_CLIP), rel=1e-12)
    eps = ledger.epsilon()
    assert 0 < eps <= epsilon
    # true: the Gaussian mechanism at that multiplier is (eps, delta)-DP, and not at 1% less (the exact value)
    assert analytic_gaussian_delta(r.sigma, eps) <= DELTA < analytic_gaussian_delta(r.sigma, 0.99 * eps)
    # a second round sends nothing new to the ledger
    h = host.open(0, 1, data.num_train, shared)
    h.close(method.local_train(env, shared, private, data, rng=torch.Generator(), privacy=h).upload)
    assert len(ledger.releases) == 1 and ledger.epsilon() == eps


def test_split_mode_calibrates_each_release_on_its_own_share():
    from raysim.privacy.accountant import calibrate_multiplier, epsilon_spent
    from raysim.privacy.prototypes import l2_clip

    eps, T, share_e, share_p = 8.0, 300, 0.25, 0.75
    method, env, host = _setup(eps, rounds=T, dp_share_embedding=share_e, dp_share_prototypes=share_p)
    up, _, data, _, _ = _round(method, env, host)
    z_e = calibrate_multiplier(epsilon=share_e * eps, delta=DELTA, plan=[(1.0, 1)])  # one release
    z_p = calibrate_multiplier(epsilon=share_p * eps, delta=DELTA, plan=[(1.0, T)])  # T releases, nothing else
    assert host.multiplier(0, data.num_train, "text_emb") == pytest.approx(z_e, rel=1e-12)
    assert host.multiplier(0, data.num_train, "protos") == pytest.approx(z_p, rel=1e-12)
    std, n = _measured_embedding_std(method, env, up["text_emb"])
    assert std == pytest.approx(2 * C_CLIP * z_e, rel=0.02)  # 266,112 coordinates: 2% is ~14 standard errors
    # the prototypes' noise, measured on a wide release through the same host (10 classes x 4096 = 40,960
    # coordinates: 2% is 5.7 standard errors); features inside the clip radius, so the clean means are exact
    R = host.dp.proto_clip
    feats = 1e-3 * torch.randn(200, 4096, generator=torch.Generator().manual_seed(5))
    labels = torch.arange(200) % 10
    h = host.open(1, 0, 200, {})
    noisy = h.release("protos", features=feats, labels=labels, num_classes=10)
    clean = torch.stack([l2_clip(feats, R)[labels == c].mean(0) for c in range(10)])
    measured = float((noisy.double() - clean.double()).std())
    # client 1 releases no embedding, so its class means get the whole epsilon (the shares are renormalised
    # over the releases a client makes): its own calibration, std = z 2R / n_c, n_c = 20
    z_1 = calibrate_multiplier(epsilon=eps, delta=DELTA, plan=[(1.0, T)])
    assert measured == pytest.approx(z_1 * 2 * R / 20, rel=0.02)
    # the embedding no longer pays for the 300 prototype compositions: the joint calibration (before #25)
    # put 5x more noise on it (the class means, at 3/4 of the budget, get more than under joint: their share)
    joint = calibrate_multiplier(epsilon=eps, delta=DELTA, plan=[(1.0, T + 1)])
    assert joint > 5 * z_e and z_p > joint
    # the ledger composes both shares: true (as Opacus computes it directly) and within dp.epsilon
    ledger = host.ledger(0)
    assert [r.mechanism for r in ledger.releases] == ["embedding", "igpp"]  # Step 0 first, then round 0's class means
    assert ledger.epsilon() == pytest.approx(epsilon_spent([(z_p, 1.0, 1), (z_e, 1.0, 1)], delta=DELTA), rel=1e-9)
    full = epsilon_spent([(z_p, 1.0, T), (z_e, 1.0, 1)], delta=DELTA)  # the whole run's
    assert full <= eps * (1 + 1e-6)


def test_split_mode_gives_a_client_without_descriptions_its_whole_budget_for_the_class_means():
    """The shares are renormalised over the releases a client makes: client 1 never releases the embedding,
    so its T prototype releases get all of dp.epsilon (not dp_share_prototypes of it); the dp client keeps
    its two shares."""
    from raysim.privacy.accountant import calibrate_multiplier, epsilon_spent

    eps, T = 2.0, 50
    method, env, host = _setup(eps, rounds=T, dp_share_embedding=0.25, dp_share_prototypes=0.75)
    assert method.releases_of(1) == ["protos", "counts"]
    whole = calibrate_multiplier(epsilon=eps, delta=DELTA, plan=[(1.0, T)])
    assert host.multiplier(1, 12, "protos") == pytest.approx(whole, rel=1e-12)
    assert host.multiplier(0, 12, "protos") == pytest.approx(calibrate_multiplier(epsilon=0.75 * eps, delta=DELTA,
                                                                                   plan=[(1.0, T)]), rel=1e-12)
    # over its whole run client 1 spends (up to the bisection's 0.01) dp.epsilon, no longer ~0.75 of it
    assert eps - 0.01 - 1e-9 <= epsilon_spent([(whole, 1.0, T)], delta=DELTA) <= eps * (1 + 1e-6)


def test_split_mode_with_a_pure_dp_prototype_mechanism_is_refused_at_config_time():
    """VPP's Laplace top-k spends epsilon itself, which a Gaussian budget share cannot calibrate: the run stops
    before it starts (not at the first release), saying what to choose."""
    from raysim.build import build_config
    from raysim.errors import ConfigError

    args = {"method": "fedtsp", "dp": {"epsilon": 1.0, "prototypes": "vpp"}, "data": {"dataset": "digits"},
            "fedtsp": {"model_family": "tiny"}}
    with pytest.raises(ConfigError, match=r"'protos' has a pure-DP part \(vpp.*use dp.prototypes=igpp"):
        build_config(args)
    build_config({**args, "fedtsp": {"model_family": "tiny", "dp_budget": "joint"}})  # one joint multiplier: fine


def test_split_is_the_default_and_the_shares_are_validated():
    from raysim.errors import ConfigError
    from raysim.methods.fedtsp.fedtsp import Options

    assert Options().dp_budget == "split"
    for bad in ({"dp_budget": "eq11"}, {"dp_share_embedding": 0.0}, {"dp_share_embedding": 0.7, "dp_share_prototypes": 0.7}):
        with pytest.raises(ConfigError, match="dp_budget|dp_share"):
            Options(**bad).validate()


def test_paper_mode_refuses_a_second_private_release():
    """The classical-Gaussian share spends the whole delta on one release: a method whose client has another
    private release under it is refused with the reason."""
    from raysim.errors import ConfigError
    from raysim.privacy.mechanisms import BudgetShare

    method, env, host = _setup(1.0, dp_budget="split")
    method.budget_shares = lambda: {"text_emb": BudgetShare(1.0, "classic_gaussian"), "protos": BudgetShare(0.5)}
    with pytest.raises(ConfigError, match="only private one"):
        host.multiplier(0, 12, "text_emb")


def test_eq11_against_the_joint_calibration_at_the_papers_scale():
    """The issue's numbers: at T = 300, C = 2.5 the joint multiplier (embedding + 300 prototype releases)
    puts 14.6x Eq. 11's noise on the embedding at epsilon 1 and 18x at epsilon 8."""
    from raysim.privacy.accountant import calibrate_multiplier

    for eps, ratio in ((1.0, 14.6), (8.0, 18.0)):
        joint = calibrate_multiplier(epsilon=eps, delta=DELTA, plan=[(1.0, 301)])
        assert 2 * C_CLIP * joint / eq11_sigma(eps) == pytest.approx(ratio, rel=0.02)  # the rounding


def test_paper_mode_run_says_what_its_epsilon_covers(tmp_path):
    """A short run in paper mode: the printed epsilon is the embedding's alone (the dp client's, exact and
    within dp.epsilon; the other clients spend nothing) and summary.md says it covers the descriptions only."""
    import csv

    from raysim.build import build_config
    from raysim.engine.loop import run

    cfg = build_config({
        "method": "fedtsp", "data": {"dataset": "digits", "shots": 8}, "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"num_clients": 3, "rounds": 2}, "execution": {"backend": "inline"},
        "output": {"out_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False, "cache_dir": str(tmp_path / "c")},
        "dp": {"epsilon": 8.0}, "fedtsp": {"plm": "clip", "model_family": "tiny", "dp_budget": "paper"},
    })
    res = run(cfg)
    eps = [float(r["epsilon_max"]) for r in csv.DictReader(open(res.out_dir / "results.csv"))]
    assert eps[0] == eps[1] and 7.0 < eps[0] <= 8.0  # one release in round 0, nothing after (7.91 at delta 1e-5)
    assert "description embedding only" in (res.out_dir / "summary.md").read_text()


def test_table4_spec_runs_the_papers_mechanism_and_the_default(tmp_path):
    from pathlib import Path

    from raysim.build import make_method
    from raysim.tools.compare import plan, spec_from_args

    s, _ = spec_from_args([str(Path(__file__).resolve().parents[2] / "benchmarks" / "tables" / "fedtsp_table4.yaml")])
    seen: dict[str, set] = {}
    for _cell, entry, _folder, cfg in plan(s, tmp_path):
        opts = make_method(cfg).opts
        seen.setdefault(entry.label, set()).add((cfg.dp.epsilon, opts.dp_budget if cfg.dp.enabled else None))
        assert opts.dp_clip == 2.5 and cfg.dp.delta == 1e-5  # fedtsp.txt 4.6
    eps = {1.0, 2.0, 4.0, 8.0}
    rows = list(seen.values())
    assert {(e, "paper") for e in eps} in rows and {(e, "split") for e in eps} in rows
    assert {(math.inf, None)} in rows  # the no-DP row, in every column


def _server(method):
    return method.build_env(EnvSpec(ModelSpec(), NAMES, dataset="digits"), role="server")


def test_paper_mode_releases_the_clipped_noised_clean_embedding_and_the_clean_end_positions():
    """#46: the release is Clip_C(vec E) + N(0, sigma^2) of the clean E (by hand, on the host's seeded stream),
    and the end positions the server uses are those of the clean tokens, sent beside it (the code knows
    them), not positions guessed from the noise; BERT's release is cut after the longest sequence, as the
    no-DP path pads to the longest prompt."""
    from raysim.methods.base import Upload
    from raysim.privacy.accountant import classic_gaussian_multiplier
    from raysim.sampling import generator

    eps = 1.0
    method, env, host = _setup(eps, dp_budget="paper")
    assert method.opts.positions == "tokens" and method.releases_of(0) == ["protos", "counts", "text_emb", "text_ends"]
    up, _, _, _, shared = _round(method, env, host)
    clean = method.embed_descriptions(env)
    v = clean.double().reshape(-1)
    v = v * min(1.0, C_CLIP / float(v.norm()))
    noise = torch.randn(v.shape, generator=generator(1, "dp-release", "text_emb", 0, 0), dtype=torch.float64)
    z = classic_gaussian_multiplier(epsilon=eps, delta=DELTA)
    expected = (v + 2 * C_CLIP * z * noise).reshape(clean.shape).float()
    # float32 output of a float64 computation: |values| < 6 sigma = 145, so 1e-4 is ~10 float32 ulps
    assert torch.allclose(up["text_emb"], expected, atol=1e-4, rtol=0)
    texts = [t for ts in method._prompt_texts(env) for t in ts]  # k = 3 descriptions for every class
    plm = method._load_plm(env)
    enc = plm.tokenizer(texts, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    ends = enc["attention_mask"].sum(-1) - 1
    assert torch.equal(up["text_ends"], ends)
    # the server builds its text from the release at exactly those positions
    senv = _server(method)
    state = method.receive_release(senv, shared, [Upload(0, up, 12)])
    assert torch.equal(state["text_ends"], ends)
    assert senv.text.base.shape[1] == int(ends.max()) + 1  # what embed() pads to for the same texts
    assert torch.allclose(senv.text.base, up["text_emb"][:, : int(ends.max()) + 1])


@pytest.mark.parametrize("plm_kind", ["bert", "clip"])
def test_a_noiseless_release_at_the_clean_end_positions_is_the_no_dp_text(plm_kind):
    """With the end positions known, the release path differs from the no-DP path by the noise alone: the
    clean fixed-length embedding gives the server's own text prototypes (BERT: cut to the longest prompt;
    CLIP: its EOT positions). Without the positions (dp_positions=noised) the text is another one."""
    from raysim.methods.fedtsp.fedtsp_descriptions import class_prompts
    from raysim.models.plm import TextPrototypes, load_plm

    plm = load_plm(plm_kind, spec=ModelSpec())
    per = class_prompts(NAMES, dataset="digits")
    texts = [t for ts in per for t in ts]
    prompts = 0.02 * torch.randn(len(NAMES), 2, plm.width, generator=torch.Generator().manual_seed(0))
    want = TextPrototypes.from_texts(plm, per)(prompts)
    emb, ends = plm.embed_fixed(texts).float(), plm.end_index_fixed(texts)
    got = TextPrototypes.from_release(plm, emb, len(NAMES), ends=ends)(prompts)
    # the same float32 network on the same inputs (CLIP: the same tensors; BERT: the same values, cut)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    if plm_kind == "bert":  # all 77 positions, padding included (no mask, as the code): another text
        assert not torch.allclose(TextPrototypes.from_release(plm, emb, len(NAMES))(prompts), want, atol=1e-3)
    else:  # under Eq. 11's noise at epsilon 8 (std 3.03), the end positions guessed from the release are wrong
        noisy = emb + 3.03 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(1))
        assert not torch.equal(plm.layout_release(noisy)[1], plm.layout_release(noisy, ends)[1])


def test_code_mode_noises_the_unclipped_embedding_and_records_no_epsilon():
    """fedtsp.dp_budget=code, the authors' clip_base_v2_dp.py: Eq. 11's sigma added to the unclipped
    embedding (by hand on the seeded stream); the ledger holds one invalid release with epsilon inf and the
    claimed epsilon beside it, and what the run prints says it is not a guarantee."""
    from raysim.build import build_config
    from raysim.engine.loop import privacy_scope
    from raysim.privacy.accountant import classic_gaussian_multiplier
    from raysim.privacy.dpsgd import NoDP
    from raysim.sampling import generator

    eps = 8.0
    method, env, host = _setup(eps, dp_budget="code")
    up, _, data, private, shared = _round(method, env, host)
    clean = method.embed_descriptions(env).double()
    noise = torch.randn(clean.numel(), generator=generator(1, "dp-release", "text_emb", 0, 0), dtype=torch.float64)
    expected = clean + 2 * C_CLIP * classic_gaussian_multiplier(epsilon=eps, delta=DELTA) * noise.reshape(clean.shape)
    assert torch.allclose(up["text_emb"].double(), expected, atol=1e-5, rtol=0)  # |values| < 20: float32 rounding
    assert float((up["text_emb"].double() - clean).std()) == pytest.approx(eq11_sigma(eps), rel=0.02)
    ledger = host.ledger(0)
    (r,) = ledger.releases
    assert not r.valid and not ledger.valid and r.claimed_epsilon == eps and "NOT a guarantee" in r.note
    assert math.isinf(ledger.epsilon()) and math.isinf(host.epsilon(0))  # epsilon_max: nan in results.csv
    # the class means leave unnoised, as the code sends them: the same as the round without any DP
    no_dp = method.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(2), privacy=NoDP()).upload
    assert torch.allclose(up["protos"], no_dp["protos"], atol=1e-5)  # float32 recomputation
    assert method.releases["protos"].kind == "public"
    cfg = build_config({"method": "fedtsp", "data": {"dataset": "digits"}, "dp": {"epsilon": eps},
                        "fedtsp": {"model_family": "tiny", "plm": "bert", "dp_budget": "code"}})
    assert "the epsilon is NOT a guarantee" in privacy_scope(cfg)


def test_end_positions_option_is_validated_and_defaults_per_budget():
    from raysim.errors import ConfigError
    from raysim.methods.fedtsp.fedtsp import Options

    assert [Options(dp_budget=b).positions for b in ("paper", "code", "split", "joint")] == ["tokens", "tokens", "noised", "noised"]
    assert Options(dp_budget="paper", dp_positions="noised").positions == "noised"
    for bad in ({"dp_positions": "eot"}, {"dp_positions": "tokens", "dp_budget": "joint"}):
        with pytest.raises(ConfigError, match="dp_positions"):
            Options(**bad).validate()
    method, _, _ = _setup(1.0, dp_budget="paper", dp_positions="noised")
    assert method.releases_of(0) == ["protos", "counts", "text_emb"]
    assert "same token counts" not in method.budget_shares()["text_emb"].note
    assert "same token counts" in _setup(1.0, dp_budget="paper")[0].budget_shares()["text_emb"].note


def test_text_from_client_without_dp_sends_the_clean_embedding_at_the_clean_end_positions():
    """fedtsp.text_from_client (the private path without DP, Table 4's like-for-like row): the dp client
    uploads its clean embedding and end positions, the server is built without class names, and the text
    it builds is the no-DP server's own (the paths differ only in when the text arrives)."""
    from raysim.methods.base import Upload
    from raysim.methods.fedtsp.fedtsp import FedTSP, Options
    from raysim.privacy.dpsgd import NoDP

    method, env, _ = _setup(math.inf, text_from_client=True)
    assert not method.needs().server_classnames and method.releases_of(0)[2:] == ["text_emb", "text_ends"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    data = ClientData(0, x, torch.tensor([0, 1, 2] * 4), x[:3], torch.tensor([0, 1, 2]), 3)
    shared = method.init_shared(_server(method), g)
    assert "text_protos" not in shared  # nothing until the dp client's release (Step 0)
    assert method.setup_clients() == (0,)
    up = method.local_setup(env, shared, method.init_private(env, data, g), data, rng=g, privacy=NoDP()).upload
    emb, ends = method.describe(env)
    assert torch.equal(up["text_emb"], emb) and torch.equal(up["text_ends"], ends)
    senv = _server(method)
    method.receive_release(senv, shared, [Upload(0, up, 12)])
    plain = FedTSP(method.train, Options(plm="bert", model_family="tiny", len_prompt=2), method.dp)
    penv = plain.build_env(EnvSpec(ModelSpec(), NAMES, dataset="digits"), role="server")
    prompts = shared["prompts"]
    # the same float32 BERT on the same embeddings (cut to the longest prompt): rounding only
    assert torch.allclose(senv.text(prompts), penv.text(prompts), atol=1e-5, rtol=1e-4)


def _step0_config(tmp_path, name: str, *, rounds: int = 2, dp: float = math.inf, **fedtsp):
    from raysim.build import build_config
    return build_config({
        "method": "fedtsp", "data": {"dataset": "digits", "partition": "dirichlet", "beta": 0.5, "shots": 4},
        "model": {"name": "raysim-tiny", "pretrained": ""}, "train": {"num_clients": 2, "rounds": rounds},
        "eval": {"every": 1, "last": 1}, "execution": {"backend": "inline"}, "dp": {"epsilon": dp, "delta": DELTA},
        "output": {"out_dir": str(tmp_path / name), "progress": False, "tensorboard": False, "cache_dir": str(tmp_path / "c")},
        "fedtsp": {"plm": "clip", "model_family": "tiny", **fedtsp},
    })


def test_with_a_clean_release_the_private_path_is_the_no_dp_run_round_by_round(tmp_path):
    """#46: the private path's description release is FedTSP's Step 0, before round 0 trains, so with a clean
    release (text_from_client: the dp client's embedding and end positions, unnoised) its run is the no-DP run:
    round 0 already trains against P^T, and every round's P^T, prompts and accuracies are the no-DP ones. The
    mechanism is then the only difference between the private rows and the no-DP row."""
    import csv

    from raysim.engine.loop import run
    from raysim.storage.store import StateStore

    plain = run(_step0_config(tmp_path, "nodp"))
    client = run(_step0_config(tmp_path, "client", text_from_client=True))
    a, b = StateStore(plain.out_dir), StateStore(client.out_dir)
    for r in range(2):
        sa, sb = a.load_server(r), b.load_server(r)
        assert "text_release" in sb and "text_release" not in sa  # the paths did differ: the text came from a client
        # the same float32 text tower on the same embeddings at the same positions: rounding only
        for key in ("text_protos", "prompts", "logit_scale"):
            assert torch.allclose(sa[key], sb[key], atol=1e-5, rtol=1e-4), (r, key)
    rows = [list(csv.DictReader(open(res.out_dir / "client_results.csv"))) for res in (plain, client)]
    assert len(rows[0]) == len(rows[1]) == 2 * 2
    for x, y in zip(*rows):
        assert (x["round"], x["client"]) == (y["round"], y["client"])
        # P^T equal to rounding: a prediction flips only on a near-tie, so allow one test example per client
        n = int(x["n_in"])
        assert abs(float(x["in_client"]) - float(y["in_client"])) <= 1.0 / n + 1e-9, (x, y)
    # the round-0 training used the text term in both: the losses match (without P^T round 0 is CE alone)
    la, lb = ([float(r["train_loss"]) for r in csv.DictReader(open(res.out_dir / "results.csv"))] for res in (plain, client))
    assert la == pytest.approx(lb, rel=1e-4)
