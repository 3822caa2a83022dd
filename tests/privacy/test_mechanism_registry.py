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
