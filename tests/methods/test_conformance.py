"""Every registered method, by existing, gets these checks: an inline round on a small dataset, uploads a
subset of the declared releases, the same seed gives the same upload, private state round-trips through
the store, the predictor returns (N, C) logits, and with finite dp.epsilon every upload is privatised by
its declared mechanism (the host checks it) or the config is refused with exit 2 before anything is
written."""

from __future__ import annotations

import pytest
import torch

from raysim.methods import method_names

# speed only: the smallest member of each family (a method missing here runs with its own defaults)
FAST = {
    "fedtsp": {"model_family": "tiny", "plm": "clip"},
    "fedtsp_gfl": {"model": "cnn_tiny", "plm": "clip"},
    "fedproto": {"model_family": "tiny"},
    "fedtgp": {"model_family": "tiny", "server_epochs": 2},
    "local": {"model_family": "tiny"},
    "fedavg": {"model": "cnn_tiny"},
    "fedbabu": {"model": "cnn_tiny"},
    "fedetf": {"model": "cnn_tiny"},
    "fedfa": {"model": "cnn_tiny"},
    "fedpac": {"model": "cnn_tiny", "qp_iters": 200},
    "fedpcl": {"model": "cnn_tiny"},
    "fedsept": {"rank": 4},
    "fml": {"model_family": "tiny"},
    "fedkd": {"model_family": "tiny"},
    "fedmrl": {"model_family": "tiny"},
    "alignfed": {"model_family": "tiny", "anchor_iters": 200},
    "lgfedavg": {"model_family": "tiny"},
    "fedgen": {"model_family": "tiny", "server_epochs": 2, "hidden_dim": 32},
    "fedgh": {"model_family": "tiny", "server_epochs": 2},
    "feddistill": {"model_family": "tiny"},
    "vpdr_fedtgp": {"server_epochs": 2},
    "vpdr_mpft": {"server_epochs": 2},
}


def config(tmp_path, name, **extra):
    from raysim.build import build_config
    values = {
        "method": name,
        "data": {"dataset": "digits", "shots": 8},
        "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"n_ctx": 4, "ctx_init": "", "num_clients": 3, "rounds": 2, "batch_size": 16},
        "execution": {"backend": "inline"},
        "output": {"progress": False, "tensorboard": False, "cache_dir": str(tmp_path.parent / "conformance-cache"),
                   "out_dir": str(tmp_path / "run")},
    }
    if name in FAST:
        values[name] = FAST[name]
    values.update(extra)
    return build_config(values)


def hosts(cfg, out_dir):
    from raysim.build import make_method
    from raysim.engine.hosts import ClientHost, ServerHost
    from raysim.engine.loop import prepare_data

    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    return data, ServerHost(cfg, data.classnames, out_dir), ClientHost(cfg, data, list(range(cfg.train.num_clients)), out_dir)


def upload_round(host, clients, shared):
    """Round 0's uploads and reports: a `release_first` method uploads from `release` (its `train` then
    uploads nothing); any other from `train`."""
    if not host.method.release_first:
        return host.train(0, clients, shared)
    uploads, reports = host.release(0, clients, shared)
    trained, train_reports = host.train(0, clients, shared)
    assert all(not u.tensors for u in trained)
    return uploads, reports + train_reports


@pytest.mark.parametrize("name", method_names())
def test_method_conforms(tmp_path, name):
    from raysim.storage.store import StateStore

    cfg = config(tmp_path, name)
    data, server, host = hosts(cfg, str(tmp_path / "a"))
    shared = server.get_shared()
    uploads, reports = upload_round(host, [0, 1], shared)
    declared = set(host.method.releases)
    assert all(set(u.tensors) <= declared for u in uploads)
    assert all(set(r.metrics) <= set(host.method.client_metrics) for r in reports)
    # the same seed gives the same upload (a fresh host replays the round)
    _, _, again = hosts(cfg, str(tmp_path / "b"))
    uploads2, _ = upload_round(again, [0, 1], shared)
    for u, v in zip(uploads, uploads2):
        assert u.tensors.keys() == v.tensors.keys() and all(torch.equal(u.tensors[k], v.tensors[k]) for k in u.tensors)
    # private state round-trips through the store
    host.commit(0)
    saved = StateStore(str(tmp_path / "a")).load_client(0, 0)["private"]
    assert saved.keys() == host.private[0].keys()
    for k, v in host.private[0].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(saved[k], v)
    # the server aggregates, and the predictor gives (N, C) logits over all classes
    server.aggregate(0, uploads)
    predict = host.method.predictor(host.env, server.get_shared(), host.private[0], host.data[0])
    x = host.data[0].x_test[:5]
    extra = (host.data[0].tokens_test[:5],) if host.data[0].tokens_test is not None else ()
    with torch.no_grad():
        assert tuple(predict(x, *extra).shape) == (5, len(data.classnames))


@pytest.mark.parametrize("level", ["sample", "client"])
@pytest.mark.parametrize("name", method_names())
def test_dp_is_applied_or_refused_before_anything_is_written(tmp_path, name, level):
    from raysim.errors import ConfigError
    from raysim.privacy.mechanisms import Public

    dp = {"epsilon": 4.0, "level": level}
    try:
        cfg = config(tmp_path, name, dp=dp)
    except ConfigError:
        from raysim.run import main

        out = tmp_path / "refused"
        args = [f"method={name}", "dp.epsilon=4", f"dp.level={level}", f"output.out_dir={out}", "execution.backend=inline",
                "data.dataset=digits", "output.progress=false", f"output.cache_dir={tmp_path / 'c'}"]
        args += [f"{name}.{k}={v}" for k, v in FAST.get(name, {}).items()]
        assert main(args) == 2 and not out.exists()
        return
    _, server, host = hosts(cfg, str(tmp_path / "a"))
    uploads, _ = upload_round(host, [0, 1, 2], server.get_shared())  # each upload passed the host's release check
    for u in uploads:
        ledger = host.privacy.ledger(u.client_id)
        private = [k for k in u.tensors if not isinstance(host.privacy.mechanisms[k], Public)]
        if private:
            assert ledger.releases and host.privacy.epsilon(u.client_id) > 0, (name, u.client_id)
        assert host.privacy.epsilon(u.client_id) <= 4.0 * (1 + 1e-6)
