"""The typed settings of a whole config: `Settings`, one frozen dataclass with a field per
config section, each section's own dataclass next to the code it configures:

  data, preview      bebop_jax/data/settings.py
  model              bebop_jax/model/config.py (ModelConfig)
  mesh               bebop_jax/sharding.py (MeshSettings)
  sft, mtp           bebop_jax/train/settings.py
  rl                 bebop_jax/rl/settings.py
  decoding           bebop_jax/decoding/settings.py (decoding/adaptive.py's Settings)
  eval, report       bebop_jax/eval_settings.py

Building a section checks it (bebop_jax.settings_base); building `Settings` then makes the
checks that span sections, `check_across_sections`. `bebop_jax.config.settings(config)`
builds one from a ConfigDict; `reference_rows()` documents every key (docs/configs.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

import jax

from bebop_jax import eval_settings
from bebop_jax import settings_base
from bebop_jax.data import settings as data_settings
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.decoding import adaptive
from bebop_jax.decoding import settings as decoding_settings
from bebop_jax.model import config as model_config
from bebop_jax.rl import settings as rl_settings
from bebop_jax.settings_base import Row, Section, nested, setting
from bebop_jax.sharding import MeshSettings
from bebop_jax.train import settings as train_settings

STAGES = ("data", "sft", "mtp", "rl", "eval")  # stages of bebop_jax.main, run in this order


def _stages_ok(stages) -> bool:
  return (isinstance(stages, (tuple, list)) and bool(stages)
          and all(s in STAGES for s in stages) and len(set(stages)) == len(stages))


def _default_decoding() -> decoding_settings.DecodingSettings:
  k = model_config.PRESETS["tiny"]["num_draft_steps"]  # k_max 0: the default model's depths
  return decoding_settings.DecodingSettings(
      decoding_settings.AdaptiveDecoding(False, adaptive.Settings(k_max=k)))


@dataclasses.dataclass(frozen=True)
class Settings(Section):
  """A whole config, checked (bebop_jax.config.settings)."""
  seed: int = setting(0, "seed of the run's initialisation, data order and sampling",
                      allowed="must be an int", check=lambda v: isinstance(v, int))
  stages: tuple[str, ...] = setting(
      ("data",), f"stages of bebop_jax.main to run, in the order {STAGES}",
      allowed=f"must be a non-empty tuple of distinct stages from {STAGES}", check=_stages_ok)
  data: data_settings.DataSettings = nested(data_settings.DataSettings)
  model: model_config.ModelConfig = nested(lambda: model_config.preset("tiny"))
  mesh: MeshSettings = nested(MeshSettings)
  preview: data_settings.PreviewSettings = nested(data_settings.PreviewSettings)
  sft: train_settings.SFTSettings = nested(train_settings.SFTSettings)
  mtp: train_settings.MTPSettings = nested(train_settings.MTPSettings)
  rl: rl_settings.RLSettings = nested(rl_settings.RLSettings)
  decoding: decoding_settings.DecodingSettings = nested(_default_decoding)
  report: eval_settings.ReportSettings = nested(eval_settings.ReportSettings)
  eval: eval_settings.EvalSettings = nested(eval_settings.EvalSettings)

  def __post_init__(self):
    super().__post_init__()
    check_across_sections(self)


def check_across_sections(s: Settings) -> None:
  """The checks that span sections (and the devices): batches against data.shards and the
  data-parallel sizes, the vocabulary against the tokenizer and the drafts against the
  model, the checkpoint against the model, the prompt buckets against the budgets.

  Raises:
    ConfigError: naming the key, its value and what is allowed.
  """
  for section, name in ((s.mtp, "batch_size"), (s.rl, "prompts_per_batch")):
    value = getattr(section, name)
    if s.data.shards and value % s.data.shards:
      section.fail(name, f"must be a multiple of data.shards={s.data.shards} (each shard "
                   "gives an equal share of a batch)")

  tok, model = s.data.loaded_tokenizer, s.model
  if model.vocab_size < tok.vocab_size:
    source = "" if s.data.tokenizer == tokenizer_lib.CHAR else (
        f" (data.tokenizer={s.data.tokenizer!r}: {tok.num_used} tokens padded to a multiple "
        "of 128)")
    settings_base.fail("model.vocab_size", model.vocab_size,
                       f"must be >= the tokenizer's {tok.vocab_size}{source}")

  sizes = s.mesh.sizes()
  data_parallel, batch_axes = s.mesh.data_parallel(sizes)
  for section in (s.data, s.mtp):
    if section.batch_size % data_parallel:
      section.fail("batch_size", f"must be a multiple of the data-parallel size "
                   f"{data_parallel} (mesh axes {batch_axes} of mesh {sizes})")
  if s.data.batch_size % s.sft.train.grad_accum_steps:
    s.sft.train.fail("grad_accum_steps", f"must divide data.batch_size={s.data.batch_size}")
  s.sft.check_checkpoint(model)

  k, v = model.num_draft_steps, model.vocab_size
  if s.mtp.depth_weights and len(s.mtp.depth_weights) != k:
    s.mtp.fail("depth_weights", f"() or {k} numbers >= 0 (one per depth, "
               f"model.num_draft_steps={k}) with a positive sum")
  if s.mtp.draft_vocab > v:
    s.mtp.fail("draft_vocab", f"an int in [0, model.vocab_size={v}] (0 = the whole head)")
  if s.rl.rollout.draft_vocab > v:
    s.rl.rollout.fail("draft_vocab", f"an int in [0, {v}] (model.vocab_size; 0 = the whole "
                      "head)")
  if s.rl.rollout.num_draft_steps > k:
    s.rl.rollout.fail("num_draft_steps", f"an int in [0, {k}] (model.num_draft_steps; 0 = "
                      "all of them)")
  s.rl.check_data_parallel(
      s.rl.placement.learner_data_parallel(jax.device_count(), data_parallel))

  # Whole rollouts (a prompt of up to rl.max_prompt_len tokens and its completion) are padded
  # to a bucket too (teacher-forced acceptance): a run must not stop there midway.
  whole = s.rl.max_prompt_len + max(s.eval.max_new_tokens, s.mtp.data.max_new_tokens)
  if max(s.eval.prompt_buckets) < whole:
    s.eval.fail("prompt_buckets", f"needs a bucket >= {whole} (rl.max_prompt_len + the "
                "longest completion budget, eval.max_new_tokens or mtp.data.max_new_tokens): "
                "whole rollouts are padded to one")


# ----------------------------------------------------------------------------- reference

def _model_rows() -> dict[str, Row]:
  """config.model: ModelConfig's fields, documented by its docstring."""
  docs = settings_base.docstring_fields(model_config.ModelConfig)
  allowed = {"attention": f"one of {list(model_config.ATTENTION)}",
             "remat": f"one of {list(model_config.REMAT)}",
             "dtype": f"one of {sorted(model_config.DTYPES)}",
             "param_dtype": f"one of {sorted(model_config.DTYPES)}",
             "num_kv_heads": "must be a positive int dividing model.num_heads",
             "num_draft_steps": "must be a positive int >= model.num_mtp_modules",
             "head_dim": "must be a positive even int (RoPE)"}
  return {f"model.{f.name}": Row(str(f.type), docs.get(f.name, ""), allowed.get(
      f.name, "must be a positive int" if f.type == "int" else ""))
          for f in dataclasses.fields(model_config.ModelConfig)}


def reference_rows() -> dict[str, Row]:
  """{config key: Row(type, doc, allowed)} for every key of a config."""
  return {**settings_base.reference_rows(Settings), **data_settings.task_rows(),
          **_model_rows(), **decoding_settings.reference_rows()}


def section_docs() -> dict[str, str]:
  """{section: the first paragraph of its settings class's docstring}."""
  docs, hints = {}, typing.get_type_hints(Settings)
  for f in dataclasses.fields(Settings):
    if "section" in f.metadata:
      text = " ".join((inspect.getdoc(hints[f.name]) or "").split("\n\n")[0].split())
      text = re.sub(r"^config\.\w+: ", "", text)
      docs[f.name] = text[:1].upper() + text[1:]
  return docs
