"""FedKD (Wu et al. 2022, "Communication-efficient federated learning via knowledge distillation") on the
heterogeneous client zoo, as the code behind FedTSP's tables runs it (XinghaoWu/FedTSP_CVPR26 clientkd.py /
serverkd.py, SOTA_FedKD.sh; SPEC 2.9: mentee lr 0.01, T_start = T_end = 0.95).

Client   The mentor t is the client's own zoo model (private); the mentee s is a copy of the global small
         model (`SharedSmallModel`, methods/families/homogeneous.py). With a private Linear(d, d) W_h (no bias) that maps the mentee's
         features to the mentor's, on every mini-batch (adaptive mutual distillation):
             w   = 1 / (CE_t + CE_s)                          (adaptive: weak when the predictions are poor)
             L_t = CE_t + w * KL(p_s || p_t) + w * MSE(f_t, W_h f_s)
             L_s = CE_s + w * KL(p_t || p_s) + w * MSE(f_t, W_h f_s)
         each model descends its own objective (the other's outputs are targets; w is a weight, not
         differentiated); W_h descends both hidden terms. Plain SGD, mentor, mentee and W_h all at the
         client lr (`mentee_lr=0`, the code: its mentee optimiser takes the client lr and never reads the
         scripts' --mentee_learning_rate); gradient norms clipped to `clip_grad` per module (HtFLlib's 10).
         Upload (`compression=none`, the code): the trained mentee's full weights.
Server   mentee <- the average of the uploaded mentees; uniform 1/K (the code) or sample-weighted.
Eval     Each client's mentor, as the code's clientKD.

`compression=svd` (the FedKD paper, the project's earlier default; the code has it commented out): the
upload is the mentee's update (trained - broadcast), SVD-compressed at energy T, added back to the
broadcast weights, and the server compresses the averaged update the same way for the downlink:
mentee <- broadcast + SVD_T(average of the uploads - broadcast). Each update tensor with >= 2 dims is seen
as a matrix (out, in * k * k), M = U S V^T, and only the top-r singular triplets are kept, r the smallest
rank whose energy sum_{i<=r} s_i^2 reaches T * ||M||_F^2; so ||M - M_r||_F^2 <= (1 - T) ||M||_F^2 and the
link carries r (m + n + 1) numbers instead of m n (or the matrix itself where its factors would not be
smaller; the client metric `upload_ratio` is the fraction sent, 1 under compression=none). Vectors
(biases, BatchNorm) go as they are. The threshold moves linearly over the rounds,
T(t) = T_start + (T_end - T_start) t / R; at the scripts' T_start = T_end = 0.95 it is 95 % every round.
HtFLlib's (commented-out) decomposition differs: it decomposes the parameters themselves, not their
update, and 4-D convolution weights per (out, in) pair of k x k kernels; `svd` follows the paper.

Uploads  only the mentee, as an update() release (dp.level=client; dp.level=sample is refused, as for FML).
         Under dp.level=client the host noises the whole update (after compression under `svd`, which
         makes it dense again: the saving is on the non-private path only).
Differences that remain: the code sends the mentee's parameters only (named_parameters), so BatchNorm
running statistics stay with each client; here the whole state_dict goes (the same for mentees without
BatchNorm, e.g. cnn_tiny).

HtFLlib quirk (`htfllib_grads=true`, which the code behind the tables has too; the FedTSP table specs set
it): nothing is detached (w, the KL targets, the hidden term), so each model also descends the other's
objective and W_h gets the hidden term twice; KL averages over classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method
from raysim.methods.families.homogeneous import SharedOptions, SharedSmallModel, clip_grads, flatten_state, mean_metrics, validate_shared
from raysim.methods.families.zoo import HtEnv, snapshot
from raysim.methods.fedtsp.fml import kl_to
from raysim.privacy.mechanisms import update
from raysim.sampling import seeded_global_rng


@dataclass
class Options(SharedOptions):
    mentee_lr: float = 0.0  # plain-SGD lr of the mentee; 0 = the client lr (the code; SPEC 2.9's scripts pass 0.01, unread)
    compression: str = "none"  # none: full mentee weights (the code) | svd: SVD-compressed updates at energy T (the paper)
    T_start: float = 0.95  # SVD energy threshold of the first round
    T_end: float = 0.95  # ... and of the last (linear in between)
    clip_grad: float = 10.0  # per-module gradient-norm clip (HtFLlib); 0 = off
    htfllib_grads: bool = False  # reproduce HtFLlib's un-detached losses (see the module docstring)

    def validate(self) -> None:
        validate_shared(self, "fedkd")
        if self.mentee_lr < 0:
            raise ConfigError("fedkd.mentee_lr must be >= 0 (0 = the client lr)")
        if not (0.0 < self.T_start <= 1.0 and 0.0 < self.T_end <= 1.0):
            raise ConfigError("fedkd.T_start and fedkd.T_end are energy fractions: each must be in (0, 1] (1 = no compression)")
        if self.clip_grad < 0:
            raise ConfigError("fedkd.clip_grad must be >= 0 (0 = no clipping)")
        if self.compression not in ("none", "svd"):
            raise ConfigError(f"fedkd.compression must be none (the FedTSP code: full weights) or svd (the paper), "
                              f"not {self.compression!r}")


# ------------------------------------------------------------------------------------ SVD compression
def svd_rank(s: Tensor, energy: float) -> int:
    """The smallest r with sum_{i<r} s_i^2 >= energy * sum_i s_i^2 (s sorted descending); 0 for a zero matrix."""
    e = s.double() ** 2
    total = float(e.sum())
    if total == 0.0:
        return 0
    cum = torch.cumsum(e, 0)
    return min(int((cum < energy * total).sum()) + 1, len(s))


def svd_compress(m: Tensor, energy: float) -> tuple[Tensor, int]:
    """A matrix's rank-r truncation at `energy` and the numbers its factors take (r (rows + cols + 1))."""
    u, s, vh = torch.linalg.svd(m.double(), full_matrices=False)
    r = svd_rank(s, energy)
    approx = (u[:, :r] * s[:r]) @ vh[:r]
    return approx.to(m.dtype), r * (m.shape[0] + m.shape[1] + 1)


def compress_update(delta: Tensor, shapes: list[torch.Size], energy: float) -> tuple[Tensor, int]:
    """A flat update, split by `shapes` (a state_dict's, in order), with every tensor of >= 2 dims
    SVD-truncated at `energy` as an (out, rest) matrix; returns it and the numbers sent."""
    out, sent, i = [], 0, 0
    for shape in shapes:
        n = shape.numel()
        chunk = delta[i : i + n]
        i += n
        if len(shape) >= 2 and energy < 1.0:
            approx, cost = svd_compress(chunk.view(shape[0], -1), energy)
            if cost < n:  # the factors are smaller than the matrix: send them
                out.append(approx.reshape(-1))
                sent += cost
                continue
        out.append(chunk)
        sent += n
    return torch.cat(out) if out else delta.clone(), sent


# ------------------------------------------------------------------------------------ the method
def adaptive_losses(z_t: Tensor, z_s: Tensor, f_t: Tensor, f_s: Tensor, y: Tensor, w_h: nn.Module, *,
                    htfllib: bool = False) -> dict[str, Tensor]:
    """The mentor's and mentee's objectives and their parts (see the module docstring)."""
    ce_t, ce_s = F.cross_entropy(z_t, y), F.cross_entropy(z_s, y)
    if htfllib:
        w = 1.0 / (ce_t + ce_s)
        kd_t = kl_to(z_t, z_s, detach=False, reduction="mean") * w
        kd_s = kl_to(z_s, z_t, detach=False, reduction="mean") * w
        hid_t = hid_s = F.mse_loss(f_t, w_h(f_s)) * w
    else:
        w = 1.0 / (ce_t + ce_s).detach()
        kd_t, kd_s = kl_to(z_t, z_s) * w, kl_to(z_s, z_t) * w
        hid_t = F.mse_loss(f_t, w_h(f_s.detach())) * w  # reaches the mentor and W_h
        hid_s = F.mse_loss(f_t.detach(), w_h(f_s)) * w  # reaches the mentee and W_h
    return {"mentor": ce_t + kd_t + hid_t, "mentee": ce_s + kd_s + hid_s,
            "ce": ce_t, "kd": kd_t, "hidden": hid_t, "ce_mentee": ce_s, "kd_mentee": kd_s}


@register_method
class FedKD(SharedSmallModel):
    name = "fedkd"
    eval_ignores = ("round", "weights", "W_h")  # the private mentor predicts; mentee and W_h only teach
    Options = Options
    releases = {"weights": update()}  # the mentee only: private only as a user-level update (dp.level=client)
    client_metrics = ("loss", "ce", "kd", "hidden", "ce_mentee", "kd_mentee", "upload_ratio")

    def energy(self, round_idx: int) -> float:
        o = self.opts
        return o.T_start + (o.T_end - o.T_start) * min(1.0, round_idx / max(1, self.train.rounds))

    def _shapes(self, env: HtEnv) -> list[torch.Size]:
        """The mentee's state_dict shapes, in order (how the flat weights split into tensors)."""
        shapes = env.extra.get("mentee_shapes")
        if shapes is None:
            shapes = env.extra["mentee_shapes"] = [v.shape for v in self.new_shared(env).state_dict().values()]
        return shapes

    def init_shared(self, env, rng):
        return {"weights": self.init_shared_weights(env, rng), "round": torch.zeros(1)}

    def init_private(self, env, data: ClientData, rng):
        private = super().init_private(env, data, rng)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
        with seeded_global_rng(seed):
            w_h = nn.Linear(env.feature_dim, env.feature_dim, bias=False)
        return {**private, "W_h": snapshot(w_h)}

    def local_train(self, env, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        mentor = self.model(env, private)
        base = shared["weights"].float()
        mentee = self.shared_module(env, base)
        w_h = nn.Linear(env.feature_dim, env.feature_dim, bias=False)
        w_h.load_state_dict(private["W_h"])
        w_h.to(env.device)
        for m in (mentor, mentee, w_h):
            m.train()
        opts = [torch.optim.SGD(mentor.parameters(), lr=self.client_lr),
                torch.optim.SGD(mentee.parameters(), lr=self.opts.mentee_lr or self.client_lr),
                torch.optim.SGD(w_h.parameters(), lr=self.client_lr)]
        parts: dict[str, list[float]] = {k: [] for k in self.client_metrics if k != "upload_ratio"}
        for x, y in self.batches(env, data, rng):
            f_t, z_t = mentor(x)
            f_s, z_s = mentee(x)
            out = adaptive_losses(z_t, z_s, f_t, f_s, y, w_h, htfllib=self.opts.htfllib_grads)
            for o in opts:
                o.zero_grad(set_to_none=True)
            (out["mentor"] + out["mentee"]).backward()
            clip_grads((mentor, mentee, w_h), self.opts.clip_grad)
            for o in opts:
                o.step()
            parts["loss"].append(float(out["mentor"].detach()))
            for k in ("ce", "kd", "hidden", "ce_mentee", "kd_mentee"):
                parts[k].append(float(out[k].detach()))
        trained = flatten_state(mentee.state_dict())
        if self.opts.compression == "svd":
            delta, sent = compress_update(trained - base, self._shapes(env), self.energy(int(shared["round"].item())))
            trained = base + delta
        else:
            sent = base.numel()
        return LocalResult(
            upload={"weights": trained},
            private={**private, "model": snapshot(mentor), "W_h": snapshot(w_h)},
            num_samples=data.num_train,
            metrics={**mean_metrics(parts), "upload_ratio": sent / max(1, base.numel())},
        )

    def aggregate(self, env, shared, uploads, rng):
        base = shared["weights"].float()
        t = int(shared["round"].item())
        mean = self.average_shared(uploads)
        if self.opts.compression == "svd":
            delta, _ = compress_update(mean - base, self._shapes(env), self.energy(t))
            mean = base + delta
        return {"weights": mean, "round": torch.tensor([float(t + 1)])}
