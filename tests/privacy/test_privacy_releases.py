"""Declared releases (privacy/mechanisms.py, privacy/host.py): for every mechanism the recorded epsilon
equals the accountant computed directly with Opacus, the noise actually added matches the sensitivity the
mechanism names, DP runs spend their target and no more, and an upload that its declared mechanism did
not privatise is refused (fail closed)."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from conftest import tiny_config

from raysim.config import DPConfig
from raysim.errors import UploadViolation
from raysim.methods import TrainConfig, get_method
from raysim.privacy.host import HostPrivacy

DELTA = 1e-5


def opacus_epsilon(history, accountant="rdp", delta=DELTA):
    """Epsilon of [(sigma, q, steps)] straight from Opacus' accountant (no raysim code in between)."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    acc = RDPAccountant() if accountant == "rdp" else PRVAccountant()
    acc.history = list(history)
    return float(acc.get_epsilon(delta=delta))


def host_for(method_name, dp, *, rounds, batch_size=8, options=None, local_epochs=1):
    cls = get_method(method_name)
    method = cls(TrainConfig(batch_size=batch_size, local_epochs=local_epochs, num_clients=2), options or cls.Options(), dp)
    return method, HostPrivacy(dp=dp, method=method, seed=3, batch_size=batch_size, releases_per_client=lambda cid: rounds)


def dp_steps(handle, ctx, n, batch_size, rng):
    """What PromptFL's client does, on a toy per-example loss: one epoch of DP-SGD on `ctx`."""
    x = torch.randn(n, ctx.numel(), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD([ctx], lr=0.1)
    for idx in handle.batches(n, batch_size, rng):
        loss = (x[idx] @ ctx.reshape(-1)).pow(2)
        opt.zero_grad(set_to_none=True)
        handle.backward(loss, dp_params={"ctx": ctx})
        opt.step()


# --------------------------------------------------------------------------------------- DP-SGD
@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_dpsgd_records_what_opacus_computes(accountant):
    from opacus.accountants.utils import get_noise_multiplier

    dp = DPConfig(epsilon=1.0, accountant=accountant)
    n, B, rounds = 40, 8, 3  # q = 0.2, 5 steps per round
    method, host = host_for("promptfl", dp, rounds=rounds, batch_size=B)
    shared = {"ctx": torch.zeros(2, 3)}
    for r in range(rounds):
        h = host.open(0, r, n, shared)
        ctx = shared["ctx"].clone().requires_grad_(True)
        dp_steps(h, ctx, n, B, torch.Generator().manual_seed(r))
        shared = h.close({"ctx": ctx.detach()})
        z = host.multiplier(0, n)
        assert host.epsilon(0) == pytest.approx(opacus_epsilon([(z, 0.2, 5 * (r + 1))], accountant), rel=1e-6)
    # calibrated as Opacus' own get_noise_multiplier for the whole run, and the ledger says how batches were drawn
    ref = get_noise_multiplier(target_epsilon=1.0, target_delta=DELTA, sample_rate=0.2, steps=5 * rounds,
                               accountant=accountant, epsilon_tolerance=0.01)
    assert z == pytest.approx(ref, rel=1e-9)
    assert 0.99 * 1.0 - 0.011 <= host.epsilon(0) <= 1.0
    assert {r.sampling for r in host.ledger(0).releases} == {"poisson"}


def test_poisson_batches_have_binomial_sizes():
    from raysim.sampling import poisson_batches

    n, B, steps = 200, 20, 4000
    sizes = torch.tensor([len(b) for b in poisson_batches(n, B, torch.Generator().manual_seed(0), steps)], dtype=torch.float64)
    q = B / n
    # standard errors: mean sqrt(nq(1-q)/steps) = 0.067, variance about var*sqrt(2/steps) = 0.4; 5 SE each
    assert float(sizes.mean()) == pytest.approx(n * q, abs=0.35)
    assert float(sizes.var()) == pytest.approx(n * q * (1 - q), abs=2.0)
    assert len(list(poisson_batches(10, 32, torch.Generator(), 3))[0]) == 10  # q = 1: the whole set


def test_poisson_step_is_normalised_by_the_expected_batch():
    """sigma = 0 isolates the normalisation: (sum of clipped per-example grads) / (q n), whatever the
    realised batch size (Opacus' convention)."""
    from raysim.privacy.dpsgd import DPSGD

    p = torch.ones(3, requires_grad=True)
    x = torch.tensor([[1.0, 0, 0], [0, 2.0, 0], [0, 0, 0.5]])
    handle = DPSGD(sigma=0.0, clip=1.0, sample_rate=0.5, generator=torch.Generator(), expected_batch=4.0)
    handle.backward((x @ p), dp_params={"p": p})
    # per-example grads are the rows; clipped to norm 1: [1,0,0], [0,1,0], [0,0,0.5]
    torch.testing.assert_close(p.grad, torch.tensor([1.0, 1.0, 0.5]) / 4.0)


# ------------------------------------------------------------------------------- user-level update
def gdp_delta(eps, mu):
    """Exact delta(eps) of mu-GDP (the composition of Gaussian mechanisms is exactly GDP)."""
    from scipy.stats import norm

    return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2))


def test_client_level_noise_is_calibrated_to_sensitivity_2C():
    dp = DPConfig(epsilon=1.0, level="client", clip=0.5)
    rounds, d = 10, 20000
    method, host = host_for("promptfl", dp, rounds=rounds)
    shared = {"ctx": torch.zeros(d)}
    noise = []
    for r in range(rounds):
        h = host.open(0, r, 16, shared)
        big = torch.full((d,), 1.0)  # norm 141 >> C: clipped to C
        out = h.close({"ctx": shared["ctx"] + big})["ctx"]
        noise.append(out - shared["ctx"] - big * (dp.clip / float(big.norm())))
    z = host.multiplier(0, 16)
    rel = [r.mechanism for r in host.ledger(0).releases]
    assert rel == ["client_update"] * rounds
    assert host.epsilon(0) == pytest.approx(opacus_epsilon([(z, 1.0, rounds)]), rel=1e-6)
    # the noise has std 2 C z: z is relative to the replace-one sensitivity 2C (std error of the std ~0.2%)
    assert float(torch.cat(noise).std()) == pytest.approx(2 * dp.clip * z, rel=0.02)
    # the closed form: T Gaussian releases at multiplier z are exactly (sqrt(T)/z)-GDP; at the recorded
    # epsilon the true delta is within the target (RDP is an upper bound) ...
    mu = math.sqrt(rounds) / z
    assert gdp_delta(host.epsilon(0), mu) <= DELTA
    # ... while the old accounting (noise z C read as sensitivity C, i.e. multiplier z/2 at 2C) is far off
    assert gdp_delta(1.0, 2 * mu) > 100 * DELTA


# ------------------------------------------------------------------------------------- prototypes
@pytest.mark.parametrize("mechanism", ["igpp", "vpp"])
def test_prototype_release_noise_and_epsilon(mechanism):
    dp = DPConfig(epsilon=1.0, prototypes=mechanism, proto_clip=5.0)
    rounds, d, n_c = 4, 4000, 10
    method, host = host_for("fedproto", dp, rounds=rounds)
    feats = torch.zeros(2 * n_c, d)  # clipped mean 0: the release is pure noise
    feats[:n_c, :10] = 3.0  # a little structure so VPP's scores are defined
    labels = torch.tensor([0] * n_c + [1] * n_c)
    h = host.open(0, 0, 2 * n_c, {})
    protos = h.release("protos", features=feats, labels=labels, num_classes=3)
    counts = torch.tensor([10.0, 10.0, 0.0])
    up = h.close({"protos": protos, "counts": counts})
    assert torch.equal(up["counts"], counts)  # public: passes unchanged, costs nothing
    assert torch.equal(up["protos"][2], torch.zeros(d))  # a class the client lacks is not released
    z = host.multiplier(0, 2 * n_c)
    delta_c = 2 * dp.proto_clip / n_c  # replace-one sensitivity of a class mean
    noise = up["protos"][1]  # class 1's clipped mean is exactly 0
    if mechanism == "igpp":
        assert float(noise.std()) == pytest.approx(z * delta_c, rel=0.05)
        assert host.epsilon(0) == pytest.approx(opacus_epsilon([(z, 1.0, 1)]), rel=1e-6)
        assert opacus_epsilon([(z, 1.0, rounds)]) == pytest.approx(1.0, abs=0.011)  # the run spends the target
    else:
        from raysim.privacy.prototypes import group_kappas, vpp_sigmas

        k = math.ceil(dp.vpp.rho * d)
        sA, sB = vpp_sigmas(z, d, k)
        kA, kB = group_kappas(d, k)
        # per coordinate: sigma_A Delta_A on I_A and sigma_B Delta_B on I_B (I_A unknown here: the
        # partition is private), so check the mixture's variance
        mix = (k * (sA * kA * delta_c) ** 2 + (d - k) * (sB * kB * delta_c) ** 2) / d
        assert float(noise.var()) == pytest.approx(mix, rel=0.06)
        pure = [r.epsilon for r in host.ledger(0).releases if r.epsilon is not None]
        assert pure == [pytest.approx(dp.vpp.split * 1.0 / rounds)]
        # over the run: r eps (Laplace, pure) + the Gaussian part at z composes to the target
        total = dp.vpp.split + opacus_epsilon([(z, 1.0, rounds)])
        assert total == pytest.approx(1.0, abs=0.011)


def test_embedding_release_noise_is_2C():
    from raysim.privacy.mechanisms import EmbeddingRelease

    mech = EmbeddingRelease(DPConfig(epsilon=1.0))
    x = torch.randn(50, 400)
    out = mech.apply(x, clip=2.5, multiplier=3.0, generator=torch.Generator().manual_seed(0))
    clean = x * (2.5 / float(x.norm()))
    assert float((out - clean).std()) == pytest.approx(2 * 2.5 * 3.0, rel=0.02)


# ------------------------------------------------------------------------------------ fail closed
def test_an_upload_its_mechanism_did_not_privatise_is_refused():
    dp = DPConfig(epsilon=1.0)
    method, host = host_for("promptfl", dp, rounds=2)
    shared = {"ctx": torch.zeros(2, 3)}
    # trained outside DP-SGD: the upload differs from the broadcast, but no DP step wrote it
    h = host.open(0, 0, 16, shared)
    with pytest.raises(UploadViolation, match="fail closed"):
        h.close({"ctx": torch.ones(2, 3)})
    # DP-trained, then changed before upload
    h = host.open(1, 0, 16, shared)
    ctx = shared["ctx"].clone().requires_grad_(True)
    dp_steps(h, ctx, 16, 8, torch.Generator().manual_seed(0))
    with pytest.raises(UploadViolation, match="not the tensor DP-SGD trained"):
        h.close({"ctx": ctx.detach() + 1.0})
    # DP steps on an unnamed tensor: the host cannot tell what was privatised
    h = host.open(1, 1, 16, shared)
    ctx = shared["ctx"].clone().requires_grad_(True)
    h.backward((torch.randn(4, 6) @ ctx.reshape(-1)), dp_params=[ctx])
    with pytest.raises(UploadViolation, match="dp_params"):
        h.close({"ctx": ctx.detach()})
    # a prototype upload that is not what the host released
    method, host = host_for("fedproto", dp, rounds=2)
    h = host.open(0, 0, 4, {})
    h.release("protos", features=torch.randn(4, 8), labels=torch.tensor([0, 0, 1, 1]), num_classes=2)
    with pytest.raises(UploadViolation, match="privacy.release"):
        h.close({"protos": torch.zeros(2, 8), "counts": torch.tensor([2.0, 2.0])})


# --------------------------------------------------------------------------------------- full runs
@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_full_dp_run_spends_its_target_and_absent_clients_spend_nothing(tmp_path, cache_dir, accountant):
    from raysim.engine.loop import run
    from raysim.privacy.ledger import PrivacyLedger
    from raysim.sampling import schedule
    from raysim.storage.store import StateStore

    seed, rounds, K, part = 5, 4, 4, 0.25
    sched = schedule(seed, rounds, K, part)
    absent = sorted(set(range(K)) - {c for p in sched for c in p})
    assert absent, "the test needs a seed where some client never takes part"
    cfg = tiny_config(tmp_path, cache_dir, train={"seed": seed, "rounds": rounds, "participation": part, "batch_size": 8},
                      data={"shots": 16},
                      **{"dp": {"epsilon": 2.0, "accountant": accountant, "sampling": "poisson"}})
    out = run(cfg).out_dir
    rows = list(csv.DictReader(open(out / "client_results.csv")))
    final = {int(r["client"]): float(r["epsilon"]) for r in rows if int(r["round"]) == rounds - 1}
    store = StateStore(out)
    for c in range(K):
        if c in absent:
            assert final[c] == 0.0
            continue
        # within 5% below the target (Opacus' calibration tolerance is 0.01), never above
        assert 0.95 * 2.0 <= final[c] <= 2.0 * (1 + 1e-6), (c, final[c])
        saved = store.load_client(c, rounds - 1)["privacy"]
        ledger = PrivacyLedger.from_dict(saved["ledger"])
        hist = {}
        for r in ledger.releases:
            assert r.mechanism == "dpsgd" and r.sampling == "poisson"
            hist[(r.sigma, r.sample_rate)] = hist.get((r.sigma, r.sample_rate), 0) + r.steps
        assert final[c] == pytest.approx(opacus_epsilon([(s, q, n) for (s, q), n in hist.items()], accountant), rel=1e-4)


def test_no_loss_or_metric_reaches_the_server(tmp_path, cache_dir, monkeypatch):
    import dataclasses

    from raysim.engine.loop import run
    from raysim.methods.base import Upload
    from raysim.methods.fedsept.fedsept import FedSEPT

    assert {f.name for f in dataclasses.fields(Upload)} == {"client_id", "tensors", "num_samples"}
    seen = []
    original = FedSEPT.aggregate

    def spy(self, env, shared, uploads, rng):
        seen.extend(uploads)
        return original(self, env, shared, uploads, rng)

    monkeypatch.setattr(FedSEPT, "aggregate", spy)
    res = run(tiny_config(tmp_path, cache_dir, method="fedsept", train={"rounds": 1}))
    assert seen and all(set(vars(u)) == {"client_id", "tensors", "num_samples"} and set(u.tensors) == {"A"} for u in seen)
    rows = list(csv.DictReader(open(res.out_dir / "results.csv")))
    assert {"train_ce", "train_div", "train_gate"} <= set(rows[0])  # the loss terms went to the driver instead
    assert math.isfinite(float(rows[0]["train_ce"]))


def test_docs_mechanism_table_is_the_registry():
    """The docs' mechanism tables (Privacy and the mechanisms reference) are generated from the registry
    on every docs build: each page holds the marker, and the generator writes every registered row."""
    import importlib.util
    from pathlib import Path

    from raysim.privacy.mechanisms import mechanism_table

    root = Path(__file__).resolve().parents[2]
    for page in ("docs/concepts/privacy.md", "docs/reference/mechanisms.md"):
        assert "<!-- generated: mechanisms -->" in (root / page).read_text(), page
    spec = importlib.util.spec_from_file_location("gen_reference", root / "docs" / "hooks" / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    table = gen.mechanisms_markdown()
    for r in mechanism_table():
        cells = [gen._text(r[k]) for k in ("clipped", "sensitivity", "relation", "accountant")]
        assert f"| `{r['mechanism']}` |" in table and all(c in table for c in cells), r["mechanism"]
