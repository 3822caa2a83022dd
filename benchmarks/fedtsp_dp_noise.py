"""FedTSP's private variant: the measured noise std on the description embedding (released tensor minus
the clipped clean one) against fedtsp.txt Eq. 11, for fedtsp.dp_budget = paper | split | joint.

    HF_HUB_OFFLINE=1 python benchmarks/fedtsp_dp_noise.py [--rounds 300] [--eps 1,8] [--snr]

--snr adds, for the offline Table 4's release, the embedding's norm (clean and clipped) against the noise's.
"""

from __future__ import annotations

import argparse
import math

import torch

from raysim.config import DPConfig
from raysim.methods.base import ClientData, EnvSpec, TrainConfig
from raysim.methods.fedtsp.fedtsp import FedTSP, Options
from raysim.models.clip import ModelSpec
from raysim.privacy.host import HostPrivacy

CLIP, DELTA = 2.5, 1e-5  # fedtsp.txt 4.6


def eq11_sigma(epsilon: float) -> float:
    return 2.0 * CLIP * math.sqrt(2.0 * math.log(1.25 / DELTA)) / epsilon


def measure(mode: str, epsilon: float, rounds: int) -> tuple[float, int, float]:
    """(measured std, coordinates, the dp client's ledger epsilon after its first round)."""
    dp = DPConfig(epsilon=epsilon, delta=DELTA)
    o = Options(plm="bert", model_family="tiny", len_prompt=2, dp_clip=CLIP, dp_budget=mode)
    o.validate()
    method = FedTSP(TrainConfig(batch_size=8, num_clients=2), o, dp)
    env = method.build_env(EnvSpec(ModelSpec(), ["zero", "one", "two"], dataset="digits"), role="client")
    host = HostPrivacy(dp=dp, method=method, seed=1, batch_size=8, releases_per_client=lambda cid: rounds)
    x = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([0, 1, 2] * 4)
    data = ClientData(0, x, y, x[:3], y[:3], 3)
    g = torch.Generator().manual_seed(0)
    private, shared = method.init_private(env, data, g), method.init_shared(env, torch.Generator().manual_seed(0))
    handle = host.open(0, 0, data.num_train, shared)  # FedTSP's Step 0 on the dp client, as the engine opens it
    up = handle.close(method.local_setup(env, shared, private, data, rng=torch.Generator().manual_seed(1), privacy=handle).upload)
    clean = method.embed_descriptions(env).double().reshape(-1)
    noise = up["text_emb"].double().reshape(-1) - clean * min(1.0, CLIP / float(clean.norm()))
    return float(noise.std()), noise.numel(), host.ledger(0).epsilon()


def signal_to_noise(eps_list: list[float]) -> None:
    """The offline Table 4's release (benchmarks/tables/fedtsp_table4.yaml: digits' 10 classes, BERT MiniLM):
    the L2 norm of the description embedding, clean and clipped to C, against the norm of Eq. 11's noise,
    sigma sqrt(D) over its D coordinates (its expectation to within 1/sqrt(D))."""
    from raysim.data.digits import DIGIT_NAMES

    o = Options(plm="bert", model_family="tiny", dp_clip=CLIP, dp_budget="paper")
    method = FedTSP(TrainConfig(num_clients=4), o, DPConfig(epsilon=1.0, delta=DELTA))
    emb = method.embed_descriptions(method.build_env(EnvSpec(ModelSpec(), list(DIGIT_NAMES), dataset="digits"), role="client"))
    d, clean = emb.numel(), float(emb.double().norm())
    print(f"\nrelease of the offline Table 4: shape {tuple(emb.shape)}, D = {d:,} coordinates, |E| = {clean:.2f} clean "
          f"(`code` sends it unclipped), {min(clean, CLIP):.2f} clipped to C (`paper`)\n")
    print("| epsilon | Eq. 11 sigma | noise norm sigma sqrt(D) | clean / noise (code) | clipped / noise (paper) |")
    print("|---:|---:|---:|---:|---:|")
    for eps in eps_list:
        noise = eq11_sigma(eps) * math.sqrt(d)
        print(f"| {eps:g} | {eq11_sigma(eps):.3f} | {noise:,.0f} | {clean / noise:.2e} | {min(clean, CLIP) / noise:.2e} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=300, help="T, the prototype releases a client is calibrated for")
    p.add_argument("--eps", default="1,8")
    p.add_argument("--snr", action="store_true", help="also the offline Table 4 release's signal against its noise")
    a = p.parse_args()
    print("| dp_budget | epsilon | Eq. 11 sigma | measured std | ratio | coordinates | ledger epsilon (round 0) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode in ("paper", "split", "joint"):
        for eps in (float(e) for e in a.eps.split(",")):
            std, n, led = measure(mode, eps, a.rounds)
            print(f"| {mode} | {eps:g} | {eq11_sigma(eps):.3f} | {std:.3f} | {std / eq11_sigma(eps):.3f} | {n:,} | {led:.3f} |")
    if a.snr:
        signal_to_noise([float(e) for e in a.eps.split(",")])


if __name__ == "__main__":
    main()
