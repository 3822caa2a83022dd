"""The dp section's checks: the part that owns the accountants and the mechanism registry validates `dp.*`
(called from raysim.build, where a run is assembled; whether a method's uploads can be released under the
run's dp is `mechanisms.check_method`, asked there too). A message names the key and what to do."""

from __future__ import annotations

from raysim.config.rules import check as _check
from raysim.config.schema import DPConfig
from raysim.errors import shown

from .accountant import ACCOUNTANTS, CONVERSIONS
from .mechanisms import MECHANISMS


def check_dp(dp: DPConfig) -> None:
    _check(dp.epsilon > 0, f"dp.epsilon must be > 0 (inf turns DP off), got {dp.epsilon}")
    _check(0 < dp.delta < 1, f"dp.delta must be in (0, 1), got {dp.delta}")
    _check(dp.clip > 0, f"dp.clip must be > 0, got {dp.clip}")
    _check(dp.accountant in ACCOUNTANTS, f"dp.accountant must be one of {', '.join(ACCOUNTANTS)}, got {shown(dp.accountant)}")
    _check(dp.conversion in CONVERSIONS, f"dp.conversion must be one of {', '.join(CONVERSIONS)}, got {shown(dp.conversion)}")
    _check(dp.conversion == "tight" or dp.accountant == "rdp",
           "dp.conversion=classic converts an RDP curve to epsilon; it needs dp.accountant=rdp")
    _check(dp.microbatch >= 0, f"dp.microbatch must be >= 1, or 0 = sized from the graph's memory, got {dp.microbatch}")
    _check(dp.calibration in ("participated", "all_rounds"), "dp.calibration must be participated or all_rounds")
    _check(dp.level in ("sample", "client"), f"dp.level must be sample or client, got {shown(dp.level)}")
    _check(dp.sampling in ("poisson", "shuffle"), f"dp.sampling must be poisson or shuffle, got {shown(dp.sampling)}")
    protos = [n for n in MECHANISMS.names() if MECHANISMS.get(n).applied == "release" and n != "embedding"]
    _check(dp.prototypes in protos, f"dp.prototypes must be one of {', '.join(protos)}, got {shown(dp.prototypes)}")
    _check(dp.proto_clip > 0, f"dp.proto_clip must be > 0, got {dp.proto_clip}")
    _check(0 < dp.vpp.rho <= 0.5, f"dp.vpp.rho must be in (0, 0.5], got {dp.vpp.rho}")
    _check(dp.vpp.H > 0, f"dp.vpp.H must be > 0, got {dp.vpp.H}")
    _check(0 < dp.vpp.split < 1, f"dp.vpp.split must be in (0, 1), got {dp.vpp.split}")
