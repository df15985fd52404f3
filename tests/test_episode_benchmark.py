"""The multi-turn decoding benchmark (experiments/episode_benchmark.py) on a tiny random
policy: its counts against the same episodes run directly through rollout.episodes."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from bebop_jax.stages import config as config_lib
from bebop_jax import tasks as tasks_lib
from bebop_jax.data import pipeline
from bebop_jax.decoding import sampling
from bebop_jax.decoding import decoder as decoder_lib
from bebop_jax.rollout import episodes as episodes_lib
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
from bebop_jax.tasks import agentic, base
from experiments import episode_benchmark

GRAPHDEF, STATE = policy_lib.init(model_config.preset("tiny"), seed=3)
KW = dict(batch_size=2, max_new_tokens=40, max_turn_tokens=6)


@dataclasses.dataclass
class _EchoEnv:
  """Replies `reply` to the first `turns` policy turns, then ends the episode (a random
  policy never writes a valid tool call, so the real environment would end every episode
  after one turn)."""
  reply: str
  turns: int
  seen: list = dataclasses.field(default_factory=list)

  def step(self, text):
    self.seen.append(text)
    if len(self.seen) > self.turns:
      return base.StepResult("", True, 1.0, len(self.seen))
    return base.StepResult(self.reply, False, 0.0, len(self.seen))


class _EchoAgenticTask(agentic.AgenticTask):
  """The agentic task (its held-out prompts) with `_EchoEnv` environments whose reply
  length and number of turns depend on the prompt."""

  def environment(self, example):
    n = len(example.prompt)
    return _EchoEnv("<|result|>" + "z" * (n % 5) + "<|/result|>", turns=1 + n % 3)


def test_episode_benchmark_counts_equal_the_episodes_run_directly(tiny_data_config,
                                                                  monkeypatch):
  config = config_lib.base_config()
  config.data = tiny_data_config
  data = config_lib.settings(config).data
  tok = data.loaded_tokenizer  # the benchmark's tokenizer
  # Three prompts in batches of 2: four episodes, the first four held-out agentic prompts.
  examples = pipeline.eval_examples(data, "agentic", 4)
  prompts = [tok.encode(ex.prompt, add_bos=True) for ex in examples]
  get_task = tasks_lib.get_task
  monkeypatch.setattr(tasks_lib, "get_task", lambda name, **knobs: (
      _EchoAgenticTask(**knobs) if name == "agentic" else get_task(name, **knobs)))
  # Keep the compiled loops for the direct runs below.
  monkeypatch.setattr(episode_benchmark, "release_compiled", lambda: None)
  modes = ("rejection", "strict")
  rows = episode_benchmark.run_episode_benchmark(
      config, GRAPHDEF, STATE, batch_sizes=[KW["batch_size"]], temperatures=[1.0],
      modes=list(modes), max_new_tokens=KW["max_new_tokens"], repeats=1, num_prompts=3,
      max_turn_tokens=KW["max_turn_tokens"], seed=4)
  assert [(r["batch"], r["prompts"], r["temperature"], r["mode"]) for r in rows] == [
      (2, 4, 1.0, mode) for mode in modes]

  task = _EchoAgenticTask(**config.data.tasks.agentic.knobs)
  params = sampling.SamplingParams(1.0)
  common = dict(tokenizer=tok, stop_tokens=(tok.eos_id, tok.call_end_id),
                max_turns=task.max_turns, batch_size=KW["batch_size"],
                max_new_tokens=KW["max_new_tokens"])
  envs = lambda: [task.environment(ex) for ex in examples]
  key = jax.random.key(4)
  turn_limit = KW["max_turn_tokens"]
  ar = episodes_lib.decode_episodes(
      decoder_lib.Autoregressive(params, max_turn_tokens=turn_limit), GRAPHDEF, STATE,
      prompts, envs(), key, **common)
  reencoded = episodes_lib.reencoded_episodes(GRAPHDEF, STATE, prompts, envs(), key,
                                              params=params, max_turn_tokens=turn_limit,
                                              **common)
  count = lambda episodes: sum(int(np.sum(ep.policy_mask)) for ep in episodes)
  replies = lambda episodes: sum(len(ep.tokens) for ep in episodes) - count(episodes)
  # The scenario: several turns per episode, replies in the completions.
  assert np.mean([ep.turns for ep in ar]) > 1.5 and replies(ar) > 0
  assert [(a.tokens, a.policy_mask) for a in ar] == [(r.tokens, r.policy_mask)
                                                     for r in reencoded]
  for row, mode in zip(rows, modes):
    spec = episodes_lib.decode_episodes(
        decoder_lib.Speculative(params, mode, nnx.merge(GRAPHDEF, STATE).config.num_draft_steps,
                                max_turn_tokens=turn_limit),
        GRAPHDEF, STATE, prompts, envs(), key, **common)
    assert row["spec_tokens"] == count(spec) and row["spec_reply_tokens"] == replies(spec)
    assert row["ar_tokens"] == row["ar_reencoded_tokens"] == count(ar)
    assert row["ar_reply_tokens"] == replies(ar)
    assert row["ar_identical_fraction"] == 1.0
    assert row["spec_mean_turns"] == pytest.approx(np.mean([ep.turns for ep in spec]))
    assert row["ar_mean_turns"] == pytest.approx(np.mean([ep.turns for ep in ar]))
    emitted = sum(ep.emitted_by_forwards for ep in spec)
    forwards = sum(int(ep.attempted[0]) for ep in spec)
    assert row["spec_target_forwards"] == forwards
    assert row["tokens_per_target_forward"] == pytest.approx(emitted / forwards)
    attempted = np.sum([ep.attempted for ep in spec], 0)
    accepted = np.sum([ep.accepted for ep in spec], 0)
    np.testing.assert_allclose(row["acceptance_online"], accepted / np.maximum(attempted, 1))
    # Rates are policy tokens per second, the ratios the ratios of the rates.
    assert row["spec_tokens_per_s"] == pytest.approx(count(spec) / row["spec_seconds"])
    assert row["ar_tokens_per_s"] == pytest.approx(count(ar) / row["ar_seconds"])
    assert row["speedup"] == pytest.approx(
        count(spec) / row["spec_seconds"] / (count(ar) / row["ar_seconds"]))
    # Same tokens in both autoregressive loops: the ratio of their times.
    assert row["continuation_speedup"] == pytest.approx(
        row["ar_reencoded_seconds"] / row["ar_seconds"])
  # One autoregressive measurement per batch size and temperature, shared by its rows.
  assert rows[0]["ar_seconds"] == rows[1]["ar_seconds"]


def test_episode_benchmark_table_has_a_column_per_header_name():
  row = dict(batch=1, prompts=4, temperature=1.0, mode="rejection", spec_tokens_per_s=1.0,
             ar_tokens_per_s=2.0, ar_reencoded_tokens_per_s=3.0, speedup=0.5,
             continuation_speedup=0.67, tokens_per_target_forward=2.5,
             acceptance_online=[0.5, 0.25], spec_mean_turns=2.0, ar_mean_turns=2.5,
             ar_identical_fraction=1.0)
  header = episode_benchmark.episode_header().splitlines()[0]
  assert episode_benchmark.format_episode_row(row).count("|") == header.count("|")
