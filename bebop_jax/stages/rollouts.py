"""The config's rollout sections as the library's settings: held-out evaluation
(`config.eval`), RL rollouts (`config.rl.rollout`) and adaptive drafting
(`config.decoding.adaptive`). The one place a ConfigDict becomes rollout.RolloutSettings or
adaptive.Settings."""

from __future__ import annotations

from typing import Any

from bebop_jax.decoding import adaptive
from bebop_jax.rollout import RolloutSettings


def adaptive_settings(config: Any) -> adaptive.Settings:
  """config.decoding.adaptive as Settings (k_max 0: model.num_draft_steps)."""
  a = config.decoding.adaptive
  return adaptive.Settings(k_max=a.k_max or config.model.num_draft_steps,
                           smoothing=float(a.smoothing), calibrate=a.calibrate,
                           segment=a.segment,
                           max_segment=max(a.segment, adaptive.Settings.max_segment),
                           batch_factor=a.batch_factor)


def eval_settings(config: Any, **overrides) -> RolloutSettings:
  """Rollout settings of held-out evaluation from `config.eval` (temperature 1 unless
  overridden), with `overrides` (RolloutSettings fields)."""
  e = config.eval
  kw = dict(temperature=1.0, top_k=e.top_k, top_p=e.top_p, max_new_tokens=e.max_new_tokens,
            batch_size=e.batch_size, prompt_buckets=tuple(e.prompt_buckets))
  kw.update(overrides)
  return RolloutSettings(**kw)


def rl_settings(config: Any, seeds=None, **overrides) -> RolloutSettings:
  """config.rl.rollout (and config.decoding.adaptive) as RolloutSettings; `seeds`:
  `drafter_acceptance`'s {mode: acceptance}, the adaptive estimate's seed by mode."""
  r = config.rl.rollout
  kw = dict(engine=r.engine, mode=r.mode, temperature=r.temperature, top_k=r.top_k,
            top_p=r.top_p, num_draft_steps=r.num_draft_steps or None,
            max_new_tokens=r.max_new_tokens, batch_size=r.batch_size,
            prompt_buckets=tuple(config.eval.prompt_buckets),
            adaptive=(adaptive_settings(config)
                      if config.decoding.adaptive.enabled else None))
  kw.update(overrides)
  if kw["adaptive"] is not None and seeds:
    kw.setdefault("acceptance", seeds.get(kw["mode"]))
  return RolloutSettings(**kw)
