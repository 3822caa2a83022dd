"""FedTGP (Zhang et al., trainable global prototypes) with the VPDR paper's settings (SPEC 3.5).

The algorithm is the FedTSP scripts' FedTGP (methods/fedtgp.py: the generator, the adaptive margin,
the margin loss and its SGD loop are shared); the settings differ and stay here:

                        VPDR (this file)               FedTSP scripts (fedtgp.py)
  server SGD lr         the client lr, 1e-3            0.01
  client lambda         1.0                            1.0
  server epochs         100                            100
  margin threshold      100                            100
  one class uploaded    margin = threshold (as coded)  margin = 0

Server   A persistent generator G: class embedding (C x 512) -> Linear(512, 512) + ReLU -> Linear(512, 512).
         The uploads are averaged per class over the clients holding it; gap_c = the distance to the
         nearest other class's average and margin = min(max_c gap_c, 100). Then 100 epochs of SGD
         (batch = the client batch size) over the uploaded (prototype, class) pairs of
         CE over c' of -(||p - G(c')|| + margin [c' = y]). G(c) for every class is broadcast.
Client   L = CE + 1.0 * MSE(f, P_g[y]) (every class has a generated prototype).
"""

from __future__ import annotations

import torch
from torch import Tensor

from raysim.methods.fedtgp import PrototypeGenerator, adaptive_margin, train_generator
from raysim.methods.hetero import aggregate_prototypes

LAMBDA = 1.0
SERVER_EPOCHS = 100
MARGIN_THRESHOLD = 100.0


def vpdr_margin(avg: Tensor, has: Tensor, threshold: float = MARGIN_THRESHOLD) -> float:
    """min(max_c gap_c, threshold); with fewer than two classes every gap is the code's 1e9 sentinel,
    so the margin is the threshold."""
    if int(has.sum()) < 2:
        return float(threshold)
    return adaptive_margin(avg, has, threshold)


def tgp_aggregate(g: PrototypeGenerator, protos: Tensor, counts: Tensor, *, epochs: int = SERVER_EPOCHS, lr: float,
                  batch_size: int, margin_threshold: float = MARGIN_THRESHOLD,
                  rng: torch.Generator) -> tuple[Tensor, float, Tensor]:
    """One FedTGP server step: protos (K, C, d) uploads, counts (K, C) -> (G(c) for all classes (C, d),
    margin, last server loss); trains `g` in place."""
    avg, has = aggregate_prototypes(protos, counts, "uniform")
    margin = vpdr_margin(avg, has, margin_threshold)
    held = counts > 0
    dev = next(g.parameters()).device
    feats, labels = protos[held].float().to(dev), held.nonzero()[:, 1].to(dev)
    loss = train_generator(g, feats, labels, margin, epochs=epochs, lr=lr, batch_size=batch_size, rng=rng)
    g.eval()
    with torch.no_grad():
        out = g().cpu()
    return out, margin, loss
