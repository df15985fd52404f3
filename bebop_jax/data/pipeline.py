"""Grain pipelines: SFT batches and RL prompt batches over the task datasets.

SFT batch (every array [batch_size, seq_len]):
  tokens       int32  bos, prompt, demonstration (a fresh sample of the task's solution paths
                      at every visit), eos; id 0 past the end (the char tokenizer's pad;
                      with any tokenizer, segment_ids 0 mark it).
  segment_ids  int32  1, 2, ... per packed example; 0 on padding.
  positions    int32  position inside the example (restarts at 0 per segment).
  loss_mask    int32  1 where the token is a training target: demonstration tokens and eos;
                      0 on bos, prompt, tool results (RESULT_START..RESULT_END inclusive)
                      and padding. Predicting token t from position t-1 is the trainer's job.

RL prompt batch, from the `rl` split (prompts in neither train nor test; batch dimension
prompts_per_batch * group_size, each prompt repeated group_size times in consecutive rows):
  prompt_tokens  int32 [B*G, max_prompt_len]  bos + prompt, right-padded with 0.
  prompt_lengths int32 [B*G]
  task_ids       int32 [B*G]  index into TASK_NAMES.
  group_ids      int32 [B*G]  row // group_size.
  example_json   object [B*G]  the serialised `Example` the reward needs.

Both are deterministic given the seed, and their iterators checkpoint: `it.get_state()` /
`it.set_state(state)` (or `grain.checkpoint` handlers with orbax) resume exactly.

Shards (`shard=(s, S)`, config data.shards): stream s of S reads the s-th of every S examples
of each task's split (grain's sharding of a source), and gives its own packed or padded rows:
1/S of each global batch's rows (SFT) or prompts (RL). A global batch is the S shards' rows
in shard order, so a process that reads shards s..s' (`process_iterator`) holds exactly its
rows; S = 1 is the one stream, as always.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Sequence

import grain
import numpy as np

from bebop_jax.data import builders
from bebop_jax.data.settings import DataSettings
from bebop_jax.data.tokenizer import BaseTokenizer
from bebop_jax.tasks import TASK_NAMES, Example, get_task

_SFT_KEYS = ("tokens", "loss_mask")
# Map elements in the consuming thread, without prefetch. grain's default (16 threads, a
# 500-element buffer whose futures are polled on every element) cost 2-3x the CPU per SFT
# batch here, and a training step already overlaps the next batch's preparation, since
# dispatch is asynchronous. The elements, and the iterator's checkpoint, are the same.
READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def sft_features(prompt: str, demonstration: str,
                 tokenizer: BaseTokenizer) -> dict[str, np.ndarray]:
  """Tokens and loss mask of one demonstration (unpadded, 1-D int32) under `tokenizer`."""
  prompt_ids = tokenizer.encode_prompt(prompt)
  completion_ids = tokenizer.encode_completion(demonstration)
  tokens = np.asarray(prompt_ids + completion_ids, dtype=np.int32)
  mask = np.zeros(len(tokens), dtype=np.int32)
  mask[len(prompt_ids):] = 1
  mask[tool_result_mask(tokens, tokenizer)] = 0
  return {"tokens": tokens, "loss_mask": mask}


def tool_result_mask(tokens: np.ndarray, tokenizer: BaseTokenizer) -> np.ndarray:
  """Boolean mask of tool-result tokens: RESULT_START through RESULT_END inclusive (the
  markers' ids under `tokenizer`).

  An unterminated result runs to the end of the sequence.
  """
  tokens = np.asarray(tokens)
  opens = np.cumsum(tokens == tokenizer.result_start_id, axis=-1)
  closes = np.cumsum(tokens == tokenizer.result_end_id, axis=-1)
  # Inside a result: more opens than closes so far, or this token is the closing marker.
  return (opens > closes) | (tokens == tokenizer.result_end_id)


# Knobs that change how demonstrations are sampled for SFT, not the stored examples: left out
# of the dataset's identity, so changing them reuses the prepared data.
_SAMPLING_KNOBS = ("diversity", "restate", "confirm", "spacing")


def task_source(data: DataSettings, task_name: str, split: str):
  """The array-record source of one task's split, preparing the dataset on first use."""
  knobs = {k: v for k, v in data.tasks[task_name].knobs.items() if k not in _SAMPLING_KNOBS}
  builder = builders.prepare(
      task_name, knobs, data_dir=data.data_dir, num_train=data.num_train,
      num_test=data.num_test, num_rl=data.num_rl, seed=data.seed)
  return builder.as_data_source()[split]


def _mixture(data: DataSettings, split: str, seed: int, repeat: bool,
             shard: tuple[int, int] = (0, 1)) -> grain.MapDataset:
  """Shuffled (and optionally repeated) weighted mixture of the task datasets (of the
  `shard` = (s, S) slice of each: its examples s, s + S, ...)."""
  datasets, weights = [], []
  index, count = _check_shard(shard)
  for name in data.task_names:
    ds = grain.MapDataset.source(task_source(data, name, split))
    if count > 1:
      ds = ds[index::count]
    ds = ds.shuffle(seed=seed + 7919 * TASK_NAMES.index(name))
    if repeat:
      ds = ds.repeat()
    datasets.append(ds.map(lambda record, n=name: {"task": n, **record}))
    weights.append(float(data.tasks[name].weight))
  if len(datasets) == 1:
    return datasets[0]
  return grain.MapDataset.mix(datasets, weights)


def _check_shard(shard: tuple[int, int]) -> tuple[int, int]:
  index, count = (int(x) for x in shard)
  if count < 1 or not 0 <= index < count:
    raise ValueError(f"shard={shard} is not allowed: (s, S) with 0 <= s < S")
  return index, count


def _rows_per_shard(rows: int, count: int, what: str) -> int:
  if rows % count:
    raise ValueError(f"{what}={rows} does not split into {count} data shards")
  return rows // count


def _as_str(value: Any) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def sft_dataset(data: DataSettings, *, batch_size: int, seq_len: int,
                packing: bool = True, seed: int = 0, split: str = "train",
                shard: tuple[int, int] = (0, 1)) -> grain.IterDataset:
  """Endless SFT batches (see module docstring), tokenized by `data.loaded_tokenizer`;
  demonstrations longer than seq_len dropped.

  Every visit of an example samples a fresh demonstration, `task.demonstration(example,
  key)` with a key derived from `seed` and the visit's position in the stream (so the
  stream is deterministic and resumable); with diversity 0 it is the canonical one, and so
  it is for the first `data.canonical_examples` examples of the stream.

  `shard` = (s, S): shard s of S (module docstring), batch_size / S rows of each global
  batch of `batch_size`; its visits' keys are those of positions s, s + S, ... .
  """
  shard_index, shard_count = _check_shard(shard)
  rows = _rows_per_shard(batch_size, shard_count, "batch_size")
  tasks = {name: get_task(name, **data.tasks[name].knobs) for name in data.task_names}
  canonical_examples, tok = data.canonical_examples, data.loaded_tokenizer

  def featurize(index, record):
    task = tasks[_as_str(record["task"])]
    demonstration = _as_str(record["demonstration"])
    if index >= canonical_examples and any(getattr(task, knob, 0) > 0
                                           for knob in _SAMPLING_KNOBS):
      example = Example.from_json(_as_str(record["example_json"]))
      position = index * shard_count + shard_index  # index with one shard
      demonstration = task.demonstration(example, (seed << 40) + position)
    return sft_features(_as_str(record["prompt"]), demonstration, tok)

  ds = (_mixture(data, split, seed, repeat=True, shard=shard)
        .map_with_index(featurize)
        .filter(lambda ex: len(ex["tokens"]) <= seq_len)
        .to_iter_dataset(READ_OPTIONS))
  if packing:
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={k: seq_len for k in _SFT_KEYS},
        num_packing_bins=rows, seed=seed, shuffle_bins=True,
        meta_features=("loss_mask",))
    ds = ds.map(lambda ex: {"tokens": ex["tokens"],
                            "segment_ids": ex["tokens_segment_ids"],
                            "positions": ex["tokens_positions"],
                            "loss_mask": ex["loss_mask"]})
  else:
    ds = ds.map(lambda ex: _pad_example(ex, seq_len))
  return ds.batch(rows, drop_remainder=True)


def _pad_example(ex: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
  n = len(ex["tokens"])
  pad = lambda a: np.pad(a, (0, seq_len - n)).astype(np.int32)
  return {"tokens": pad(ex["tokens"]),
          "segment_ids": pad(np.ones(n, np.int32)),
          "positions": pad(np.arange(n, dtype=np.int32)),
          "loss_mask": pad(ex["loss_mask"])}


def rl_prompt_dataset(data: DataSettings, *, prompts_per_batch: int,
                      group_size: int, max_prompt_len: int, seed: int = 0,
                      split: str = "rl", repeat: bool = True,
                      shard: tuple[int, int] = (0, 1)) -> grain.IterDataset:
  """Batches of prompts, tokenized by `data.loaded_tokenizer`, each repeated `group_size`
  times (see module docstring); with `shard` = (s, S), shard s's prompts_per_batch / S
  prompts of each global batch (its group_ids count on from the shards before it)."""
  shard_index, shard_count = _check_shard(shard)
  prompts = _rows_per_shard(prompts_per_batch, shard_count, "prompts_per_batch")
  first_group = shard_index * prompts
  tok = data.loaded_tokenizer

  def featurize(record):
    ids = tok.encode_prompt(_as_str(record["prompt"]))
    if len(ids) > max_prompt_len:
      raise ValueError(f"a {record['task']} prompt has {len(ids)} tokens, more than "
                       f"max_prompt_len={max_prompt_len}; raise max_prompt_len")
    return {"prompt_tokens": np.pad(np.asarray(ids, np.int32), (0, max_prompt_len - len(ids))),
            "prompt_lengths": np.int32(len(ids)),
            "task_ids": np.int32(TASK_NAMES.index(record["task"])),
            "example_json": _as_str(record["example_json"])}

  def repeat_group(batch):
    out = {k: np.repeat(np.asarray(v), group_size, axis=0) for k, v in batch.items()}
    out["group_ids"] = np.repeat(np.arange(first_group, first_group + prompts,
                                           dtype=np.int32), group_size)
    return out

  ds = _mixture(data, split, seed, repeat=repeat, shard=shard).map(featurize)
  return (ds.to_iter_dataset(READ_OPTIONS)
          .batch(prompts, drop_remainder=True)
          .map(repeat_group))


class ShardedBatches:
  """This process's rows of every global batch: the next batch of each of its shards'
  iterators, concatenated in shard order. Checkpointable like a grain iterator
  (`get_state()` -> bytes, `set_state(bytes)`: every shard's position; grain's orbax
  handler stores it per process)."""

  def __init__(self, iterators: Sequence[Any]):
    self.iterators = list(iterators)

  def __iter__(self) -> "ShardedBatches":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    parts = [next(it) for it in self.iterators]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def get_state(self) -> bytes:
    return json.dumps([it.get_state() for it in self.iterators], indent=1).encode()

  def set_state(self, state: bytes) -> None:
    states = json.loads(state.decode() if isinstance(state, bytes) else state)
    if len(states) != len(self.iterators):
      raise ValueError(f"a saved position of {len(states)} data shards, but this process "
                       f"reads {len(self.iterators)}: resume with the same data.shards and "
                       "number of processes")
    for it, s in zip(self.iterators, states):
      it.set_state(s)

  def start_prefetch(self) -> None:
    """grain's checkpoint handler calls this after a restore."""


def process_iterator(datasets: Sequence[grain.IterDataset]
                     ) -> Iterator[dict[str, np.ndarray]]:
  """The batch iterator of a process over its shards' datasets (in shard order;
  multihost.data_shards says which): one dataset's own grain iterator (as a one-process run
  always had), or their `ShardedBatches`."""
  if len(datasets) == 1:
    return iter(datasets[0])
  return ShardedBatches([iter(ds) for ds in datasets])


def eval_examples(data: DataSettings, task_name: str, num: int,
                  split: str = "test") -> list[Example]:
  """The first `num` held-out examples of one task (deterministic order)."""
  source = task_source(data, task_name, split)
  return [Example.from_json(_as_str(source[i]["example_json"]))
          for i in range(min(num, len(source)))]
