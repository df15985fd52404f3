"""A stage's policy for inference: where it comes from and how it is built from checkpoints.

The lineage of a workdir's policies: SFT starts from `initial_policy` (a random
initialisation or a Hugging Face checkpoint, sft.init_from_hf) and trains its trainable
subset; the MTP stage trains the MTP modules over the SFT policy of `sft_workdir` (its own
workdir, or mtp.init_from); the RL stage saves every parameter. `restore_policy` builds any
of them from parameters alone (Checkpointer.restore_params, orbax's partial restore):
inference never builds an optimizer nor reads its state.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from bebop_jax import multihost
from bebop_jax.decoding import draft_vocab as draft_vocab_lib
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.train.checkpoint import (CheckpointMismatchError, Checkpointer, abstract_like,
                                        checkpoint_dir)

# The entries of each stage's saved state that hold parameters (the rest is optimizer state,
# counters and buffers, which only resuming that stage needs): SFT and MTP save
# trainer.TrainState.checkpoint_tree() (their trainable subset; the frozen rest comes from the
# stage they started from), the RL stage its learner's trunk and MTP modules (everything).
PARAM_KEYS = {"sft": ("trainable",), "mtp": ("trainable",), "rl": ("trunk", "mtp")}


def sft_workdir(config: Any, workdir: str) -> str:
  """The workdir whose SFT policy the MTP stage of `workdir` trains a drafter for
  (mtp.init_from, default `workdir` itself)."""
  return (os.path.abspath(os.path.expanduser(config.mtp.init_from)) if config.mtp.init_from
          else workdir)


def uses_pretrained(config: Any, workdir: str) -> bool:
  """Whether the policy of `workdir` is `sft.init_from_hf` as it is: no SFT stage ran there."""
  return bool(config.sft.init_from_hf) and not os.path.isdir(checkpoint_dir(workdir, "sft"))


def initial_policy(config: Any, model_cfg: Any, mesh, rules) -> Any:
  """The policy SFT starts from: a random initialisation, or (sft.init_from_hf) a Hugging Face
  Qwen3 checkpoint placed onto the mesh, its MTP modules by sft.hf_mtp (hf.MTP_MODES). The
  parameters SFT does not train keep these values, so restoring a policy takes them from
  here too."""
  from bebop_jax.model import hf  # pylint: disable=g-import-not-at-top
  from bebop_jax.model import model as policy_lib  # pylint: disable=g-import-not-at-top
  path = config.sft.init_from_hf
  if not path:
    return policy_lib.Policy(model_cfg, rngs=nnx.Rngs(config.seed))
  cfg, state = hf.import_checkpoint(
      path, mesh=mesh, rules=rules, dtype=model_cfg.param_dtype, mtp=config.sft.hf_mtp,
      num_mtp_modules=model_cfg.num_mtp_modules, num_draft_steps=model_cfg.num_draft_steps,
      seed=config.seed, vocab_size=model_cfg.vocab_size)
  hf.check_matches(cfg, model_cfg, f"config.sft.init_from_hf={path!r}")
  # config.model's graph: its compute dtype, attention and remat choices over these weights.
  print(f"[sft] starting from {path} ({policy_lib.num_params(state) / 1e6:.1f}M parameters, "
        f"MTP modules: {config.sft.hf_mtp})")
  return nnx.merge(policy_lib.abstract_state(model_cfg)[0], state)


def restore_policy(config: Any, workdir: str, *, stage: str = "mtp", step: int | None = None,
                   mesh=None, rules=None) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, parameters) of the policy `stage` left in `workdir`, for inference.

  Only parameters are read (Checkpointer.restore_params): no optimizer is built and no
  optimizer state is read, so every inference path (the eval stage, the findings, the
  benchmarks, the RL stage's starting point) depends on the checkpoints alone, not on the
  training configuration that wrote them.

  Args:
    config: the run's config (model shape, sft.init_from_hf, mtp.init_from, seed).
    workdir: the workdir holding `stage`'s checkpoints.
    stage: "sft": the SFT policy (with its jointly trained MTP modules); its parameters SFT
      did not train, and with sft.init_from_hf and no SFT stage in `workdir` all of them,
      come from `initial_policy`. "mtp": that policy (of `sft_workdir(config, workdir)`)
      with the MTP stage's trained subset over it. "rl": the RL stage's trunk and MTP
      modules (its checkpoints hold every parameter).
    step: the step of `stage`'s checkpoint (None: the latest); earlier stages' latest.
    mesh, rules: place every parameter on its sharding under these logical-axis rules (None:
      everything on this process's first device, multihost.local_device()).

  Raises:
    FileNotFoundError: `stage` has no checkpoint in `workdir`.
  """
  from bebop_jax import sharding  # pylint: disable=g-import-not-at-top
  from bebop_jax.model import config as model_config  # pylint: disable=g-import-not-at-top
  from bebop_jax.model import model as policy_lib  # pylint: disable=g-import-not-at-top
  if stage not in PARAM_KEYS:
    raise ValueError(f"stage={stage!r} is not allowed: one of {tuple(PARAM_KEYS)}")
  model_cfg = model_config.ModelConfig.from_dict(config.model.to_dict())
  rules = sharding.DEFAULT_RULES if rules is None else rules
  graphdef, abstract = policy_lib.abstract_state(model_cfg)
  abstract = abstract_like(abstract, SingleDeviceSharding(multihost.local_device())
                           if mesh is None else sharding.state_shardings(abstract, mesh, rules))

  def placed(params: nnx.State) -> nnx.State:
    return jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), params,
                        _only(abstract, _paths(params)))

  def load(stage: str, workdir: str, step: int | None) -> nnx.State:
    if stage == "sft" and uses_pretrained(config, workdir):
      return placed(nnx.state(initial_policy(config, model_cfg, mesh, rules)))
    directory = checkpoint_dir(workdir, stage)
    if not os.path.isdir(directory):  # a Checkpointer would create it
      raise FileNotFoundError(f"no {stage} checkpoint in {workdir}: run the {stage!r} stage")
    with Checkpointer(directory) as ckpt:
      params = ckpt.restore_params(step, abstract, PARAM_KEYS[stage])
    missing = _paths(abstract) - _paths(params)
    if not missing:
      return params
    if stage == "sft":
      base = nnx.state(initial_policy(config, model_cfg, mesh, rules))
    elif stage == "mtp":
      base = load("sft", sft_workdir(config, workdir), None)
    else:
      raise CheckpointMismatchError(
          f"the RL checkpoint in {workdir} lacks parameters: "
          f"{sorted('/'.join(map(str, p)) for p in missing)[:3]}")
    return nnx.merge_state(placed(_only(base, missing)), params)

  return graphdef, load(stage, workdir, step)


def _paths(state: nnx.State) -> set[tuple]:
  """The paths of the leaves of an nnx state."""
  return {tuple(path) for path, _ in state.flat_state()}


def _only(state: nnx.State, paths: set[tuple]) -> nnx.State:
  """The part of `state` at `paths`."""
  return state.filter(lambda path, _: tuple(path) in paths)


def stage_dir(workdir: str, stage: str) -> str:
  """Where `stage` keeps its files in `workdir` (checkpoints, summary.json)."""
  return os.path.join(workdir, stage)


def read_summary(workdir: str, stage: str) -> dict[str, Any] | None:
  """The summary `stage` wrote in `workdir` when it completed (the eval stage's is the job's
  <workdir>/summary.json), or None when it has not completed there."""
  path = (os.path.join(workdir, "summary.json") if stage == "eval"
          else os.path.join(stage_dir(workdir, stage), "summary.json"))
  return metrics_lib.read_json(path)


DRAFT_COUNTS = "draft_token_counts.npy"


DRAFT_VOCAB = "draft_vocab.npy"  # the reduced vocabulary the drafter drafts from


def write_draft_counts(workdir: str, counts: np.ndarray) -> None:
  path = os.path.join(stage_dir(workdir, "mtp"), DRAFT_COUNTS)
  tmp = path + ".tmp.npy"
  np.save(tmp, counts)
  os.replace(tmp, path)


def draft_vocabulary(workdir: str, size: int,
                     always: Sequence[int] = ()) -> tuple[np.ndarray, float]:
  """(ids [size] int32 sorted, coverage): the reduced draft vocabulary of the workdir's
  drafter, its `size` most frequent policy tokens (decoding/draft_vocab.py) plus `always`
  (the stop tokens), and the share of the drafter's training tokens it covers. The counts
  are those the MTP stage stored with the drafter."""
  path = os.path.join(stage_dir(workdir, "mtp"), DRAFT_COUNTS)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no draft token counts in {stage_dir(workdir, 'mtp')} ({DRAFT_COUNTS}): "
                            f"run the MTP stage for this workdir")
  counts = np.load(path)
  ids = draft_vocab_lib.top_tokens(counts, size, always)
  return ids, draft_vocab_lib.coverage(counts, ids)


def stored_vocabulary_path(workdir: str) -> str:
  return os.path.join(stage_dir(workdir, "mtp"), DRAFT_VOCAB)


def stored_draft_vocabulary(workdir: str) -> np.ndarray | None:
  """The reduced draft vocabulary stored with the MTP stage's drafter in `workdir` (sorted
  int32 token ids), or None (the drafter drafts from the whole head)."""
  path = stored_vocabulary_path(workdir)
  return np.load(path) if os.path.exists(path) else None
