"""data.augment for the VPDR frameworks (raysim/data/padcrop.py): the VPDR code's RandomCrop(size, padding 4) and
horizontal flip, taken afresh on the materialised images at every pass over a client's training images from the
(round, client) stream; the policy (auto, official, its refusals); the same crops inline and on Ray."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from raysim.build import build_config
from raysim.data.base import CLIP_MEAN, CLIP_STD
from raysim.data.padcrop import NAME, PADDING, PadCropFlip
from raysim.errors import ConfigError


@pytest.fixture(scope="module")
def backbone(tmp_path_factory) -> str:
    """A tiny random HF ViT folder (2 blocks, width 32, 8 px patches, 32 px input): fast."""
    from raysim.models.vit_adapter import random_hf_vit

    path = tmp_path_factory.mktemp("vit") / "tiny"
    random_hf_vit(width=32, layers=2, patch_size=8, heads=2, seed=0).vit.save_pretrained(str(path))
    return str(path)


def vpdr_values(tmp_path, cache_dir, backbone, *, augment="official", backend="inline", out="run", rounds=2, epochs=2):
    return {
        "method": "vpdr_fedproto",
        "data": {"dataset": "digits4", "partition": "domain", "shots": 0, "augment": augment},
        "train": {"num_clients": 4, "rounds": rounds, "batch_size": 64, "local_epochs": epochs},
        "eval": {"every": 1, "last": 1, "protocol": "vpdr"},
        "execution": {"backend": backend, "num_actors": 2},
        "output": {"progress": False, "tensorboard": False, "cache_dir": cache_dir, "out_dir": str(tmp_path / out)},
        "dp": {"epsilon": 1.0},
        "vpdr_fedproto": {"backbone": backbone},
    }


def prepared(cfg):
    from raysim.build import make_method
    from raysim.data.prepare import prepare_data

    return prepare_data(cfg, make_method(cfg).needs(), progress=False)


# -- the transform ------------------------------------------------------------------------------------------------
def test_the_crop_is_torchvisions_randomcrop_with_padding_4_and_flip_on_the_normalised_image():
    from PIL import Image
    from torchvision.transforms import functional as TF

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
    t = PadCropFlip.normalised(CLIP_MEAN, CLIP_STD)
    x = TF.normalize(TF.to_tensor(img), list(CLIP_MEAN), list(CLIP_STD))
    for top, left, flip in ((0, 0, 0), (8, 8, 1), (3, 6, 0), (7, 1, 1), (4, 4, 0)):
        # the VPDR code's order on the PIL image: pad 4 black pixels, crop at (top, left), flip, ToTensor, Normalize
        want = TF.crop(TF.pad(img, PADDING, fill=0), top, left, 20, 20)
        want = TF.normalize(TF.to_tensor(TF.hflip(want) if flip else want), list(CLIP_MEAN), list(CLIP_STD))
        got = t(x[None], torch.tensor([[top, left, flip]]))[0]
        # the same float32 affine map per pixel, taken before the copy here and after it there: equal to rounding
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(t(x[None], torch.tensor([[PADDING, PADDING, 0]]))[0], x)  # the centre window, unflipped, is the image


def test_draws_cover_every_offset_and_flip_half_the_time_from_their_generator():
    t = PadCropFlip.normalised(CLIP_MEAN, CLIP_STD)
    d = t.draw(4000, 2, torch.Generator().manual_seed(3))
    assert d.shape == (2, 4000, 3) and d.dtype == torch.int64
    assert set(d[..., 0].unique().tolist()) == set(range(2 * PADDING + 1)) == set(d[..., 1].unique().tolist())
    # 8000 fair coins: the flip share is within 0.5 +- 0.03 (about 5.4 standard deviations)
    assert abs(float(d[..., 2].float().mean()) - 0.5) < 0.03
    assert torch.equal(d, t.draw(4000, 2, torch.Generator().manual_seed(3)))
    assert not torch.equal(d, t.draw(4000, 2, torch.Generator().manual_seed(4)))


# -- the policy ---------------------------------------------------------------------------------------------------
def test_auto_is_official_where_the_vpdr_code_augments_and_official_refuses_where_it_cannot_apply():
    from raysim.data.augment import augment_mode

    for name in ("vpdr_digits", "pacs", "office_caltech10"):  # utils/domain_skew.py's train transforms
        assert augment_mode("auto", name, input_kind="images", image_augment=NAME) == "official", name
    for name in ("cifar10", "digits4", "digits", "synthetic"):  # label_skew.py has none; the stand-ins stay as they were
        assert augment_mode("auto", name, input_kind="images", image_augment=NAME) == "off", name
    assert augment_mode("official", "digits4", input_kind="images", image_augment=NAME) == "official"
    assert augment_mode("official", "cifar10", input_kind="images", image_augment=NAME) == "official"
    assert augment_mode("auto", "pacs", input_kind="images") == "off"  # a zoo method declares no augmentation
    with pytest.raises(ConfigError, match="trains its own image model"):
        augment_mode("official", "pacs", input_kind="images")
    with pytest.raises(ConfigError, match="stores its images already normalised.*set data.augment=off"):
        augment_mode("official", "pfllib", input_kind="images", image_augment=NAME)
    with pytest.raises(ConfigError, match="pools train and test"):
        augment_mode("official", "cifar10", partition="pfllib", input_kind="images", image_augment=NAME)


def test_the_config_accepts_official_for_vpdr_without_its_backbone_and_refuses_it_for_a_zoo_method(tmp_path, cache_dir):
    values = vpdr_values(tmp_path, cache_dir, str(tmp_path / "no-weights-here"))
    assert build_config(values).data.augment == "official"  # a dry run: the backbone's config is not read
    zoo = {"method": "fedproto", "fedproto": {"model_family": "HtFE2"}, "data": {"dataset": "digits", "partition": "dirichlet",
                                                                                  "shots": 0, "augment": "official"}}
    with pytest.raises(ConfigError, match="trains its own image model.*set data.augment=off"):
        build_config(zoo)


# -- the crops a client trains on ---------------------------------------------------------------------------------
def test_each_pass_crops_afresh_from_the_round_client_stream(tmp_path, cache_dir, backbone):
    data = prepared(build_config(vpdr_values(tmp_path, cache_dir, backbone)))
    assert data.image_augment is not None
    c = data.client(1)
    idx = torch.arange(c.num_train)
    assert c.crop_draws is None and torch.equal(c.train_batch(idx), c.x_train)  # evaluation's slice: the images as loaded
    r = c.for_round(1, 0, epochs=2)
    assert r.crop_draws.shape == (3, c.num_train, 3)  # two epochs and the release's pass
    e0, e1, rel = r.train_batch(idx, 0), r.train_batch(idx, 1), r.train_batch(idx)
    for x in (e0, e1, rel):
        assert x.shape == c.x_train.shape
        # a window off the centre or a flip moves the pixels of nearly every image (the centre unflipped is 1/162)
        assert (x - c.x_train).flatten(1).abs().amax(1).gt(1e-3).float().mean() > 0.9
    assert not torch.equal(e0, e1) and not torch.equal(e0, rel)  # another crop each pass
    torch.testing.assert_close(r.train_batch(idx[5:9], 1), e1[5:9], rtol=0, atol=0)  # a batch is its rows' crops
    again = c.for_round(1, 0, epochs=2)
    assert torch.equal(again.crop_draws, r.crop_draws)  # the same (seed, round, client): the same crops
    for seed, rnd, cid in ((2, 0, 1), (1, 1, 1)):
        assert not torch.equal(data.client(cid).for_round(seed, rnd, epochs=2).crop_draws, r.crop_draws)
    assert not torch.equal(data.client(2).for_round(1, 0, epochs=2).crop_draws[:, :5], r.crop_draws[:, :5])
    off = prepared(build_config(vpdr_values(tmp_path, cache_dir, backbone, augment="auto")))  # auto on digits4: off
    assert off.image_augment is None and off.client(1).for_round(1, 0, epochs=2).crop_draws is None


def rows(path):
    with open(path) as f:
        return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(f)]


def test_a_run_trains_on_the_crops_and_inline_equals_ray(tmp_path, cache_dir, backbone, ray_session):
    from raysim.engine.loop import run

    off = run(build_config(vpdr_values(tmp_path, cache_dir, backbone, augment="off", out="off")))
    a = run(build_config(vpdr_values(tmp_path, cache_dir, backbone, out="inline")))
    b = run(build_config(vpdr_values(tmp_path, cache_dir, backbone, backend="ray", out="ray")))
    # the same computation on two backends, the crops drawn from the same streams: the same rows, to the digit
    for name in ("results.csv", "client_results.csv"):
        assert rows(a.out_dir / name) == rows(b.out_dir / name), name
    assert math.isfinite(a.summary["vpdr_avg"])
    # the crops reach training and the release: the round's training losses differ from the run without them
    loss = [float(r["train_loss"]) for r in rows(a.out_dir / "results.csv")]
    loss_off = [float(r["train_loss"]) for r in rows(off.out_dir / "results.csv")]
    assert max(abs(x - y) for x, y in zip(loss, loss_off)) > 1e-4
