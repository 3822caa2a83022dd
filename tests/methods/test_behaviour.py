"""Behavioural conformance: every registered method, by being registered, is checked against what it declares
(methods/base.py, "What the behaviour tests check"), on a tiny offline setting (digits, the random `raysim-tiny`
CLIP, 3 clients). Each check can fail on a wrong algorithm that is still deterministic and well shaped:

- every declared loss term reaches the trained tensors: the term's weight set to 0 changes the round's update;
- the predictor reads every broadcast and private tensor it does not declare it ignores (perturbing one
  changes the logits), ignores those it declares (perturbing one leaves them), and reads each option it
  declares it evaluates with (changing one changes the logits);
- the server's aggregate depends on every participant's upload (dropping one changes it), and the uploads
  the method declares FedAvg'd are the sample-weighted mean (a worked value);
- under dp.level=client the noise of every released update (10 methods release updates), measured from two releases of the same
  clean update under two noise streams, has the std 2 C z of the mechanism's calibration; under dp.level=sample the
  noise of every prototype release (14 methods) has the std z 2R / n_c of IGPP's calibration, class by class;
- local training lowers the training loss of the evaluated model within a few rounds.

The setting of each method is built once (module cache) and shared by its checks."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F
from test_conformance import FAST  # the same speed-only settings (pytest puts this folder on sys.path)

from raysim.methods import get_method, method_names
from raysim.methods.base import ServerResult, Upload, broadcast_state
from raysim.sampling import generator

CLIENTS = [0, 1, 2]
_SETTINGS: dict[tuple[str, str], "Setting"] = {}


def build(tmp_path, name: str, **extra: Any):
    from raysim.build import build_config
    values: dict[str, Any] = {
        "method": name,
        "data": {"dataset": "digits", "shots": 8},
        "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"n_ctx": 4, "ctx_init": "", "num_clients": len(CLIENTS), "rounds": 3, "batch_size": 16},
        "execution": {"backend": "inline"},
        "output": {"progress": False, "tensorboard": False, "cache_dir": str(tmp_path.parent / "behaviour-cache"),
                   "out_dir": str(tmp_path / "run")},
    }
    if name in FAST:
        values[name] = dict(FAST[name])
    for k, v in extra.items():
        values[k] = {**values.get(k, {}), **v} if isinstance(v, dict) else v
    return build_config(values)


class Setting:
    """One method on the tiny setting: its hosts, round 0's uploads, and the state after aggregating them."""

    def __init__(self, tmp_path, name: str, **extra: Any) -> None:
        from raysim.build import make_method
        from raysim.engine.hosts import ClientHost, ServerHost
        from raysim.engine.loop import prepare_data

        self.cfg = cfg = build(tmp_path, name, **extra)
        self.data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
        self.server = ServerHost(cfg, self.data.classnames, str(tmp_path / "s"))
        self.host = ClientHost(cfg, self.data, CLIENTS, str(tmp_path / "c"))
        self.method = self.host.method
        self.shared0 = self.server.get_shared()
        self.private0 = {c: copy.deepcopy(self.host.private_state(c)) for c in CLIENTS}
        self.server_state0 = dict(self.server.state)
        self.uploads = self.round(0)
        self.server.aggregate(0, self.uploads)
        self.shared1 = self.server.get_shared()

    def round(self, r: int) -> list[Upload]:
        shared = self.server.get_shared()
        if not self.method.release_first:
            return self.host.train(r, CLIENTS, shared)[0]
        uploads, _ = self.host.release(r, CLIENTS, shared)
        self.server.aggregate(r, uploads)
        self.host.train(r, CLIENTS, self.server.get_shared())
        return uploads

    def inputs(self, cid: int, split: str = "test", n: int = 24) -> tuple[Any, ...]:
        d = self.host.data[cid]
        x = getattr(d, f"x_{split}")[:n]
        tokens = getattr(d, f"tokens_{split}", None)
        return (x,) if tokens is None else (x, tokens[:n])

    def logits(self, shared, private, cid: int = 0, method=None, split: str = "test") -> torch.Tensor:
        method = method or self.method
        predict = method.predictor(self.host.env, shared, private, self.host.data[cid])
        with torch.no_grad():
            return predict(*self.inputs(cid, split)).float()


def setting(tmp_path_factory, name: str, kind: str = "plain", **extra: Any) -> Setting:
    if (name, kind) not in _SETTINGS:
        _SETTINGS[(name, kind)] = Setting(tmp_path_factory.mktemp(f"{name}-{kind}"), name, **extra)
    return _SETTINGS[(name, kind)]


# -- tensors of a (nested) state, by dotted path ---------------------------------------------------------

def tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        if state.is_floating_point() and state.numel():
            yield prefix, state
    elif isinstance(state, dict):
        for k in sorted(state, key=str):
            yield from tensors(state[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from tensors(v, f"{prefix}.{i}" if prefix else str(i))


def replaced(state: Any, path: str, value: torch.Tensor, prefix: str = "") -> Any:
    """A copy of `state` with the tensor at `path` replaced (containers copied on the way, nothing else)."""
    if prefix == path:
        return value
    if isinstance(state, dict):
        return {k: replaced(v, path, value, f"{prefix}.{k}" if prefix else str(k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(replaced(v, path, value, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(state))
    return state


def perturbed(t: torch.Tensor, seed: int) -> torch.Tensor:
    """t moved by a random multiplicative and additive amount of its own scale (a zero tensor moves too)."""
    g = torch.Generator().manual_seed(seed)
    scale = float(t.float().abs().mean()) + 0.05
    noise = torch.randn(t.shape, generator=g)
    return (t.float() * torch.exp(0.3 * torch.randn(t.shape, generator=g)) + 0.3 * scale * noise).to(t.dtype)


def covers(entry: str, where: str, path: str) -> bool:
    """Whether an `eval_ignores` entry (a dotted path or a prefix of one, optionally "shared:" or "private:"
    first) names the tensor at `path` of the `where` ("shared" / "private") state."""
    return any(p == entry or p.startswith(entry + ".") for p in (path, f"{where}:{path}"))


def ignored(method, where: str, path: str) -> bool:
    return any(covers(q, where, path) for q in method.eval_ignores)


def differ(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest change of b from a, relative to a's typical size (the median: masked logits of -1e4 do not set
    the scale); nan counts as a change."""
    if a.shape != b.shape:
        return math.inf
    d = (a.float() - b.float()).abs().max()
    live = a.float().abs()[a.float().abs() < 1e3]  # a logit of -1e4 is a mask (a class the client lacks)
    return math.inf if torch.isnan(d) else float(d) / ((float(live.median()) if live.numel() else 1.0) + 1e-3)


# float32 logits of a deterministic predictor: a read input moves them by far more than 1e-5 of their scale,
# an unread one leaves them bit for bit (1e-6 leaves room for a reassociated sum only)
MOVES, STILL = 1e-5, 1e-6

NAMES = method_names()


@pytest.mark.parametrize("name", NAMES)
def test_predictor_reads_every_part_it_declares(tmp_path_factory, name):
    s = setting(tmp_path_factory, name)
    shared, private = s.shared1, s.host.private_state(0)
    base = s.logits(shared, private)
    assert torch.isfinite(base).all()
    parts = [("shared", p, t) for p, t in tensors(shared)] + [("private", p, t) for p, t in tensors(private)]
    for q in s.method.eval_ignores:
        assert any(covers(q, w, p) for w, p, _ in parts), f"{name}.eval_ignores names no tensor: {q}"
    unread, read_but_ignored = [], []
    for i, (where, path, t) in enumerate(parts):
        new = replaced(shared, path, perturbed(t, i)) if where == "shared" else shared
        priv = replaced(private, path, perturbed(t, i)) if where == "private" else private
        change = differ(base, s.logits(new, priv))
        if ignored(s.method, where, path):
            if change > STILL:
                read_but_ignored.append(f"{where}:{path}")
        elif change <= MOVES:
            unread.append(f"{where}:{path}")
    assert not unread, f"{name}'s predictor does not read {unread} (declare them in eval_ignores if that is the algorithm)"
    assert not read_but_ignored, f"{name}'s predictor reads {read_but_ignored}, which it declares it ignores"


@pytest.mark.parametrize("name", NAMES)
def test_predictor_reads_the_options_it_declares(tmp_path_factory, name):
    s = setting(tmp_path_factory, name)
    shared, private = s.shared1, s.host.private_state(0)
    base = s.logits(shared, private)
    for opt in s.method.eval_options:
        value = getattr(s.method.opts, opt)
        m = copy.copy(s.method)
        m.opts = dataclasses.replace(s.method.opts, **{opt: value * 1.5 + 0.25})
        assert differ(base, s.logits(shared, private, method=m)) > MOVES, f"{name}'s predictor does not read {opt}"


def trained(result) -> dict[str, torch.Tensor]:
    return {**{f"upload:{k}": v for k, v in result.upload.items()}, **{f"private:{p}": t for p, t in tensors(result.private)}}


def local_round(s: Setting, method, cid: int = 0):
    """Client `cid`'s round 1 training (after round 0's aggregate) under `method`, from the same state and stream."""
    shared = {k: v.clone() for k, v in s.shared1.items()}
    private = copy.deepcopy(s.host.private_state(cid))
    privacy = s.host.open_privacy(cid, 1, shared)
    return method.local_train(s.host.env, shared, private, s.host.data[cid], rng=generator(s.cfg.train.seed, "train", 1, cid),
                              privacy=privacy)


@pytest.mark.parametrize("name", NAMES)
def test_every_declared_loss_term_reaches_the_trained_tensors(tmp_path_factory, name):
    s = setting(tmp_path_factory, name)
    for term, weight in s.method.loss_weights.items():
        assert isinstance(getattr(s.method.opts, weight), (int, float)), f"{name}: {term}'s weight {weight} is not an option"
    if not s.method.loss_weights:
        return
    base = trained(local_round(s, s.method))
    again = trained(local_round(s, s.method))
    assert all(differ(base[k], again[k]) == 0.0 for k in base), f"{name}'s local round is not deterministic"
    for term, weight in s.method.loss_weights.items():
        m = copy.copy(s.method)
        m.opts = dataclasses.replace(s.method.opts, **{weight: 0.0})
        dropped = trained(local_round(s, m))
        change = max(differ(base[k], dropped[k]) for k in base)
        assert change > MOVES, f"{name}: dropping its loss term {term} ({weight}=0) does not change the update"


def aggregate(s: Setting, uploads: list[Upload]) -> dict[str, torch.Tensor]:
    new = s.method.aggregate(s.server.env, dict(s.server_state0), uploads, generator(s.cfg.train.seed, "server", 0))
    return new.state if isinstance(new, ServerResult) else new


@pytest.mark.parametrize("name", NAMES)
def test_the_aggregate_depends_on_every_upload_with_its_weight(tmp_path_factory, name):
    s = setting(tmp_path_factory, name)
    if not s.method.releases:  # nothing is uploaded (zero-shot): the server state stays what it was
        assert not any(u.tensors for u in s.uploads)
        new = aggregate(s, s.uploads)
        assert all(differ(s.server_state0[k], new[k]) == 0.0 for k in s.server_state0)
        return
    full = broadcast_state(s.method, aggregate(s, s.uploads))
    for drop in CLIENTS:
        part = broadcast_state(s.method, aggregate(s, [u for u in s.uploads if u.client_id != drop]))
        assert set(part) != set(full) or max(differ(full[k], part[k]) for k in full) > MOVES, \
            f"{name}: the aggregate does not depend on client {drop}'s upload"
    # FedAvg-declared uploads: client j's upload c_j everywhere with n_j samples -> sum n_j c_j / sum n_j
    counts, values = [1, 3, 6], [1.0, 2.0, 4.0]
    worked = (1 * 1.0 + 3 * 2.0 + 6 * 4.0) / 10  # = 3.1
    for key in s.method.averaged:
        ups = [Upload(u.client_id, {**u.tensors, key: torch.full_like(u.tensors[key], c)}, n)
               for u, c, n in zip(s.uploads, values, counts)]
        out = aggregate(s, ups)[key]
        assert torch.allclose(out.float(), torch.full_like(out.float(), worked), atol=1e-5), (name, key)  # float32 sums


def train_loss(s: Setting, shared, private, cid: int) -> float:
    logits = s.logits(shared, private, cid, split="train")
    y = s.host.data[cid].y_train[: len(logits)]
    return float(F.cross_entropy(logits, y))


# AlignFed pulls the ReLU features towards signed anchors they cannot reach (its docstring); at its round-0 weight
# of 20 that pull, not the data, sets the first rounds, so the toy check runs it at weight 1
TOY = {"alignfed": {"lam": 1.0, "lam_final": 1.0}}


@pytest.mark.parametrize("name", NAMES)
def test_local_training_lowers_the_training_loss(tmp_path_factory, name):
    extra = {name: {**FAST.get(name, {}), **TOY.get(name, {})}} if name in TOY else {}
    s = setting(tmp_path_factory, name, "train", train={"local_epochs": 3}, **extra)  # its own copy: it aggregates alone
    before = [train_loss(s, s.shared0, s.private0[c], c) for c in CLIENTS]
    if not s.method.trains:  # nothing is learnt: the evaluated model stays the initial one
        after = [train_loss(s, s.shared1, s.host.private_state(c), c) for c in CLIENTS]
        assert max(abs(a - b) for a, b in zip(after, before)) < STILL, name
        return
    # each client's model right after its own round-0 training: its private state, with the server state made
    # from its upload alone (a release_first method trains after the aggregate: the round's broadcast)
    after = []
    for u in s.uploads:
        shared = s.shared1 if s.method.release_first else broadcast_state(s.method, aggregate(s, [u]))
        after.append(train_loss(s, shared, s.host.private_state(u.client_id), u.client_id))
    if not s.uploads:  # a method without uploads (local training only)
        after = [train_loss(s, s.shared1, s.host.private_state(c), c) for c in CLIENTS]
    assert sum(after) < sum(before), f"{name}: local training did not lower the training loss: {before} -> {after}"


def released_twice(s: Setting, monkeypatch, stream: str, step) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Client 0's round-1 upload made by `step` (local_train or local_release) and closed by its privacy handle,
    twice: the noise stream named `stream` ("dp-update", "dp-release") salted differently each time, every other
    stream and the client's privacy state the same (restored after each)."""
    import raysim.privacy.host as privacy_host

    plain = generator

    def release(salt: int) -> dict[str, torch.Tensor]:
        monkeypatch.setattr(privacy_host, "generator", lambda *a: plain(*a) if a[1] != stream else plain(a[0] + salt, *a[1:]))
        snap = s.host.privacy_snapshot(0)
        shared = {k: v.clone() for k, v in s.shared1.items()}
        privacy = s.host.open_privacy(0, 1, shared)
        result = step(s.host.env, shared, copy.deepcopy(s.host.private_state(0)), s.host.data[0],
                      rng=generator(s.cfg.train.seed, "train", 1, 0), privacy=privacy)
        out = privacy.close(result.upload)
        s.host.restore_privacy(0, snap)
        return out

    return release(0), release(7919)


@pytest.mark.parametrize("name", NAMES)
def test_client_level_noise_is_the_calibrated_std(tmp_path_factory, monkeypatch, name):
    """Under dp.level=client, the same client round released twice under two noise streams: the releases of
    every update-released upload differ by N1 - N2 (the clean clipped update cancels), whose std is
    sqrt(2) * 2 C z with z the mechanism's calibrated multiplier; every other upload is the same both times."""
    from raysim.errors import ConfigError

    try:
        s = setting(tmp_path_factory, name, "dp", dp={"epsilon": 4.0, "level": "client"})
    except ConfigError:  # refused at config time (test_conformance checks it exits 2 before writing anything)
        return
    mechs = s.host.privacy.mechanisms
    noised = sorted(k for k in s.method.releases if getattr(mechs.get(k), "applied", "") == "update")
    a, b = released_twice(s, monkeypatch, "dp-update", s.method.local_train)
    assert a.keys() == b.keys() and set(a) <= set(s.method.releases)
    for k in set(a) - set(noised):
        assert torch.equal(a[k], b[k]), f"{name}: {k} is not update-released but differs between noise streams"
    if not noised:
        return
    diff = torch.cat([(a[k].double() - b[k].double()).flatten() for k in noised])
    z = s.host.privacy.multiplier(0, s.host.data[0].num_train)
    expected = math.sqrt(2) * 2 * s.cfg.dp.clip * z
    tol = 5 / math.sqrt(2 * diff.numel())  # 5 standard errors of a sample std over n Gaussian coordinates
    assert z > 0 and abs(float(diff.std()) / expected - 1) < tol, (name, float(diff.std()), expected, diff.numel())


PROTOTYPE_NAMES = [n for n in NAMES if any(getattr(spec, "kind", "") == "prototype" for spec in get_method(n).releases.values())]


@pytest.mark.parametrize("name", PROTOTYPE_NAMES)
def test_prototype_release_noise_is_the_calibrated_std(tmp_path_factory, monkeypatch, name):
    """Under dp.level=sample with IGPP, the same client round released twice under two noise streams: each
    class mean (or cluster centre) the client releases differs by N1 - N2 (the clean mean cancels), whose std
    is sqrt(2) z 2R / n_c, with n_c the examples behind it (the public counts) and z the multiplier the host
    calibrated for that release; the public counts are the same both times."""
    from raysim.errors import ConfigError

    try:
        s = setting(tmp_path_factory, name, "dp-proto", dp={"epsilon": 4.0, "level": "sample", "prototypes": "igpp"})
    except ConfigError:  # refused at config time (test_conformance checks it exits 2 before writing anything)
        return
    mechs = s.host.privacy.mechanisms
    noised = sorted(k for k, spec in s.method.releases.items() if spec.kind == "prototype" and mechs.get(k) is not None)
    step = s.method.local_release if s.method.release_first else s.method.local_train
    a, b = released_twice(s, monkeypatch, "dp-release", step)
    assert a.keys() == b.keys()
    if "counts" not in a:
        # clustered centres (FedPLVM): each centre's sensitivity 2R/n_k uses its member count, which stays on the
        # client; their noise is checked in tests/privacy/test_privacy_formulas.py (clustered centres)
        assert all(not torch.equal(a[k], b[k]) for k in noised), f"{name}: a prototype release is not noised"
        return
    noised = [k for k in noised if k in a]
    assert noised, f"{name}: no prototype release in round 1"
    for k in set(a) - set(noised):
        assert torch.equal(a[k], b[k]), f"{name}: {k} is not a prototype release but differs between noise streams"
    R, n = s.cfg.dp.proto_clip, s.host.data[0].num_train
    scaled = []
    for k in noised:
        counts = a.get("counts")
        assert counts is not None and counts.shape[0] == a[k].shape[0], f"{name}: {k} has no per-row public counts"
        held = counts > 0
        z = s.host.privacy.multiplier(0, n, k)
        scaled.append(((a[k] - b[k]).double()[held] * counts[held, None].double() / (2 * R * z)).flatten())
        assert torch.equal(a[k][~held], b[k][~held]), f"{name}: a class the client lacks is released"
    diff = torch.cat(scaled)
    tol = 5 / math.sqrt(2 * diff.numel())  # 5 standard errors of a sample std over n Gaussian coordinates
    assert abs(float(diff.std()) / math.sqrt(2) - 1) < tol, (name, float(diff.std()) / math.sqrt(2), diff.numel())
