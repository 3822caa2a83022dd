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
