"""Autoregressive against speculative decoding on the same prompts, one model, one process.

`run_benchmark` measures, per batch size, temperature and verification mode: tokens/s of both
loops over the same held-out prompts (all tasks mixed; a batch of 1 decodes them one after
another), the speed ratio, tokens per target forward, and per-depth acceptance online and
teacher-forced at the visited frontiers (the self-consistency diagnostic). Both loops stop at
end of sequence or end of a tool call (one policy turn). Each loop is compiled and warmed up
before timing; the passes of the loops are interleaved in alternating order, and the speed
ratio is the geometric mean of the passes' ratios with its 95% interval over passes
(`timed_passes`, `speed_ratio`; `meets_protocol` says whether a row meets the protocol of
every published wall-clock figure: MIN_REPEATS passes over MIN_PROMPTS prompts, MIN_TOKENS
tokens per arm). Used by experiments/bench_decode.py and the evaluation stage.

`run_episode_benchmark` times whole agentic episodes instead (policy turns with the tool
environment in the loop, rollout.episodes): speculative episodes against autoregressive
episodes that keep their cache across turns and autoregressive episodes that re-encode the
whole context every turn, on the same held-out agentic prompts and keys.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx

from bebop_jax.compilation import release_compiled
from bebop_jax.data import pipeline
from bebop_jax.decoding import decoder, diagnostics, sampling, speculative
from bebop_jax.decoding.batching import pad_rows
from bebop_jax.stages import config as config_lib


def _ids(ids) -> tuple[int, ...] | None:
  """A draft vocabulary (array of token ids, or None) as a decoder holds it."""
  return None if ids is None else tuple(int(i) for i in np.asarray(ids))


def _examples(config, batch: int, num_prompts: int) -> list:
  """The held-out examples of `prompt_batches`, in its order."""
  data = config_lib.settings(config).data
  examples = [ex for name in data.task_names for ex in pipeline.eval_examples(data, name, 64)]
  order = np.random.default_rng(0).permutation(len(examples))
  total = -(-max(batch, num_prompts) // batch) * batch
  return [examples[order[i % len(order)]] for i in range(total)]


def prompt_batches(config, batch: int, num_prompts: int, prompt_buckets=None) -> list[tuple[np.ndarray, np.ndarray]]:
  """max(batch, num_prompts) held-out prompts of all tasks (shuffled, cycled if needed),
  encoded by config.data's tokenizer, in batches of `batch` rows, each right-padded to its
  prompt bucket (as a server buckets requests; each loop compiles once per bucket, before
  timing)."""
  tok = config_lib.settings(config).data.loaded_tokenizer
  ids = [tok.encode_prompt(ex.prompt) for ex in _examples(config, batch, num_prompts)]
  buckets = prompt_buckets or tuple(config.eval.prompt_buckets)
  return [pad_rows(ids[start:start + batch], batch, buckets, fill_id=tok.bos_id)
          for start in range(0, len(ids), batch)]


def prompt_tasks(config, batch: int, num_prompts: int) -> list[str]:
  """The task of each row of `prompt_batches(config, batch, num_prompts)`, in order."""
  return [ex.task for ex in _examples(config, batch, num_prompts)]


def tokens_per_forward_by_task(outputs, tasks: list[str]) -> dict[str, float]:
  """Tokens per target forward of each task's rows (speculative.tokens_per_target_forward)
  over the outputs of one pass (one per batch, rows in `prompt_tasks` order)."""
  emitted = np.concatenate([np.asarray(o.emitted_by_forwards) for o in outputs])
  forwards = np.concatenate([np.asarray(o.row_forwards) for o in outputs])
  names = np.asarray(tasks)
  return {t: speculative.tokens_per_target_forward(emitted[names == t], forwards[names == t])
          for t in sorted(set(tasks))}


# The protocol every wall-clock figure meets (`meets_protocol`): the arms of a comparison run in
# one process, interleaved in alternating order, over at least MIN_REPEATS timed passes, each
# pass over at least MIN_PROMPTS prompts, and each arm generates at least MIN_TOKENS tokens over
# its passes; the ratio is reported with its 95% interval over the passes.
MIN_REPEATS, MIN_PROMPTS, MIN_TOKENS = 3, 64, 4000


@dataclasses.dataclass
class Passes:
  """An arm's timed passes: seconds and generated tokens of each, and the outputs of the
  last one."""
  seconds: list[float]
  tokens: list[int]
  outputs: list


def _tokens(outputs) -> int:
  return sum(int(np.asarray(o.lengths).sum()) for o in outputs)


def timed_passes(fns: dict, batches, repeats: int) -> dict[str, Passes]:
  """{name: its `Passes`}. Every function is compiled and warmed up on every bucket first;
  then `repeats` rounds each time one pass of every function over all batches, in the given
  order in even rounds and the reverse in odd ones, so neither a drift in machine speed nor
  a position in the round favours an arm. Pass r of every arm uses the same keys."""
  shapes = {}
  for tokens, lengths in batches:
    shapes.setdefault(tokens.shape, (tokens, lengths))
  for fn in fns.values():
    for tokens, lengths in shapes.values():  # compile + warm up every bucket
      jax.block_until_ready(fn(tokens, lengths, 0))
  out = {name: Passes([], [], []) for name in fns}
  for r in range(repeats):
    for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
      start = time.perf_counter()
      outputs = [jax.block_until_ready(fns[name](tokens, lengths, 1000 * r + i))
                 for i, (tokens, lengths) in enumerate(batches)]
      out[name].seconds.append(time.perf_counter() - start)
      out[name].tokens.append(_tokens(outputs))
      out[name].outputs = outputs
  return out


def speed_ratio(arm: Passes, baseline: Passes) -> dict:
  """`arm`'s tokens/s over `baseline`'s, pass by pass (pass r of both ran in round r):
  {"speedup": the geometric mean of the passes' ratios, "ci95": its Student-t 95% interval
  over passes (None with one pass), "repeats"}."""
  log_ratios = np.log([(ta / sa) / (tb / sb) for sa, ta, sb, tb in zip(
      arm.seconds, arm.tokens, baseline.seconds, baseline.tokens)])
  n = len(log_ratios)
  out = {"speedup": float(np.exp(log_ratios.mean())), "ci95": None, "repeats": n}
  if n >= 2:
    from scipy import stats  # pylint: disable=g-import-not-at-top  (a dependency of jax)
    half = stats.t.ppf(0.975, n - 1) * log_ratios.std(ddof=1) / np.sqrt(n)
    out["ci95"] = [float(np.exp(log_ratios.mean() - half)),
                   float(np.exp(log_ratios.mean() + half))]
  return out


def meets_protocol(row: dict) -> bool:
  """Whether a benchmark row's ratio meets the protocol (MIN_REPEATS, MIN_PROMPTS,
  MIN_TOKENS above)."""
  return (row["repeats"] >= MIN_REPEATS and row["prompts"] >= MIN_PROMPTS and
          min(row["ar_tokens"], row["spec_tokens"]) >= MIN_TOKENS)


def run_benchmark(config, graphdef, state, *, batch_sizes, temperatures, modes, max_new,
                  repeats, num_prompts=32, split_fixed_cost=False, draft_vocabs=None,
                  draft_lengths=None, adaptive_settings=None, on_measured=None) -> list[dict]:
  """All measurements as a list of row dicts.

  `on_measured`: called with no arguments after each (batch size, temperature) measurement,
  outside the timed loops (the eval stage moves its progress bar with it).

  With `split_fixed_cost`, every loop also runs the same prompts with max_new_tokens=1
  (prefill and the first token: the per-call cost that speculative decoding cannot shorten)
  and the rows add the share of that cost in autoregressive time and the speed ratio of the
  rest, i.e. of the decoding phase alone.

  `draft_vocabs`: {label: token ids or None (the full head)}: each mode runs once per
  reduced draft vocabulary (decoding/draft_vocab.py), its rows labelled `draft_vocab`; their
  teacher-forced acceptance (the full head's) is left out.

  `draft_lengths`: fixed draft lengths K (1 .. the drafter's depths) to run each mode with,
  their rows labelled `k` (default: the drafter's K only, unlabelled); K = 0 is the
  autoregressive loop itself (ratio 1). `adaptive_settings` (adaptive.Settings): each mode
  also runs adaptive decoding (decoding/segments.py), seeded with the online acceptance of
  that mode's fixed-K row of the most drafts, timed in a second round against the
  autoregressive loop again; its rows have `k` "adaptive", the iterations run with each K
  (`k_iterations`, summed over the pass) and the cost table it decided with."""
  draft_vocabs = draft_vocabs or {"full": None}
  k_drafter = nnx.merge(graphdef, state).config.num_draft_steps
  lengths_run = list(draft_lengths) if draft_lengths else [None]
  for k in lengths_run:
    if k is not None and not 1 <= k <= k_drafter:
      raise ValueError(f"draft length {k} is not allowed: must be in [1, {k_drafter}]")
  # Stop where a real rollout turn stops (end of sequence, end of a tool call); both loops
  # stop on the same tokens.
  tok = config_lib.settings(config).data.loaded_tokenizer
  stop = (tok.eos_id, tok.call_end_id)
  results = []
  for b in batch_sizes:
    batches = prompt_batches(config, b, num_prompts)
    row_tasks = prompt_tasks(config, b, num_prompts)
    for t in temperatures:
      params = sampling.SamplingParams(temperature=t)

      def loops(max_new_tokens, params=params, t=t):
        def call(dec):
          return lambda tokens, lengths, seed: dec.generate(
              graphdef, state, tokens, lengths, jax.random.key(seed),
              max_new_tokens=max_new_tokens, cache_length=tokens.shape[1] + max_new + 8,
              stop_tokens=stop)
        fns = {"autoregressive": call(decoder.Autoregressive(params))}
        for mode in (["exact"] if t == 0 else modes):
          for label, ids in draft_vocabs.items():
            for k in lengths_run:
              fns[(mode, label, k)] = call(decoder.Speculative(
                  params, mode, k, draft_vocab=_ids(ids)))
        return fns

      timed = timed_passes(loops(max_new), batches, repeats)
      fixed = ({name: float(np.mean(p.seconds)) for name, p in
                timed_passes(loops(1), batches, repeats).items()} if split_fixed_cost else None)
      ar_passes = timed.pop("autoregressive")
      ar = ar_passes.outputs
      if adaptive_settings is not None:
        release_compiled()  # the fixed-K loops are not used again (see release_compiled)
        timed.update(_adaptive_round(graphdef, state, batches, timed, k_drafter=k_drafter,
                                     params=params, max_new=max_new, stop=stop,
                                     repeats=repeats, settings=adaptive_settings,
                                     draft_vocabs=draft_vocabs))
      ar_forwards = sum(int(o.target_forwards) for o in ar)
      num_rows = len(batches) * b
      for (mode, label, k), measured in timed.items():
        stats, baseline = None, ar_passes
        if k == "adaptive":
          passes, baseline, stats = measured  # against its own round's autoregressive passes
        else:
          passes = measured
        sp = passes.outputs
        ratio = speed_ratio(passes, baseline)
        ar_tokens, sp_tokens = sum(baseline.tokens), sum(passes.tokens)
        ar_time, sp_time = sum(baseline.seconds), sum(passes.seconds)
        att = sum(np.asarray(o.attempted).sum(0) for o in sp)
        acc = sum(np.asarray(o.accepted).sum(0) for o in sp)
        if draft_vocabs[label] is None:
          expected, visits = _teacher_forced_at_frontiers(graphdef, state, batches, sp,
                                                          params=params, mode=mode)
          teacher_forced = (expected / np.maximum(visits, 1)).tolist()
        else:
          teacher_forced = None
        row = {
            "batch": b, "prompts": num_rows, "temperature": t, "mode": mode,
            **({} if len(draft_vocabs) == 1 and label == "full" else {"draft_vocab": label}),
            **({} if k is None else {"k": k}),
            "ar_tokens_per_s": ar_tokens / ar_time,
            "spec_tokens_per_s": sp_tokens / sp_time,
            "speedup": ratio["speedup"], "speedup_ci95": ratio["ci95"],
            "repeats": ratio["repeats"],
            "tokens_per_target_forward": speculative.tokens_per_target_forward(
                np.concatenate([np.asarray(o.emitted_by_forwards) for o in sp]),
                np.concatenate([np.asarray(o.row_forwards) for o in sp])),
            "tokens_per_target_forward_by_task": tokens_per_forward_by_task(sp, row_tasks),
            "acceptance_online": (acc / np.maximum(att, 1)).tolist(),
            "acceptance_teacher_forced": teacher_forced,
            # Over all timed passes (per pass under "passes").
            "ar_seconds": ar_time, "spec_seconds": sp_time,
            "ar_tokens": ar_tokens, "spec_tokens": sp_tokens,
            "passes": {"ar_seconds": baseline.seconds, "spec_seconds": passes.seconds,
                       "ar_tokens": baseline.tokens, "spec_tokens": passes.tokens},
            "ar_target_forwards": ar_forwards,
            "spec_target_forwards": sum(int(o.target_forwards) for o in sp),
        }
        if stats is not None:
          row.update(k_iterations=stats["k_iterations"], cost_table=stats["cost_table"],
                     segment_overhead_s=stats["segment_overhead_s"],
                     start_cost_s=stats["start_cost_s"], prefill_s=stats["prefill_s"],
                     call_residual_s=stats["call_residual_s"],
                     adaptive_seed=stats["seed"])
        row["meets_protocol"] = meets_protocol(row)
        if fixed is not None and (mode, label, k) in fixed:
          # Tokens after the first of each row, over the time after the fixed cost (per pass).
          n = row["repeats"]
          ar_rate = (ar_tokens / n - num_rows) / max(ar_time / n - fixed["autoregressive"],
                                                     1e-9)
          sp_rate = (sp_tokens / n - num_rows) / max(sp_time / n - fixed[(mode, label, k)],
                                                     1e-9)
          row.update(ar_fixed_seconds=fixed["autoregressive"],
                     spec_fixed_seconds=fixed[(mode, label, k)],
                     ar_fixed_share=fixed["autoregressive"] / (ar_time / n),
                     decode_phase_speedup=sp_rate / ar_rate)
        results.append(row)
        print(format_row(row), flush=True)
      # This block's loops are not used again: free them (see release_compiled).
      release_compiled()
      if on_measured is not None:
        on_measured()
  return results


def _adaptive_round(graphdef, state, batches, timed, *, k_drafter, params, max_new, stop,
                    repeats, settings, draft_vocabs) -> dict:
  """Adaptive decoding's measurements for `run_benchmark`: per (mode, draft vocabulary), a
  second `timed_passes` round of the autoregressive loop and adaptive decoding, seeded with
  the online acceptance of that mode's fixed-K row of the most drafts in `timed`.
  {(mode, label, "adaptive"): (its Passes, this round's autoregressive Passes, stats)}."""
  most = {}  # (mode, label) -> (K, outputs) of its row with the most drafts
  for (mode, label, k), passes in timed.items():
    k = k_drafter if k is None else k
    if k > most.get((mode, label), (0, None))[0]:
      most[(mode, label)] = (k, passes.outputs)
  out = {}
  for (mode, label), (_, sp) in most.items():
    att = sum(np.asarray(o.attempted).sum(0) for o in sp)
    acc = sum(np.asarray(o.accepted).sum(0) for o in sp)
    seed = (acc / np.maximum(att, 1)).tolist()
    adaptive_decoder = decoder.Adaptive(
        params, mode, dataclasses.replace(settings, k_max=len(seed)), acceptance=seed,
        draft_vocab=_ids(draft_vocabs[label]))
    stats = adaptive_decoder.stats
    call = lambda dec: (lambda tokens, lengths, rng_seed: dec.generate(
        graphdef, state, tokens, lengths, jax.random.key(rng_seed), max_new_tokens=max_new,
        cache_length=tokens.shape[1] + max_new + 8, stop_tokens=stop))
    fns = {"autoregressive": call(decoder.Autoregressive(params)),
           "adaptive": call(adaptive_decoder)}
    round_ = timed_passes(fns, batches, repeats)
    release_compiled()  # this mode's programs are not used again
    last = stats[-len(batches):]  # the last pass's calls
    k_iterations = {}
    for st in last:
      for kk, n in st.k_iterations.items():
        k_iterations[str(kk)] = k_iterations.get(str(kk), 0) + n
    out[(mode, label, "adaptive")] = (
        round_["adaptive"], round_["autoregressive"],
        {"k_iterations": dict(sorted(k_iterations.items())), "seed": seed,
         "cost_table": last[0].table.to_json(),
         "segment_overhead_s": last[0].to_json()["segment_overhead_s"],
         **{key: last[-1].to_json()[key] for key in ("start_cost_s", "prefill_s",
                                                      "call_residual_s")}})
  return out


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


def format_row(r: dict) -> str:
  acc = "/".join(f"{a:.2f}" for a in r["acceptance_online"])
  tf = ("/".join(f"{a:.2f}" for a in r["acceptance_teacher_forced"])
        if r["acceptance_teacher_forced"] is not None else "-")
  split = (f" {r['ar_fixed_share']:>5.0%} | {r['decode_phase_speedup']:>5.2f}x |"
           if "decode_phase_speedup" in r else "")
  mode = (r["mode"] + (f" @{r['draft_vocab']}" if "draft_vocab" in r else "") +
          (f" K={r['k']}" if "k" in r else ""))
  ci = r.get("speedup_ci95")
  ci = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
  return (f"| {r['batch']:>5} | {r['prompts']:>3} | {r['temperature']:>4g} | {mode:<12} | "
          f"{r['ar_tokens_per_s']:>9.1f} | {r['spec_tokens_per_s']:>9.1f} | "
          f"{r['speedup']:>5.2f}x{ci} | {r.get('repeats', 1)} | {r['ar_tokens']} / "
          f"{r['spec_tokens']} | {r['tokens_per_target_forward']:>5.2f} | {acc} | {tf} |"
          + split)


def header(split_fixed_cost: bool = False) -> str:
  """The markdown header of `format_row`'s table."""
  names = ["batch", "prompts", "temp", "mode", "AR tok/s", "spec tok/s",
           "ratio [95% over passes]", "passes", "tokens AR / spec", "tok/fwd",
           "acceptance online", "teacher-forced"]
  if split_fixed_cost:
    names += ["AR fixed share", "decode-phase ratio"]
  return "| " + " | ".join(names) + " |\n" + "|---" * len(names) + "|"

