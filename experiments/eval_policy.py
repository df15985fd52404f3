r"""Held-out pass@1 and per-token entropy of a workdir's SFT policy at temperature 1.

  python experiments/eval_policy.py --config=configs/testbed_entropy.py \
      --workdir=runs/testbed_entropy --num_examples=256

One autoregressive rollout per held-out prompt (the first --num_examples of the test split
per task; the agentic environment in the loop), sampled at temperature 1 without top-k/top-p
with the config's seed. Prints per task pass@1 with its standard error and the entropy of the
sampled positions (mean, fraction above 0.5 nats; bebop_jax.evaluation.entropy_stats), and
writes them to --out (JSON) when given. The SFT stage reports the same quantities on
eval.num_examples prompts.

For comparison it also reports the entropy of the demonstrations themselves: per problem,
--demo_samples paths from `task.demonstration` (the config's diversity knobs), and at every
policy position of every path the entropy of the next token among the paths sharing its
prefix (a plug-in estimate, biased low for few samples), averaged over --demo_problems
training problems. The policy's entropy above it is its own uncertainty.
"""

from __future__ import annotations

import json

from absl import app, flags
from ml_collections import config_flags

from bebop_jax import evaluation
from bebop_jax import tasks as tasks_lib
from bebop_jax.stages import config as config_lib
from bebop_jax.stages import lineage
from bebop_jax.stages import sft

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir holding an SFT checkpoint.")
_NUM = flags.DEFINE_integer("num_examples", 256, "Held-out prompts per task.")
_OUT = flags.DEFINE_string("out", None, "Optional JSON output path.")
_DEMO_SAMPLES = flags.DEFINE_integer("demo_samples", 64, "Sampled paths per problem.")
_DEMO_PROBLEMS = flags.DEFINE_integer("demo_problems", 30, "Problems for the demonstration "
                                      "entropy (task.sample(0..N-1)).")


def main(argv):
  del argv
  config = _CONFIG.value
  graphdef, params = lineage.restore_policy(config, _WORKDIR.value, stage="sft")
  rollouts = sft.heldout_rollouts(config, graphdef, params, num_examples=_NUM.value,
                                  seed=config.seed)
  names = list(rollouts)
  tok = config_lib.settings(config).data.loaded_tokenizer
  task_objs = {n: tasks_lib.get_task(n, **config.data.tasks[n].knobs) for n in names}
  entropy = evaluation.entropy_stats(rollouts)
  results = {}
  print("| task | pass@1 | policy entropy (nats) | above 0.5 nats | demonstration entropy "
        "(nats) | above 0.5 nats |")
  print("|---|---|---|---|---|---|")
  for n in names:
    rewards = rollouts[n].rewards
    solved = tasks_lib.solved(rewards).astype(float)
    demo = evaluation.demonstration_entropy(
        task_objs[n], [task_objs[n].sample(i) for i in range(_DEMO_PROBLEMS.value)],
        _DEMO_SAMPLES.value, tokenizer=tok)
    results[n] = {"pass_at_1": float(solved.mean()),
                  "pass_at_1_se": evaluation.standard_error(solved),
                  "mean_reward": float(rewards.mean()),
                  "entropy": entropy[n], "demonstration_entropy": demo}
    print(f"| {n} | {solved.mean():.3f} ± {results[n]['pass_at_1_se']:.3f} | "
          f"{entropy[n]['mean']:.3f} | {100 * entropy[n]['above_threshold']:.1f}% | "
          f"{demo['mean']:.3f} | {100 * demo['above_threshold']:.1f}% |")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
