"""The privacy audit: FSH and prototype-MIA metrics against reference computations, the hijacking on a
worked example, `raysim audit` on recorded runs of both attack families, and the shipped study specs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config

from raysim.attacks.fsh import FSHConfig, attacked_classes, frechet_distance, fsh_metrics, hijack
from raysim.attacks.prototype_mia import roc_metrics
from raysim.engine.loop import run
from raysim.storage.runfolder import RunFolder as RunView
from raysim.tools.audit import GIABudget, audit_folder, audit_run, clients_then_rounds, main, per_round_means

ROOT = Path(__file__).resolve().parents[2]


# -- metrics against references ---------------------------------------------------------------

def _direct_frechet(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.linalg import sqrtm

    sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root = sqrtm(sa @ sb)
    return float(np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(sa + sb - 2 * np.real(root)))


def test_frechet_distance_matches_the_direct_formula():
    rng = np.random.default_rng(0)
    a = rng.normal(0.0, 1.0, (200, 4)) @ rng.normal(size=(4, 4))
    b = rng.normal(0.5, 2.0, (150, 4))
    # the eigenvalue route and scipy's sqrtm of S_a S_b agree to round-off of a 4x4 eigenproblem
    assert frechet_distance(a, b) == pytest.approx(_direct_frechet(a, b), rel=1e-8)
    # singular covariances (fewer rows than dimensions: 16 dummies in 512-d) stay finite and agree
    c, d = rng.normal(size=(5, 8)), rng.normal(1.0, 1.0, (40, 8))
    assert frechet_distance(c, d) == pytest.approx(_direct_frechet(c, d), rel=1e-5)  # sqrtm of a rank-4 product: looser
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)
    # two Gaussians with known parameters: ||mu||^2 + tr(S1 + S2 - 2 sqrt(S1 S2)) = 4 * 1 + 4 * (1 + 4 - 2 * 2) = 8
    x, y = rng.normal(0, 1, (200_000, 4)), rng.normal(1, 2, (200_000, 4))
    assert frechet_distance(x, y) == pytest.approx(8.0, abs=0.05)  # sampling error of 200k draws


def _sklearn_metrics(member: np.ndarray, nonmember: np.ndarray) -> tuple[float, float, float, float, float]:
    from sklearn.metrics import precision_recall_curve, roc_auc_score, roc_curve

    y = np.r_[np.ones(len(member)), np.zeros(len(nonmember))]
    s = np.r_[member, nonmember]
    fpr, tpr, _ = roc_curve(y, s, drop_intermediate=False)
    prec, rec, _ = precision_recall_curve(y, s)
    f1 = np.where(prec + rec > 0, 2 * prec * rec / np.maximum(prec + rec, 1e-300), 0)
    return (roc_auc_score(y, s), tpr[fpr <= 0.01].max(), tpr[fpr <= 0.001].max(), float((tpr - fpr).max()), float(f1.max()))


@pytest.mark.parametrize("ties", [False, True])
def test_mia_metrics_agree_with_scikit_learn(ties):
    rng = np.random.default_rng(1)
    a, b = rng.normal(1.0, 1.0, 1500), rng.normal(0.0, 1.0, 2000)
    if ties:  # rounded scores: many tied thresholds
        a, b = np.round(a, 1), np.round(b, 1)
    ours, ref = roc_metrics(a, b), _sklearn_metrics(a, b)
    for name, x, r in zip(("auc", "tpr@1%", "tpr@0.1%", "advantage", "f1"), ours, ref):
        assert x == pytest.approx(r, abs=1e-9), name


def test_a_class_released_as_several_centres_scores_each_sample_by_its_best_centre():
    from raysim.attacks.prototype_mia import membership_scores
    from raysim.tools.audit import released_prototypes

    feats = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    labels = torch.tensor([0, 0, 1])
    protos = {0: torch.tensor([[1.0, 0.0], [0.0, 1.0]]), 1: torch.tensor([0.0, 1.0])}  # class 0: two centres
    s = membership_scores(feats, labels, protos)
    assert s.tolist() == pytest.approx([1.0, 1.0, 2**-0.5])  # each class-0 sample matches one centre exactly
    assert membership_scores(feats, labels, protos, metric="l2").tolist() == pytest.approx([0.0, -1.0, -1.0])
    # FedPLVM's upload: centres with their labels -> per class its centres, counted by how many it has
    up = {"centres": torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]), "centre_labels": torch.tensor([0, 0, 2])}
    by_class, counts = released_prototypes(up, torch.tensor([0, 2]), 3)
    assert sorted(by_class) == [0, 2] and by_class[0].shape == (2, 2) and counts.tolist() == [2.0, 0.0, 1.0]
    up = {"protos": torch.ones(3, 2), "counts": torch.tensor([4.0, 0.0, 1.0])}
    by_class, counts = released_prototypes(up, torch.tensor([0]), 3)
    assert sorted(by_class) == [0, 2] and counts.tolist() == [4.0, 0.0, 1.0]


def test_fsh_metrics_and_classes_by_hand():
    clean = torch.tensor([1.0, 0.0])
    feats = torch.tensor([[2.0, 0.0], [1.0, 1.0], [0.0, 3.0]])  # cosines 1, 1/sqrt(2), 0
    logits = torch.tensor([[0.0, 5.0], [1.0, 0.0], [0.0, 2.0]])  # predicted 1, 0, 1
    real = torch.tensor([[1.0, 0.0], [1.2, 0.1], [0.8, -0.1], [1.0, 0.2]])
    m = fsh_metrics(feats, logits, 1, clean, real)
    assert m.cos_sim == pytest.approx((1 + 2**-0.5 + 0) / 3)
    assert m.top1_hit == pytest.approx(200 / 3)
    assert m.cffd == pytest.approx(frechet_distance(feats.numpy(), real.numpy()))
    assert attacked_classes(torch.tensor([5.0, 0.0, 9.0, 5.0, 1.0]), 3) == [2, 0, 3]  # most samples; ties: lower id
    assert attacked_classes(torch.tensor([0.0, 2.0]), 3) == [1]


def test_clients_then_rounds_by_hand():
    rows = [  # round 0: clients 0 (two classes: 0.2, 0.4 -> 0.3) and 1 (0.5); round 1: client 0 (0.7), client 1 (0.9)
        {"round": 0, "client": 0, "x": 0.2}, {"round": 0, "client": 0, "x": 0.4}, {"round": 0, "client": 1, "x": 0.5},
        {"round": 1, "client": 0, "x": 0.7}, {"round": 1, "client": 1, "x": 0.9},
    ]
    mean, std = clients_then_rounds(rows, ["x"])["x"]
    assert mean == pytest.approx(((0.3 + 0.5) / 2 + (0.7 + 0.9) / 2) / 2)
    assert std == pytest.approx(0.2)  # over rounds of the per-round client means 0.4 and 0.8 (vpdr.txt E.6.2's mean ± std)
    means = per_round_means(rows, ["x"])
    assert list(means["round"]) == [0, 1] and list(means["x"]) == pytest.approx([0.4, 0.8])


def test_hijack_recovers_a_target_feature_and_stops_early():
    """A linear extractor of 3x4x4 images: a target that some valid image produces is matched almost
    exactly; a target no image can produce (noise 50x the feature scale) is matched far worse."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(48, 6, generator=g) / 7

    def extract(x):
        return x.flatten(1) @ W

    real = torch.rand(1, 3, 4, 4, generator=g) * 2 - 1
    target = extract(real)[0]
    cfg = FSHConfig(dummies=4, lr=0.05, tv_weight=0.0, max_steps=3000, patience=50, min_steps=100)
    low, high = torch.full((1, 3, 1, 1), -1.0), torch.full((1, 3, 1, 1), 1.0)
    h = hijack(extract, target, shape=(3, 4, 4), generator=torch.Generator().manual_seed(1), cfg=cfg, low=low, high=high)
    cos = torch.nn.functional.cosine_similarity(h.features, target.expand_as(h.features), dim=-1)
    assert cos.min() > 0.999 and h.loss < 1e-3
    assert h.steps < cfg.max_steps  # stopped by patience
    assert h.images.min() >= -1 and h.images.max() <= 1  # clamped to the valid range
    noisy = target + 50 * target.norm() * torch.randn(6, generator=g)
    far = hijack(extract, noisy, shape=(3, 4, 4), generator=torch.Generator().manual_seed(1), cfg=cfg, low=low, high=high)
    cos_clean = torch.nn.functional.cosine_similarity(far.features, target.expand_as(far.features), dim=-1)
    assert cos_clean.mean() < 0.9


def test_fsh_config_is_checked():
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="objective must be mse or cos"):
        FSHConfig(objective="l1")
    with pytest.raises(ConfigError, match="dummies >= 2"):
        FSHConfig(dummies=1)


# -- `raysim audit` on recorded runs ---------------------------------------------------------------

FAST_FSH = FSHConfig(max_steps=10, patience=5, min_steps=5, classes=2)


def _fedproto(folder: Path, cache_dir: str, **dp):
    cfg = tiny_config(folder, cache_dir, method="fedproto", output={"record_uploads": True}, eval={"every": 1},
                      data={"dataset": "digits", "shots": 0, "partition": "dirichlet", "beta": 0.5},
                      train={"batch_size": 32, "lr": 0.05, "rounds": 2}, fedproto={"model_family": "tiny"}, dp=dp)
    return run(cfg).out_dir


@pytest.fixture(scope="module")
def proto_runs(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("audit-proto")
    return root, _fedproto(root / "nodp", cache_dir), _fedproto(root / "eps1", cache_dir, epsilon=1.0)


def test_audit_of_a_prototype_run_writes_the_ledger_and_the_attacks(proto_runs, capsys):
    _, _, dp_run = proto_runs
    res = audit_run(dp_run, fsh=FAST_FSH, max_per_class=30, clients=[0, 1, 2, 3])
    text = (dp_run / "audit.md").read_text()
    assert "| client | mechanism | sigma | q | steps | rounds | epsilon spent / target |" in text
    # IGPP, one release per round, sigma calibrated for the run's 2 releases: the ledger spends its target
    igpp = [r for r in res.ledger if r["mechanism"] == "igpp"]
    assert len(igpp) == 4 and all(r["rounds"] == 2 and r["steps"] == 2 and r["q"] == 1.0 for r in igpp)
    # calibrated to the target (the calibration's bisection stops a little below it)
    assert all(0.99 < r["epsilon_spent"] <= 1.0 for r in igpp)
    assert "| 0 | igpp |" in text and "/ 1 |" in text
    assert "Cos Sim" in text and "ROC-AUC" in text and "| 1 | IGPP | fedproto |" in text
    pa = res.prototype
    assert pa is not None and pa.rounds == [0, 1]  # both rounds' models are on disk (the store keeps two)
    assert {r["client"] for r in pa.mia} == {0, 1, 2, 3} and len(pa.mia) == 8
    assert all(0 <= r["auc"] <= 1 and 0 < r["members"] <= 30 * 10 and 0 < r["nonmembers"] <= 30 * 10 for r in pa.mia)
    assert len(pa.fsh) == 2 * 4 * 2  # rounds x clients x classes
    for name in ("audit_ledger.csv", "audit_fsh.csv", "audit_mia.csv", "audit_summary.csv"):
        assert (dp_run / name).is_file()
    assert main([str(dp_run), "--rounds", "last", "--fsh-steps", "5", "--fsh-patience", "5", "--fsh-classes", "1",
                 "--max-per-class", "20", "--clients", "0", "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("# Privacy audit of") and "rounds attacked: 1;" in out.out


def test_hijacking_succeeds_on_clean_releases_and_not_on_noisy_ones(proto_runs):
    _, clean, noisy = proto_runs
    cfg = FSHConfig(max_steps=100, patience=20, min_steps=20, classes=1)
    kw = dict(fsh=cfg, mia=False, rounds="last", write=False, progress=False, clients=[0, 1])
    a, b = audit_run(clean, **kw), audit_run(noisy, **kw)
    assert a.summary["Cos Sim"][0] > 0.9  # the features match the clean prototype (which was released)
    # epsilon = 1: the release is mostly noise, the reconstructions match the clean prototype less
    assert b.summary["Cos Sim"][0] < a.summary["Cos Sim"][0] - 0.02
    assert b.summary["cFFD"][0] > a.summary["cFFD"][0]


def test_audit_of_a_folder_of_runs_tabulates_and_plots_against_epsilon(proto_runs, capsys):
    root, _, _ = proto_runs
    results = audit_folder(root, fsh=FAST_FSH, max_per_class=20, rounds="last", progress=False, clients=[0])
    assert [r.epsilon for r in results] == [math.inf, 1.0] and [r.ldp for r in results] == ["NoLDP", "IGPP"]  # the paper's order
    text = (root / "audit.md").read_text()
    assert "## FSH / prototype MIA" in text and "audit_vs_epsilon.png" in text
    assert (root / "audit_vs_epsilon.png").stat().st_size > 1000 and (root / "audit.csv").is_file()
    assert (root / "nodp" / "run" / "audit.md").is_file()


def test_audit_of_a_prompt_run_runs_the_update_mia_and_gradient_inversion(tmp_path, cache_dir):
    out = run(tiny_config(tmp_path / "pfl", cache_dir, output={"record_uploads": True}, train={"rounds": 2, "n_ctx": 4},
                          dp={"epsilon": 1.0})).out_dir
    budget = GIABudget(images=2, iterations=3, clients=1, rounds="all")  # a tiny budget: the wiring, not the attack's strength
    res = audit_run(out, progress=False, gia=budget)
    assert res.family == "update" and res.ldp == "DPSGD"
    text = (out / "audit.md").read_text()
    # GIA on the recorded ctx uploads: one inversion per attacked (round, client), each scored against the client's images
    assert res.gia is not None and [(r["round"], r["client"]) for r in res.gia.rows] == [(0, 0), (1, 0)]
    assert all(-1 <= r["CLIPCos"] <= 1 and -1 <= r["GradCos"] <= 1 and 0 <= r["Top-1"] <= 1 for r in res.gia.rows)
    assert res.summary["CLIPCos"][0] == pytest.approx(np.mean([r["CLIPCos"] for r in res.gia.rows]))  # one client per round
    assert "## Gradient inversion of the uploaded prompt" in text and "| mean ± std |" in text and "GIA CLIPCos" in text
    assert (out / "audit_gia.csv").is_file()
    assert "| client | mechanism | sigma | q | steps | rounds | epsilon spent / target |" in text and "| 0 | dpsgd |" in text
    assert "update-only" in text and "update-and-query" in text
    dpsgd = [r for r in res.ledger if r["mechanism"] == "dpsgd"]
    assert len(dpsgd) == 4 and all(r["sigma"] > 0 and 0 < r["q"] <= 1 and r["steps"] >= 2 and r["rounds"] == 2 for r in dpsgd)
    assert all(r["epsilon_spent"] <= 1.0 * (1 + 1e-6) for r in dpsgd)
    assert 0 <= res.summary["update-only mean_auc"][0] <= 1
    assert (out / "audit_update_mia.csv").is_file()


def _short_proto(folder: Path, cache_dir: str, **output):
    """A short recorded FedProto run; the keyword arguments are keys of its output section."""
    cfg = tiny_config(folder, cache_dir, method="fedproto", eval={"every": 3},
                      data={"dataset": "digits", "shots": 4, "partition": "dirichlet", "beta": 0.5},
                      train={"num_clients": 2, "batch_size": 32, "lr": 0.05, "rounds": 3}, fedproto={"model_family": "tiny"},
                      output={"record_uploads": True, **output})
    return run(cfg).out_dir


def test_recorded_runs_keep_every_rounds_client_state_so_the_audit_sees_every_round(tmp_path, cache_dir):
    from raysim.build import build_config
    from raysim.errors import ConfigError
    from raysim.storage.store import StateStore

    every = _short_proto(tmp_path / "auto", cache_dir)  # keep_client_states=auto: all, since uploads are recorded
    assert StateStore(every).client_rounds(0) == [0, 1, 2] and StateStore(every).client_rounds(1) == [0, 1, 2]
    res = audit_run(every, fsh=None, max_per_class=10, progress=False, write=False)
    assert res.prototype is not None and res.prototype.rounds == [0, 1, 2] and not res.prototype.skipped
    assert sorted({(r["round"], r["client"]) for r in res.prototype.mia}) == [(r, c) for r in range(3) for c in range(2)]
    per_round = per_round_means(res.prototype.mia, ["auc"])["auc"]
    assert res.summary["auc"] == pytest.approx((float(per_round.mean()), float(per_round.std(ddof=0))))

    last = _short_proto(tmp_path / "last", cache_dir, keep_client_states="last")  # only what a resume needs
    assert StateStore(last).client_rounds(0) == [1, 2]
    res = audit_run(last, fsh=None, max_per_class=10, progress=False, write=False)
    assert res.prototype is not None and res.prototype.rounds == [1, 2]
    assert len(res.prototype.skipped) == 2 and "output.keep_client_states=all" in res.prototype.skipped[0]

    # a method that releases before it trains (a two-phase round) is attacked with the state it entered the round with
    view = RunView.open(every)
    view.method.release_first = True  # type: ignore[misc]
    entered = view.releasing_state(1, 2)
    assert entered is not None
    after_1 = view.client_state(1, 1)
    assert after_1 is not None
    assert all(torch.equal(a, b) for a, b in zip(entered["private"]["model"].values(), after_1["private"]["model"].values()))
    first = view.releasing_state(1, 0)  # round 0: the client's initial state, rebuilt from its seeded stream
    assert first is not None and set(first["private"]) == set(view.client_state(1, 0)["private"])

    with pytest.raises(ConfigError, match="output.keep_client_states must be one of auto, last, all"):
        build_config({"output": {"keep_client_states": "some"}})


def test_the_epsilon_plot_has_gia_clipcos_next_to_the_update_mia_and_utility(tmp_path):
    from raysim.tools.audit import AuditResult, epsilon_series, plot_vs_epsilon

    def result(eps, ldp, auc, clip, hm):
        return AuditResult(tmp_path, "update", eps, ldp, "fedsept", {"hm": hm}, [],
                           summary={"update-and-query mean_auc": (auc, 0.0), "CLIPCos": (clip, 0.01)})

    results = [result(1.0, "DPSGD", 0.55, 0.1, 0.5), result(2.0, "DPSGD", 0.6, 0.2, 0.52), result(math.inf, "NoLDP", 0.9, 0.6, 0.55)]
    lines = {s.label: s for s in epsilon_series(results)}
    assert set(lines) == {"update-and-query AUC (fedsept DPSGD)", "GIA CLIPCos (fedsept DPSGD)", "HM (fedsept DPSGD)"}
    gia = lines["GIA CLIPCos (fedsept DPSGD)"]
    assert gia.kind == "attack" and gia.epsilons == [1.0, 2.0, math.inf] and gia.values == [0.1, 0.2, 0.6]  # no DP joins the line
    assert lines["HM (fedsept DPSGD)"].kind == "utility"
    png = plot_vs_epsilon(results, tmp_path / "p.png")
    assert png is not None and png.stat().st_size > 1000


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory) -> str:
    """A tiny random HF ViT folder (as tests/methods/test_vpdr_base.py): fast."""
    from raysim.models.vit_adapter import random_hf_vit

    path = tmp_path_factory.mktemp("vit") / "tiny"
    random_hf_vit(width=32, layers=2, patch_size=8, heads=2, seed=0).vit.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("method,privacy", [("vpdr_fedproto", "vpdr"), ("vpdr_mpft", "igpp"), ("vpdr_fedplvm", "igpp")])
def test_audit_of_a_vpdr_run_writes_the_ledger_and_the_attacks(tmp_path, cache_dir, tiny_vit, method, privacy):
    from raysim.build import build_config
    cfg = build_config({
        "method": method, "data": {"dataset": "digits4", "partition": "domain", "shots": 4},
        "train": {"num_clients": 4, "rounds": 2, "batch_size": 32, "local_epochs": 1},  # partition=domain: one per domain
        "eval": {"every": 2, "last": 1, "protocol": "vpdr"}, "execution": {"backend": "inline"},
        "output": {"progress": False, "tensorboard": False, "cache_dir": cache_dir, "out_dir": str(tmp_path / method),
                   "record_uploads": True},
        "dp": {"epsilon": 1.0, "prototypes": "vpp" if privacy == "vpdr" else "igpp"},
        method: {"dcr": privacy == "vpdr", "backbone": tiny_vit},
    })
    out = run(cfg).out_dir
    res = audit_run(out, fsh=FSHConfig(max_steps=3, patience=3, min_steps=1, classes=1), max_per_class=10, progress=False,
                    clients=[0, 1])
    assert res.family == "prototype" and res.ldp == ("VPDR" if privacy == "vpdr" else "IGPP")
    text = (out / "audit.md").read_text()
    assert "| client | mechanism | sigma | q | steps | rounds | epsilon spent / target |" in text
    mech = "vpp" if privacy == "vpdr" else "igpp"
    assert any(r["mechanism"] == mech and r["rounds"] == 2 for r in res.ledger)
    assert all(r["epsilon_spent"] <= 1.0 * (1 + 1e-6) for r in res.ledger)
    pa = res.prototype
    assert pa is not None and pa.rounds == [0, 1] and len(pa.mia) == 4 and len(pa.fsh) == 4  # rounds x clients (x 1 class)
    assert all(0 <= r["auc"] <= 1 for r in pa.mia) and all(-1 <= r["Cos Sim"] <= 1 for r in pa.fsh)
    assert f"| {method} |" in text and "ROC-AUC" in text


def test_a_run_without_recorded_uploads_says_how_to_record_one(tmp_path, cache_dir, capsys):
    out = run(tiny_config(tmp_path / "plain", cache_dir, train={"rounds": 1, "n_ctx": 4})).out_dir
    assert main([str(out)]) == 2
    err = capsys.readouterr().err
    assert "no recorded uploads" in err and "output.record_uploads=true" in err
    assert main([str(tmp_path)]) == 2  # a folder whose only run was not recorded
    assert "output.record_uploads=true" in capsys.readouterr().err
    assert main([str(tmp_path / "nothing")]) == 2
    assert "no run folders" in capsys.readouterr().err


def test_the_cli_knows_audit(capsys):
    from raysim.tools.cli import main as cli

    assert cli(["--help"]) == 0 and "audit RUN_DIR" in capsys.readouterr().out


# -- the shipped studies (validated, not run) ---------------------------------------------------------

def test_the_audit_study_specs_validate_offline():
    from raysim.build import build_config
    from raysim.config import merge_config
    from raysim.tools.compare import plan, spec_from_args
    from raysim.tools.sweep import load_sweep

    sweep = load_sweep(ROOT / "sweeps" / "audit_fedsept_fig5.yaml")
    assert list(sweep["space"]) == ["dp.epsilon"] and sweep["space"]["dp.epsilon"]["grid"] == [0.25, 0.5, 0.75, 1.0, math.inf]
    for eps in sweep["space"]["dp.epsilon"]["grid"]:  # every trial's config builds
        cfg = build_config(merge_config(sweep["base"], {"dp": {"epsilon": eps}}))
        assert cfg.method == "fedsept" and cfg.output.record_uploads and cfg.dp.epsilon == eps

    spec, _ = spec_from_args([str(ROOT / "benchmarks" / "tables" / "vpdr_attacks.yaml")])
    runs = plan(spec, Path("/nonexistent/out"))  # builds and checks every config; runs and writes nothing
    cfgs = {entry.label: cfg for _, entry, _, cfg in runs}
    assert set(cfgs) == {"NoLDP", *(f"{m}-eps{e}" for m in ("IGPP", "VPP", "VPDR") for e in (1, 2))}
    assert all(c.method == "vpdr_fedproto" and c.output.record_uploads and c.data.dataset == "digits4" for c in cfgs.values())
    from raysim.build import make_method
    from raysim.tools.audit import attack_family

    for label, c in cfgs.items():
        m = make_method(c)
        assert attack_family(m) == "prototype"  # the audit runs FSH and the prototype MIA on it
        want = {"NoLDP": "none", "IGPP": "igpp", "VPP": "vpp", "VPDR": "vpdr"}[label.split("-")[0]]
        knobs = {"none": ("igpp", False), "igpp": ("igpp", False), "vpp": ("vpp", False), "vpdr": ("vpp", True)}[want]
        assert (m.dp.prototypes, m.dcr) == knobs and (math.isinf(c.dp.epsilon) if want == "none" else c.dp.epsilon == float(label[-1]))

    spec, _ = spec_from_args([str(ROOT / "benchmarks" / "tables" / "vpdr_attacks_zoo.yaml")])
    runs = plan(spec, Path("/nonexistent/out"))
    cfgs = {entry.label: cfg for _, entry, _, cfg in runs}
    assert set(cfgs) == {"NoLDP", "IGPP-eps1", "VPP-eps1", "IGPP-eps2", "VPP-eps2"}
    assert all(c.output.record_uploads and c.data.dataset == "digits" for c in cfgs.values())
    assert math.isinf(cfgs["NoLDP"].dp.epsilon)
    assert (cfgs["VPP-eps2"].dp.epsilon, cfgs["VPP-eps2"].dp.prototypes) == (2.0, "vpp")
    assert (cfgs["IGPP-eps1"].dp.epsilon, cfgs["IGPP-eps1"].dp.prototypes) == (1.0, "igpp")
