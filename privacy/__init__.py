"""raysim.privacy: calibration, accounting and the DP mechanisms of FedSEPT, FedTSP and VPDR."""

from .accountant import epsilon_spent, gaussian_rdp_epsilon, gaussian_rdp_sigma, noise_multiplier
from .client_level import clip_update, client_level_release, client_level_sigma, noise_update
from .dcr import EMATeacher, kd_loss, soft_clip
from .dpsgd import DPSGD, NoDP, clip_per_sample, per_sample_grads
from .embedding import embedding_ledger_release, gaussian_sigma, release_embeddings
from .ledger import PrivacyLedger, Release
from .prototypes import (
    discriminativeness_scores,
    group_clip,
    igpp_ledger_release,
    igpp_release,
    igpp_sigma,
    private_topk_partition,
    vpp_ledger_releases,
    vpp_release,
    vpp_sigmas,
)

__all__ = [
    "DPSGD",
    "EMATeacher",
    "NoDP",
    "PrivacyLedger",
    "Release",
    "client_level_release",
    "client_level_sigma",
    "clip_per_sample",
    "clip_update",
    "discriminativeness_scores",
    "embedding_ledger_release",
    "epsilon_spent",
    "gaussian_rdp_epsilon",
    "gaussian_rdp_sigma",
    "gaussian_sigma",
    "group_clip",
    "igpp_ledger_release",
    "igpp_release",
    "igpp_sigma",
    "kd_loss",
    "noise_multiplier",
    "noise_update",
    "per_sample_grads",
    "private_topk_partition",
    "release_embeddings",
    "soft_clip",
    "vpp_ledger_releases",
    "vpp_release",
    "vpp_sigmas",
]
