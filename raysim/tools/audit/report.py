"""The audit's report: the privacy ledger, the paper-layout tables of the attacks, RUN_DIR/audit.md and its
CSVs, and the attacks-against-epsilon figure of a folder of runs (raysim/tools/audit/__init__.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from raysim.attacks.base import per_round_means
from raysim.attacks.fsh import FSH_COLUMNS, FSH_REFERENCE
from raysim.attacks.gradient_inversion import GIA_COLUMNS, GIA_REFERENCE
from raysim.storage.runfolder import RunFolder


@dataclass
class PrototypeAudit:
    fsh: list[dict[str, Any]] = field(default_factory=list)  # one row per round, client, class
    mia: list[dict[str, Any]] = field(default_factory=list)  # one row per round, client
    skipped: list[str] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)


@dataclass
class GIAAudit:
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per round and client
    skipped: list[str] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)


@dataclass
class AuditResult:
    run_dir: Path
    family: str
    epsilon: float
    ldp: str
    method: str
    utility: dict[str, float]
    ledger: list[dict[str, Any]]
    summary: dict[str, tuple[float, float]] = field(default_factory=dict)  # metric -> (mean, std)
    prototype: Optional[PrototypeAudit] = None
    update: Any = None  # DataFrame of the update MIA
    gia: Optional[GIAAudit] = None

    def row(self) -> dict[str, Any]:
        """One row of the paper layout (flat: metric and metric_std)."""
        out: dict[str, Any] = {"run": str(self.run_dir), "method": self.method, "epsilon": self.epsilon, "ldp": self.ldp}
        for k, (m, s) in self.summary.items():
            out[k], out[f"{k} std"] = m, s
        for k in ("in_client", "cross_client", "hm"):
            out[k] = float(self.utility.get(k, math.nan))
        return out


def _pm(m: float, s: float, fmt: str) -> str:
    return "-" if math.isnan(m) else f"{m:{fmt}} ± {s:{fmt}}"


def _eps(e: float) -> str:
    return "-" if math.isinf(e) else f"{e:g}"


FMT = {"Cos Sim": ".4f", "cFFD": ".1f", "Top-1 Hit (%)": ".2f", "auc": ".4f", "tpr@1%fpr": ".4f", "tpr@0.1%fpr": ".4f",
       "advantage": ".4f", "f1": ".4f"}



def ldp_of(run: RunFolder) -> str:
    """The paper's LDP column: NoLDP, or the prototype mechanism (IGPP, VPP; VPDR = VPP + DCR), or for
    other methods the mechanisms of the uploads."""
    from raysim.privacy.mechanisms import resolve_all

    dp = getattr(run.method, "dp", None) or run.cfg.dp
    if not run.cfg.dp.enabled:
        return "NoLDP"
    mechs = {m.name for m in resolve_all(run.method.releases, dp, method=run.method.name).values()
             if m is not None and m.name != "public"}
    names = "+".join(sorted(n.upper() for n in mechs)) or "-"
    dcr = bool(getattr(run.method, "dcr", False))  # a VPDR framework's DCR (<method>.dcr)
    if dcr and names == "VPP":
        return "VPDR"
    return f"{names}+DCR" if dcr else names




# -- the ledger -------------------------------------------------------------------------------------

def ledger_rows(view: RunFolder) -> list[dict[str, Any]]:
    """Per client and mechanism: sigma, q, steps, rounds and the client's epsilon spent / target."""
    from raysim.privacy.ledger import PrivacyLedger

    rows: list[dict[str, Any]] = []
    for cid in range(view.cfg.train.num_clients):
        saved = view.latest_client_state(cid)
        base = {"client": cid, "target_epsilon": float(view.cfg.dp.epsilon), "delta": float(view.cfg.dp.delta)}
        if saved is None:
            rows.append({**base, "mechanism": "(never took part)", "sigma": math.nan, "q": math.nan, "steps": 0, "rounds": 0,
                         "epsilon_spent": 0.0, "valid": True})
            continue
        led = (saved.get("privacy") or {}).get("ledger") or saved.get("ledger")
        if not led:
            rows.append({**base, "mechanism": "none (no DP)", "sigma": math.nan, "q": math.nan, "steps": 0, "rounds": 0,
                         "epsilon_spent": math.inf if not view.cfg.dp.enabled else 0.0, "valid": True})
            continue
        ledger = PrivacyLedger.from_dict(led)
        spent = float(ledger.epsilon())
        groups: dict[tuple, dict[str, Any]] = {}
        for r in ledger.releases:
            key = (r.mechanism, float(r.sigma), float(r.sample_rate), r.epsilon is not None, r.valid)
            g = groups.setdefault(key, {"steps": 0, "rounds": set(), "pure": 0.0})
            g["steps"] += int(r.steps)
            g["rounds"].add(int(r.round))
            g["pure"] += float(r.epsilon or 0.0)
        for (mech, sigma, q, pure, valid), g in groups.items():
            rows.append({**base, "target_epsilon": float(ledger.target_epsilon), "delta": float(ledger.delta), "mechanism": mech,
                         "sigma": math.nan if pure else sigma, "q": q, "steps": g["steps"], "rounds": len(g["rounds"]),
                         "epsilon_spent": spent, "valid": valid, **({"pure_epsilon": g["pure"]} if pure else {})})
    return rows


def ledger_markdown(rows: list[dict[str, Any]]) -> str:
    from raysim.metrics import markdown_table

    def f(v: Any, fmt: str = ".4g") -> str:
        return "-" if isinstance(v, float) and math.isnan(v) else ("inf" if v == math.inf else format(v, fmt))

    body = []
    for r in rows:
        sigma = f"(pure eps {r['pure_epsilon']:.4g})" if "pure_epsilon" in r else f(r["sigma"])
        body.append([str(r["client"]), r["mechanism"] + ("" if r["valid"] else " (NOT a valid guarantee)"), sigma, f(r["q"]),
                     str(r["steps"]), str(r["rounds"]), f"{f(r['epsilon_spent'])} / {f(r['target_epsilon'])}"])
    return markdown_table(["client", "mechanism", "sigma", "q", "steps", "rounds", "epsilon spent / target"], body, align="llrrrrr")



# -- the tables -------------------------------------------------------------------------------------

def prototype_table(results: list[AuditResult]) -> str:
    """vpdr.txt's FSH / MIA table: epsilon, LDP, Cos Sim, cFFD, Top-1 Hit, ROC-AUC, TPR@1%FPR, Advantage, F1;
    then TPR@0.1%FPR, the utility and the no-leak reference of FSH (its random starting dummies)."""
    from raysim.metrics import markdown_table

    header = ["ε", "LDP", "method", "Cos Sim ↓", "cFFD ↑", "Top-1 Hit(%) ↓", "ROC-AUC →0.5", "TPR@1%FPR ↓", "Advantage →0",
              "F1 Score ↓", "TPR@0.1%FPR ↓", "In-Client acc", "start Cos Sim", "start Hit(%)"]
    cols = [*FSH_COLUMNS, "auc", "tpr@1%fpr", "advantage", "f1", "tpr@0.1%fpr"]
    body = []
    for r in results:
        ref = [r.summary.get(k, (math.nan, 0))[0] for k in FSH_REFERENCE]
        body.append([_eps(r.epsilon), r.ldp, r.method, *(_pm(*r.summary.get(c, (math.nan, math.nan)), FMT[c]) for c in cols),
                     _pct(r.utility.get("in_client", math.nan)), "-" if math.isnan(ref[0]) else f"{ref[0]:.4f}",
                     "-" if math.isnan(ref[1]) else f"{ref[1]:.2f}"])
    return markdown_table(header, body, align="lll" + "r" * (len(header) - 3))


def update_table(results: list[AuditResult]) -> str:
    """fedsept.txt Figure 5's numbers: per run and attacker, mean AUC over rounds, final AUC, HM."""
    from raysim.metrics import markdown_table

    body = []
    for r in results:
        m, s = r.summary.get("CLIPCos", (math.nan, math.nan)), r.summary.get("rand CLIPCos", (math.nan, 0))
        gia = [_pm(*m, ".4f"), "-" if math.isnan(s[0]) else f"{s[0]:.4f}"]
        for attack in ("update-only", "update-and-query"):
            m, s = r.summary.get(f"{attack} mean_auc", (math.nan, math.nan)), r.summary.get(f"{attack} final_auc", (math.nan, 0))
            body.append([_eps(r.epsilon), r.ldp, r.method, attack, "-" if math.isnan(m[0]) else f"{m[0]:.4f}",
                         "-" if math.isnan(s[0]) else f"{s[0]:.4f}", *gia, _pct(r.utility.get("hm", math.nan))])
    return markdown_table(["ε", "LDP", "method", "attacker", "mean AUC", "final AUC", "GIA CLIPCos", "rand CLIPCos", "HM"], body,
                          align="llll" + "rrrrr")


def gia_table(res: AuditResult) -> str:
    """Per round: the GIA metrics' mean over the attacked clients, then the mean ± std over rounds."""
    from raysim.metrics import markdown_table

    assert res.gia is not None
    cols = [*GIA_COLUMNS, *GIA_REFERENCE]
    fmt = {"CLIPCos": ".4f", "GradCos": ".4f", "PSNR": ".2f", "Top-1": ".2f", "rand CLIPCos": ".4f", "rand Top-1": ".2f"}
    body = []
    for _, row in per_round_means(res.gia.rows, cols).iterrows():
        body.append([str(int(row["round"])), *(f"{row[c]:{fmt[c]}}" for c in cols)])
    body.append(["mean ± std", *(_pm(*res.summary.get(c, (math.nan, math.nan)), fmt[c]) for c in cols)])
    return markdown_table(["round", *cols], body, align="l" + "r" * len(cols))


def _pct(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{100 * v:.2f}"


def run_markdown(res: AuditResult) -> str:
    lines = [f"# Privacy audit of {res.run_dir}", "",
             f"method {res.method}, dp.epsilon={_eps(res.epsilon) if math.isfinite(res.epsilon) else 'inf'} ({res.ldp}), "
             f"{'prototype attacks (vpdr.txt 5.4, SPEC 3.7)' if res.family == 'prototype' else 'update MIA (fedsept.txt 5.5, SPEC 1.12)'}",
             "", "## Privacy ledger (per client)", "", ledger_markdown(res.ledger)]
    if res.family == "prototype":
        pa = res.prototype
        assert pa is not None
        lines += ["## Attacks (white-box server: each client's model of the round of its release)", "",
                  f"rounds attacked: {', '.join(map(str, pa.rounds)) or 'none'}; metrics: mean over clients, then over rounds; "
                  "± = std over rounds (of the per-round means over clients)", "", prototype_table([res])]
        if pa.fsh:
            cs, hit = res.summary["start Cos Sim"][0], res.summary["start Top-1 Hit (%)"][0]
            lines += ["", f"no-leak reference (the attack's random starting dummies, same metrics): Cos Sim {cs:.4f}, "
                          f"Top-1 Hit {hit:.2f}%. An attack leaks where it beats these, not where it beats 0 and 1/C."]
        if pa.skipped:
            lines += ["", "not attacked:", "", *[f"- {s}" for s in pa.skipped[:20]],
                      *([f"- ... and {len(pa.skipped) - 20} more"] if len(pa.skipped) > 20 else [])]
    else:
        from raysim.attacks.update_mia import markdown

        lines += ["## Update MIA (logistic attackers on what the server saw)", "", update_table([res]), "", markdown(res.update)]
        if res.gia is not None:
            lines += ["", "## Gradient inversion of the uploaded prompt (fedsept.txt 5.5, SPEC 1.12)", "",
                      f"rounds attacked: {', '.join(map(str, res.gia.rounds)) or 'none'}; "
                      f"{len(res.gia.rows)} (round, client) inversions; per round the mean over clients, ± = std over rounds. "
                      "CLIPCos: cosine of the CLIP image embeddings of each reconstruction and the client's closest training "
                      "image; `rand`: the same for random images (the inversion's start), the no-leak level.", "",
                      gia_table(res)]
            if res.gia.skipped:
                lines += ["", "not attacked:", "", *[f"- {s}" for s in res.gia.skipped[:20]]]
    return "\n".join(lines) + "\n"


def write_run(res: AuditResult) -> None:
    import pandas as pd

    d = res.run_dir
    (d / "audit.md").write_text(run_markdown(res))
    pd.DataFrame(res.ledger).to_csv(d / "audit_ledger.csv", index=False)
    pd.DataFrame([res.row()]).to_csv(d / "audit_summary.csv", index=False)
    if res.prototype is not None:
        pd.DataFrame(res.prototype.fsh, columns=["round", "client", "class", *FSH_COLUMNS, *FSH_REFERENCE]).to_csv(
            d / "audit_fsh.csv", index=False)
        pd.DataFrame(res.prototype.mia).to_csv(d / "audit_mia.csv", index=False)
    if res.update is not None:
        res.update.to_csv(d / "audit_update_mia.csv", index=False)
    if res.gia is not None:
        pd.DataFrame(res.gia.rows).to_csv(d / "audit_gia.csv", index=False)



# -- against epsilon (a folder of runs) -------------------------------------------------------------

ATTACK_LINES = {"prototype": (("auc", "MIA ROC-AUC"), ("Cos Sim", "FSH Cos Sim")),
                "update": (("update-only mean_auc", "update-only AUC"), ("update-and-query mean_auc", "update-and-query AUC"),
                           ("CLIPCos", "GIA CLIPCos"))}
UTILITY_LINE = {"prototype": ("in_client", "In-Client acc"), "update": ("hm", "HM")}


@dataclass
class Series:
    family: str
    label: str  # "MIA ROC-AUC (fedproto IGPP)"
    kind: str  # "attack" (left axis) or "utility" (right axis)
    group: int  # the (method, LDP) line's colour index
    epsilons: list[float]  # inf = no DP
    values: list[float]


def epsilon_series(results: list[AuditResult]) -> list[Series]:
    """The lines of audit_vs_epsilon.png: per family and (method, LDP mechanism), each attack metric the
    runs have and the utility, against epsilon. A method's no-DP run joins each of its DP lines."""
    out: list[Series] = []
    for fam in sorted({r.family for r in results}):
        runs = [r for r in results if r.family == fam]
        groups: dict[str, list[AuditResult]] = {}
        for r in runs:
            groups.setdefault(r.method if r.ldp == "NoLDP" else f"{r.method} {r.ldp}", []).append(r)
        nodp = [r for r in runs if math.isinf(r.epsilon)]
        dp_methods = {r.method for r in runs if math.isfinite(r.epsilon)}
        groups = {k: v for k, v in groups.items() if any(math.isfinite(r.epsilon) for r in v) or v[0].method not in dp_methods}
        for gi, (name, rs) in enumerate(sorted(groups.items())):
            rs = sorted(rs + [n for n in nodp if n.method == rs[0].method and n not in rs], key=lambda r: r.epsilon)
            eps = [r.epsilon for r in rs]
            for key, label in ATTACK_LINES[fam]:
                ys = [r.summary.get(key, (math.nan, 0))[0] for r in rs]
                if not all(math.isnan(y) for y in ys):
                    out.append(Series(fam, f"{label} ({name})", "attack", gi, eps, ys))
            key, label = UTILITY_LINE[fam]
            out.append(Series(fam, f"{label} ({name})", "utility", gi, eps, [r.utility.get(key, math.nan) for r in rs]))
    return out


def plot_vs_epsilon(results: list[AuditResult], path: Path) -> Optional[Path]:
    """Attack metrics (left axis: MIA AUC, FSH Cos Sim, GIA CLIPCos) and utility (right axis, dashed)
    against epsilon, one colour per (method, LDP mechanism); no DP is drawn at the right end. None when
    the runs have fewer than two epsilons."""
    eps = sorted({r.epsilon for r in results})
    if len(eps) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [e for e in eps if math.isfinite(e)]
    inf_x = (max(finite) * 1.5 if finite else 1.0) if math.inf in eps else None
    series = epsilon_series(results)
    families = sorted({s.family for s in series})
    fig, axes = plt.subplots(1, len(families), figsize=(6.5 * len(families), 4.2), squeeze=False)
    for ax, fam in zip(axes[0], families):
        right = ax.twinx()
        marks: dict[str, str] = {}
        for line in (s for s in series if s.family == fam):
            xs = [inf_x if math.isinf(e) else e for e in line.epsilons]
            if line.kind == "utility":
                right.plot(xs, line.values, marker="x", linestyle="--", color=f"C{line.group}", alpha=0.6, label=line.label)
            else:
                metric = line.label.split(" (")[0]
                mark = marks.setdefault(metric, "os^dv"[len(marks) % 5])
                ax.plot(xs, line.values, marker=mark, linestyle="-", color=f"C{line.group}", label=line.label)
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        ticks = finite + ([inf_x] if inf_x is not None else [])
        ax.set_xticks(ticks, [f"{e:g}" for e in finite] + (["no DP"] if inf_x is not None else []))
        ax.set_xlabel("ε (local DP budget)")
        ax.set_ylabel("attack (AUC, Cos Sim)" if fam == "prototype" else "attack (AUC, GIA CLIPCos)")
        right.set_ylabel(f"utility ({UTILITY_LINE[fam][1]}, dashed)")
        ax.set_title("prototype attacks (FSH, MIA)" if fam == "prototype" else "update MIA, gradient inversion")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = right.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


