"""Privacy attacks that read what the server saw (uploads, released prototypes) or query final models.

Every module here that defines an attack registers it in `ATTACKS` on import (`@register_attack`, see
attacks/base.py for what an attack is); `discover()` imports them all, so a new attack is one new file
plus its test: nothing here lists them by hand. `raysim audit` walks the registry.
"""

from raysim.attacks.base import ATTACKS, Attack, AttackOutput, Release, ReleaseAttack, register_attack
from raysim.attacks.prototype_mia import MIAResult, membership_scores, prototype_mia, roc_metrics
from raysim.registry import import_all


def discover() -> None:
    """Import every module of the package once, so each registers its attacks."""
    import_all(__path__, __name__)


def attacks() -> list[Attack]:
    """Every registered attack, in the order the audit runs them."""
    discover()
    return sorted((ATTACKS.get(n) for n in ATTACKS.names()), key=lambda a: (a.order, a.name))


__all__ = ["ATTACKS", "Attack", "AttackOutput", "MIAResult", "Release", "ReleaseAttack", "attacks", "discover",
           "membership_scores", "prototype_mia", "register_attack", "roc_metrics"]
