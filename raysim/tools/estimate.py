"""A FLOP-based GPU-hours estimate of a run, from its config alone (no data, no weights): what
`raysim compare --dry-run` prints beside each run (docs/papers/fedsept.md "Paper presets").

The prompt methods' cost is the frozen text tower, run forward and backward (3x a forward) at every local
step for each learned prompt set over all C classes; the image tower runs once per training image and
augmented view (features cached) and once per test image; evaluation re-encodes the classes per client.

    flops = steps * 3 * passes * C * F_text + N_train * views * F_image + N_test * F_image
            + evals * K * passes * C * F_text
    steps = rounds * K * participation * E * ceil(n_k / B),   n_k = shots * classes per client
    gpu_hours = flops / THROUGHPUT / 3600

F_text / F_image: forward FLOPs of one 77-token caption / one 224x224 image (2 x parameters x tokens,
open_clip's counts for ViT-B/16: 2.9 GFLOP MACs x 2 for text, 17.6 GFLOP for the image);
THROUGHPUT = 40 TFLOP/s, an A100 at about a quarter of its TF32 peak. An order-of-magnitude figure:
data loading, Python overhead and per-example DP-SGD VJPs (which replay the text backward per chunk of
dp.microbatch examples) are not in it; under DP the text backward is multiplied by ceil(B / microbatch).

Heterogeneous-model methods (FedTSP's tables: a `model_family` like HtFE9 or one `model` per client) and
the VPDR frameworks (`vpdr_*`: a frozen ViT with an adapter after every block) train the whole network, so:

    flops = rounds * participation * E * sum_k n_k * 3 * F_k  +  evals * sum_k n_test_k * F_k
    n_k = N_train / K,  n_test_k = N_test / K

F_k is the forward FLOPs of client k's model on one image: for the zoo CNNs counted by
torch.utils.flop_counter.FlopCounterMode on the actual model (`make_client_model(arch_of(family, k), ...)`,
built on the meta device, one dummy image at the dataset's size: no data, no weights); for the ViT backbones the standard
transformer count 2 x (12 d^2 + 2 T d) per token per block (Kaplan et al. 2020, with d the width, 4d the MLP
and T the tokens) plus the patch embedding, at 224x224 with 16x16 patches (ViT-S/16: d=384, 12 blocks, 9.2
GFLOP, timm's 4.6 GMACs). Training is 3x the forward (forward + backward), also for the VPDR adapters: the
adapters sit inside every block, so the backbone runs forward and backward at every step (its weight
gradients are skipped, so 3x is an upper bound; nearer 2x). Server-side work (FedTSP's PLM, prototype
aggregation, generators) is not in it.
"""

from __future__ import annotations

import math
from typing import Any

from raysim.data.augment import augment_mode
from raysim.data.folders import split_sizes
from raysim.data.subset import kept_count

THROUGHPUT = 40e12  # FLOP/s
MODEL_FLOPS = {  # name -> (text forward per caption, image forward per image), FLOPs
    "ViT-B-16": (5.9e9, 17.6e9),
    "ViT-B-32": (5.9e9, 4.4e9),
    "ViT-L-14": (13.1e9, 81.1e9),
}
SMALL = (1e7, 1e7)  # the bundled / tiny models: negligible
# dataset -> (classes, training images, test images): the CoOp splits and torchvision sets
DATASETS = {
    "food101": (101, 50500, 30300), "caltech101": (100, 4128, 2465), "flowers102": (102, 4093, 2463),
    "dtd": (47, 2820, 1692), "oxford_pets": (37, 2944, 3669), "cifar10": (10, 50000, 10000),
    "cifar100": (100, 50000, 10000), "office31": (31, 3288, 822),
    "officehome": (65, 12470, 3118), "domainnet": (100, 120000, 30000),
    "tiny_imagenet": (200, 100000, 10000), "digits": (10, 60000, 10000), "digits4": (10, 60000, 10000),
}
# datasets counted domain by domain (data.train_fraction keeps max(1, floor(f n)) of each domain's n training
# images, raysim/data/subset.py): domain -> (training images, test images) as raysim's loader splits them
DOMAIN_SIZES: dict[str, dict[str, tuple[int, int]]] = {
    # vpdr_digits: every image of each split (raysim/data/vpdr.py): MNIST 60000/10000, USPS 7291/2007, SVHN
    # 73257/26032 (torchvision's splits), SynthDigits imgs_train/imgs_valid 10000/2000 (the sizes the Kaggle
    # synthetic-digits set lists; not counted from a copy here)
    "vpdr_digits": {"mnist": (60000, 10000), "usps": (7291, 2007), "svhn": (73257, 26032), "synth": (10000, 2000)},
    # the index % 10 <= 7 split (raysim/data/folders.py `split_sizes`) of each flat domain folder: Office-Caltech's
    # amazon 958, caltech 1123, dslr 157, webcam 295 images; PACS's art_painting 2048, cartoon 2344, photo 1670,
    # sketch 3929. The VPDR code splits 80/20 at random (n_test = int(0.2 n)) before keeping 30% of the training
    # split: a domain's training split differs from raysim's by at most one image
    "office_caltech10": {d: split_sizes(n) for d, n in {"amazon": 958, "caltech": 1123, "dslr": 157, "webcam": 295}.items()},
    "pacs": {d: split_sizes(n) for d, n in {"art_painting": 2048, "cartoon": 2344, "photo": 1670, "sketch": 3929}.items()},
}
CLASSES = {"vpdr_digits": 10, "office_caltech10": 10, "pacs": 7}
DATASETS.update({name: (CLASSES[name], sum(tr for tr, _ in doms.values()), sum(te for _, te in doms.values()))
                 for name, doms in DOMAIN_SIZES.items()})
IMAGE_SIZE = {"tiny_imagenet": 64}  # the zoo CNNs' input side; 32 otherwise (CIFAR, digits at 32x32)
VIT_WIDTH = {"tiny": (192, 12), "small": (384, 12), "base": (768, 12), "raysim-vit": (384, 12)}  # name part -> (d, blocks)
PASSES = {"zeroshot": 0, "promptfl": 1, "dpfpl": 1, "fedotp": 2, "fedpha": 2, "fedpgp": 4, "pfedmoap": 1}


def text_passes(cfg: Any) -> float:
    """Learned prompt sets encoded per step: FedSEPT's M experts, FedOTP's 2 prompts, FedPGP's 4 feature sets."""
    if cfg.method == "fedsept":
        from raysim.build import method_options

        opts = method_options(cfg)
        return 1.0 if getattr(opts, "variant", "full") == "single" else float(getattr(opts, "experts", 4))
    return float(PASSES.get(cfg.method, 1))


def sizes(cfg: Any) -> tuple[int, int, int]:
    """(classes, training images, test images) of the run's data: data.train_fraction of each domain's training
    split (`DOMAIN_SIZES`), or of the whole split for a dataset counted as one; the test split whole."""
    classes, n_train, n_test = DATASETS.get(cfg.data.dataset, (10, 1000, 1000))
    f = float(cfg.data.train_fraction)
    domains = DOMAIN_SIZES.get(cfg.data.dataset)
    if domains is not None:
        return classes, sum(kept_count(tr, f) for tr, _ in domains.values()), n_test
    return classes, kept_count(n_train, f), n_test


def estimate(cfg: Any) -> dict[str, float]:
    """{"flops", "gpu_hours", "steps"} of one run (see the module docstring)."""
    forward = client_forward_flops(cfg)
    if forward is not None:
        return estimate_models(cfg, forward)
    f_text, f_image = MODEL_FLOPS.get(cfg.model.name, SMALL)
    classes, n_train_all, n_test = sizes(cfg)
    K = max(1, cfg.train.num_clients)
    if cfg.data.shots > 0 and cfg.data.partition == "pathological":
        n_k = cfg.data.shots * max(1, round(classes / K))
    else:
        n_k = max(1, n_train_all // K)
    n_k = min(n_k, max(1, n_train_all // K)) if cfg.data.partition != "pathological" else n_k
    batches = max(1, math.ceil(n_k / cfg.train.batch_size))
    steps = cfg.train.rounds * max(1, round(K * cfg.train.participation)) * cfg.train.local_epochs * batches
    passes = text_passes(cfg)
    backward = 3.0
    if cfg.dp.enabled and cfg.dp.microbatch > 0:
        backward = 1.0 + 2.0 * math.ceil(cfg.train.batch_size / cfg.dp.microbatch)
    on = augment_mode(cfg.data.augment, cfg.data.dataset, partition=cfg.data.partition) == "official"
    views = cfg.data.augment_views if on else 1  # data.augment resolved per dataset (auto: off for CIFAR)
    evals = len({r for r in range(cfg.train.rounds) if (r + 1) % cfg.eval.every == 0 or r >= cfg.train.rounds - cfg.eval.last})
    flops = (steps * backward * passes * classes * f_text + n_k * K * views * f_image + n_test * f_image
             + evals * K * max(passes, 1) * classes * f_text)
    return {"flops": flops, "gpu_hours": flops / THROUGHPUT / 3600.0, "steps": float(steps)}


def vit_forward_flops(backbone: str, *, image: int = 224, patch: int = 16) -> float:
    """Forward FLOPs of one image through a ViT (module docstring); the width from the backbone's name."""
    d, layers = next((v for k, v in VIT_WIDTH.items() if k in backbone.lower()), VIT_WIDTH["small"])
    tokens = (image // patch) ** 2 + 1
    return layers * tokens * 2.0 * (12 * d * d + 2 * tokens * d) + 2.0 * (tokens - 1) * 3 * patch * patch * d


_CNN_CACHE: dict[tuple[str, int, int, int], float] = {}


def cnn_forward_flops(arch: str, feature_dim: int, classes: int, image_size: int) -> float:
    """Forward FLOPs of one image through the zoo model, counted on the actual model built on the meta device
    (shapes only: no weights are initialised, no arithmetic is done; the count is the same as on real tensors)."""
    key = (arch, feature_dim, classes, image_size)
    if key not in _CNN_CACHE:
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        from raysim.models.zoo import make_client_model

        with torch.device("meta"):
            model = make_client_model(arch, feature_dim, classes, image_size=image_size).eval()
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model(torch.zeros(1, 3, image_size, image_size, device="meta"))
        _CNN_CACHE[key] = float(counter.get_total_flops())
    return _CNN_CACHE[key]


def client_forward_flops(cfg: Any) -> list[float] | None:
    """Per-client forward FLOPs for the heterogeneous-model and VPDR methods; None for the prompt methods."""
    from raysim.build import method_options

    opts = method_options(cfg)
    classes = DATASETS.get(cfg.data.dataset, (10, 1000, 1000))[0]
    K = max(1, cfg.train.num_clients)
    if cfg.method.startswith("vpdr_"):
        return [vit_forward_flops(str(getattr(opts, "backbone", "small")))] * K
    fam, arch = getattr(opts, "model_family", None), getattr(opts, "model", None)
    if not fam and not arch:
        return None
    from raysim.models.zoo import arch_of

    size = IMAGE_SIZE.get(cfg.data.dataset, 32)
    dim = int(getattr(opts, "feature_dim", 0) or 0) or _plm_width(cfg, opts)
    return [cnn_forward_flops(arch_of(fam, k) if fam else str(arch), dim, classes, size) for k in range(K)]


def _plm_width(cfg: Any, opts: Any) -> int:
    """FedTSP's feature_dim 0 means the PLM's width: read from its config (no weights), when the dry run can
    reach it; 768 (BERT-base, the paper's) for a BERT folder not on this machine; 512 for the other methods.
    The width sizes only the pooled feature and the head, a small share of a client's FLOPs."""
    kind = getattr(opts, "plm", "")
    if not kind:
        return 512
    from raysim.errors import ConfigError
    from raysim.models.plm import plm_output_dim

    try:
        return plm_output_dim(kind, model=cfg.model.name, path=str(getattr(opts, "plm_path", "")))
    except (ConfigError, OSError, ValueError):
        return 768 if kind == "bert" else 512


def estimate_models(cfg: Any, forward: list[float]) -> dict[str, float]:
    """{"flops", "gpu_hours", "steps"} of a whole-network run (the module docstring's second formula)."""
    _, n_train, n_test = sizes(cfg)
    K = len(forward)
    rounds, E = cfg.train.rounds, cfg.train.local_epochs
    evals = len({r for r in range(rounds) if (r + 1) % cfg.eval.every == 0 or r >= rounds - cfg.eval.last})
    per_client = sum(forward)
    flops = rounds * cfg.train.participation * E * (n_train / K) * 3.0 * per_client + evals * (n_test / K) * per_client
    steps = rounds * max(1, round(K * cfg.train.participation)) * E * max(1, math.ceil(n_train / K / cfg.train.batch_size))
    return {"flops": flops, "gpu_hours": flops / THROUGHPUT / 3600.0, "steps": float(steps)}
