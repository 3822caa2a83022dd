"""The mechanism registry (privacy/mechanisms/): every module registers a mechanism that says what it is,
every release kind resolves (or is refused with what to do) under every valid dp setting, and a mechanism
defined elsewhere is found by `resolve` without touching any other file."""

from __future__ import annotations

import math
import pkgutil
from pathlib import Path

import pytest
import torch

import raysim.privacy.mechanisms as mechanisms
from raysim.config import DPConfig
from raysim.errors import ConfigError
from raysim.privacy.mechanisms import KINDS, MECHANISMS, Mechanism, Planned, ReleaseSpec, resolve

TABLE = ("name", "applied", "clipped", "sensitivity", "relation", "accountant", "serves")


def _spec(kind: str) -> ReleaseSpec:
    return ReleaseSpec(kind, note="a test's public upload" if kind == "public" else "")


def test_every_module_registers_a_mechanism_and_every_mechanism_says_what_it_is():
    folder = Path(mechanisms.__file__).parent
    files = {m.name for m in pkgutil.iter_modules([str(folder)])}
    assert "base" in files  # the shared pieces (ReleaseSpec, Mechanism, the registry), which register nothing
    files.discard("base")
    assert files >= {"dp_sgd", "client_update", "igpp", "vpp", "embedding_release", "public_release", "dpfpl_reference"}
    assert not files & set(KINDS), "a module named like a release constructor (dpsgd, public, ...) would shadow it"
    registered = {MECHANISMS.get(n).__module__.rsplit(".", 1)[-1] for n in MECHANISMS.names()}
    assert files <= registered, f"modules registering no mechanism: {sorted(files - registered)}"
    for n in MECHANISMS.names():
        cls = MECHANISMS.get(n)
        assert issubclass(cls, Mechanism) and cls.name == n
        for attr in TABLE:
            assert getattr(cls, attr), f"mechanism {n} has no {attr}"
        assert cls.applied in ("train", "release", "update", "none")
        assert set(cls.serves) <= set(KINDS) and set(cls.levels) <= {"sample", "client"}


def _settings():
    for level in ("sample", "client"):
        for prototypes in mechanisms.prototype_choices():
            for epsilon in (1.0, math.inf):
                yield DPConfig(epsilon=epsilon, level=level, prototypes=prototypes)


# what each kind resolves to at each dp.level under DP (None: refused with a ConfigError saying what to do)
EXPECTED = {
    ("dpsgd", "sample"): "dpsgd", ("dpsgd", "client"): "client_update",
    ("update", "sample"): None, ("update", "client"): "client_update",
    ("prototype", "sample"): "<dp.prototypes>", ("prototype", "client"): None,
    ("embedding", "sample"): "embedding", ("embedding", "client"): "embedding",
    ("public", "sample"): "public", ("public", "client"): "public",
    ("reference", "sample"): "dpfpl_reference", ("reference", "client"): None,
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_release_kind_resolves_under_every_valid_dp_setting(kind):
    for dp in _settings():
        if not dp.enabled:  # DP off: nothing is privatised; a public upload is still declared public
            mech = resolve(_spec(kind), dp, what="x")
            assert (mech.name if mech else None) == ("public" if kind == "public" else None)
            assert mech is None or mech.dp is dp  # built on the run's dp section, as under DP
            continue
        want = EXPECTED[kind, dp.level]
        if want is None:
            with pytest.raises(ConfigError, match="use dp.level=|dp.epsilon=inf"):
                resolve(_spec(kind), dp, what="x")
            continue
        mech = resolve(kind, dp)  # a kind's name resolves as its spec does
        assert mech.name == (dp.prototypes if want == "<dp.prototypes>" else want)
        assert kind in mech.serves and mech.dp is dp
        assert isinstance(mech.plan(num_train=10, steps_per_round=3, batch_size=5), Planned)


def test_a_new_mechanism_is_found_by_resolve_without_touching_another_file(monkeypatch):
    class Rounded(Mechanism):
        name = "test_rounded"
        applied = "release"
        clipped = "each feature to R"
        sensitivity = "2R / n_c"
        relation = "replace one example of a class"
        accountant = "Gaussian, q = 1"
        serves = ("prototype",)
        levels = ("sample",)
        choice = "test_rounded"

        def plan(self, *, num_train, steps_per_round, batch_size):
            return Planned(q=1.0, steps=2)

        def apply(self, features, labels, num_classes, *, multiplier, generator, rounds, assignments=None):
            return torch.zeros(num_classes, features.shape[1]), {}

    monkeypatch.setitem(MECHANISMS._items, Rounded.name, Rounded)  # registered for this test only
    assert "test_rounded" in mechanisms.prototype_choices()
    dp = DPConfig(epsilon=1.0, prototypes="test_rounded")
    mech = resolve(prototype_spec := _spec("prototype"), dp, what="x")
    assert isinstance(mech, Rounded) and mech.plan(num_train=1, steps_per_round=1, batch_size=1).steps == 2
    assert resolve(prototype_spec, DPConfig(epsilon=1.0), what="x").name == "igpp"  # the others still resolve
    with pytest.raises(ConfigError, match="use dp.level=sample"):
        resolve(prototype_spec, DPConfig(epsilon=1.0, prototypes="test_rounded", level="client"), what="x")

    from raysim.methods import get_method
    from raysim.methods.base import TrainConfig
    from raysim.privacy.host import HostPrivacy

    cls = get_method("fedproto")  # a prototype method: the host makes its release with the new mechanism
    method = cls(TrainConfig(num_clients=2), cls.Options(), dp)
    host = HostPrivacy(dp=dp, method=method, seed=0, batch_size=8, releases_per_client=lambda cid: 3)
    assert host.mechanisms["protos"].name == "test_rounded"
    h = host.open(0, 0, 10, {})
    protos = h.release("protos", features=torch.randn(10, 4), labels=torch.arange(10) % 2, num_classes=2)
    assert torch.equal(protos, torch.zeros(2, 4))
    h.close({"protos": protos, "counts": torch.tensor([5.0, 5.0])})
    assert [r.mechanism for r in host.ledger(0).releases] == ["test_rounded"]


# the refusals, word for word: a user reads these to know what to change (each names the upload and the fix)
REFUSALS = {
    ("update", "sample"): "{what} is trained without per-example DP-SGD, so dp.level=sample cannot privatise it; use "
                          "dp.level=client (the whole update is clipped and noised) or dp.epsilon=inf",
    ("prototype", "client"): "{what} is a prototype release, not an update of the broadcast state; use dp.level=sample",
    ("reference", "client"): "{what} reproduces a reference code's sample-level noise; use dp.level=sample",
}


@pytest.mark.parametrize("kind, level", sorted(REFUSALS))
def test_each_refusal_names_the_upload_and_says_what_to_set(kind, level):
    for prototypes in mechanisms.prototype_choices():
        dp = DPConfig(epsilon=1.0, level=level, prototypes=prototypes)
        with pytest.raises(ConfigError) as named:
            resolve(_spec(kind), dp, what="fedx's upload 'w'")
        assert str(named.value) == REFUSALS[kind, level].format(what="fedx's upload 'w'")
        with pytest.raises(ConfigError) as unnamed:  # without `what`, the kind names the upload
            resolve(kind, dp)
        assert str(unnamed.value) == REFUSALS[kind, level].format(what=f"a {kind} upload")


def test_resolve_refuses_unknown_kinds_ambiguous_registries_and_mechanisms_without_a_refusal(monkeypatch):
    with pytest.raises(ConfigError) as e:
        resolve("gradient", DPConfig(epsilon=1.0), what="fedx's upload 'g'")
    assert str(e.value) == "fedx's upload 'g': unknown release kind 'gradient'"
    with pytest.raises(ConfigError) as e:
        resolve("gradient", DPConfig(epsilon=1.0))
    assert str(e.value) == "a gradient upload: unknown release kind 'gradient'"

    class Twin(Mechanism):  # a second mechanism serving embeddings at the same settings: which one is meant?
        name = "test_twin"
        applied = "release"
        clipped = sensitivity = relation = accountant = "-"
        serves = ("embedding",)

        def plan(self, *, num_train, steps_per_round, batch_size):
            return Planned(q=1.0, steps=1)

    monkeypatch.setitem(MECHANISMS._items, Twin.name, Twin)
    with pytest.raises(ConfigError) as e:
        resolve("embedding", DPConfig(epsilon=1.0), what="w")
    assert str(e.value) == ("w: mechanisms embedding, test_twin all serve embedding releases under this dp section; "
                            "give them distinct dp.level or dp.prototypes choices")
    monkeypatch.delitem(MECHANISMS._items, Twin.name)

    class SampleOnly(Twin):  # no refusal text of its own: the generic one says which level it serves
        name = "test_sample_only"
        serves = ("public",)
        levels = ("sample",)

    monkeypatch.setitem(MECHANISMS._items, "public", SampleOnly)  # the only public mechanism, for this test
    with pytest.raises(ConfigError) as e:
        resolve(_spec("public"), DPConfig(epsilon=1.0, level="client"), what="w")
    assert str(e.value) == ("w is a public release, which test_sample_only makes only at dp.level=sample; "
                            "use dp.level=sample or dp.epsilon=inf")

    class Chosen(Twin):  # serves references only when chosen, and is not: nothing serves the release
        name = "test_chosen"
        serves = ("reference",)
        choice = "test_chosen"

    monkeypatch.setitem(MECHANISMS._items, "dpfpl_reference", Chosen)
    with pytest.raises(ConfigError) as e:
        resolve("reference", DPConfig(epsilon=1.0), what="w")
    assert str(e.value) == ("w: no registered mechanism serves reference releases at dp.level=sample with dp.prototypes=igpp; "
                            f"choose dp.prototypes from {', '.join(mechanisms.prototype_choices())} or dp.epsilon=inf")


# ------------------------------------------------------------- the survivors of the 2026-12-06 run (docs/testing.md)
def test_register_mechanism_adds_the_class_and_only_prototype_mechanisms_are_dp_prototypes_choices(monkeypatch):
    # a mechanism registered at test time (the registry restored after): it is returned (a decorator) and listed;
    # a `choice` on a mechanism that serves no prototype release is not a value dp.prototypes may take
    from raysim.privacy.mechanisms.base import mechanisms as registered
    from raysim.privacy.mechanisms.base import prototype_choices, register_mechanism

    monkeypatch.setattr(MECHANISMS, "_items", dict(MECHANISMS._items))

    class Chosen(Mechanism):
        name = "test_chosen_update"
        serves = ("update",)
        levels = ("client",)
        choice = "test_chosen_update"

    assert register_mechanism(Chosen) is Chosen
    assert Chosen in registered() and MECHANISMS.get("test_chosen_update") is Chosen
    assert "test_chosen_update" not in prototype_choices()
    assert prototype_choices() == sorted(c.choice for c in registered() if "prototype" in c.serves and c.choice)


def test_the_embedding_and_client_update_plans_are_one_full_rate_release():
    # calibration counts one Gaussian release at q = 1 per run (embedding) or per participation (client
    # update), whatever the client's data and steps
    emb = resolve("embedding", DPConfig(epsilon=1.0))
    upd = resolve("update", DPConfig(epsilon=1.0, level="client"))
    for mech in (emb, upd):
        for n, s, b in ((10, 3, 5), (1000, 40, 1)):
            assert mech.plan(num_train=n, steps_per_round=s, batch_size=b) == Planned(q=1.0, steps=1, pure_share=0.0)


def test_the_client_update_noise_comes_from_the_callers_generator():
    # the same seed gives the same release (reproducible runs), and it is noise_update's at sigma = 2 x the
    # multiplier (sensitivity 2C), drawn from that generator
    from raysim.privacy.client_level import noise_update

    mech = resolve("update", DPConfig(epsilon=1.0, level="client", clip=0.5))
    delta = {"w": torch.ones(50), "b": torch.zeros(3)}
    a = mech.apply(delta, multiplier=1.3, generator=torch.Generator().manual_seed(7))
    b = mech.apply(delta, multiplier=1.3, generator=torch.Generator().manual_seed(7))
    want = noise_update(delta, clip=0.5, sigma=2.6, generator=torch.Generator().manual_seed(7))
    for k in delta:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], want[k])


def test_the_dpfpl_reference_clip_and_noise_formulas():
    # clip: the method's dpfpl.norm_thresh, else dp.clip (also for a method without options); sigma =
    # sqrt(T ln(1/delta)) / epsilon at epsilon != 1, its stds sigma C / B (/ K), a batch of 1 (or 0) dividing by 1
    from types import SimpleNamespace

    from raysim.privacy.mechanisms.dpfpl_reference import local_noise_std, reference_sigma, server_noise_std

    mech = resolve("reference", DPConfig(epsilon=2.0, clip=0.7))
    assert mech.clip_of(object()) == 0.7 and mech.clip_of(SimpleNamespace(opts=object())) == 0.7
    assert mech.clip_of(SimpleNamespace(opts=SimpleNamespace(norm_thresh=3.0))) == 3.0
    sigma = math.sqrt(10 * math.log(1e5)) / 2.0
    assert reference_sigma(10, 2.0, 1e-5) == pytest.approx(sigma, rel=1e-12)
    assert reference_sigma(0, 2.0, 1e-5) == pytest.approx(math.sqrt(math.log(1e5)) / 2.0, rel=1e-12)  # T >= 1
    for b in (1, 0):
        assert local_noise_std(10, 2.0, 1e-5, 0.7, b) == pytest.approx(sigma * 0.7, rel=1e-12)
        assert server_noise_std(10, 2.0, 1e-5, 0.7, b, 4) == pytest.approx(sigma * 0.7 / 4, rel=1e-12)
    assert server_noise_std(10, 2.0, 1e-5, 0.7, 8, 4) == pytest.approx(sigma * 0.7 / 32, rel=1e-12)


def test_a_dpfpl_reference_upload_without_its_clipped_gradient_fails_closed():
    # verify: an upload is accepted only as the very gradient a clipped step computed for it. A stepper without
    # gradients, one whose steps ran but did not compute this tensor, and a different tensor are each refused
    # with UploadViolation (not another error: the host reports it as a violation)
    from types import SimpleNamespace

    from raysim.errors import UploadViolation

    mech = resolve("reference", DPConfig(epsilon=1.0))
    g = torch.tensor([1.0, 2.0])

    def rp(stepper):
        return SimpleNamespace(enabled=True, cid=3, stepper=stepper)

    mech.verify(rp(SimpleNamespace(steps=2, grads={"ctx": g.clone()})), "ctx", g, "reference")  # accepted
    for stepper in (SimpleNamespace(steps=2), SimpleNamespace(steps=2, grads={"other": g}),
                    SimpleNamespace(steps=0, grads={"ctx": g})):
        with pytest.raises(UploadViolation, match="client 3: 'ctx' is declared reference but no clipped step"):
            mech.verify(rp(stepper), "ctx", g, "reference")
    with pytest.raises(UploadViolation, match="is not the gradient the clipped step computed"):
        mech.verify(rp(SimpleNamespace(steps=2, grads={"ctx": g})), "ctx", g + 1, "reference")


def test_training_done_fills_in_the_steps_and_drops_a_stepless_round_only_when_asked():
    from types import SimpleNamespace

    from raysim.privacy.ledger import Release
    from raysim.privacy.mechanisms import Training

    release = Release("dpfpl_reference", 0.0, 1.0, 0, 2, valid=False, claimed_epsilon=1.0)
    for keep in (True, False):
        done = Training(SimpleNamespace(steps=4), release, record_without_steps=keep).done()
        assert done is not None and done.steps == 4 and done.round == 2
    # no step ran: DP-SGD keeps the round on record with 0 steps, the reference mechanism records nothing
    assert Training(SimpleNamespace(steps=0), release, record_without_steps=True).done().steps == 0
    assert Training(SimpleNamespace(steps=0), release, record_without_steps=False).done() is None


def _method(releases, **extra):
    """A method as check_method and warnings_for see it: a name and its declared releases (nothing else)."""
    from types import SimpleNamespace

    return SimpleNamespace(name="fedx", releases=releases, **extra)


def test_check_method_refuses_a_prototype_mechanism_for_a_method_without_prototypes():
    from raysim.build import build_config
    with pytest.raises(ConfigError) as err:
        build_config({"method": "promptfl", "dp": {"epsilon": 1.0, "prototypes": "vpp"}})
    assert str(err.value) == ("dp.prototypes=vpp chooses how prototypes are released, but promptfl releases no prototypes; "
                              "use a prototype method (fedproto, fedtgp, vpdr_fedproto, ...) or leave dp.prototypes at its default")
    # a method releasing prototypes (and a public upload beside them) may choose it; so may one releasing only
    # prototypes, and without DP the choice is moot
    build_config({"method": "fedproto", "dp": {"epsilon": 1.0, "prototypes": "vpp"}})
    mechanisms.check_method(_method({"protos": mechanisms.prototype()}), DPConfig(epsilon=1.0, prototypes="vpp"))
    mechanisms.check_method(_method({"w": mechanisms.dpsgd()}), DPConfig(epsilon=math.inf, prototypes="vpp"))


def test_check_method_names_the_method_in_a_refusal_and_needs_no_budget_shares():
    # a duck-typed method without budget_shares (check_method reads it with a default, as the host does)
    mechanisms.check_method(_method({"w": mechanisms.dpsgd()}), DPConfig(epsilon=1.0))
    with pytest.raises(ConfigError) as err:
        mechanisms.check_method(_method({"protos": mechanisms.prototype()}), DPConfig(epsilon=1.0, level="client"))
    assert str(err.value) == REFUSALS["prototype", "client"].format(what="fedx's upload 'protos'")


def test_check_method_refuses_budget_shares_over_a_release_with_a_pure_dp_part():
    from raysim.build import build_config
    from raysim.privacy.mechanisms import BudgetShare

    with pytest.raises(ConfigError) as err:
        build_config({"method": "fedtsp", "dp": {"epsilon": 1.0, "prototypes": "vpp"}, "fedtsp": {"dp_budget": "split"}})
    assert str(err.value) == ("fedtsp's budget shares calibrate Gaussian releases; 'protos' has a pure-DP part (vpp: it "
                              "spends dp.epsilon itself); use dp.prototypes=igpp, or a budget mode of fedtsp without shares "
                              "(e.g. fedtsp.dp_budget=joint)")
    build_config({"method": "fedtsp", "dp": {"epsilon": 1.0}, "fedtsp": {"dp_budget": "split"}})  # igpp: Gaussian only
    shares = _method({"protos": mechanisms.prototype()}, budget_shares=lambda: {"protos": BudgetShare(0.5)})
    with pytest.raises(ConfigError, match="fedx's budget shares calibrate Gaussian releases"):
        mechanisms.check_method(shares, DPConfig(epsilon=1.0, prototypes="vpp"))
    mechanisms.check_method(shares, DPConfig(epsilon=math.inf, prototypes="vpp"))  # no DP, no shares to check


def test_warnings_for_gives_each_mechanisms_warning_once_as_text():
    from raysim.privacy.mechanisms import DPFPLReference, warnings_for

    two = _method({"g": mechanisms.reference(), "h": mechanisms.reference(), "w": mechanisms.dpsgd()})
    assert warnings_for(two, DPConfig(epsilon=1.0)) == [DPFPLReference.warning]
    assert DPFPLReference.warning.startswith("dpfpl.dp_mode=reference reproduces the DP-FPL code")
    assert warnings_for(_method({"w": mechanisms.dpsgd()}), DPConfig(epsilon=1.0)) == []
    with pytest.raises(ConfigError) as err:  # what cannot be released is refused here too, naming the upload
        warnings_for(_method({"protos": mechanisms.prototype()}), DPConfig(epsilon=1.0, level="client"))
    assert str(err.value) == REFUSALS["prototype", "client"].format(what="fedx's upload 'protos'")


def test_the_dpsgd_rate_is_the_batch_over_the_training_set_capped_at_one():
    mech = resolve("dpsgd", DPConfig(epsilon=1.0))
    assert mech.sample_rate(40, 8) == pytest.approx(0.2)
    assert mech.sample_rate(1, 1) == 1.0  # one example in a batch of one: every step sees it
    assert mech.sample_rate(5, 8) == 1.0 and mech.sample_rate(0, 8) == 1.0


def test_a_dpsgd_upload_is_the_trained_tensor_or_the_untouched_broadcast_one():
    from types import SimpleNamespace

    from raysim.errors import UploadViolation

    mech = resolve("dpsgd", DPConfig(epsilon=1.0))
    w = torch.tensor([1.0, 2.0, 3.0])

    def rp(steps, names=(), trained=None, shared=None):
        stepper = SimpleNamespace(steps=steps, names_each_step=[frozenset(n) for n in names], trained=trained or {})
        return SimpleNamespace(enabled=True, cid=3, stepper=stepper, shared=shared if shared is not None else {"w": w})

    # no step ran: the broadcast tensor, untouched, holds nothing of the client's data
    mech.verify(rp(0), "w", w.clone(), "dpsgd")
    for bad in (rp(0), rp(0, shared={"w": w.reshape(3, 1)}), rp(0, shared={})):  # changed, reshaped, never broadcast
        upload = w + 1 if bad.shared.get("w") is w else w.clone()
        with pytest.raises(UploadViolation) as err:
            mech.verify(bad, "w", upload, "dpsgd")
        assert str(err.value) == "client 3: 'w' is declared dpsgd but no DP-SGD step trained it (fail closed)"
    # steps ran: only the tensor they trained, passed to every step (the broadcast value is no longer it)
    mech.verify(rp(2, [{"w"}, {"w", "b"}], {"w": w + 1}), "w", w + 1, "dpsgd")
    with pytest.raises(UploadViolation, match="the uploaded 'w' is not the tensor DP-SGD trained"):
        mech.verify(rp(2, [{"w"}, {"w"}], {"w": w + 1}), "w", w.clone(), "dpsgd")
    with pytest.raises(UploadViolation) as err:  # trained by the first step only
        mech.verify(rp(2, [{"w"}, {"b"}], {"w": w + 1, "b": w}), "w", w + 1, "dpsgd")
    assert str(err.value) == ("client 3: 'w' is declared dpsgd but was not passed as dp_params={'w': tensor} to every "
                              "privacy.backward step (fail closed)")
