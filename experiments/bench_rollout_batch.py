r"""Autoregressive rollout throughput by batch size: where the MTP stage samples its drafter
dataset (mtp.data.batch_size).

  python experiments/bench_rollout_batch.py --config=configs/smollm2.py \
      --workdir=runs/smollm2 --batch_sizes=16,32,64,128 --num_prompts=128 \
      --out=docs/artifacts/smollm2_rollout_batch.json

The SFT policy of --workdir samples the first --num_prompts training prompts of each task
the way the MTP stage does (stages.drafter_data.policy_rollouts: the stage's temperature, budget and
key, autoregressively, keeping the trunk's hidden states), once per batch size after a
warm-up call that compiles its programs. Reports policy tokens per second per batch size,
over --repeats passes in alternating order (each pass times every batch size once), with
the median and range.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from bebop_jax.stages import config as config_lib
from bebop_jax.stages import lineage
from bebop_jax.stages import drafter_data

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir holding the SFT stage.")
_BATCH = flags.DEFINE_list("batch_sizes", ["16", "32", "64", "128"], "Batch sizes.")
_PROMPTS = flags.DEFINE_integer("num_prompts", 128, "Prompts per task per measurement.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed passes.")
_OUT = flags.DEFINE_string("out", None, "JSON output path.")


def main(argv):
  del argv
  config = config_lib.validate(_CONFIG.value)
  graphdef, params = lineage.restore_policy(config, _WORKDIR.value, stage="sft")
  per_task = {n: _PROMPTS.value for n in drafter_data.heldout_tasks(config)}
  sizes = [int(b) for b in _BATCH.value]

  def sample(batch: int, num: dict[str, int]) -> tuple[float, int]:
    config.mtp.data.batch_size = batch
    start = time.perf_counter()
    rollouts = drafter_data.policy_rollouts(config, graphdef, params, "train", num,
                                   engine="autoregressive")
    return time.perf_counter() - start, sum(r.policy_tokens() for r in rollouts.values())

  for b in sizes:  # compile every program first
    sample(b, {n: b for n in per_task})
  rates = {b: [] for b in sizes}
  for rep in range(_REPEATS.value):
    for b in (sizes if rep % 2 == 0 else sizes[::-1]):
      seconds, tokens = sample(b, per_task)
      rates[b].append({"seconds": seconds, "policy_tokens": tokens,
                       "tokens_per_s": tokens / seconds})
      print(f"batch {b}: {tokens} policy tokens in {seconds:.1f} s "
            f"({tokens / seconds:.1f} tokens/s)")
  rows = [{"batch": b, "prompts": sum(per_task.values()), "passes": rates[b],
           "median_tokens_per_s": float(np.median([p["tokens_per_s"] for p in rates[b]])),
           "min_tokens_per_s": float(min(p["tokens_per_s"] for p in rates[b])),
           "max_tokens_per_s": float(max(p["tokens_per_s"] for p in rates[b]))}
          for b in sizes]
  out = _OUT.value or os.path.join(_WORKDIR.value, "rollout_batch.json")
  with open(out, "w") as f:
    json.dump({"workdir": _WORKDIR.value, "temperature": config.mtp.temperature,
               "max_new_tokens": config.mtp.data.max_new_tokens, "results": rows}, f,
              indent=1)
  for r in rows:
    print(f"batch {r['batch']:4d}: median {r['median_tokens_per_s']:.1f} tokens/s "
          f"[{r['min_tokens_per_s']:.1f}, {r['max_tokens_per_s']:.1f}]")
  print(f"wrote {out}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
