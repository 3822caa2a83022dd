"""FedSEPT's patch-token router (SPEC 1.3, `fedsept.router=patch`): the image tower's tokens are read in the
feature pass and cached, they reach the router (never the upload), the probe query u then matters, and
runs agree across backends."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import tiny_config  # noqa: E402

from raysim.errors import ConfigError  # noqa: E402
from raysim.methods import ClientData, TrainConfig, get_method  # noqa: E402
from raysim.models.clip import ModelSpec, build_clip_env, encode_images, load_clip  # noqa: E402
from raysim.storage.store import StateStore  # noqa: E402

CLASSES = ["zero", "one", "two", "three", "four"]


@pytest.fixture(scope="module")
def tiny():
    return load_clip(ModelSpec("raysim-tiny"))


def test_vit_tokens_are_the_pre_ln_post_sequence(tiny):
    images = torch.utils.data.TensorDataset(torch.randn(5, 3, 32, 32))
    pooled = encode_images(tiny, images, batch_size=2)
    feats, tokens = encode_images(tiny, images, batch_size=2, tokens=True)
    assert torch.equal(feats, pooled)  # reading the tokens does not change the pooled features
    v = tiny.visual
    assert tokens.dtype == torch.float16 and tokens.shape == (5, 1 + (32 // 8) ** 2, v.transformer.width)
    # CLS pooling: ln_post(token 0) @ proj is the image feature, so the tokens are the pre-ln_post sequence
    again = F.normalize(v.ln_post(tokens[:, 0].float()) @ v.proj, dim=-1)
    torch.testing.assert_close(again, feats, atol=5e-3, rtol=0)


def test_cnn_tower_tokens_are_its_last_feature_map():
    model = load_clip(ModelSpec("raysim-clip"))  # a timm CNN image tower (random weights here)
    images = torch.utils.data.TensorDataset(torch.randn(3, 3, 32, 32))
    _, tokens = encode_images(model, images, tokens=True)
    fmap = model.visual.trunk.forward_features(torch.zeros(1, 3, 32, 32))
    assert tokens.shape == (3, fmap.shape[2] * fmap.shape[3], model.visual.trunk.num_features)


def _method(env, **opts):
    cls = get_method("fedsept")
    return cls(TrainConfig(n_ctx=4, batch_size=4, lr=0.05), cls.Options(rank=8, router_dropout=0.0, **opts))


def _data(env, tiny, n=8):
    g = torch.Generator().manual_seed(0)
    feats, tokens = encode_images(tiny, torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32, generator=g)), tokens=True)
    y = torch.arange(n) % len(CLASSES)
    return ClientData(0, feats, y, feats[:4], y[:4], len(CLASSES), tokens_train=tokens, tokens_test=tokens[:4])


@pytest.mark.parametrize("router", ["pooled", "patch"])
def test_probe_query_trains_only_with_patch_tokens(tiny, router):
    from raysim.privacy.dpsgd import NoDP

    env = build_clip_env(ModelSpec("raysim-tiny"), CLASSES, 4)
    m = _method(env, router=router)
    assert m.needs().tokens == (router == "patch")
    data = _data(env, tiny)
    shared = m.init_shared(env, torch.Generator().manual_seed(0))
    private = m.init_private(env, data, torch.Generator().manual_seed(1))
    width = env.token_dim if router == "patch" else env.feature_dim
    assert private["router"]["probe"].shape == (1, width)  # SPEC 1.3: the MHA is built at the token width
    out = m.local_train(env, shared, private, data, rng=torch.Generator().manual_seed(2), privacy=NoDP())
    assert set(out.upload) == {"A"}  # the tokens and the router stay on the client
    moved = (out.private["router"]["probe"] - private["router"]["probe"]).abs().max().item()
    if router == "patch":
        assert moved > 1e-5  # K tokens: u decides where the router looks, and it trains
    else:
        assert moved < 1e-8  # one pooled key: the attention weight is 1 and u gets no gradient (SPEC 1.3)
    predict = m.predictor(env, shared, out.private)
    logits = predict(data.x_test, data.tokens_test) if router == "patch" else predict(data.x_test)
    assert logits.shape == (4, len(CLASSES))
    if router == "patch":  # the probe now decides where the router looks, so it changes the prediction
        state = dict(out.private["router"], probe=out.private["router"]["probe"] + 1.0)
        assert not torch.allclose(m.predictor(env, shared, dict(out.private, router=state))(data.x_test, data.tokens_test), logits)


def test_patch_router_end_to_end_same_results_on_both_backends(tmp_path, cache_dir, ray_session):
    from raysim.engine.loop import run

    opts = dict(method="fedsept", fedsept={"router": "patch", "rank": 8}, train={"n_ctx": 4, "rounds": 2})
    a = run(tiny_config(tmp_path / "inline", cache_dir, **opts))
    b = run(tiny_config(tmp_path / "ray", cache_dir, execution={"backend": "ray", "num_actors": 2}, **opts))
    cols = ["round", "in_client", "cross_client", "hm", "train_loss", "bytes_up", "bytes_down"]
    ra, rb = (pd.read_csv(r.out_dir / "results.csv")[cols] for r in (a, b))
    pd.testing.assert_frame_equal(ra, rb)
    assert ra["in_client"].iloc[-1] > 0.2  # it learns (5 classes per client on digits)
    assert (ra["bytes_up"] > 0).all()
    assert list(Path(cache_dir).glob("features/*-tokens.pt"))  # tokens cached next to the pooled features


def test_single_token_tower_is_refused_with_a_way_out(tmp_path, cache_dir):
    from raysim.engine.loop import run

    cfg = tiny_config(tmp_path, cache_dir, method="fedsept", model={"name": "raysim-clip"}, fedsept={"router": "patch"})
    with pytest.raises(ConfigError, match="1 token per image.*ViT"):
        run(cfg)


def test_pretrain_folder_loads_and_runs_the_patch_router(tmp_path, cache_dir):
    """A ViT from `raysim pretrain` is used with pretrained=<its folder> (model=<its name>)."""
    from raysim.data import synthetic as syn
    from raysim.engine.loop import run
    from raysim.tools import pretrain as pt

    bench = syn.SyntheticParams(classes=("circle", "seven", "letter A"), train_per_cell=2, test_per_cell=3, seed=5)
    out = tmp_path / "vit"
    pt.pretrain(out=str(out), steps=2, text="clip", vision="vit", batch_size=16, per_cell=2, classes=syn.CLASS_POOL[:4],
                warmup=1, cache_dir=str(tmp_path / "pc"), bench=bench, progress=False, embed_dim=32, vision_width=48,
                vision_layers=1, patch_size=8, text_width=32, text_layers=1)
    name = "raysim-clip-vit"
    with pytest.raises(ConfigError, match=f"model.name={name}"):
        run(tiny_config(tmp_path / "wrong", cache_dir, model={"pretrained": str(out)}))
    res = run(tiny_config(tmp_path, cache_dir, method="fedsept", model={"name": name, "pretrained": str(out)},
                          train={"n_ctx": 4, "rounds": 1},
                          fedsept={"router": "patch", "rank": 4}))
    saved = StateStore(res.out_dir).load_client(0, 10**6)
    assert saved["private"]["router"]["probe"].shape == (1, 48)  # the ViT's token width, not the 32-d embedding
    assert list(Path(cache_dir).glob("features/*-tokens.pt"))


@pytest.mark.parametrize("method,section", [("fedotp", {}), ("fedsept", {"fedsept": {"router": "patch", "rank": 4}})])
def test_token_methods_run_on_the_bundled_raysim_clip2(tmp_path, cache_dir, method, section):
    """The bundled raysim-clip2 has a ViT image tower, so FedOTP's default patch-token transport and FedSEPT's
    patch router run on it (on the CNN raysim-clip, still model.name's default, they are refused, exit 2)."""
    from raysim.engine.loop import run

    cfg = tiny_config(tmp_path, cache_dir, method=method, model={"name": "raysim-clip2", "pretrained": "bundled"},
                      train={"n_ctx": 4, "rounds": 1}, **section)
    res = run(cfg)  # fedotp.tokens is left at its default, patch
    assert 0.0 <= res.summary["in_client"] <= 1.0
    assert list(Path(cache_dir).glob("features/*-tokens.pt"))  # the patch tokens were read and cached
