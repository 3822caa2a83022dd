"""The data section's checks: the part that owns the dataset and partitioner registries validates
`data.*` (called from raysim.build, where a run is assembled). A message names the key and what to do."""

from __future__ import annotations

import math

from raysim.config.limits import MAX_AUGMENT_VIEWS
from raysim.config.rules import check as _check
from raysim.config.schema import AUGMENT_CHOICES, DataConfig
from raysim.errors import ConfigError, shown


def check_data(d: DataConfig) -> None:
    from raysim.data import PARTITIONERS, dataset_names

    if d.dataset.lower() not in dataset_names():
        raise ConfigError(f"unknown dataset {shown(d.dataset)}. Valid choices: {', '.join(dataset_names())}.")
    d.dataset = d.dataset.lower()
    _check(d.partition in PARTITIONERS, f"data.partition must be one of {', '.join(PARTITIONERS.names())}, got {shown(d.partition)}")
    _check(d.beta > 0 and math.isfinite(d.beta), f"data.beta must be a positive number, got {d.beta}")
    _check(d.shots >= 0, f"data.shots must be >= 0 (0 = use all training images), got {d.shots}")
    _check(not d.domain_reseed or d.partition == "domain",
           f"data.domain_reseed=true is the FedSEPT code's domain split; it needs data.partition=domain (got {shown(d.partition)})")
    _check(d.cifar_transform in ("clip", "official"),
           f"data.cifar_transform must be clip (CLIP's normalisation) or official (the FedSEPT code's CIFAR mean/std, then "
           f"resize), got {shown(d.cifar_transform)}")
    _check(d.min_samples >= 0, f"data.min_samples must be >= 0 (0 = the partition's default), got {d.min_samples}")
    _check((d.partition == "stored") == (d.dataset == "pfllib"),
           "data.partition=stored (the clients a folder stores) goes with data.dataset=pfllib, and only with it")
    _check(d.augment in AUGMENT_CHOICES,
           f"data.augment must be one of {', '.join(AUGMENT_CHOICES)} (auto = the official code's augmentation for the CoOp "
           f"and domain datasets, off elsewhere), got {shown(d.augment)}")
    _check(1 <= d.augment_views <= MAX_AUGMENT_VIEWS,
           f"data.augment_views must be between 1 and {MAX_AUGMENT_VIEWS} (augmented views per training image, each encoded "
           f"once and cached), got {d.augment_views}")
    if d.augment == "official":  # whether the dataset has images to augment depends on the method: checked in raysim.build
        from raysim.data.partition import is_pooled

        _check(not is_pooled(d.partition),
               f"data.augment=official cannot go with data.partition={d.partition}: it pools train and test, so a client's "
               "training row may be another's test row; set data.augment=off (or auto)")
    _check(isinstance(d.train_fraction, (int, float)) and not isinstance(d.train_fraction, bool)
           and 0.0 < float(d.train_fraction) <= 1.0,
           f"data.train_fraction must be a number in (0, 1]: the fraction of each domain's training images kept (1 = all; "
           f"the VPDR code keeps 0.1 of Digits and 0.3 of PACS and Office-Caltech), got {shown(d.train_fraction)}")
    d.train_fraction = float(d.train_fraction)
    if d.train_fraction < 1.0:
        from raysim.data.partition import is_pooled

        _check(not is_pooled(d.partition) and d.partition != "stored",
               f"data.train_fraction keeps part of each domain's training split before the partition; data.partition="
               f"{d.partition} {'pools train and test' if d.partition != 'stored' else 'uses the clients a folder stores'}, "
               "so there is no training split to keep part of: set data.train_fraction=1")
    _check(d.partition != "pfllib" or d.shots == 0,
           f"data.partition=pfllib is PFLlib's protocol, which keeps every sample of each client; set data.shots=0 (got {d.shots})")
