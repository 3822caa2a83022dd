"""`public`: an upload the method declares not private (its docstring says why the paper treats it as public)."""

from __future__ import annotations

from typing import Any

from .base import Mechanism, register_mechanism


@register_mechanism
class Public(Mechanism):
    name = "public"
    applied = "none"
    clipped = "nothing"
    sensitivity = "n/a (not private)"
    relation = "n/a: declared public by the method (its docstring says why)"
    accountant = "none (costs nothing, protects nothing)"
    serves = ("public",)

    def verify(self, rp: Any, name: str, tensor: Any, kind: str) -> None:
        return None  # nothing to check: it carries no privacy claim
