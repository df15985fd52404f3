"""Autoregressive against speculative decoding on the same prompts, one model, one process.

`run_benchmark` measures, per batch size, temperature and verification mode: tokens/s of both
loops over the same held-out prompts (all tasks mixed; a batch of 1 decodes them one after
another), the speed ratio, tokens per target forward, and per-depth acceptance online and
teacher-forced at the visited frontiers (the self-consistency diagnostic). Both loops stop at
end of sequence or end of a tool call (one policy turn). Each loop is compiled and warmed up
before timing; passes of the loops are interleaved and the best of `repeats` is kept.
Used by experiments/bench_decode.py and
the evaluation stage.
"""

from __future__ import annotations

import gc
import time

import jax
import numpy as np

from bebop_jax import tasks as tasks_lib
from bebop_jax.data import get_tokenizer, pipeline
from bebop_jax.decoding import autoregressive, diagnostics, sampling, speculative
from bebop_jax.decoding.batching import pad_rows


def prompt_batches(config, batch: int, num_prompts: int, prompt_buckets=None) -> list[tuple[np.ndarray, np.ndarray]]:
  """max(batch, num_prompts) held-out prompts of all tasks (shuffled, cycled if needed) in
  batches of `batch` rows, each right-padded to its prompt bucket (as a server buckets
  requests; each loop compiles once per bucket, before timing)."""
  tok = get_tokenizer()
  examples = []
  for name in tasks_lib.TASK_NAMES:
    if config.data.tasks[name].weight > 0:
      examples += pipeline.eval_examples(config.data, name, 64)
  order = np.random.default_rng(0).permutation(len(examples))
  total = -(-max(batch, num_prompts) // batch) * batch
  ids = [tok.encode(examples[order[i % len(order)]].prompt, add_bos=True)
         for i in range(total)]
  buckets = prompt_buckets or tuple(config.eval.prompt_buckets)
  return [pad_rows(ids[start:start + batch], batch, buckets) for start in range(0, total, batch)]


def best_times(fns: dict, batches, repeats: int) -> dict:
  """{name: (best total seconds over `repeats` passes over all batches, outputs of the last
  pass)}. Every function is compiled and warmed up on every bucket first; the passes are
  interleaved (one pass of each function per round), so a drift in machine speed hits all
  of them alike instead of biasing the ratio."""
  shapes = {}
  for tokens, lengths in batches:
    shapes.setdefault(tokens.shape, (tokens, lengths))
  for fn in fns.values():
    for tokens, lengths in shapes.values():  # compile + warm up every bucket
      jax.block_until_ready(fn(tokens, lengths, 0))
  best = {name: float("inf") for name in fns}
  outs = {}
  for r in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      outs[name] = [jax.block_until_ready(fn(tokens, lengths, 1000 * r + i))
                    for i, (tokens, lengths) in enumerate(batches)]
      best[name] = min(best[name], time.perf_counter() - start)
  return {name: (best[name], outs[name]) for name in fns}


def run_benchmark(config, graphdef, state, *, batch_sizes, temperatures, modes, max_new,
                  repeats, num_prompts=32, split_fixed_cost=False) -> list[dict]:
  """All measurements as a list of row dicts.

  With `split_fixed_cost`, every loop also runs the same prompts with max_new_tokens=1
  (prefill and the first token: the per-call cost that speculative decoding cannot shorten)
  and the rows add the share of that cost in autoregressive time and the speed ratio of the
  rest, i.e. of the decoding phase alone."""
  # Stop where a real rollout turn stops (end of sequence, end of a tool call); both loops
  # stop on the same tokens.
  tok = get_tokenizer()
  stop = (tok.eos_id, tok.call_end_id)
  results = []
  for b in batch_sizes:
    batches = prompt_batches(config, b, num_prompts)
    for t in temperatures:
      params = sampling.SamplingParams(temperature=t)

      def loops(max_new_tokens, params=params, t=t):
        fns = {"autoregressive": lambda tokens, lengths, seed: autoregressive.generate(
            graphdef, state, tokens, lengths, jax.random.key(seed),
            max_new_tokens=max_new_tokens, cache_length=tokens.shape[1] + max_new + 8,
            params=params, stop_tokens=stop)}
        for mode in (["exact"] if t == 0 else modes):
          fns[mode] = (lambda tokens, lengths, seed, mode=mode: speculative.generate(
              graphdef, state, tokens, lengths, jax.random.key(seed),
              max_new_tokens=max_new_tokens, cache_length=tokens.shape[1] + max_new + 8,
              params=params, mode=mode, stop_tokens=stop))
        return fns

      timed = best_times(loops(max_new), batches, repeats)
      fixed = ({name: seconds for name, (seconds, _) in
                best_times(loops(1), batches, repeats).items()} if split_fixed_cost else None)
      ar_time, ar = timed.pop("autoregressive")
      ar_tokens = sum(int(np.asarray(o.lengths).sum()) for o in ar)
      ar_forwards = sum(int(o.target_forwards) for o in ar)
      num_rows = len(batches) * b
      for mode, (sp_time, sp) in timed.items():
        sp_tokens = sum(int(np.asarray(o.lengths).sum()) for o in sp)
        att = sum(np.asarray(o.attempted).sum(0) for o in sp)
        acc = sum(np.asarray(o.accepted).sum(0) for o in sp)
        expected, visits = _teacher_forced_at_frontiers(graphdef, state, batches, sp,
                                                        params=params, mode=mode)
        row = {
            "batch": b, "prompts": num_rows, "temperature": t, "mode": mode,
            "ar_tokens_per_s": ar_tokens / ar_time,
            "spec_tokens_per_s": sp_tokens / sp_time,
            "speedup": (sp_tokens / sp_time) / (ar_tokens / ar_time),
            "tokens_per_target_forward": speculative.tokens_per_target_forward(
                np.concatenate([np.asarray(o.emitted_by_forwards) for o in sp]),
                np.concatenate([np.asarray(o.attempted)[:, 0] for o in sp])),
            "acceptance_online": (acc / np.maximum(att, 1)).tolist(),
            "acceptance_teacher_forced": (expected / np.maximum(visits, 1)).tolist(),
            "ar_seconds": ar_time, "spec_seconds": sp_time,
            "ar_tokens": ar_tokens, "spec_tokens": sp_tokens,
            "ar_target_forwards": ar_forwards,
            "spec_target_forwards": sum(int(o.target_forwards) for o in sp),
        }
        if fixed is not None:
          # Tokens after the first of each row, over the time after the fixed cost.
          ar_rate = (ar_tokens - num_rows) / max(ar_time - fixed["autoregressive"], 1e-9)
          sp_rate = (sp_tokens - num_rows) / max(sp_time - fixed[mode], 1e-9)
          row.update(ar_fixed_seconds=fixed["autoregressive"], spec_fixed_seconds=fixed[mode],
                     ar_fixed_share=fixed["autoregressive"] / ar_time,
                     decode_phase_speedup=sp_rate / ar_rate)
        results.append(row)
        print(format_row(row), flush=True)
      # This block's loops are not used again: free them (see release_compiled).
      release_compiled()
  return results


TF_ROWS = 16  # rows per teacher-forced forward in `run_benchmark`


def _teacher_forced_at_frontiers(graphdef, state, batches, outputs, *, params, mode):
  """(expected accepted count [K], visits [K]) summed over the frontiers that speculative
  decoding visited in `outputs` (one per batch of `batches`). The rows of every batch are
  right-padded to one length and scored TF_ROWS at a time, so the forward compiles once per
  mode, whatever the batch size and prompt buckets (padding counts nowhere: it is neither
  generated nor a visited frontier)."""
  rows = []
  for (tokens, lengths), o in zip(batches, outputs):
    seq, gen = jax.device_get(diagnostics.sequences_from_generation(
        tokens, lengths, o.tokens, o.lengths))
    rows += list(zip(seq, gen, np.asarray(o.frontier_depths)))
  length = max(len(seq) for seq, _, _ in rows)
  expected, visits = 0.0, 0.0
  for seq, gen, depths in diagnostics.padded_batches(rows, TF_ROWS, length):
    tf = diagnostics.teacher_forced_acceptance(graphdef, state, seq, gen, depths,
                                               params=params, mode=mode)
    expected = expected + np.asarray(tf["expected_accepted"])
    visits = visits + np.asarray(tf["visits"])
  return expected, visits


def release_compiled() -> None:
  """Drops JAX's compiled executables. On CPU each compiled decoding loop maps ~1000 memory
  regions of generated code (one per kernel of its unrolled layers), so a process that
  compiles ~60 of them (prompt buckets x batch sizes x modes) reaches the kernel's
  vm.max_map_count (65530) and LLVM fails with "Cannot allocate memory". Long-running jobs
  call this between phases whose compiled functions are not reused."""
  jax.clear_caches()
  gc.collect()


def format_row(r: dict) -> str:
  acc = "/".join(f"{a:.2f}" for a in r["acceptance_online"])
  tf = "/".join(f"{a:.2f}" for a in r["acceptance_teacher_forced"])
  split = (f" {r['ar_fixed_share']:>5.0%} | {r['decode_phase_speedup']:>5.2f}x |"
           if "decode_phase_speedup" in r else "")
  return (f"| {r['batch']:>5} | {r['prompts']:>3} | {r['temperature']:>4g} | {r['mode']:<12} | "
          f"{r['ar_tokens_per_s']:>9.1f} | {r['spec_tokens_per_s']:>9.1f} | "
          f"{r['speedup']:>5.2f}x | {r['tokens_per_target_forward']:>5.2f} | {acc} | {tf} |"
          + split)


def header(split_fixed_cost: bool = False) -> str:
  """The markdown header of `format_row`'s table."""
  names = ["batch", "prompts", "temp", "mode", "AR tok/s", "spec tok/s", "ratio", "tok/fwd",
           "acceptance online", "teacher-forced"]
  if split_fixed_cost:
    names += ["AR fixed share", "decode-phase ratio"]
  return "| " + " | ".join(names) + " |\n" + "|---" * len(names) + "|"
