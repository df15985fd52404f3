"""The `rl` stage: synchronous GRPO on speculative rollouts of the policy's own MTP drafts.

Each RL step:
  1. `prompts_per_batch` training prompts, each `group_size` times (data.pipeline's RL prompt
     stream, checkpointed), are rolled out by the rollout engine (speculative by default;
     agentic episodes with the environment in the loop), at the rollout temperature.
  2. Rewards -> group advantages (rl.advantage); optional dynamic sampling masks groups of
     equal rewards out of the loss.
  3. The learner runs `epochs` x `minibatches` policy updates on the batch: the shared jitted
     train step (AOT-compiled, donated, sharded by the mesh rules) with the clipped policy
     loss; the trunk is one parameter group (rl.optim), the MTP modules another.
  4. The drafter: `frozen`, or an MTP-only update (rl.mtp.loss, targets from the current
     policy) on this batch (`online`) or every `every` steps on the rollouts since
     (`periodic`); MTP gradients never reach the trunk.
  5. The learner publishes the new parameters (version = steps done) to the rollout side
     (rl.placement: the first device, or the rollout sub-mesh) through the double-buffered
     weight store; the engine samples the next batch with them.
With rl.asynchronous.enabled, a rollout thread (async_loop.RolloutWorker) samples batches into a
bounded queue while the learner trains, never more than max_staleness versions ahead; stale
batches get the decoupled objective (proximal log-probs recomputed by the learner). With
max_staleness 0 the run equals the synchronous one bit for bit.
Metrics of every step go to metrics.jsonl and TensorBoard (stage "rl"): rewards and pass
rates per task, lengths, entropy, online acceptance per depth, tokens per target forward,
teacher-forced acceptance per depth in `rl.acceptance_modes` (the batch scored under the
policy that sampled it), seconds of rollout and learner and the rollout share, clip
fractions, KL, gradient norm, and the sampler-learner log-prob difference (behaviour
log-probs against the learner's recomputation under the same parameters, before the update);
versions and staleness, weight-sync, idle and queue figures (docs/rl.md).
Held-out evaluation (pass@1 per task with its standard error, acceptance per depth per
`rl.eval.modes`) runs before the first step, every `rl.train.eval_every` steps and at the end.

Workdir: <workdir>/rl/checkpoints (orbax: trunk, MTP modules, both optimizer states, the
update counters, the periodic buffer, the prompt iterator's position after the last trained
batch), rl/evals.json (held-out
evaluations by step), rl/summary.json when complete. A rerun resumes exactly (the rollout
key of step s is fold_in(seed, s)) or skips a complete stage.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from bebop_jax.stages import config as config_lib
from bebop_jax import evaluation
from bebop_jax import multihost
from bebop_jax import rollout
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import pipeline
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.rl import async_loop
from bebop_jax.rl import learner
from bebop_jax.rl import placement as placement_lib
from bebop_jax.train import checkpoint as checkpoint_lib
from bebop_jax.stages import lineage
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.train import drafter
from bebop_jax.stages import rollouts

STAGE = "rl"


def feedworkdir(config: ml_collections.ConfigDict, workdir: str) -> str:
  return (os.path.abspath(os.path.expanduser(config.rl.init_from)) if config.rl.init_from
          else workdir)


def load_initial_policy(config: ml_collections.ConfigDict, workdir: str
                        ) -> tuple[nnx.GraphDef, nnx.State, str]:
  """(graphdef, parameters, which stage) the RL stage starts from: the MTP stage's policy
  and drafter when it completed in the source workdir, else the SFT policy."""
  source = feedworkdir(config, workdir)
  if lineage.read_summary(source, "mtp") is not None:
    graphdef, params = lineage.restore_policy(config, source, stage="mtp")
    return graphdef, params, "mtp"
  sft_source = lineage.sft_workdir(config, source)
  if lineage.read_summary(sft_source, "sft") is not None:
    graphdef, params = lineage.restore_policy(config, sft_source, stage="sft")
    return graphdef, params, "sft"
  raise FileNotFoundError(f"the RL stage needs a completed SFT (and ideally MTP) stage in "
                          f"{source} (run them first, or set rl.init_from)")


def draft_vocabulary(config: ml_collections.ConfigDict, workdir: str
                     ) -> tuple[int, ...] | None:
  """The reduced draft vocabulary the rollouts draft from: with rl.rollout.draft_vocab 0,
  the one stored with the drafter the RL stage starts from (mtp.draft_vocab; None, the
  whole head, when it has none); with a size, that many tokens chosen from the token
  counts stored with the drafter, with the stop tokens always in."""
  size = config.rl.rollout.draft_vocab
  source = feedworkdir(config, workdir)
  if not size:
    ids = lineage.stored_draft_vocabulary(source)
    if ids is None:
      return None
    print(f"[rl] draft vocabulary: the drafter's {len(ids)} tokens")
    return tuple(int(i) for i in ids)
  if lineage.read_summary(source, "mtp") is None:
    raise FileNotFoundError(f"rl.rollout.draft_vocab={size} needs the drafter's token "
                            f"counts: no completed MTP stage in {source}")
  tok = config_lib.settings(config).data.loaded_tokenizer
  ids, cover = lineage.draft_vocabulary(source, size,
                                          always=(tok.eos_id, tok.call_end_id))
  print(f"[rl] draft vocabulary: {size} tokens, {cover:.1%} of the drafter's training tokens")
  return tuple(int(i) for i in ids)


def drafter_acceptance(config: ml_collections.ConfigDict, workdir: str
                       ) -> dict[str, tuple[float, ...]]:
  """{mode: per-depth acceptance} the MTP stage measured for the drafter the RL stage
  starts from (teacher-forced on held-out rollouts), the seed of adaptive decoding's
  estimate; {} without a completed MTP stage or with adaptive decoding off."""
  if not config.decoding.adaptive.enabled:
    return {}
  summary = lineage.read_summary(feedworkdir(config, workdir), "mtp") or {}
  return {m: tuple(float(a) for a in acc)
          for m, acc in summary.get("acceptance_teacher_forced_by_mode", {}).items()}


# ----------------------------------------------------------------------------- evaluation


def evaluate(config: ml_collections.ConfigDict, graphdef, params, examples, task_objs,
             draft_vocab: tuple[int, ...] | None = None, seeds=None) -> dict[str, Any]:
  """Held-out evaluation at the rollout temperature, speculative, in every rl.eval.modes.
  Every mode samples the policy exactly, so pass@1 pools them: per prompt the fraction of
  modes whose sample solves it (tasks.solved: reward 1; for code every test passes), per
  task the mean over prompts and its standard error; `mean_reward` likewise pools the
  rewards (for code, the fraction of test cases passed). The same key every time, so
  evaluations along a run are paired."""
  start = time.perf_counter()
  tok = config_lib.settings(config).data.loaded_tokenizer
  per_mode, solved, rewards = {}, {}, {}
  bar = metrics_lib.Progress(
      len(config.rl.eval.modes) * sum(len(e) for e in examples.values()), 0,
      f"[{STAGE}] held-out evaluation", disable=not config.rl.train.progress, unit="prompt")
  for mode in config.rl.eval.modes:
    engine = rollout.JaxEngine(graphdef, params, task_objs, rollouts.rl_settings(
        config, seeds, engine="speculative", mode=mode, batch_size=config.eval.batch_size,
        draft_vocab=draft_vocab), tokenizer=tok)
    by_task = evaluation.rollouts_by_task(engine, examples, seed=config.seed + 7,
                                          on_task=bar.update)
    both = rollout.Rollouts.concatenate(list(by_task.values()))
    per_mode[mode] = {"acceptance": both.acceptance().tolist(),
                      "tokens_per_target_forward": both.tokens_per_target_forward(),
                      "entropy": both.mean_entropy(),
                      "pass_at_1": evaluation.pass_at_1(by_task),
                      "mean_reward": evaluation.mean_reward(by_task)}
    for name, r in by_task.items():
      solved.setdefault(name, []).append(tasks_lib.solved(r.rewards).astype(float))
      rewards.setdefault(name, []).append(r.rewards)
  bar.close()
  per_prompt = {name: np.mean(s, axis=0) for name, s in solved.items()}
  return {"pass_at_1": {n: float(v.mean()) for n, v in per_prompt.items()},
          "pass_at_1_se": {n: evaluation.standard_error(v) for n, v in per_prompt.items()},
          "per_prompt_pass": {n: v.tolist() for n, v in per_prompt.items()},
          "mean_reward": {n: float(np.mean(r)) for n, r in rewards.items()},
          "modes": per_mode, "seconds": time.perf_counter() - start}


def paired_difference(before: dict, after: dict) -> dict[str, dict[str, float]]:
  """Per task: after - before pass@1 and the standard error of that difference over the
  same prompts (paired)."""
  out = {}
  for name, b in before["per_prompt_pass"].items():
    d = np.asarray(after["per_prompt_pass"][name]) - np.asarray(b)
    out[name] = {"delta": float(d.mean()), "se": evaluation.standard_error(d)}
  return out


def _teacher_forced(graphdef, params, rollouts: rollout.Rollouts, modes, temperature: float,
                    batch_size: int, pack_length: int, draft_vocab=None
                    ) -> dict[str, dict[str, list[float]]]:
  """Per mode: train.drafter.teacher_forced_acceptance of the rollouts under `params` ("alpha":
  per-depth acceptance weighted by the probability of reaching the depth; "positions": the
  weights that combine calls), one forward for all modes; the rollouts packed into rows of
  `pack_length` positions, `batch_size` rows per forward; the drafts from `draft_vocab`
  when given."""
  if not modes:
    return {}
  return drafter.teacher_forced_acceptance(
      graphdef, params, rollouts.sequences(), temperature=temperature, modes=modes,
      batch_size=batch_size, pack_length=pack_length, draft_vocab=draft_vocab)


# ----------------------------------------------------------------------------- the stage


def _batch_metrics(rollouts: rollout.Rollouts, group_size: int) -> dict[str, float]:
  m = {"reward_mean": float(rollouts.rewards.mean()),
       "completion_length": float(rollouts.lengths.mean()),
       "policy_tokens": float(rollouts.policy_mask.sum(1).mean()),
       "entropy": rollouts.mean_entropy(),
       "tokens_per_target_forward": rollouts.tokens_per_target_forward(),
       "target_forwards": int(rollouts.target_forwards.sum()),
       "reward_std_within_groups": float(
           rollouts.rewards.reshape(-1, group_size).std(axis=1).mean())}
  for k, a in enumerate(rollouts.acceptance(), start=1):
    m[f"acceptance_{k}"] = float(a)
  for k, n in sorted((rollouts.k_iterations or {}).items()):
    m[f"adaptive/k{k}_iterations"] = int(n)
  for name in tasks_lib.TASK_NAMES:
    rows = rollouts.rows_of_task(name)
    if len(rows):
      m[f"reward/{name}"] = float(rollouts.rewards[rows].mean())
      m[f"pass_rate/{name}"] = float(tasks_lib.solved(rollouts.rewards[rows]).mean())
  return m


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs (or resumes, or skips when complete) the RL stage; returns its summary."""
  done = lineage.read_summary(workdir, "rl")
  if done is not None:
    print(f"[rl] complete in {lineage.stage_dir(workdir, 'rl')} ({done['steps']} steps): skipping")
    return done
  settings = config_lib.settings(config)
  c = settings.rl
  asynchronous = c.asynchronous
  eta = asynchronous.max_staleness if asynchronous.enabled else 0
  if asynchronous.enabled and multihost.process_count() > 1:
    # The rollout thread would exchange rollouts while the learner runs its collectives.
    raise config_lib.ConfigError(
        f"rl.asynchronous.enabled=True needs one process; this run has "
        f"{multihost.process_count()}: use the synchronous loop")
  os.makedirs(lineage.stage_dir(workdir, "rl"), exist_ok=True)
  stage_start = time.perf_counter()
  place = placement_lib.make_placement(c.placement, settings.mesh)
  graphdef, params0, source = load_initial_policy(config, workdir)
  draft_vocab = draft_vocabulary(config, workdir)
  seeds = drafter_acceptance(config, workdir)
  seq_len = c.max_prompt_len + c.rollout.max_new_tokens
  learn = learner.Learner(c, graphdef, params0, mesh=place.learner_mesh,
                          rules=place.learner_rules, seq_len=seq_len,
                          mtp_head=config.mtp.head)
  loop = (f"async (max_staleness {eta}, interrupt {asynchronous.interrupt}, off-policy "
          f"{asynchronous.off_policy})" if asynchronous.enabled else "sync")
  print(f"[rl] updates compiled in {learn.compile_seconds:.1f}s (policy from the {source} "
        f"stage, MTP strategy {c.mtp.strategy}); {loop}; {place.describe()}")

  # This process's shards of the prompt stream: its prompts of every batch.
  data = settings.data
  shards, local = multihost.data_shards(data.shards)
  prompts = pipeline.process_iterator([pipeline.rl_prompt_dataset(
      data, prompts_per_batch=c.prompts_per_batch, group_size=c.group_size,
      max_prompt_len=c.max_prompt_len, seed=settings.seed, shard=(s, shards)) for s in local])
  checkpointer = checkpoint_lib.Checkpointer(
      checkpoint_lib.checkpoint_dir(workdir, STAGE), keep_last=c.train.keep_checkpoints)
  start_step = 0
  if checkpointer.latest_step() is not None:
    tree = dict(learn.state_tree(), rl_step=jnp.int32(0))
    restored = checkpointer.restore(None, checkpoint_lib.abstract_like(tree),
                                    data_iterator=prompts)
    learn.load_state_tree(restored)
    start_step = int(restored["rl_step"])
    print(f"[rl] resumed from step {start_step} (policy version {start_step})")

  # The rollout side samples with its own copy of each version's parameters: the newest in
  # the weight store (version = RL steps done).
  store = async_loop.WeightStore(place.to_rollout(learn.params()), start_step)
  task_objs = {n: tasks_lib.get_task(n, **data.tasks[n].knobs) for n in data.task_names}
  examples = {n: pipeline.eval_examples(data, n, c.eval.num_examples) for n in data.task_names}

  def held_out() -> dict[str, Any]:
    def evaluate_newest() -> dict[str, Any]:
      with store.read() as (params, _), place.rollout_context():
        return evaluate(config, graphdef, params, examples, task_objs, draft_vocab, seeds)
    # With several processes, process 0 evaluates and tells the others.
    return multihost.on_primary(evaluate_newest, "rl_eval")

  evals_path = os.path.join(lineage.stage_dir(workdir, "rl"), "evals.json")
  evals = {k: v for k, v in (metrics_lib.read_json(evals_path) or {}).items()
           if int(k) <= start_step}
  if "0" not in evals:
    evals["0"] = held_out()
    metrics_lib.write_json_atomic(evals_path, evals)
  print(f"[rl] held-out at step {max(int(k) for k in evals)}: "
        f"{_describe_eval(evals[str(max(int(k) for k in evals))])}")

  num_steps = c.train.num_steps
  end = min(num_steps, c.train.stop_at_step) if c.train.stop_at_step else num_steps
  produce = _make_producer(config, graphdef, task_objs, store, place,
                           tuple(c.acceptance_modes), learn.seq_len, draft_vocab, seeds,
                           shards=(shards, local), tokenizer=data.loaded_tokenizer)

  def draw():
    batch = next(prompts)
    return batch, async_loop.capture_state(prompts)

  if asynchronous.enabled:
    feed = async_loop.RolloutWorker(
        # Like a preemption, stop_at_step does not tell the worker: it may have drawn and
        # sampled batches past the stop, which the checkpoint must not count.
        produce, draw, store, start=start_step, end=num_steps, max_staleness=eta,
        queue_size=asynchronous.queue_size, max_restarts=asynchronous.max_restarts)
  else:
    feed = async_loop.InlineSource(produce, draw, start_step)

  writer = metrics_lib.MetricsWriter(workdir, STAGE, resume_step=start_step)
  progress = metrics_lib.Progress(num_steps, start_step, STAGE, disable=not c.train.progress)
  step = start_step
  feed.start()
  try:
    while step < end:
      t0 = time.perf_counter()
      depth = feed.queue_depth()  # batches ready when the learner asks
      batch = feed.get()
      waited = time.perf_counter() - t0
      staleness = async_loop.check_batch(batch, step, eta)
      metrics = dict(batch.metrics)
      metrics.update(learn.update(batch.rollouts, step, staleness=staleness))
      step += 1
      t1 = time.perf_counter()
      sync_wait = store.publish(lambda: jax.block_until_ready(place.to_rollout(learn.params())),
                                step)
      metrics.update(async_loop.staleness_metrics(staleness, eta))
      work = metrics["rollout_s"] + metrics["learner_s"] + metrics["mtp_update_s"]
      metrics.update(
          sync_s=time.perf_counter() - t1, sync_wait_s=sync_wait, learner_idle_s=waited,
          rollout_idle_s=batch.idle_s, queue_depth=depth, rollout_restarts=feed.restarts,
          rollout_attempts=batch.attempts, step_s=time.perf_counter() - t0,
          rollout_share=metrics["rollout_s"] / work, policy_version=step,
          rollout_version_min=int(batch.rollouts.versions.min()),
          rollout_version_max=int(batch.rollouts.versions.max()))
      if c.train.eval_every and step % c.train.eval_every == 0 and step < num_steps:
        evals[str(step)] = held_out()
        metrics.update({f"eval/pass_at_1/{n}": v
                        for n, v in evals[str(step)]["pass_at_1"].items()})
        metrics_lib.write_json_atomic(evals_path, evals)
      if step % c.train.log_every == 0 or step == end:
        writer.write(step, metrics)
      progress.update(1, reward=metrics["reward_mean"])
      if step % c.train.checkpoint_every == 0 or step == end:
        checkpointer.save(step, dict(learn.state_tree(), rl_step=jnp.int32(step)),
                          data_iterator=async_loop.SavedIteratorState(batch.iterator_state))
  finally:
    feed.stop()
    progress.close()
    writer.close()
    checkpointer.close()
  if step < num_steps:
    print(f"[rl] stopped at step {step} of {num_steps}; rerun to resume")
    return {"steps": step, "complete": False}
  if str(num_steps) not in evals:
    evals[str(num_steps)] = held_out()
    metrics_lib.write_json_atomic(evals_path, evals)
  seconds = time.perf_counter() - stage_start
  # From metrics.jsonl, which process 0 writes: it reads it and tells the others.
  summary = multihost.on_primary(lambda: _summary(config, workdir, evals, num_steps, source,
                                                  seconds, learn.compile_seconds),
                                 "rl_summary")
  metrics_lib.write_json_atomic(os.path.join(lineage.stage_dir(workdir, "rl"), "summary.json"), summary)
  print(f"[rl] done: {_describe_eval(evals[str(num_steps)])}")
  print(f"[rl] {_describe_timing(summary)}")
  return summary


def _describe_timing(summary: dict) -> str:
  t, a = summary["timing"], summary["async"]
  line = (f"{summary['steps']} steps in {t['step_s']:.1f}s: rollout {t['rollout_s']:.1f}s, "
          f"learner {t['learner_s'] + t['mtp_update_s']:.1f}s, weight sync {t['sync_s']:.1f}s")
  if a["enabled"]:
    line += (f"; idle: learner {t['learner_idle_s']:.1f}s, rollout {t['rollout_idle_s']:.1f}s; "
             f"staleness max {a['staleness_max']:.0f} mean {a['staleness_mean']:.2f} "
             f"(bound {a['max_staleness']}); rollout restarts {a['rollout_restarts']}")
  return line


def _make_producer(config, graphdef, task_objs, store: async_loop.WeightStore,
                   place: placement_lib.Placement, tf_modes, pack_length: int,
                   draft_vocab: tuple[int, ...] | None = None, seeds=None,
                   shards: tuple[int, tuple[int, ...]] = (1, (0,)), *,
                   tokenizer: tokenizer_lib.BaseTokenizer):
  """produce(index, prompt batch) -> (rollouts, rollout-side metrics): batch `index` sampled
  on the rollout side with the newest weights in `store` (the engine tokenizing with
  `tokenizer`, the config's), rollout key fold_in(seed + 101, index), and the teacher-forced
  acceptance of its rows under the version that sampled them.

  `shards` = (S, this process's shards): with S > 1 the prompt batch holds this process's
  shards' prompts, each shard s sampled on its own with key fold_in(that key, s); the
  processes then exchange their rollouts (multihost.gather_objects), so every process
  returns the whole batch's rollouts, in shard order, and the same metrics.

  Without rl.asynchronous.interrupt one version samples the whole batch. With it, each
  decoding call takes the newest version; a call holds whole GRPO groups (one version
  samples every rollout of a prompt), and its rows are scored while its version is held.
  The engine keeps no parameters of its own, so at most the weight store's two versions
  live on the rollout devices."""
  c = config.rl
  interrupt = c.asynchronous.enabled and c.asynchronous.interrupt
  base_key = jax.random.key(config.seed + 101)
  with store.read() as (params, version):
    engine = rollout.JaxEngine(graphdef, params, task_objs,
                               rollouts.rl_settings(config, seeds, draft_vocab=draft_vocab),
                               tokenizer=tokenizer,
                               policy_version=version)
  engine.release_params()
  del params

  num_shards, local = shards

  def produce(index: int, batch) -> tuple[rollout.Rollouts, dict[str, Any]]:
    exs = [tasks_lib.Example.from_json(x) for x in batch["example_json"]]
    key = jax.random.fold_in(base_key, index)
    if num_shards == 1:
      rollouts, scored, rollout_s, diagnostics_s = sample(exs, key)
    else:  # this process's shards, then every process's rollouts in shard order
      per = len(exs) // len(local)
      mine = [sample(exs[i * per:(i + 1) * per], jax.random.fold_in(key, s))
              for i, s in enumerate(local)]
      rollout_s = sum(m[2] for m in mine)  # this process's seconds
      diagnostics_s = sum(m[3] for m in mine)
      parts = [part for got in multihost.gather_objects([m[:2] for m in mine], "rollouts")
               for part in got]
      rollouts = rollout.Rollouts.concatenate([r for r, _ in parts])
      scored = [result for _, results in parts for result in results]
    metrics = _batch_metrics(rollouts, c.group_size)
    metrics["rollout_s"] = rollout_s
    for mode in tf_modes:
      alpha = _combine_teacher_forced([r[mode] for r in scored])
      metrics.update({f"tf_acceptance_{mode}_{k}": a for k, a in enumerate(alpha, 1)})
    metrics["diagnostics_s"] = diagnostics_s
    return rollouts, metrics

  def sample(exs, key):
    """(the rollouts of `exs` sampled with `key`, their teacher-forced results, seconds of
    sampling, seconds of scoring)."""
    t0 = time.perf_counter()
    scored: list[tuple[rollout.Rollouts, Any]] = []  # (rows, their teacher-forced result)
    diagnostics_s = 0.0

    def score(part: rollout.Rollouts, params, _version) -> None:
      nonlocal diagnostics_s
      t = time.perf_counter()
      scored.append(_teacher_forced(graphdef, params, part, tf_modes, c.rollout.temperature,
                                    c.rollout.batch_size, pack_length, draft_vocab))
      diagnostics_s += time.perf_counter() - t

    with place.rollout_context():
      if interrupt:
        rollouts = engine.generate(exs, key, weights=store.read, group_size=c.group_size,
                                   after_call=score)
      else:
        with store.read() as (params, version):
          rollouts = engine.generate(exs, key,
                                     weights=lambda: contextlib.nullcontext((params, version)),
                                     group_size=c.group_size)
          score(rollouts, params, version)
        del params
    return rollouts, scored, time.perf_counter() - t0 - diagnostics_s, diagnostics_s

  return produce


def _combine_teacher_forced(results: list[dict[str, list[float]]]) -> list[float]:
  """Per-depth acceptance of several calls' teacher-forced results, weighted by the
  positions each depth was scored at."""
  n = np.asarray([r["positions"] for r in results], float)
  alpha = np.asarray([r["alpha"] for r in results], float)
  return (np.sum(alpha * n, axis=0) / np.maximum(n.sum(axis=0), 1)).tolist()


def _describe_eval(ev: dict) -> str:
  parts = [f"{n} {v:.3f}+-{ev['pass_at_1_se'][n]:.3f}" for n, v in ev["pass_at_1"].items()]
  acc = "; ".join(f"{m} acceptance {'/'.join(f'{a:.3f}' for a in r['acceptance'])}"
                  for m, r in ev["modes"].items())
  return ", ".join(parts) + f" ({acc})"


def _learner_flops(ordered: list[dict]) -> dict[str, float]:
  """Median model FLOP/s of the learner's policy updates over the logged steps and their
  ratio to the matmul calibration (bebop_jax.train.flops)."""
  if not ordered or not all("learner_model_flops_per_s" in r for r in ordered):
    return {}
  model = float(np.median([r["learner_model_flops_per_s"] for r in ordered]))
  return {"learner_model_flops_per_s": model,
          "learner_flops_utilization": model / ordered[0]["learner_matmul_flops_per_s"]}


def _summary(config, workdir, evals, num_steps, source, seconds, compile_s):
  steps = metrics_lib.read_metrics(workdir, STAGE)
  by_step = {r["step"]: r for r in steps}
  ordered = [by_step[s] for s in sorted(by_step)]
  k = max((int(key.rsplit("_", 1)[1]) for key in (ordered[0] if ordered else {})
           if key.startswith("acceptance_")), default=0)
  before, after = evals["0"], evals[str(num_steps)]
  # Seconds of the logged steps (every step with log_every 1).
  totals = {k: float(sum(r[k] for r in ordered))
            for k in ("rollout_s", "learner_s", "mtp_update_s")}
  sides = {k: float(sum(r.get(k, 0.0) for r in ordered))
           for k in ("step_s", "sync_s", "learner_idle_s", "rollout_idle_s")}
  asynchronous = config.rl.asynchronous
  tf_modes = tuple(config.rl.acceptance_modes)
  return {
      "steps": num_steps, "complete": True, "feedstage": source,
      "mtp_strategy": config.rl.mtp.strategy, "rollout_engine": config.rl.rollout.engine,
      "rollout_mode": config.rl.rollout.mode,
      "pass_at_1_before": before["pass_at_1"], "pass_at_1_after": after["pass_at_1"],
      "pass_at_1_se_before": before["pass_at_1_se"], "pass_at_1_se_after": after["pass_at_1_se"],
      "pass_at_1_delta": paired_difference(before, after),
      "mean_reward_before": before["mean_reward"], "mean_reward_after": after["mean_reward"],
      "acceptance_before": {m: r["acceptance"] for m, r in before["modes"].items()},
      "acceptance_after": {m: r["acceptance"] for m, r in after["modes"].items()},
      "tokens_per_target_forward_before": {m: r["tokens_per_target_forward"]
                                           for m, r in before["modes"].items()},
      "tokens_per_target_forward_after": {m: r["tokens_per_target_forward"]
                                          for m, r in after["modes"].items()},
      "logged_steps": [r["step"] for r in ordered],
      "acceptance_by_step": [[r[f"acceptance_{d}"] for d in range(1, k + 1)] for r in ordered],
      "tf_acceptance_by_step": {
          m: [[r.get(f"tf_acceptance_{m}_{d}") for d in range(1, k + 1)] for r in ordered]
          for m in tf_modes},
      "reward_by_step": [r["reward_mean"] for r in ordered],
      # Adaptive rollouts (decoding.adaptive): decoding iterations run with each K, summed.
      "adaptive_k_iterations": {
          key.split("/k")[1].split("_")[0]: int(sum(r.get(key, 0) for r in ordered))
          for key in sorted({key for r in ordered for key in r
                             if key.startswith("adaptive/k")})},
      "entropy_by_step": [r["entropy"] for r in ordered],
      "eval_by_step": {s: {"pass_at_1": e["pass_at_1"], "pass_at_1_se": e["pass_at_1_se"],
                           "acceptance": {m: r["acceptance"] for m, r in e["modes"].items()}}
                       for s, e in sorted(evals.items(), key=lambda kv: int(kv[0]))},
      "timing": {**totals, **sides, "compile_s": compile_s, "stage_s": seconds,
                 "rollout_share": totals["rollout_s"] / max(sum(totals.values()), 1e-9),
                 **_learner_flops(ordered)},
      "async": {
          "enabled": asynchronous.enabled,
          "max_staleness": asynchronous.max_staleness if asynchronous.enabled else 0,
          "staleness_max": max((r.get("staleness_max", 0.0) for r in ordered), default=0.0),
          "staleness_mean": float(np.mean([r.get("staleness_mean", 0.0) for r in ordered]))
                            if ordered else 0.0,
          "rollout_restarts": max((r.get("rollout_restarts", 0) for r in ordered), default=0),
          "placement": config.rl.placement.mode},
  }
