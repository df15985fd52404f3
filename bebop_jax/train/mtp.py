"""MTP stage: train the drafter on the frozen SFT policy's own rollouts, then measure it.

1. Load the SFT policy (from `mtp.init_from`, default this workdir) and freeze everything
   but the MTP modules (`mtp.optim.trainable`, "mtp" by default).
2. Self-distillation data: sample the policy at `mtp.temperature` on training prompts of every
   task (the agentic ones with the environment in the loop), with speculative decoding, which
   samples exactly the policy's distribution. Prompt, policy turns and tool replies form one
   sequence; the loss targets are the policy's tokens. Sequences are packed into rows of
   data.seq_len. The rollouts are cached under the SFT workdir (mtp_data/), keyed by the
   settings, so every loss of a sweep trains on the same data.
3. Train with `mtp.loss` (ce, kl, tv, e2e_tv; bebop_jax.losses.mtp), the trunk's forward
   under stop-gradient.
4. Evaluate on held-out prompts: teacher-forced per-depth acceptance on held-out rollouts
   (plain mean over positions and weighted by the probability of reaching the depth, as
   online decoding visits them), and online speculative decoding at `mtp.temperature` in every
   `mtp.eval_modes`: per-depth acceptance, tokens per target forward and pass@1. The SFT
   drafter (before this stage) is measured the same way for comparison.

Workdir layout: <workdir>/mtp/checkpoints (orbax: MTP parameters, optimizer, data iterator),
<workdir>/mtp/summary.json when complete; metrics in <workdir>/metrics.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Sequence

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from bebop_jax import evaluation
from bebop_jax import rollout
from bebop_jax import sharding
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import pipeline
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.data.tokenizer import get_tokenizer
from bebop_jax.decoding import batching, diagnostics, sampling
from bebop_jax.decoding import draft_vocab as draft_vocab_lib
from bebop_jax.losses import mtp as mtp_losses
from bebop_jax.model import model as policy_lib
from bebop_jax.model.config import ModelConfig
from bebop_jax.train import checkpoint as checkpoint_lib
from bebop_jax.train import flops as flops_lib
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.train import optimizer as optimizer_lib
from bebop_jax.train import sft
from bebop_jax.train import trainer

STAGE = "mtp"
_ROW_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")


def stage_dir(workdir: str) -> str:
  return os.path.join(workdir, STAGE)


def read_summary(workdir: str) -> dict[str, Any] | None:
  """The completed stage's summary, or None."""
  return metrics_lib.read_json(os.path.join(stage_dir(workdir), "summary.json"))


sft_workdir = checkpoint_lib.sft_workdir  # where the policy the drafter is for was trained


# ----------------------------------------------------------------------------- rollouts


def sample_rollouts(graphdef: nnx.GraphDef, params: nnx.State,
                    examples: dict[str, Sequence[tasks_lib.Example]],
                    task_objs: dict[str, tasks_lib.Task], rng: jax.Array,
                    settings: rollout.RolloutSettings, progress: bool = False,
                    desc: str = f"[{STAGE}] rollouts") -> dict[str, rollout.Rollouts]:
  """{task: one rollout per example} from the rollout engine (`progress`: a bar with an
  ETA titled `desc`, a step per task)."""
  engine = rollout.JaxEngine(graphdef, params, task_objs, settings)
  bar = metrics_lib.Progress(sum(len(e) for e in examples.values()), 0, desc,
                             disable=not progress, unit="prompt")
  out = {}
  for name, exs in examples.items():
    rng, key = jax.random.split(rng)
    out[name] = engine.generate(exs, key)
    bar.update(len(exs))
  bar.close()
  return out


def pack_rows(sequences: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int
              ) -> dict[str, np.ndarray]:
  """First-fit packing of (tokens, loss_mask) sequences into rows [R, seq_len] with segment
  ids (1, 2, ... per sequence; 0 = padding) and per-sequence positions. Longer sequences are
  cut to seq_len."""
  rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
  free: list[int] = []
  for tokens, mask in sorted(sequences, key=lambda s: -len(s[0])):
    tokens, mask = tokens[:seq_len], mask[:seq_len]
    for r, room in enumerate(free):
      if room >= len(tokens):
        rows[r].append((tokens, mask))
        free[r] -= len(tokens)
        break
    else:
      rows.append([(tokens, mask)])
      free.append(seq_len - len(tokens))
  out = {k: np.zeros((len(rows), seq_len), np.int32) for k in _ROW_KEYS}
  for r, row in enumerate(rows):
    at = 0
    for seg, (tokens, mask) in enumerate(row, start=1):
      n = len(tokens)
      out["tokens"][r, at:at + n] = tokens
      out["loss_mask"][r, at:at + n] = mask
      out["segment_ids"][r, at:at + n] = seg
      out["positions"][r, at:at + n] = np.arange(n)
      at += n
  return out


def _data_key(config: ml_collections.ConfigDict, split: str, num: int) -> str:
  m, d = config.mtp, config.data
  key = {"split": split, "num": num, "temperature": m.temperature,
         "max_new_tokens": m.data.max_new_tokens, "seed": config.seed,
         "tasks": d.tasks.to_dict(), "data_seed": d.seed,
         "num_train": d.num_train, "num_test": d.num_test}
  if d.tokenizer != tokenizer_lib.CHAR:  # the cache holds ids; char caches keep their names
    key["tokenizer"] = tokenizer_lib.for_data(d).fingerprint
  blob = json.dumps(key, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _examples(config, split: str, per_task: dict[str, int]) -> dict[str, list]:
  return {n: pipeline.eval_examples(config.data, n, k, split=split) for n, k in per_task.items()}


def _per_task(config, total: int) -> dict[str, int]:
  names = [n for n in tasks_lib.TASK_NAMES if config.data.tasks[n].weight > 0]
  weights = np.array([config.data.tasks[n].weight for n in names], float)
  counts = np.maximum(1, np.round(total * weights / weights.sum())).astype(int)
  return dict(zip(names, counts.tolist()))


def policy_rollouts(config: ml_collections.ConfigDict, graphdef, params, split: str,
                    per_task: dict[str, int], *, progress: bool = False,
                    desc: str = f"[{STAGE}] rollouts") -> dict[str, rollout.Rollouts]:
  """{task: one rollout per prompt} of the first `per_task[task]` `split` prompts, sampled
  from `params` with the MTP stage's settings (temperature, budget, batch; full support) and
  its key for the split. Not cached (self_distillation_data caches them)."""
  m = config.mtp
  task_objs = {n: tasks_lib.get_task(n, **config.data.tasks[n].knobs) for n in per_task}
  return sample_rollouts(
      graphdef, params, _examples(config, split, per_task), task_objs,
      jax.random.key(config.seed + (17 if split == "train" else 29)),
      evaluation.settings(config, temperature=m.temperature, top_k=0, top_p=1.0,
                          max_new_tokens=m.data.max_new_tokens, batch_size=m.data.batch_size),
      progress=progress, desc=desc)


def self_distillation_data(config: ml_collections.ConfigDict, graphdef, params, data_dir: str,
                           split: str, per_task: dict[str, int]) -> dict[str, Any]:
  """Cached rollouts of the policy on `split` prompts: {"sequences": [(tokens, mask)], ...}.
  Written atomically (tmp + rename), so an interrupted run regenerates, never half-reads."""
  os.makedirs(data_dir, exist_ok=True)
  path = os.path.join(data_dir, f"{split}_{_data_key(config, split, sum(per_task.values()))}"
                                f".npz")
  if os.path.exists(path):
    with np.load(path) as f:
      tokens, masks, lengths = f["tokens"], f["loss_mask"], f["lengths"]
      meta = json.loads(str(f["meta"]))
    return {"sequences": [(tokens[i, :n], masks[i, :n]) for i, n in enumerate(lengths)],
            "cached": True, **meta}
  start = time.perf_counter()
  rollouts = policy_rollouts(config, graphdef, params, split, per_task,
                             progress=config.mtp.train.progress)
  seqs = [seq for r in rollouts.values() for seq in r.sequences()]
  meta = {"seconds": time.perf_counter() - start,
          "reward": {n: float(r.rewards.mean()) for n, r in rollouts.items()},
          "policy_tokens": int(sum(r.policy_tokens() for r in rollouts.values()))}
  longest = max(len(t) for t, _ in seqs)
  tokens = np.zeros((len(seqs), longest), np.int32)
  masks = np.zeros_like(tokens)
  for i, (t, mk) in enumerate(seqs):
    tokens[i, :len(t)], masks[i, :len(t)] = t, mk
  tmp = path + ".tmp.npz"
  np.savez(tmp, tokens=tokens, loss_mask=masks, lengths=np.array([len(t) for t, _ in seqs]),
           meta=json.dumps(meta))
  os.replace(tmp, path)
  return {"sequences": seqs, "cached": False, **meta}


class _Rows:
  """A grain source over packed rows."""

  def __init__(self, rows: dict[str, np.ndarray]):
    self.rows = rows

  def __len__(self):
    return len(self.rows["tokens"])

  def __getitem__(self, i):
    return {k: v[i] for k, v in self.rows.items()}


def train_dataset(rows: dict[str, np.ndarray], batch_size: int, seed: int) -> grain.IterDataset:
  """Endless shuffled batches of packed rows (checkpointable iterator)."""
  if not len(rows["tokens"]):
    raise ValueError("no self-distillation data; raise mtp.data.num_prompts")
  return (grain.MapDataset.source(_Rows(rows)).shuffle(seed=seed).repeat()
          .batch(batch_size, drop_remainder=True).to_iter_dataset(pipeline.READ_OPTIONS))


# ----------------------------------------------------------------------------- evaluation


def teacher_forced_acceptance(graphdef, params, sequences, *, temperature: float,
                              modes: Sequence[str], batch_size: int = 64,
                              buckets: Sequence[int] = batching.PROMPT_BUCKETS,
                              pack_length: int | None = None
                              ) -> dict[str, dict[str, list[float]]]:
  """Per mode: per-depth acceptance over the policy tokens of held-out rollouts, plain
  ("alpha_unweighted") and weighted by the probability of reaching the depth ("alpha"), and
  the positions each depth was scored at ("positions": the weights that combine results of
  several calls, as this function combines its batches).

  The sequences are packed (first-fit-decreasing, each its own segment) into rows of
  `pack_length` positions (default: the bucket that holds the longest), up to `batch_size`
  rows per forward."""
  params_s = sampling.SamplingParams(temperature=temperature)
  lengths = np.asarray([len(t) for t, _ in sequences])
  length = pack_length or batching.bucket(int(lengths.max()), buckets)
  keys = ("alpha", "alpha_unweighted")
  sums = {mode: {k: 0.0 for k in keys} for mode in modes}
  weights = {mode: 0.0 for mode in modes}
  bins = batching.first_fit_decreasing(lengths, length)
  for seq, gen, seg, pos in diagnostics.packed_batches(sequences, bins, batch_size, length):
    out = jax.device_get(diagnostics.teacher_forced_acceptance_by_mode(
        graphdef, params, jnp.asarray(seq), jnp.asarray(gen), jnp.asarray(seg),
        jnp.asarray(pos), params=params_s, modes=tuple(modes)))
    # Combine batches by their position counts (exact for the plain mean; the weighted
    # one is combined by positions too, a close approximation across batches).
    for mode in modes:
      n = np.asarray(out[mode]["positions"], float)
      for key in keys:
        sums[mode][key] = sums[mode][key] + np.asarray(out[mode][key]) * n
      weights[mode] = weights[mode] + n
  return {mode: {**{k: (sums[mode][k] / np.maximum(weights[mode], 1)).tolist() for k in keys},
                 "positions": np.asarray(weights[mode], float).tolist()}
          for mode in modes}


def online_evaluation(config: ml_collections.ConfigDict, graphdef, params, examples,
                      task_objs, *, modes: Sequence[str]) -> dict[str, Any]:
  """Speculative decoding on held-out prompts at mtp.temperature, per mode: per-depth
  acceptance, tokens per target forward (Rollouts.tokens_per_target_forward: the policy
  tokens verifications emitted per verification), pass@1, overall and per task, and
  seconds."""
  results = {}
  for mode in modes:
    start = time.perf_counter()
    engine = rollout.JaxEngine(graphdef, params, task_objs, evaluation.settings(
        config, temperature=config.mtp.temperature, top_k=0, top_p=1.0, mode=mode))
    by_task = evaluation.rollouts_by_task(engine, examples, seed=config.seed)
    accuracy = evaluation.pass_at_1(by_task)
    per_task = {n: {**_acceptance(r), "accuracy": accuracy[n]} for n, r in by_task.items()}
    results[mode] = {**_acceptance(rollout.Rollouts.concatenate(list(by_task.values()))),
                     "accuracy": accuracy, "per_task": per_task,
                     "seconds": time.perf_counter() - start}
  return results


def _acceptance(r: rollout.Rollouts) -> dict[str, Any]:
  return {"acceptance": r.acceptance().tolist(),
          "tokens_per_target_forward": r.tokens_per_target_forward()}


def evaluate_drafter(config, graphdef, params, heldout_sequences, examples, task_objs
                     ) -> dict[str, Any]:
  modes = tuple(config.mtp.eval_modes)
  return {"teacher_forced": teacher_forced_acceptance(
              graphdef, params, heldout_sequences, temperature=config.mtp.temperature,
              modes=modes, batch_size=config.eval.batch_size,
              buckets=tuple(config.eval.prompt_buckets)),
          "online": online_evaluation(config, graphdef, params, examples, task_objs,
                                      modes=modes)}


# ----------------------------------------------------------------------------- the stage


def load_workdir_policy(config: ml_collections.ConfigDict, workdir: str | None, *,
                        which: str = "auto") -> tuple[nnx.GraphDef, nnx.State, str]:
  """(graphdef, parameters, where they came from) for benchmarks: the MTP stage's policy
  (which "mtp", or "auto" when that stage completed in `workdir`), else the SFT stage's
  (with its jointly trained MTP module), else a random policy of the config's shape (also
  for which "random")."""
  if which not in ("auto", "mtp", "sft", "random"):
    raise ValueError(f"which={which!r} is not allowed: one of auto, mtp, sft, random")
  use_mtp = which == "mtp" or (which == "auto" and workdir and read_summary(workdir) is not None)
  if which != "random" and workdir and use_mtp:
    return (*checkpoint_lib.restore_policy(config, workdir, stage="mtp"),
            f"sft + mtp checkpoint in {workdir}")
  if which != "random" and workdir and sft.read_summary(workdir) is not None:
    return (*checkpoint_lib.restore_policy(config, workdir, stage="sft"),
            f"sft checkpoint in {workdir}")
  return (*policy_lib.init(ModelConfig.from_dict(config.model.to_dict()), config.seed),
          "random_init")


def _reinit_mtp(config, model_cfg: ModelConfig, params: nnx.State) -> nnx.State:
  """`params` with the MTP modules freshly initialised (the drafter learned from scratch)."""
  fresh = nnx.state(policy_lib.Policy(model_cfg, rngs=nnx.Rngs(
      config.seed + 1 + 7919 * config.mtp.seed)))
  mtp_filter = nnx.All(nnx.Param, nnx.PathContains("mtp"))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  keep = params.filter(nnx.Not(mtp_filter))
  return nnx.merge_state(keep, jax.device_put(fresh.filter(mtp_filter), device))


def make_loss_fn(config: ml_collections.ConfigDict):
  """The MTP stage's loss_fn(model, batch) -> (loss, metrics) (the trunk detached)."""
  m = config.mtp
  depth_weights = tuple(m.depth_weights) or None
  impl = None if m.tv_implementation == "auto" else m.tv_implementation

  def loss_fn(model, batch):
    out = model(batch["tokens"], batch["positions"], batch["segment_ids"],
                mtp_stop_gradient=True, logits=m.head == "dense", frozen_layers=True)
    return mtp_losses.mtp_loss(out, batch["tokens"], batch["loss_mask"], loss=m.loss,
                               depth_weights=depth_weights, tv_implementation=impl,
                               tv_interpret=m.tv_interpret,
                               temperature=m.temperature)

  return loss_fn


def split(model, config):
  """(graphdef, trainable, frozen) of the MTP stage: config.mtp.optim.trainable trains."""
  return nnx.split(model, optimizer_lib.trainable_filter(config.mtp.optim.trainable), ...)


DRAFT_COUNTS = "draft_token_counts.npy"


def _write_draft_counts(workdir: str, counts: np.ndarray) -> None:
  path = os.path.join(stage_dir(workdir), DRAFT_COUNTS)
  tmp = path + ".tmp.npy"
  np.save(tmp, counts)
  os.replace(tmp, path)


def draft_vocabulary(config: ml_collections.ConfigDict, workdir: str, size: int,
                     always: Sequence[int] = ()) -> tuple[np.ndarray, float]:
  """(ids [size] int32 sorted, coverage): the reduced draft vocabulary of the workdir's
  drafter, its `size` most frequent policy tokens (decoding/draft_vocab.py) plus `always`
  (the stop tokens), and the share of the drafter's training tokens it covers. The counts
  are those the MTP stage stored with the drafter; a drafter trained before they were
  stored gets them from its cached training rollouts (mtp_data)."""
  path = os.path.join(stage_dir(workdir), DRAFT_COUNTS)
  if os.path.exists(path):
    counts = np.load(path)
  else:
    data_dir = os.path.join(sft_workdir(config, workdir), "mtp_data")
    cached = sorted(f for f in os.listdir(data_dir) if f.startswith("train_")) \
        if os.path.isdir(data_dir) else []
    if not cached:
      raise FileNotFoundError(f"no draft token counts in {stage_dir(workdir)} and no cached "
                              f"MTP training rollouts in {data_dir}: run the MTP stage")
    with np.load(os.path.join(data_dir, cached[-1])) as f:
      seqs = [(f["tokens"][i, :n], f["loss_mask"][i, :n]) for i, n in enumerate(f["lengths"])]
    counts = draft_vocab_lib.count_tokens([t for t, _ in seqs], [m for _, m in seqs],
                                          config.model.vocab_size)
  ids = draft_vocab_lib.top_tokens(counts, size, always)
  return ids, draft_vocab_lib.coverage(counts, ids)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs (or resumes, or skips when complete) the MTP stage; returns its summary."""
  done = read_summary(workdir)
  if done is not None:
    print(f"[mtp] complete in {stage_dir(workdir)} (loss {done['loss']}): skipping")
    return done
  m = config.mtp
  source = sft_workdir(config, workdir)
  if sft.read_summary(source) is None and not checkpoint_lib.uses_pretrained(config, source):
    raise FileNotFoundError(f"the MTP stage needs a completed SFT stage in {source} "
                            "(run the 'sft' stage first, set mtp.init_from, or start from "
                            "a pretrained checkpoint with sft.init_from_hf)")
  if checkpoint_lib.uses_pretrained(config, source):
    print(f"[mtp] no SFT stage in {source}: the drafter is trained for the pretrained "
          f"policy {config.sft.init_from_hf}")
  os.makedirs(stage_dir(workdir), exist_ok=True)
  stage_start = time.perf_counter()
  timing = {}
  model_cfg = ModelConfig.from_dict(config.model.to_dict())
  mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
  rules = tuple(tuple(r) for r in config.mesh.rules)

  graphdef0, sft_params = checkpoint_lib.restore_policy(config, source, stage="sft")
  data_dir = os.path.join(source, "mtp_data")
  t0 = time.perf_counter()
  train_data = self_distillation_data(config, graphdef0, sft_params, data_dir, "train",
                                      _per_task(config, m.data.num_prompts))
  per_task_eval = {n: config.eval.num_examples for n in _per_task(config, 1)}
  heldout = self_distillation_data(config, graphdef0, sft_params, data_dir, "test",
                                   per_task_eval)
  timing["rollouts_s"] = time.perf_counter() - t0
  # The drafter's token counts (the policy tokens of its training rollouts), stored with it:
  # a reduced draft vocabulary is chosen from them (draft_vocabulary).
  _write_draft_counts(workdir, draft_vocab_lib.count_tokens(
      [t for t, _ in train_data["sequences"]], [mk for _, mk in train_data["sequences"]],
      model_cfg.vocab_size))
  rows = pack_rows(train_data["sequences"], config.data.seq_len)
  print(f"[mtp] self-distillation data: {len(train_data['sequences'])} rollouts "
        f"({train_data['policy_tokens']} policy tokens, rewards {train_data['reward']}"
        f"{', cached' if train_data['cached'] else ''}) in {len(rows['tokens'])} rows of "
        f"{config.data.seq_len}")

  task_objs = {n: tasks_lib.get_task(n, **config.data.tasks[n].knobs) for n in per_task_eval}
  examples = {n: pipeline.eval_examples(config.data, n, k) for n, k in per_task_eval.items()}
  before_path = os.path.join(stage_dir(workdir), "before.json")
  before = None
  if m.eval_before:
    if os.path.exists(before_path):
      with open(before_path) as f:
        before = json.load(f)
    else:
      t0 = time.perf_counter()
      before = evaluate_drafter(config, graphdef0, sft_params, heldout["sequences"], examples,
                                task_objs)
      timing["eval_before_s"] = time.perf_counter() - t0
      metrics_lib.write_json_atomic(before_path, before)
    print(f"[mtp] SFT drafter: {_describe(before)}")

  if m.reinit:
    sft_params = _reinit_mtp(config, model_cfg, sft_params)
  model = nnx.merge(graphdef0, sft_params)
  graphdef, trainable, frozen = split(model, config)
  num_steps = m.train.num_steps
  tx, schedule = optimizer_lib.make_optimizer(m.optim, num_steps)
  state = trainer.place_state(
      trainer.TrainState(trainable, frozen, tx.init(trainable), 0), mesh, rules, tx)
  dataset = train_dataset(rows, m.batch_size, config.seed + 7919 * m.seed)
  data_iter = iter(dataset)
  checkpointer = checkpoint_lib.Checkpointer(
      checkpoint_lib.checkpoint_dir(workdir, STAGE), keep_last=m.train.keep_checkpoints)
  state, latest = trainer.resume(checkpointer, state, data_iter)
  if latest is not None:
    print(f"[mtp] resumed from step {latest}")
  step_fn = trainer.make_train_step(graphdef, make_loss_fn(config), tx, schedule,
                                    m.train.grad_accum_steps)
  example_batch = next(iter(dataset))
  compiled = trainer.compile_train_step(step_fn, state, example_batch, mesh, rules, tx)
  print(f"[mtp] train step ({m.loss}) compiled in {compiled.compile_seconds:.1f}s")
  t0 = time.perf_counter()
  with sharding.use_mesh(mesh, rules):
    state, summary = trainer.train_loop(
        stage=STAGE, workdir=workdir, state=state, compiled=compiled, batches=data_iter,
        loop=trainer.LoopConfig(num_steps=num_steps, log_every=m.train.log_every,
                                eval_every=0, checkpoint_every=m.train.checkpoint_every,
                                progress=m.train.progress, stop_at_step=m.train.stop_at_step),
        checkpointer=checkpointer, data_iterator=data_iter,
        batch_sh=trainer.batch_shardings(example_batch, mesh, rules),
        flops_per_step=flops_lib.train_flops_per_step(
            model_cfg, m.batch_size, config.data.seq_len, model_cfg.num_draft_steps,
            trainable_main=False))
  checkpointer.close()
  timing["train_s"] = time.perf_counter() - t0
  if not summary["complete"]:
    print(f"[mtp] stopped at step {summary['steps']} of {num_steps}; rerun to resume")
    return summary
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = jax.device_put(nnx.merge_state(state.trainable, state.frozen), device)
  t0 = time.perf_counter()
  after = evaluate_drafter(config, graphdef, params, heldout["sequences"], examples, task_objs)
  timing["eval_s"] = time.perf_counter() - t0
  timing["total_s"] = time.perf_counter() - stage_start
  summary.update(loss=m.loss, before=before, after=after, timing=timing,
                 num_rollouts=len(train_data["sequences"]),
                 policy_tokens=train_data["policy_tokens"], rollout_reward=train_data["reward"])
  metrics_lib.write_json_atomic(os.path.join(stage_dir(workdir), "summary.json"), summary)
  print(f"[mtp] done ({m.loss}): {_describe(after)}")
  return summary


def _describe(ev: dict[str, Any]) -> str:
  parts = []
  for mode, r in ev["online"].items():
    tf = ev["teacher_forced"][mode]["alpha"]
    parts.append(f"{mode}: online {'/'.join(f'{a:.3f}' for a in r['acceptance'])} "
                 f"(teacher-forced {'/'.join(f'{a:.3f}' for a in tf)}), "
                 f"{r['tokens_per_target_forward']:.2f} tokens/forward")
  return "; ".join(parts)
