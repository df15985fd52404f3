r"""Autoregressive against speculative (MTP drafts) decoding, one model, one process.

  python experiments/bench_decode.py --config=configs/sft_small.py --workdir=runs/sft_small \
      --batch_sizes=1,8,64 --out=runs/sft_small/bench_decode.json

Without an SFT checkpoint in --workdir (or with --random_init) a randomly initialised model
of the config's shape is used. Prompts are held-out task prompts. For every batch size,
temperature and verification mode it reports tokens/s of both loops over the same prompts (batch 1
decodes --num_prompts prompts one after another), the speed ratio,
tokens per target forward, and per-depth acceptance online and teacher-forced (the
self-consistency diagnostic). Temperature 0 uses mode "exact"; temperature > 0 the others.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from bebop_jax import config as config_lib
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import get_tokenizer, pipeline
from bebop_jax.decoding import autoregressive, diagnostics, sampling, speculative
from bebop_jax.evaluation import bucket
from bebop_jax.model import model as policy_lib
from bebop_jax.model.config import ModelConfig
from bebop_jax.train import sft

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir holding an SFT checkpoint.")
_BATCH = flags.DEFINE_list("batch_sizes", ["1", "8", "64"], "Batch sizes.")
_TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures.")
_MODES = flags.DEFINE_list("modes", ["rejection", "greedy_draft", "strict"],
                           "Verification modes at temperature > 0.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per row.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed passes per measurement (best is kept).")
_PROMPTS = flags.DEFINE_integer("num_prompts", 32, "Prompts per measurement (at least one "
                                "batch): batch 1 decodes them one after another.")
_RANDOM = flags.DEFINE_bool("random_init", False, "Use a randomly initialised model.")
_OUT = flags.DEFINE_string("out", None, "JSON output path (default <workdir>/bench_decode.json).")


def _prompt_batches(config, batch: int, num_prompts: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """max(batch, num_prompts) held-out prompts of all tasks (shuffled, cycled if needed) in
  batches of `batch` rows, right-padded to one bucket so each loop compiles once."""
  tok = get_tokenizer()
  examples = []
  for name in tasks_lib.TASK_NAMES:
    if config.data.tasks[name].weight > 0:
      examples += pipeline.eval_examples(config.data, name, 64)
  order = np.random.default_rng(0).permutation(len(examples))
  total = -(-max(batch, num_prompts) // batch) * batch
  ids = [tok.encode(examples[order[i % len(order)]].prompt, add_bos=True)
         for i in range(total)]
  p = bucket(max(len(x) for x in ids))
  batches = []
  for start in range(0, total, batch):
    rows = ids[start:start + batch]
    tokens = np.zeros((batch, p), np.int32)
    for i, x in enumerate(rows):
      tokens[i, :len(x)] = x
    batches.append((tokens, np.array([len(x) for x in rows], np.int32)))
  return batches


def _best_time(fn, batches, repeats: int):
  """Best total wall time over `repeats` passes over all batches, after a warm-up pass;
  returns (seconds, outputs of the last pass)."""
  jax.block_until_ready(fn(*batches[0], 0))  # compile + warm up
  best, outs = float("inf"), []
  for r in range(repeats):
    start = time.perf_counter()
    outs = [jax.block_until_ready(fn(tokens, lengths, 1000 * r + i))
            for i, (tokens, lengths) in enumerate(batches)]
    best = min(best, time.perf_counter() - start)
  return best, outs


def run_benchmark(config, graphdef, state, *, batch_sizes, temperatures, modes, max_new,
                  repeats, num_prompts=32) -> list[dict]:
  """All measurements as a list of row dicts."""
  # Stop at end of sequence as a real rollout does; both loops stop on the same tokens.
  stop = (get_tokenizer().eos_id,)
  results = []
  for b in batch_sizes:
    batches = _prompt_batches(config, b, num_prompts)
    cache_length = batches[0][0].shape[1] + max_new + 8
    for t in temperatures:
      params = sampling.SamplingParams(temperature=t)
      ar_time, ar = _best_time(lambda tokens, lengths, seed: autoregressive.generate(
          graphdef, state, tokens, lengths, jax.random.key(seed), max_new_tokens=max_new,
          cache_length=cache_length, params=params, stop_tokens=stop), batches, repeats)
      ar_tokens = sum(int(np.asarray(o.lengths).sum()) for o in ar)
      ar_forwards = sum(int(o.target_forwards) for o in ar)
      for mode in (["exact"] if t == 0 else modes):
        sp_time, sp = _best_time(lambda tokens, lengths, seed: speculative.generate(
            graphdef, state, tokens, lengths, jax.random.key(seed), max_new_tokens=max_new,
            cache_length=cache_length, params=params, mode=mode, stop_tokens=stop),
                                 batches, repeats)
        sp_tokens = sum(int(np.asarray(o.lengths).sum()) for o in sp)
        att = sum(np.asarray(o.attempted).sum(0) for o in sp)
        acc = sum(np.asarray(o.accepted).sum(0) for o in sp)
        expected, visits = 0.0, 0.0
        for (tokens, lengths), o in zip(batches, sp):
          seq, gen = diagnostics.sequences_from_generation(tokens, lengths, o.tokens, o.lengths)
          tf = diagnostics.teacher_forced_acceptance(
              graphdef, state, seq, gen, o.frontier_depths, params=params, mode=mode)
          expected = expected + np.asarray(tf["expected_accepted"])
          visits = visits + np.asarray(tf["visits"])
        row = {
            "batch": b, "prompts": len(batches) * b, "temperature": t, "mode": mode,
            "ar_tokens_per_s": ar_tokens / ar_time,
            "spec_tokens_per_s": sp_tokens / sp_time,
            "speedup": (sp_tokens / sp_time) / (ar_tokens / ar_time),
            "tokens_per_target_forward": float((att[0] + acc.sum()) / max(att[0], 1)),
            "acceptance_online": (acc / np.maximum(att, 1)).tolist(),
            "acceptance_teacher_forced": (expected / np.maximum(visits, 1)).tolist(),
            "ar_seconds": ar_time, "spec_seconds": sp_time,
            "ar_tokens": ar_tokens, "spec_tokens": sp_tokens,
            "ar_target_forwards": ar_forwards,
            "spec_target_forwards": sum(int(o.target_forwards) for o in sp),
        }
        results.append(row)
        print(_format_row(row), flush=True)
  return results


def _format_row(r: dict) -> str:
  acc = "/".join(f"{a:.2f}" for a in r["acceptance_online"])
  tf = "/".join(f"{a:.2f}" for a in r["acceptance_teacher_forced"])
  return (f"| {r['batch']:>5} | {r['prompts']:>3} | {r['temperature']:>4g} | {r['mode']:<12} | "
          f"{r['ar_tokens_per_s']:>9.1f} | {r['spec_tokens_per_s']:>9.1f} | "
          f"{r['speedup']:>5.2f}x | {r['tokens_per_target_forward']:>5.2f} | {acc} | {tf} |")


HEADER = ("| batch | prompts | temp | mode         |  AR tok/s | spec tok/s | ratio | tok/fwd | "
          "acceptance online | teacher-forced |\n|---|---|---|---|---|---|---|---|---|---|")


def main(argv):
  del argv
  config = config_lib.validate(_CONFIG.value)
  if _RANDOM.value or _WORKDIR.value is None or sft.read_summary(_WORKDIR.value) is None:
    graphdef, state = policy_lib.init(ModelConfig.from_dict(config.model.to_dict()),
                                      config.seed)
    source = "random_init"
  else:
    graphdef, state = sft.load_policy(config, _WORKDIR.value)
    source = f"sft checkpoint in {_WORKDIR.value}"
  print(f"model: {source}; device: {jax.devices()[0].device_kind}\n{HEADER}")
  results = run_benchmark(
      config, graphdef, state, batch_sizes=[int(b) for b in _BATCH.value],
      temperatures=[float(t) for t in _TEMPS.value], modes=list(_MODES.value),
      max_new=_MAX_NEW.value, repeats=_REPEATS.value,
      num_prompts=_PROMPTS.value)
  out = _OUT.value or os.path.join(_WORKDIR.value or ".", "bench_decode.json")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump({"model": source, "device": jax.devices()[0].device_kind,
               "max_new_tokens": _MAX_NEW.value, "results": results}, f, indent=2)
  print(f"wrote {out}")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
