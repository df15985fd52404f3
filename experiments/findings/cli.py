"""The command line of experiments/reproduce.py and experiments/fig_*.py.

Flags are defined by `define_flags()`, which only the scripts call (under __main__), so the
library and the tests can import this module.
"""

from __future__ import annotations

import logging as std_logging
import os
import shlex
import sys
from typing import Sequence

from absl import flags
from absl import logging

from experiments.findings import common


def define_flags(page: bool) -> None:
  flags.DEFINE_enum("scale", "laptop", list(common.SCALES),
                    "Budgets: smoke (seconds, the tiny model), laptop (about an hour on two "
                    "CPU cores), full (the same code at larger budgets); real (the pretrained "
                    "SmolLM2-135M-Instruct, configs/smollm2.py, about 100 minutes on two CPU "
                    "cores) and real_full (it at an accelerator's budgets).")
  flags.DEFINE_string("workdir", None, "Directory for every stage and finding; a rerun "
                      "reuses finished stages and resumes partial ones.")
  flags.DEFINE_string("config", None, "Base config file (default: the scale's, "
                      "experiments/findings/common.py SCALES).")
  if page:
    flags.DEFINE_string("results", None, "Path of the results page (default: "
                        "<workdir>/results.md); figures and data go to <its dir>/results/.")
    flags.DEFINE_list("only", [], "Run only these findings' scripts (default: all).")
  flags.DEFINE_string("compilation_cache", None, "JAX's persistent compilation cache: stages "
                      "that compile the same programs (seeds, arms, reruns) compile once. "
                      "Default <workdir>/compile_cache; '' turns it off.")
  flags.mark_flag_as_required("workdir")


def _prepare(workdir: str) -> None:
  from bebop_jax.stages import console  # pylint: disable=g-import-not-at-top
  from bebop_jax import compilation  # pylint: disable=g-import-not-at-top
  compilation.enable_compilation_cache(flags.FLAGS.compilation_cache, workdir)
  to_terminal = flags.FLAGS["verbosity"].present
  if not to_terminal:
    logging.get_absl_handler().setLevel(std_logging.WARNING)
  os.makedirs(workdir, exist_ok=True)
  console.route_logs(workdir, to_terminal=to_terminal)


def command_line() -> str:
  script = os.path.relpath(os.path.abspath(sys.argv[0]), common.REPO)
  return " ".join(["python", shlex.quote(script), *map(shlex.quote, sys.argv[1:])])


def main_reproduce(argv: Sequence[str]) -> None:
  del argv
  from experiments.findings import results  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  _prepare(f.workdir)
  common.prepare_checkpoint(common.get_scale(f.scale))
  results.reproduce(f.workdir, f.scale, names=tuple(f.only) or tuple(results.FINDINGS),
                    results=f.results, command=command_line(), config_file=f.config)


def main_one(name: str):
  """The main of experiments/fig_<name>.py: that finding's files under <workdir>/findings."""
  def main(argv: Sequence[str]) -> None:
    del argv
    from experiments.findings import results  # pylint: disable=g-import-not-at-top
    f = flags.FLAGS
    _prepare(f.workdir)
    common.prepare_checkpoint(common.get_scale(f.scale))
    ctx = common.Context(f.workdir, f.scale, f.config)
    results.run_findings(ctx, (name,))
    print(f"wrote {ctx.out_dir}/")
  return main
