"""Loading the default model prints nothing that is expected (transformers' load report of MiniLM's unused
pooler, open_clip's "initialized partially", the weights progress bar), and real load warnings still show."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

from raysim.models.quiet import REPORT_LOGGER, expected_report, quiet_load

ROOT = Path(__file__).resolve().parents[2]
NOISE = ("LOAD REPORT", "UNEXPECTED", "initialized partially", "Loading weights")


def test_default_model_loads_quietly(tmp_path):
    """A first run, as a user sees it: a fresh process and cache assemble raysim-clip and load it, then the
    bundled MiniLM as FedTSP's BERT PLM; logging as `raysim run` sets it up."""
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(name)s: %(message)s')\n"
        "from raysim.models.clip import ModelSpec, load_clip\n"
        "from raysim.models.plm import BertPLM\n"
        f"clip = load_clip(ModelSpec('raysim-clip', 'bundled', cache_dir={str(tmp_path)!r}))\n"
        "bert = BertPLM()\n"
        "print('loaded', type(clip.text).__name__, bert.width)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "loaded HFTextEncoder 384" in out.stdout
    assert list((tmp_path / "pretrained").glob("raysim-clip-*.pt"))  # the checkpoint was assembled here
    printed = out.stdout + out.stderr
    assert not [n for n in NOISE if n in printed], printed


def _report(**keys) -> list[str]:
    """What transformers logs for a load with these key sets, inside `quiet_load`."""
    from transformers.utils.loading_report import LoadStateDictInfo, log_state_dict_report

    info = LoadStateDictInfo(missing_keys=set(keys.get("missing", ())), unexpected_keys=set(keys.get("unexpected", ())),
                             mismatched_keys=set(), error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    seen: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(REPORT_LOGGER)
    logger.addHandler(catch)
    try:
        with quiet_load(partial_model="raysim-clip"):
            log_state_dict_report(torch.nn.Module(), "MiniLM", False, info, logger=logger)
    finally:
        logger.removeHandler(catch)
    return seen


def test_real_load_warnings_still_show():
    pooler = ("pooler.dense.weight", "pooler.dense.bias")
    assert _report(unexpected=pooler) == []  # the expected report: dropped
    missing = _report(unexpected=pooler, missing=("encoder.layer.0.attention.self.query.weight",))
    assert len(missing) == 1 and "MISSING" in missing[0] and "encoder.layer.0" in missing[0]
    other = _report(unexpected=(*pooler, "cls.predictions.bias"))
    assert len(other) == 1 and "cls.predictions.bias" in other[0]
    assert not expected_report("BertModel LOAD REPORT from: x\n")  # a report without rows is not "expected"


def test_only_the_named_model_may_be_partial(caplog):
    with caplog.at_level(logging.WARNING), quiet_load(partial_model="raysim-clip"):
        logging.warning("Model raysim-clip initialized partially.")
        logging.warning("Model raysim-other initialized partially.")
        logging.warning("No pretrained weights loaded for model 'raysim-clip'. Model initialized randomly.")
    assert [r.getMessage() for r in caplog.records] == [
        "Model raysim-other initialized partially.",
        "No pretrained weights loaded for model 'raysim-clip'. Model initialized randomly.",
    ]
