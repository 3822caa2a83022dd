"""raysim.privacy: calibration, accounting and the DP mechanisms of FedSEPT, FedTSP and VPDR."""

from .accountant import calibrate_multiplier, epsilon_spent, gaussian_rdp_epsilon, gaussian_rdp_sigma, noise_multiplier
from .client_level import clip_update, noise_update
from .dcr import EMATeacher, kd_loss, soft_clip
from .dpsgd import DPSGD, NoDP, clip_per_sample, per_sample_grads
from .ledger import PrivacyLedger, Release
from .mechanisms import MECHANISMS, ReleaseSpec, dpsgd, embedding, prototype, public, register_mechanism, update
from .prototypes import discriminativeness_scores, group_clip, igpp_release, private_topk_partition, vpp_release, vpp_sigmas

__all__ = [
    "DPSGD", "EMATeacher", "MECHANISMS", "NoDP", "PrivacyLedger", "Release", "ReleaseSpec", "calibrate_multiplier",
    "clip_per_sample", "clip_update", "discriminativeness_scores", "dpsgd", "embedding", "epsilon_spent",
    "gaussian_rdp_epsilon", "gaussian_rdp_sigma", "group_clip", "igpp_release", "kd_loss", "noise_multiplier",
    "noise_update", "per_sample_grads", "private_topk_partition", "prototype", "public", "register_mechanism",
    "soft_clip", "update", "vpp_release", "vpp_sigmas",
]
