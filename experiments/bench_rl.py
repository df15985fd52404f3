r"""RL speed: {autoregressive, speculative} x {sync, async} rollouts, same prompts and seeds.

  python experiments/bench_rl.py --config=configs/laptop.py --init_from=runs/laptop \
      --workdir=runs/bench_rl --steps=24

Every arm runs the `rl` stage from the SFT/MTP stages in --init_from, in --workdir/<arm>
(a rerun resumes the schedule or reuses finished arms). The arms run interleaved in blocks of
--block_steps steps, the arm order alternating between blocks (ABCD, DCBA, ...); each block
resumes the arm's stage from its checkpoint, and the first --warmup steps of every block are
left out of the statistics. --placement=auto puts the arms on split sub-meshes when there are
at least two devices, else colocated (--simulated_devices=N makes N host devices on a CPU;
they share the machine's cores, so a split run there checks the split path's structure and
measures no speed). It prints and writes (--workdir/bench_rl.{json,md}) the placement, the
schedule, seconds per RL step, the rollout share, the time to a target held-out reward, the
paired speedups with their 95% intervals, and the decode speedup with the Amdahl and overlap
bounds next to the measured ratios (experiments/rl_benchmark.py); the learner's compile time is
reported apart. Teacher-forced diagnostics are off, so a step is rollouts + learner + weight
sync only.
"""

from __future__ import annotations

import os  # pylint: disable=g-bad-import-order
import sys

if __package__ in (None, ""):  # run as a script: the checkout's root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.",
                                          lock_config=True)
_INIT = flags.DEFINE_string("init_from", None, "Workdir with the SFT/MTP stages "
                            "(default: the config's rl.init_from).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (one subdirectory per arm).")
_ARMS = flags.DEFINE_list("arms", ["autoregressive_sync", "autoregressive_async",
                                   "speculative_sync", "speculative_async"],
                          "Arms to run, in the order of even blocks (experiments.rl_benchmark."
                          "ALL_ARMS: also adaptive_sync, adaptive_async).")
_STEPS = flags.DEFINE_integer("steps", 24, "RL steps per arm.")
_BLOCK = flags.DEFINE_integer("block_steps", 8, "Steps per interleaved block; 0 (or >= "
                              "--steps): each arm in one go, one after the other, and the "
                              "paired speedups get no interval.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 8, "Held-out evaluation every N steps.")
_EVAL_N = flags.DEFINE_integer("eval_examples", 32, "Held-out prompts per task.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Steps after each block's start left out of the "
                               "statistics.")
_TARGET = flags.DEFINE_float("target", None, "Held-out mean pass@1 to reach (default: halfway "
                             "from the start to the best value any arm reached).")
_STALENESS = flags.DEFINE_integer("max_staleness", 1,
                                  "Async arms' rl.asynchronous.max_staleness.")
_PLACEMENT = flags.DEFINE_enum("placement", "auto", ["auto", "split", "colocated"],
                               "auto: split sub-meshes with at least two devices, else "
                               "colocated.")
_SIM = flags.DEFINE_integer("simulated_devices", 0, "> 0: this many simulated host devices "
                            "(CPU only; set before JAX starts).")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", None, "JAX's persistent compilation cache, so each block's stage "
    "start loads its programs instead of compiling them. Default <workdir>/compile_cache; '' "
    "turns it off.")


def main(argv):
  del argv
  if _SIM.value:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_SIM.value}").strip()
  import jax  # pylint: disable=g-import-not-at-top  # after XLA_FLAGS
  from experiments import rl_benchmark as bench  # pylint: disable=g-import-not-at-top
  from bebop_jax import compilation  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value
  init_from = _INIT.value or config.rl.init_from
  if not init_from or not _WORKDIR.value:
    raise app.UsageError("--workdir and --init_from (or the config's rl.init_from) are needed")
  compilation.enable_compilation_cache(_COMPILATION_CACHE.value, _WORKDIR.value)
  split = (jax.device_count() >= 2 if _PLACEMENT.value == "auto"
           else _PLACEMENT.value == "split")
  config = bench.bench_config(config, init_from, steps=_STEPS.value,
                              eval_every=_EVAL_EVERY.value, eval_examples=_EVAL_N.value,
                              max_staleness=_STALENESS.value, split=split)
  print(f"[bench_rl] {bench.placement_line(bench.placement(split))}")
  result = bench.run_arms(config, _WORKDIR.value, _ARMS.value, split=split,
                          warmup=_WARMUP.value, target=_TARGET.value,
                          block_steps=_BLOCK.value)
  result["devices"] = {"count": jax.device_count(), "platform": jax.devices()[0].platform,
                       "kind": jax.devices()[0].device_kind}
  table = bench.markdown(result["arms"], result["ratios"], result["target"],
                         pairs=result["pairs"], placement=result["placement"],
                         schedule=result["schedule"])
  compile_line = ", ".join(f"{a} {s['learner_compile_s']:.1f}s"
                           for a, s in result["arms"].items())
  table += (f"Learner compile or cache load at the last block's start (not in the step "
            f"times): {compile_line}.\n")
  print(table)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, "bench_rl.json"), "w") as f:
    json.dump(result, f, indent=2)
  with open(os.path.join(_WORKDIR.value, "bench_rl.md"), "w") as f:
    f.write(table)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
