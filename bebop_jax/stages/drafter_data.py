"""The drafter dataset of a config and a workdir: the policy's own rollouts on training and
held-out prompts, sampled once and stored by split under the SFT workdir (keyed by the
settings, so every loss and seed of a sweep trains on the same data). The MTP stage trains on
it; the eval stage re-scores the held-out part."""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from bebop_jax import rollout
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import drafter_store as drafter_store_lib
from bebop_jax.data import pipeline
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.stages import config as config_lib
from bebop_jax.stages import lineage
from bebop_jax.stages import rollouts
from bebop_jax.train import drafter


def store_key(config: ml_collections.ConfigDict) -> str:
  """The drafter store's key: everything the policy's rollouts depend on besides the policy
  (the store lives under the policy's workdir) and the number of prompts (the split's)."""
  m, d = config.mtp, config.data
  key = {"temperature": m.temperature, "max_new_tokens": m.data.max_new_tokens,
         "seed": config.seed, "tasks": d.tasks.to_dict(), "data_seed": d.seed,
         "num_train": d.num_train, "num_test": d.num_test}
  if d.tokenizer != tokenizer_lib.CHAR:  # the store holds ids; char stores keep their names
    key["tokenizer"] = config_lib.settings(config).data.loaded_tokenizer.fingerprint
  blob = json.dumps(key, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:12]


def drafter_store(config: ml_collections.ConfigDict, workdir: str) -> drafter_store_lib.DrafterStore:
  """The store of the drafter dataset of the policy the MTP stage of `workdir` trains for:
  <sft workdir>/drafter_data/<store_key>, shared by every objective and seed."""
  return drafter_store_lib.DrafterStore(
      os.path.join(lineage.sft_workdir(config, workdir), "drafter_data", store_key(config)))


def prompts_per_task(config, total: int) -> dict[str, int]:
  names = [n for n in tasks_lib.TASK_NAMES if config.data.tasks[n].weight > 0]
  weights = np.array([config.data.tasks[n].weight for n in names], float)
  counts = np.maximum(1, np.round(total * weights / weights.sum())).astype(int)
  return dict(zip(names, counts.tolist()))


def heldout_tasks(config: ml_collections.ConfigDict) -> dict[str, int]:
  """{task: eval.num_examples} of the drafter dataset's held-out split."""
  return {n: config.eval.num_examples for n in prompts_per_task(config, 1)}


def policy_rollouts(config: ml_collections.ConfigDict, graphdef, params, split: str,
                    per_task: dict[str, int], *, progress: bool = False,
                    desc: str = "[mtp] rollouts", engine: str = "speculative",
                    return_hidden: bool | None = None) -> dict[str, rollout.Rollouts]:
  """{task: one rollout per prompt} of the first `per_task[task]` `split` prompts, sampled
  from `params` with the MTP stage's settings (temperature, budget, batch; full support) and
  its key for the split, by `engine` (the same law either way; autoregressive rollouts keep
  the trunk's h0, Rollouts.hidden, unless `return_hidden` is False). Not stored
  (`drafter_dataset` stores them)."""
  if return_hidden is None:
    return_hidden = engine == "autoregressive"
  m, data = config.mtp, config_lib.settings(config).data
  task_objs = {n: tasks_lib.get_task(n, **data.tasks[n].knobs) for n in per_task}
  examples = {n: pipeline.eval_examples(data, n, k, split=split) for n, k in per_task.items()}
  return drafter.sample_rollouts(
      graphdef, params, examples, task_objs,
      jax.random.key(config.seed + (17 if split == "train" else 29)),
      rollouts.eval_settings(config, engine=engine, temperature=m.temperature, top_k=0,
                          top_p=1.0, max_new_tokens=m.data.max_new_tokens,
                          batch_size=m.data.batch_size, return_hidden=return_hidden),
      tokenizer=data.loaded_tokenizer, progress=progress, desc=desc)


def drafter_dataset(config: ml_collections.ConfigDict, graphdef, params,
                    store: drafter_store_lib.DrafterStore, split: str,
                    per_task: dict[str, int]) -> dict[str, Any]:
  """The policy's rollouts on the first `per_task` prompts of `split`, from `store`, sampled
  (by mtp.data.engine, at mtp.data.batch_size) and stored first when the store lacks them:
  {"records": [{tokens, loss_mask, task, reward}], "sequences": [(tokens, loss_mask)],
  "cached": bool, "seconds", "reward" {task: mean}, "policy_tokens", "per_task"}."""
  meta = store.meta()["splits"].get(split)
  if meta is not None and meta.get("per_task") == per_task and store.has_split(split):
    records = store.read_split(split)
    return {"records": records, "sequences": drafter_store_lib.sequences(records),
            "cached": True, **meta}
  start = time.perf_counter()
  rollouts = policy_rollouts(config, graphdef, params, split, per_task,
                             progress=config.mtp.train.progress,
                             engine=config.mtp.data.engine)
  hidden = None  # autoregressive decoding kept h0 at every position: the trunk features
  if all(r.hidden is not None for r in rollouts.values()):
    hidden = [h for r in rollouts.values() for h in r.hidden]
  records = [{"tokens": tokens, "loss_mask": mask, "task": name, "reward": float(reward)}
             for name, r in rollouts.items()
             for (tokens, mask), reward in zip(r.sequences(), r.rewards)]
  meta = {"seconds": time.perf_counter() - start, "per_task": per_task,
          "engine": config.mtp.data.engine, "batch_size": config.mtp.data.batch_size,
          "reward": {n: float(r.rewards.mean()) for n, r in rollouts.items()},
          "policy_tokens": int(sum(r.policy_tokens() for r in rollouts.values()))}
  store.write_split(split, records, meta)
  return {"records": records, "sequences": drafter_store_lib.sequences(records),
          "cached": False, "hidden": hidden, **store.meta()["splits"][split]}


def heldout_sequences(config: ml_collections.ConfigDict, workdir: str, graphdef, params
                      ) -> list[tuple[np.ndarray, np.ndarray]]:
  """(tokens, loss_mask) of the drafter dataset's held-out split (stored by the MTP stage;
  sampled from `params` when absent)."""
  return drafter_dataset(config, graphdef, params, drafter_store(config, workdir), "test",
                         heldout_tasks(config))["sequences"]
