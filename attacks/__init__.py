"""Privacy attacks that read what the server saw (uploads, released prototypes) or query final models."""

from raysim.attacks.prototype_mia import MIAResult, membership_scores, prototype_mia, roc_metrics

__all__ = ["MIAResult", "membership_scores", "prototype_mia", "roc_metrics"]
