"""The rollout interface: a batch of task examples in, one `Rollouts` row per example out.

Evaluation, MTP self-distillation and RL all sample through a `RolloutEngine`:

    engine = JaxEngine(graphdef, params, tasks, RolloutSettings(engine="speculative"),
                       tokenizer=settings.data.loaded_tokenizer)
    rollouts = engine.generate(examples, jax.random.key(0))
    rollouts.rewards, rollouts.logprobs, rollouts.acceptance() ...

`JaxEngine` (engine.py) decodes with the policy, speculatively with its own MTP drafts or
autoregressively; `MockEngine` (mock.py) returns scripted completions for tests of what
consumes rollouts.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from bebop_jax import tasks as tasks_lib
from bebop_jax.decoding import batching, sampling, speculative

ENGINES = ("speculative", "autoregressive")
VERIFICATION_MODES = ("rejection", "greedy_draft", "strict", "block")


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """How an engine samples.

  engine: "speculative" (the policy verifies its own MTP drafts) or "autoregressive".
  mode: speculative verification, one of VERIFICATION_MODES; at temperature 0 every
    engine decodes greedily (speculative: mode "exact", whatever `mode` says).
  temperature, top_k, top_p: the sampling transform (decoding.sampling), applied to the
    policy and the drafts alike; the behaviour log-probs are of this distribution.
  num_draft_steps: K drafts per verification (None: the model's).
  max_new_tokens: budget of a whole completion (policy turns and environment replies).
  batch_size: rows per decoding call (a batch of examples is decoded in chunks of it).
  prompt_buckets: context lengths are padded to the smallest of these.
  max_turn_tokens: optional cap on one policy turn.
  draft_vocab: optional token ids the speculative drafter is restricted to (a reduced draft
    vocabulary, decoding/draft_vocab.py; None: the whole head).
  adaptive: optional decoding.adaptive.Settings: speculative rollouts choose their draft
    length from live acceptance and measured cost (k_max replaces num_draft_steps), the
    estimate seeded with `acceptance` (the drafter's measured per-depth acceptance).
  return_hidden: autoregressive rollouts keep the main model's h0 at every position of
    each row (Rollouts.hidden): a drafter's training features at no extra forward.
  """
  engine: str = "speculative"
  mode: str = "rejection"
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  num_draft_steps: int | None = None
  max_new_tokens: int = 160
  batch_size: int = 32
  prompt_buckets: tuple[int, ...] = batching.PROMPT_BUCKETS
  max_turn_tokens: int | None = None
  draft_vocab: tuple[int, ...] | None = None
  adaptive: Any = None
  acceptance: tuple[float, ...] | None = None
  return_hidden: bool = False

  def __post_init__(self):
    if self.return_hidden and self.engine != "autoregressive":
      raise ValueError("return_hidden needs engine='autoregressive' (its forwards see every "
                       f"position once); got engine={self.engine!r}")
    if self.engine not in ENGINES:
      raise ValueError(f"engine={self.engine!r} is not allowed: one of {ENGINES}")
    if self.mode not in VERIFICATION_MODES:
      raise ValueError(f"mode={self.mode!r} is not allowed: one of {VERIFICATION_MODES}")
    if self.max_new_tokens < 1 or self.batch_size < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} and batch_size="
                       f"{self.batch_size} must be >= 1")
    self.sampling  # validates temperature, top_k, top_p  # pylint: disable=pointless-statement

  @property
  def sampling(self) -> sampling.SamplingParams:
    return sampling.SamplingParams(self.temperature, self.top_k, self.top_p)

  @property
  def decode_mode(self) -> str:
    """The verification mode the speculative loop runs ("exact" at temperature 0)."""
    return "exact" if self.sampling.greedy else self.mode


@dataclasses.dataclass
class Rollouts:
  """One row per rollout (numpy). B rows, prompts right-padded to P, completions to N =
  max_new_tokens, K draft depths (0 for autoregressive rollouts).

  task_ids [B] int32 (index into tasks.TASK_NAMES); prompt_tokens [B, P] int32 (bos +
  prompt); prompt_lengths [B]; tokens [B, N] the completion (policy turns and environment
  replies, 0 after the end); lengths [B]; policy_mask [B, N] bool (True where the policy
  sampled the token); logprobs [B, N] float32 behaviour log-probs of the sampled tokens
  under the sampling distribution (0 elsewhere); entropy [B, N] float32 raw policy entropy
  at each sampled token (nats); rewards [B] float32; turns [B]; done [B] bool (the
  environment ended the episode); truncated [B] bool (a length limit cut the rollout rather
  than the policy or the environment ending it: its last policy turn reached the completion
  budget `max_new_tokens` or the per-turn limit `max_turn_tokens` without a stop token, or
  the environment's reply did not fit in the budget left; running out of `max_turns` is not
  truncation); attempted / accepted [B, K] drafts verified / accepted per depth;
  target_forwards [B] target forwards after each turn's first token (verifications, or
  autoregressive steps; each turn's first token comes from the prefill or the reply's
  forward); emitted_by_forwards [B] the policy tokens those forwards emitted (policy tokens
  minus one per turn); versions [B] int32 the parameter version that sampled each row
  (every token of a row: weights change only between decoding calls); policy_version: the
  newest of them; seconds: wall time of `generate`; k_iterations: adaptive rollouts'
  decoding iterations run with each draft length K ({K: count}; None otherwise); hidden:
  with RolloutSettings.return_hidden, per row the main model's h0 [prompt + completion
  length, E] float32 at the positions of `sequences()` (None otherwise).
  """
  task_ids: np.ndarray
  prompt_tokens: np.ndarray
  prompt_lengths: np.ndarray
  tokens: np.ndarray
  lengths: np.ndarray
  policy_mask: np.ndarray
  logprobs: np.ndarray
  entropy: np.ndarray
  rewards: np.ndarray
  turns: np.ndarray
  done: np.ndarray
  attempted: np.ndarray
  accepted: np.ndarray
  target_forwards: np.ndarray
  emitted_by_forwards: np.ndarray
  truncated: np.ndarray
  policy_version: int = 0
  seconds: float = 0.0
  versions: np.ndarray | None = None
  k_iterations: dict[int, int] | None = None
  hidden: list[np.ndarray] | None = None

  def __post_init__(self):
    if self.versions is None:
      self.versions = np.full(len(self.rewards), self.policy_version, np.int32)

  @property
  def num_rows(self) -> int:
    return len(self.rewards)

  @property
  def num_draft_steps(self) -> int:
    return self.attempted.shape[1]

  def acceptance(self) -> np.ndarray:
    """[K] accepted / attempted drafts per depth, summed over rows."""
    return self.accepted.sum(0) / np.maximum(self.attempted.sum(0), 1)

  def tokens_per_target_forward(self) -> float:
    """Policy tokens emitted by target forwards per target forward, over all rows
    (speculative.tokens_per_target_forward; 1.0 for autoregressive rollouts). A
    verification emits its accepted drafts and one more token, fewer when a stop token or
    a length limit ends the turn inside it."""
    if not self.num_draft_steps:
      return 1.0
    return speculative.tokens_per_target_forward(self.emitted_by_forwards,
                                                 self.target_forwards)

  def policy_tokens(self) -> int:
    return int(self.policy_mask.sum())

  def mean_entropy(self) -> float:
    """Mean policy entropy over the sampled tokens (nats)."""
    return float(self.entropy[self.policy_mask].mean()) if self.policy_mask.any() else 0.0

  def rows_of_task(self, name: str) -> np.ndarray:
    return np.flatnonzero(self.task_ids == tasks_lib.TASK_NAMES.index(name))

  def sequences(self) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, loss mask) per rollout: bos + prompt + completion, the mask 1 on the policy's
    tokens (MTP self-distillation data)."""
    out = []
    for i in range(self.num_rows):
      p, n = int(self.prompt_lengths[i]), int(self.lengths[i])
      tokens = np.concatenate([self.prompt_tokens[i, :p], self.tokens[i, :n]]).astype(np.int32)
      mask = np.concatenate([np.zeros(p, np.int32), self.policy_mask[i, :n].astype(np.int32)])
      out.append((tokens, mask))
    return out

  @staticmethod
  def concatenate(parts: Sequence["Rollouts"]) -> "Rollouts":
    """Rows of every part, in order (prompts re-padded to the longest; each row keeps its
    version; policy_version is the newest, seconds the sum)."""
    if not parts:
      raise ValueError("nothing to concatenate")
    p = max(r.prompt_tokens.shape[1] for r in parts)
    padded = [dataclasses.replace(r, prompt_tokens=np.pad(
        r.prompt_tokens, ((0, 0), (0, p - r.prompt_tokens.shape[1])))) for r in parts]
    arrays = {f.name: np.concatenate([getattr(r, f.name) for r in padded])
              for f in dataclasses.fields(Rollouts)
              if isinstance(getattr(parts[0], f.name), np.ndarray)}
    k_iterations = None
    for r in parts:
      for k, n in (r.k_iterations or {}).items():
        k_iterations = k_iterations or {}
        k_iterations[k] = k_iterations.get(k, 0) + n
    hidden = None
    if all(r.hidden is not None for r in parts):
      hidden = [h for r in parts for h in r.hidden]
    return Rollouts(**arrays, policy_version=max(r.policy_version for r in parts),
                    seconds=sum(r.seconds for r in parts), k_iterations=k_iterations,
                    hidden=hidden)


def rollouts_from_episodes(episodes, prompts: Sequence[Sequence[int]],
                           task_ids: Sequence[int], *, max_new_tokens: int,
                           num_draft_steps: int, policy_version: int = 0,
                           seconds: float = 0.0) -> Rollouts:
  """Packs rollout.episodes Episodes (one per prompt) into a Rollouts."""
  b = len(episodes)
  p = max((len(x) for x in prompts), default=1)
  prompt_tokens = np.zeros((b, p), np.int32)
  tokens = np.zeros((b, max_new_tokens), np.int32)
  mask = np.zeros((b, max_new_tokens), bool)
  logprobs = np.zeros((b, max_new_tokens), np.float32)
  entropy = np.zeros((b, max_new_tokens), np.float32)
  attempted = np.zeros((b, num_draft_steps), np.int64)
  accepted = np.zeros((b, num_draft_steps), np.int64)
  for i, (ep, prompt) in enumerate(zip(episodes, prompts)):
    n = len(ep.tokens)
    prompt_tokens[i, :len(prompt)] = prompt
    tokens[i, :n] = ep.tokens
    mask[i, :n] = ep.policy_mask
    logprobs[i, :n] = ep.logprobs
    entropy[i, :n] = ep.entropy
    if len(ep.attempted):
      attempted[i], accepted[i] = ep.attempted, ep.accepted
  return Rollouts(
      task_ids=np.asarray(task_ids, np.int32), prompt_tokens=prompt_tokens,
      prompt_lengths=np.array([len(x) for x in prompts], np.int32), tokens=tokens,
      lengths=np.array([len(ep.tokens) for ep in episodes], np.int32), policy_mask=mask,
      logprobs=logprobs, entropy=entropy,
      rewards=np.array([ep.reward for ep in episodes], np.float32),
      turns=np.array([ep.turns for ep in episodes], np.int32),
      done=np.array([ep.done for ep in episodes], bool), attempted=attempted,
      accepted=accepted,
      target_forwards=np.array([ep.target_forwards for ep in episodes], np.int64),
      emitted_by_forwards=np.array([ep.emitted_by_forwards for ep in episodes], np.int64),
      truncated=np.array([ep.truncated for ep in episodes], bool),
      policy_version=policy_version, seconds=seconds,
      hidden=([ep.hidden for ep in episodes]
              if episodes and all(ep.hidden is not None for ep in episodes) else None))


class RolloutEngine(abc.ABC):
  """Samples one rollout per task example with the current policy parameters."""

  settings: RolloutSettings
  policy_version: int = 0

  @abc.abstractmethod
  def generate(self, examples: Sequence[tasks_lib.Example], rng: jax.Array) -> Rollouts:
    """One row per example, in order; deterministic given `rng` and the parameters."""

  @abc.abstractmethod
  def update_params(self, params, policy_version: int) -> None:
    """Samples with `params` (trunk and MTP modules of one version) from now on."""

