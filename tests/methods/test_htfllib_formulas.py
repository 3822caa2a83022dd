"""FedProto's and FedGen's client step under benchmarks/presets/htfllib.yaml, pinned to HtFLlib's own formulas
written out here by hand (clientproto.py, serverproto.py, clientgen.py, servergen.py of TsingZ0/HtFLlib), without
raysim's helpers: the loss of a local step, the SGD step it takes, what the client uploads, the server's aggregate
and the prediction rule. The library itself cannot run offline; these pin raysim's side to its code instead.

Each check compares float32 arithmetic done in two different orders (per-row loops here, batched kernels in
raysim): the tolerances (1e-5 relative on losses and weights) are a few float32 ulps of values of order 1."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from raysim.methods.base import ClientData, TrainConfig, Upload
from raysim.privacy.dpsgd import NoDP

PRESET = yaml.safe_load((Path(__file__).resolve().parents[2] / "benchmarks" / "presets" / "htfllib.yaml").read_text())
C, D, N = 3, 8, 6  # classes, feature width, training rows (one batch of N: one local step)


def _method(name: str, **extra):
    from raysim.methods import get_method

    cls = get_method(name)
    section = {**PRESET[name], "model_family": "tiny", "feature_dim": D, **extra}
    opts = cls.Options(**section)
    opts.validate()
    return cls(TrainConfig(lr=PRESET["train"]["lr"], batch_size=N, local_epochs=1), opts, None)


def _setup(name: str, **extra):
    from raysim.methods.families.zoo import HtEnv

    m = _method(name, **extra)
    env = HtEnv(torch.device("cpu"), C, D)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N + 3, 3, 32, 32, generator=g)
    y = torch.tensor([0, 1, 0, 2, 1, 0, 2, 1, 0])
    data = ClientData(0, x[:N], y[:N], x[N:], y[N:], C)
    private = m.init_private(env, data, torch.Generator().manual_seed(1))
    return m, env, data, private


def _sgd_step(model: torch.nn.Module, loss: torch.Tensor, lr: float) -> None:
    """torch.optim.SGD(model.parameters(), lr) with no momentum: p <- p - lr * grad (HtFLlib's client optimiser)."""
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ FedProto
def test_fedproto_step_is_htfllibs_clientproto():
    """clientproto.train: loss = CE(head(rep), y) + lam * MSELoss(proto_new, rep), proto_new = rep.detach() with
    each row whose class has a global prototype replaced by it; protos = per-class mean of the batch's rep
    (train mode, before the step); one plain SGD step at the client lr."""
    m, env, data, private = _setup("fedproto")
    lam, lr = PRESET["fedproto"]["lam"], PRESET["train"]["lr"]
    assert lam == 10.0 and m.opts.protocol == "htfllib" and m.opts.proto_weighting == "uniform"
    global_protos = {0: torch.randn(D, generator=torch.Generator().manual_seed(2)),
                     2: torch.randn(D, generator=torch.Generator().manual_seed(3))}  # class 1 has none yet
    shared = {"protos": torch.zeros(C, D), "has": torch.zeros(C)}
    for c, p in global_protos.items():
        shared["protos"][c], shared["has"][c] = p, 1.0

    # HtFLlib, by hand, on a copy of the same model
    ref = copy.deepcopy(m.model(env, private)).train()
    rep = ref.pool(ref.base(data.x_train).unsqueeze(1)).squeeze(1)  # model.base in HtFLlib: extractor + pooling
    output = ref.head(rep)
    loss = F.cross_entropy(output, data.y_train)
    proto_new = rep.detach().clone()
    for i, yy in enumerate(data.y_train.tolist()):
        if yy in global_protos:
            proto_new[i, :] = global_protos[yy]
    loss = loss + F.mse_loss(proto_new, rep) * lam
    want_protos = {c: rep.detach()[data.y_train == c].mean(0) for c in range(C)}
    want_loss = float(loss.detach())
    _sgd_step(ref, loss, lr)

    res = m.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(4), privacy=NoDP())
    assert res.metrics["loss"] == pytest.approx(want_loss, rel=1e-5)
    for k, v in ref.state_dict().items():
        assert _close(res.private["model"][k].float(), v.float()), k  # the same step, so the same weights
    for c in range(C):
        assert _close(res.upload["protos"][c], want_protos[c]), c
    assert torch.equal(res.upload["counts"], torch.tensor([3.0, 2.0, 1.0]))  # y = 0, 1, 0, 2, 1, 0


def test_fedproto_server_and_prediction_are_htfllibs():
    """serverproto.proto_aggregation: the plain mean over the clients that hold a class (uniform, whatever their
    counts); clientproto.test_metrics: argmin over the classes with a global prototype of MSELoss(rep, proto),
    a class without one never predicted."""
    m, env, data, private = _setup("fedproto")
    p0 = torch.tensor([[1.0] * D, [2.0] * D, [0.0] * D])
    p1 = torch.tensor([[3.0] * D, [0.0] * D, [0.0] * D])
    ups = [Upload(0, {"protos": p0, "counts": torch.tensor([5.0, 1.0, 0.0])}, 6),
           Upload(1, {"protos": p1, "counts": torch.tensor([1.0, 0.0, 0.0])}, 1)]
    out = m.aggregate(env, {"protos": torch.zeros(C, D), "has": torch.zeros(C)}, ups, torch.Generator())
    assert _close(out["protos"][0], torch.full((D,), 2.0))  # (1 + 3) / 2: uniform, not (5 * 1 + 1 * 3) / 6
    assert _close(out["protos"][1], torch.full((D,), 2.0))  # one holder
    assert out["has"].tolist() == [1.0, 1.0, 0.0]
    model = m.model(env, private).eval()
    with torch.no_grad():
        rep = model.features(data.x_test)
    want = []
    for r in rep:  # HtFLlib: output = inf; output[i, j] = MSE(r, pro) for each class j with a prototype
        d = [float(F.mse_loss(r, out["protos"][j])) if out["has"][j] > 0.5 else float("inf") for j in range(C)]
        want.append(min(range(C), key=lambda j: d[j]))
    with torch.no_grad():
        got = m.predictor(env, out, private, data)(data.x_test).argmax(1)
    assert got.tolist() == want and 2 not in got.tolist()


# -------------------------------------------------------------------------------------------- FedGen
def _generator_by_hand(state: dict[str, torch.Tensor], labels: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """servergen.Generative.forward in training mode: fc(ReLU(BN(Linear([eps; onehot(y)])))), BatchNorm on the
    batch's own statistics (biased variance, eps 1e-5)."""
    z = torch.cat([eps, F.one_hot(labels, C).float()], dim=1)
    h = z @ state["fc1.0.weight"].t() + state["fc1.0.bias"]
    h = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5) * state["fc1.1.weight"] + state["fc1.1.bias"]
    return torch.relu(h) @ state["fc.weight"].t() + state["fc.bias"]


def test_fedgen_step_is_htfllibs_clientgen_with_the_initial_generator():
    """clientgen.train (after set_parameters put the global head on): loss = CE(model(x), y) + CE(model.head(z),
    labels), labels ~ the label distribution (np.random.choice over every client's labels), z = G(labels) with
    U[0, 1) noise, G the server's initial generator (servergen never saves its trained copy); one SGD step."""
    m, env, data, private = _setup("fedgen", hidden_dim=16)
    assert m.opts.generator == "initial" and m.opts.noise == "uniform" and m.opts.noise_dim == 32
    shared = m.init_shared(env, torch.Generator().manual_seed(5))
    counts = torch.tensor([4.0, 0.0, 2.0])  # class 1 held by nobody: never drawn
    shared = {**shared, "label_counts": counts}
    gen = {k[4:]: v for k, v in shared.items() if k.startswith("gen.")}
    lr, B = PRESET["train"]["lr"], N

    rng = torch.Generator().manual_seed(6)
    mirror = torch.Generator().set_state(rng.get_state())  # the same stream, drawn here by hand
    labels = torch.multinomial(counts, B, replacement=True, generator=mirror)
    eps = torch.rand((B, m.opts.noise_dim), generator=mirror)
    assert 1 not in labels.tolist()
    ref = copy.deepcopy(m.model(env, private)).train()
    with torch.no_grad():
        ref.head.weight.copy_(shared["head.weight"])
        ref.head.bias.copy_(shared["head.bias"])
    z = _generator_by_hand(gen, labels, eps)
    loss = F.cross_entropy(ref(data.x_train)[1], data.y_train) + F.cross_entropy(ref.head(z), labels)
    want_loss = float(loss.detach())
    _sgd_step(ref, loss, lr)

    res = m.local_train(env, shared, private, data, rng=rng, privacy=NoDP())
    assert res.metrics["loss"] == pytest.approx(want_loss, rel=1e-5)
    for k, v in ref.state_dict().items():
        assert _close(res.private["model"][k].float(), v.float()), k
    assert _close(res.upload["head.weight"], ref.head.weight.detach())


def test_fedgen_initial_generator_is_never_changed_by_the_server():
    """generator=initial: the round's aggregate broadcasts the initial G unchanged (HtFLlib's clients load the
    saved initial one every round), the heads still averaged by n_k; generator=trained moves G."""
    for mode, moves in (("initial", False), ("trained", True)):
        m, env, data, private = _setup("fedgen", hidden_dim=16, server_epochs=3, generator=mode)
        shared = m.init_shared(env, torch.Generator().manual_seed(7))
        res = m.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(8), privacy=NoDP())
        ups = [Upload(0, res.upload, res.num_samples), Upload(1, res.upload, 2 * res.num_samples)]
        out = m.aggregate(env, shared, ups, torch.Generator().manual_seed(9))
        gen_keys = [k for k in shared if k.startswith("gen.") and shared[k].is_floating_point()]
        changed = any(not torch.equal(out.state[k], shared[k]) for k in gen_keys)
        assert changed is moves, mode
        assert _close(out.state["head.weight"], res.upload["head.weight"])  # one head averaged with itself


def test_fedgen_generator_option_is_checked():
    from raysim.errors import ConfigError
    from raysim.methods.fedtsp.fedgen import Options

    with pytest.raises(ConfigError, match="fedgen.generator must be trained"):
        Options(model_family="tiny", generator="frozen").validate()
