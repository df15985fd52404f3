"""The config schema, its defaults, and the one validation function run before any work.

Experiment files in configs/ start from `base_config()` and change values; they may not add
keys. `validate(config)` rejects a bad config with a `ConfigError` that names the key, the
value, and what is allowed. The schema grows with the stages; keep it small.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
from typing import Any

import ml_collections

from bebop_jax import sharding
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.model import config as model_config

STAGES = ("data", "sft", "mtp", "rl", "eval")  # stages of bebop_jax.main, run in this order


class ConfigError(ValueError):
  """A config value or key is not allowed."""


def task_knob_defaults(task_name: str) -> dict[str, Any]:
  """The difficulty knobs of a task with their default values."""
  cls = tasks_lib.task_class(task_name)
  return {name: p.default for name, p in inspect.signature(cls).parameters.items()
          if p.default is not inspect.Parameter.empty}


def optim_defaults(**overrides: Any) -> ml_collections.ConfigDict:
  """Optimizer settings of one training stage (bebop_jax.train.optimizer)."""
  optim = ml_collections.ConfigDict(dict(
      learning_rate=3e-3, warmup_steps=50, decay="cosine", end_lr_fraction=0.1,
      weight_decay=0.01, b1=0.9, b2=0.95, clip_norm=1.0, trainable="all"))
  optim.update(overrides)
  return optim


def loop_defaults(**overrides: Any) -> ml_collections.ConfigDict:
  """Loop settings of one training stage (bebop_jax.train.trainer)."""
  loop = ml_collections.ConfigDict(dict(
      num_steps=1000, grad_accum_steps=1, log_every=20, eval_every=0, checkpoint_every=200,
      keep_checkpoints=2, progress=True,
      stop_at_step=0))  # > 0: checkpoint and stop there, as if preempted (rerun resumes)
  loop.update(overrides)
  return loop


def _mesh_defaults() -> ml_collections.ConfigDict:
  """A mesh section: shape (one entry may be -1), axis names, logical-axis rules."""
  return ml_collections.ConfigDict(dict(shape=(-1,), axes=("data",),
                                        rules=sharding.DEFAULT_RULES))


def base_config() -> ml_collections.ConfigDict:
  """Every key the project understands, with its default."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.stages = ("data",)

  c.data = ml_collections.ConfigDict()
  c.data.data_dir = "~/.cache/bebop_jax/datasets"
  c.data.seed = 0  # seed of example generation (train and test)
  c.data.num_train = 20_000
  c.data.num_test = 256
  c.data.num_rl = 1024  # RL training prompts per task (in neither train nor test)
  # "char" (character level), or the path of a Hugging Face tokenizer.json or of a directory
  # holding one; validate() makes it the active tokenizer (bebop_jax.data.tokenizer).
  c.data.tokenizer = tokenizer_lib.CHAR
  # True: prompts and completions in the checkpoint's chat format (its tokenizer_config.json
  # chat template; plain-text answer lines; the template's end of turn as eos).
  c.data.chat_format = False
  c.data.tasks = ml_collections.ConfigDict()
  for name in tasks_lib.TASK_NAMES:
    c.data.tasks[name] = ml_collections.ConfigDict(
        {"weight": 1.0, "knobs": task_knob_defaults(name)})
  # SFT batches.
  c.data.seq_len = 256
  c.data.batch_size = 32
  c.data.packing = True
  # The first canonical_examples examples of the SFT stream use the canonical demonstration;
  # later visits sample a solution path (the tasks' fork knobs): the policy learns
  # the skills on one path before it sees the forks.
  c.data.canonical_examples = 0
  # The SFT and RL data streams come in this many shards, each a grain pipeline over its
  # slice of the datasets giving its share of every batch; a process of a run over several
  # reads only its shards (bebop_jax.multihost). 0 = one per process. A one-process run with
  # data.shards=N reads the batches an N-process run reads.
  c.data.shards = 0

  # The policy (bebop_jax.model.config.ModelConfig fields); presets in model_config.PRESETS.
  c.model = ml_collections.ConfigDict(dataclasses.asdict(model_config.preset("tiny")))

  # Device mesh: one dimension may be -1 (all remaining devices); rules map logical axes of
  # parameters and activations to mesh axes (bebop_jax.sharding).
  c.mesh = _mesh_defaults()

  c.preview = ml_collections.ConfigDict()
  c.preview.examples_per_task = 2

  # SFT stage (bebop_jax.train.sft).
  c.sft = ml_collections.ConfigDict()
  c.sft.optim = optim_defaults()
  c.sft.train = loop_defaults()
  c.sft.mtp_loss_weight = 0.3  # lambda of the joint MTP cross-entropy; 0 = off
  c.sft.head = "fused"         # bebop_jax.losses.head.HEADS: fused never makes [B, T, V]
                               # logits (pallas_kernels.fused_head); dense: the logits
  c.sft.init_from_hf = ""      # a Hugging Face Qwen3 checkpoint directory; "" = random init
  c.sft.hf_mtp = "auto"        # its MTP modules: bebop_jax.model.hf.MTP_MODES

  # MTP stage (bebop_jax.train.mtp): the drafter trained on the frozen SFT policy's rollouts.
  c.mtp = ml_collections.ConfigDict()
  c.mtp.loss = "e2e_tv"            # bebop_jax.losses.mtp.LOSSES
  c.mtp.depth_weights = ()         # K weights of the per-depth terms; () = uniform
  c.mtp.head = "fused"             # bebop_jax.losses.mtp.HEADS: fused never makes [K, B, T, V]
                                   # logits (pallas_kernels.fused_head); dense: the TV kernel
  c.mtp.tv_implementation = "auto"  # or one of pallas_kernels.tv_loss.IMPLEMENTATIONS
  c.mtp.tv_interpret = False       # run the Pallas TV kernels in interpret mode (on CPU)
  c.mtp.temperature = 1.0          # rollouts are sampled, and distributions compared, at this
  c.mtp.init_from = ""             # workdir holding the SFT stage; "" = this workdir
  c.mtp.init = "sft"               # the drafter it starts from: bebop_jax.model.drafter_init.INITS
                                   # (sft: the checkpoint's, e.g. trained jointly with SFT;
                                   # fresh: random; copy_last_block: the trunk's last layer)
  c.mtp.proj_init = "random"       # copy_last_block's projection: model.drafter_init.PROJ_INITS
  c.mtp.seed = 0                   # the drafter's initialisation (fresh) and data order;
                                   # the policy's rollouts stay the same
  # The schedule: warm_start.loss for warm_start.steps steps, then mtp.loss to
  # train.num_steps (docs/mtp.md: e2e-TV's gradient at a depth is scaled by the other
  # depths' acceptance, ~0 for a drafter that starts cold).
  c.mtp.warm_start = ml_collections.ConfigDict(dict(loss="kl", steps=0))
  c.mtp.batch_size = 16            # packed rows of mtp.seq_len per step
  c.mtp.seq_len = 0                # packed row length; 0 = data.seq_len
  c.mtp.features = "cached"        # the frozen trunk's h0: cached (computed once per dataset
                                   # into the drafter store) or in_step (every step runs it)
  c.mtp.features_batch_size = 16   # rows per forward when computing the cached features
  c.mtp.draft_vocab = 0            # > 0: the drafter drafts from its this-many most frequent
                                   # policy tokens (decoding/draft_vocab.py), stored with it
  c.mtp.eval_modes = ("rejection", "greedy_draft")
  c.mtp.eval_before = True         # also measure the initial drafter, for comparison
  c.mtp.eval_before_online = True  # ... by speculative decoding too (else teacher-forced only)
  c.mtp.eval_online = True         # measure the trained drafter by speculative decoding too
  c.mtp.data = ml_collections.ConfigDict()
  c.mtp.data.num_prompts = 1024    # training prompts (split over tasks by data weights)
  c.mtp.data.max_new_tokens = 160  # completion budget of a rollout (replies included)
  c.mtp.data.batch_size = 64       # rollout batch
  c.mtp.data.engine = "autoregressive"  # how the rollouts are sampled (the same law either
                                   # way; an untrained drafter makes speculative slower)
  c.mtp.optim = optim_defaults(learning_rate=2e-3, warmup_steps=20, trainable="mtp")
  c.mtp.train = loop_defaults(num_steps=300, log_every=25, checkpoint_every=100)

  # RL stage (bebop_jax.rl.stage): GRPO on speculative rollouts of the policy from the MTP
  # stage (or the SFT stage when there is none).
  c.rl = ml_collections.ConfigDict()
  c.rl.init_from = ""              # workdir holding the sft (and mtp) stages; "" = this one
  c.rl.prompts_per_batch = 8       # prompts per RL step ...
  c.rl.group_size = 4              # ... each sampled this many times (consecutive rows)
  c.rl.max_prompt_len = 128        # longer training prompts are an error
  c.rl.advantage = "grpo"          # bebop_jax.rl.ADVANTAGE_MODES
  c.rl.dynamic_sampling = False    # drop groups whose rewards are all equal (DAPO)
  c.rl.clip_low = 0.2
  c.rl.clip_high = 0.2
  c.rl.aggregation = "token-mean"  # bebop_jax.rl.AGGREGATIONS
  c.rl.kl_coef = 0.0               # > 0: k3 KL to the frozen initial policy
  # The learner's log-probs, entropies and reference log-probs: "fused" (no [B, T, V]
  # logits; pallas_kernels.fused_head) or "dense". With rollout top_k / top_p truncation
  # (or temperature 0) the learner uses dense logits whatever this says, with a warning.
  c.rl.head = "fused"
  c.rl.epochs = 1                  # passes of learner updates over each batch ...
  c.rl.minibatches = 1             # ... each pass split into this many updates
  c.rl.packing = True              # pack each update's rollouts into full-length rows
  # Completions cut by the length budget (no end of sequence): "keep" trains on them as
  # sampled; "mask" leaves them out of the loss (DAPO's overlong filtering); "penalty" adds
  # DAPO's soft overlong punishment, 0 up to max_new_tokens - overlong_buffer tokens, then
  # falling linearly to -1 at the budget, to every rollout's reward.
  c.rl.overlong = "mask"
  c.rl.overlong_buffer = 32        # "penalty": the punished tail of the budget, in tokens
  c.rl.rollout = ml_collections.ConfigDict(dict(
      engine="speculative",        # or "autoregressive" (bebop_jax.rollout.ENGINES)
      mode="rejection",            # speculative verification (bebop_jax.rollout.VERIFICATION_MODES)
      temperature=1.0, top_k=0, top_p=1.0,
      num_draft_steps=0,           # K drafts per verification; 0 = the model's
      max_new_tokens=160,          # completion budget (policy turns and replies)
      batch_size=32,               # rows per decoding call
      # A reduced draft vocabulary: the drafter's V most frequent training tokens (and the
      # stop tokens); 0 = the drafter's own (mtp.draft_vocab; the whole head when it has
      # none) (decoding/draft_vocab.py).
      draft_vocab=0))
  c.rl.acceptance_modes = ("rejection", "greedy_draft")  # teacher-forced on each batch
  c.rl.optim = optim_defaults(learning_rate=3e-4, warmup_steps=0, decay="constant",
                              weight_decay=0.0, trainable="main")
  c.rl.train = loop_defaults(num_steps=50, log_every=1, eval_every=0, checkpoint_every=10)
  # The drafter during RL: "frozen" (the paper's recipe), "online" (an MTP-only update on
  # each batch's rollouts) or "periodic" (every `every` steps, on the rollouts since).
  c.rl.mtp = ml_collections.ConfigDict()
  c.rl.mtp.strategy = "frozen"
  c.rl.mtp.loss = "e2e_tv"         # bebop_jax.losses.mtp.LOSSES
  c.rl.mtp.every = 5               # periodic: steps between updates
  c.rl.mtp.optim = optim_defaults(learning_rate=1e-3, warmup_steps=0, decay="constant",
                                  trainable="mtp")
  # Where the learner and the rollouts run (bebop_jax.rl.placement): "colocated" (the learner
  # on config.mesh, rollouts on the first device) or "split" into two disjoint sub-meshes.
  c.rl.placement = ml_collections.ConfigDict(dict(
      mode="colocated",
      learner_devices=0.5,         # split: a count (>= 1) or a fraction in (0, 1) of devices
      rollout_devices=0.0,         # split: the same; 0 = the rest
      learner_mesh=_mesh_defaults(), rollout_mesh=_mesh_defaults()))
  # Asynchronous RL (bebop_jax.rl.async_loop): a rollout thread fills a bounded queue while
  # the learner trains; off = the synchronous loop. (Not "async": a Python keyword cannot be
  # a --config.rl.<key> override path.)
  c.rl.asynchronous = ml_collections.ConfigDict(dict(
      enabled=False,
      max_staleness=1,             # eta: no batch is sampled more than eta versions back
      queue_size=0,                # batches ready ahead of the learner; 0 = eta + 1
      interrupt=False,             # swap in new weights between a batch's decoding calls
      off_policy="decoupled",      # "decoupled" PPO (proximal log-probs recomputed) or "none"
      is_cap=2.0,                  # cap of the behaviour weight exp(proximal - behaviour)
      is_mode="cap",               # "cap" the weight at is_cap, or "mask" tokens above it
      max_restarts=3))             # consecutive rollout-thread failures before giving up
  # Held-out evaluation before, every rl.train.eval_every steps and after: pass@1 per task
  # and acceptance per depth, speculative at the rollout temperature, in each mode.
  c.rl.eval = ml_collections.ConfigDict()
  c.rl.eval.num_examples = 64      # per task
  c.rl.eval.modes = ("rejection", "greedy_draft")

  # Adaptive draft length (decoding/adaptive.py): K in 0..k_max chosen before every segment
  # of iterations from live per-depth acceptance and a measured cost table; K = 0 is the
  # autoregressive step. Used by bench_decode.py (--adaptive) when enabled.
  c.decoding = ml_collections.ConfigDict()
  c.decoding.adaptive = ml_collections.ConfigDict(dict(
      enabled=False,
      k_max=0,                     # the most drafts; 0 = model.num_draft_steps
      smoothing=0.2,               # EMA weight of each segment's observed acceptance
      calibrate=True,              # measure the cost table in-process; False: weight reads
      segment=16,                  # iterations between decisions (doubling while K holds)
      batch_factor=4))             # finished rows leave: batches B, then powers of this

  # Evaluation stage (bebop_jax.eval_stage; bebop_jax.report renders it): the policy the job
  # ends with, its decode speed and acceptance against entropy.
  c.report = ml_collections.ConfigDict()
  c.report.batch_sizes = (1, 8)    # speculative vs autoregressive wall clock at these
  c.report.num_prompts = 32        # held-out prompts per measurement (batch 1: one by one)
  c.report.repeats = 2             # timed passes per arm, interleaved (the ratio: their
                                   # geometric mean with a 95% interval over passes)
  c.report.entropy_temperatures = (1.0, 1.5, 2.0)  # re-scoring temperatures for the fit
  c.report.progress = True         # progress bars with ETA over the stage's long phases

  # Evaluation by sampling: pass@1 per task at each temperature.
  c.eval = ml_collections.ConfigDict()
  c.eval.num_examples = 64
  c.eval.temperatures = (0.0, 1.0)
  c.eval.batch_size = 32
  c.eval.max_new_tokens = 160
  c.eval.top_k = 0
  c.eval.top_p = 1.0
  # Prompts (and contexts) are right-padded to the smallest of these: one compile per bucket.
  c.eval.prompt_buckets = (16, 32, 64, 128, 256, 512, 1024)
  return c


def load_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of the experiment config file at `path` (a config may build on
  another: `load_file(os.path.join(os.path.dirname(__file__), "other.py"))`)."""
  namespace: dict[str, Any] = {"__file__": path, "__name__": "config_file"}
  with open(path) as f:
    exec(compile(f.read(), path, "exec"), namespace)  # pylint: disable=exec-used
  return namespace["get_config"](arg)


def load_sweep(path: str, arg: str | None = None,
               default: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
  """`get_sweep(arg)` of the config file at `path`: a list of override dicts (dotted config
  keys to values), one per run, as big_vision's configs define them; `default` when the
  file defines none and a default is given.

  Raises:
    ConfigError: if the file defines no get_sweep (and there is no default), or an entry is
      not a dict of dotted keys.
  """
  namespace: dict[str, Any] = {"__file__": path, "__name__": "config_file"}
  with open(path) as f:
    exec(compile(f.read(), path, "exec"), namespace)  # pylint: disable=exec-used
  if "get_sweep" not in namespace and default is not None:
    return list(default)
  if "get_sweep" not in namespace:
    raise ConfigError(f"{path} defines no get_sweep(arg): a sweep config returns a list of "
                      "override dicts from get_sweep")
  sweep = list(namespace["get_sweep"](arg))
  for i, entry in enumerate(sweep):
    if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry):
      raise ConfigError(f"{path}: get_sweep entry {i} is {entry!r}; each entry must be a "
                        "dict of dotted config keys to values, e.g. {'mtp.loss': 'ce'}")
  return sweep


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, Any]
                    ) -> ml_collections.ConfigDict:
  """A copy of `config` with `overrides` (dotted keys from the root, e.g. "rl.group_size")
  set, with the config's type checks.

  Raises:
    ConfigError: for a key the config does not have, naming the keys it has there.
  """
  config = config.copy_and_resolve_references()
  for key, value in overrides.items():
    *path, last = key.split(".")
    node = config
    for i, part in enumerate(path + [last]):
      if part not in node:
        where = ".".join(path[:i])
        raise ConfigError(f"config.{key} is not a known key; known keys under "
                          f"config.{where or '.'}: {', '.join(sorted(node.keys()))}")
      if i < len(path):
        node = node[part]
    node[last] = value
  return config


def _validate_init_from_hf(s: Any, model: Any) -> None:
  """sft.init_from_hf: a readable Qwen3 config.json describing config.model's decoder."""
  from bebop_jax.model import hf  # pylint: disable=g-import-not-at-top
  if s.hf_mtp not in hf.MTP_MODES:
    _fail("sft.hf_mtp", s.hf_mtp, f"one of {hf.MTP_MODES}")
  if not isinstance(s.init_from_hf, str):
    _fail("sft.init_from_hf", s.init_from_hf, "must be a checkpoint directory ('' = none)")
  if not s.init_from_hf:
    return
  path = os.path.join(s.init_from_hf, "config.json")
  if not os.path.exists(path):
    _fail("sft.init_from_hf", s.init_from_hf, f"a Hugging Face checkpoint directory with "
          f"config.json and *.safetensors; {path} does not exist")
  with open(path) as f:
    try:
      checkpoint = hf.config_from_hf(json.load(f), num_mtp_modules=model.num_mtp_modules,
                                     num_draft_steps=model.num_draft_steps)
      if model.vocab_size > checkpoint.vocab_size:  # grown on import (hf.import_checkpoint)
        checkpoint = dataclasses.replace(checkpoint, vocab_size=model.vocab_size)
      hf.check_matches(checkpoint, model, f"config.sft.init_from_hf={s.init_from_hf!r}")
    except (ValueError, KeyError) as e:
      raise ConfigError(f"config.sft.init_from_hf={s.init_from_hf!r}: {e}") from e


def _fail(key: str, value: Any, allowed: str):
  raise ConfigError(f"config.{key}={value!r} is not allowed: {allowed}")


def _check_keys(cfg: Any, schema: Any, prefix: str):
  """Every key of cfg must be in schema (recursively)."""
  for key in cfg.keys():
    full = f"{prefix}{key}"
    if key not in schema:
      raise ConfigError(f"config.{full} is not a known key; known keys under "
                        f"config.{prefix or '.'}: {', '.join(sorted(schema.keys()))}")
    if isinstance(schema[key], ml_collections.ConfigDict) and not full.endswith(".knobs"):
      if not isinstance(cfg[key], (ml_collections.ConfigDict, dict)):
        _fail(full, cfg[key], "must be a ConfigDict")
      _check_keys(cfg[key], schema[key], full + ".")


def _positive_int(cfg, key: str):
  value = _get(cfg, key)
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    _fail(key, value, "must be a positive int")


def _get(cfg, key: str) -> Any:
  for part in key.split("."):
    cfg = cfg[part]
  return cfg


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks keys, types and values; returns the config unchanged or raises ConfigError."""
  _check_keys(config, base_config(), "")

  if not isinstance(config.seed, int):
    _fail("seed", config.seed, "must be an int")
  stages = tuple(config.stages) if isinstance(config.stages, (tuple, list)) else None
  if not stages or any(s not in STAGES for s in stages) or len(set(stages)) != len(stages):
    _fail("stages", config.stages, f"must be a non-empty tuple of distinct stages from {STAGES}")

  d = config.data
  for key in ("data.num_train", "data.num_test", "data.num_rl", "data.seq_len",
              "data.batch_size"):
    _positive_int(config, key)
  if not isinstance(d.data_dir, str) or not d.data_dir:
    _fail("data.data_dir", d.data_dir, "must be a non-empty path")
  if not isinstance(d.packing, bool):
    _fail("data.packing", d.packing, "must be True or False")
  if not isinstance(d.canonical_examples, int) or d.canonical_examples < 0:
    _fail("data.canonical_examples", d.canonical_examples, "must be an int >= 0")
  tok = _validate_tokenizer(d.tokenizer, d.chat_format)
  if not isinstance(d.shards, int) or isinstance(d.shards, bool) or d.shards < 0:
    _fail("data.shards", d.shards, "must be an int >= 0 (0 = one per process)")
  for key in ("data.batch_size", "mtp.batch_size", "rl.prompts_per_batch"):
    if d.shards and isinstance(_get(config, key), int) and _get(config, key) % d.shards:
      _fail(key, _get(config, key), f"must be a multiple of data.shards={d.shards} (each "
            "shard gives an equal share of a batch)")

  total_weight = 0.0
  for name in tasks_lib.TASK_NAMES:
    weight = d.tasks[name].weight
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
      _fail(f"data.tasks.{name}.weight", weight, "must be a number >= 0")
    total_weight += weight
    knobs = dict(d.tasks[name].knobs)
    allowed = task_knob_defaults(name)
    for knob in knobs:
      if knob not in allowed:
        raise ConfigError(f"config.data.tasks.{name}.knobs.{knob} is not a knob of task "
                          f"{name!r}; its knobs are: {', '.join(sorted(allowed))}")
    try:
      tasks_lib.get_task(name, **knobs)
    except ValueError as e:
      raise ConfigError(f"config.data.tasks.{name}.knobs: {e}") from e
  if total_weight <= 0:
    _fail("data.tasks.*.weight", 0, "at least one task needs a positive weight")

  try:
    model = model_config.ModelConfig.from_dict(config.model.to_dict())
  except ValueError as e:
    raise ConfigError(f"config.{e}") from e
  if model.vocab_size < tok.vocab_size:
    source = "" if d.tokenizer == tokenizer_lib.CHAR else (
        f" (data.tokenizer={d.tokenizer!r}: {tok.num_used} tokens padded to a multiple of 128)")
    _fail("model.vocab_size", model.vocab_size,
          f"must be >= the tokenizer's {tok.vocab_size}{source}")

  mesh_sizes = _validate_mesh(config.mesh)
  data_parallel, batch_axes = _data_parallel(mesh_sizes, config.mesh.rules)
  for key in ("data.batch_size", "mtp.batch_size"):
    if _get(config, key) % data_parallel:
      _fail(key, _get(config, key),
            f"must be a multiple of the data-parallel size {data_parallel} (mesh axes "
            f"{batch_axes} of mesh {mesh_sizes})")
  _validate_training(config, "sft")
  if not isinstance(config.sft.mtp_loss_weight, (int, float)) or config.sft.mtp_loss_weight < 0:
    _fail("sft.mtp_loss_weight", config.sft.mtp_loss_weight, "must be a number >= 0")
  from bebop_jax.losses import head as head_lib  # pylint: disable=g-import-not-at-top
  if config.sft.head not in head_lib.HEADS:
    _fail("sft.head", config.sft.head, f"one of {head_lib.HEADS}")
  _validate_init_from_hf(config.sft, model)
  _validate_mtp(config)
  _validate_rl(config, _validate_placement(config, data_parallel))
  _validate_adaptive(config)
  r = config.report
  if not r.batch_sizes or any(not isinstance(b, int) or b < 1 for b in r.batch_sizes):
    _fail("report.batch_sizes", r.batch_sizes, "must be a non-empty tuple of positive ints")
  for key in ("report.num_prompts", "report.repeats"):
    _positive_int(config, key)
  temps = r.entropy_temperatures
  if not temps or any(not isinstance(t, (int, float)) or t <= 0 for t in temps):
    _fail("report.entropy_temperatures", temps, "must be a non-empty tuple of numbers > 0")
  for key in ("eval.num_examples", "eval.batch_size", "eval.max_new_tokens"):
    _positive_int(config, key)
  temps = config.eval.temperatures
  if not temps or any(not isinstance(t, (int, float)) or t < 0 for t in temps):
    _fail("eval.temperatures", temps, "must be a non-empty tuple of numbers >= 0")
  if not isinstance(config.eval.top_k, int) or config.eval.top_k < 0:
    _fail("eval.top_k", config.eval.top_k, "must be an int >= 0 (0 = off)")
  pb = tuple(config.eval.prompt_buckets)
  if not pb or any(not isinstance(b, int) or b < 1 for b in pb) or list(pb) != sorted(set(pb)):
    _fail("eval.prompt_buckets", config.eval.prompt_buckets,
          "must be a non-empty increasing tuple of positive ints")
  # Whole rollouts (a prompt of up to rl.max_prompt_len tokens and its completion) are padded
  # to a bucket too (teacher-forced acceptance): a run must not stop there midway.
  whole = config.rl.max_prompt_len + max(config.eval.max_new_tokens,
                                         config.mtp.data.max_new_tokens)
  if pb and max(pb) < whole:
    _fail("eval.prompt_buckets", config.eval.prompt_buckets,
          f"needs a bucket >= {whole} (rl.max_prompt_len + the longest completion budget, "
          "eval.max_new_tokens or mtp.data.max_new_tokens): whole rollouts are padded to "
          "one")
  if not 0 < config.eval.top_p <= 1:
    _fail("eval.top_p", config.eval.top_p, "must be in (0, 1]")
  _positive_int(config, "preview.examples_per_task")
  tokenizer_lib.set_tokenizer(tok)  # only a valid config changes the active tokenizer
  return config


def _validate_adaptive(config: ml_collections.ConfigDict) -> None:
  a = config.decoding.adaptive
  k = config.model.num_draft_steps
  if not isinstance(a.k_max, int) or isinstance(a.k_max, bool) or not 0 <= a.k_max <= k:
    _fail("decoding.adaptive.k_max", a.k_max,
          f"an int in [0, {k}] (model.num_draft_steps; 0 = all of them)")
  if not isinstance(a.smoothing, (int, float)) or not 0 < a.smoothing <= 1:
    _fail("decoding.adaptive.smoothing", a.smoothing, "must be in (0, 1]")
  for key in ("enabled", "calibrate"):
    if not isinstance(a[key], bool):
      _fail(f"decoding.adaptive.{key}", a[key], "must be True or False")
  _positive_int(config, "decoding.adaptive.segment")
  if not isinstance(a.batch_factor, int) or a.batch_factor < 2:
    _fail("decoding.adaptive.batch_factor", a.batch_factor, "must be an int >= 2")


def _validate_tokenizer(spec: Any, chat_format: Any = False) -> tokenizer_lib.BaseTokenizer:
  """data.tokenizer and data.chat_format: loads it (the vocab check needs its size; a bad
  file fails here, before any work)."""
  if not isinstance(chat_format, bool):
    _fail("data.chat_format", chat_format, "must be True or False (True: prompts and "
          "completions in the chat template of data.tokenizer's directory; docs/usage.md)")
  allowed = (f"must be {tokenizer_lib.CHAR!r} or the path of a Hugging Face "
             f"{tokenizer_lib.HF_FILE} (or of a directory holding one)")
  if not isinstance(spec, str) or not spec:
    _fail("data.tokenizer", spec, allowed)
  path = os.path.expanduser(spec)
  if spec != tokenizer_lib.CHAR and not os.path.exists(path):
    _fail("data.tokenizer", spec, f"{allowed}; there is no such file or directory"
          + ("" if path == spec else f" {path!r}"))
  try:
    return tokenizer_lib.load_tokenizer(spec, chat_format=chat_format)
  except FileNotFoundError as e:
    _fail("data.tokenizer", spec, f"{allowed}; {e}")
  except ValueError as e:
    _fail("data.tokenizer", spec, str(e))


def _validate_mtp(config: ml_collections.ConfigDict) -> None:
  """The mtp section."""
  from bebop_jax.losses import mtp as mtp_losses  # pylint: disable=g-import-not-at-top
  from pallas_kernels import tv_loss  # pylint: disable=g-import-not-at-top
  m = config.mtp
  if m.loss not in mtp_losses.LOSSES:
    _fail("mtp.loss", m.loss, f"one of {mtp_losses.LOSSES}")
  k = config.model.num_draft_steps
  w = tuple(m.depth_weights)
  if w and (len(w) != k or any(not isinstance(x, (int, float)) or x < 0 for x in w)
            or sum(w) <= 0):
    _fail("mtp.depth_weights", m.depth_weights,
          f"() or {k} numbers >= 0 (one per depth, model.num_draft_steps={k}) with a "
          "positive sum")
  if m.head not in mtp_losses.HEADS:
    _fail("mtp.head", m.head, f"one of {mtp_losses.HEADS}")
  if m.tv_implementation not in ("auto",) + tuple(tv_loss.IMPLEMENTATIONS):
    _fail("mtp.tv_implementation", m.tv_implementation,
          f"one of {('auto',) + tuple(tv_loss.IMPLEMENTATIONS)}")
  if not isinstance(m.tv_interpret, bool):
    _fail("mtp.tv_interpret", m.tv_interpret, "True or False")
  if not isinstance(m.temperature, (int, float)) or m.temperature <= 0:
    _fail("mtp.temperature", m.temperature, "must be a number > 0")
  if not isinstance(m.init_from, str):
    _fail("mtp.init_from", m.init_from, "must be a path ('' = this workdir)")
  modes = tuple(m.eval_modes)
  allowed = ("rejection", "greedy_draft", "strict")
  if not modes or any(x not in allowed for x in modes):
    _fail("mtp.eval_modes", m.eval_modes, f"a non-empty tuple from {allowed}")
  if not isinstance(m.seed, int) or m.seed < 0:
    _fail("mtp.seed", m.seed, "must be an int >= 0")
  from bebop_jax.model import drafter_init  # pylint: disable=g-import-not-at-top
  if m.init not in drafter_init.INITS:
    _fail("mtp.init", m.init, f"one of {drafter_init.INITS}")
  if m.proj_init not in drafter_init.PROJ_INITS:
    _fail("mtp.proj_init", m.proj_init, f"one of {drafter_init.PROJ_INITS}")
  if m.warm_start.loss not in mtp_losses.LOSSES:
    _fail("mtp.warm_start.loss", m.warm_start.loss, f"one of {mtp_losses.LOSSES}")
  if not isinstance(m.warm_start.steps, int) or m.warm_start.steps < 0:
    _fail("mtp.warm_start.steps", m.warm_start.steps, "must be an int >= 0")
  for key in ("eval_before", "eval_before_online", "eval_online"):
    if not isinstance(m[key], bool):
      _fail(f"mtp.{key}", m[key], "must be True or False")
  if m.features not in ("cached", "in_step"):
    _fail("mtp.features", m.features, "one of ('cached', 'in_step')")
  if m.data.engine not in ("autoregressive", "speculative"):
    _fail("mtp.data.engine", m.data.engine, "one of ('autoregressive', 'speculative')")
  if not isinstance(m.seq_len, int) or m.seq_len < 0:
    _fail("mtp.seq_len", m.seq_len, "must be an int >= 0 (0 = data.seq_len)")
  v = config.model.vocab_size
  if not isinstance(m.draft_vocab, int) or not 0 <= m.draft_vocab <= v:
    _fail("mtp.draft_vocab", m.draft_vocab, f"an int in [0, model.vocab_size={v}] (0 = the "
          "whole head)")
  for key in ("mtp.batch_size", "mtp.features_batch_size", "mtp.data.num_prompts",
              "mtp.data.max_new_tokens", "mtp.data.batch_size"):
    _positive_int(config, key)
  _validate_training(config, "mtp", batch_key="mtp.batch_size")


def _validate_placement(config: ml_collections.ConfigDict, data_parallel: int) -> int:
  """rl.placement and rl.asynchronous; returns the learner's data-parallel size."""
  import jax  # pylint: disable=g-import-not-at-top
  from bebop_jax.rl import placement as placement_lib  # pylint: disable=g-import-not-at-top
  p = config.rl.placement
  if p.mode not in placement_lib.MODES:
    _fail("rl.placement.mode", p.mode, f"one of {placement_lib.MODES}")
  if p.mode == "split":
    try:
      learner, rollout = placement_lib.split_devices(p.learner_devices, p.rollout_devices,
                                                     list(range(jax.device_count())))
    except placement_lib.PlacementError as e:
      raise ConfigError(f"config.{e}") from e
    sizes = _validate_mesh(p.learner_mesh, "rl.placement.learner_mesh", len(learner))
    _validate_mesh(p.rollout_mesh, "rl.placement.rollout_mesh", len(rollout))
    data_parallel = _data_parallel(sizes, p.learner_mesh.rules)[0]
  a = config.rl.asynchronous
  if not isinstance(a.enabled, bool):
    _fail("rl.asynchronous.enabled", a.enabled, "must be True or False")
  if not isinstance(a.max_staleness, int) or a.max_staleness < 0:
    _fail("rl.asynchronous.max_staleness", a.max_staleness,
          "must be an int >= 0 (0 = on-policy)")
  if not isinstance(a.queue_size, int) or a.queue_size < 0:
    _fail("rl.asynchronous.queue_size", a.queue_size,
          "must be an int >= 0 (0 = max_staleness + 1)")
  if not isinstance(a.interrupt, bool):
    _fail("rl.asynchronous.interrupt", a.interrupt, "must be True or False")
  if a.enabled and a.interrupt and config.rl.rollout.batch_size < config.rl.group_size:
    _fail("rl.rollout.batch_size", config.rl.rollout.batch_size,
          f"must be >= rl.group_size={config.rl.group_size} with rl.asynchronous.interrupt: "
          "weights change between decoding calls, and a call must hold whole groups so that "
          "one version samples every rollout of a prompt")
  if a.off_policy not in ("decoupled", "none"):
    _fail("rl.asynchronous.off_policy", a.off_policy, "one of ('decoupled', 'none')")
  if not isinstance(a.is_cap, (int, float)) or a.is_cap <= 0:
    _fail("rl.asynchronous.is_cap", a.is_cap, "must be a number > 0")
  if a.is_mode not in ("cap", "mask"):
    _fail("rl.asynchronous.is_mode", a.is_mode, "one of ('cap', 'mask')")
  if not isinstance(a.max_restarts, int) or a.max_restarts < 0:
    _fail("rl.asynchronous.max_restarts", a.max_restarts, "must be an int >= 0")
  return data_parallel


def _validate_rl(config: ml_collections.ConfigDict, data_parallel: int) -> None:
  """The rl section."""
  from bebop_jax import rl  # pylint: disable=g-import-not-at-top
  from bebop_jax import rollout  # pylint: disable=g-import-not-at-top
  from bebop_jax.losses import mtp as mtp_losses  # pylint: disable=g-import-not-at-top
  c = config.rl
  if not isinstance(c.init_from, str):
    _fail("rl.init_from", c.init_from, "must be a path ('' = this workdir)")
  for key in ("prompts_per_batch", "group_size", "max_prompt_len", "epochs", "minibatches"):
    _positive_int(config, f"rl.{key}")
  if c.advantage not in rl.ADVANTAGE_MODES:
    _fail("rl.advantage", c.advantage, f"one of {rl.ADVANTAGE_MODES}")
  if c.group_size < 2:
    _fail("rl.group_size", c.group_size,
          f"must be >= 2 with rl.advantage={c.advantage!r}: group-relative advantages of "
          "one rollout per prompt are all 0")
  if c.aggregation not in rl.AGGREGATIONS:
    _fail("rl.aggregation", c.aggregation, f"one of {rl.AGGREGATIONS}")
  if not isinstance(c.clip_low, (int, float)) or not 0 <= c.clip_low < 1:
    _fail("rl.clip_low", c.clip_low, "must be a number in [0, 1)")
  if not isinstance(c.clip_high, (int, float)) or c.clip_high < 0:
    _fail("rl.clip_high", c.clip_high, "must be a number >= 0")
  if not isinstance(c.kl_coef, (int, float)) or c.kl_coef < 0:
    _fail("rl.kl_coef", c.kl_coef, "must be a number >= 0 (0 = no KL term)")
  if c.head not in mtp_losses.HEADS:
    _fail("rl.head", c.head, f"one of {mtp_losses.HEADS}")
  if not isinstance(c.dynamic_sampling, bool):
    _fail("rl.dynamic_sampling", c.dynamic_sampling, "must be True or False")
  if not isinstance(c.packing, bool):
    _fail("rl.packing", c.packing, "must be True or False")
  if c.overlong not in rl.OVERLONG_MODES:
    _fail("rl.overlong", c.overlong, f"one of {rl.OVERLONG_MODES}")
  if not isinstance(c.overlong_buffer, int) or c.overlong_buffer < 1 or (
      c.overlong == "penalty" and c.overlong_buffer > c.rollout.max_new_tokens):
    _fail("rl.overlong_buffer", c.overlong_buffer,
          f"an int in [1, rl.rollout.max_new_tokens={c.rollout.max_new_tokens}] (the "
          "punished tail of the budget with rl.overlong='penalty')")
  r = c.rollout
  if r.engine not in rollout.ENGINES:
    _fail("rl.rollout.engine", r.engine, f"one of {rollout.ENGINES}")
  if r.mode not in rollout.VERIFICATION_MODES:
    _fail("rl.rollout.mode", r.mode, f"one of {rollout.VERIFICATION_MODES}")
  if not isinstance(r.temperature, (int, float)) or r.temperature <= 0:
    _fail("rl.rollout.temperature", r.temperature,
          "must be a number > 0 (RL samples; greedy rollouts have no policy gradient)")
  if not isinstance(r.top_k, int) or r.top_k < 0:
    _fail("rl.rollout.top_k", r.top_k, "must be an int >= 0 (0 = off)")
  if not 0 < r.top_p <= 1:
    _fail("rl.rollout.top_p", r.top_p, "must be in (0, 1]")
  v = config.model.vocab_size
  if not isinstance(r.draft_vocab, int) or not 0 <= r.draft_vocab <= v:
    _fail("rl.rollout.draft_vocab", r.draft_vocab,
          f"an int in [0, {v}] (model.vocab_size; 0 = the whole head)")
  k = config.model.num_draft_steps
  if not isinstance(r.num_draft_steps, int) or not 0 <= r.num_draft_steps <= k:
    _fail("rl.rollout.num_draft_steps", r.num_draft_steps,
          f"an int in [0, {k}] (model.num_draft_steps; 0 = all of them)")
  for key in ("max_new_tokens", "batch_size"):
    _positive_int(config, f"rl.rollout.{key}")
  modes = tuple(c.acceptance_modes)
  if any(m not in rollout.VERIFICATION_MODES for m in modes):
    _fail("rl.acceptance_modes", c.acceptance_modes,
          f"a tuple from {rollout.VERIFICATION_MODES} (() = none)")
  modes = tuple(c.eval.modes)
  if not modes or any(m not in rollout.VERIFICATION_MODES for m in modes):
    _fail("rl.eval.modes", c.eval.modes, f"a non-empty tuple from {rollout.VERIFICATION_MODES}")
  _positive_int(config, "rl.eval.num_examples")
  rows = c.prompts_per_batch * c.group_size
  if rows % c.minibatches:
    _fail("rl.minibatches", c.minibatches,
          f"must divide the batch of rl.prompts_per_batch x rl.group_size = {rows} rollouts")
  update_rows = rows // c.minibatches
  if update_rows % (data_parallel * c.train.grad_accum_steps):
    _fail("rl.minibatches", c.minibatches,
          f"each update's {update_rows} rollouts must split over the data-parallel size "
          f"{data_parallel} x rl.train.grad_accum_steps={c.train.grad_accum_steps}")
  if rows % data_parallel:
    _fail("rl.prompts_per_batch", c.prompts_per_batch,
          f"the {rows} rollouts of a step must split over the data-parallel size "
          f"{data_parallel}")
  m = c.mtp
  if m.strategy not in ("frozen", "online", "periodic"):
    _fail("rl.mtp.strategy", m.strategy, "one of ('frozen', 'online', 'periodic')")
  if m.loss not in mtp_losses.LOSSES:
    _fail("rl.mtp.loss", m.loss, f"one of {mtp_losses.LOSSES}")
  _positive_int(config, "rl.mtp.every")
  _validate_optim(config, "rl.mtp.optim", config.rl.mtp.optim)
  if m.optim.trainable != "mtp":
    _fail("rl.mtp.optim.trainable", m.optim.trainable, "must be 'mtp' (MTP-only updates)")
  _validate_training(config, "rl", batch_key=None)
  if c.optim.trainable != "main":
    _fail("rl.optim.trainable", c.optim.trainable,
          "must be 'main' (the policy update trains the trunk; the drafter is rl.mtp's)")


def _validate_optim(config, key: str, o) -> None:
  from bebop_jax.train import optimizer  # pylint: disable=g-import-not-at-top
  if not isinstance(o.learning_rate, (int, float)) or o.learning_rate <= 0:
    _fail(f"{key}.learning_rate", o.learning_rate, "must be a number > 0")
  if o.decay not in optimizer.DECAYS:
    _fail(f"{key}.decay", o.decay, f"one of {optimizer.DECAYS}")
  if o.trainable not in optimizer.TRAINABLE:
    _fail(f"{key}.trainable", o.trainable, f"one of {optimizer.TRAINABLE}")
  if not 0 <= o.end_lr_fraction <= 1:
    _fail(f"{key}.end_lr_fraction", o.end_lr_fraction, "must be in [0, 1]")
  if not isinstance(o.warmup_steps, int) or o.warmup_steps < 0:
    _fail(f"{key}.warmup_steps", o.warmup_steps, "must be an int >= 0")


def _validate_training(config: ml_collections.ConfigDict, stage: str,
                       batch_key: str | None = "data.batch_size") -> None:
  """The optim and train sections of one training stage (batch_key None: no batch check)."""
  _validate_optim(config, f"{stage}.optim", config[stage].optim)
  for key in ("num_steps", "grad_accum_steps", "log_every", "checkpoint_every",
              "keep_checkpoints"):
    _positive_int(config, f"{stage}.train.{key}")
  t = config[stage].train
  if not isinstance(t.stop_at_step, int) or t.stop_at_step < 0:
    _fail(f"{stage}.train.stop_at_step", t.stop_at_step, "must be an int >= 0 (0 = off)")
  if not isinstance(t.eval_every, int) or t.eval_every < 0:
    _fail(f"{stage}.train.eval_every", t.eval_every, "must be an int >= 0 (0 = at the end)")
  if batch_key is not None and _get(config, batch_key) % t.grad_accum_steps:
    _fail(f"{stage}.train.grad_accum_steps", t.grad_accum_steps,
          f"must divide {batch_key}={_get(config, batch_key)}")


def _data_parallel(mesh_sizes: dict[str, int], rules) -> tuple[int, tuple[str, ...]]:
  """(the data-parallel size of a mesh: the product of its batch axes, those axes)."""
  batch_axes = dict(rules).get("batch") or ()
  batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
  return math.prod(mesh_sizes.get(a, 1) for a in batch_axes), batch_axes


def _validate_mesh(mesh_cfg: ml_collections.ConfigDict, key: str = "mesh",
                   num_devices: int | None = None) -> dict[str, int]:
  """Shape against axes and the device count (default: all of them); rules against known
  mesh axes. Returns {axis: size}."""
  import jax  # pylint: disable=g-import-not-at-top  # only here: config files stay light
  shape, axes = tuple(mesh_cfg.shape), tuple(mesh_cfg.axes)
  if len(shape) != len(axes) or len(set(axes)) != len(axes):
    _fail(f"{key}.axes", axes, f"must name each of the {len(shape)} dimensions of "
          f"{key}.shape={shape} once")
  unknown = [a for a in axes if a not in sharding.MESH_AXES]
  if unknown:
    _fail(f"{key}.axes", axes, f"axis names must come from {sharding.MESH_AXES}")
  if any(not isinstance(s, int) or (s < 1 and s != -1) for s in shape) or shape.count(-1) > 1:
    _fail(f"{key}.shape", shape, "must hold positive ints and at most one -1")
  for rule in mesh_cfg.rules:
    if len(rule) != 2 or not isinstance(rule[0], str):
      _fail(f"{key}.rules", rule,
            "each rule must be (logical_axis, mesh_axis or tuple of them)")
    targets = (rule[1],) if isinstance(rule[1], str) or rule[1] is None else tuple(rule[1])
    for target in targets:
      if target is not None and target not in sharding.MESH_AXES:
        _fail(f"{key}.rules", rule, f"mesh axis {target!r} is not one of "
              f"{sharding.MESH_AXES} (rules may name axes the mesh lacks; those are ignored)")
  num_devices = jax.device_count() if num_devices is None else num_devices
  try:
    resolved = sharding.resolve_mesh_shape(shape, num_devices)
  except sharding.MeshError as e:
    raise ConfigError(f"config.{key}.shape={shape} is not allowed: {e}") from e
  return dict(zip(axes, resolved))


# ----------------------------------------------------------------------------- reference

_PROBE = "__not_a_value__"


def _leaves(cfg: ml_collections.ConfigDict, prefix: str = ""):
  for key in cfg.keys():
    value = cfg[key]
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def _probes(default: Any) -> list[Any]:
  """Values of no valid kind for a key with this default: the wrong type, then out of range."""
  if isinstance(default, bool):
    return [_PROBE]
  if isinstance(default, (int, float)):
    return [_PROBE, -987654321, 987654321, -0.5]
  if isinstance(default, (tuple, list)):
    return [(_PROBE,), ()]
  return [_PROBE]


def allowed_values(key: str) -> str:
  """What `validate` allows for `key`, in its own words: the message it gives when the key
  alone holds a value of no valid kind ("" when no probe draws a message about the key)."""
  for probe in _probes(_get(base_config(), key)):
    config = base_config()
    *path, last = key.split(".")
    node = config
    for part in path:
      node = node[part]
    with node.ignore_type():
      node[last] = probe
    try:
      validate(config)
    except ConfigError as e:
      text = str(e)
      marker = "is not allowed: "
      if marker in text and text.startswith(f"config.{key}="):
        return text.split(marker, 1)[1]
      parent = f"config.{'.'.join(path)}: "
      if text.startswith(parent):  # a task's own check of its knobs
        text = re.split(r"[;,] got ", text[len(parent):])[0]
        if "must" in text:
          return text
      elif f"config.{key}" in text:
        return text
    except Exception:  # pylint: disable=broad-except  # a check without a ConfigError
      pass
  return ""


def reference_markdown() -> str:
  """docs/configs.md: every key of `base_config()` with its default and, from `validate`,
  what it allows (python -m bebop_jax.config > docs/configs.md)."""
  lines = ["# Config reference", "",
           "Every key of `bebop_jax.config.base_config()` with its default, and what",
           "`validate` allows (its own error text for a value of no valid kind; blank where it",
           "does not check the key). Generated by `python -m bebop_jax.config >",
           "docs/configs.md`; a test keeps it current. Experiment files in `configs/` change",
           "values only; see [usage.md](usage.md#configs).", ""]
  section = None
  for key, default in _leaves(base_config()):
    top = key.split(".")[0] if "." in key else "(top level)"
    if top != section:
      section = top
      lines += ["", f"## {section}", "", "| key | default | allowed |", "|---|---|---|"]
    shown = repr(default).replace("|", "\\|")
    if len(shown) > 80:
      shown = shown[:77] + "..."
    allowed = allowed_values(key)
    if not allowed and ".knobs." in key:
      allowed = (f"a {type(default).__name__}, range-checked by the "
                 f"{key.split('.')[2]} task (bebop_jax/tasks)")
    if not allowed and key.startswith("rl.placement."):
      allowed = "checked with rl.placement.mode='split' against the devices (rl/placement.py)"
    allowed = allowed or f"any {type(default).__name__} (the type is locked)"
    allowed = allowed.replace("|", "\\|").replace("\n", " ")
    lines.append(f"| `{key}` | `{shown}` | {allowed} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  print(reference_markdown(), end="")
