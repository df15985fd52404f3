"""The terminal and the log file: stage lines, progress bars and warnings on the terminal;
library INFO logs (orbax, TFDS, absl) in <workdir>/log.txt."""

from __future__ import annotations

import logging as std_logging
import os

from absl import logging


# Library warnings that say nothing to a user of this project: they stay in log.txt.
QUIET_WARNINGS = (
    "Using custom data configuration",      # TFDS: every task dataset has its own config
    "Requested `tracked_metric`",           # orbax: we keep the last checkpoints, not the best
)


class _Quiet(std_logging.Filter):

  def filter(self, record: std_logging.LogRecord) -> bool:
    msg = str(record.msg)
    return not any(q in msg for q in QUIET_WARNINGS)


def route_logs(workdir: str, to_terminal: bool = False) -> str:
  """Library INFO logs (orbax, TFDS, absl) go to <workdir>/log.txt; the terminal keeps the
  stage lines, progress bars and warnings. With `to_terminal` (an explicit --verbosity)
  they also stay on the terminal. Returns the log file's path."""
  path = os.path.join(workdir, "log.txt")
  handler = std_logging.FileHandler(path)
  handler.setLevel(std_logging.INFO)
  handler.setFormatter(logging.PythonFormatter())
  root = std_logging.getLogger()
  root.addHandler(handler)
  root.setLevel(min(root.level or std_logging.INFO, std_logging.INFO))
  if not to_terminal:
    absl_handler = logging.get_absl_handler()
    absl_handler.setLevel(std_logging.WARNING)
    if not any(isinstance(f, _Quiet) for f in absl_handler.filters):
      absl_handler.addFilter(_Quiet())
  return path
