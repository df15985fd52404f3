"""Typed settings of `config.decoding`: the adaptive draft length (decoding/adaptive.py) as
`adaptive.Settings`, which checks its own ranges; `check_adaptive` makes the checks of
config.decoding.adaptive that it does not (bebop_jax.settings_base)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from bebop_jax.decoding import adaptive
from bebop_jax.settings_base import Row, fail, in_unit_interval, int_at_least, is_int

_BOOL = "must be True or False"

# config.decoding.adaptive: {key: (type, doc, allowed, the check adaptive.Settings lacks)}.
ADAPTIVE_KEYS: dict[str, tuple[str, str, str, Any]] = {
    "enabled": ("bool", "adaptive decoding in the RL rollouts, the evaluation stage and "
                "bench_decode.py (--adaptive)", _BOOL, lambda v: isinstance(v, bool)),
    "k_max": ("int", "the most drafts; 0 = model.num_draft_steps",
              "an int in [0, model.num_draft_steps] (0 = all of them)", int_at_least(0)),
    "smoothing": ("float", "EMA weight of each segment's observed acceptance",
                  "must be in (0, 1]", in_unit_interval),
    "calibrate": ("bool", "measure the cost table in-process; False: model it from weight "
                  "reads", _BOOL, lambda v: isinstance(v, bool)),
    "segment": ("int", "iterations between decisions (doubling while K holds)",
                "must be a positive int", int_at_least(1)),
    "batch_factor": ("int", "finished rows leave: batches B, then the powers of this below "
                     "it", "must be an int >= 2", is_int),  # adaptive.Settings: >= 2
}


def check_adaptive(values: Mapping[str, Any], num_draft_steps: int,
                   key: str = "decoding.adaptive") -> None:
  """The checks of config.decoding.adaptive (`values`) that adaptive.Settings does not make:
  the types, smoothing, and k_max against the model's depths (k_max 0 means all of them)."""
  for name, (_, _, allowed, check) in ADAPTIVE_KEYS.items():
    value, ok = values[name], check(values[name])
    if name == "k_max":
      ok = ok and value <= num_draft_steps
      allowed = f"an int in [0, {num_draft_steps}] (model.num_draft_steps; 0 = all of them)"
    if not ok:
      fail(f"{key}.{name}", value, allowed)


@dataclasses.dataclass(frozen=True)
class AdaptiveDecoding:
  """config.decoding.adaptive: whether adaptive decoding is on, and its settings (k_max 0
  resolved to the model's depths)."""
  enabled: bool
  settings: adaptive.Settings

  def __post_init__(self):
    if not isinstance(self.enabled, bool):
      fail("decoding.adaptive.enabled", self.enabled, _BOOL)

  def when_enabled(self) -> adaptive.Settings | None:
    return self.settings if self.enabled else None


@dataclasses.dataclass(frozen=True)
class DecodingSettings:
  """config.decoding: the adaptive draft length (decoding/adaptive.py), K in 0..k_max chosen
  before every segment of iterations from live per-depth acceptance and a measured cost
  table; K = 0 is the autoregressive step."""
  adaptive: AdaptiveDecoding


def reference_rows() -> dict[str, Row]:
  return {f"decoding.adaptive.{name}": Row(tp, doc, allowed)
          for name, (tp, doc, allowed, _) in ADAPTIVE_KEYS.items()}
