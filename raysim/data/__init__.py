"""Datasets (registry), partitions, and the frozen-feature cache."""

# dataset modules register themselves on import
from raysim.data import digits, folders, pfllib_folder, synthetic, vpdr  # noqa: F401,E402
from raysim.data.base import DATASETS, DatasetBundle, ImageSet, LoadSpec, TensorImages, register_dataset
from raysim.data.partition import PARTITIONERS, ClientSplit, PartitionSpec, partition


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
