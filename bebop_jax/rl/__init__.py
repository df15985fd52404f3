"""RL post-training: GRPO-family algorithms (pure functions), the learner and the RL stage.

`bebop_jax.rl.advantages(rewards, group_size, mode)` and
`bebop_jax.rl.policy_loss(logprobs, behaviour_logprobs, advantages, mask, ...)` are the
algorithms (algorithms.py); learner.py builds learner batches from rollouts and the jitted
update; stage.py is the `rl` stage of bebop_jax.main.
"""

from bebop_jax.rl.algorithms import (ADVANTAGE_MODES, AGGREGATIONS, advantages,
                                     aggregation_weights, dynamic_sampling_mask, k3_kl,
                                     policy_loss)

__all__ = ["ADVANTAGE_MODES", "AGGREGATIONS", "advantages", "aggregation_weights",
           "dynamic_sampling_mask", "k3_kl", "policy_loss"]
