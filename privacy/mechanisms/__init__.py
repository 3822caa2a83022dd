"""How each uploaded tensor leaves a client: declared releases and the registry of mechanisms (plug-ins).

A method declares, for every tensor it may upload, a `ReleaseSpec` naming the *kind* of release:

    dpsgd       trained by DP-SGD (per-example clipping and noise) on the client's data
    update      an update of a broadcast tensor, trained without per-example DP
    prototype   class prototypes computed from the client's features (the host computes and noises them)
    embedding   a one-shot release of a tensor the client computes once (FedTSP's description embeddings)
    public      not private (sample counts, and only where the papers treat them as public)
    reference   a reference code's own noise, reproduced on request (DP-FPL's batch-gradient clipping):
                recorded in the ledger as not valid (`Release.valid = False`), never a DP guarantee

Every module of this package defines and registers mechanisms (`discover` imports them all, so a new
mechanism is one new file; no module may be named like a constructor above, dpsgd, public, ..., which
it would shadow). A mechanism says which release kinds it `serves`, under which `dp` settings (`levels`,
and `choice`: the dp.prototypes value that picks it; or its own `selected(kind, dp)`), the dp fields it
reads (`options`), and its hooks: `plan` (the Gaussian compositions one participation costs,
used to calibrate the noise multiplier before training), `train` (for `applied = "train"`: the step
object that privatises local training), `apply` (for the releases the host makes itself: prototype,
embedding, update) and `verify` (what the host checks at close(): that an upload was privatised as
declared). `resolve(spec, dp)` walks the registry; a combination that cannot be made private is refused
at config time (`check_method`). Its table attributes (clipped, sensitivity, relation, accountant) are
README "Privacy" (`mechanism_table`). Multipliers are always relative to the mechanism's L2 sensitivity,
so every ledger entry composes through the same accountant (one epsilon conversion everywhere).
"""

from __future__ import annotations

from raysim.registry import import_all

from .base import (  # noqa: F401 (the package's names)
    KINDS,
    LEVELS,
    MECHANISMS,
    BudgetShare,
    M,
    Mechanism,
    Planned,
    ReleaseSpec,
    Training,
    check_method,
    dpsgd,
    embedding,
    mechanism_table,
    mechanisms,
    prototype,
    prototype_choices,
    public,
    reference,
    register_mechanism,
    resolve,
    resolve_all,
    update,
    warnings_for,
)


# ------------------------------------------------------------------------------------- discovery
def discover() -> list[str]:
    """Import every module of this package (each registers its mechanisms); returns their names."""
    return import_all(__path__, __name__, skip=("base",))


MODULES = discover()

# the mechanism classes under their previous names (imported by tests and tools)
from .client_update import ClientUpdate  # noqa: E402
from .dp_sgd import DPSGDMechanism  # noqa: E402
from .dpfpl_reference import DPFPLReference  # noqa: E402
from .embedding_release import EmbeddingRelease  # noqa: E402
from .igpp import IGPP  # noqa: E402
from .public_release import Public  # noqa: E402
from .vpp import VPP  # noqa: E402

__all__ = [
    "IGPP", "KINDS", "BudgetShare", "MECHANISMS", "VPP", "ClientUpdate", "DPFPLReference", "DPSGDMechanism", "EmbeddingRelease",
    "Mechanism", "Planned", "Public", "ReleaseSpec", "Training", "check_method", "discover", "dpsgd", "embedding",
    "mechanism_table", "mechanisms", "prototype", "prototype_choices", "public", "reference", "register_mechanism",
    "resolve", "resolve_all", "update", "warnings_for",
]
