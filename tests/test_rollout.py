"""The rollout engine: per-rollout outputs, the environment in the loop, exactness of
speculative rollouts against autoregressive ones, sampler-learner log-prob parity, the mock."""

import dataclasses

import jax
import numpy as np
import pytest
from scipy import stats

from bebop_jax import rollout
from bebop_jax import tasks as tasks_lib
from bebop_jax.data.tokenizer import load_tokenizer
from bebop_jax.decoding import speculative
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
from bebop_jax.rl import learner
from bebop_jax.tasks import base

CONFIG = model_config.preset("tiny")
GRAPHDEF, _STATE = policy_lib.init(CONFIG, seed=3)
# A sharper random policy (entropy ~3.6 nats instead of ~4.3 of 4.85): its rollouts have
# structure for the statistical tests, and drafts are still accepted ~30% of the time.
STATE = jax.tree.map(lambda x: x, _STATE)
STATE["embed"].set_value(_STATE["embed"].get_value() * 1.5)
CHAR = load_tokenizer("char")  # the tokenizer every engine here is handed


class CharTask(base.Task):
  """Single-turn: reward = fraction of the completion's characters in `chars` (the reward
  sees every sampled token)."""
  name = "math"

  def __init__(self, chars="aeiou0123456789"):
    self.chars = chars

  def sample(self, seed):
    return base.Example("math", f"Say {seed % 10}:\n", "x", {})

  def reward(self, example, completion):
    text = base.clip_completion(completion)
    return sum(ch in self.chars for ch in text) / max(len(text), 1)


@dataclasses.dataclass
class _EchoEnv:
  """Replies for `turns` turns, then ends with reward = number of turns seen."""
  turns: int
  seen: list = dataclasses.field(default_factory=list)

  def step(self, text):
    self.seen.append(text)
    if len(self.seen) > self.turns:
      return base.StepResult("", True, float(len(self.seen)), len(self.seen))
    return base.StepResult("<|result|>ok<|/result|>", False, 0.0, len(self.seen))


class EchoTask(base.Task):
  """Multi-turn: every episode takes `turns` replies before the environment ends it."""
  name = "agentic"
  max_turns = 4

  def __init__(self, turns=2):
    self.turns = turns
    self.envs = []

  @property
  def multi_turn(self):
    return True

  def sample(self, seed):
    return base.Example("agentic", f"Ask {seed}:\n", "x", {})

  def reward(self, example, completion):
    return 0.0

  def environment(self, example):
    self.envs.append(_EchoEnv(self.turns))
    return self.envs[-1]


def _settings(engine, **kw):
  if engine == "adaptive":  # speculative with an adaptive draft length
    from bebop_jax.decoding import adaptive  # pylint: disable=g-import-not-at-top
    engine, kw = "speculative", kw | {"adaptive": adaptive.Settings(
        k_max=CONFIG.num_draft_steps, segment=2, calibrate=False, batch_factor=2)}
  kw = dict(engine=engine, max_new_tokens=40, batch_size=8, prompt_buckets=(16, 64)) | kw
  return rollout.RolloutSettings(**kw)


@pytest.mark.parametrize("engine", rollout.ENGINES)
def test_rollouts_of_a_mixed_batch(engine):
  """Single- and multi-turn rows in one batch: each row follows its own environment and stop
  set; replies are in the tokens but not in the policy mask; rewards are the environment's;
  log-probs and entropies only where the policy sampled."""
  tok = CHAR
  echo = EchoTask(turns=2)
  tasks = {"math": CharTask(), "agentic": echo}
  exs = [tasks["math"].sample(i) if i % 2 else echo.sample(i) for i in range(6)]
  eng = rollout.JaxEngine(GRAPHDEF, STATE, tasks, _settings(engine, max_turn_tokens=5),
                          tokenizer=CHAR)
  r = eng.generate(exs, jax.random.key(0))
  assert r.num_rows == 6 and r.tokens.shape == (6, 40)
  assert r.num_draft_steps == (CONFIG.num_draft_steps if engine == "speculative" else 0)
  reply = tok.encode("<|result|>ok<|/result|>")
  for i, ex in enumerate(exs):
    n = int(r.lengths[i])
    toks, mask = r.tokens[i, :n].tolist(), r.policy_mask[i, :n]
    assert not r.policy_mask[i, n:].any() and not r.tokens[i, n:].any()
    assert (r.logprobs[i][~r.policy_mask[i]] == 0).all()
    assert (r.logprobs[i][r.policy_mask[i]] < 0).all()
    assert (r.entropy[i][r.policy_mask[i]] > 0).all()
    # Each turn's first token comes from the prefill or the reply's forward.
    assert r.emitted_by_forwards[i] == mask.sum() - r.turns[i]
    if ex.task == "agentic":
      # Two replies, each right after a policy turn, none in the policy mask.
      assert r.turns[i] == 3 and r.done[i] and r.rewards[i] == 3.0
      # Truncated when max_turn_tokens cut the last turn before a stop token.
      assert r.truncated[i] == (toks[-1] not in (tok.eos_id, tok.call_end_id))
      starts = [j for j in range(n) if toks[j:j + len(reply)] == reply]
      assert len(starts) == 2
      for j in starts:
        assert not mask[j:j + len(reply)].any() and mask[j - 1]
      assert mask.sum() == n - 2 * len(reply)
    else:
      assert r.turns[i] == 1 and mask.all()
      text = tok.decode(toks[:-1] if toks[-1] == tok.eos_id else toks)
      assert r.rewards[i] == pytest.approx(tasks["math"].reward(ex, text))
      # max_turn_tokens=5 ends the turn; a tool-call end does not stop a single-turn row.
      assert n == 5 or toks[-1] == tok.eos_id
      assert r.truncated[i] == (toks[-1] != tok.eos_id)
  if engine == "speculative":
    assert (r.attempted[:, 0] == r.target_forwards).all() and r.accepted.sum() > 0
    assert 1 < r.tokens_per_target_forward() < 1 + CONFIG.num_draft_steps
    assert r.tokens_per_target_forward() == r.emitted_by_forwards.sum() / r.attempted[:, 0].sum()
  else:
    assert (r.target_forwards == r.emitted_by_forwards).all()
    assert r.tokens_per_target_forward() == 1.0


# Every engine at 0.7 (a learner that forgot the temperature fails there, not at 1.0); 1.0 once,
# for the fused head's branch at temperature 1. The engines apply the temperature through the
# same sampling transform at any value, so 1.0 on the speculative engines repeats 0.7's path.
@pytest.mark.parametrize("engine,temperature", [
    ("speculative", 0.7), ("autoregressive", 0.7), ("adaptive", 0.7), ("autoregressive", 1.0)])
def test_behaviour_logprobs_equal_the_learners_recomputation(engine, temperature):
  """The sampler's log-probs of every sampled token, single-turn and across environment
  replies, equal the learner's teacher-forced recomputation under the same parameters
  (adaptive: draft lengths switching and rows leaving the batch between segments)."""
  tasks = {"math": CharTask(), "agentic": EchoTask(turns=2)}
  exs = [tasks["math"].sample(i) if i % 2 else tasks["agentic"].sample(i) for i in range(8)]
  eng = rollout.JaxEngine(GRAPHDEF, STATE, tasks,
                          _settings(engine, temperature=temperature, max_turn_tokens=10),
                          tokenizer=CHAR)
  r = eng.generate(exs, jax.random.key(1))
  seq_len = 16 + 40  # prompts are < 16 tokens
  batch = learner.learner_batch(r, np.zeros(8), seq_len)
  lp_fn = learner.make_logprobs_fn(GRAPHDEF, eng.settings.sampling)
  lp = np.asarray(lp_fn(STATE, {}, batch["tokens"], batch["segment_ids"]))
  m = batch["mask"] > 0
  assert m.sum() > 100 and (r.turns[::2] == 3).all()
  np.testing.assert_allclose(lp[m], batch["behaviour_logprobs"][m], atol=1e-5, rtol=0)
  if engine == "adaptive":
    assert sum(r.k_iterations.values()) > 0 and r.num_draft_steps == CONFIG.num_draft_steps
    assert (r.target_forwards >= r.attempted[:, 0]).all()


def test_speculative_and_autoregressive_reward_distributions_match():
  """Verification is exact, so speculative rollouts are samples of the same policy: their
  reward distribution passes two-sample tests against autoregressive rollouts of the same
  prompts (fixed seeds), while the same tests reject a 25% temperature change (power). The
  reward counts the policy's favourite characters (from a pilot sample), so it moves with
  any change of the sampling distribution."""
  exs = [CharTask().sample(i) for i in range(1024)]
  run = lambda task, engine, t, seed: rollout.JaxEngine(
      GRAPHDEF, STATE, {"math": task},
      _settings(engine, temperature=t, max_new_tokens=16, batch_size=128),
      tokenizer=CHAR).generate(exs, jax.random.key(seed))
  pilot = run(CharTask(), "autoregressive", 1.0, 99)
  counts = np.bincount(pilot.tokens[pilot.policy_mask], minlength=CONFIG.vocab_size)
  tok = CHAR
  chars = [t for t in np.argsort(-counts) if len(tok.specials) <= t < tok.num_used]
  favourite = tok.decode(chars[:10])
  task = CharTask(favourite)
  spec = run(task, "speculative", 1.0, 1)
  assert 0.2 < spec.acceptance()[0] < 0.6  # both verification branches are exercised
  ar = run(task, "autoregressive", 1.0, 2)
  hot = run(task, "autoregressive", 1.25, 3)
  for other, same in ((ar, True), (hot, False)):
    ks = stats.ks_2samp(spec.rewards, other.rewards).pvalue
    welch = stats.ttest_ind(spec.rewards, other.rewards, equal_var=False).pvalue
    if same:
      assert ks > 0.01 and welch > 0.01, (ks, welch)
    else:
      assert ks < 0.01 and welch < 0.01, (ks, welch)


def test_generate_compiles_once_per_shape():
  tasks = {"math": CharTask()}
  eng = rollout.JaxEngine(GRAPHDEF, STATE, tasks, _settings("speculative"), tokenizer=CHAR)
  exs = [tasks["math"].sample(i) for i in range(8)]
  eng.generate(exs, jax.random.key(0))
  size = speculative.start._cache_size()  # pylint: disable=protected-access
  for seed in range(1, 4):
    eng.update_params(jax.tree.map(lambda x: x * 1.0, STATE), policy_version=seed)
    r = eng.generate(exs[seed:] + exs[:seed], jax.random.key(seed))
    assert r.policy_version == seed
  assert speculative.start._cache_size() == size  # pylint: disable=protected-access


def test_bad_settings_are_clear_errors():
  with pytest.raises(ValueError, match="engine='beam' is not allowed"):
    rollout.RolloutSettings(engine="beam")
  with pytest.raises(ValueError, match="mode='exact' is not allowed"):
    rollout.RolloutSettings(mode="exact")
  with pytest.raises(ValueError, match="top_p"):
    rollout.RolloutSettings(top_p=0.0)
  with pytest.raises(ValueError, match=r"num_draft_steps=9 is not allowed: must be in \[1, 3\]"):
    rollout.JaxEngine(GRAPHDEF, STATE, {}, rollout.RolloutSettings(num_draft_steps=9),
                      tokenizer=CHAR)
  eng = rollout.JaxEngine(GRAPHDEF, STATE, {"math": CharTask()}, _settings("speculative"),
                          tokenizer=CHAR)
  with pytest.raises(ValueError, match="task 'code'"):
    eng.generate([base.Example("code", "x", "y", {})], jax.random.key(0))


def test_autoregressive_multi_turn_contexts_may_outgrow_the_prompt_buckets():
  """The autoregressive engine keeps its cache across turns (prompt bucket + max_new_tokens
  positions), so only the prompt needs a bucket."""
  task = EchoTask(turns=2)
  eng = rollout.JaxEngine(GRAPHDEF, STATE, {"agentic": task},
                          _settings("autoregressive", prompt_buckets=(16,), max_turn_tokens=8),
                          tokenizer=CHAR)
  r = eng.generate([task.sample(i) for i in range(2)], jax.random.key(0))
  assert (r.turns == 3).all() and r.done.all()
  assert (r.prompt_lengths + r.lengths > 16).all()


def test_mock_engine_scores_scripted_completions():
  math = tasks_lib.get_task("math")
  exs = [math.sample(i) for i in range(4)]
  answers = lambda ex, row, seed: (ex.demonstration if row % 2 else "<|answer|>nope")
  eng = rollout.MockEngine({"math": math}, answers, tokenizer=CHAR)
  r = eng.generate(exs, jax.random.key(0))
  np.testing.assert_array_equal(r.rewards, [0, 1, 0, 1])
  assert r.policy_mask.sum() == r.lengths.sum() and (r.logprobs[r.policy_mask] == -1).all()
  seqs = r.sequences()
  assert len(seqs) == 4 and all(m.sum() == n for (_, m), n in zip(seqs, r.lengths))
  assert not r.truncated.any()
  np.testing.assert_array_equal(r.emitted_by_forwards, r.lengths - 1)
  # A completion longer than max_new_tokens is cut there, eos included: truncated.
  eng = rollout.MockEngine({"math": math}, lambda ex, row, seed: "ab" * (4 + 4 * row),
                           rollout.RolloutSettings(engine="autoregressive", max_new_tokens=12),
                           tokenizer=CHAR)
  r = eng.generate(exs[:2], jax.random.key(0))
  np.testing.assert_array_equal(r.lengths, [9, 12])
  np.testing.assert_array_equal(r.truncated, [False, True])


def test_entropy_stats_from_their_definition():
  from bebop_jax import evaluation  # pylint: disable=g-import-not-at-top
  r = rollout.MockEngine({"math": CharTask()}, lambda ex, row, seed: "ab" * (row + 1),
                         entropy=0.75, tokenizer=CHAR).generate(
                             [CharTask().sample(i) for i in range(3)], jax.random.key(0))
  r.entropy[0, 0] = 0.2  # one position below the threshold
  stats = evaluation.entropy_stats({"math": r})["math"]
  ent = r.entropy[r.policy_mask]
  assert stats["positions"] == len(ent) == 2 + 4 + 6 + 3  # + an eos each
  np.testing.assert_allclose(stats["mean"], ent.mean())
  np.testing.assert_allclose(stats["above_threshold"], (len(ent) - 1) / len(ent))
  assert stats["histogram"][2] == 1 and stats["histogram"][7] == len(ent) - 1  # 0.1-wide bins
