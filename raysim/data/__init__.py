"""Datasets (registry), partitions, and the frozen-feature cache."""

from raysim.data.base import DATASETS, DatasetBundle, ImageSet, LoadSpec, TensorImages, register_dataset
from raysim.data.partition import PARTITIONERS, ClientSplit, PartitionSpec, partition

# dataset modules register themselves on import
from raysim.data import digits  # noqa: F401,E402

try:  # optional modules written alongside (each registers its datasets)
    from raysim.data import synthetic  # noqa: F401
except ImportError:  # pragma: no cover - only while the module is absent
    pass
try:
    from raysim.data import folders  # noqa: F401
except ImportError:  # pragma: no cover
    pass


def dataset_names() -> list[str]:
    return DATASETS.names()


__all__ = [
    "DATASETS",
    "DatasetBundle",
    "ImageSet",
    "LoadSpec",
    "TensorImages",
    "register_dataset",
    "PARTITIONERS",
    "ClientSplit",
    "PartitionSpec",
    "partition",
    "dataset_names",
]
