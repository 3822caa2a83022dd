import torch
from torch import nn

from raysim.privacy import EMATeacher, kd_loss, soft_clip


def test_soft_clip_never_increases_norms():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(200, 32, generator=g) * torch.logspace(-3, 2, 200).unsqueeze(1)
    out = soft_clip(z, R=5.0, gamma=0.05)
    n_in, n_out = z.norm(dim=1), out.norm(dim=1)
    assert (n_out <= n_in * (1 + 1e-6)).all()
    assert (n_out < 5.0).all()
    small = n_in < 1.0
    torch.testing.assert_close(out[small], z[small])  # small norms are left alone without expand


def test_soft_clip_expand_moves_small_norms_toward_R():
    z = torch.randn(50, 16, generator=torch.Generator().manual_seed(1)) * 0.01
    out = soft_clip(z, R=5.0, gamma=0.05, expand=True)
    n_in, n_out = z.norm(dim=1), out.norm(dim=1)
    assert (n_out > n_in).all() and (n_out <= 5.0 / 0.05 + 1e-4).all()
    assert ((n_out - 5.0).abs() < (n_in - 5.0).abs()).all()
    big = soft_clip(z * 1e4, R=5.0, gamma=0.05, expand=True).norm(dim=1)
    assert (big < (z * 1e4).norm(dim=1)).all()


def test_soft_clip_is_differentiable():
    z = torch.randn(4, 8, requires_grad=True)
    soft_clip(z * 100, R=5.0, gamma=0.05).sum().backward()
    assert torch.isfinite(z.grad).all()


def test_ema_teacher():
    torch.manual_seed(0)
    student = nn.Linear(4, 3)
    teacher = EMATeacher(student, beta=0.9, warmup=5)
    assert all(not p.requires_grad for p in teacher.teacher.parameters())
    before = [p.clone() for p in teacher.teacher.parameters()]
    with torch.no_grad():
        for p in student.parameters():
            p.add_(1.0)
    assert teacher.update(student, step=4) is False
    for a, b in zip(teacher.teacher.parameters(), before):
        torch.testing.assert_close(a, b)
    assert teacher.update(student, step=5) is True
    for a, b, s in zip(teacher.teacher.parameters(), before, student.parameters()):
        torch.testing.assert_close(a, 0.9 * b + 0.1 * s)
    x = torch.randn(2, 4)
    assert not teacher(x).requires_grad


def test_kd_loss():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(6, 5, generator=g, requires_grad=True)
    t = torch.randn(6, 5, generator=g)
    T = 4.0
    pt = torch.softmax(t / T, -1)
    ref = (pt * (pt.log() - torch.log_softmax(s / T, -1))).sum(-1).mean() * T * T
    loss = kd_loss(s, t, T)
    torch.testing.assert_close(loss, ref)
    assert kd_loss(t, t, T).abs().item() < 1e-6
    loss.backward()
    assert s.grad is not None
