"""The federation a run trains on: its dataset loaded, partitioned over the clients, and (for CLIP
methods) its frozen image features computed or read from the cache. The engine, the run folder's
reader (raysim.storage.runfolder) and the attacks all rebuild a run's data through `prepare_data`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from raysim.config import RunConfig
from raysim.data.federation import FederationData
from raysim.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def prepare_data(cfg: RunConfig, needs: Any, *, progress: bool) -> FederationData:
    """Load the dataset, partition it, and (for CLIP methods) compute or load frozen image features;
    `needs` is the method's declared `Needs` (input kind and size, image tokens)."""
    from raysim.data import DATASETS, LoadSpec, PartitionSpec, partition
    from raysim.data.augment import augment_mode
    from raysim.data.features import cached_image_features, cached_view_features
    from raysim.data.padcrop import PadCropFlip
    from raysim.data.partition import is_pooled
    from raysim.data.subset import keep_train_fraction
    from raysim.models.clip import ModelSpec, load_clip, register_builtin_configs, resolve_device

    register_builtin_configs()
    import open_clip

    if cfg.model.name not in open_clip.list_models():
        load_clip(ModelSpec(cfg.model.name, cfg.model.pretrained, cache_dir=cfg.output.cache_dir))  # raises the helpful ConfigError
    model_cfg = open_clip.get_model_config(cfg.model.name) or {}
    size = (model_cfg.get("vision_cfg") or {}).get("image_size", 224)
    size = int(size[0] if isinstance(size, (list, tuple)) else size)
    if needs.input == "images" and needs.image_size:
        size = needs.image_size  # methods that train their own image models pick their input size
    spec = LoadSpec(data_root=cfg.data.data_root, image_size=size, download=cfg.data.download, seed=cfg.train.seed,
                    cache_dir=cfg.output.cache_dir, cifar_transform=cfg.data.cifar_transform)
    bundle = keep_train_fraction(DATASETS.get(cfg.data.dataset)(spec), cfg.data.train_fraction, seed=cfg.train.seed)
    pspec = PartitionSpec(
        train_labels=bundle.train.labels,
        test_labels=bundle.test.labels,
        num_clients=cfg.train.num_clients,
        seed=cfg.train.seed,
        beta=cfg.data.beta,
        shots=cfg.data.shots,
        min_samples=cfg.data.min_samples,
        domain_reseed=cfg.data.domain_reseed,
        train_domains=bundle.train.domains,
        test_domains=bundle.test.domains,
    )
    if cfg.data.partition == "stored":  # the clients a dataset folder stores (data.dataset=pfllib), as stored
        from raysim.data.partition import few_shot
        from raysim.data.pfllib_folder import stored_splits

        if needs.input != "images":
            raise ConfigError(
                f"data.dataset={cfg.data.dataset} gives its images as stored ({bundle.meta.get('sample_shape')}, the "
                f"folder's normalisation), so it suits methods that train their own image models (the zoo methods), not "
                f"{cfg.method}, which encodes images with {cfg.model.name}"
            )
        check_stored_input(cfg, needs, tuple(bundle.meta.get("sample_shape", ())))
        splits = stored_splits(bundle)
        if cfg.data.shots > 0:
            splits = few_shot(splits, bundle.train.labels, cfg.data.shots, cfg.train.seed)
    else:
        splits = partition(cfg.data.partition, pspec)
    ttr = tte = None
    x_views = tok_views = None
    augment = augment_mode(cfg.data.augment, cfg.data.dataset, partition=cfg.data.partition, input_kind=needs.input,
                           image_augment=needs.image_augment)
    image_augment = None
    if needs.input == "features":
        tokens = needs.tokens
        xtr, xte, *toks = cached_image_features(
            bundle, model_spec=ModelSpec(cfg.model.name, cfg.model.pretrained, cache_dir=cfg.output.cache_dir), image_size=size,
            cache_dir=cfg.output.cache_dir,
            device=resolve_device(cfg.execution.device), progress=progress, tokens=tokens,
        )
        if tokens:
            ttr, tte = toks
            if ttr.shape[1] < 2:
                raise ConfigError(
                    f"{cfg.model.name}'s image tower yields {ttr.shape[1]} token per image at {size} px (a 1x1 feature map), "
                    "so attending over (or transporting between) tokens degenerates to the pooled feature; use a ViT image tower "
                    "(e.g. model=raysim-tiny, or a ViT checkpoint from `raysim pretrain --vision vit`) or the method's pooled "
                    "mode (fedsept.router=pooled, fedotp.tokens=pooled)"
                )
        if augment == "official":  # V augmented views of every training image, encoded once (raysim/data/augment.py)
            log.info("data.augment=%s (%s): %d augmented views per training image", augment, cfg.data.augment, cfg.data.augment_views)
            views = cached_view_features(
                bundle, views=cfg.data.augment_views, seed=cfg.train.seed,
                model_spec=ModelSpec(cfg.model.name, cfg.model.pretrained, cache_dir=cfg.output.cache_dir), image_size=size,
                cache_dir=cfg.output.cache_dir, device=resolve_device(cfg.execution.device), progress=progress, tokens=tokens,
            )
            x_views = views[0].numpy()
            tok_views = views[1].numpy() if tokens else None
    else:
        xtr, xte = materialize_images(bundle.train.images), materialize_images(bundle.test.images)
        if augment == "official":  # cropped and flipped afresh at every pass over the data (raysim/data/padcrop.py)
            log.info("data.augment=%s (%s): %s on the training images", augment, cfg.data.augment, needs.image_augment)
            image_augment = PadCropFlip.normalised(spec.mean, spec.std)
    x_train, x_test = xtr.numpy(), xte.numpy()  # features (N, D) or images (N, 3, S, S)
    y_train, y_test = bundle.train.labels.astype(np.int64), bundle.test.labels.astype(np.int64)
    tok_train = None if ttr is None else ttr.numpy()  # (N, K, width) float16, only when asked for
    tok_test = None if tte is None else tte.numpy()
    if is_pooled(cfg.data.partition):  # the split's indices point into train + test merged (partition=pfllib)
        x_train = x_test = np.concatenate([x_train, x_test])
        y_train = y_test = np.concatenate([y_train, y_test])
        if tok_train is not None and tok_test is not None:
            tok_train = tok_test = np.concatenate([tok_train, tok_test])
    return FederationData(
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        train_idx=[s.train for s in splits],
        test_idx=[s.test for s in splits],
        classnames=list(bundle.classnames),
        tok_train=tok_train,
        tok_test=tok_test,
        client_domains=client_domains(bundle, splits),
        x_views=x_views,
        tok_views=tok_views,
        image_augment=image_augment,
    )


def check_stored_input(cfg: RunConfig, needs: Any, shape: tuple[int, ...]) -> None:
    """Images used as stored (data.dataset=pfllib) must fit the method's zoo models: one channel at 28x28 for
    fedavgcnn_1x28, three channels for the others, and the FedAvgCNNs' own size (their flatten width is fixed)."""
    from raysim.models.zoo import family

    opts: Any = cfg.methods.get(cfg.method.lower())
    if opts is None:  # build_config always materialises the run's method section
        return
    if getattr(opts, "model_family", ""):  # a family of client models (fedpcl's `model` is then unused)
        archs = list(family(opts.model_family))
    else:  # one model for every client (the homogeneous methods)
        archs = [opts.model.lower()] if getattr(opts, "model", "") else []
    shared = str(getattr(opts, "shared_model", "")).lower()
    if shared and shared != "first":
        archs.append(shared)
    side = int(needs.image_size or 32)
    for arch in dict.fromkeys(archs):
        want = {"fedavgcnn_1x28": (1, 28, 28), "fedavgcnn": (3, side, side), "cnn_tiny": (3, side, side)}.get(arch)
        bad = shape != want if want else (len(shape) != 3 or shape[0] != 3)
        if bad:
            raise ConfigError(
                f"data.dataset=pfllib uses the folder's images as stored, {shape}; {cfg.method}'s {arch} takes "
                f"{want or '3-channel images'}: pick a family that takes them (FedAvgCNN-1x28 for 1x28x28, an HtFE-img "
                "family for 3x32x32), or export the data at that shape (raysim export-pfllib)"
            )


def client_domains(bundle: Any, splits: list[Any]) -> Optional[list[str]]:
    """Each client's domain name (the most common among its training images), or None without domains."""
    doms = bundle.train.domains
    if doms is None or not bundle.domain_names:
        return None
    out = []
    for s in splits:
        d = doms[s.train] if len(s.train) else doms[:0]
        out.append(bundle.domain_names[int(np.bincount(d).argmax())] if len(d) else "")
    return out


def materialize_images(images) -> "torch.Tensor":
    """All images of a (small) dataset as one float tensor, for methods that train image models."""
    import torch

    loader = torch.utils.data.DataLoader(images, batch_size=512, shuffle=False)
    return torch.cat([b[0] if isinstance(b, (list, tuple)) else b for b in loader])
