"""bebop_jax.rl.advantages and policy_loss against numpy written from the definitions, in
values and gradients, in every mode and aggregation."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop_jax import rl

B, T, G = 6, 7, 3


# ----------------------------------------------------------------------- numpy references


def np_advantages(rewards, group_size, mode):
  out = np.zeros(len(rewards))
  for start in range(0, len(rewards), group_size):
    g = np.asarray(rewards[start:start + group_size], float)
    for i, r in enumerate(g):
      if mode == "grpo":
        mu = sum(g) / len(g)
        sd = (sum((x - mu) ** 2 for x in g) / len(g)) ** 0.5
        out[start + i] = (r - mu) / (sd + 1e-6)
      elif mode == "drgrpo":
        out[start + i] = r - sum(g) / len(g)
      else:
        others = [x for j, x in enumerate(g) if j != i]
        out[start + i] = r - sum(others) / len(others)
  return out


NORM = 2 * B * T  # seq-mean-token-sum-norm's constant (rows per update x generation budget)


def np_policy_loss(lp, behaviour, adv, mask, *, clip_low, clip_high, aggregation,
                   proximal=None, is_cap=None, is_mode="cap", ref=None, kl_coef=0.0,
                   norm=NORM):
  """(loss, d loss / d lp) token by token, in float64."""
  b, t = lp.shape
  loss_tok = np.zeros((b, t))
  grad_tok = np.zeros((b, t))
  fin = np.isfinite
  for i, j in itertools.product(range(b), range(t)):
    anchor = behaviour[i, j] if proximal is None else proximal[i, j]
    val = grad = 0.0
    # The policy-gradient term only where every log-prob it uses is finite (a token outside
    # a policy's top-k/top-p support has log-prob -inf and contributes nothing).
    if mask[i, j] and fin(lp[i, j]) and fin(anchor) and fin(behaviour[i, j]):
      rho = np.exp(lp[i, j] - anchor)
      a = adv[i]
      pg1 = rho * a
      pg2 = min(max(rho, 1 - clip_low), 1 + clip_high) * a
      if pg1 <= pg2:   # the unclipped branch is the min: d/dlp (-rho a) = -rho a
        val, grad = -pg1, -rho * a
      else:            # the clipped branch is constant in lp when it is the min
        val, grad = -pg2, 0.0
      if proximal is not None:
        w = np.exp(proximal[i, j] - behaviour[i, j])
        if is_cap is not None:
          w = min(w, is_cap) if is_mode == "cap" else (0.0 if w > is_cap else w)
        val, grad = val * w, grad * w
    if ref is not None and kl_coef and mask[i, j] and fin(lp[i, j]) and fin(ref[i, j]):
      d = ref[i, j] - lp[i, j]
      val += kl_coef * (np.exp(d) - d - 1)
      grad += kl_coef * (-np.exp(d) + 1)
    loss_tok[i, j], grad_tok[i, j] = val, grad
  m = mask.astype(float)
  rows = [i for i in range(b) if m[i].sum() > 0]
  weights = np.zeros((b, t))
  for i in rows:
    for j in range(t):
      if not m[i, j]:
        continue
      if aggregation == "token-mean":
        weights[i, j] = 1 / m.sum()
      elif aggregation == "seq-mean-token-mean":
        weights[i, j] = 1 / m[i].sum() / len(rows)
      else:
        weights[i, j] = 1 / norm
  return (loss_tok * weights).sum(), grad_tok * weights


def _inputs(seed=0, drift=0.4):
  rng = np.random.default_rng(seed)
  behaviour = np.log(rng.uniform(0.05, 0.95, (B, T)))
  lp = behaviour + rng.normal(0, drift, (B, T))   # ratios well on both sides of the clip
  proximal = behaviour + rng.normal(0, drift, (B, T))
  ref = behaviour + rng.normal(0, drift, (B, T))
  adv = rng.normal(0, 1, B)
  mask = rng.uniform(size=(B, T)) < 0.7
  mask[:, 0] = True
  mask[4] = False  # a row with no tokens: absent from every denominator
  return lp, behaviour, proximal, ref, adv, mask


# ----------------------------------------------------------------------- advantages


@pytest.mark.parametrize("mode", rl.ADVANTAGE_MODES)
def test_advantages_equal_the_definitions(mode):
  rewards = np.array([1.0, 0.0, 0.5, 1.0, 1.0, 1.0, 0.2, 0.9, 0.0])
  got = np.asarray(rl.advantages(jnp.asarray(rewards), G, mode))
  np.testing.assert_allclose(got, np_advantages(rewards, G, mode), rtol=1e-5, atol=1e-6)
  # A group of equal rewards has advantage 0 in every mode.
  np.testing.assert_allclose(got[3:6], 0.0, atol=1e-6)


@pytest.mark.parametrize("bad", [dict(group_size=1), dict(group_size=4),
                                 dict(mode="ppo")])
def test_advantages_reject_bad_arguments(bad):
  kw = dict(group_size=G, mode="grpo") | bad
  with pytest.raises(ValueError, match=next(iter(bad))):
    rl.advantages(jnp.zeros(9), **kw)


def test_dynamic_sampling_drops_groups_with_equal_rewards():
  rewards = jnp.array([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.2, 0.2, 0.3])
  np.testing.assert_array_equal(np.asarray(rl.dynamic_sampling_mask(rewards, 3)),
                                [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1])


# ----------------------------------------------------------------------- policy loss


CASES = [dict(), dict(proximal=True), dict(proximal=True, is_cap=1.1),
         dict(proximal=True, is_cap=1.1, is_mode="mask"),
         dict(ref=True, kl_coef=0.3), dict(proximal=True, is_cap=1.5, ref=True, kl_coef=0.1)]


@pytest.mark.parametrize("aggregation", rl.AGGREGATIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(c) or "plain")
@pytest.mark.parametrize("mask_dtype", [bool, np.int32])
def test_policy_loss_and_gradient_equal_numpy(aggregation, case, mask_dtype):
  lp, behaviour, proximal, ref, adv, mask = _inputs()
  clip = dict(clip_low=0.2, clip_high=0.28)
  kw = dict(proximal=proximal if case.get("proximal") else None, is_cap=case.get("is_cap"),
            is_mode=case.get("is_mode", "cap"), ref=ref if case.get("ref") else None,
            kl_coef=case.get("kl_coef", 0.0))
  want_loss, want_grad = np_policy_loss(lp, behaviour, adv, mask, aggregation=aggregation,
                                        **clip, **kw)
  f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)

  def loss(lp_):
    return rl.policy_loss(lp_, f32(behaviour), f32(adv), jnp.asarray(mask.astype(mask_dtype)),
                          aggregation=aggregation, proximal_logprobs=f32(kw["proximal"]),
                          is_cap=kw["is_cap"], is_mode=kw["is_mode"],
                          ref_logprobs=f32(kw["ref"]),
                          kl_coef=kw["kl_coef"], norm=NORM, **clip)

  (got_loss, metrics), got_grad = jax.value_and_grad(loss, has_aux=True)(f32(lp))
  np.testing.assert_allclose(float(got_loss), want_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(got_grad), want_grad, rtol=1e-4, atol=1e-7)
  # The metrics, from their definitions.
  m = mask.astype(bool)
  anchor = kw["proximal"] if kw["proximal"] is not None else behaviour
  rho = np.exp(lp - anchor)
  a = np.broadcast_to(adv[:, None], lp.shape)
  np.testing.assert_allclose(float(metrics["ratio_mean"]), rho[m].mean(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["clip_frac_low"]),
                             ((rho < 0.8) & (a < 0))[m].mean(), atol=1e-7)
  np.testing.assert_allclose(float(metrics["clip_frac_high"]),
                             ((rho > 1.28) & (a > 0))[m].mean(), atol=1e-7)
  assert 0 < float(metrics["clip_frac_low"]) + float(metrics["clip_frac_high"]) < 1
  np.testing.assert_allclose(float(metrics["logprob_diff_max"]),
                             np.abs(lp - behaviour)[m].max(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["logprob_diff_mean"]),
                             np.abs(lp - behaviour)[m].mean(), rtol=1e-5)
  d = lp - behaviour
  np.testing.assert_allclose(float(metrics["kl_behaviour"]), (np.exp(d) - d - 1)[m].mean(),
                             rtol=1e-4)
  if kw["ref"] is not None:
    d = kw["ref"] - lp
    np.testing.assert_allclose(float(metrics["kl"]), (np.exp(d) - d - 1)[m].mean(), rtol=1e-4)
  if kw["is_cap"] is not None:
    w = np.exp(proximal - behaviour)
    np.testing.assert_allclose(float(metrics["is_capped_frac"]), (w > kw["is_cap"])[m].mean())
    np.testing.assert_allclose(float(metrics["is_weight_max"]), w[m].max(), rtol=1e-5)


@pytest.mark.parametrize("aggregation", rl.AGGREGATIONS)
def test_the_entropy_bonus_equals_numpy(aggregation):
  """l - entropy_coef H over every masked token, with the aggregation's weights: the loss and
  its gradient in H (-coef x weight at masked tokens, 0 elsewhere), the policy-gradient part
  unchanged; a negative coefficient, or one without entropies, is refused."""
  lp, behaviour, _, _, adv, mask = _inputs(seed=3)
  entropy = np.random.default_rng(3).uniform(0.0, 2.0, lp.shape)
  clip = dict(clip_low=0.2, clip_high=0.28)
  want_pg, _ = np_policy_loss(lp, behaviour, adv, mask, aggregation=aggregation, **clip)
  weights = np.asarray(rl.aggregation_weights(mask, aggregation, NORM), float)
  coef = 0.05
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  loss = lambda h: rl.policy_loss(f32(lp), f32(behaviour), f32(adv), mask,
                                  aggregation=aggregation, norm=NORM, entropy=h,
                                  entropy_coef=coef, **clip)
  (got, metrics), grad = jax.value_and_grad(loss, has_aux=True)(f32(entropy))
  np.testing.assert_allclose(float(got), want_pg - coef * (entropy * weights * mask).sum(),
                             rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(grad), -coef * weights * mask, rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(float(metrics["entropy"]), entropy[mask].mean(), rtol=1e-5)
  for bad in (dict(entropy=f32(entropy), entropy_coef=-0.1), dict(entropy_coef=0.1)):
    with pytest.raises(ValueError, match="entropy_coef=.* is not allowed"):
      rl.policy_loss(f32(lp), f32(behaviour), f32(adv), mask, **bad)


def test_token_weights_replace_the_aggregation():
  """Weights computed over a whole batch make microbatch losses add up to its loss."""
  lp, behaviour, _, _, adv, mask = _inputs(seed=1)
  f = lambda x: jnp.asarray(x, jnp.float32)
  full, _ = rl.policy_loss(f(lp), f(behaviour), f(adv), mask, aggregation="seq-mean-token-mean")
  w = rl.aggregation_weights(mask, "seq-mean-token-mean")
  halves = sum(float(rl.policy_loss(f(lp[s]), f(behaviour[s]), f(adv[s]), mask[s],
                                    token_weights=w[s])[0])
               for s in (slice(0, 3), slice(3, 6)))
  np.testing.assert_allclose(halves, float(full), rtol=1e-6)


def test_on_policy_loss_is_the_policy_gradient():
  """At lp = behaviour the ratio is 1 and the gradient is -A w per token (REINFORCE)."""
  _, behaviour, _, _, adv, mask = _inputs(seed=2)
  f = lambda x: jnp.asarray(x, jnp.float32)
  grad = jax.grad(lambda x: rl.policy_loss(x, f(behaviour), f(adv), mask)[0])(f(behaviour))
  w = mask / mask.sum()
  np.testing.assert_allclose(np.asarray(grad), -adv[:, None] * w, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("bad", [dict(clip_low=1.0), dict(clip_low=-0.1),
                                 dict(clip_high=-0.2), dict(aggregation="sum"),
                                 dict(is_cap=0.0), dict(is_mode="clip")])
def test_policy_loss_rejects_bad_arguments(bad):
  x = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match=next(iter(bad))):
    rl.policy_loss(x, x, jnp.zeros(2), x > -1, **bad)


# ------------------------------------------------------- top-k / top-p: -inf log-probs


def np_truncated_logprobs(logits, top_k=0, top_p=1.0):
  """Log-probs [..., V] of softmax(logits) restricted to the top-k entries, then to the
  smallest prefix (by probability) whose mass reaches top_p; -inf outside (float64)."""
  x = np.array(logits, np.float64)
  out = np.full_like(x, -np.inf)
  for idx in np.ndindex(x.shape[:-1]):
    v = x[idx]
    order = np.argsort(-v)
    keep = order[:top_k] if top_k else order
    p = np.exp(v[keep] - v[keep].max())
    p /= p.sum()
    mass = 0.0
    kept = []
    for tok, q in zip(keep, p):
      if mass >= top_p:
        break
      kept.append(tok)
      mass += q
    z = np.log(np.sum(np.exp(v[kept] - v[kept].max()))) + v[kept].max()
    out[idx][kept] = v[kept] - z
  return out


def _stale_batch(seed=0, b=4, t=6, v=7):
  """Logits of the current, proximal and reference policies, and tokens sampled from an
  older behaviour policy: many fall outside the others' top-k / top-p sets."""
  rng = np.random.default_rng(seed)
  cur = rng.normal(0, 2, (b, t, v))
  prox = cur + rng.normal(0, 1.0, (b, t, v))
  ref = cur + rng.normal(0, 1.0, (b, t, v))
  old = rng.normal(0, 2, (b, t, v))
  p_old = np.exp(old) / np.exp(old).sum(-1, keepdims=True)
  tokens = np.array([[rng.choice(v, p=p_old[i, j]) for j in range(t)] for i in range(b)])
  behaviour = np.take_along_axis(np.log(p_old), tokens[..., None], -1)[..., 0]
  mask = rng.uniform(size=(b, t)) < 0.8
  mask[-1] = False  # an all-padding row
  adv = rng.normal(0, 1, b)
  return cur, prox, ref, tokens, behaviour, mask, adv


@pytest.mark.parametrize("truncation", [dict(top_k=2), dict(top_p=0.9)], ids=str)
@pytest.mark.parametrize("path", ["plain", "decoupled", "kl", "decoupled_kl"])
def test_top_k_top_p_loss_gradient_and_metrics_are_finite_and_equal_numpy(truncation, path):
  """Tokens outside the current, proximal or reference policy's top-k/top-p set have
  log-prob -inf there; the loss, its gradient with respect to the current logits and every
  metric stay finite and equal numpy written from the module's definition."""
  from bebop_jax.decoding import sampling  # pylint: disable=g-import-not-at-top
  cur, prox, ref, tokens, behaviour, mask, adv = _stale_batch()
  params = sampling.SamplingParams(1.0, truncation.get("top_k", 0), truncation.get("top_p", 1.0))
  take = lambda logp: np.take_along_axis(logp, tokens[..., None], -1)[..., 0]
  np_lp = lambda logits: np_truncated_logprobs(logits, **truncation)
  lp_cur = take(np_lp(cur))
  use_prox, use_ref = "decoupled" in path, "kl" in path
  prox_lp = take(np_lp(prox)) if use_prox else None
  ref_lp = take(np_lp(ref)) if use_ref else None
  m = mask.astype(bool)
  # The case is what it claims: masked tokens outside each policy's set.
  assert (~np.isfinite(lp_cur[m])).sum() >= 2
  if use_prox:
    assert (~np.isfinite(prox_lp[m])).sum() >= 2
  kw = dict(clip_low=0.2, clip_high=0.28, aggregation="token-mean", is_cap=2.0,
            kl_coef=0.1 if use_ref else 0.0)
  want_loss, want_dlp = np_policy_loss(lp_cur, behaviour, adv, mask, proximal=prox_lp,
                                       ref=ref_lp, **{k: v for k, v in kw.items()
                                                      if k != "is_cap"},
                                       is_cap=kw["is_cap"] if use_prox else None)
  # d lp(token) / d logits = onehot - p over the kept set (0 outside, and 0 for a token
  # outside the set, whose d loss / d lp is 0).
  p_cur = np.exp(np_lp(cur))
  onehot = np.eye(cur.shape[-1])[tokens]
  want_grad = want_dlp[..., None] * (onehot - p_cur) * np.isfinite(np_lp(cur))
  f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
  tok = jnp.asarray(tokens)

  def loss(logits):
    lp = jnp.take_along_axis(sampling.sampling_logprobs(logits, params), tok[..., None],
                             axis=-1)[..., 0]
    return rl.policy_loss(lp, f32(behaviour), f32(adv), jnp.asarray(mask),
                          proximal_logprobs=f32(prox_lp), ref_logprobs=f32(ref_lp),
                          is_cap=kw["is_cap"] if use_prox else None,
                          clip_low=kw["clip_low"], clip_high=kw["clip_high"],
                          aggregation=kw["aggregation"], kl_coef=kw["kl_coef"])

  (got_loss, metrics), got_grad = jax.value_and_grad(loss, has_aux=True)(f32(cur))
  assert np.isfinite(float(got_loss)) and np.all(np.isfinite(np.asarray(got_grad)))
  assert all(np.isfinite(float(v)) for v in metrics.values()), metrics
  np.testing.assert_allclose(float(got_loss), want_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got_grad), want_grad, rtol=1e-4, atol=1e-6)
  # Metrics over the tokens each term covers.
  anchor = prox_lp if use_prox else behaviour
  s = m & np.isfinite(lp_cur) & np.isfinite(anchor)
  diff = np.abs(lp_cur - behaviour)[s]
  d = lp_cur[s] - behaviour[s]
  np.testing.assert_allclose(float(metrics["logprob_diff_mean"]), diff.mean(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["logprob_diff_max"]), diff.max(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["kl_behaviour"]), (np.exp(d) - d - 1).mean(),
                             rtol=1e-4)
  np.testing.assert_allclose(float(metrics["ratio_mean"]),
                             np.exp(lp_cur[s] - anchor[s]).mean(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["outside_support_frac"]), 1 - s.sum() / m.sum(),
                             rtol=1e-6)
  assert float(metrics["tokens"]) == m.sum()
  if use_prox:
    w = np.exp(prox_lp[s] - behaviour[s])
    np.testing.assert_allclose(float(metrics["is_weight_mean"]), w.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["is_weight_max"]), w.max(), rtol=1e-5)
  if use_ref:
    both = m & np.isfinite(lp_cur) & np.isfinite(ref_lp)
    assert 2 <= both.sum() < (m & np.isfinite(lp_cur)).sum()  # some outside the reference's
    d = ref_lp[both] - lp_cur[both]
    np.testing.assert_allclose(float(metrics["kl"]), (np.exp(d) - d - 1).mean(), rtol=1e-4)


def test_an_all_padding_batch_gives_zero_metrics_not_infinities():
  x = jnp.zeros((2, 3))
  _, metrics = rl.policy_loss(x, x, jnp.ones(2), x > 1, proximal_logprobs=x, is_cap=2.0)
  assert all(float(v) == 0.0 for v in metrics.values()), metrics
