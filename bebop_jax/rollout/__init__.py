"""One rollout engine for evaluation, MTP self-distillation and RL (see base.py)."""

from bebop_jax.rollout.base import (ENGINES, VERIFICATION_MODES, RolloutEngine, Rollouts,
                                    RolloutSettings, rollouts_from_episodes)
from bebop_jax.rollout.engine import JaxEngine
from bebop_jax.rollout.mock import MockEngine

__all__ = ["ENGINES", "VERIFICATION_MODES", "JaxEngine", "MockEngine", "RolloutEngine",
           "Rollouts", "RolloutSettings", "rollouts_from_episodes"]
