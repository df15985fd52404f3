"""The multi-turn decoding benchmark: whole agentic episodes (policy turns, tool replies,
prefills) decoded autoregressively and speculatively under the protocol of
bebop_jax.stages.decode_timing, for experiments/bench_decode.py --episodes."""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from bebop_jax import tasks as tasks_lib
from bebop_jax.compilation import release_compiled
from bebop_jax.data import pipeline
from bebop_jax.decoding import decoder as decoder_lib
from bebop_jax.decoding import sampling, speculative
from bebop_jax.rollout import episodes as episodes_lib
from bebop_jax.stages import config as config_lib

# The autoregressive loops of `run_episode_benchmark`: with the cache kept across turns
# (as a serving engine's prefix cache does), and re-encoding the whole context every turn.
AR_CONTINUED = "autoregressive"
AR_REENCODED = "autoregressive_reencoded"


def agentic_examples(config, batch: int, num_prompts: int) -> list[tasks_lib.Example]:
  """The first max(batch, num_prompts) held-out agentic examples (pipeline.eval_examples,
  in its deterministic order), cycled if the split has fewer, rounded up to whole batches
  of `batch` rows."""
  total = -(-max(batch, num_prompts) // batch) * batch
  examples = pipeline.eval_examples(config_lib.settings(config).data, "agentic", total)
  if not examples:
    raise ValueError("the held-out agentic split is empty (config.data.num_test)")
  return [examples[i % len(examples)] for i in range(total)]


def best_episode_times(loops: dict, environments, repeats: int) -> dict:
  """{name: (best seconds over `repeats` passes, the episodes of the last pass)}.

  Args:
    loops: {name: fn(environments) -> list[episodes_lib.Episode]}, each running one episode
      per prompt, with the same prompts and key in every pass.
    environments: () -> a fresh list of environments, one per prompt (an environment keeps
      the episode's state, so every pass gets new ones, made before its timer starts).
    repeats: timed passes of each loop.

  Every loop first runs one untimed warm-up pass: the same prompts and key as the timed
  passes, so it compiles every prompt, reply and context bucket they visit. The timed passes
  are interleaved (one pass of each loop per round), as in `timed_passes`. Each pass includes
  the environment calls and the host work between turns.
  """
  for fn in loops.values():
    fn(environments())
  best = {name: float("inf") for name in loops}
  outs = {}
  for _ in range(repeats):
    for name, fn in loops.items():
      envs = environments()
      start = time.perf_counter()
      outs[name] = fn(envs)  # host lists: the episodes are complete when it returns
      best[name] = min(best[name], time.perf_counter() - start)
  return {name: (best[name], outs[name]) for name in loops}


def policy_tokens(episodes) -> int:
  """Tokens the policy sampled over `episodes` (environment replies excluded)."""
  return sum(sum(ep.policy_mask) for ep in episodes)


def run_episode_benchmark(config, graphdef, state, *, batch_sizes, temperatures, modes,
                          max_new_tokens, repeats, num_prompts=32,
                          max_turn_tokens=None, seed=0) -> list[dict]:
  """Whole agentic episodes (tool calls answered by the environment, the policy continuing)
  with three loops on the same prompts and key: speculative episodes and autoregressive
  episodes, caches kept across turns (`episodes_lib.decode_episodes` with
  `decoder.Speculative` / `decoder.Autoregressive`), and autoregressive episodes that
  re-encode the whole context every turn (`episodes_lib.reencoded_episodes`).

  Prompts: `agentic_examples(config, batch, num_prompts)`; environments:
  `task.environment(example)` of the agentic task with config.data's knobs; stop tokens end
  of sequence and end of a tool call; at most the task's `max_turns` policy turns, as
  `rollout.JaxEngine` runs them. Every loop, pass, batch size and temperature uses the key
  jax.random.key(seed). Temperature 0 runs mode "exact", temperature > 0 each of `modes`;
  the autoregressive loops run once per batch size and temperature and are shared by its
  rows. Each loop is compiled and warmed up, then timed by `best_episode_times`.

  Args:
    config: the experiment config (config.data, config.eval.prompt_buckets: the buckets of
      prompts and of the re-encoded contexts; the largest must hold the longest prompt plus
      max_new_tokens).
    graphdef, state: the policy.
    batch_sizes: rows per decoding call; each runs its own prompt set (see above).
    temperatures, modes: sampling temperatures and verification modes (temperature > 0).
    max_new_tokens: completion budget of an episode, in tokens (policy turns and replies).
    repeats: timed passes of each loop (the best is kept).
    num_prompts: episodes per measurement (at least one batch).
    max_turn_tokens: optional cap on the tokens of one policy turn.
    seed: the key of every loop.
  Returns:
    One row per batch size, temperature and mode. Token counts are policy tokens (sampled
    by the policy; the environment's reply tokens in the completions do not count; they are
    reported apart as *_reply_tokens), so tokens/s is policy tokens per second of wall
    clock over the whole pass, environment calls and reply prefills included:
      spec_tokens_per_s, ar_tokens_per_s, ar_reencoded_tokens_per_s;
      speedup: spec_tokens_per_s / ar_tokens_per_s (against the autoregressive loop with
        its cache kept: the like-for-like ratio);
      continuation_speedup: ar_tokens_per_s / ar_reencoded_tokens_per_s (what keeping the
        cache buys the autoregressive loop);
      tokens_per_target_forward: of the speculative episodes
        (`speculative.tokens_per_target_forward` of their emitted_by_forwards and
        target_forwards);
      acceptance_online: [K] accepted / attempted drafts per depth;
      spec_mean_turns, ar_mean_turns: policy turns per episode;
      ar_identical_fraction: the fraction of episodes that the two autoregressive loops
        sampled identically (same tokens and policy mask) from the same key (1.0 expected);
      *_seconds (best pass), *_tokens, *_reply_tokens, *_target_forwards.
  """
  tok = config_lib.settings(config).data.loaded_tokenizer
  k = nnx.merge(graphdef, state).config.num_draft_steps
  task = tasks_lib.get_task("agentic", **config.data.tasks.agentic.knobs)
  stop = (tok.eos_id, tok.call_end_id)
  buckets = tuple(config.eval.prompt_buckets)
  rng = jax.random.key(seed)
  results = []
  for b in batch_sizes:
    examples = agentic_examples(config, b, num_prompts)
    prompts = [tok.encode_prompt(ex.prompt) for ex in examples]
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > buckets[-1]:
      raise ValueError(f"re-encoded contexts reach {longest} tokens (the longest prompt "
                       f"plus max_new_tokens={max_new_tokens}), more than the largest of "
                       f"config.eval.prompt_buckets={buckets}")
    environments = lambda examples=examples: [task.environment(ex) for ex in examples]
    for t in temperatures:
      params = sampling.SamplingParams(temperature=t)
      common = dict(
          tokenizer=tok, batch_size=b, max_new_tokens=max_new_tokens, stop_tokens=stop,
          row_stops=np.array([[True, task.multi_turn]] * len(prompts), bool),
          max_turns=task.max_turns, prompt_buckets=buckets)
      decoders = {AR_CONTINUED: decoder_lib.Autoregressive(params,
                                                           max_turn_tokens=max_turn_tokens)}
      for mode in (["exact"] if t == 0 else modes):
        decoders[mode] = decoder_lib.Speculative(params, mode, k,
                                                 max_turn_tokens=max_turn_tokens)
      loops = {name: (lambda envs, d=d, common=common: episodes_lib.decode_episodes(
          d, graphdef, state, prompts, envs, rng, **common)) for name, d in decoders.items()}
      loops[AR_REENCODED] = (lambda envs, common=common, params=params:
                             episodes_lib.reencoded_episodes(
                                 graphdef, state, prompts, envs, rng, params=params,
                                 max_turn_tokens=max_turn_tokens, **common))
      timed = best_episode_times(loops, environments, repeats)
      ar_time, ar = timed.pop(AR_CONTINUED)
      re_time, re = timed.pop(AR_REENCODED)
      ar_tokens, re_tokens = policy_tokens(ar), policy_tokens(re)
      identical = np.mean([a.tokens == r.tokens and a.policy_mask == r.policy_mask
                           for a, r in zip(ar, re)])
      for mode, (sp_time, sp) in timed.items():
        sp_tokens = policy_tokens(sp)
        attempted = sum(ep.attempted for ep in sp)
        accepted = sum(ep.accepted for ep in sp)
        row = {
            "batch": b, "prompts": len(prompts), "temperature": t, "mode": mode,
            "spec_tokens_per_s": sp_tokens / sp_time,
            "ar_tokens_per_s": ar_tokens / ar_time,
            "ar_reencoded_tokens_per_s": re_tokens / re_time,
            "speedup": (sp_tokens / sp_time) / (ar_tokens / ar_time),
            "continuation_speedup": (ar_tokens / ar_time) / (re_tokens / re_time),
            "tokens_per_target_forward": speculative.tokens_per_target_forward(
                [ep.emitted_by_forwards for ep in sp], [ep.target_forwards for ep in sp]),
            "acceptance_online": (accepted / np.maximum(attempted, 1)).tolist(),
            "spec_mean_turns": float(np.mean([ep.turns for ep in sp])),
            "ar_mean_turns": float(np.mean([ep.turns for ep in ar])),
            "ar_identical_fraction": float(identical),
            "spec_seconds": sp_time, "ar_seconds": ar_time, "ar_reencoded_seconds": re_time,
            "spec_tokens": sp_tokens, "ar_tokens": ar_tokens, "ar_reencoded_tokens": re_tokens,
            "spec_reply_tokens": sum(len(ep.tokens) for ep in sp) - sp_tokens,
            "ar_reply_tokens": sum(len(ep.tokens) for ep in ar) - ar_tokens,
            "spec_target_forwards": sum(ep.target_forwards for ep in sp),
            "ar_target_forwards": sum(ep.target_forwards for ep in ar),
            "ar_reencoded_target_forwards": sum(ep.target_forwards for ep in re),
        }
        results.append(row)
        print(format_episode_row(row), flush=True)
      release_compiled()  # this block's loops are not used again
  return results


def format_episode_row(r: dict) -> str:
  """One row of `run_episode_benchmark` as a line of `episode_header`'s table."""
  acc = "/".join(f"{a:.2f}" for a in r["acceptance_online"])
  return (f"| {r['batch']:>5} | {r['prompts']:>3} | {r['temperature']:>4g} | {r['mode']:<12} | "
          f"{r['spec_tokens_per_s']:>9.1f} | {r['ar_tokens_per_s']:>9.1f} | "
          f"{r['ar_reencoded_tokens_per_s']:>9.1f} | {r['speedup']:>5.2f}x | "
          f"{r['continuation_speedup']:>5.2f}x | {r['tokens_per_target_forward']:>5.2f} | "
          f"{acc} | {r['spec_mean_turns']:>4.2f} | {r['ar_mean_turns']:>4.2f} | "
          f"{r['ar_identical_fraction']:>4.0%} |")


def episode_header() -> str:
  """The markdown header of `format_episode_row`'s table."""
  names = ["batch", "episodes", "temp", "mode", "spec tok/s", "AR tok/s", "AR re-encoded tok/s",
           "spec/AR", "AR/re-encoded", "tok/fwd", "acceptance online", "turns spec",
           "turns AR", "AR loops identical"]
  return "| " + " | ".join(names) + " |\n" + "|---" * len(names) + "|"
