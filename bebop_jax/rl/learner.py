"""The RL learner: rollouts into learner batches, log-probs of sampled tokens, and the
policy-loss function the shared jitted train step (train/trainer.py) optimises.

A step's rollouts first become a row-per-rollout batch (`learner_batch`, [B, L] with L the
smallest length bucket that holds the longest rollout, advantages [B]). Each policy update
then gets its minibatch as an update batch (`update_batches`): with `rl.packing` the
minibatch's rollouts are packed first-fit-decreasing into rows of the learner's longest
length (max_prompt_len + max_new_tokens), every rollout its own segment (completions are
mostly far shorter than their budget, so a row-per-rollout batch is mostly padding);
without it, each rollout keeps its own row. The row count is bucketed to multiples of
ROW_STEP, so a run compiles a handful of shapes and nothing in steady state. Update batch
([R, L'] each):
  tokens              int32  bos + prompt + completion (policy turns and replies) per
                             segment, 0 on padding
  segment_ids         int32  1, 2, ... per rollout in the row; 0 on padding
  positions           int32  position inside the rollout (restarts at 0 per segment)
  mask                int32  1 where the policy sampled the token (the loss mask; 0 on the
                             prompt, environment replies, padding and dropped rows)
  behaviour_logprobs  f32    the sampler's log-probs of those tokens (0 elsewhere)
  advantages          f32    the rollout's advantage on each of its positions
  token_weights       f32    aggregation weights (rl.aggregation_weights over the
                             minibatch's rollouts, before packing, times the accumulation
                             steps; Dr. GRPO's constant is `drgrpo_norm`)
  ref_logprobs        f32    reference policy log-probs, only with a KL term
  proximal_logprobs   f32    the learner's log-probs before the step's updates, only for a
                             stale batch under the decoupled objective (rl.asynchronous)
Position t holds token t; its log-prob comes from the logits at t - 1 (the first position
of a segment is its bos, never in the loss).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from bebop_jax import multihost
from bebop_jax import sharding
from bebop_jax.data import packing
from bebop_jax.decoding import sampling
from bebop_jax.losses import head as head_lib
from bebop_jax.losses import mtp as mtp_losses
from bebop_jax.model.model import shift_left
from bebop_jax.rl import algorithms
from bebop_jax.rl.settings import RLSettings
from bebop_jax.rollout import Rollouts
from bebop_jax.train import flops as flops_lib
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.train import optimizer as optimizer_lib
from bebop_jax.train import trainer


def learner_batch(rollouts: Rollouts, advantages: np.ndarray, seq_len: int,
                  keep: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """The learner batch of `rollouts` (module docstring) without token_weights; rows where
  `keep` is False get an all-zero mask (they take no part in the loss)."""
  b = rollouts.num_rows
  tokens = np.zeros((b, seq_len), np.int32)
  segment_ids = np.zeros((b, seq_len), np.int32)
  mask = np.zeros((b, seq_len), np.int32)
  behaviour = np.zeros((b, seq_len), np.float32)
  for i in range(b):
    p, n = int(rollouts.prompt_lengths[i]), int(rollouts.lengths[i])
    if p + n > seq_len:
      raise ValueError(f"rollout {i} has {p} prompt + {n} completion tokens, more than the "
                       f"learner's sequence length {seq_len} (max_prompt_len + max_new_tokens)")
    tokens[i, :p] = rollouts.prompt_tokens[i, :p]
    tokens[i, p:p + n] = rollouts.tokens[i, :n]
    segment_ids[i, :p + n] = 1
    if keep is None or keep[i]:
      mask[i, p:p + n] = rollouts.policy_mask[i, :n]
    behaviour[i, p:p + n] = np.where(rollouts.policy_mask[i, :n], rollouts.logprobs[i, :n], 0.0)
  return {"tokens": tokens, "segment_ids": segment_ids, "mask": mask,
          "behaviour_logprobs": behaviour,
          "advantages": np.asarray(advantages, np.float32).reshape(b)}


def drgrpo_norm(rl: RLSettings) -> float:
  """Dr. GRPO's constant normaliser (seq-mean-token-sum-norm): the configured rows per
  update (prompts_per_batch x group_size / minibatches) x the generation budget
  (rollout.max_new_tokens). The same in every step, whatever the padded width of the
  step's batch or the rows dynamic sampling drops."""
  return float(rl.prompts_per_batch * rl.group_size // rl.minibatches *
               rl.rollout.max_new_tokens)


def with_token_weights(batch: Mapping[str, np.ndarray], aggregation: str,
                       grad_accum_steps: int = 1, norm: float | None = None
                       ) -> dict[str, np.ndarray]:
  """`batch` plus its token_weights: the aggregation over all of its rows (`norm`:
  seq-mean-token-sum-norm's constant), scaled by the accumulation steps (the train step
  averages microbatch gradients)."""
  w = np.asarray(algorithms.aggregation_weights(batch["mask"], aggregation, norm))
  return dict(batch, token_weights=(w * grad_accum_steps).astype(np.float32))


ROW_STEP = 4  # update batches have a multiple of this many rows (and of the data-parallel size)


def pack_rows(part: Mapping[str, np.ndarray], lengths: np.ndarray, bins: list[list[int]],
              rows: int, length: int) -> dict[str, np.ndarray]:
  """The update batch (module docstring) of `part`, a row-per-rollout batch with per-row
  advantages and token_weights: row r holds the rollouts `bins[r]` back to back, rollout i
  its first lengths[i] positions (data.packing.pack); rows past len(bins) are padding."""
  per_token = [k for k, v in part.items() if np.ndim(v) == 2 and k != "segment_ids"]
  fields = {k: part[k] for k in per_token} | {"advantages": part["advantages"]}
  dtypes = {k: part[k].dtype for k in per_token} | {"advantages": np.float32}
  return packing.pack(fields, lengths, bins, rows, length, dtypes)


def update_batches(rl: RLSettings, full: Mapping[str, np.ndarray], lengths: np.ndarray, *,
                   seq_len: int, rows_buckets: tuple[int, ...]) -> list[dict[str, np.ndarray]]:
  """The update batches (module docstring) of a row-per-rollout batch `full` (per-row
  advantages; ref/proximal log-probs where used) whose rollouts have `lengths` tokens: one
  per minibatch of rl.minibatches, all of one shape. With rl.packing, rows of `seq_len`
  positions, as many as the smallest of `rows_buckets` that holds every minibatch."""
  size = full["tokens"].shape[0] // rl.minibatches
  parts = [with_token_weights({k: v[mb * size:(mb + 1) * size] for k, v in full.items()},
                              rl.aggregation, rl.train.grad_accum_steps,
                              drgrpo_norm(rl))
           for mb in range(rl.minibatches)]
  sizes = [lengths[mb * size:(mb + 1) * size] for mb in range(rl.minibatches)]
  if rl.packing:
    length = seq_len
    bins = [packing.first_fit_decreasing(n, length) for n in sizes]
    rows = next(r for r in rows_buckets if r >= max(map(len, bins)))
  else:
    length, rows = full["tokens"].shape[1], size
    bins = [[[i] for i in range(size)]] * len(parts)
  return [pack_rows(p, n, b, rows, length) for p, n, b in zip(parts, sizes, bins)]


def example_batch(rl: RLSettings, rows: int, length: int, *, proximal: bool = False
                  ) -> dict[str, np.ndarray]:
  """An all-zero update batch of `rows` x `length` (for compiling): with ref_logprobs under
  a KL term and, with `proximal`, proximal_logprobs (the decoupled objective's stale
  batches)."""
  ints = ("tokens", "segment_ids", "positions", "mask")
  floats = ("behaviour_logprobs", "advantages", "token_weights")
  floats += ("ref_logprobs",) if rl.kl_coef > 0 else ()
  floats += ("proximal_logprobs",) if proximal else ()
  return {**{k: np.zeros((rows, length), np.int32) for k in ints},
          **{k: np.zeros((rows, length), np.float32) for k in floats}}


_warned_truncation = False  # the fused head's fallback to dense is logged once a process


def truncates(params: sampling.SamplingParams, vocab_size: int) -> bool:
  """Whether the sampling distribution is a truncation of softmax(logits / temperature):
  greedy, or top-k below the vocabulary, or top-p below 1 (as sampling.sampling_logprobs)."""
  return params.greedy or 0 < params.top_k < vocab_size or params.top_p < 1.0


def resolve_head(head: str, params: sampling.SamplingParams, vocab_size: int) -> str:
  """The head the learner's log-probs use: `head` (losses.head.HEADS), except "dense" when
  the sampling distribution is truncated (an exact top-k / top-p needs every logit of a row
  at once, which vocabulary chunks do not give cheaply); that fallback logs one warning."""
  global _warned_truncation
  head_lib.check_head(head, "rl.head")
  if head != "fused" or not truncates(params, vocab_size):
    return head
  if not _warned_truncation:
    _warned_truncation = True
    logging.warning(
        "rl.head='fused' with a truncated sampling distribution (rl.rollout.top_k=%d, "
        "rl.rollout.top_p=%s, rl.rollout.temperature=%s): the learner's log-probs must be "
        "those of the truncated distribution, which the fused head cannot give; using dense "
        "[B, T, V] logits for the policy, proximal and reference log-probs instead.",
        params.top_k, params.top_p, params.temperature)
  return "dense"


def token_logprobs_and_entropy(model, tokens: jax.Array, segment_ids: jax.Array,
                               params: sampling.SamplingParams,
                               positions: jax.Array | None = None, *, head: str = "fused"
                               ) -> tuple[jax.Array, jax.Array]:
  """([B, T] log-prob of tokens[:, t] given the tokens before it in its segment, [B, T] the
  entropy of the distribution it was drawn from) under the sampling distribution
  (temperature, top-k, top-p as in decoding); both 0 at t = 0. Trunk only (no MTP chain).
  `positions` restart per segment in packed rows (default arange). `head` (resolve_head):
  "fused" streams the head over vocabulary chunks (no [B, T, V] logits), "dense" reduces the
  logits."""
  head = resolve_head(head, params, model.config.vocab_size)
  out = model(tokens, positions, segment_ids, num_draft_steps=0, logits=head == "dense")
  if head == "dense":
    logp = sampling.sampling_logprobs(out["logits"][:, :-1], params)
    lp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    p = jnp.exp(logp)
    entropy = -jnp.sum(p * jnp.where(p > 0, logp, 0.0), axis=-1)
  else:
    # Every position (the last one scores a padding token): slicing [B, T, E] to T - 1
    # positions would copy it and break the length axis's layout.
    terms = head_lib.next_token_terms(out, shift_left(tokens, 1),
                                      temperature=params.temperature)
    lp, entropy = terms["logprob"][:, :-1], terms["entropy"][:, :-1]
  pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
  return pad(lp), pad(entropy)


def token_logprobs(model, tokens: jax.Array, segment_ids: jax.Array,
                   params: sampling.SamplingParams, positions: jax.Array | None = None, *,
                   head: str = "fused") -> jax.Array:
  """[B, T] log-prob of tokens[:, t] (token_logprobs_and_entropy)."""
  return token_logprobs_and_entropy(model, tokens, segment_ids, params, positions,
                                    head=head)[0]


def make_logprobs_fn(graphdef: nnx.GraphDef, params: sampling.SamplingParams, *,
                     head: str = "fused"):
  """jit((trainable, frozen, tokens, segment_ids) -> token log-probs [B, T])."""
  head_lib.check_head(head, "rl.head")

  @jax.jit
  def logprobs_fn(trainable, frozen, tokens, segment_ids):
    return token_logprobs(nnx.merge(graphdef, trainable, frozen), tokens, segment_ids, params,
                          head=head)

  return logprobs_fn


def make_policy_loss_fn(params: sampling.SamplingParams, *, clip_low: float, clip_high: float,
                        aggregation: str, kl_coef: float = 0.0, is_cap: float | None = None,
                        is_mode: str = "cap", head: str = "fused", entropy_coef: float = 0.0):
  """The RL loss_fn(model, batch) -> (loss, metrics) for trainer.make_train_step; with
  `proximal_logprobs` in the batch, the decoupled objective (is_cap, is_mode). `head`
  (rl.head): how the log-probs reach the vocabulary (token_logprobs_and_entropy)."""
  head_lib.check_head(head, "rl.head")

  def loss_fn(model, batch) -> tuple[jax.Array, dict[str, Any]]:
    lp, entropy = token_logprobs_and_entropy(model, batch["tokens"], batch["segment_ids"],
                                             params, batch["positions"], head=head)
    loss, metrics = algorithms.policy_loss(
        lp, batch["behaviour_logprobs"], batch["advantages"], batch["mask"],
        clip_low=clip_low, clip_high=clip_high, aggregation=aggregation,
        proximal_logprobs=batch.get("proximal_logprobs"), is_cap=is_cap, is_mode=is_mode,
        ref_logprobs=batch.get("ref_logprobs"), kl_coef=kl_coef,
        token_weights=batch["token_weights"], entropy=entropy, entropy_coef=entropy_coef)
    return loss, dict(metrics, loss=loss)

  return loss_fn


def mtp_batch(batch: Mapping[str, np.ndarray], rollouts: Rollouts) -> dict[str, np.ndarray]:
  """Self-distillation rows for an MTP update from a learner batch: tokens, positions,
  segment ids, and loss_mask = the policy's tokens (every row, dropped or not)."""
  seq_len = batch["tokens"].shape[1]
  loss_mask = np.zeros_like(batch["tokens"])
  for i in range(rollouts.num_rows):
    p, n = int(rollouts.prompt_lengths[i]), int(rollouts.lengths[i])
    loss_mask[i, p:p + n] = rollouts.policy_mask[i, :n]
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), batch["tokens"].shape)
  return {"tokens": batch["tokens"], "segment_ids": batch["segment_ids"],
          "positions": np.where(batch["segment_ids"] > 0, positions, 0).astype(np.int32),
          "loss_mask": loss_mask}


def logprob_differences(batch: Mapping[str, np.ndarray], rows: np.ndarray, name: str
                        ) -> dict[str, float]:
  """{name}_logprob_diff_{mean,max}: |proximal - behaviour| over the loss tokens of `rows`
  whose proximal log-prob is finite (the learner's parameters before the step's updates
  against the sampler's); nothing when no such token."""
  m = (batch["mask"] > 0) & rows[:, None] & np.isfinite(batch["proximal_logprobs"])
  if not m.any():
    return {}
  d = np.abs(batch["proximal_logprobs"][m].astype(np.float64) -
             batch["behaviour_logprobs"][m])
  return {f"{name}_logprob_diff_mean": float(d.mean()),
          f"{name}_logprob_diff_max": float(d.max())}


IS_WEIGHT_QUANTILES = (0.5, 0.9, 0.99)


def behaviour_weight_stats(batch: Mapping[str, np.ndarray], is_cap: float) -> dict[str, float]:
  """The distribution of the behaviour weight exp(proximal - behaviour) over a batch's loss
  tokens: quantiles, the mean, the maximum and the fraction above `is_cap`."""
  m = batch["mask"] > 0
  if not m.any():
    return {}
  w = np.exp(batch["proximal_logprobs"][m].astype(np.float64) -
             batch["behaviour_logprobs"][m].astype(np.float64))
  out = {f"is_weight_p{round(q * 100)}": float(np.quantile(w, q)) for q in IS_WEIGHT_QUANTILES}
  out.update(is_weight_batch_mean=float(w.mean()), is_weight_batch_max=float(w.max()),
             is_weight_above_cap_frac=float((w > is_cap).mean()))
  return out


# ----------------------------------------------------------------------------- the learner

MTP_STRATEGIES = ("frozen", "online", "periodic")
_MTP_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
LENGTH_STEP = 64  # learner batches are cut to the smallest multiple of this that fits


def length_buckets(seq_len: int) -> tuple[int, ...]:
  """The learner batch lengths: multiples of LENGTH_STEP below seq_len, and seq_len."""
  return tuple(range(LENGTH_STEP, seq_len, LENGTH_STEP)) + (seq_len,)


def row_buckets(rows: int, data_parallel: int = 1, grad_accum_steps: int = 1
                ) -> tuple[int, ...]:
  """The update batch row counts for minibatches of `rows` rollouts: multiples of a step
  below `rows`, and `rows`. Every count splits into `grad_accum_steps` microbatches that
  split over `data_parallel` devices, so the step is the smallest multiple of
  data_parallel x grad_accum_steps that is >= ROW_STEP (`rows` itself is such a multiple:
  config validation checks it)."""
  unit = data_parallel * grad_accum_steps
  if rows % unit:
    raise ValueError(f"an update of {rows} rollouts does not split into {grad_accum_steps} "
                     f"microbatches over {data_parallel} data-parallel devices")
  step = unit * -(-ROW_STEP // unit)
  return tuple(range(step, rows, step)) + (rows,)


class Learner:
  """The RL learner over two parameter groups: the trunk (policy updates with the clipped
  loss, `rl.optim`) and the MTP modules (`rl.mtp.strategy`: frozen, or MTP-only updates with
  `rl.mtp.loss`, `rl.mtp.optim`). Both updates are the shared train step on the mesh,
  parameters and optimizer states donated, compiled once per update batch shape (module
  docstring: packed rows of `seq_len` positions in `row_buckets` counts with rl.packing,
  else a row per rollout cut to the smallest of `length_buckets(seq_len)` that holds the
  longest), the largest ahead of time; a run compiles a handful of shapes and nothing in
  steady state.

  `rl` is the RL settings (`config.rl`, typed); `params` the policy's parameters (trunk and MTP
  modules); `seq_len` the longest rollout (max prompt + completion budget); `mtp_head`
  config.mtp.head (the drafter update's losses, losses.mtp.HEADS). The policy update, the
  proximal and the reference log-probs use rl.head (`resolve_head`: dense under top-k /
  top-p truncation).
  """

  def __init__(self, rl: RLSettings, graphdef: nnx.GraphDef, params: nnx.State, *, mesh, rules,
               seq_len: int, mtp_head: str = "fused"):
    self.rl, self.seq_len, self.mesh, self.rules = rl, seq_len, mesh, rules
    self.buckets = length_buckets(seq_len)
    self.strategy = rl.mtp.strategy
    if self.strategy not in MTP_STRATEGIES:
      raise ValueError(f"rl.mtp.strategy={self.strategy!r} is not allowed: one of "
                       f"{MTP_STRATEGIES}")
    self.rows = rl.prompts_per_batch * rl.group_size
    self.update_rows = self.rows // rl.minibatches
    batch_axes = sharding.logical_to_spec(("batch",), rules, mesh)[0] or ()
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    self.row_buckets = row_buckets(self.update_rows,
                                   int(np.prod([mesh.shape[a] for a in batch_axes])),
                                   rl.train.grad_accum_steps)
    self.sampling = sampling.SamplingParams(rl.rollout.temperature, rl.rollout.top_k,
                                            rl.rollout.top_p)
    model = nnx.merge(graphdef, params)
    self.model_config = model.config
    # One graphdef serves both groups: nnx.merge(graphdef, trunk, mtp) either way round.
    self.graphdef, trunk, mtp = nnx.split(model, optimizer_lib.trainable_filter("main"), ...)
    num_steps = rl.train.num_steps
    self.tx, schedule = optimizer_lib.make_optimizer(rl.optim,
                                                     num_steps * rl.epochs * rl.minibatches)
    state = trainer.place_state(trainer.TrainState(trunk, mtp, self.tx.init(trunk), 0),
                                mesh, rules, self.tx)
    self.trunk, self.mtp = state.trainable, state.frozen
    self.trunk_opt, self.updates = state.opt_state, state.step
    self.ref_trunk = jax.tree.map(jnp.copy, self.trunk) if rl.kl_coef > 0 else None
    self.head = resolve_head(rl.head, self.sampling, self.model_config.vocab_size)
    self.ref_fn = (make_logprobs_fn(self.graphdef, self.sampling, head=self.head)
                   if self.ref_trunk is not None else None)
    asynchronous = rl.asynchronous
    # The decoupled objective for stale batches: proximal log-probs recomputed under the
    # learner's parameters before the step's updates (rl.asynchronous.off_policy).
    self.decoupled = asynchronous.enabled and asynchronous.off_policy == "decoupled"
    self.is_cap = float(asynchronous.is_cap)
    self._policy_fn = trainer.make_train_step(self.graphdef, make_policy_loss_fn(
        self.sampling, clip_low=rl.clip_low, clip_high=rl.clip_high,
        aggregation=rl.aggregation, kl_coef=rl.kl_coef, is_cap=self.is_cap,
        is_mode=asynchronous.is_mode, head=self.head, entropy_coef=rl.entropy_coef),
        self.tx, schedule,
        rl.train.grad_accum_steps)
    self.logprobs_fn = (make_logprobs_fn(self.graphdef, self.sampling, head=self.head)
                        if self.decoupled else None)
    self._compiled: dict[tuple[str, int], tuple[trainer.CompiledStep, Any]] = {}
    self.mtp_opt = self.mtp_updates = self.buffer = None
    if self.strategy != "frozen":
      total = num_steps if self.strategy == "online" else num_steps // rl.mtp.every * rl.mtp.every
      self.mtp_tx, mtp_schedule = optimizer_lib.make_optimizer(rl.mtp.optim, max(total, 1))
      mstate = trainer.place_state(
          trainer.TrainState(self.mtp, self.trunk, self.mtp_tx.init(self.mtp), 0), mesh,
          rules, self.mtp_tx)
      self.mtp_opt, self.mtp_updates = mstate.opt_state, mstate.step

      def mtp_loss_fn(model, batch):
        out = model(batch["tokens"], batch["positions"], batch["segment_ids"],
                    mtp_stop_gradient=True, logits=mtp_head == "dense")
        return mtp_losses.mtp_loss(out, batch["tokens"], batch["loss_mask"], loss=rl.mtp.loss,
                                   temperature=rl.rollout.temperature)

      self._mtp_fn = trainer.make_train_step(self.graphdef, mtp_loss_fn, self.mtp_tx,
                                             mtp_schedule)
      if self.strategy == "periodic":
        self.buffer = {k: np.zeros((rl.mtp.every, self.rows, seq_len), np.int32)
                       for k in _MTP_KEYS}
    # The largest shapes ahead of time; smaller ones on first use.
    self._step("policy", seq_len, self.update_rows)
    if self.decoupled:
      self._step("policy_proximal", seq_len, self.update_rows)
    if self.strategy != "frozen":
      self._step("mtp", seq_len)

  def _step(self, kind: str, length: int, rows: int | None = None
            ) -> tuple[trainer.CompiledStep, dict[str, Any]]:
    """(the compiled policy update for update batches of `rows` x `length`, or the MTP
    update for batches of `length` positions; the batch shardings)."""
    key = (kind, length, rows)
    if key not in self._compiled:
      if kind.startswith("policy"):
        example = example_batch(self.rl, rows, length, proximal=kind == "policy_proximal")
        state = trainer.TrainState(self.trunk, self.mtp, self.trunk_opt, self.updates)
        fn, tx = self._policy_fn, self.tx
      else:
        example = {k: np.zeros((self.rows, length), np.int32) for k in _MTP_KEYS}
        state = trainer.TrainState(self.mtp, self.trunk, self.mtp_opt, self.mtp_updates)
        fn, tx = self._mtp_fn, self.mtp_tx
      self._compiled[key] = (
          trainer.compile_train_step(fn, state, example, self.mesh, self.rules, tx),
          trainer.batch_shardings(example, self.mesh, self.rules))
    return self._compiled[key]

  @property
  def compile_seconds(self) -> float:
    """Seconds spent compiling updates so far."""
    return sum(c.compile_seconds for c, _ in self._compiled.values())

  @property
  def num_compiled(self) -> int:
    return len(self._compiled)

  def bucket(self, lengths: np.ndarray) -> int:
    """The smallest length bucket that holds every one of `lengths`."""
    longest = int(np.max(lengths))
    for b in self.buckets:
      if longest <= b:
        return b
    raise ValueError(f"a rollout of {longest} tokens is longer than the learner's "
                     f"{self.seq_len} (max_prompt_len + max_new_tokens)")

  def params(self) -> nnx.State:
    """The current parameters, trunk and MTP modules (one version)."""
    return nnx.merge_state(self.trunk, self.mtp)

  # -------------------------------------------------------------- checkpoints

  def state_tree(self) -> dict[str, Any]:
    """Everything a checkpoint needs to resume the learner exactly."""
    t = {"trunk": self.trunk, "mtp": self.mtp, "trunk_opt": self.trunk_opt,
         "updates": self.updates}
    if self.mtp_opt is not None:
      t.update(mtp_opt=self.mtp_opt, mtp_updates=self.mtp_updates)
    if self.buffer is not None:
      t["buffer"] = self.buffer
    return t

  def load_state_tree(self, t: Mapping[str, Any]) -> None:
    """Restores what `state_tree` saved (arrays already placed by the checkpointer)."""
    self.trunk, self.mtp, self.trunk_opt, self.updates = (
        t["trunk"], t["mtp"], t["trunk_opt"], t["updates"])
    if self.mtp_opt is not None:
      self.mtp_opt, self.mtp_updates = t["mtp_opt"], t["mtp_updates"]
    if self.buffer is not None:
      self.buffer = {k: np.array(v) for k, v in t["buffer"].items()}

  # -------------------------------------------------------------- one RL step

  def update(self, rollouts: Rollouts, step: int, staleness: np.ndarray | None = None
             ) -> dict[str, float]:
    """The policy updates (and the drafter's, per strategy) of RL step `step` (0-based) on
    one batch of `rows` rollouts in groups; returns the step's learner metrics.

    `staleness` [rows]: how many versions older than the learner's parameters the version
    that sampled each row is (None: all 0, a fresh batch). On a stale batch under the
    decoupled objective the proximal log-probs are recomputed (one forward) and anchor the
    clip, with the behaviour weight exp(proximal - behaviour) capped or masked (a fresh
    batch needs none: its proximal policy is its behaviour policy).

    Truncated completions (`rollouts.truncated`: cut by the length budget) follow
    rl.overlong: "keep" trains on them as they are, "mask" leaves them out of the loss
    (DAPO's overlong filtering; they still count in their group's reward statistics), and
    "penalty" adds DAPO's soft overlong punishment to every reward (overlong_penalty).

    Log-prob differences: on rows sampled by the learner's current parameters,
    sampler_learner_logprob_diff_{mean,max} compare the sampler's log-probs with the
    learner's recomputation (numerics only: they should be ~0); on stale rows the same
    difference is policy drift plus numerics and is logged as
    policy_drift_logprob_diff_{mean,max}.
    """
    rl = self.rl
    start = time.perf_counter()
    if rollouts.num_rows != self.rows:
      raise ValueError(f"{rollouts.num_rows} rollouts; the learner was built for "
                       f"rl.prompts_per_batch x rl.group_size = {self.rows}")
    staleness = (np.zeros(self.rows, np.int64) if staleness is None
                 else np.asarray(staleness, np.int64))
    stale_rows = staleness > 0
    rewards = np.asarray(rollouts.rewards, np.float32)
    truncated = np.asarray(rollouts.truncated, bool)
    metrics: dict[str, float] = {}
    if rl.overlong == "penalty":
      penalty = np.asarray(algorithms.overlong_penalty(rollouts.lengths, rl.rollout.max_new_tokens,
                                 rl.overlong_buffer))
      rewards = rewards + penalty
      metrics["overlong_penalty_mean"] = float(penalty.mean())
    adv = np.asarray(algorithms.advantages(rewards, rl.group_size, rl.advantage))
    keep = np.ones(self.rows, bool)
    if rl.dynamic_sampling:
      keep &= np.asarray(algorithms.dynamic_sampling_mask(rewards, rl.group_size))
    if rl.overlong == "mask":
      keep &= ~truncated
    lengths = rollouts.prompt_lengths + rollouts.lengths
    full = learner_batch(rollouts, adv, self.bucket(lengths), keep)
    if self.ref_fn is not None:
      full["ref_logprobs"] = multihost.to_host(self.ref_fn(
          self.ref_trunk, self.mtp, full["tokens"], full["segment_ids"]))
    kind = "policy"
    if stale_rows.any() and self.decoupled:
      kind = "policy_proximal"
      full["proximal_logprobs"] = multihost.to_host(self.logprobs_fn(
          self.trunk, self.mtp, full["tokens"], full["segment_ids"]))
      metrics.update(behaviour_weight_stats(full, self.is_cap))
      # The proximal log-probs are the learner's before this step's updates.
      metrics.update(logprob_differences(full, ~stale_rows, "sampler_learner"))
      metrics.update(logprob_differences(full, stale_rows, "policy_drift"))
    parts = update_batches(rl, full, lengths, seq_len=self.seq_len,
                           rows_buckets=self.row_buckets)
    rows, length = parts[0]["tokens"].shape
    compiled, batch_sh = self._step(kind, length, rows)
    # Every process holds the whole batch (the rollouts were exchanged): each places the
    # blocks its devices hold.
    parts = [multihost.put_everywhere(p, batch_sh) for p in parts]
    results = []
    for _ in range(rl.epochs):
      for part in parts:
        self.trunk, self.trunk_opt, self.updates, m = compiled.fn(
            self.trunk, self.mtp, self.trunk_opt, self.updates, part)
        results.append(m)
    results = jax.device_get(results)
    if kind == "policy":
      # The first update's log-probs are under the parameters that sampled a fresh batch:
      # the sampler-learner difference, measured for free (on a stale batch without the
      # decoupled objective, drift since sampling as well).
      name = "policy_drift" if stale_rows.any() else "sampler_learner"
      metrics[f"{name}_logprob_diff_mean"] = float(results[0]["logprob_diff_mean"])
      metrics[f"{name}_logprob_diff_max"] = float(results[0]["logprob_diff_max"])
    metrics.update(metrics_lib.combine_list(results))
    metrics["dropped_frac"] = float(1 - keep.mean())
    metrics["truncated_frac"] = float(truncated.mean())
    metrics["learner_length"] = length
    metrics["learner_rows"] = rows
    # The fraction of the update batches' positions that hold a token.
    metrics["learner_fill"] = float(lengths.sum() / (len(parts) * rows * length))
    metrics["learner_compiles"] = self.num_compiled
    metrics["learner_s"] = time.perf_counter() - start
    # Model FLOP/s of the policy updates over the whole learner time (host work included);
    # timing keys end in _s (the stage summary gives their ratio, the utilization).
    u = flops_lib.utilization(
        len(results) * flops_lib.train_flops_per_step(self.model_config, rows, length, 0),
        metrics["learner_s"])
    metrics["learner_model_flops_per_s"] = u["model_flops_per_s"]
    metrics["learner_matmul_flops_per_s"] = u["matmul_flops_per_s"]
    start = time.perf_counter()
    metrics.update(self._update_mtp(mtp_batch(full, rollouts), step))
    metrics["mtp_update_s"] = time.perf_counter() - start
    return metrics

  def _update_mtp(self, fresh: dict[str, np.ndarray], step: int) -> dict[str, float]:
    if self.strategy == "frozen":
      return {}
    if self.strategy == "online":
      batches = [fresh]
    else:
      n = fresh["tokens"].shape[1]
      for k in self.buffer:
        self.buffer[k][step % self.rl.mtp.every] = np.pad(fresh[k],
                                                          ((0, 0), (0, self.seq_len - n)))
      if (step + 1) % self.rl.mtp.every:
        return {}
      batches = []
      for i in range(self.rl.mtp.every):
        length = self.bucket(self.buffer["segment_ids"][i].sum(axis=1))
        batches.append({k: v[i, :, :length] for k, v in self.buffer.items()})
    results = []
    for b in batches:
      compiled, batch_sh = self._step("mtp", b["tokens"].shape[1])
      b = multihost.put_everywhere(b, batch_sh)
      self.mtp, self.mtp_opt, self.mtp_updates, m = compiled.fn(
          self.mtp, self.trunk, self.mtp_opt, self.mtp_updates, b)
      results.append(m)
    # Every update's metrics (a periodic update trains on every buffered batch).
    return {f"mtp/{k}": v for k, v in metrics_lib.combine_list(jax.device_get(results)).items()}

