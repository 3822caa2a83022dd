"""How FedProto and FedTGP are evaluated: `protocol=fedtsp` (the code behind fedtsp.txt's tables, an HtFLlib
fork: each client predicts with its own head, HtFLlib's prototype collection) and that the FedTSP table spec
runs them so; `protocol=htfllib` (upstream HtFLlib, the nearest global prototype) stays available."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raysim.methods.base import ClientData, TrainConfig
from raysim.privacy.dpsgd import NoDP

C, D = 3, 8
ROOT = Path(__file__).resolve().parents[2]


def _data(n=12, num_classes=C):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.arange(n) % num_classes
    return ClientData(0, x, y, x[:4], y[:4], num_classes)


def _method(name, train=None, **opts):
    from raysim.methods import get_method

    cls = get_method(name)
    o = cls.Options(model_family="tiny", feature_dim=D, **opts)
    o.validate()
    return cls(train or TrainConfig(batch_size=4, local_epochs=1), o, None)


def _predictions(m, num_classes=C, feature_dim=D):
    """(the method's predictor's logits, the client's own head's logits) on a client whose shared state
    holds global prototypes for two of three classes (FedProto) / a trained generator (FedTGP)."""
    from raysim.methods.families.prototype import nearest_prototype_logits
    from raysim.methods.families.zoo import HtEnv

    env = HtEnv(torch.device("cpu"), num_classes, feature_dim)
    data = _data(num_classes=num_classes)
    private = m.init_private(env, data, torch.Generator().manual_seed(0))
    shared = m.init_shared(env, torch.Generator().manual_seed(0))
    shared = {**shared, "protos": torch.randn(num_classes, feature_dim, generator=torch.Generator().manual_seed(1)),
              "has": torch.tensor([1.0, 1.0] + [0.0] * (num_classes - 2))}
    model = m.model(env, private).eval()
    with torch.no_grad():
        got = m.predictor(env, shared, private, data)(data.x_test)
        head = model(data.x_test)[1]
        near = nearest_prototype_logits(model.features(data.x_test), shared["protos"], m.prediction_classes(shared))
    return got, head, near


@pytest.mark.parametrize("name", ["fedproto", "fedtgp"])
def test_fedtsp_protocol_predicts_with_the_clients_head(name):
    got, head, near = _predictions(_method(name, protocol="fedtsp"))
    assert torch.allclose(got, head)  # the same forward pass: argmax model(x), as the fork's test_metrics
    assert not torch.allclose(got, near)  # and not the nearest prototype (random prototypes: far apart)
    got, head, near = _predictions(_method(name, protocol="htfllib"))
    assert torch.allclose(got, near) and not torch.allclose(got, head)  # upstream HtFLlib's rule kept


def test_fedtsp_protocol_collects_fedprotos_means_as_htfllib():
    """The fork's clientproto collects the class means of the training batches, as HtFLlib's: fedtsp and
    htfllib uploads agree; with lr > 0 they differ from the default's after-training pass."""
    data = _data()
    up = {}
    for protocol in ("head", "fedtsp", "htfllib"):
        m = _method("fedproto", TrainConfig(batch_size=4, local_epochs=1, lr=0.05), protocol=protocol)
        from raysim.methods.families.zoo import HtEnv

        env = HtEnv(torch.device("cpu"), C, D)
        private = m.init_private(env, data, torch.Generator().manual_seed(0))
        up[protocol] = m.local_train(env, m.init_shared(env, torch.Generator()), private, data,
                                     rng=torch.Generator(), privacy=NoDP()).upload["protos"]
    assert torch.allclose(up["fedtsp"], up["htfllib"], atol=1e-6)  # same code path; atol: float32 noise
    assert not torch.allclose(up["fedtsp"], up["head"], atol=1e-4)


@pytest.mark.parametrize("spec", ["fedtsp_table1.yaml"])
def test_fedtsp_table_spec_evaluates_fedproto_and_fedtgp_by_head(tmp_path, spec):
    """The table spec's own settings, as `raysim compare` builds them: FedProto and FedTGP predict with the
    client's head (the FedTSP code), FedProto's server mean is uniform (the fork's proto_aggregation)."""
    from raysim.build import make_method
    from raysim.tools.compare import plan, spec_from_args

    s, _ = spec_from_args([str(ROOT / "benchmarks" / "tables" / spec)])
    seen = set()
    for _cell, entry, _folder, cfg in plan(s, tmp_path):
        if entry.method not in ("fedproto", "fedtgp"):
            continue
        m = make_method(cfg)
        assert m.opts.protocol == "fedtsp"
        if entry.method == "fedproto":
            assert m.opts.proto_weighting == "uniform"
        got, head, _ = _predictions(m, num_classes=10, feature_dim=m.opts.feature_dim)
        assert torch.allclose(got, head)
        seen.add(entry.method)
    assert seen == {"fedproto", "fedtgp"}


def test_fedtsp_table3_has_no_prototype_baselines_to_set():
    """Table 3 (one model) has no FedProto / FedTGP rows: nothing there evaluates by prototype."""
    from raysim.tools.compare import spec_from_args

    s, _ = spec_from_args([str(ROOT / "benchmarks" / "tables" / "fedtsp_table3.yaml")])
    assert not {e.method for e in s.methods} & {"fedproto", "fedtgp"}


def test_protocol_error_names_the_choices():
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="head.*fedtsp.*htfllib"):
        _method("fedproto", protocol="nearest")
