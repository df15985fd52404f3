"""Typed settings of `config.rl` (bebop_jax.settings_base): the RL stage (bebop_jax.stages.rl),
its rollouts, its drafter, where it runs (bebop_jax.rl.placement) and asynchronous RL
(bebop_jax.rl.async_loop)."""

from __future__ import annotations

import dataclasses

from bebop_jax import rl
from bebop_jax import rollout as rollout_lib
from bebop_jax.losses import mtp as mtp_losses
from bebop_jax.rl import placement as placement_lib
from bebop_jax.settings_base import (ConfigError, Section, choice, count, flag, int_at_least,
                                     is_number, subset, nested, number_at_least, positive_int,
                                     setting)
from bebop_jax.sharding import MeshSettings
from bebop_jax.train.settings import LoopSettings, OptimSettings


@dataclasses.dataclass(frozen=True)
class RLRolloutSettings(Section):
  """config.rl.rollout: how the policy samples its training rollouts (bebop_jax.rollout)."""
  KEY = "rl.rollout"
  engine: str = choice("speculative", "speculative (the policy verifies its own MTP drafts) "
                       "or autoregressive (bebop_jax.rollout.ENGINES)", rollout_lib.ENGINES)
  mode: str = choice("rejection", "speculative verification "
                     "(bebop_jax.rollout.VERIFICATION_MODES)", rollout_lib.VERIFICATION_MODES)
  temperature: float = setting(
      1.0, "sampling temperature of the rollouts (and of their behaviour log-probs)",
      allowed="must be a number > 0 (RL samples; greedy rollouts have no policy gradient)",
      check=number_at_least(0, strict=True))
  top_k: int = count(0, "sample from the k most likely tokens", note=" (0 = off)")
  top_p: float = setting(1.0, "sample from the smallest set of tokens holding this much "
                         "probability", allowed="must be in (0, 1]",
                         check=lambda v: 0 < v <= 1)
  num_draft_steps: int = setting(
      0, "K drafts per verification; 0 = the model's",
      allowed="an int in [0, model.num_draft_steps] (0 = all of them)",
      check=lambda v: isinstance(v, int) and v >= 0)
  max_new_tokens: int = positive_int(160, "completion budget (policy turns and replies)")
  batch_size: int = positive_int(32, "rows per decoding call")
  draft_vocab: int = setting(
      0, "a reduced draft vocabulary: the drafter's V most frequent training tokens (and the "
      "stop tokens); 0 = the drafter's own (mtp.draft_vocab; the whole head when it has "
      "none) (decoding/draft_vocab.py)",
      allowed="an int in [0, model.vocab_size] (0 = the whole head)",
      check=lambda v: isinstance(v, int) and v >= 0)


@dataclasses.dataclass(frozen=True)
class RLMTPSettings(Section):
  """config.rl.mtp: the drafter during RL."""
  KEY = "rl.mtp"
  strategy: str = choice("frozen", "frozen (the paper's recipe), online (an MTP-only update "
                         "on each batch's rollouts) or periodic (every `every` steps, on the "
                         "rollouts since)", ("frozen", "online", "periodic"))
  loss: str = choice("e2e_tv", "the drafter's loss: bebop_jax.losses.mtp.LOSSES",
                     mtp_losses.LOSSES)
  every: int = positive_int(5, "periodic: steps between updates")
  optim: OptimSettings = nested(lambda: OptimSettings(
      learning_rate=1e-3, warmup_steps=0, decay="constant", trainable="mtp",
      key="rl.mtp.optim"))

  def __post_init__(self):
    super().__post_init__()
    if self.optim.trainable != "mtp":
      self.optim.fail("trainable", "must be 'mtp' (MTP-only updates)")


@dataclasses.dataclass(frozen=True)
class PlacementSettings(Section):
  """config.rl.placement: where the learner and the rollouts run (bebop_jax.rl.placement).
  With mode 'split' the device counts and the sub-meshes are checked against the devices by
  `learner_data_parallel` (across sections: bebop_jax.settings)."""
  KEY = "rl.placement"
  mode: str = choice("colocated", "colocated (the learner on config.mesh, rollouts on the "
                     "first device) or split into two disjoint sub-meshes",
                     placement_lib.MODES)
  learner_devices: float = setting(
      0.5, "split: a count (>= 1) or a fraction in (0, 1) of the devices",
      allowed="checked with rl.placement.mode='split' against the devices "
      "(bebop_jax/rl/placement.py)")
  rollout_devices: float = setting(
      0.0, "split: the same; 0 = the rest",
      allowed="checked with rl.placement.mode='split' against the devices "
      "(bebop_jax/rl/placement.py)")
  learner_mesh: MeshSettings = nested(lambda: MeshSettings(key="rl.placement.learner_mesh"))
  rollout_mesh: MeshSettings = nested(lambda: MeshSettings(key="rl.placement.rollout_mesh"))

  def learner_data_parallel(self, num_devices: int, colocated: int) -> int:
    """The learner's data-parallel size over `num_devices` devices (`colocated`: that of
    config.mesh, the learner's mesh unless split)."""
    if self.mode != "split":
      return colocated
    try:
      learner, rollouts = placement_lib.split_devices(
          self.learner_devices, self.rollout_devices, list(range(num_devices)))
    except placement_lib.PlacementError as e:
      raise ConfigError(f"config.{e}") from e
    sizes = self.learner_mesh.sizes(len(learner))
    self.rollout_mesh.sizes(len(rollouts))
    return self.learner_mesh.data_parallel(sizes)[0]


@dataclasses.dataclass(frozen=True)
class AsyncSettings(Section):
  """config.rl.asynchronous (bebop_jax.rl.async_loop): a rollout thread fills a bounded queue
  while the learner trains; off = the synchronous loop. (Not "async": a Python keyword
  cannot be a --config.rl.<key> override path.)"""
  KEY = "rl.asynchronous"
  enabled: bool = flag(False, "asynchronous RL (False: the synchronous loop)")
  max_staleness: int = count(1, "eta: no batch is sampled more than eta versions back",
                             note=" (0 = on-policy)")
  queue_size: int = count(0, "batches ready ahead of the learner",
                          note=" (0 = max_staleness + 1)")
  interrupt: bool = flag(False, "swap in new weights between a batch's decoding calls")
  off_policy: str = choice("decoupled", "decoupled PPO (proximal log-probs recomputed) or "
                           "none", ("decoupled", "none"))
  is_cap: float = setting(2.0, "cap of the behaviour weight exp(proximal - behaviour)",
                          allowed="must be a number > 0", check=number_at_least(0, True))
  is_mode: str = choice("cap", "cap the weight at is_cap, or mask tokens above it",
                        ("cap", "mask"))
  max_restarts: int = count(3, "consecutive rollout-thread failures before giving up")


@dataclasses.dataclass(frozen=True)
class RLEvalSettings(Section):
  """config.rl.eval: held-out evaluation before, every rl.train.eval_every steps and after:
  pass@1 per task and acceptance per depth, speculative at the rollout temperature, in each
  mode."""
  KEY = "rl.eval"
  num_examples: int = positive_int(64, "held-out prompts per task")
  modes: tuple[str, ...] = subset(("rejection", "greedy_draft"), "verification modes of the "
                                 "evaluation", rollout_lib.VERIFICATION_MODES)


@dataclasses.dataclass(frozen=True)
class RLSettings(Section):
  """config.rl: GRPO on speculative rollouts of the policy from the MTP stage (or the SFT
  stage when there is none)."""
  KEY = "rl"
  init_from: str = setting("", "workdir holding the sft (and mtp) stages; '' = this one",
                           allowed="must be a path ('' = this workdir)",
                           check=lambda v: isinstance(v, str))
  prompts_per_batch: int = positive_int(8, "prompts per RL step ...")
  group_size: int = positive_int(4, "... each sampled this many times (consecutive rows)")
  max_prompt_len: int = positive_int(128, "longer training prompts are an error")
  advantage: str = choice("grpo", "group-relative advantages: bebop_jax.rl.ADVANTAGE_MODES",
                          rl.ADVANTAGE_MODES)
  dynamic_sampling: bool = flag(False, "drop groups whose rewards are all equal (DAPO)")
  clip_low: float = setting(0.2, "ratios below 1 - clip_low are clipped",
                            allowed="must be a number in [0, 1)",
                            check=lambda v: is_number(v) and 0 <= v < 1)
  clip_high: float = setting(0.2, "ratios above 1 + clip_high are clipped",
                             allowed="must be a number >= 0", check=number_at_least(0))
  aggregation: str = choice("token-mean", "how token losses are averaged: "
                            "bebop_jax.rl.AGGREGATIONS", rl.AGGREGATIONS)
  kl_coef: float = setting(0.0, "> 0: k3 KL to the frozen initial policy",
                           allowed="must be a number >= 0 (0 = no KL term)",
                           check=number_at_least(0))
  entropy_coef: float = setting(0.0, "> 0: an entropy bonus (the policy's entropy rises)",
                                allowed="must be a number >= 0 (0 = no bonus)",
                                check=number_at_least(0))
  head: str = choice(
      "fused", "the learner's log-probs, entropies and reference log-probs: fused (no "
      "[B, T, V] logits; pallas_kernels.fused_head) or dense. With rollout top_k / top_p "
      "truncation (or temperature 0) the learner uses dense logits whatever this says, with "
      "a warning", mtp_losses.HEADS)
  epochs: int = positive_int(1, "passes of learner updates over each batch ...")
  minibatches: int = positive_int(1, "... each pass split into this many updates")
  packing: bool = flag(True, "pack each update's rollouts into full-length rows")
  overlong: str = choice(
      "mask", "completions cut by the length budget (no end of sequence): keep trains on "
      "them as sampled; mask leaves them out of the loss (DAPO's overlong filtering); "
      "penalty adds DAPO's soft overlong punishment, 0 up to max_new_tokens - "
      "overlong_buffer tokens, then falling linearly to -1 at the budget, to every "
      "rollout's reward", rl.OVERLONG_MODES)
  overlong_buffer: int = setting(
      32, "penalty: the punished tail of the budget, in tokens",
      allowed="an int in [1, rl.rollout.max_new_tokens] (the punished tail of the budget "
      "with rl.overlong='penalty')")
  rollout: RLRolloutSettings = nested(RLRolloutSettings)
  acceptance_modes: tuple[str, ...] = subset(
      ("rejection", "greedy_draft"), "teacher-forced acceptance on each batch, in these "
      "verification modes", rollout_lib.VERIFICATION_MODES, non_empty=False)
  optim: OptimSettings = nested(lambda: OptimSettings(
      learning_rate=3e-4, warmup_steps=0, decay="constant", weight_decay=0.0,
      trainable="main", key="rl.optim"))
  train: LoopSettings = nested(lambda: LoopSettings(
      num_steps=50, log_every=1, eval_every=0, checkpoint_every=10, key="rl.train"))
  mtp: RLMTPSettings = nested(RLMTPSettings)
  placement: PlacementSettings = nested(PlacementSettings)
  asynchronous: AsyncSettings = nested(AsyncSettings)
  eval: RLEvalSettings = nested(RLEvalSettings)

  def __post_init__(self):
    super().__post_init__()
    if self.group_size < 2:
      self.fail("group_size", f"must be >= 2 with rl.advantage={self.advantage!r}: "
                "group-relative advantages of one rollout per prompt are all 0")
    budget = self.rollout.max_new_tokens
    if not int_at_least(1, bools=True)(self.overlong_buffer) or (
        self.overlong == "penalty" and self.overlong_buffer > budget):
      self.fail("overlong_buffer", f"an int in [1, rl.rollout.max_new_tokens={budget}] (the "
                "punished tail of the budget with rl.overlong='penalty')")
    a = self.asynchronous
    if a.enabled and a.interrupt and self.rollout.batch_size < self.group_size:
      self.rollout.fail("batch_size", f"must be >= rl.group_size={self.group_size} with "
                        "rl.asynchronous.interrupt: weights change between decoding calls, "
                        "and a call must hold whole groups so that one version samples "
                        "every rollout of a prompt")
    if self.rows % self.minibatches:
      self.fail("minibatches", "must divide the batch of rl.prompts_per_batch x "
                f"rl.group_size = {self.rows} rollouts")
    if self.optim.trainable != "main":
      self.optim.fail("trainable", "must be 'main' (the policy update trains the trunk; the "
                      "drafter is rl.mtp's)")

  @property
  def rows(self) -> int:
    """Rollouts per step: prompts_per_batch x group_size."""
    return self.prompts_per_batch * self.group_size

  def check_data_parallel(self, data_parallel: int) -> None:
    """A step's rollouts, and each update's, split over the learner's data-parallel size (a
    check across sections)."""
    update_rows = self.rows // self.minibatches
    accum = self.train.grad_accum_steps
    if update_rows % (data_parallel * accum):
      self.fail("minibatches", f"each update's {update_rows} rollouts must split over the "
                f"data-parallel size {data_parallel} x rl.train.grad_accum_steps={accum}")
    if self.rows % data_parallel:
      self.fail("prompts_per_batch", f"the {self.rows} rollouts of a step must split over "
                f"the data-parallel size {data_parallel}")
