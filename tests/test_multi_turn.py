"""Multi-turn generation: environment replies prefilled into every cache (speculative) or
the target's cache (autoregressive), against decoding that re-encodes the whole context."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop_jax.data.tokenizer import load_tokenizer
from bebop_jax.decoding import autoregressive, sampling, speculative
from bebop_jax.decoding import decoder as decoder_lib
from bebop_jax.rollout import episodes as episodes_lib
from bebop_jax.model import config as model_config
from bebop_jax.model import model as policy_lib

CONFIG = model_config.preset("tiny")
GRAPHDEF, STATE = policy_lib.init(CONFIG, seed=3)
K = CONFIG.num_draft_steps
STOP = (2,)
TOK = load_tokenizer("char")  # the tokenizer the episodes are handed


def _prompts(b=3, p=12, seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.array([5, 12, 8, 3][:b], np.int32)
  tokens = rng.integers(3, 100, (b, p)).astype(np.int32)
  tokens[np.arange(p)[None] >= lengths[:, None]] = 0
  return jnp.asarray(tokens), jnp.asarray(lengths)


def test_caches_after_a_reply_equal_a_fresh_prefill_of_the_whole_context():
  tokens, lengths = _prompts()
  params = sampling.SamplingParams(1.0)
  common = dict(params=params, mode="rejection")
  ds = speculative.start(GRAPHDEF, STATE, tokens, lengths, jax.random.key(0),
                         max_new_tokens=40, cache_length=64, max_turn_tokens=7,
                         stop_tokens=STOP, **common)
  before = jax.tree.map(jnp.copy, ds)
  reply = jnp.asarray([[50, 51, 52, 53, 54], [60, 61, 0, 0, 0], [0, 0, 0, 0, 0]], jnp.int32)
  reply_lengths = jnp.asarray([5, 2, 0], jnp.int32)
  # max_turn_tokens=1: the call appends the reply, samples one token and stops, so the state
  # is the one right after the append.
  ds = speculative.continue_with_reply(GRAPHDEF, STATE, ds, reply, reply_lengths,
                                       max_turn_tokens=1, **common)
  n_before, n_after = np.asarray(before.frontier), np.asarray(ds.frontier)
  np.testing.assert_array_equal(n_after, n_before + [6, 3, 0])
  out_len = np.asarray(ds.out.lengths)
  np.testing.assert_array_equal(out_len, np.asarray(before.out.lengths) + [6, 3, 0])
  model = nnx.merge(GRAPHDEF, STATE)
  t = int(n_after.max()) + 2
  seq = ds.seq[:, :t]
  _, h0, fresh = jax.jit(lambda x: model.prefill(model.init_cache(3, 64), x))(seq)
  for row in range(2):
    n = int(n_after[row])
    # The reply sits right after the turn, in the sequence and in the output.
    p, m = int(lengths[row]), int(before.out.lengths[row])
    np.testing.assert_array_equal(np.asarray(ds.seq[row, p + m:p + m + reply_lengths[row]]),
                                  np.asarray(reply[row, :reply_lengths[row]]))
    np.testing.assert_array_equal(np.asarray(ds.out.tokens[row, m:m + reply_lengths[row]]),
                                  np.asarray(reply[row, :reply_lengths[row]]))
    mask = np.asarray(ds.out.policy_mask[row])
    assert not mask[m:m + reply_lengths[row]].any() and mask[:m].all()
    assert mask[m + reply_lengths[row]] and not mask[out_len[row]:].any()
    np.testing.assert_allclose(np.asarray(ds.hidden[row, :n + 1]), np.asarray(h0[row, :n + 1]),
                               atol=2e-5)
    for name in ("k", "v"):
      np.testing.assert_allclose(
          np.asarray(ds.cache.main.stacked(name)[:, row, :, :n + 1]),
          np.asarray(fresh.main.stacked(name)[:, row, :, :n + 1]), atol=2e-5)
      for depth in range(1, K + 1):
        # Depth k at position j needs x_{j+k}; committed up to n + 1.
        end = n + 2 - depth
        np.testing.assert_allclose(
            np.asarray(ds.cache.mtp.stacked(name)[depth - 1, row, :, :end]),
            np.asarray(fresh.mtp.stacked(name)[depth - 1, row, :, :end]), atol=2e-5,
            err_msg=f"row {row} depth {depth} {name}")
  # The row without a reply is untouched.
  untouched = lambda s: (s.seq, s.hidden, s.frontier, s.done, s.out.tokens, s.out.lengths,
                         s.out.policy_mask, s.out.logprobs)
  for a, b in zip(untouched(before), untouched(ds)):
    np.testing.assert_array_equal(np.asarray(a[2]), np.asarray(b[2]))
  for a, b in zip(jax.tree.leaves(before.cache), jax.tree.leaves(ds.cache)):  # [B, KV, S, D]
    np.testing.assert_array_equal(np.asarray(a[2]), np.asarray(b[2]))


@dataclasses.dataclass
class _EchoEnv:
  """Replies with a fixed token text for `turns` turns, then ends with reward = turns."""
  reply: str
  turns: int
  seen: list = dataclasses.field(default_factory=list)

  def step(self, text):
    self.seen.append(text)
    done = len(self.seen) > self.turns
    return multi_turn_result(self.reply if not done else "", done, float(len(self.seen)))


def multi_turn_result(observation, done, reward):
  from bebop_jax.tasks.base import StepResult  # pylint: disable=g-import-not-at-top
  return StepResult(observation, done, reward, 0)


def _reprefill_greedy(prompt, env, max_new_tokens, max_turn_tokens, stop):
  """Reference: greedy autoregressive decoding from the whole context at every turn."""
  tok = TOK
  completion, mask = [], []
  while True:
    ctx = list(prompt) + completion
    budget = min(max_turn_tokens, max_new_tokens - len(completion))
    out = autoregressive.generate(
        GRAPHDEF, STATE, jnp.asarray([ctx + [0] * (64 - len(ctx))]),
        jnp.asarray([len(ctx)]), jax.random.key(0), max_new_tokens=budget,
        cache_length=64 + budget, params=sampling.SamplingParams(0.0), stop_tokens=stop)
    turn = np.asarray(out.tokens)[0, :int(out.lengths[0])].tolist()
    completion += turn
    mask += [True] * len(turn)
    text = tok.decode(turn[:-1] if turn and turn[-1] == tok.eos_id else turn)
    result = env.step(text)
    if result.done:
      return completion, mask, result.reward
    reply = tok.encode(result.observation)
    if len(completion) + len(reply) >= max_new_tokens:
      return completion, mask, 0.0
    completion += reply
    mask += [False] * len(reply)


@pytest.mark.parametrize("engine", ["speculative", "autoregressive", "adaptive"])
def test_temperature_zero_episodes_equal_greedy_decoding_with_full_reprefill(engine):
  tok = TOK
  prompts = [tok.encode(s, add_bos=True) for s in ("what is 3+4?", "get age of bob", "x")]
  replies = ["<|result|>7<|/result|>", "<|result|>error: unknown entity<|/result|>", "ok"]
  stop = (tok.eos_id, tok.call_end_id)
  kw = dict(max_new_tokens=48, max_turn_tokens=6)
  envs = [_EchoEnv(r, turns=2 + i) for i, r in enumerate(replies)]
  stats = []
  if engine in ("speculative", "adaptive"):
    # adaptive: K from the weight-read cost model and an optimistic seed, so it drafts
    # first and then switches as it observes the random model's drafts; rows leave the
    # batch of 4 as they finish.
    from bebop_jax.decoding import adaptive  # pylint: disable=g-import-not-at-top
    greedy = sampling.SamplingParams(0.0)
    decoder = (decoder_lib.Adaptive(
        greedy, "exact", adaptive.Settings(k_max=K, segment=1, calibrate=False,
                                           batch_factor=2), max_turn_tokens=6, stats=stats)
               if engine == "adaptive" else
               decoder_lib.Speculative(greedy, "exact", K, max_turn_tokens=6))
    episodes = episodes_lib.decode_episodes(
        decoder, GRAPHDEF, STATE, prompts, envs, jax.random.key(1), batch_size=4,
        stop_tokens=stop, tokenizer=TOK, max_new_tokens=48)
  else:
    episodes = episodes_lib.decode_episodes(
        decoder_lib.Autoregressive(sampling.SamplingParams(0.0), max_turn_tokens=6),
        GRAPHDEF, STATE, prompts, envs, jax.random.key(1), batch_size=4, stop_tokens=stop,
        prompt_buckets=(64,), tokenizer=TOK, max_new_tokens=48)
  for i, ep in enumerate(episodes):
    env = _EchoEnv(replies[i], turns=2 + i)
    tokens, mask, reward = _reprefill_greedy(prompts[i], env, stop=stop, **kw)
    assert ep.tokens == tokens, i
    assert ep.policy_mask == mask, i
    assert ep.reward == reward and ep.turns == len(env.seen)
    assert envs[i].seen == env.seen
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.policy_mask) if not m)
  assert sum(ep.turns for ep in episodes) >= 7  # replies were appended, several per row
  # Each turn's first token comes from the prefill or the reply's forward.
  assert all(ep.emitted_by_forwards == sum(ep.policy_mask) - ep.turns for ep in episodes)
  if engine == "autoregressive":
    assert all(ep.target_forwards == ep.emitted_by_forwards for ep in episodes)
    return
  # The random model's drafts are mostly wrong: rejections happened around the replies.
  attempted = sum(ep.attempted for ep in episodes)
  accepted = sum(ep.accepted for ep in episodes)
  assert accepted[0] < attempted[0]
  if engine == "speculative":
    assert all(ep.target_forwards == ep.attempted[0] > 0 for ep in episodes)
    return
  assert all(ep.target_forwards >= ep.attempted[0] for ep in episodes)
  used = {k for st in stats for k in st.k_iterations}
  assert 0 in used and len(used) > 1, used  # switched between drafting and K = 0
  assert len(stats) >= 3  # a start and continuations


def test_every_decoders_single_turn_generate_is_its_first_turn():
  """decoder.generate (one turn, no state kept: what benchmarks time) gives the first turn of
  decoder.start, token for token, for every decoder; greedy, all three give the same
  tokens."""
  from bebop_jax.decoding import adaptive  # pylint: disable=g-import-not-at-top
  greedy = sampling.SamplingParams(0.0)
  rows = [TOK.encode(s, add_bos=True) for s in ("what is 3+4?", "x")]
  tokens = np.zeros((2, 16), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  lengths = np.array([len(r) for r in rows], np.int32)
  kw = dict(max_new_tokens=12, cache_length=40, stop_tokens=(TOK.eos_id,))
  decoders = {"autoregressive": decoder_lib.Autoregressive(greedy),
              "speculative": decoder_lib.Speculative(greedy, "exact", K),
              "adaptive": decoder_lib.Adaptive(greedy, "exact", adaptive.Settings(
                  k_max=K, segment=1, calibrate=False))}
  outs = {}
  for name, dec in decoders.items():
    out = dec.generate(GRAPHDEF, STATE, tokens, lengths, jax.random.key(0), **kw)
    first = dec.start(GRAPHDEF, STATE, tokens, lengths, jax.random.key(0), **kw).out
    got, want = np.asarray(out.tokens), np.asarray(first.tokens)
    for i in range(2):
      n = int(out.lengths[i])
      assert n == int(first.lengths[i]) and n > 0, name
      np.testing.assert_array_equal(got[i, :n], want[i, :n], err_msg=name)
    outs[name] = [got[i, :int(out.lengths[i])].tolist() for i in range(2)]
  assert outs["speculative"] == outs["autoregressive"] == outs["adaptive"]
  assert len(decoders["adaptive"].stats) == 2  # generate's call and start's


def test_episodes_compile_once_per_bucket():
  tok = TOK

  def run(seed):
    prompts = [tok.encode("abc" * (1 + i), add_bos=True) for i in range(3)]
    envs = [_EchoEnv("<|result|>" + "z" * (3 + i + seed) + "<|/result|>", turns=2)
            for i in range(3)]
    return episodes_lib.decode_episodes(
        decoder_lib.Speculative(sampling.SamplingParams(1.0), "rejection", K,
                                max_turn_tokens=5),
        GRAPHDEF, STATE, prompts, envs, jax.random.key(seed), batch_size=4,
        max_new_tokens=48, stop_tokens=(tok.eos_id,), tokenizer=TOK)

  run(0)
  sizes = (speculative.start._cache_size(),  # pylint: disable=protected-access
           speculative.continue_with_reply._cache_size())  # pylint: disable=protected-access
  run(1)
  run(2)
  assert (speculative.start._cache_size(),  # pylint: disable=protected-access
          speculative.continue_with_reply._cache_size()) == sizes  # pylint: disable=protected-access


@pytest.mark.parametrize("engine", ["speculative", "autoregressive"])
def test_row_stops_choose_each_rows_stop_tokens(engine):
  """Row 0 stops at token 7 and token 9; row 1 only at token 9 (an eos-only single-turn row
  in a batch with agentic rows). Whatever the sampler draws, a row's turn ends exactly at its
  first own stop token and never at another row's."""
  tokens, lengths = _prompts(b=2)
  stop = (7, 9)
  row_stops = np.array([[True, True], [False, True]])
  params = sampling.SamplingParams(3.0)  # near uniform over the vocabulary: stops happen
  kw = dict(max_new_tokens=200, params=params, stop_tokens=stop, row_stops=row_stops)
  hits = 0
  for seed in range(4):
    if engine == "speculative":
      out = speculative.generate(GRAPHDEF, STATE, tokens, lengths, jax.random.key(seed),
                                 cache_length=12 + 200 + K + 1, mode="rejection", **kw)
    else:
      out = autoregressive.generate(GRAPHDEF, STATE, tokens, lengths, jax.random.key(seed),
                                    cache_length=12 + 200, **kw)
    toks, n = np.asarray(out.tokens), np.asarray(out.lengths)
    for row, own in enumerate(([7, 9], [9])):
      emitted = toks[row, :n[row]].tolist()
      first = next((i for i, t in enumerate(emitted) if t in own), None)
      if first is None:
        assert n[row] == 200
      else:
        assert n[row] == first + 1
      hits += row == 1 and 7 in emitted  # row 1 ran past a token 7
  assert hits > 0


@dataclasses.dataclass
class _ScriptedEnv:
  """Replies replies[t] to policy turn t; after the last reply's turn, ends with reward =
  turns seen."""
  replies: list[str]
  seen: list = dataclasses.field(default_factory=list)

  def step(self, text):
    self.seen.append(text)
    t = len(self.seen) - 1
    if t < len(self.replies):
      return multi_turn_result(self.replies[t], False, 0.0)
    return multi_turn_result("", True, float(len(self.seen)))


# Replies of different lengths in different rows (4 to 40 tokens), a row the environment
# ends after its first turn, and a row whose second reply cannot fit the budget. Five
# prompts in chunks of 4 rows: the second chunk is one row and padding.
AR_REPLIES = [
    ["<|result|>7<|/result|>", "<|result|>" + "a" * 9 + "<|/result|>"],
    [],
    ["ok", "no", "<|result|>" + "z" * 14 + "<|/result|>"],
    ["<|result|>" + "b" * 10 + "<|/result|>", "c" * 40],
    ["d" * 5],
]
AR_PARAMS = sampling.SamplingParams(0.8, top_k=50)
AR_KW = dict(batch_size=4, max_new_tokens=56)
AR_DECODER = decoder_lib.Autoregressive(AR_PARAMS, max_turn_tokens=6)


@pytest.fixture(scope="module")
def ar_episodes():
  """{continuation: (prompts, episodes, environments)} for the same key."""
  tok = TOK
  prompts = [tok.encode(s, add_bos=True)
             for s in ("what is 3+4?", "get age of bob", "x", "list files", "hi")]
  out = {}
  for continuation in (True, False):
    envs = [_ScriptedEnv(list(r)) for r in AR_REPLIES]
    kw = dict(stop_tokens=(tok.eos_id,), tokenizer=TOK, **AR_KW)
    out[continuation] = (prompts, episodes_lib.decode_episodes(
        AR_DECODER, GRAPHDEF, STATE, prompts, envs, jax.random.key(5), **kw)
                         if continuation else episodes_lib.reencoded_episodes(
        GRAPHDEF, STATE, prompts, envs, jax.random.key(5), params=AR_PARAMS,
        max_turn_tokens=6, **kw), envs)
  return out


def test_autoregressive_continuation_equals_reencoding_the_context(ar_episodes):
  """Keeping the cache across turns and re-encoding the whole context every turn sample
  the same episodes from the same key: per-row keys carried across turns, split once per
  sampled token whatever the other rows do."""
  _, kept, kept_envs = ar_episodes[True]
  _, fresh, fresh_envs = ar_episodes[False]
  for i, (a, b) in enumerate(zip(kept, fresh)):
    assert a.tokens == b.tokens, i
    assert a.policy_mask == b.policy_mask, i
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0, err_msg=str(i))
    np.testing.assert_allclose(a.entropy, b.entropy, atol=1e-5, rtol=0, err_msg=str(i))
    assert (a.reward, a.turns, a.done, a.truncated) == (b.reward, b.turns, b.done,
                                                       b.truncated), i
    assert a.target_forwards == b.target_forwards == a.emitted_by_forwards, i
    assert a.emitted_by_forwards + a.turns == sum(a.policy_mask), i
    assert kept_envs[i].seen == fresh_envs[i].seen, i
  # The scenario: several turns in rows 0 and 2, an early end in row 1, and row 3's second
  # reply cut by the budget.
  assert [ep.turns for ep in kept] == [3, 1, 4, 2, 2]
  assert [ep.done for ep in kept] == [True, True, True, False, True]
  assert kept[3].truncated and len(kept[3].tokens) + 40 >= AR_KW["max_new_tokens"]


def test_autoregressive_continuation_logprobs_equal_a_teacher_forced_forward(ar_episodes):
  """The log-probs and entropies a continued episode reports equal one teacher-forced
  forward of the policy over prompt + turns + replies, at the policy's positions, under
  the same sampling transform."""
  prompts, episodes, _ = ar_episodes[True]
  model = nnx.merge(GRAPHDEF, STATE)
  forward = jax.jit(lambda x: model(x, num_draft_steps=0)["logits"])
  checked = 0
  for prompt, ep in zip(prompts, episodes):
    seq = np.asarray(prompt + ep.tokens, np.int32)[None]
    logits = forward(jnp.asarray(seq))[0]
    # Completion token j sits at position P + j and is scored by the logits at P + j - 1.
    scored = logits[len(prompt) - 1:-1]
    logp = np.asarray(sampling.sampling_logprobs(scored, AR_PARAMS))
    ent = np.asarray(sampling.entropy(scored))
    mask = np.asarray(ep.policy_mask)
    ref = logp[np.arange(len(ep.tokens)), ep.tokens]
    np.testing.assert_allclose(np.asarray(ep.logprobs)[mask], ref[mask], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ep.entropy)[mask], ent[mask], atol=1e-5, rtol=0)
    assert (np.asarray(ep.logprobs)[~mask] == 0).all()
    checked += int((~mask).sum() > 0)
  assert checked == 4  # four episodes have replies in their sequences


def test_autoregressive_episodes_keep_the_teacher_forced_hidden_states(ar_episodes):
  """return_hidden: every episode keeps the main model's h0 at each position of prompt +
  turns + replies (from the prefill, each decoding step and each reply's forward), equal to
  one teacher-forced forward over the whole sequence; the episodes themselves do not
  change. (The last token is never fed, so its h0 is not compared.)"""
  prompts, plain, _ = ar_episodes[True]
  envs = [_ScriptedEnv(list(r)) for r in AR_REPLIES]
  episodes = episodes_lib.decode_episodes(
      dataclasses.replace(AR_DECODER, return_hidden=True), GRAPHDEF, STATE, prompts, envs,
      jax.random.key(5), stop_tokens=(TOK.eos_id,), tokenizer=TOK, **AR_KW)
  model = nnx.merge(GRAPHDEF, STATE)
  forward = jax.jit(lambda x: model(x, num_draft_steps=0)["hidden"])
  for prompt, ep, ref in zip(prompts, episodes, plain):
    assert ep.tokens == ref.tokens and ep.logprobs == ref.logprobs
    seq = np.asarray(prompt + ep.tokens, np.int32)
    assert ep.hidden.shape == (len(seq), CONFIG.d_model)
    h0 = np.asarray(forward(jnp.asarray(seq[None]))[0])
    np.testing.assert_allclose(ep.hidden[:-1], h0[:-1], atol=2e-5, rtol=1e-4)


def test_autoregressive_episodes_compile_once_per_bucket():
  tok = TOK

  def run(seed):
    prompts = [tok.encode("abc" * (1 + i), add_bos=True) for i in range(3)]
    envs = [_ScriptedEnv(["<|result|>" + "z" * (3 + i + seed) + "<|/result|>"] * (1 + i))
            for i in range(3)]
    return episodes_lib.decode_episodes(
        decoder_lib.Autoregressive(sampling.SamplingParams(1.0), max_turn_tokens=5),
        GRAPHDEF, STATE, prompts, envs, jax.random.key(seed), batch_size=4,
        max_new_tokens=48, stop_tokens=(tok.eos_id,), tokenizer=TOK)

  sizes = lambda: (autoregressive.start._cache_size(),  # pylint: disable=protected-access
                   autoregressive.continue_with_reply._cache_size())  # pylint: disable=protected-access
  run(0)
  compiled = sizes()
  episodes = run(1) + run(2)
  assert sizes() == compiled
  assert max(ep.turns for ep in episodes) == 4  # replies appended, reply buckets reused


@pytest.mark.parametrize("continuation", [True, False])
def test_an_autoregressive_episode_does_not_depend_on_the_other_rows(continuation):
  """Row 0's episode, from the same key, alone and next to rows whose turns and episodes
  end at other times: a row's key is split once per token it samples, whatever the loop
  does for the other rows. Row 0 stops at many tokens (its turns end early, sampled near
  uniformly), the other rows at none (their turns run to max_turn_tokens)."""
  tok = TOK
  stops = tuple(range(8, 104, 2))  # 48 of the 128 tokens

  def run(others, other_replies):
    prompts = [tok.encode("what is 3+4?", add_bos=True)] + [
        tok.encode(p, add_bos=True) for p in others]
    envs = [_ScriptedEnv(["ok", "<|result|>12<|/result|>", "no"])] + [
        _ScriptedEnv(list(r)) for r in other_replies]
    kw = dict(batch_size=4, max_new_tokens=48, stop_tokens=stops, tokenizer=TOK,
              row_stops=np.arange(len(prompts))[:, None] == np.zeros((1, len(stops))))
    params = sampling.SamplingParams(3.0)
    if continuation:
      return episodes_lib.decode_episodes(
          decoder_lib.Autoregressive(params, max_turn_tokens=10), GRAPHDEF, STATE, prompts,
          envs, jax.random.key(9), **kw)
    return episodes_lib.reencoded_episodes(GRAPHDEF, STATE, prompts, envs,
                                           jax.random.key(9), params=params,
                                           max_turn_tokens=10, **kw)

  def turn_lengths(ep):  # the runs of policy tokens
    return [len(list(run)) for sampled, run in itertools.groupby(ep.policy_mask) if sampled]

  alone = run([], [])
  crowded = run(["list files", "x"], [["a" * 3] * 3, []])
  assert alone[0].tokens == crowded[0].tokens
  np.testing.assert_allclose(alone[0].logprobs, crowded[0].logprobs, atol=1e-5, rtol=0)
  # Row 0 ended a turn (not its last) before row 1 did: the loop ran on without it.
  first, second = turn_lengths(crowded[0]), turn_lengths(crowded[1])
  assert len(first) == len(second) == 4
  assert any(a < b for a, b in zip(first[:-1], second[:-1])), (first, second)
