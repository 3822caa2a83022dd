"""The model-homogeneous methods of fedtsp.txt section 3.6: FedAvg (GFL) and FedTSP-GFL, each with the
classifier fine-tuning of the "-FT" rows (PFL): sample-weighted aggregation, fine-tuning that stays in
the client's private state, and short end-to-end runs on the bundled digits."""

from __future__ import annotations

import csv
import math
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import run_on_digits

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from raysim.methods.base import ClientData, EnvSpec, ServerResult, TrainConfig, Upload  # noqa: E402
from raysim.models.clip import ModelSpec  # noqa: E402
from raysim.privacy import NoDP  # noqa: E402

C = 3
SPEC = EnvSpec(model=ModelSpec("raysim-tiny", ""), classnames=["zero", "one", "two"], dataset="digits")


def _data(cid: int, n: int, seed: int) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % C
    x = torch.randn(n, 3, 32, 32, generator=g) * 0.3 + y[:, None, None, None].float() * 0.5  # learnable
    return ClientData(cid, x, y, x[:6].clone(), y[:6].clone(), C)


def _method(name: str, **opts):
    from raysim.methods import get_method

    cls = get_method(name)
    base = {"model": "cnn_tiny"}
    base.update({"feature_dim": 16} if name == "fedavg" else {"plm": "clip", "lam": 1.0})
    base.update(opts)
    o = cls.Options(**base)
    o.validate()
    return cls(TrainConfig(local_epochs=1, batch_size=8, seed=1, num_clients=2), o)


@pytest.fixture(scope="module")
def servers():
    """Per method: (server method, server env, initial shared state); the PLM is built once."""
    out = {}
    for name in ("fedavg", "fedtsp_gfl"):
        m = _method(name)
        env = m.build_env(SPEC, role="server")
        out[name] = (env, m.init_shared(env, torch.Generator().manual_seed(0)))
    return out


def _broadcast(method, shared):
    hidden = tuple(method.server_only)
    return {k: v for k, v in shared.items() if not any(k == h or k.startswith(h + ".") for h in hidden)}


# ------------------------------------------------------------------------------------ flat weights
@pytest.mark.parametrize("arch", ["cnn_tiny", "resnet4"])
def test_flat_weights_round_trip_with_batchnorm_buffers(arch):
    from raysim.methods.families.homogeneous import flatten_state, load_flat
    from raysim.models.zoo import make_client_model

    a, b = make_client_model(arch, 16, C, seed=1), make_client_model(arch, 16, C, seed=2)
    if arch == "resnet4":
        a.train()
        a(torch.randn(4, 3, 32, 32))  # moves running stats and num_batches_tracked
    load_flat(b, flatten_state(a.state_dict()))
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert va.dtype == vb.dtype and torch.equal(va, vb), k
    with pytest.raises(Exception, match="hold"):
        load_flat(make_client_model("resnet4", 16, C), flatten_state(make_client_model("cnn_tiny", 16, C).state_dict()))


# ------------------------------------------------------------------------------------ aggregation
@pytest.mark.parametrize("name", ["fedavg", "fedtsp_gfl"])
def test_aggregation_is_sample_weighted_mean_of_client_models(name, servers):
    from raysim.methods.families.homogeneous import load_flat

    env_s, shared = servers[name]
    server, client = _method(name), _method(name)
    env_c = client.build_env(SPEC, role="client")
    down = _broadcast(server, shared)
    uploads = []
    for cid, n in ((0, 16), (1, 48)):
        data = _data(cid, n, seed=cid)
        res = client.local_train(env_c, down, client.init_private(env_c, data, torch.Generator()), data,
                                 rng=torch.Generator().manual_seed(cid), privacy=NoDP())
        assert "weights" in res.upload and set(res.upload) <= set(client.uploads)
        assert "model" not in res.private  # the trained model goes up, the client keeps no copy
        uploads.append(Upload(cid, res.upload, res.num_samples))
    w0, w1 = uploads[0].tensors["weights"], uploads[1].tensors["weights"]
    assert not torch.equal(w0, w1) and not torch.equal(w0, shared["weights"])
    out = server.aggregate(env_s, shared, uploads, torch.Generator().manual_seed(0))
    new = out.state if isinstance(out, ServerResult) else out
    assert torch.allclose(new["weights"], (16 * w0 + 48 * w1) / 64, atol=1e-6)
    # per tensor of the model: feature extractor and head alike
    models = [load_flat(server.new_model(env_s), u.tensors["weights"]).state_dict() for u in uploads]
    glob = load_flat(server.new_model(env_s), new["weights"]).state_dict()
    for k, v in glob.items():
        if v.is_floating_point():
            assert torch.allclose(v, 0.25 * models[0][k] + 0.75 * models[1][k], atol=1e-6), k
    assert not torch.equal(glob["head.weight"], models[0]["head.weight"])
    if name == "fedtsp_gfl":  # FedTSP's server half ran too: prompts trained against the class means
        assert math.isfinite(out.metrics["loss"]) and not torch.equal(new["prompts"], shared["prompts"])
        assert new["text_protos"].shape == (C, 128)


def test_fedtsp_gfl_client_loss_is_fedtsps(servers):
    """lambda enters the homogeneous client exactly as in FedTSP: lambda=0 trains differently."""
    env_s, shared = servers["fedtsp_gfl"]
    down = _broadcast(_method("fedtsp_gfl"), shared)
    data = _data(0, 16, seed=0)
    ups = []
    for lam in (0.0, 1.0):
        m = _method("fedtsp_gfl", lam=lam)
        env = m.build_env(SPEC, role="client")
        ups.append(m.local_train(env, down, m.init_private(env, data, torch.Generator()), data,
                                 rng=torch.Generator().manual_seed(0), privacy=NoDP()).upload["weights"])
    assert not torch.equal(ups[0], ups[1])


# ------------------------------------------------------------------------------------ -FT
@pytest.mark.parametrize("name", ["fedavg", "fedtsp_gfl"])
def test_finetuning_changes_only_the_private_head_never_the_upload(name, servers):
    from raysim.methods.families.homogeneous import load_flat

    _, shared = servers[name]
    plain, ft = _method(name), _method(name, finetune_epochs=5, finetune_lr=0.1)
    down = _broadcast(plain, shared)
    data = _data(0, 24, seed=3)
    envs = {m: m.build_env(SPEC, role="client") for m in (plain, ft)}
    privs = {m: m.init_private(envs[m], data, torch.Generator()) for m in (plain, ft)}

    def train(m):
        return m.local_train(envs[m], down, privs[m], data, rng=torch.Generator().manual_seed(5), privacy=NoDP())

    before = {k: v.clone() for k, v in down.items()}
    r_plain, r_ft = train(plain), train(ft)
    for k in r_plain.upload:  # the -FT option does not touch local training
        assert torch.equal(r_plain.upload[k], r_ft.upload[k]), k
    privs[plain], privs[ft] = r_plain.private, r_ft.private

    # evaluation: the FT client fine-tunes the global head on its data and keeps it privately
    x = data.x_train
    with torch.no_grad():  # as the engine evaluates
        out_plain = plain.predictor(envs[plain], down, privs[plain], data)(x)
        out_ft = ft.predictor(envs[ft], down, privs[ft], data)(x)
    assert "head_ft" not in privs[plain] and set(privs[ft]["head_ft"]) == {"weight", "bias"}
    for k, v in down.items():
        assert torch.allclose(v, before[k], rtol=0, atol=0, equal_nan=True), k  # the broadcast is untouched
    glob = load_flat(plain.new_model(envs[plain]), down["weights"]).eval()
    assert torch.allclose(out_plain, glob(x)[1], atol=1e-5)
    assert not torch.equal(privs[ft]["head_ft"]["weight"], glob.head.weight)
    with torch.no_grad():  # same frozen extractor, its own head; and the head fits the client's data better
        feats = glob.features(x)
        expect = F.linear(feats, privs[ft]["head_ft"]["weight"], privs[ft]["head_ft"]["bias"])
    assert torch.allclose(out_ft, expect, atol=1e-5)
    assert F.cross_entropy(out_ft, data.y_train) < F.cross_entropy(out_plain, data.y_train)

    # the next round: what the FT client uploads is still exactly what the plain client uploads
    r_plain2, r_ft2 = train(plain), train(ft)
    for k in r_plain2.upload:
        assert torch.equal(r_plain2.upload[k], r_ft2.upload[k]), k
    assert torch.equal(r_ft2.private["head_ft"]["weight"], privs[ft]["head_ft"]["weight"])  # kept privately


def test_options_are_validated():
    from raysim.build import build_config
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="fedavg.model"):
        build_config({"method": "fedavg", "fedavg": {"model": "HtFE2"}})
    with pytest.raises(ConfigError, match="finetune_epochs"):
        build_config({"method": "fedtsp_gfl", "fedtsp_gfl": {"finetune_epochs": -1}})


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("method,section", [
    ("fedavg", {"model": "cnn_tiny"}),
    ("fedtsp_gfl", {"model": "cnn_tiny", "plm": "clip", "lam": 1.0}),
])
def test_end_to_end_gfl_and_ft(tmp_path, method, section):
    from raysim.storage.store import StateStore

    res, rows = run_on_digits(tmp_path, method, section, tag="gfl")
    res_ft, rows_ft = run_on_digits(tmp_path, method, {**section, "finetune_epochs": 2}, tag="ft")
    for rs in (rows, rows_ft):
        assert len(rs) == 2 * 4 and {r["round"] for r in rs} == {"0", "1"}
    # GFL: every client evaluates the one global model, so its accuracy on all test data is the same
    for rnd in ("0", "1"):
        glob = {round((float(r["in_client"]) * int(r["n_in"]) + float(r["cross_client"]) * int(r["n_cross"]))
                      / (int(r["n_in"]) + int(r["n_cross"])), 6) for r in rows if r["round"] == rnd}
        assert len(glob) == 1
    # training is identical (FT is evaluation-side only), so the global models agree to the bit
    store, store_ft = StateStore(res.out_dir), StateStore(res_ft.out_dir)
    assert torch.equal(store.load_server(1)["weights"], store_ft.load_server(1)["weights"])
    assert "head_ft" in store_ft.load_client(0, 1)["private"] and "head_ft" not in store.load_client(0, 1)["private"]
    assert "model" not in store_ft.load_client(0, 1)["private"]
    # personalised heads fit the clients' own (label-skewed) test splits better than the global head
    assert res_ft.summary["in_client"] > res.summary["in_client"]
    if method == "fedtsp_gfl":
        server = store.load_server(1)
        assert server["text_protos"].shape == (10, 128)
        losses = [float(r["server_loss"]) for r in csv.DictReader(open(res.out_dir / "results.csv"))]
        assert all(math.isfinite(v) for v in losses)  # the server's prompt loss reaches results.csv
