"""What a rollout reports about itself, on a policy whose every prediction is known: the
policy tokens its target forwards emitted (tokens per target forward, counted exactly) and
whether a length limit cut it (`truncated`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop_jax import rollout
from bebop_jax.data.tokenizer import load_tokenizer
from bebop_jax.decoding import sampling, speculative
from bebop_jax.decoding import decoder as decoder_lib
from bebop_jax.rollout import episodes as episodes_lib
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib
from bebop_jax.tasks import base

CONFIG = model_config.preset("tiny", tie_embeddings=False)
K = CONFIG.num_draft_steps  # 3
CHAIN_START = 64  # every prediction is a token of [64, 64 + d_model)


def _chain_policy():
  """The tiny model made deterministic: token x embeds as the one-hot of x mod E (E =
  d_model), every block adds nothing (zero output projections), the head maps the one-hot
  of r to token 64 + (r + 1) mod E, and each MTP module passes its token embedding through.
  So the target predicts next(x) = 64 + (x + 1) mod E after any token x, and depth k
  predicts next(x_{i+k}) as well: at temperature 0 every draft is accepted."""
  graphdef, state = policy_lib.init(CONFIG, seed=0)
  e, v = CONFIG.d_model, CONFIG.vocab_size
  state["embed"].set_value(jnp.asarray(np.eye(e)[np.arange(v) % e], jnp.float32))
  head = np.zeros((e, v), np.float32)
  head[np.arange(e), CHAIN_START + (np.arange(e) + 1) % e] = 1.0
  state["head"].set_value(jnp.asarray(head))
  for blocks in (state["layers"], state["mtp"]["blocks"]):
    for name in ("wo", "w_down"):
      blocks[name].set_value(jnp.zeros_like(blocks[name].get_value()))
  proj = np.zeros(state["mtp"]["proj"].get_value().shape, np.float32)  # [M, 2E, E]
  proj[:, e:, :] = np.eye(e)  # u = RMSNorm(Emb(x_{i+k})): the hidden half is dropped
  state["mtp"]["proj"].set_value(jnp.asarray(proj))
  return graphdef, state


GRAPHDEF, STATE = _chain_policy()
GREEDY = sampling.SamplingParams(0.0)


def _chain(token: int, n: int) -> list[int]:
  """The n tokens the chain policy emits after `token`."""
  out = []
  for _ in range(n):
    token = CHAIN_START + (token + 1) % CONFIG.d_model
    out.append(token)
  return out


def test_verifications_count_the_tokens_they_emit():
  """Three rows after the same prompt (its last token 20, so the chain is 85, 86, 87, ...),
  K = 3 drafts all accepted, max_new_tokens 7. The first token comes from the prefill; then
  row 0 stops at 87, which verification 1 accepted as draft 2: it emits 2 tokens, not
  K + 1. Row 1 stops at 89, the bonus token: all K + 1. Row 2 has no stop token: verification
  1 emits K + 1, verification 2 is cut by the length limit after 2."""
  tokens = jnp.asarray([[1, 20, 0, 0]] * 3, jnp.int32)
  lengths = jnp.asarray([2, 2, 2], jnp.int32)
  out = speculative.generate(
      GRAPHDEF, STATE, tokens, lengths, jax.random.key(0), max_new_tokens=7,
      cache_length=4 + 7 + K + 1, params=GREEDY, mode="exact", stop_tokens=(87, 89),
      row_stops=np.array([[True, False], [False, True], [False, False]]))
  chain = _chain(20, 7)
  np.testing.assert_array_equal(np.asarray(out.lengths), [3, 5, 7])
  for row, n in enumerate((3, 5, 7)):
    assert np.asarray(out.tokens)[row, :n].tolist() == chain[:n]
  attempted, accepted = np.asarray(out.attempted), np.asarray(out.accepted)
  np.testing.assert_array_equal(accepted, attempted)  # every verified draft was accepted
  np.testing.assert_array_equal(attempted[:, 0], [1, 1, 2])  # verifications per row
  np.testing.assert_array_equal(np.asarray(out.emitted_by_forwards), [2, 4, 6])
  # "1 + accepted drafts per verification" would count one token too many for rows 0
  # and 2, whose last verification ended on an accepted draft.
  np.testing.assert_array_equal(attempted[:, 0] + accepted.sum(1), [3, 4, 7])
  assert speculative.tokens_per_target_forward(out.emitted_by_forwards,
                                               attempted[:, 0]) == 12 / 4


def _rollouts(num_draft_steps, emitted, forwards, turns):
  b = len(emitted)
  zeros = np.zeros((b, 4))
  return rollout.Rollouts(
      task_ids=np.zeros(b, np.int32), prompt_tokens=np.ones((b, 1), np.int32),
      prompt_lengths=np.ones(b, np.int32), tokens=zeros.astype(np.int32),
      lengths=np.full(b, 4, np.int32), policy_mask=np.ones((b, 4), bool),
      logprobs=zeros, entropy=zeros, rewards=np.zeros(b, np.float32),
      turns=np.asarray(turns), done=np.ones(b, bool),
      attempted=np.tile(np.asarray(forwards)[:, None], (1, num_draft_steps)),
      accepted=np.tile(np.asarray(forwards)[:, None], (1, num_draft_steps)),
      target_forwards=np.asarray(forwards), emitted_by_forwards=np.asarray(emitted),
      truncated=np.zeros(b, bool))


def test_rollouts_tokens_per_target_forward_is_emitted_tokens_over_forwards():
  # The rows of test_verifications_count_the_tokens_they_emit: 12 tokens in 4 forwards,
  # where "1 + accepted drafts per verification" gives (4 + 10) / 4.
  r = _rollouts(K, emitted=[2, 4, 6], forwards=[1, 1, 2], turns=[1, 1, 1])
  r.accepted[:] = [[1, 1, 0], [1, 1, 1], [2, 2, 1]]
  assert r.tokens_per_target_forward() == 3.0
  both = rollout.Rollouts.concatenate([r, _rollouts(K, [5], [2], [1])])
  np.testing.assert_array_equal(both.emitted_by_forwards, [2, 4, 6, 5])
  assert both.tokens_per_target_forward() == 17 / 6
  assert _rollouts(0, [3, 5], [3, 5], [1, 2]).tokens_per_target_forward() == 1.0


@dataclasses.dataclass
class _ScriptedEnv:
  """Replies replies[t] to policy turn t; after the last reply's turn, ends with reward 1."""
  replies: list[str]
  seen: list = dataclasses.field(default_factory=list)

  def step(self, text):
    self.seen.append(text)
    t = len(self.seen) - 1
    if t < len(self.replies):
      return base.StepResult(self.replies[t], False, 0.0, len(self.seen))
    return base.StepResult("", True, 1.0, len(self.seen))


# Every row's prompt ends in token 20, so each episode starts 85, 86, 87, 88, 89; "a" is
# token 74 (of the char tokenizer the episodes are handed), after which the chain goes 75,
# 76, ... max_new_tokens 12, max_turn_tokens 5.
# (stops, replies, expected tokens, policy mask length pattern, done, truncated)
CASES = [
    # A stop token ends the only turn.
    ({87}, [], [85, 86, 87], [3], True, False),
    # The per-turn limit cuts the last turn.
    (set(), [], [85, 86, 87, 88, 89], [5], True, True),
    # 2 tokens + a reply of 10 leave no room for a policy token in 12: not appended.
    ({86}, ["a" * 10], [85, 86], [2], False, True),
    # The second turn runs into the completion budget (the environment then ends it).
    (set(), ["aaa"], [85, 86, 87, 88, 89, 74, 74, 74, 75, 76, 77, 78], [5, -3, 4], True, True),
    # A cut first turn, then a reply, then a turn that ends at its stop token.
    ({75}, ["aaa"], [85, 86, 87, 88, 89, 74, 74, 74, 75], [5, -3, 1], True, False),
    # A reply of 9 fits (2 + 9 < 12); the turn after it is the budget's last token.
    ({86}, ["a" * 9], [85, 86] + [74] * 9 + [75], [2, -9, 1], True, True),
]
STOP_TOKENS = (87, 86, 75)


@pytest.mark.parametrize("engine", ["speculative", "autoregressive", "autoregressive_reencoded"])
def test_truncated_and_emitted_tokens_of_episodes(engine):
  """Episodes that end at a stop token, at the per-turn limit, at the completion budget, or
  because a reply does not fit, through the rollout pipeline (Episodes -> Rollouts)."""
  prompts = [[1, 20]] * len(CASES)
  envs = [_ScriptedEnv(list(replies)) for _, replies, *_ in CASES]
  row_stops = np.array([[t in stops for t in STOP_TOKENS] for stops, *_ in CASES])
  kw = dict(batch_size=8, max_new_tokens=12, stop_tokens=STOP_TOKENS, row_stops=row_stops,
            tokenizer=load_tokenizer("char"))
  if engine == "autoregressive_reencoded":
    episodes = episodes_lib.reencoded_episodes(GRAPHDEF, STATE, prompts, envs,
                                               jax.random.key(0), params=GREEDY,
                                               max_turn_tokens=5, **kw)
  else:
    decoder = (decoder_lib.Speculative(GREEDY, "exact", K, max_turn_tokens=5)
               if engine == "speculative" else
               decoder_lib.Autoregressive(GREEDY, max_turn_tokens=5))
    episodes = episodes_lib.decode_episodes(decoder, GRAPHDEF, STATE, prompts, envs,
                                            jax.random.key(0), **kw)
  r = rollout.rollouts_from_episodes(episodes, prompts, [0] * len(CASES), max_new_tokens=12,
                                     num_draft_steps=K if engine == "speculative" else 0)
  for i, (_, replies, tokens, pattern, done, truncated) in enumerate(CASES):
    mask = [m for n in pattern for m in [n > 0] * abs(n)]
    assert episodes[i].tokens == tokens, i
    assert episodes[i].policy_mask == mask, i
    assert (episodes[i].done, episodes[i].truncated) == (done, truncated), i
    assert episodes[i].turns == sum(n > 0 for n in pattern) == len(envs[i].seen), i
  np.testing.assert_array_equal(r.truncated, [c[-1] for c in CASES])
  np.testing.assert_array_equal(r.done, [c[-2] for c in CASES])
  # Each turn's first token comes from the prefill or the reply's forward; every other
  # policy token was emitted by a target forward.
  np.testing.assert_array_equal(r.emitted_by_forwards + r.turns, r.policy_mask.sum(1))
  np.testing.assert_array_equal(r.emitted_by_forwards, [2, 4, 1, 7, 4, 1])
  if engine == "speculative":
    # One verification in each turn that went past its first token: 19 tokens in 7
    # forwards, where "1 + accepted drafts per verification" counts 23 (rows 0, 2, 3 and
    # 5 end a turn inside a verification, at a stop token or the budget).
    np.testing.assert_array_equal(r.target_forwards, [1, 1, 1, 2, 1, 1])
    assert r.tokens_per_target_forward() == 19 / 7
  else:
    np.testing.assert_array_equal(r.target_forwards, r.emitted_by_forwards)
    assert r.tokens_per_target_forward() == 1.0


def test_tokens_per_forward_by_task_pools_each_tasks_rows():
  import types  # pylint: disable=g-import-not-at-top
  from bebop_jax.stages import decode_timing  # pylint: disable=g-import-not-at-top
  out = lambda e, f: types.SimpleNamespace(emitted_by_forwards=np.array(e),
                                           row_forwards=np.array(f))
  got = decode_timing.tokens_per_forward_by_task([out([6, 2], [2, 2]), out([9, 0], [3, 0])],
                                             ["math", "code", "math", "code"])
  assert got == {"code": 2 / 2, "math": (6 + 9) / (2 + 3)}
