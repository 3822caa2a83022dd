"""How much of a DP-SGD step on FedSEPT's A is the data, with L_div summed (the paper) or averaged (the code).

    python benchmarks/fedsept_ldiv_dp.py [key=value ...]     # default: synthetic-large, pathological, 10 clients

At FedSEPT's initialisation (the official one: A, B0 ~ N(0, 0.02^2), R = 0, the run's seed), on client 0's
first DP-SGD batch (B examples, no noise), for each reduction:

- |lambda grad_A L_div|: the data-independent gradient added to every per-example loss before clipping;
- the median over the batch of |grad_A CE_i|, the per-example data gradient;
- the data's share of the clipped step: with s_i = min(1, C / |g_i + d|) each example's clip factor
  (g_i its CE gradient, d the L_div gradient, C = dp.clip), the step is sum_i s_i g_i + sum_i s_i d and
  the share is |sum_i s_i g_i| / (|sum_i s_i g_i| + |sum_i s_i d|).

Prints one line per reduction. docs/papers/fedsept.md "L_div under DP" quotes it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import torch
    import torch.nn.functional as F

    from raysim.build import build_config, make_method
    from raysim.config import merge_config, parse_overrides
    from raysim.engine.hosts import ClientHost, ServerHost
    from raysim.engine.loop import prepare_data
    from raysim.methods.fedsept.fedsept_parts import diversity_loss
    from raysim.sampling import batch_indices, generator

    argv = list(sys.argv[1:] if argv is None else argv)
    values = merge_config({"method": "fedsept", "data": {"dataset": "synthetic-large", "partition": "pathological"},
                           "train": {"num_clients": 10, "ctx_init": ""}, "dp": {"epsilon": 1.0},
                           "execution": {"backend": "inline"}, "output": {"progress": False, "tensorboard": False}},
                          parse_overrides(argv))
    with tempfile.TemporaryDirectory() as tmp:
        values = merge_config(values, {"output": {"out_dir": str(Path(tmp) / "run")}})
        cfg = build_config(values)
        data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
        server = ServerHost(cfg, data.classnames, str(Path(tmp) / "run"))
        host = ClientHost(cfg, data, [0], str(Path(tmp) / "run"))
        m, env = host.method, host.env
        A = server.get_shared()["A"].clone().requires_grad_(True)
        priv, cd = host.private_state(0), host.client_data(0)
        R = priv["R"] if m.has_residual else None
        router = m._router(env, torch.Generator(), priv["router"]).eval() if m.has_router else None
        idx = next(iter(batch_indices(cd.num_train, cfg.train.batch_size, generator(cfg.train.seed, "train", 0, 0))))
        x, y = cd.x_train[idx], cd.y_train[idx]
        logits, _ = m.forward(env, A, R, router, x)
        ce = F.cross_entropy(logits, y, reduction="none")
        g = torch.stack([torch.autograd.grad(ce[i], A, retain_graph=True)[0] for i in range(len(idx))])
        C = cfg.dp.clip
        print(f"{cfg.data.dataset} ({cfg.data.partition}, {cfg.train.num_clients} clients), {cfg.model.name}, client 0, "
              f"B={len(idx)}, lambda_div={m.opts.lambda_div}, dp.clip={C}")
        for red in ("sum", "mean"):
            (d,) = torch.autograd.grad(m.opts.lambda_div * diversity_loss(A, m.M, red), A)
            tot = g + d
            s = (C / tot.flatten(1).norm(dim=1)).clamp(max=1.0)
            data_part = (s[:, None, None] * g).sum(0).norm()
            div_part = (s.sum() * d).norm()
            share = float(data_part / (data_part + div_part))
            med = float(g.flatten(1).norm(dim=1).median())
            print(f"  {red:4s}: |lambda grad L_div| = {float(d.norm()):.3f}, median |grad CE_i| = {med:.3f}, "
                  f"data's share of the clipped step = {100 * share:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
