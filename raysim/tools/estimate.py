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
"""

from __future__ import annotations

import math
from typing import Any

from raysim.data.augment import augment_mode

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
    "cifar100": (100, 50000, 10000), "pacs": (7, 7992, 2000), "office31": (31, 3288, 822),
    "officehome": (65, 12470, 3118), "domainnet": (100, 120000, 30000),
}
PASSES = {"zeroshot": 0, "promptfl": 1, "dpfpl": 1, "fedotp": 2, "fedpha": 2, "fedpgp": 4, "pfedmoap": 1}


def text_passes(cfg: Any) -> float:
    """Learned prompt sets encoded per step: FedSEPT's M experts, FedOTP's 2 prompts, FedPGP's 4 feature sets."""
    if cfg.method == "fedsept":
        from raysim.config.checks import method_options

        opts = method_options(cfg)
        return 1.0 if getattr(opts, "variant", "full") == "single" else float(getattr(opts, "experts", 4))
    return float(PASSES.get(cfg.method, 1))


def estimate(cfg: Any) -> dict[str, float]:
    """{"flops", "gpu_hours", "steps"} of one run (see the module docstring)."""
    f_text, f_image = MODEL_FLOPS.get(cfg.model.name, SMALL)
    classes, n_train_all, n_test = DATASETS.get(cfg.data.dataset, (10, 1000, 1000))
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
