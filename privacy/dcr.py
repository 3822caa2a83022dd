"""Distillation-guided clipping regularisation (vpdr.txt Eq. 15-18, SPEC 3.3).

DCR consumes no privacy budget: it only shapes local training so that feature norms sit near the
clipping bound R used later by the prototype release.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError


def soft_clip(z: Tensor, *, R: float, gamma: float, expand: bool = False) -> Tensor:
    """z * min(1, R / (||z|| + gamma R)) over the last dimension (the code; only shrinks).
    With `expand=True` the cap is dropped (the paper's Eq. 15), so small norms grow toward R."""
    if not R > 0:
        raise ConfigError(f"R must be > 0, got {R}")
    if not gamma >= 0:
        raise ConfigError(f"gamma must be >= 0, got {gamma}")
    norm = z.norm(dim=-1, keepdim=True)
    scale = R / (norm + gamma * R).clamp_min(1e-12)
    if not expand:
        scale = scale.clamp(max=1.0)
    return z * scale


class EMATeacher(nn.Module):
    """A frozen deep copy of `module` tracking it by EMA: theta_t <- beta theta_t + (1 - beta) theta,
    applied by `update(student, step)` once `step >= warmup` (SPEC 3.3: beta 0.999, warm-up 5).
    The teacher runs in eval mode and without gradients."""

    def __init__(self, module: nn.Module, *, beta: float = 0.999, warmup: int = 5) -> None:
        super().__init__()
        if not (0.0 <= beta < 1.0):
            raise ConfigError(f"EMA momentum beta must lie in [0, 1), got {beta}")
        self.beta = float(beta)
        self.warmup = int(warmup)
        self.teacher = copy.deepcopy(module)
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.teacher.eval()

    def train(self, mode: bool = True) -> "EMATeacher":  # the teacher always stays in eval mode
        super().train(mode)
        self.teacher.eval()
        return self

    @torch.no_grad()
    def update(self, student: nn.Module, step: int) -> bool:
        """EMA step toward `student` if `step >= warmup`; returns whether it updated."""
        if step < self.warmup:
            return False
        for pt, ps in zip(self.teacher.parameters(), student.parameters()):
            pt.mul_(self.beta).add_(ps.detach().to(pt.dtype), alpha=1.0 - self.beta)
        for bt, bs in zip(self.teacher.buffers(), student.buffers()):
            bt.copy_(bs)
        return True

    @torch.no_grad()
    def forward(self, *args, **kwargs):
        return self.teacher(*args, **kwargs)


def kd_loss(student_logits: Tensor, teacher_logits: Tensor, T: float) -> Tensor:
    """KL(softmax(t / T) || softmax(s / T)) * T^2, averaged over the batch (vpdr.txt Eq. 17)."""
    if not T > 0:
        raise ConfigError(f"temperature must be > 0, got {T}")
    log_s = F.log_softmax(student_logits / T, dim=-1)
    log_t = F.log_softmax(teacher_logits.detach() / T, dim=-1)
    return F.kl_div(log_s, log_t, log_target=True, reduction="batchmean") * (T * T)
