"""The semantic-structure measures of fedtsp.txt Figure 1, for any set of class prototypes.

- `semantic_alignment`: Spearman rho between the prototypes' pairwise cosine similarities and a reference
  class-similarity matrix (the paper uses WordNet; here any hierarchy given as root-to-leaf paths, scored
  by Wu-Palmer similarity 2 depth(lca) / (depth(a) + depth(b)), or a user matrix).
- `semantic_gap`: Delta_sem = mean similarity of pairs in the same semantic group - mean similarity of
  pairs in different groups (e.g. animals vs animals minus animals vs vehicles).

Known hierarchies: CIFAR-10 (animals / vehicles, with a few sub-levels), CIFAR-100 (its 20 official
superclasses) and the synthetic datasets (shapes / digits / letters). Class names are matched after
normalisation (lower case, `_` -> space).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from raysim.errors import ConfigError


def _norm(name: str) -> str:
    return " ".join(name.replace("_", " ").lower().split())


def cosine_matrix(protos: Tensor) -> np.ndarray:
    p = torch.nn.functional.normalize(torch.as_tensor(protos, dtype=torch.float64), dim=-1)
    return (p @ p.t()).numpy()


def wu_palmer(paths: Sequence[Sequence[str]]) -> np.ndarray:
    """Reference similarity from root-to-leaf paths (each ends with the class itself)."""
    C = len(paths)
    out = np.zeros((C, C))
    for i in range(C):
        for j in range(C):
            lca = 0
            for a, b in zip(paths[i], paths[j]):
                if a != b:
                    break
                lca += 1
            out[i, j] = 2.0 * lca / (len(paths[i]) + len(paths[j]))
    return out


def _pairs(C: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(C, k=1)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def semantic_alignment(protos_or_sim, reference: np.ndarray) -> float:
    """Spearman rho over all class pairs i < j between the learned similarities and the reference."""
    sim = _similarity(protos_or_sim)
    ref = np.asarray(reference, dtype=np.float64)
    if sim.shape != ref.shape:
        raise ConfigError(f"similarity {sim.shape} and reference {ref.shape} differ")
    iu = _pairs(sim.shape[0])
    return spearman(sim[iu], ref[iu])


def semantic_gap(protos_or_sim, groups: Sequence[int | str]) -> float:
    """Mean similarity within groups minus mean similarity across groups (pairs i < j)."""
    sim = _similarity(protos_or_sim)
    g = np.asarray([str(x) for x in groups])
    iu = _pairs(sim.shape[0])
    same = g[iu[0]] == g[iu[1]]
    if not same.any() or same.all():
        raise ConfigError("the semantic gap needs pairs both within and across groups")
    vals = sim[iu]
    return float(vals[same].mean() - vals[~same].mean())


def _similarity(protos_or_sim) -> np.ndarray:
    x = torch.as_tensor(protos_or_sim)
    if x.dim() == 2 and x.shape[0] == x.shape[1] and torch.allclose(x, x.t()) and torch.allclose(
        x.diagonal().double(), torch.ones(x.shape[0], dtype=torch.float64), atol=1e-6
    ):
        return x.double().numpy()  # already a cosine-similarity matrix
    return cosine_matrix(x)


# ----------------------------------------------------------------------------------- known hierarchies
CIFAR10_PATHS = {
    "airplane": ("vehicle", "aircraft", "airplane"),
    "automobile": ("vehicle", "road vehicle", "automobile"),
    "truck": ("vehicle", "road vehicle", "truck"),
    "ship": ("vehicle", "watercraft", "ship"),
    "bird": ("animal", "bird"),
    "frog": ("animal", "amphibian", "frog"),
    "cat": ("animal", "mammal", "carnivore", "cat"),
    "dog": ("animal", "mammal", "carnivore", "dog"),
    "deer": ("animal", "mammal", "ungulate", "deer"),
    "horse": ("animal", "mammal", "ungulate", "horse"),
}

CIFAR100_SUPERCLASSES = {
    "aquatic mammals": "beaver dolphin otter seal whale",
    "fish": "aquarium_fish flatfish ray shark trout",
    "flowers": "orchid poppy rose sunflower tulip",
    "food containers": "bottle bowl can cup plate",
    "fruit and vegetables": "apple mushroom orange pear sweet_pepper",
    "household electrical devices": "clock keyboard lamp telephone television",
    "household furniture": "bed chair couch table wardrobe",
    "insects": "bee beetle butterfly caterpillar cockroach",
    "large carnivores": "bear leopard lion tiger wolf",
    "large man-made outdoor things": "bridge castle house road skyscraper",
    "large natural outdoor scenes": "cloud forest mountain plain sea",
    "large omnivores and herbivores": "camel cattle chimpanzee elephant kangaroo",
    "medium-sized mammals": "fox porcupine possum raccoon skunk",
    "non-insect invertebrates": "crab lobster snail spider worm",
    "people": "baby boy girl man woman",
    "reptiles": "crocodile dinosaur lizard snake turtle",
    "small mammals": "hamster mouse rabbit shrew squirrel",
    "trees": "maple_tree oak_tree palm_tree pine_tree willow_tree",
    "vehicles 1": "bicycle bus motorcycle pickup_truck train",
    "vehicles 2": "lawn_mower rocket streetcar tank tractor",
}
_CIFAR100_TOP = {  # a coarse level above the superclasses
    "living": ("aquatic mammals", "fish", "insects", "large carnivores", "large omnivores and herbivores",
               "medium-sized mammals", "non-insect invertebrates", "people", "reptiles", "small mammals"),
    "plants": ("flowers", "fruit and vegetables", "trees"),
    "objects": ("food containers", "household electrical devices", "household furniture", "vehicles 1", "vehicles 2"),
    "scenes": ("large man-made outdoor things", "large natural outdoor scenes"),
}


def _cifar100_paths() -> dict[str, tuple[str, ...]]:
    top = {sc: t for t, scs in _CIFAR100_TOP.items() for sc in scs}
    return {_norm(c): (top[sc], sc, _norm(c)) for sc, cs in CIFAR100_SUPERCLASSES.items() for c in cs.split()}


def _synthetic_paths() -> dict[str, tuple[str, ...]]:
    from raysim.data.synthetic import DIGITS, LETTERS, SHAPES

    out: dict[str, tuple[str, ...]] = {s: ("shape", s) for s in SHAPES}
    out.update({d: ("digit", d) for d in DIGITS})
    out.update({_norm(letter): ("letter", _norm(letter)) for letter in LETTERS})
    return out


def hierarchy_paths(dataset: str, classnames: Sequence[str]) -> list[tuple[str, ...]]:
    """Root-to-leaf paths of `classnames` in the known hierarchy of `dataset`."""
    ds = dataset.lower()
    if ds == "cifar10":
        table = {_norm(k): v for k, v in CIFAR10_PATHS.items()}
    elif ds == "cifar100":
        table = _cifar100_paths()
    elif ds.startswith("synthetic"):
        table = {_norm(k): v for k, v in _synthetic_paths().items()}
    else:
        raise ConfigError(f"no known class hierarchy for dataset {dataset!r} (cifar10, cifar100, synthetic*)")
    missing = [c for c in classnames if _norm(c) not in table]
    if missing:
        raise ConfigError(f"classes {missing[:5]} are not in the {dataset} hierarchy")
    return [table[_norm(c)] for c in classnames]


def semantic_report(protos: Tensor, dataset: str, classnames: Sequence[str],
                    paths: Mapping[str, Sequence[str]] | None = None) -> dict[str, float]:
    """{"spearman": rho vs Wu-Palmer similarity, "semantic_gap": Delta_sem over the top-level groups}."""
    p = [tuple(paths[c]) for c in classnames] if paths is not None else hierarchy_paths(dataset, classnames)
    return {
        "spearman": semantic_alignment(protos, wu_palmer(p)),
        "semantic_gap": semantic_gap(protos, [x[0] for x in p]),
    }
