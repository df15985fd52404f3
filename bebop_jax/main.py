r"""Entry point: runs the stages a config names.

  python -m bebop_jax.main --config=configs/quickstart.py[:arg] \
      [--config.key=value ...] [--workdir=DIR] [--compilation_cache=DIR]
      [--distributed=auto|on|off]
      [--coordinator=HOST:PORT --num_processes=N --process_id=I [--distributed_timeout=S]]

The config file's `get_config(arg)` returns an ml_collections.ConfigDict; it is locked, so an
override of a key that does not exist is an error, and `bebop_jax.config.validate` rejects bad
values before any work starts. The terminal shows the stages' lines, progress bars and
warnings; library INFO logs go to <workdir>/log.txt (`--verbosity=0` keeps them on the
terminal too).

A bad config, mesh, placement or checkpoint stops the run with one short message saying
what is wrong and, where the config file's docstring gives one, how to run it (e.g. the
XLA_FLAGS line that simulates its devices); `--debug` shows the traceback instead.

Several processes (docs/usage.md): every process runs the same command with its own
`--process_id`; process 0 hosts the coordinator at `--coordinator`. They check that they were
given the same config and workdir before any work (bebop_jax.multihost).
"""

from __future__ import annotations

import logging as std_logging
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from bebop_jax.stages import config as config_lib
from bebop_jax.stages import console
from bebop_jax import multihost
from bebop_jax import sharding
from bebop_jax import compilation
from bebop_jax import stages

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an experiment config file (configs/*.py[:arg]).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints, metrics and reports "
    "(default: runs/<config file name>).")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", None, "JAX's persistent compilation cache: a program compiled once "
    "(by an earlier stage that released it, a resumed stage, a rerun) is loaded, not "
    "compiled again. Default <workdir>/compile_cache; '' turns it off.")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", ["auto", "on", "off"],
    "Call jax.distributed.initialize() before anything else: on every host of a multi-host "
    "run (TPU pod slice, or a coordinator given by JAX_COORDINATOR_ADDRESS). auto: when the "
    "environment names several TPU hosts or a coordinator.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "HOST:PORT of the coordinator of a run over several processes "
    "(process 0 hosts it; default JAX_COORDINATOR_ADDRESS). With --num_processes and "
    "--process_id: JAX's multi-controller runtime on any machines, e.g. two processes on "
    "localhost (CPU collectives over gloo).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "How many processes run this job (with --coordinator).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index, 0..num_processes-1 (with --coordinator).")
_DISTRIBUTED_TIMEOUT = flags.DEFINE_float(
    "distributed_timeout", 300.0, "Seconds a process waits for the coordinator and the other "
    "processes at start-up before it stops with a message.")
_DEBUG = flags.DEFINE_bool(
    "debug", False, "Show the traceback of a configuration, placement or checkpoint error "
    "instead of its one-line message.")


def user_errors() -> tuple[type[Exception], ...]:
  """The errors that mean the run was set up wrong (config, mesh, placement, checkpoint,
  model files), not that the code failed: the CLI reports them without a traceback."""
  # pylint: disable=g-import-not-at-top
  from bebop_jax.data.chat import ChatTemplateError
  from bebop_jax.model.gguf import GGUFError
  from bebop_jax.model.hf import CheckpointError
  from bebop_jax.rl.aot import AotError
  from bebop_jax.rl.placement import PlacementError
  from bebop_jax.train.checkpoint import CheckpointMismatchError
  return (config_lib.ConfigError, sharding.MeshError, PlacementError, AotError,
          CheckpointMismatchError, CheckpointError, GGUFError, ChatTemplateError,
          multihost.DistributedError)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a one-line message instead of a traceback for a
  `--config.*` override that does not apply (unless --debug)."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, KeyError, AttributeError, TypeError, ValueError) as e:
    if "--debug" in argv:
      raise
    text = f"error: {e}" if isinstance(e, flags.Error) else console.override_error(argv, e)
    print(text + "\n(--debug shows the traceback)", file=sys.stderr)
    sys.exit(2)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    _main()
  except user_errors() as e:  # pylint: disable=catching-non-exception
    if _DEBUG.value:
      raise
    print(console.report_user_error(e, flags.FLAGS["config"].config_filename), file=sys.stderr)
    sys.exit(2)


def _main():
  to_terminal = flags.FLAGS["verbosity"].present
  if not to_terminal:  # before JAX starts its backends (they log at INFO)
    logging.get_absl_handler().setLevel(std_logging.WARNING)
  explicit = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if _DISTRIBUTED.value != "off" and (any(x is not None for x in explicit) or
                                      sharding.multihost(_DISTRIBUTED.value, dict(os.environ))):
    coordinator = _COORDINATOR.value
    if coordinator is None and any(x is not None for x in explicit):
      coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
    # Every process runs this same program; process 0 hosts the coordinator.
    multihost.initialize(coordinator, _NUM_PROCESSES.value, _PROCESS_ID.value,
                         timeout_s=_DISTRIBUTED_TIMEOUT.value)
  config = config_lib.validate(_CONFIG.value)
  # Every process must run the same job: the same config and workdir.
  multihost.check_same({**multihost.flat_items(config.to_dict()),
                        "--workdir": str(_WORKDIR.value)}, "config")
  workdir = os.path.abspath(_WORKDIR.value or console.default_workdir(
      flags.FLAGS["config"].config_filename))
  os.makedirs(workdir, exist_ok=True)
  compilation.enable_compilation_cache(_COMPILATION_CACHE.value, workdir)
  console.route_logs(workdir, to_terminal=to_terminal)
  logging.info("workdir: %s", os.path.abspath(workdir))
  stages.run(config, workdir)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=parse_flags)
