"""raysim.data.synthetic: deterministic, cached, multi-domain generated images with captions."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from raysim.data import DATASETS, LoadSpec
from raysim.data import synthetic as syn

TINY = syn.SyntheticParams(classes=("circle", "seven", "letter A"), train_per_cell=3, test_per_cell=2, seed=3)


def test_deterministic_from_seed_and_seed_matters():
    a_tr, a_te = syn.generate(TINY, cache_dir=None, workers=1)
    b_tr, b_te = syn.generate(TINY, cache_dir=None, workers=1)
    assert torch.equal(a_tr.images, b_tr.images) and torch.equal(a_te.images, b_te.images)
    assert a_tr.captions == b_tr.captions
    c_tr, _ = syn.generate(dataclasses.replace(TINY, seed=4), cache_dir=None, workers=1)
    assert not torch.equal(a_tr.images, c_tr.images)
    assert not torch.equal(a_tr.images, a_te.images[: len(a_tr)])  # train and test differ


def test_cells_do_not_depend_on_other_classes():
    small, _ = syn.generate(dataclasses.replace(TINY, classes=("seven",)), cache_dir=None, workers=1)
    full, _ = syn.generate(TINY, cache_dir=None, workers=1)
    assert torch.equal(small.images, full.images[full.labels == 1])


def test_shapes_labels_domains_and_captions():
    tr, te = syn.generate(TINY, cache_dir=None, workers=1)
    n_cells = len(TINY.classes) * len(TINY.domains)
    assert tr.images.shape == (n_cells * 3, 3, 32, 32) and tr.images.dtype == torch.uint8
    assert te.images.shape == (n_cells * 2, 3, 32, 32)
    assert set(tr.domains.tolist()) == set(range(4)) and set(tr.labels.tolist()) == {0, 1, 2}
    for split in (tr, te):
        for cap, y, d in zip(split.captions, split.labels, split.domains):
            assert TINY.classes[y].lower() in cap.lower()
            assert syn.DOMAIN_WORDS[TINY.domains[d]] in cap
    # the styles really differ: mean images of the domains are far apart
    means = [tr.images[tr.domains == d].float().mean(0) for d in range(4)]
    assert min(float((means[i] - means[j]).abs().mean()) for i in range(4) for j in range(i + 1, 4)) > 3.0


def test_caption_names_attributes():
    attrs = {"colour": "red", "size": "small", "position": "top left", "background": "striped"}
    cap = syn.caption("seven", "photo", attrs, np.random.default_rng(0))
    assert "seven" in cap and "photo" in cap
    full = [syn.caption("seven", "photo", attrs, np.random.default_rng(s)) for s in range(40)]
    assert any("small red seven" in c and "striped background" in c for c in full)


def test_cache_roundtrip_and_key(tmp_path):
    tr, te = syn.generate(TINY, cache_dir=str(tmp_path), workers=1)
    files = list((tmp_path / "synthetic").glob("*.pt"))
    assert len(files) == 1 and files[0].stem == TINY.key()
    tr2, te2 = syn.generate(TINY, cache_dir=str(tmp_path))
    assert torch.equal(tr.images, tr2.images) and tr.captions == tr2.captions
    keys = {TINY.key()} | {dataclasses.replace(TINY, **kw).key() for kw in
                           [dict(seed=9), dict(train_per_cell=4), dict(resolution=24), dict(domains=("clean",))]}
    assert len(keys) == 5
    images, captions, labels, domains = syn.get_captions(TINY, cache_dir=str(tmp_path))
    assert len(images) == len(captions) == len(labels) == len(domains) == len(tr)


def test_registered_bundle(tmp_path):
    spec = LoadSpec(data_root=str(tmp_path), image_size=48, cache_dir=str(tmp_path))
    b = DATASETS.get("synthetic-small")(spec)
    assert b.classnames == list(syn.SMALL.classes) and b.domain_names == list(syn.DOMAINS)
    assert len(b.train) == 6 * 4 * 16 and len(b.test) == 6 * 4 * 8
    assert b.train.domains is not None and set(b.test.domains.tolist()) == {0, 1, 2, 3}
    x = b.train.images[0]
    assert x.shape == (3, 48, 48) and x.dtype == torch.float32
    assert -3 < float(x.min()) and float(x.max()) < 3
    assert len(b.meta["train_captions"]) == len(b.train)
    b2 = DATASETS.get("synthetic-small")(LoadSpec(data_root=str(tmp_path), image_size=32, cache_dir=str(tmp_path)))
    assert b2.signature != b.signature and "synthetic" in DATASETS and "synthetic-large" in DATASETS
