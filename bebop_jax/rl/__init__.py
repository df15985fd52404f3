"""RL post-training: GRPO-family algorithms (pure functions), the learner and the RL stage.

`bebop_jax.rl.advantages(rewards, group_size, mode)` and
`bebop_jax.rl.policy_loss(logprobs, behaviour_logprobs, advantages, mask, ...)` are the
algorithms (algorithms.py); learner.py builds learner batches from rollouts and the jitted
update; placement.py puts the learner and the rollouts on one mesh or two sub-meshes;
async_loop.py is the weight store and the rollout thread of asynchronous RL; stage.py is the
`rl` stage of bebop_jax.main; aot.py compiles both RL programs ahead of time on a
(simulated) split pod. The four-arm speed benchmark, which runs the stage, is
experiments/rl_benchmark.py.
"""

from bebop_jax.rl.algorithms import (ADVANTAGE_MODES, AGGREGATIONS, advantages,
                                     aggregation_weights, dynamic_sampling_mask, k3_kl,
                                     overlong_penalty, policy_loss, OVERLONG_MODES)

__all__ = ["ADVANTAGE_MODES", "AGGREGATIONS", "advantages", "aggregation_weights",
           "dynamic_sampling_mask", "k3_kl", "overlong_penalty", "policy_loss", "OVERLONG_MODES"]
