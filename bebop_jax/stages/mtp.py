"""MTP stage: train the drafter on the frozen SFT policy's own rollouts, then measure it.

1. Load the SFT policy (from `mtp.init_from`, default this workdir) and freeze everything
   but the MTP modules (`mtp.optim.trainable`, "mtp" by default).
2. Self-distillation data (the drafter dataset): sample the policy at `mtp.temperature` on
   training prompts of every task (the agentic ones with the environment in the loop), once,
   with the engine of `mtp.data.engine` (autoregressive by default, which keeps the trunk's
   hidden state at every position). Prompt, policy turns and tool replies form one sequence;
   the loss targets are the policy's tokens. The records are stored by split under the SFT
   workdir (drafter_data/<key>, array_record read through grain, keyed by the settings), so
   every loss and seed of a sweep trains on the same data. Sequences are packed into rows
   of `mtp.seq_len` with a cap on loss targets per row.
3. Train with `mtp.loss` (ce, kl, tv, e2e_tv; bebop_jax.losses.mtp), after a warm start of
   `mtp.warm_start.steps` with `mtp.warm_start.loss` if set; the trunk frozen (its features
   from `mtp.features`), the draft heads only at the loss rows and over the drafter's
   reduced vocabulary (`mtp.draft_vocab`).
4. Evaluate on held-out prompts: teacher-forced per-depth acceptance on held-out rollouts
   (plain mean over positions and weighted by the probability of reaching the depth, as
   online decoding visits them), and online speculative decoding at `mtp.temperature` in every
   `mtp.eval_modes`: per-depth acceptance, tokens per target forward and pass@1. The SFT
   drafter (before this stage) is measured the same way for comparison.

Workdir layout: <workdir>/mtp/checkpoints (orbax: MTP parameters, optimizer, data iterator),
<workdir>/mtp/summary.json when complete; metrics in <workdir>/metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from bebop_jax import evaluation
from bebop_jax import multihost
from bebop_jax import rollout
from bebop_jax import sharding
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import pipeline
from bebop_jax.decoding import diagnostics
from bebop_jax.decoding import draft_vocab as draft_vocab_lib
from bebop_jax.losses import mtp as mtp_losses
from bebop_jax.model import drafter_init
from bebop_jax.model import model as policy_lib
from bebop_jax.model.config import ModelConfig
from bebop_jax.train import checkpoint as checkpoint_lib
from bebop_jax.train import flops as flops_lib
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.train import optimizer as optimizer_lib
from bebop_jax.train import drafter
from bebop_jax.train import trainer
from bebop_jax.stages import config as config_lib
from bebop_jax.stages import drafter_data
from bebop_jax.stages import lineage
from bebop_jax.stages import rollouts

STAGE = "mtp"




# ----------------------------------------------------------------------------- rollouts


# ----------------------------------------------------------------------------- features


# ----------------------------------------------------------------------------- evaluation


def online_evaluation(config: ml_collections.ConfigDict, graphdef, params, examples,
                      task_objs, *, modes: Sequence[str],
                      draft_vocab: Sequence[int] | None = None) -> dict[str, Any]:
  """Speculative decoding on held-out prompts at mtp.temperature, per mode: per-depth
  acceptance (accepted / attempted drafts, each depth's drafts counted when verified, with
  binomial 95% intervals), tokens per target forward (Rollouts.tokens_per_target_forward:
  the policy tokens verifications emitted per verification), pass@1, overall and per task,
  and seconds. `draft_vocab`: the drafter's reduced vocabulary (None: the whole head)."""
  results = {}
  tok = config_lib.settings(config).data.loaded_tokenizer
  for mode in modes:
    start = time.perf_counter()
    engine = rollout.JaxEngine(graphdef, params, task_objs, rollouts.eval_settings(
        config, temperature=config.mtp.temperature, top_k=0, top_p=1.0, mode=mode,
        draft_vocab=None if draft_vocab is None else tuple(int(i) for i in draft_vocab)),
        tokenizer=tok)
    by_task = evaluation.rollouts_by_task(engine, examples, seed=config.seed)
    accuracy = evaluation.pass_at_1(by_task)
    per_task = {n: {**_acceptance(r), "accuracy": accuracy[n]} for n, r in by_task.items()}
    results[mode] = {**_acceptance(rollout.Rollouts.concatenate(list(by_task.values()))),
                     "accuracy": accuracy, "per_task": per_task,
                     "seconds": time.perf_counter() - start}
  return results


def _acceptance(r: rollout.Rollouts) -> dict[str, Any]:
  attempted, accepted = r.attempted.sum(0), r.accepted.sum(0)
  return {"acceptance": r.acceptance().tolist(),
          "attempted": attempted.tolist(), "accepted": accepted.tolist(),
          "interval": [list(diagnostics.binomial_interval(int(a), int(n)))
                       for a, n in zip(accepted, attempted)],
          "tokens_per_target_forward": r.tokens_per_target_forward()}


def evaluate_drafter(config, graphdef, params, heldout_sequences, examples, task_objs, *,
                     online: bool = True, draft_vocab: Sequence[int] | None = None
                     ) -> dict[str, Any]:
  """Teacher-forced acceptance on the held-out rollouts and (`online`) speculative decoding
  on the held-out prompts (`online_evaluation`), in every mtp.eval_modes."""
  modes = tuple(config.mtp.eval_modes)
  result = {"teacher_forced": drafter.teacher_forced_acceptance(
      graphdef, params, heldout_sequences, temperature=config.mtp.temperature,
      modes=modes, batch_size=config.eval.batch_size,
      buckets=tuple(config.eval.prompt_buckets), draft_vocab=draft_vocab)}
  if online:
    result["online"] = online_evaluation(config, graphdef, params, examples, task_objs,
                                         modes=modes, draft_vocab=draft_vocab)
  return result


# ----------------------------------------------------------------------------- the stage


def load_workdir_policy(config: ml_collections.ConfigDict, workdir: str | None, *,
                        which: str = "auto") -> tuple[nnx.GraphDef, nnx.State, str]:
  """(graphdef, parameters, where they came from) for benchmarks: the MTP stage's policy
  (which "mtp", or "auto" when that stage completed in `workdir`), else the SFT stage's
  (with its jointly trained MTP module), else a random policy of the config's shape (also
  for which "random")."""
  if which not in ("auto", "mtp", "sft", "random"):
    raise ValueError(f"which={which!r} is not allowed: one of auto, mtp, sft, random")
  use_mtp = which == "mtp" or (which == "auto" and workdir and lineage.read_summary(workdir, "mtp") is not None)
  if which != "random" and workdir and use_mtp:
    return (*lineage.restore_policy(config, workdir, stage="mtp"),
            f"sft + mtp checkpoint in {workdir}")
  if which != "random" and workdir and lineage.read_summary(workdir, "sft") is not None:
    return (*lineage.restore_policy(config, workdir, stage="sft"),
            f"sft checkpoint in {workdir}")
  return (*policy_lib.init(ModelConfig.from_dict(config.model.to_dict()), config.seed),
          "random_init")


def make_loss_fn(config: ml_collections.ConfigDict, loss: str | None = None,
                 draft_vocab: np.ndarray | None = None):
  """The MTP stage's loss_fn(model, batch) -> (loss, metrics) with `loss` (default
  mtp.loss), the trunk detached. A batch with "hidden" (trunk features) skips the trunk; one
  with "rows" runs the fused head at those rows only (losses.mtp.loss_rows), restricted to
  `draft_vocab` when given (the drafter's reduced vocabulary)."""
  m = config.mtp
  loss = loss or m.loss
  depth_weights = tuple(m.depth_weights) or None
  impl = None if m.tv_implementation == "auto" else m.tv_implementation
  fused = m.head == "fused"
  vocab = None if draft_vocab is None else jnp.asarray(draft_vocab, jnp.int32)
  if vocab is not None and not fused:
    raise ValueError("mtp.draft_vocab > 0 trains the drafter on its vocabulary at the loss "
                     "rows: it needs mtp.head='fused'")

  def loss_fn(model, batch):
    out = model(batch["tokens"], batch["positions"], batch["segment_ids"],
                mtp_stop_gradient=True, logits=not fused, frozen_layers=True,
                hidden=batch.get("hidden"))
    return mtp_losses.mtp_loss(out, batch["tokens"], batch["loss_mask"], loss=loss,
                               depth_weights=depth_weights, tv_implementation=impl,
                               tv_interpret=m.tv_interpret, temperature=m.temperature,
                               rows=batch.get("rows") if fused else None,
                               draft_vocab=vocab if fused else None)

  return loss_fn


def split(model, config):
  """(graphdef, trainable, frozen) of the MTP stage: config.mtp.optim.trainable trains."""
  return nnx.split(model, optimizer_lib.trainable_filter(config.mtp.optim.trainable), ...)


def _phases(config) -> list[tuple[str, int]]:
  """[(loss, last step)] of the stage's schedule: the warm start's loss for its steps, then
  mtp.loss to mtp.train.num_steps."""
  m = config.mtp
  n = m.train.num_steps
  warm = min(m.warm_start.steps, n)
  return ([(m.warm_start.loss, warm)] if warm > 0 else []) + ([(m.loss, n)] if warm < n else [])


def _packed_data(config, store, train_data, heldout, graphdef, params, seq_len: int,
                 timing: dict[str, Any]):
  """(targets per row or None, packed training rows, packed held-out rows, their trunk
  features or None x 2) of the drafter dataset; the features from the store, computed and
  stored first when absent (mtp.features "cached")."""
  m = config.mtp
  max_targets = None
  if m.head == "fused":  # the head runs at the loss rows only: at most this many per row
    max_targets = -(-max(int(np.sum(mk[1:seq_len] > 0)) for _, mk in
                         train_data["sequences"] + heldout["sequences"]) // 8) * 8
  rows = drafter.pack_rows(train_data["sequences"], seq_len, max_targets)
  heldout_rows = drafter.pack_rows(heldout["sequences"], seq_len, max_targets)
  features = heldout_features = None
  if m.features == "cached":
    t0 = time.perf_counter()
    packed = lambda data: (None if data.get("hidden") is None else drafter.pack_hidden(
        data["hidden"], data["sequences"], seq_len, max_targets))
    features, source = drafter.cached_features(store, "train", rows, graphdef, params,
                                       m.features_batch_size, m.train.progress,
                                       packed(train_data))
    heldout_features, _ = drafter.cached_features(store, "test", heldout_rows, graphdef, params,
                                          m.features_batch_size, m.train.progress,
                                          packed(heldout))
    timing["features_s"] = time.perf_counter() - t0
    timing["features_from"] = source
  return max_targets, rows, heldout_rows, features, heldout_features


def _drafter_from(config: ml_collections.ConfigDict, source: str,
                  params: nnx.State) -> nnx.State:
  """`params` with the MTP modules of the MTP stage in `source` (mtp.drafter_from)."""
  if lineage.read_summary(source, "mtp") is None:
    raise FileNotFoundError(f"config.mtp.drafter_from={source!r} holds no completed MTP "
                            "stage: run it first")
  _, warm = lineage.restore_policy(config, source, stage="mtp")
  print(f"[mtp] the drafter starts from the MTP stage in {source}")
  return drafter_init.with_drafter(params, warm)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs (or resumes, or skips when complete) the MTP stage; returns its summary."""
  done = lineage.read_summary(workdir, "mtp")
  if done is not None:
    print(f"[mtp] complete in {lineage.stage_dir(workdir, 'mtp')} (loss {done['loss']}): skipping")
    return done
  settings = config_lib.settings(config)
  m = config.mtp
  source = lineage.sft_workdir(config, workdir)
  if lineage.read_summary(source, "sft") is None and not lineage.uses_pretrained(config, source):
    raise FileNotFoundError(f"the MTP stage needs a completed SFT stage in {source} "
                            "(run the 'sft' stage first, set mtp.init_from, or start from "
                            "a pretrained checkpoint with sft.init_from_hf)")
  if lineage.uses_pretrained(config, source):
    print(f"[mtp] no SFT stage in {source}: the drafter is trained for the pretrained "
          f"policy {config.sft.init_from_hf}")
  os.makedirs(lineage.stage_dir(workdir, "mtp"), exist_ok=True)
  stage_start = time.perf_counter()
  timing = {}
  model_cfg = ModelConfig.from_dict(config.model.to_dict())
  mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
  rules = tuple(tuple(r) for r in config.mesh.rules)
  seq_len = m.seq_len or config.data.seq_len

  # The drafter dataset: the policy's rollouts, sampled once into the store.
  graphdef0, sft_params = lineage.restore_policy(config, source, stage="sft")
  store = drafter_data.drafter_store(config, workdir)
  t0 = time.perf_counter()
  if multihost.process_count() > 1:
    # Process 0 samples the drafter dataset and stores its trunk features; then every
    # process (process 0 too) reads both from the store: all hold the same data.
    if multihost.is_primary():
      data = [drafter_data.drafter_dataset(config, graphdef0, sft_params, store, split, per_task)
              for split, per_task in (("train", drafter_data.prompts_per_task(config, m.data.num_prompts)),
                                      ("test", drafter_data.heldout_tasks(config)))]
      _packed_data(config, store, *data, graphdef0, sft_params, seq_len, {})
    multihost.barrier("drafter_data")
  train_data = drafter_data.drafter_dataset(config, graphdef0, sft_params, store, "train",
                               drafter_data.prompts_per_task(config, m.data.num_prompts))
  heldout = drafter_data.drafter_dataset(config, graphdef0, sft_params, store, "test",
                            drafter_data.heldout_tasks(config))
  timing["rollouts_s"] = time.perf_counter() - t0
  # The drafter's token counts (the policy tokens of its training rollouts), stored with it,
  # and the reduced draft vocabulary chosen from them (mtp.draft_vocab > 0).
  counts = draft_vocab_lib.count_tokens([t for t, _ in train_data["sequences"]],
                                        [mk for _, mk in train_data["sequences"]],
                                        model_cfg.vocab_size)
  if multihost.is_primary():
    lineage.write_draft_counts(workdir, counts)
  vocab, vocab_info = None, {"size": 0}
  if m.draft_vocab:
    tok = settings.data.loaded_tokenizer
    vocab = draft_vocab_lib.top_tokens(counts, m.draft_vocab, (tok.eos_id, tok.call_end_id))
    if multihost.is_primary():
      np.save(lineage.stored_vocabulary_path(workdir), vocab)
    heldout_counts = draft_vocab_lib.count_tokens(
        [t for t, _ in heldout["sequences"]], [mk for _, mk in heldout["sequences"]],
        model_cfg.vocab_size)
    vocab_info = {"size": int(m.draft_vocab),
                  "coverage_train": draft_vocab_lib.coverage(counts, vocab),
                  "coverage_heldout": draft_vocab_lib.coverage(heldout_counts, vocab)}
    print(f"[mtp] draft vocabulary: {m.draft_vocab} tokens, covering "
          f"{vocab_info['coverage_train']:.2%} of the training rollouts' policy tokens and "
          f"{vocab_info['coverage_heldout']:.2%} of the held-out ones")
  fused = m.head == "fused"
  max_targets, rows, heldout_rows, features, heldout_features = _packed_data(
      config, store, train_data, heldout, graphdef0, sft_params, seq_len, timing)
  targets = int(rows["loss_mask"].sum())
  print(f"[mtp] drafter dataset: {len(train_data['sequences'])} rollouts "
        f"({train_data['policy_tokens']} policy tokens, rewards {train_data['reward']}"
        f"{', stored' if train_data['cached'] else ''}) in {len(rows['tokens'])} rows of "
        f"{seq_len} ({targets / rows['tokens'].size:.1%} of positions are targets"
        f"{f', the head runs at {max_targets} per row' if fused else ''}; trunk features "
        f"{m.features})")

  task_objs = {n: tasks_lib.get_task(n, **config.data.tasks[n].knobs)
               for n in drafter_data.heldout_tasks(config)}
  examples = {n: pipeline.eval_examples(settings.data, n, k)
              for n, k in drafter_data.heldout_tasks(config).items()}
  hidden_rms = 1.0
  if features is not None:
    hidden_rms = float(np.sqrt(np.mean(np.square(features[:8][rows["segment_ids"][:8] > 0]))))
  params = drafter_init.init_drafter(sft_params, model_cfg, m.init, seed=config.seed + 1 + 7919 * m.seed,
                        proj_init=m.proj_init, hidden_rms=hidden_rms)
  if m.drafter_from:
    params = _drafter_from(config, m.drafter_from, params)
  model = nnx.merge(graphdef0, params)
  graphdef, trainable, frozen = split(model, config)
  track = drafter.heldout_acceptance(graphdef, heldout_rows, heldout_features,
                             batch_size=m.batch_size, temperature=m.temperature,
                             draft_vocab=vocab) if fused else None
  eval_fn = (lambda st: track(nnx.merge_state(st.trainable, st.frozen))) if track else None

  before_path = os.path.join(lineage.stage_dir(workdir, "mtp"), "before.json")
  before = None
  if m.eval_before:
    def initial() -> tuple[dict[str, Any], float | None]:
      if os.path.exists(before_path):
        with open(before_path) as f:
          return json.load(f), None
      t0 = time.perf_counter()
      result = evaluate_drafter(config, graphdef0, params, heldout["sequences"], examples,
                                task_objs, online=m.eval_before_online, draft_vocab=vocab)
      metrics_lib.write_json_atomic(before_path, result)
      return result, time.perf_counter() - t0

    # With several processes, process 0 evaluates and tells the others.
    before, seconds = multihost.on_primary(initial, "mtp_before")
    if seconds is not None:
      timing["eval_before_s"] = seconds
    print(f"[mtp] initial drafter ({m.init}): {_describe(before)}")

  num_steps = m.train.num_steps
  tx, schedule = optimizer_lib.make_optimizer(settings.mtp.optim, num_steps)
  state = trainer.place_state(
      trainer.TrainState(trainable, frozen, tx.init(trainable), 0), mesh, rules, tx)
  # This process's shards of every batch (rows of the same global batches for any number).
  shards, local = multihost.data_shards(config.data.shards)
  datasets = [drafter.train_dataset(rows, m.batch_size, config.seed + 7919 * m.seed, features,
                            shard=(s, shards)) for s in local]
  data_iter = pipeline.process_iterator(datasets)
  checkpointer = checkpoint_lib.Checkpointer(
      checkpoint_lib.checkpoint_dir(workdir, STAGE), keep_last=m.train.keep_checkpoints)
  state, latest = trainer.resume(checkpointer, state, data_iter)
  if latest is not None:
    print(f"[mtp] resumed from step {latest}")
  example_batch = multihost.global_example(next(pipeline.process_iterator(datasets)))
  batch_sh = trainer.batch_shardings(example_batch, mesh, rules)
  flops = flops_lib.train_flops_per_step(
      model_cfg, m.batch_size, seq_len, model_cfg.num_draft_steps, trainable_main=False)
  if eval_fn is not None and m.train.eval_every and int(state.step) == 0:
    writer = metrics_lib.MetricsWriter(workdir, STAGE)  # the curve's first point
    writer.write(0, {f"eval/{k}": v for k, v in eval_fn(state).items()})
    writer.close()
  t0 = time.perf_counter()
  summary = None
  for loss, last in _phases(config):
    if int(state.step) >= last:
      continue
    step_fn = trainer.make_train_step(graphdef, make_loss_fn(config, loss, vocab), tx,
                                      schedule, m.train.grad_accum_steps)
    compiled = trainer.compile_train_step(step_fn, state, example_batch, mesh, rules, tx)
    print(f"[mtp] train step ({loss}, to step {last}) compiled in "
          f"{compiled.compile_seconds:.1f}s")
    stop = min(last, m.train.stop_at_step) if m.train.stop_at_step else last
    with sharding.use_mesh(mesh, rules):
      state, summary = trainer.train_loop(
          stage=STAGE, workdir=workdir, state=state, compiled=compiled, batches=data_iter,
          loop=trainer.LoopConfig(num_steps=num_steps, log_every=m.train.log_every,
                                  eval_every=m.train.eval_every,
                                  checkpoint_every=m.train.checkpoint_every,
                                  progress=m.train.progress,
                                  stop_at_step=stop if stop < num_steps else 0),
          checkpointer=checkpointer, data_iterator=data_iter, batch_sh=batch_sh,
          eval_fn=eval_fn if m.train.eval_every else None, flops_per_step=flops)
    if int(state.step) < last:  # stopped early (mtp.train.stop_at_step)
      break
  checkpointer.close()
  timing["train_s"] = time.perf_counter() - t0
  if summary is None:  # every phase had run: the checkpoint is final, evaluate it
    summary = {"steps": int(state.step), "complete": int(state.step) >= num_steps}
  if not summary["complete"]:
    print(f"[mtp] stopped at step {summary['steps']} of {num_steps}; rerun to resume")
    return summary
  device = jax.sharding.SingleDeviceSharding(multihost.local_device())
  params = jax.device_put(multihost.to_local(nnx.merge_state(state.trainable, state.frozen)),
                          device)
  t0 = time.perf_counter()

  def final() -> dict[str, Any]:
    result = evaluate_drafter(config, graphdef, params, heldout["sequences"], examples,
                              task_objs, online=m.eval_online, draft_vocab=vocab)
    if track is not None:
      result["heldout"] = track(params)
    return result

  after = multihost.on_primary(final, "mtp_after")  # process 0 evaluates, tells the others
  timing["eval_s"] = time.perf_counter() - t0
  timing["total_s"] = time.perf_counter() - stage_start
  summary.update(loss=m.loss, schedule=[list(p) for p in _phases(config)], init=m.init, drafter_from=m.drafter_from,
                 before=before, after=after, timing=timing, draft_vocab=vocab_info,
                 num_rollouts=len(train_data["sequences"]), rows=len(rows["tokens"]),
                 seq_len=seq_len, targets_per_row=max_targets,
                 policy_tokens=train_data["policy_tokens"],
                 rollout_reward=train_data["reward"],
                 rollout_seconds=train_data["seconds"])
  metrics_lib.write_json_atomic(os.path.join(lineage.stage_dir(workdir, "mtp"), "summary.json"), summary)
  print(f"[mtp] done ({m.loss}): {_describe(after)}")
  return summary


def _describe(ev: dict[str, Any]) -> str:
  parts = []
  fmt = lambda xs: "/".join(f"{a:.3f}" for a in xs)
  for mode, tf in ev["teacher_forced"].items():
    text = f"{mode}: teacher-forced {fmt(tf['alpha'])} (reach-weighted)"
    r = ev.get("online", {}).get(mode)
    if r is not None:
      text += (f", online {fmt(r['acceptance'])} over {'/'.join(map(str, r['attempted']))} "
               f"drafts, {r['tokens_per_target_forward']:.2f} tokens/forward")
    parts.append(text)
  return "; ".join(parts)
