"""FedFA (Zhou et al., IEEE TMC 2023): feature anchors that align the clients' features and classifiers.

The server keeps, besides the global model w, one feature anchor a_c in R^d per class, initialised as C
distinct rows of the d x d identity (a random L2-normalised Gaussian when C > d, as the official code).

Round    The server broadcasts w and the anchors A.
Client   For E epochs, per mini-batch (plain SGD at the client lr on the whole model):
             L = CE(h(f(x)), y) + lambda * L_anchor,
             L_anchor = (1/C) sum_i ||f(x_i) - a_{y_i}||^2 / m_{y_i}      (m_c = class-c samples in the batch)
         then one classifier-calibration step on the anchors (Adam at `calib_lr`, fresh each round, on the
         head only): CE(h(A), [0, ..., C-1]).
         Anchor update (each epoch, for every class c the client holds, with the official code's quirk that
         the sum of the class-c batch means is divided by the number of batches B of the epoch, not by
         the number of batches that contain class c):
             a_c <- mu * a_c + (1 - mu) * (1/B) sum_{batches b containing c} mean_{i in b, y_i = c} f(x_i)
         Uploads the trained w and its anchors (the broadcast ones for the classes it lacks).
Server   w <- sample-weighted FedAvg; A <- sample-weighted average of the clients' anchors.
Eval     GFL (`finetune_epochs=0`): the global model. PFL ("FedFA-FT", `finetune_epochs` > 0): the head
         fine-tuned on the client's own data, the extractor frozen (as FedAvg-FT: `Homogeneous`, methods/families/homogeneous.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError
from raysim.methods.base import ClientData, LocalResult, register_method, weighted_mean
from raysim.methods.families.homogeneous import Homogeneous, flatten_state, validate_homogeneous
from raysim.methods.families.zoo import HeteroMethod, HtEnv
from raysim.privacy.mechanisms import update
from raysim.sampling import epoch_batches


@dataclass
class Options:
    model: str = "fedavgcnn"  # the one architecture every client trains (any zoo model, e.g. resnet8, cnn_tiny)
    feature_dim: int = 512  # d, the pooled feature width before the head
    lam: float = 0.1  # lambda, weight of the anchor loss (official lambda_anchor)
    anchor_momentum: float = 0.5  # mu of the anchor update (official momentum_anchor)
    calib_lr: float = 0.001  # Adam lr of the classifier calibration on the anchors (Adam's default, as the official code)
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)
    finetune_epochs: int = 0  # > 0: "FedFA-FT", each client evaluates with its head fine-tuned on its data
    finetune_lr: float = 0.0  # 0 = client_lr

    def validate(self) -> None:
        if self.lam < 0 or self.calib_lr < 0:
            raise ConfigError("fedfa.lam and fedfa.calib_lr must be >= 0 (0 turns the term off)")
        if not 0 <= self.anchor_momentum <= 1:
            raise ConfigError("fedfa.anchor_momentum must be in [0, 1]")
        validate_homogeneous(self, "fedfa")


def init_anchors(num_classes: int, dim: int, rng: torch.Generator) -> Tensor:
    """C distinct one-hot rows of the d x d identity (C <= d), else L2-normalised Gaussian rows."""
    if num_classes <= dim:
        rows = torch.randperm(dim, generator=rng)[:num_classes]
        return torch.eye(dim)[rows].clone()
    return F.normalize(torch.randn(num_classes, dim, generator=rng), dim=1)


def anchor_loss(feats: Tensor, y: Tensor, anchors: Tensor) -> Tensor:
    """(1/C) sum_i ||f_i - a_{y_i}||^2 / m_{y_i}, m_c = samples of class c in the batch: the mean squared
    distance to the anchor per class present, summed over those classes and divided by all C."""
    C = anchors.shape[0]
    m = torch.bincount(y, minlength=C).to(feats.dtype)
    dist = ((feats - anchors[y]) ** 2).sum(1)
    return (dist / m[y]).sum() / C


def anchor_update(anchors: Tensor, batch_mean_sum: Tensor, num_batches: int, held: Tensor, momentum: float) -> Tensor:
    """One epoch's anchor update: a_c <- mu a_c + (1 - mu) S_c / B for the classes the client holds
    (`held`), S_c the sum over the epoch's batches of class c's batch mean feature, B the epoch's batches."""
    new = momentum * anchors + (1 - momentum) * batch_mean_sum / max(1, num_batches)
    return torch.where(held[:, None], new, anchors)


@register_method
class FedFA(Homogeneous, HeteroMethod):
    name = "fedfa"
    loss_weights = {"anchor": "lam"}
    eval_ignores = ("anchors",)  # train-time
    averaged = ("weights", "anchors")
    Options = Options
    releases = {"weights": update(), "anchors": update()}  # user-level updates of the broadcast (dp.level=client)
    global_predictor = True  # every client evaluates the global model (unless finetune_epochs > 0)
    client_metrics = ("loss", "ce", "anchor", "calib")

    def init_shared(self, env: HtEnv, rng: torch.Generator) -> dict[str, Tensor]:
        return {"weights": self.init_weights(env, rng), "anchors": init_anchors(env.num_classes, env.feature_dim, rng)}

    def aggregate(self, env: HtEnv, shared, uploads, rng):
        return {"weights": weighted_mean(uploads, "weights"), "anchors": weighted_mean(uploads, "anchors")}

    def local_train(self, env: HtEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        C = env.num_classes
        model = self.global_model(env, shared["weights"]).train()
        global_anchors = shared["anchors"].to(env.device).float()  # what the losses use all round
        anchors = global_anchors.clone()  # the client's running anchors
        held = torch.bincount(data.y_train, minlength=C).to(env.device) > 0
        opt = torch.optim.SGD(model.parameters(), lr=self.client_lr)
        calib = torch.optim.Adam(model.head.parameters(), lr=self.opts.calib_lr) if self.opts.calib_lr > 0 else None
        classes = torch.arange(C, device=env.device)
        logs: dict[str, list[float]] = {k: [] for k in self.client_metrics}
        for _ in range(self.train.local_epochs):
            sums = torch.zeros_like(anchors)
            batches = 0
            for idx in epoch_batches(data.num_train, self.train.batch_size, rng, shuffle=self.opts.shuffle):
                if len(idx) < 2:  # BatchNorm cannot train on one sample
                    continue
                x, y = data.x_train[idx].to(env.device), data.y_train[idx].to(env.device)
                feats, logits = model(x)
                ce = F.cross_entropy(logits, y)
                la = anchor_loss(feats, y, global_anchors)
                loss = ce + self.opts.lam * la
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                lc = torch.tensor(float("nan"))
                if calib is not None:  # classifier calibration: the head must classify the anchors
                    lc = F.cross_entropy(model.head(global_anchors), classes)
                    calib.zero_grad(set_to_none=True)
                    lc.backward()
                    calib.step()
                with torch.no_grad():
                    f = feats.detach()
                    cnt = torch.bincount(y, minlength=C).to(f.dtype)
                    sums += torch.zeros_like(sums).index_add_(0, y, f) / cnt.clamp_min(1)[:, None]
                batches += 1
                for k, v in (("loss", loss), ("ce", ce), ("anchor", la), ("calib", lc)):
                    logs[k].append(float(v.detach()))
            anchors = anchor_update(anchors, sums, batches, held, self.opts.anchor_momentum)
        return LocalResult(
            upload={"weights": flatten_state(model.state_dict()), "anchors": anchors.detach().cpu()},
            private={**private, "rounds": int(private.get("rounds", 0)) + 1},
            num_samples=data.num_train,
            metrics={k: (sum(v) / len(v) if v else float("nan")) for k, v in logs.items()},
        )
