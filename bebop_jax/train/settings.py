"""Typed settings of the training stages (bebop_jax.settings_base): a stage's optimizer
(`OptimSettings`, bebop_jax.train.optimizer) and loop (`LoopSettings`,
bebop_jax.train.trainer), `config.sft` (bebop_jax.stages.sft) and `config.mtp`
(bebop_jax.stages.mtp)."""

from __future__ import annotations

import dataclasses
import json
import os

from pallas_kernels import tv_loss

from bebop_jax.losses import head as head_lib
from bebop_jax.losses import mtp as mtp_losses
from bebop_jax.model import drafter_init
from bebop_jax.model import hf
from bebop_jax.model.config import ModelConfig
from bebop_jax.settings_base import (ConfigError, Section, choice, count, flag, is_number,
                                     subset, nested, positive_int, setting)
from bebop_jax.train import optimizer


@dataclasses.dataclass(frozen=True)
class OptimSettings(Section):
  """A training stage's optimizer: AdamW, warmup then decay, global-norm clipping."""
  KEY = "optim"
  learning_rate: float = setting(3e-3, "peak learning rate (after warmup)",
                                 allowed="must be a number > 0",
                                 check=lambda v: is_number(v) and v > 0)
  warmup_steps: int = count(50, "steps of linear warmup from 0 to the peak")
  decay: str = choice("cosine", "the schedule after warmup, down to the peak x end_lr_fraction "
                      "at the last step", optimizer.DECAYS)
  end_lr_fraction: float = setting(0.1, "the last step's learning rate as a fraction of the "
                                   "peak (cosine, linear)", allowed="must be in [0, 1]",
                                   check=lambda v: is_number(v) and 0 <= v <= 1)
  weight_decay: float = setting(0.01, "AdamW weight decay (not on norm scales)")
  b1: float = setting(0.9, "AdamW decay of the first moment")
  b2: float = setting(0.95, "AdamW decay of the second moment")
  clip_norm: float = setting(1.0, "gradients are clipped to this global norm (<= 0: off)")
  trainable: str = choice("all", "the parameters the stage trains: all, mtp (the MTP "
                          "modules) or main (the rest)", optimizer.TRAINABLE)


@dataclasses.dataclass(frozen=True)
class LoopSettings(Section):
  """A training stage's loop: steps, logging, evaluation and checkpoints."""
  KEY = "train"
  num_steps: int = positive_int(1000, "optimizer steps of the stage")
  grad_accum_steps: int = positive_int(1, "micro-batches per step, each an equal share of "
                                       "the batch")
  log_every: int = positive_int(20, "steps between metric log lines")
  eval_every: int = count(0, "steps between evaluations", note=" (0 = at the end)")
  checkpoint_every: int = positive_int(200, "steps between checkpoints")
  keep_checkpoints: int = positive_int(2, "checkpoints kept on disk (the newest)")
  progress: bool = setting(True, "a progress bar with ETA on the terminal")
  stop_at_step: int = count(0, "> 0: checkpoint and stop there, as if preempted (a rerun "
                            "resumes)", note=" (0 = off)")


@dataclasses.dataclass(frozen=True)
class SFTSettings(Section):
  """config.sft: the SFT stage (bebop_jax.stages.sft), trunk and MTP modules jointly."""
  KEY = "sft"
  optim: OptimSettings = nested(lambda: OptimSettings(key="sft.optim"))
  train: LoopSettings = nested(lambda: LoopSettings(key="sft.train"))
  mtp_loss_weight: float = setting(0.3, "lambda of the joint MTP cross-entropy; 0 = off",
                                   allowed="must be a number >= 0",
                                   check=lambda v: is_number(v) and v >= 0)
  head: str = choice("fused", "bebop_jax.losses.head.HEADS: fused never makes [B, T, V] "
                     "logits (pallas_kernels.fused_head); dense: the logits", head_lib.HEADS)
  init_from_hf: str = setting(
      "", "a Hugging Face Qwen3 checkpoint directory; '' = random init",
      allowed="a Hugging Face checkpoint directory with config.json and *.safetensors "
      "('' = none), its decoder that of config.model")
  hf_mtp: str = choice("auto", "the checkpoint's MTP modules: bebop_jax.model.hf.MTP_MODES",
                       hf.MTP_MODES)

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.init_from_hf, str):
      self.fail("init_from_hf", "must be a checkpoint directory ('' = none)")
    if self.init_from_hf and not os.path.exists(self._hf_config_path):
      self.fail("init_from_hf", "a Hugging Face checkpoint directory with config.json and "
                f"*.safetensors; {self._hf_config_path} does not exist")

  @property
  def _hf_config_path(self) -> str:
    return os.path.join(self.init_from_hf, "config.json")

  def check_checkpoint(self, model: ModelConfig) -> None:
    """init_from_hf's config.json describes `model`'s decoder (a check across sections)."""
    if not self.init_from_hf:
      return
    with open(self._hf_config_path) as f:
      try:
        checkpoint = hf.config_from_hf(json.load(f), num_mtp_modules=model.num_mtp_modules,
                                       num_draft_steps=model.num_draft_steps)
        if model.vocab_size > checkpoint.vocab_size:  # grown on import (hf.import_checkpoint)
          checkpoint = dataclasses.replace(checkpoint, vocab_size=model.vocab_size)
        hf.check_matches(checkpoint, model, f"config.sft.init_from_hf={self.init_from_hf!r}")
      except (ValueError, KeyError) as e:
        raise ConfigError(f"config.sft.init_from_hf={self.init_from_hf!r}: {e}") from e


@dataclasses.dataclass(frozen=True)
class WarmStartSettings(Section):
  """config.mtp.warm_start: warm_start.loss for warm_start.steps steps, then mtp.loss to
  train.num_steps (docs/mtp.md: e2e-TV's gradient at a depth is scaled by the other depths'
  acceptance, ~0 for a drafter that starts cold)."""
  KEY = "mtp.warm_start"
  loss: str = choice("kl", "the loss of the first warm_start.steps steps",
                     mtp_losses.LOSSES)
  steps: int = count(0, "steps trained with warm_start.loss before mtp.loss")


@dataclasses.dataclass(frozen=True)
class MTPDataSettings(Section):
  """config.mtp.data: the frozen policy's rollouts the drafter trains on."""
  KEY = "mtp.data"
  num_prompts: int = positive_int(1024, "training prompts (split over tasks by data weights)")
  max_new_tokens: int = positive_int(160, "completion budget of a rollout (replies included)")
  batch_size: int = positive_int(64, "rollout batch")
  engine: str = choice("autoregressive", "how the rollouts are sampled (the same law either "
                       "way; an untrained drafter makes speculative slower)",
                       ("autoregressive", "speculative"))


def _depth_weights_ok(w) -> bool:
  return isinstance(w, (tuple, list)) and (not w or (
      all(is_number(x) and x >= 0 for x in w) and sum(w) > 0))


@dataclasses.dataclass(frozen=True)
class MTPSettings(Section):
  """config.mtp: the MTP stage (bebop_jax.stages.mtp), the drafter trained on the frozen SFT
  policy's rollouts."""
  KEY = "mtp"
  loss: str = choice("e2e_tv", "the drafter's loss: bebop_jax.losses.mtp.LOSSES",
                     mtp_losses.LOSSES)
  depth_weights: tuple[float, ...] = setting(
      (), "K weights of the per-depth terms; () = uniform",
      allowed="() or model.num_draft_steps numbers >= 0 (one per depth) with a positive sum",
      check=_depth_weights_ok)
  head: str = choice("fused", "bebop_jax.losses.mtp.HEADS: fused never makes [K, B, T, V] "
                     "logits (pallas_kernels.fused_head); dense: the TV kernel",
                     mtp_losses.HEADS)
  tv_implementation: str = choice("auto", "the TV kernel: auto or one of "
                                  "pallas_kernels.tv_loss.IMPLEMENTATIONS",
                                  ("auto",) + tuple(tv_loss.IMPLEMENTATIONS))
  tv_interpret: bool = flag(False, "run the Pallas TV kernels in interpret mode (on CPU)",
                            allowed="True or False")
  temperature: float = setting(1.0, "rollouts are sampled, and distributions compared, at "
                               "this temperature", allowed="must be a number > 0",
                               check=lambda v: is_number(v) and v > 0)
  init_from: str = setting("", "workdir holding the SFT stage; '' = this workdir",
                           allowed="must be a path ('' = this workdir)",
                           check=lambda v: isinstance(v, str))
  init: str = choice("sft", "the drafter it starts from: bebop_jax.model.drafter_init.INITS "
                     "(sft: the checkpoint's, e.g. trained jointly with SFT; fresh: random; "
                     "copy_last_block: the trunk's last layer)", drafter_init.INITS)
  drafter_from: str = setting(
      "", "workdir of a completed MTP stage on the same SFT policy whose drafter this stage "
      "starts from (a warm start shared by several runs, e.g. the objectives of one "
      "comparison); '' = mtp.init", allowed="must be a path ('' = mtp.init)",
      check=lambda v: isinstance(v, str))
  proj_init: str = choice("random", "copy_last_block's projection: "
                          "bebop_jax.model.drafter_init.PROJ_INITS", drafter_init.PROJ_INITS)
  seed: int = count(0, "the drafter's initialisation (fresh) and data order; the policy's "
                    "rollouts stay the same")
  warm_start: WarmStartSettings = nested(WarmStartSettings)
  batch_size: int = positive_int(16, "packed rows of mtp.seq_len per step")
  seq_len: int = count(0, "packed row length", note=" (0 = data.seq_len)")
  features: str = choice("cached", "the frozen trunk's h0: cached (computed once per dataset "
                         "into the drafter store) or in_step (every step runs it)",
                         ("cached", "in_step"))
  features_batch_size: int = positive_int(16, "rows per forward when computing the cached "
                                          "features")
  draft_vocab: int = setting(
      0, "> 0: the drafter drafts from its this-many most frequent policy tokens "
      "(decoding/draft_vocab.py), stored with it",
      allowed="an int in [0, model.vocab_size] (0 = the whole head)",
      check=lambda v: isinstance(v, int) and v >= 0)
  eval_modes: tuple[str, ...] = subset(("rejection", "greedy_draft"),
                                      "verification modes the drafter is measured in",
                                      ("rejection", "greedy_draft", "strict"))
  eval_before: bool = flag(True, "also measure the initial drafter, for comparison")
  eval_before_online: bool = flag(True, "... by speculative decoding too (else "
                                  "teacher-forced only)")
  eval_online: bool = flag(True, "measure the trained drafter by speculative decoding too")
  data: MTPDataSettings = nested(MTPDataSettings)
  optim: OptimSettings = nested(lambda: OptimSettings(
      learning_rate=2e-3, warmup_steps=20, trainable="mtp", key="mtp.optim"))
  train: LoopSettings = nested(lambda: LoopSettings(
      num_steps=300, log_every=25, checkpoint_every=100, key="mtp.train"))

  def __post_init__(self):
    super().__post_init__()
    if self.batch_size % self.train.grad_accum_steps:
      self.train.fail("grad_accum_steps", f"must divide mtp.batch_size={self.batch_size}")
