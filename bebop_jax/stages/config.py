"""The config schema, its defaults, and the one validation function run before any work.

Experiment files in configs/ start from `base_config()` and change values; they may not add
keys. `validate(config)` rejects a bad config with a `ConfigError` that names the key, the
value, and what is allowed: it checks the keys against the schema and builds the typed
settings (`settings(config)`, a frozen `bebop_jax.settings.Settings` whose sections check
themselves). The schema grows with the stages; keep it small. What each key means and
allows is documented with its settings field; `python -m bebop_jax.stages.config` writes the
reference, docs/configs.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from bebop_jax import settings as settings_lib
from bebop_jax import sharding
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.data.settings import task_knob_defaults
from bebop_jax.decoding import settings as decoding_settings
from bebop_jax.model import config as model_config
from bebop_jax.settings_base import ConfigError, build, fail
from bebop_jax.stages import rollouts

STAGES = settings_lib.STAGES  # stages of bebop_jax.main, run in this order

__all__ = ["ConfigError", "STAGES", "apply_overrides", "base_config", "load_file",
           "load_sweep", "loop_defaults", "optim_defaults", "reference_markdown", "settings",
           "task_knob_defaults", "validate"]


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
  # holding one; the typed data settings load it (settings(config).data.loaded_tokenizer).
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

  # SFT stage (bebop_jax.stages.sft).
  c.sft = ml_collections.ConfigDict()
  c.sft.optim = optim_defaults()
  c.sft.train = loop_defaults()
  c.sft.mtp_loss_weight = 0.3  # lambda of the joint MTP cross-entropy; 0 = off
  c.sft.head = "fused"         # bebop_jax.losses.head.HEADS: fused never makes [B, T, V]
                               # logits (pallas_kernels.fused_head); dense: the logits
  c.sft.init_from_hf = ""      # a Hugging Face Qwen3 checkpoint directory; "" = random init
  c.sft.hf_mtp = "auto"        # its MTP modules: bebop_jax.model.hf.MTP_MODES

  # MTP stage (bebop_jax.stages.mtp): the drafter trained on the frozen SFT policy's rollouts.
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
  c.mtp.drafter_from = ""         # workdir of an MTP stage whose drafter this one starts from
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

  # RL stage (bebop_jax.stages.rl): GRPO on speculative rollouts of the policy from the MTP
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
  c.rl.entropy_coef = 0.0          # > 0: an entropy bonus (the policy's entropy rises)
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

  # Evaluation stage (bebop_jax.stages.eval; bebop_jax.stages.report renders it): the policy the job
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


def _check_keys(cfg: Any, schema: Any, prefix: str):
  """Every key of cfg must be in schema (recursively)."""
  for key in cfg.keys():
    full = f"{prefix}{key}"
    if key not in schema:
      raise ConfigError(f"config.{full} is not a known key; known keys under "
                        f"config.{prefix or '.'}: {', '.join(sorted(schema.keys()))}")
    if isinstance(schema[key], ml_collections.ConfigDict) and not full.endswith(".knobs"):
      if not isinstance(cfg[key], (ml_collections.ConfigDict, dict)):
        fail(full, cfg[key], "must be a ConfigDict")
      _check_keys(cfg[key], schema[key], full + ".")


_SETTINGS_CACHE: dict[str, settings_lib.Settings] = {}
_SETTINGS_CACHE_SIZE = 16


def settings(config: ml_collections.ConfigDict) -> settings_lib.Settings:
  """The typed settings of `config`: its keys checked against the schema, then every
  section built, each checking itself, and the checks across sections
  (bebop_jax.settings.check_across_sections).

  Stage helpers call this for the section they need; building loads the tokenizer, so the
  settings of the last few configs are kept, keyed by the config's values (a changed config
  is a new key; a failing one is never kept).

  Raises:
    ConfigError: naming the key, the value and what is allowed.
  """
  key = repr(config.to_dict())
  if key not in _SETTINGS_CACHE:
    if len(_SETTINGS_CACHE) >= _SETTINGS_CACHE_SIZE:
      del _SETTINGS_CACHE[next(iter(_SETTINGS_CACHE))]
    _SETTINGS_CACHE[key] = _build_settings(config)
  return _SETTINGS_CACHE[key]


def _build_settings(config: ml_collections.ConfigDict) -> settings_lib.Settings:
  _check_keys(config, base_config(), "")
  values = config.to_dict()  # plain dicts from here on
  try:
    model = model_config.ModelConfig.from_dict(values["model"])
  except ValueError as e:
    raise ConfigError(f"config.{e}") from e
  a = values["decoding"]["adaptive"]
  decoding_settings.check_adaptive(a, model.num_draft_steps)
  try:
    adaptive_settings = rollouts.adaptive_settings(config)
  except ValueError as e:
    raise ConfigError(f"config.decoding.adaptive.{e}") from e
  decoding = decoding_settings.DecodingSettings(
      decoding_settings.AdaptiveDecoding(a["enabled"], adaptive_settings))
  return build(settings_lib.Settings, values, "", model=model, decoding=decoding)


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks keys, types and values (`settings`; it loads data.tokenizer to check the
  vocabulary size); returns the config unchanged or raises ConfigError. It sets nothing:
  code that tokenizes gets the tokenizer from the settings, `settings(config).data
  .loaded_tokenizer`."""
  settings(config)
  return config


# ----------------------------------------------------------------------------- reference

def _leaves(cfg: ml_collections.ConfigDict, prefix: str = ""):
  for key in cfg.keys():
    value = cfg[key]
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def _cell(text: str) -> str:
  return text.replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
  """docs/configs.md: every key of `base_config()` with its default and, from the typed
  settings' fields, its type, what it allows and what it means (python -m bebop_jax.stages.config
  > docs/configs.md).

  Raises:
    ConfigError: if a key of the schema has no settings field or the other way round.
  """
  rows, defaults = settings_lib.reference_rows(), dict(_leaves(base_config()))
  if set(rows) != set(defaults):
    raise ConfigError(f"schema keys without a documented settings field: "
                      f"{sorted(set(defaults) - set(rows))}; settings fields the schema lacks: "
                      f"{sorted(set(rows) - set(defaults))}")
  lines = ["# Config reference", "",
           "Every key of `bebop_jax.config.base_config()` with its type, default, what",
           "`validate` allows and what it means, from the typed settings that check it",
           "(`bebop_jax/settings.py` lists where each section's settings live). Generated by",
           "`python -m bebop_jax.stages.config > docs/configs.md`; a test keeps it current.",
           "Experiment files in `configs/` change values only; see",
           "[usage.md](usage.md#configs).", ""]
  docs, section = settings_lib.section_docs(), None
  top_level_first = sorted(defaults, key=lambda k: ("." in k, k.split(".")[0]))
  for key in top_level_first:
    top = key.split(".")[0] if "." in key else "(top level)"
    if top != section:
      section = top
      lines += ["", f"## {section}", ""] + ([_cell(docs[top]), ""] if top in docs else [])
      lines += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    row = rows[key]
    shown = repr(defaults[key])
    if len(shown) > 80:
      shown = shown[:77] + "..."
    allowed = row.allowed or f"any {row.type} (the type is locked)"
    lines.append(f"| `{key}` | `{_cell(row.type)}` | `{_cell(shown)}` | {_cell(allowed)} | "
                 f"{_cell(row.doc)} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  print(reference_markdown(), end="")
