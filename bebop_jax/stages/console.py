"""The terminal and the log file: stage lines, progress bars and warnings on the terminal;
library INFO logs (orbax, TFDS, absl) in <workdir>/log.txt."""

from __future__ import annotations

import ast
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
  they also stay on the terminal. Returns the log file's path: log.txt, or for process
  I > 0 of a run over several processes log.process<I>.txt."""
  from bebop_jax import multihost  # pylint: disable=g-import-not-at-top
  index = multihost.process_index()
  path = os.path.join(workdir, "log.txt" if index == 0 else f"log.process{index}.txt")
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


# ------------------------------------------------- setup errors, as the CLI reports them


def run_hints(config_path: str) -> list[str]:
  """The lines of the config file's docstring that show how to run it with an environment
  (`XLA_FLAGS=...`, the line after a trailing backslash included); empty if none."""
  path = config_path.partition(":")[0]
  try:
    with open(path) as f:
      doc = ast.get_docstring(ast.parse(f.read())) or ""
  except (OSError, SyntaxError):
    return []
  lines, hints = doc.splitlines(), []
  for i, line in enumerate(lines):
    if "XLA_FLAGS=" in line:
      command = line
      while command.rstrip().endswith("\\") and i + 1 < len(lines):  # a raw docstring's
        i += 1                                                        # continued line
        command = command.rstrip()[:-1] + " " + lines[i]
      hints.append(" ".join(command.split()))
  return hints


def report_user_error(error: Exception, config_path: str | None) -> str:
  """The message the CLI prints for a setup error: what is wrong, and how to run the config
  where its docstring says."""
  text = f"error: {error}"
  hints = run_hints(config_path) if config_path else []
  if hints:
    text += "\nThis config's docstring runs it as:\n  " + "\n  ".join(hints)
  return text + "\n(--debug shows the traceback)"


def default_workdir(config_path: str) -> str:
  """runs/<config file stem>[_<arg>] under the current directory."""
  path, _, arg = config_path.partition(":")
  stem = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("runs", stem + (f"_{arg}" if arg else ""))


def override_error(argv: list[str], error: Exception) -> str:
  """The message for a `--config.<path>=<value>` that names no key of the config (or whose
  value does not parse): which override, which part of its path is missing, and the keys
  that exist there."""
  from bebop_jax.stages import config as config_lib  # pylint: disable=g-import-not-at-top  (jax-free until used)
  config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  overrides = [a for a in argv if a.startswith("--config.")]
  try:
    path, _, arg = (config_arg or "").partition(":")
    config = config_lib.load_file(path, arg or None)
  except Exception:  # pylint: disable=broad-except  # fall back to the raw error
    config = None
  for override in overrides:
    keys = override[len("--config."):].split("=", 1)[0].split(".")
    node, where = config, "config"
    for key in keys:
      if node is None or not hasattr(node, "keys"):
        break
      if key not in node:
        allowed = ", ".join(sorted(node.keys()))
        return (f"error: {override}: {where} has no key {key!r}; its keys: {allowed}")
      node, where = node[key], f"{where}.{key}"
  return f"error: a --config override could not be applied ({type(error).__name__}: {error})"
