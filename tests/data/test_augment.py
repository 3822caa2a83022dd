"""Training augmentation (data.augment, raysim/data/augment.py): the official code's RandomResizedCrop(0.08-1) and
flip, V views per training image encoded once and cached under a key that names the settings, one view per image
per local epoch drawn from the (round, client) stream, the same inline and on Ray; off is the old path itself."""

from __future__ import annotations

import csv
import os

import numpy as np
import pytest
import torch
from conftest import tiny_config
from PIL import Image

from raysim.errors import ConfigError

DOMAINS = ["art_painting", "cartoon", "photo", "sketch"]


def write_pacs(root, per_class: int = 5, size: int = 24) -> str:
    """A tiny PACS tree of random-noise images (4 domains x 2 classes), its DATA_ROOT returned."""
    for d, dom in enumerate(DOMAINS):
        for c, cls in enumerate(("dog", "cat")):
            for k in range(per_class):
                path = os.path.join(root, "PACS", dom, cls, f"img_{k:02d}.png")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                rng = np.random.default_rng(1000 * d + 100 * c + k)
                Image.fromarray(rng.integers(0, 256, (size, size + 8, 3), dtype=np.uint8)).save(path)
    return str(root)


def pacs_config(tmp_path, cache_dir, *, method="promptfl", epochs=1, options=None, **data):
    root = tmp_path / "data"
    if not (root / "PACS").is_dir():
        write_pacs(root)
    # FedPGP's contrast (weight 100) reads no image and, on random tiny CLIP weights, moves its context ~1e7 times
    # more than the CE term: weight 0 here so the image-dependent term is what the view tests see
    extra = {k: v for k, v in {"fedsept": {"rank": 4}, "fedpgp": {"weight": 0.0}}.items() if k == method}
    if options:  # the method's own section
        extra[method] = {**extra.get(method, {}), **options}
    return tiny_config(tmp_path, cache_dir, method=method, **extra,
                       data={"dataset": "pacs", "data_root": str(root), "partition": "iid", "shots": 0, "augment_views": 3, **data},
                       train={"num_clients": 2, "rounds": 2, "batch_size": 8, "local_epochs": epochs})


def prepared(cfg):
    from raysim.build import make_method
    from raysim.data.prepare import prepare_data

    return prepare_data(cfg, make_method(cfg).needs(), progress=False)


# -- the crop box -----------------------------------------------------------------------------------------------
def test_crop_box_stays_inside_the_image_within_the_scale_range_and_follows_its_generator():
    from raysim.data.crop import SCALE, crop_box

    boxes = [crop_box(40, 30, torch.Generator().manual_seed(s)) for s in range(200)]
    for top, left, h, w in boxes:
        assert 0 <= top and 0 <= left and top + h <= 30 and left + w <= 40 and h > 0 and w > 0
        # rounding the side lengths to pixels moves the area by up to about one row and one column
        assert SCALE[0] * 1200 - (h + w) <= h * w <= SCALE[1] * 1200
    assert len(set(boxes)) > 150  # 200 seeds: boxes vary (a constant crop would fail)
    assert crop_box(40, 30, torch.Generator().manual_seed(7)) == boxes[7]  # a function of its generator alone


# -- the config's edge -------------------------------------------------------------------------------------------
def test_config_refuses_bad_augment_settings(tmp_path, cache_dir):
    with pytest.raises(ConfigError, match="data.augment must be one of auto, off, official"):
        pacs_config(tmp_path, cache_dir, augment="on")
    with pytest.raises(ConfigError, match="data.augment_views must be between 1 and 256"):
        pacs_config(tmp_path, cache_dir, augment_views=0)
    with pytest.raises(ConfigError, match="data.dataset=digits has no images to augment: set data.augment=off"):
        tiny_config(tmp_path, cache_dir, data={"augment": "official"})
    with pytest.raises(ConfigError, match="pools train and test"):
        pacs_config(tmp_path, cache_dir, augment="official", partition="pfllib")


def test_auto_is_official_where_the_official_code_augments_and_off_elsewhere():
    from raysim.data.augment import augment_mode

    for name in ("pacs", "domainnet", "office31", "dtd", "caltech101", "food101"):
        assert augment_mode("auto", name) == "official", name
    for name in ("cifar10", "cifar100", "tiny_imagenet", "synthetic", "digits", "pfllib"):
        assert augment_mode("auto", name) == "off", name  # the official CIFAR transform has no augmentation (SPEC 1.9)
    assert augment_mode("auto", "pacs", input_kind="images") == "off"  # the zoo methods train on the images as loaded
    assert augment_mode("official", "cifar10") == "official"  # asked for: on any dataset of images
    with pytest.raises(ConfigError, match="trains its own image model"):
        augment_mode("official", "pacs", input_kind="images")


# -- the views and their cache -----------------------------------------------------------------------------------
def test_views_differ_from_each_other_and_from_the_test_transform(tmp_path, cache_dir):
    data = prepared(pacs_config(tmp_path, cache_dir))  # auto on pacs: official
    assert data.x_views is not None and data.x_views.shape == (data.x_train.shape[0], 3, data.x_train.shape[1])
    views, clean = torch.from_numpy(data.x_views), torch.from_numpy(data.x_train)
    assert torch.allclose(views.norm(dim=-1), torch.ones(views.shape[:2]), atol=1e-5)  # L2-normalised, as the clean ones
    # distinct crops of noise images give distinct features: a view repeated, or the centre crop reused, would be ~0 apart
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert ((views[:, a] - views[:, b]).norm(dim=-1) > 1e-3).all(), (a, b)
    for v in range(3):
        assert ((views[:, v] - clean).norm(dim=-1) > 1e-3).all(), v
    assert data.x_test.shape[0] > 0 and data.tok_views is None


def test_the_same_seed_gives_the_same_views_and_another_seed_others(tmp_path, cache_dir):
    from raysim.data.augment import AugmentedViews

    cfg = pacs_config(tmp_path, cache_dir)
    a = prepared(cfg).x_views
    b = prepared(pacs_config(tmp_path / "again", str(tmp_path / "fresh-cache"))).x_views  # recomputed, not read back
    # the same images through the same frozen tower: equal up to float noise of the batched forward
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    from raysim.data import DATASETS, LoadSpec

    bundle = DATASETS.get("pacs")(LoadSpec(data_root=cfg.data.data_root, image_size=32))
    one, other = AugmentedViews(bundle.train.images, 2, seed=1), AugmentedViews(bundle.train.images, 2, seed=2)
    assert torch.equal(one[3], AugmentedViews(bundle.train.images, 2, seed=1)[3])  # pixels: a pure function of (seed, image, view)
    assert not torch.allclose(one[3], other[3])
    assert not torch.allclose(one[2], one[3])  # two views of one image


def test_the_cache_key_changes_with_every_augment_setting(tmp_path, cache_dir):
    from raysim.data import DATASETS, LoadSpec
    from raysim.data.features import feature_cache_path, views_kind

    bundle = DATASETS.get("pacs")(LoadSpec(data_root=write_pacs(tmp_path / "d"), image_size=32))

    def path(kind):
        return feature_cache_path(cache_dir, "m", bundle, 32, kind=kind)

    keys = {path(views_kind(v, s, tokens=t)) for v in (3, 8) for s in (1, 2) for t in (False, True)}
    assert len(keys) == 8 and path("clip-eval") not in keys
    import raysim.data.augment as aug

    tag = aug.TAG
    try:
        aug.TAG = tag + "-changed"  # a changed transform (its tag) moves the file too
        assert path(views_kind(3, 1)) not in keys
    finally:
        aug.TAG = tag
    cfg = pacs_config(tmp_path, cache_dir, augment_views=2)
    prepared(cfg)
    v2 = prepared(cfg).x_views  # read back from the cache
    assert v2.shape[1] == 2 and prepared(pacs_config(tmp_path, cache_dir, augment_views=3)).x_views.shape[1] == 3


# -- one view per image per epoch ---------------------------------------------------------------------------------
def test_round_data_draws_one_view_per_image_per_epoch_from_the_round_client_stream(tmp_path, cache_dir):
    data = prepared(pacs_config(tmp_path, cache_dir))
    c0 = data.client(0)
    r = c0.for_round(1, 5, epochs=3)
    assert r.view_choice is not None and r.view_choice.shape == (3, c0.num_train)
    rows = torch.arange(c0.num_train)
    for e in range(3):
        x, _ = r.train_inputs(e)
        assert torch.equal(x, c0.views_train[rows, r.view_choice[e]])  # a gather: the cached view itself
    assert torch.equal(r.x_train, r.train_inputs(0)[0])
    assert torch.equal(r.view_choice, c0.for_round(1, 5, epochs=3).view_choice)  # the same (seed, round, client)
    assert torch.equal(r.view_choice, data.client(0).for_round(1, 5, epochs=3).view_choice)  # a rebuilt slice too
    assert not torch.equal(r.view_choice, c0.for_round(1, 6, epochs=3).view_choice)  # another round
    assert not torch.equal(r.view_choice[0], r.view_choice[1])  # another epoch
    assert not torch.equal(r.view_choice, data.client(1).for_round(1, 5, epochs=3).view_choice[:, : c0.num_train])
    assert set(r.view_choice.flatten().tolist()) == {0, 1, 2}  # every view is used


def test_off_is_the_old_path_itself(tmp_path, cache_dir):
    data = prepared(pacs_config(tmp_path, cache_dir, augment="off"))
    assert data.x_views is None and data.tok_views is None
    c0 = data.client(0)
    assert c0.for_round(1, 0, epochs=2) is c0  # the slice itself: the methods see the tensors they saw before
    x, tok = c0.train_inputs(1)
    assert x is c0.x_train and tok is None
    auto_digits = prepared(tiny_config(tmp_path / "digits", cache_dir))  # auto on digits: off
    assert auto_digits.x_views is None


# -- whole runs ---------------------------------------------------------------------------------------------------
def run_rows(cfg):
    from raysim.engine.loop import run
    from raysim.storage.store import StateStore

    out = run(cfg).out_dir
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    return [float(r["train_loss"]) for r in rows], StateStore(out).load_uploads(1)["uploads"]


def test_training_sees_the_views_and_inline_equals_ray(tmp_path, cache_dir, ray_session):
    def go(tag, augment, **execution):
        cfg = pacs_config(tmp_path / tag, cache_dir, augment=augment)
        cfg.output.record_uploads = True
        for k, v in execution.items():
            setattr(cfg.execution, k, v)
        return run_rows(cfg)

    loss_off, up_off = go("off", "off")
    loss_in, up_in = go("inline", "official")
    loss_ray, up_ray = go("ray", "official", backend="ray", num_actors=2, client_cpus=0.5)
    # the same views drawn from the same streams in one process or two actors: equal up to float noise
    assert loss_ray == pytest.approx(loss_in, abs=1e-6)
    for c in up_in:
        torch.testing.assert_close(up_ray[c]["ctx"], up_in[c]["ctx"], rtol=0, atol=1e-6)
    # the views reach training: the off run's uploads differ by far more than float noise
    assert max(float((up_in[c]["ctx"] - up_off[c]["ctx"]).abs().max()) for c in up_in) > 1e-4


PROMPT_METHODS = ["promptfl", "fedsept", "fedpgp", "fedpha", "pfedmoap", "fedotp", "dpfpl"]


@pytest.mark.parametrize("name", PROMPT_METHODS)
def test_every_prompt_method_trains_each_epoch_on_that_epochs_view(tmp_path, cache_dir, name):
    """Two local epochs: training on the drawn views equals training on a plain slice holding those views when both
    epochs drew the same ones (the method reads the view, features and tokens), and differs when epoch 1 drew others
    (it reads each epoch's own view, not epoch 0's twice)."""
    import copy
    import dataclasses

    from raysim.engine.hosts import ClientHost
    from raysim.sampling import generator

    cfg = pacs_config(tmp_path, cache_dir, method=name, epochs=2)
    data = prepared(cfg)
    host = ClientHost(cfg, data, [0, 1], cfg.output.out_dir)
    shared = host.method.init_shared(host.env, generator(cfg.train.seed, "server-init"))
    base = host.data[0]
    drawn = base.for_round(cfg.train.seed, 0, epochs=2)
    assert drawn.view_choice is not None and not torch.equal(drawn.view_choice[0], drawn.view_choice[1])

    def upload(d):
        res = host.method.local_train(host.env, shared, copy.deepcopy(host.private_state(0)), d,
                                      rng=generator(cfg.train.seed, "train", 0, 0), privacy=host.open_privacy(0, 0, shared))
        out = dict(res.upload)
        for k, v in res.private.items():  # the private parts too (a method's global part may move little)
            for kk, t in (v.items() if isinstance(v, dict) else [("", v)]):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    out[f"private.{k}.{kk}"] = t
        return out

    twice = dataclasses.replace(drawn, view_choice=drawn.view_choice[[0, 0]])
    x0, t0 = twice.train_inputs(0)
    plain = dataclasses.replace(base, x_train=x0, tokens_train=t0 if base.tokens_train is not None else None,
                                views_train=None, token_views_train=None, view_choice=None)
    a, b, c = upload(twice), upload(plain), upload(drawn)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)  # the same inputs and streams: float noise at most
    assert max(float((c[k] - a[k]).abs().max()) for k in a) > 1e-4  # epoch 1's own views change the update


def test_dpfpl_reference_lock_steps_read_each_epochs_view(tmp_path, cache_dir):
    """DP-FPL's reference mode trains one batch per call (a lock-step): past its first epoch's batches it reads
    epoch 1's drawn views (it read x_train, epoch 0's, in every epoch before). The lock-steps of one round, run
    on the drawn data, equal those on a plain slice holding epoch 0's views while they stay in epoch 0, and
    differ from it once epoch 1 begins."""
    import copy
    import dataclasses

    from raysim.engine.hosts import ClientHost
    from raysim.sampling import batches_per_epoch, generator

    cfg = pacs_config(tmp_path, cache_dir, method="dpfpl", epochs=2, options={"dp_mode": "reference"})
    data = prepared(cfg)
    host = ClientHost(cfg, data, [0, 1], cfg.output.out_dir)
    shared = host.method.init_shared(host.env, generator(cfg.train.seed, "server-init"))
    drawn = host.data[0].for_round(cfg.train.seed, 0, epochs=2)
    assert drawn.view_choice is not None and not torch.equal(drawn.view_choice[0], drawn.view_choice[1])
    plain = dataclasses.replace(drawn, x_train=drawn.train_inputs(0)[0], views_train=None, token_views_train=None,
                                view_choice=None)
    per_epoch = batches_per_epoch(drawn.num_train, cfg.train.batch_size)

    def lock_steps(d, n):
        private, grads = copy.deepcopy(host.private_state(0)), []
        for _ in range(n):
            res = host.method.local_train(host.env, shared, private, d, rng=generator(cfg.train.seed, "train", 0, 0),
                                          privacy=host.open_privacy(0, 0, shared))
            private = {**private, **res.private}
            grads.append(res.upload["global_grad"])
        return grads

    a, b = lock_steps(drawn, per_epoch + 1), lock_steps(plain, per_epoch + 1)
    for s in range(per_epoch):  # epoch 0: the same inputs and streams, float noise at most
        torch.testing.assert_close(a[s], b[s], rtol=0, atol=1e-6)
    assert float((a[per_epoch] - b[per_epoch]).abs().max()) > 1e-4  # epoch 1's first batch: its own views
