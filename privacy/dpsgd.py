"""DP-SGD on selected tensors, as the FedSEPT code does it (SPEC 1.6).

Per-example gradients come from batched vector-Jacobian products on the per-example loss vector
(one-hot cotangent rows pulled back through the graph under `torch.func.vmap`; see VJP_MODES),
`microbatch` rows at a time, the forward shared. They are clipped jointly over all privatised tensors,
summed, noised with N(0, sigma^2 clip^2) and divided by the actual batch size; the result overwrites
`.grad`. The other trainable tensors get the plain gradient of the mean loss (plus `public_loss`, a
data-independent term, when given), read off the same batched backward passes (the sum of their
per-example gradients), so a step costs one forward and B cotangents through one backward graph:
the FLOP bound of exact per-example clipping for a prompt at the text tower's input (README "DP-SGD cost").
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Sequence

import torch
from torch import Tensor

from raysim.errors import ConfigError


def _zeros_like_batched(p: Tensor, b: int) -> Tensor:
    return torch.zeros((b, *p.shape), dtype=p.dtype, device=p.device)


def _per_sample_loop(per_sample_loss: Tensor, params: Sequence[Tensor], rows: range) -> list[Tensor]:
    out: list[list[Tensor]] = [[] for _ in params]
    for i in rows:
        gs = torch.autograd.grad(per_sample_loss[i], list(params), retain_graph=True, allow_unused=True)
        for j, (g, p) in enumerate(zip(gs, params)):
            out[j].append(torch.zeros_like(p) if g is None else g)
    return [torch.stack(parts) for parts in out]


# How the rows of one microbatch are pulled back through the graph, best first. "func": torch.func.vmap
# over torch.autograd.grad, whose batching rules cover the backward of every op of the text towers
# except the fused attention kernels (those run example by example inside it, correctly); "legacy":
# autograd.grad(is_grads_batched=True), the older vmap, which batches matrix products but loops over the
# rows for layer norm, GELU, softmax and attention backward; "loop": one backward per row.
VJP_MODES = ("func", "legacy", "loop")


def _rows_vjp(per_sample_loss: Tensor, params: Sequence[Tensor], start: int, stop: int, mode: str) -> list[Tensor]:
    """d(per_sample_loss[i]) / d(params) for i in [start, stop): tensors of shape (stop - start, *p.shape)."""
    n = stop - start
    if mode == "loop":
        return _per_sample_loop(per_sample_loss, params, range(start, stop))
    rows = torch.zeros((n, per_sample_loss.shape[0]), dtype=per_sample_loss.dtype, device=per_sample_loss.device)
    rows[torch.arange(n), torch.arange(start, stop)] = 1.0  # one-hot cotangents
    if mode == "func":
        def pull(v: Tensor) -> tuple[Tensor, ...]:
            gs = torch.autograd.grad(per_sample_loss, params, v, retain_graph=True, allow_unused=True)
            return tuple(torch.zeros_like(p) if g is None else g for g, p in zip(gs, params))

        with warnings.catch_warnings():
            # the fused attention kernels' backward has no batching rule, so vmap runs it row by row and
            # says so; known and measured (attention is a few % of a short text sequence's FLOPs)
            warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented the batching rule")
            return list(torch.func.vmap(pull)(rows))
    gs = torch.autograd.grad(per_sample_loss, params, grad_outputs=rows, is_grads_batched=True, retain_graph=True,
                             allow_unused=True)
    return [_zeros_like_batched(p, n) if g is None else g for g, p in zip(gs, params)]


def default_budget(device: torch.device) -> float:
    """Bytes the batched backward may use: 1 GiB on a CPU, an eighth of a GPU's total memory (the device's
    size, not what is free now)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory) / 8
    return float(2**30)


def auto_microbatch(per_sample_loss: Tensor, budget_bytes: float | None = None) -> int:
    """Rows per batched backward so that the backward's transient memory stays near `budget_bytes`.

    One cotangent row pulled back through the graph needs at most about as much memory as the tensors the
    forward saved for backward (every saved activation gets at most one gradient of its size per row), so
    this is budget / (bytes saved in `per_sample_loss`'s graph), in [1, B]: conservative, since most of
    those gradients are freed before the next layer's are made. It depends only on the graph's shapes and
    the device's size (`default_budget`), never on the memory free at the moment, so a run's results do
    not depend on the machine's load (the microbatch changes summation order, hence the last float bits)."""
    if budget_bytes is None:
        budget_bytes = default_budget(per_sample_loss.device)
    b = int(per_sample_loss.shape[0])
    fn = per_sample_loss.grad_fn
    if b <= 1 or fn is None or math.isinf(budget_bytes):  # no limit: the whole batch (inf // x is nan in Python)
        return max(1, b)
    seen_nodes: set[int] = set()
    seen_tensors: set[tuple] = set()
    total = 0
    stack: list = [fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_") and not name.startswith("_saved_self_sym"):
                try:
                    t = getattr(node, name)
                except RuntimeError:  # already freed
                    continue
                if isinstance(t, Tensor) and t.numel() > 0:
                    key = (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))
                    if key not in seen_tensors:
                        seen_tensors.add(key)
                        total += t.numel() * t.element_size()
        stack.extend(nxt for nxt, _ in node.next_functions)
    return int(min(b, max(1, budget_bytes // max(total, 1))))


def per_sample_grads(per_sample_loss: Tensor, params: Sequence[Tensor], *, microbatch: int = 8) -> list[Tensor]:
    """Gradient of every entry of `per_sample_loss` (shape (B,)) w.r.t. every tensor in `params`:
    a list of tensors of shape (B, *param.shape). The graph is retained. `microbatch`: rows pulled
    back per batched backward (0 = `auto_microbatch`)."""
    return per_sample_grads_and_sums(per_sample_loss, list(params), [], microbatch=microbatch)[0]


def per_sample_grads_and_sums(per_sample_loss: Tensor, params: list[Tensor], summed: list[Tensor], *,
                              microbatch: int) -> tuple[list[Tensor], list[Tensor]]:
    """(per-example gradients w.r.t. `params`: tensors of shape (B, *param.shape), the sum over examples of
    the gradients w.r.t. `summed`: tensors of each one's shape), from the same batched backward passes of
    `per_sample_loss` (shape (B,)), `microbatch` rows at a time (0 = `auto_microbatch`); the graph is retained.
    The rows that give the per-example gradients of `params` give those of `summed` too, at the cost of the
    graph's leaves only (the text tower is pulled back once per row either way), so the other tensors' plain
    gradient needs no extra backward. `DPSGD.backward` and the client-batched DP-SGD step of a stack
    (raysim/engine/batched.py, whose rows hold one example of every client) use it."""
    if per_sample_loss.dim() != 1:
        raise ValueError(f"per_sample_loss must have shape (B,), got {tuple(per_sample_loss.shape)}")
    if microbatch < 0:
        raise ConfigError(f"microbatch must be >= 1 (or 0 = automatic), got {microbatch}")
    b = per_sample_loss.shape[0]
    if not params and not summed:
        return [], []
    if b == 0:
        return [_zeros_like_batched(p, 0) for p in params], [torch.zeros_like(p) for p in summed]
    step = auto_microbatch(per_sample_loss) if microbatch == 0 else microbatch
    every = params + summed
    chunks: list[list[Tensor]] = [[] for _ in params]
    sums: list[Tensor | None] = [None for _ in summed]
    mode = 0
    for start in range(0, b, step):
        stop = min(b, start + step)
        while True:
            try:
                gs = _rows_vjp(per_sample_loss, every, start, stop, VJP_MODES[mode])
                break
            except (RuntimeError, NotImplementedError):
                if mode == len(VJP_MODES) - 1:
                    raise
                mode += 1  # an op this way cannot batch: the next way, for this and the later microbatches
        for j in range(len(params)):
            chunks[j].append(gs[j].detach())
        for k in range(len(summed)):
            part = gs[len(params) + k].detach().sum(dim=0)
            prev = sums[k]
            sums[k] = part if prev is None else prev + part
    per_example = [torch.cat(parts, dim=0) for parts in chunks]
    return per_example, [s if s is not None else torch.zeros_like(p) for s, p in zip(sums, summed)]


def clip_per_sample(grads: list[Tensor], clip: float) -> list[Tensor]:
    """Scale every example's gradient by min(1, clip / ||g_i||), the norm taken jointly over all tensors."""
    if not grads:
        return []
    b = grads[0].shape[0]
    sq = torch.zeros(b, dtype=torch.float64, device=grads[0].device)
    for g in grads:
        sq = sq + g.flatten(1).double().pow(2).sum(dim=1)  # flatten, not reshape(b, -1): b may be 0 (an empty Poisson batch)
    norms = sq.sqrt()
    factor = (float(clip) / norms.clamp_min(1e-12)).clamp(max=1.0)
    return [g * factor.to(g.dtype).view(b, *([1] * (g.dim() - 1))) for g in grads]


def gaussian_noise_like(p: Tensor, std: float, generator: torch.Generator) -> Tensor:
    """N(0, std^2) noise of p's shape, drawn from `generator` on its device, then moved to p's device."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    z = torch.randn(p.shape, generator=generator, device=gen_device, dtype=torch.float32)
    return (z * std).to(device=p.device, dtype=p.dtype)


def _set_grads(params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    for p, g in zip(params, grads):
        p.grad = torch.zeros_like(p) if g is None else g.detach().to(p.dtype)


def _plain_grads(loss: Tensor, params: Sequence[Tensor]) -> None:
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    gs = torch.autograd.grad(loss, params, retain_graph=False, allow_unused=True)
    _set_grads(params, gs)


def _named(params) -> dict[str, Tensor]:
    """dp_params as {upload name: tensor}; a plain sequence gets positional names (then the host cannot
    match them to uploads and refuses a DP-SGD upload)."""
    if isinstance(params, dict):
        return dict(params)
    return {f"#{i}": p for i, p in enumerate(params)}


def check_class_labels(name: str, labels: Tensor, num_classes: int) -> None:
    """Refuse a prototype release whose class count is below 1 or does not cover every label."""
    lo, hi = (int(labels.min()), int(labels.max())) if labels.numel() else (0, 0)
    if num_classes < 1 or lo < 0 or hi >= num_classes:
        raise ValueError(f"the prototype release {name!r} needs num_classes >= 1 and every label in [0, num_classes): "
                         f"got num_classes={num_classes}, labels in [{lo}, {hi}]")


class _Standalone:
    """What a handle used on its own (unit tests, benchmarks that call `local_train` directly) offers
    besides `backward`: shuffled fixed-size batches, and releases without noise (clean class means, the
    tensor itself). Inside a run the host's RoundPrivacy (privacy/host.py) provides these instead."""

    def batches(self, n: int, batch_size: int, rng: torch.Generator):
        from raysim.sampling import batch_indices

        return batch_indices(n, batch_size, rng)

    def release(self, name: str, value=None, *, features: Tensor | None = None, labels: Tensor | None = None,
                num_classes: int = 0, clip: float = 0.0, assignments: Tensor | None = None,
                unclipped: bool = False) -> Tensor:
        if features is not None:
            assert labels is not None, "a prototype release needs the labels of its features"
            features, labels = features.detach().float().cpu(), labels.detach().long().cpu()
            if assignments is None:
                check_class_labels(name, labels, num_classes)
            if assignments is not None:  # clustered: the clean centres, class by class
                from .prototypes import clean_centres

                return clean_centres(features, labels, assignments.detach().long().cpu())
            sums = torch.zeros(num_classes, features.shape[1]).index_add_(0, labels, features)
            return sums / torch.bincount(labels, minlength=num_classes).float().clamp_min(1)[:, None]
        return (value() if callable(value) else value).detach().float().cpu().clone()


class DPSGD(_Standalone):
    """The DP-SGD step (implements the `backward` of `methods.base.PrivacyHandle`).

    `expected_batch`: with Poisson sampling the clipped sum is divided by the expected batch size q*n (as
    Opacus does), so the step does not depend on the realised batch size; None divides by the actual
    batch size (fixed-size shuffled batches, the papers' code). `public_loss` is a data-independent term
    (a function of tensors that are already public): its plain gradient is added after clipping and
    noising, at no privacy cost; `other_params` get the plain gradient of mean(loss) + public_loss."""

    enabled = True

    def __init__(
        self,
        *,
        sigma: float,
        clip: float,
        sample_rate: float,
        generator: torch.Generator,
        microbatch: int = 8,
        on_step: Callable[[], None] | None = None,
        expected_batch: float | None = None,
    ) -> None:
        if not (sigma >= 0 and math.isfinite(sigma)):
            raise ConfigError(f"noise multiplier must be a finite number >= 0, got {sigma}")
        if not (clip > 0 and math.isfinite(clip)):
            raise ConfigError(f"clipping norm must be > 0, got {clip}")
        if not (0 < sample_rate <= 1):
            raise ConfigError(f"sample rate must lie in (0, 1], got {sample_rate}")
        if microbatch < 0:
            raise ConfigError(f"microbatch must be >= 1 (or 0 = automatic), got {microbatch}")
        self.sigma = float(sigma)
        self.clip = float(clip)
        self.sample_rate = float(sample_rate)
        self.generator = generator
        self.microbatch = int(microbatch)
        self.on_step = on_step
        self.expected_batch = expected_batch
        self.steps = 0
        self.trained: dict[str, Tensor] = {}  # upload name -> the tensor the DP steps wrote (the host checks uploads)
        self.names_each_step: list[frozenset[str]] = []

    def backward(self, per_sample_loss: Tensor, dp_params, other_params: Sequence[Tensor] = (), public_loss: Tensor | None = None) -> None:
        named = _named(dp_params)
        dp_list = list(named.values())
        others = [p for p in other_params if p.requires_grad]
        b = int(per_sample_loss.shape[0])
        if b == 0 and self.expected_batch is None:
            raise ValueError("DP-SGD step on an empty batch")
        public_grads: Sequence[Tensor | None] = [None] * (len(dp_list) + len(others))
        if public_loss is not None and (dp_list or (others and b > 0)):
            wrt = dp_list + (others if b > 0 else [])
            public_grads = list(torch.autograd.grad(public_loss, wrt, retain_graph=True, allow_unused=True))
            public_grads += [None] * (len(dp_list) + len(others) - len(public_grads))
        # one set of batched backward passes gives the per-example gradients of the privatised tensors and
        # the summed (plain) gradient of the others; the graph is kept for the caller, as under NoDP it is not
        grads, other_sums = per_sample_grads_and_sums(per_sample_loss, dp_list, others if b > 0 else [], microbatch=self.microbatch)
        if dp_list:
            self.apply_per_example(named, grads, b, public_grads[:len(dp_list)])
        if b > 0:  # the other tensors get the plain gradient of the whole loss, as under NoDP
            for k, (p, g) in enumerate(zip(others, other_sums)):
                total = g / b
                pg = public_grads[len(dp_list) + k]
                if pg is not None:
                    total = total + pg.detach()
                p.grad = total.detach().to(p.dtype)
        else:  # an empty Poisson batch has no loss for them: no gradient (the optimizer skips them), never a stale one
            for p in others:
                p.grad = None
        self.record_step(named)

    def apply_per_example(self, named: dict[str, Tensor], grads: Sequence[Tensor], b: int,
                          public_grads: Sequence[Tensor | None] | None = None) -> None:
        """The private part of a step once the per-example gradients of `named` are known (`grads[j]`: (b, *shape)
        for the j-th tensor): clip jointly, sum, noise from this step's generator, divide, add the public
        gradients, write `.grad`. `backward` calls it; so does the client-batched path (raysim/engine/batched.py),
        which gets several clients' per-example gradients from one backward."""
        if b == 0 and self.expected_batch is None:
            raise ValueError("DP-SGD step on an empty batch")
        denom = float(self.expected_batch) if self.expected_batch is not None else float(b)
        std = self.sigma * self.clip
        for j, (p, g) in enumerate(zip(named.values(), clip_per_sample(list(grads), self.clip))):
            total = g.sum(dim=0)
            if std > 0:
                total = total + gaussian_noise_like(total, std, self.generator)
            total = total / denom
            pg = public_grads[j] if public_grads is not None else None
            if pg is not None:
                total = total + pg.detach()
            p.grad = total.detach().to(p.dtype)

    def record_step(self, named: dict[str, Tensor]) -> None:
        """Count one DP-SGD step that privatised `named` (what the host checks uploads against)."""
        self.trained.update(named)
        self.names_each_step.append(frozenset(named))
        self.steps += 1
        if self.on_step is not None:
            self.on_step()


class BatchClipSGD(_Standalone):
    """A reference code's noisy step, reproduced (DP-FPL, `privacy.mechanisms.DPFPLReference`): the gradient
    of the batch-mean loss w.r.t. the uploaded tensors is clipped to `clip` as a whole, N(0, std^2) is added,
    and the other tensors get the plain gradient. NOT per-example DP-SGD: one example can move the clipped
    batch gradient by up to 2 * clip, which `std` (sigma * clip / B in the reference) does not account for."""

    enabled = True

    def __init__(self, *, std: float, clip: float, generator: torch.Generator, on_step: Callable[[], None] | None = None) -> None:
        if not (std >= 0 and math.isfinite(std)):
            raise ConfigError(f"noise std must be a finite number >= 0, got {std}")
        if not (clip > 0 and math.isfinite(clip)):
            raise ConfigError(f"clipping norm must be > 0, got {clip}")
        self.std = float(std)
        self.clip = float(clip)
        self.generator = generator
        self.on_step = on_step
        self.steps = 0
        self.trained: dict[str, Tensor] = {}
        self.names_each_step: list[frozenset[str]] = []
        self.grads: dict[str, Tensor] = {}  # the last step's clipped (noised) gradient of each dp_params entry

    def backward(self, per_sample_loss: Tensor, dp_params, other_params: Sequence[Tensor] = (), public_loss: Tensor | None = None) -> None:
        named = _named(dp_params)
        dp_list = list(named.values())
        if per_sample_loss.shape[0] == 0:
            raise ValueError("a batch-clipped step needs a non-empty batch")
        loss = per_sample_loss.mean()
        public_grads = None
        if public_loss is not None and dp_list:
            public_grads = torch.autograd.grad(public_loss, dp_list, retain_graph=True, allow_unused=True)
        if dp_list:
            raw = torch.autograd.grad(loss, dp_list, retain_graph=True, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(raw, dp_list)]
            norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
            scale = min(1.0, self.clip / max(norm, 1e-12))
            for j, (key, p, g) in enumerate(zip(named, dp_list, grads)):
                total = g * scale
                if self.std > 0:
                    total = total + gaussian_noise_like(total, self.std, self.generator)
                if public_grads is not None and public_grads[j] is not None:
                    total = total + public_grads[j].detach()
                p.grad = total.detach().to(p.dtype)
                self.grads[key] = p.grad.detach().cpu().clone()
        _plain_grads(loss, other_params)
        self.trained.update(named)
        self.names_each_step.append(frozenset(named))
        self.steps += 1
        if self.on_step is not None:
            self.on_step()


class NoDP(_Standalone):
    """The handle when DP is off: plain gradients of the mean loss (plus `public_loss`) for every tensor,
    `.grad` overwritten."""

    enabled = False

    def __init__(self, on_step: Callable[[], None] | None = None) -> None:
        self.on_step = on_step
        self.steps = 0

    def backward(self, per_sample_loss: Tensor, dp_params, other_params: Sequence[Tensor] = (), public_loss: Tensor | None = None) -> None:
        loss = per_sample_loss.mean()
        if public_loss is not None:
            loss = loss + public_loss
        _plain_grads(loss, list(_named(dp_params).values()) + list(other_params))
        self.steps += 1
        if self.on_step is not None:
            self.on_step()
