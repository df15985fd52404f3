"""The drafter's data and measurements, as a library: rollouts of a policy, their packing into
rows with the trunk's cached features, the training dataset over them, and the per-depth
acceptance of a drafter (teacher-forced, summed over packed rows). The MTP stage
(bebop_jax.stages.mtp) drives these from the config."""

from __future__ import annotations

import functools
import hashlib
from typing import Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bebop_jax import rollout
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import drafter_store as drafter_store_lib
from bebop_jax.data import packing
from bebop_jax.data import pipeline
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.decoding import batching, diagnostics, sampling
from bebop_jax.losses import mtp as mtp_losses
from bebop_jax.model import model as policy_lib
from bebop_jax.train import metrics as metrics_lib


def sample_rollouts(graphdef: nnx.GraphDef, params: nnx.State,
                    examples: dict[str, Sequence[tasks_lib.Example]],
                    task_objs: dict[str, tasks_lib.Task], rng: jax.Array,
                    settings: rollout.RolloutSettings, *,
                    tokenizer: tokenizer_lib.BaseTokenizer, progress: bool = False,
                    desc: str = "[mtp] rollouts") -> dict[str, rollout.Rollouts]:
  """{task: one rollout per example} from the rollout engine, with `tokenizer` (`progress`:
  a bar with an ETA titled `desc`, a step per task)."""
  engine = rollout.JaxEngine(graphdef, params, task_objs, settings, tokenizer=tokenizer)
  bar = metrics_lib.Progress(sum(len(e) for e in examples.values()), 0, desc,
                             disable=not progress, unit="prompt")
  out = {}
  for name, exs in examples.items():
    rng, key = jax.random.split(rng)
    out[name] = engine.generate(exs, key)
    bar.update(len(exs))
  bar.close()
  return out


def pack_rows(sequences: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int,
              max_targets: int | None = None) -> dict[str, np.ndarray]:
  """First-fit-decreasing packing (data.packing) of (tokens, loss_mask) sequences into rows
  [R, seq_len] with segment ids (1, 2, ... per sequence; 0 = padding) and per-sequence
  positions. Longer sequences are cut to seq_len. With `max_targets`, no row holds more than
  that many loss targets, and "rows" [R, max_targets] lists the rows' target rows
  (losses.mtp.loss_rows: where the MTP head runs)."""
  cut, lengths, bins = _bins(sequences, seq_len, max_targets)
  out = packing.pack({"tokens": [t for t, _ in cut], "loss_mask": [m for _, m in cut]},
                     lengths, bins, len(bins), seq_len,
                     {"tokens": np.int32, "loss_mask": np.int32})
  if max_targets is not None:
    out["rows"] = mtp_losses.loss_rows(out["loss_mask"], max_targets)
  return out


def _bins(sequences, seq_len: int, max_targets: int | None):
  """(sequences cut to seq_len, their lengths, first-fit-decreasing bins): `pack_rows`'
  placement."""
  cut = [(np.asarray(t[:seq_len]), np.asarray(m[:seq_len])) for t, m in sequences]
  lengths = np.array([len(t) for t, _ in cut])
  targets = None if max_targets is None else np.array(
      [int(np.sum(np.asarray(m[1:]) > 0)) for _, m in cut])
  return cut, lengths, packing.first_fit_decreasing(lengths, seq_len, targets, max_targets)


def pack_hidden(hidden: Sequence[np.ndarray], sequences, seq_len: int,
                max_targets: int | None = None) -> np.ndarray:
  """[R, seq_len, E] float32: per-sequence features `hidden` ([len, E] each, e.g. the h0
  decoding kept, Rollouts.hidden) placed where `pack_rows(sequences, seq_len, max_targets)`
  puts their sequences (0 on padding)."""
  _, lengths, bins = _bins(sequences, seq_len, max_targets)
  for i, n in enumerate(lengths):
    if len(hidden[i]) < n:
      raise ValueError(f"sequence {i} has {n} tokens but {len(hidden[i])} feature rows")
  return packing.pack({"hidden": hidden}, lengths, bins, len(bins), seq_len,
                      {"hidden": np.float32})["hidden"]


def trunk_features(graphdef: nnx.GraphDef, params: nnx.State, rows: dict[str, np.ndarray],
                   batch_size: int, progress: bool = False) -> np.ndarray:
  """[R, T, E] float32: the main model's h0 over packed rows (tokens, positions,
  segment_ids), `batch_size` rows per forward: what the frozen trunk gives the drafter's
  training step (Policy.__call__'s `hidden=`)."""
  fn = _trunk_hidden(graphdef)
  n, t = rows["tokens"].shape
  out = None
  bar = metrics_lib.Progress(n, 0, "[mtp] trunk features", disable=not progress,
                             unit="row")
  for first in range(0, n, batch_size):
    take = {k: rows[k][first:first + batch_size] for k in ("tokens", "positions",
                                                            "segment_ids")}
    got = len(take["tokens"])
    if got < batch_size:  # one shape: pad the last batch with empty rows
      take = {k: np.pad(v, ((0, batch_size - got), (0, 0))) for k, v in take.items()}
    h = np.asarray(jax.device_get(fn(params, take["tokens"], take["positions"],
                                     take["segment_ids"])))[:got]
    if out is None:
      out = np.zeros((n, t, h.shape[-1]), np.float32)
    out[first:first + got] = h
    bar.update(got)
  bar.close()
  return out


@functools.lru_cache(maxsize=8)
def _trunk_hidden(graphdef: nnx.GraphDef):
  @jax.jit
  def fn(params, tokens, positions, segment_ids):
    out = nnx.merge(graphdef, params)(tokens, positions, segment_ids, num_draft_steps=0,
                                      logits=False, frozen_layers=True)
    return out["hidden"].astype(jnp.float32)
  return fn


def _features_name(split: str, rows: dict[str, np.ndarray]) -> str:
  """A cache name for the trunk features of exactly these packed rows."""
  digest = hashlib.sha256()
  for k in ("tokens", "positions", "segment_ids"):
    digest.update(np.ascontiguousarray(rows[k]).tobytes())
  return f"{split}_{rows['tokens'].shape[1]}_{digest.hexdigest()[:12]}"


def cached_features(store: drafter_store_lib.DrafterStore, split: str,
                    rows: dict[str, np.ndarray], graphdef, params, batch_size: int,
                    progress: bool = False, packed: np.ndarray | None = None
                    ) -> tuple[np.ndarray, str]:
  """(the trunk features of `rows` from the store, memory-mapped; where they came from:
  "stored", "decoding" or "forward") stored first when absent: `packed` (the features
  decoding kept, `pack_hidden`) when given, else a trunk forward over the rows. Keyed by
  the rows' contents: the policy is the store's."""
  name = _features_name(split, rows)
  if store.has_features(name):
    return store.features(name), "stored"
  source = "decoding" if packed is not None else "forward"
  if packed is None:
    packed = trunk_features(graphdef, params, rows, batch_size, progress)
  store.write_features(name, packed)
  return store.features(name), source


class _Rows:
  """A grain source over packed rows (`features`: an [R, T, E] array, e.g. memory-mapped,
  given as each row's "hidden")."""

  def __init__(self, rows: dict[str, np.ndarray], features: np.ndarray | None = None):
    self.rows = rows
    self.features = features

  def __len__(self):
    return len(self.rows["tokens"])

  def __getitem__(self, i):
    item = {k: v[i] for k, v in self.rows.items()}
    if self.features is not None:
      item["hidden"] = np.asarray(self.features[i], np.float32)
    return item


class _ShardOfBatches:
  """Shard s of S of a stream read in batches of `batch_size`: its element j is element
  (j // m) * batch_size + s * m + j % m of `ds` (m = batch_size / S), so shard s's batches
  of m are the s-th m rows of every batch of the whole stream."""

  def __init__(self, ds: grain.MapDataset, batch_size: int, shard: tuple[int, int]):
    self.ds, (self.index, self.count) = ds, shard
    if batch_size % self.count:
      raise ValueError(f"mtp.batch_size={batch_size} does not split into {self.count} shards")
    self.rows, self.batch_size = batch_size // self.count, batch_size

  def __len__(self):
    return len(self.ds) // self.count

  def __getitem__(self, j):
    j = int(j)
    return self.ds[(j // self.rows) * self.batch_size + self.index * self.rows + j % self.rows]


def train_dataset(rows: dict[str, np.ndarray], batch_size: int, seed: int,
                  features: np.ndarray | None = None, shard: tuple[int, int] = (0, 1)
                  ) -> grain.IterDataset:
  """Endless shuffled batches of packed rows, with their trunk features when given
  (checkpointable iterator). `shard` = (s, S): the s-th batch_size / S rows of each of
  those batches (a process reads only its rows; the global batches do not depend on S)."""
  if not len(rows["tokens"]):
    raise ValueError("no self-distillation data; raise mtp.data.num_prompts")
  ds = grain.MapDataset.source(_Rows(rows, features)).shuffle(seed=seed).repeat()
  if shard[1] > 1:
    ds = grain.MapDataset.source(_ShardOfBatches(ds, batch_size, shard))
  return (ds.batch(batch_size // shard[1], drop_remainder=True)
          .to_iter_dataset(pipeline.READ_OPTIONS))


def teacher_forced_acceptance(graphdef, params, sequences, *, temperature: float,
                              modes: Sequence[str], batch_size: int = 64,
                              buckets: Sequence[int] = batching.PROMPT_BUCKETS,
                              pack_length: int | None = None,
                              draft_vocab: Sequence[int] | None = None
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
  bins = packing.first_fit_decreasing(lengths, length)
  for seq, gen, seg, pos in diagnostics.packed_batches(sequences, bins, batch_size, length):
    out = jax.device_get(diagnostics.teacher_forced_acceptance_by_mode(
        graphdef, params, jnp.asarray(seq), jnp.asarray(gen), jnp.asarray(seg),
        jnp.asarray(pos), None if draft_vocab is None else jnp.asarray(draft_vocab),
        params=params_s, modes=tuple(modes)))
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


def acceptance_sums(out: dict[str, jax.Array], batch: dict[str, jax.Array], *,
                    temperature: float, draft_vocab: jax.Array | None = None
                    ) -> dict[str, jax.Array]:
  """Per depth [K], sums over a batch of the drafter's rejection-sampling acceptance
  alpha_k(i) = 1 - TV(p_{i+k}, q_i^k) at the start positions i it is drafted from online
  (x_{i+1} and x_{i+k+1} sampled by the policy): "alpha" (sum of alpha), "weight" (count),
  "reach_alpha" and "reach" (the same weighted by prod_{j<k} alpha_j(i), the probability
  of reaching depth k). From the forward's fused form with the batch's loss rows, as the
  training step computes it (`make_loss_fn`); `heldout_acceptance` divides them."""
  terms = mtp_losses.mtp_terms(out, batch["tokens"], batch["loss_mask"],
                               temperature=temperature, rows=batch.get("rows"),
                               draft_vocab=draft_vocab)
  alpha = 1.0 - terms["tv"]
  frontier = policy_lib.shift_left(batch["loss_mask"], 1) > 0
  mask = (terms["mask"] & frontier[None]).astype(jnp.float32)
  reach = jnp.concatenate([jnp.ones_like(alpha[:1]), jnp.cumprod(alpha, axis=0)[:-1]])
  total = lambda x: jnp.sum(x, axis=(1, 2))
  return {"alpha": total(mask * alpha), "weight": total(mask),
          "reach_alpha": total(mask * reach * alpha), "reach": total(mask * reach)}


def heldout_acceptance(graphdef: nnx.GraphDef, rows: dict[str, np.ndarray],
                       features: np.ndarray | None, *, batch_size: int, temperature: float,
                       draft_vocab: np.ndarray | None = None):
  """fn(params) -> {"alpha_k": reach-weighted, "alpha_unweighted_k", "draft_events_k"} of
  the held-out packed `rows` (with their trunk features, or the trunk run in the forward):
  the teacher-forced acceptance a training run tracks (`acceptance_sums`), one compiled
  forward per batch of `batch_size` rows."""
  @jax.jit
  def sums(params, batch):
    out = nnx.merge(graphdef, params)(
        batch["tokens"], batch["positions"], batch["segment_ids"], logits=False,
        frozen_layers=True, hidden=batch.get("hidden"))
    return acceptance_sums(out, batch, temperature=temperature, draft_vocab=vocab)

  vocab = None if draft_vocab is None else jnp.asarray(draft_vocab, jnp.int32)

  n = len(rows["tokens"])
  batches = []
  for first in range(0, n, batch_size):
    idx = np.arange(first, first + batch_size)
    batch = {k: v[np.minimum(idx, n - 1)] for k, v in rows.items()}
    batch["loss_mask"] = np.where((idx < n)[:, None], batch["loss_mask"], 0)  # padding rows
    if features is not None:
      batch["hidden"] = np.asarray(features[np.minimum(idx, n - 1)], np.float32)
    batches.append(batch)

  def fn(params) -> dict[str, float]:
    total = None
    for batch in batches:
      got = jax.device_get(sums(params, batch))
      total = got if total is None else {k: total[k] + got[k] for k in total}
    out = {}
    for k in range(len(total["weight"])):
      out[f"alpha_{k + 1}"] = float(total["reach_alpha"][k] / max(total["reach"][k], 1e-9))
      out[f"alpha_unweighted_{k + 1}"] = float(total["alpha"][k] / max(total["weight"][k], 1))
      out[f"draft_events_{k + 1}"] = float(total["weight"][k])
    return out

  return fn
