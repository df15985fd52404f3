r"""RL speed: {autoregressive, speculative} x {sync, async} rollouts, same prompts and seeds.

  python experiments/bench_rl.py --config=configs/quickstart.py --init_from=runs/quickstart \
      --workdir=runs/bench_rl --steps=24 --simulated_devices=2

Every arm runs the `rl` stage from the SFT/MTP stages in --init_from, in --workdir/<arm>
(a rerun resumes or reuses finished arms). Async arms run on split sub-meshes when there are
at least two devices (--simulated_devices=N makes N host devices on a CPU; leave it 0 on a
GPU/TPU machine), else colocated. It prints and writes (--workdir/bench_rl.{json,md}) seconds
per RL step, the rollout share, the time to a target held-out reward, the decode speedup and
the Amdahl and overlap bounds next to the measured ratios (bebop_jax/bench_rl.py); the
learner's compile time is reported apart. Teacher-forced diagnostics are off, so a step is
rollouts + learner + weight sync only.
"""

from __future__ import annotations

import json
import os

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.",
                                          lock_config=True)
_INIT = flags.DEFINE_string("init_from", None, "Workdir with the SFT/MTP stages "
                            "(default: the config's rl.init_from).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (one subdirectory per arm).")
_ARMS = flags.DEFINE_list("arms", ["autoregressive_sync", "autoregressive_async",
                                   "speculative_sync", "speculative_async"], "Arms to run.")
_STEPS = flags.DEFINE_integer("steps", 24, "RL steps per arm.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 8, "Held-out evaluation every N steps.")
_EVAL_N = flags.DEFINE_integer("eval_examples", 32, "Held-out prompts per task.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Leading steps left out of the medians.")
_TARGET = flags.DEFINE_float("target", None, "Held-out mean pass@1 to reach (default: the "
                             "lowest final value over the arms).")
_STALENESS = flags.DEFINE_integer("max_staleness", 1,
                                  "Async arms' rl.asynchronous.max_staleness.")
_SIM = flags.DEFINE_integer("simulated_devices", 0, "> 0: this many simulated host devices "
                            "(CPU only; set before JAX starts).")


def main(argv):
  del argv
  if _SIM.value:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_SIM.value}").strip()
  import jax  # pylint: disable=g-import-not-at-top  # after XLA_FLAGS
  from bebop_jax import bench_rl as bench  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value
  init_from = _INIT.value or config.rl.init_from
  if not init_from or not _WORKDIR.value:
    raise app.UsageError("--workdir and --init_from (or the config's rl.init_from) are needed")
  split = jax.device_count() >= 2
  config = bench.bench_config(config, init_from, steps=_STEPS.value,
                              eval_every=_EVAL_EVERY.value, eval_examples=_EVAL_N.value,
                              max_staleness=_STALENESS.value, split=split)
  print(f"[bench_rl] {jax.device_count()} {jax.devices()[0].platform} devices; async arms "
        f"{'on split sub-meshes' if split else 'colocated'}")
  result = bench.run_arms(config, _WORKDIR.value, _ARMS.value, split=split,
                          warmup=_WARMUP.value, target=_TARGET.value)
  result["devices"] = {"count": jax.device_count(), "platform": jax.devices()[0].platform,
                       "kind": jax.devices()[0].device_kind}
  table = bench.markdown(result["arms"], result["ratios"], result["target"])
  compile_line = ", ".join(f"{a} {s['learner_compile_s']:.1f}s"
                           for a, s in result["arms"].items())
  table += f"Learner compile (not in the step times): {compile_line}.\n"
  print(table)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, "bench_rl.json"), "w") as f:
    json.dump(result, f, indent=2)
  with open(os.path.join(_WORKDIR.value, "bench_rl.md"), "w") as f:
    f.write(table)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
