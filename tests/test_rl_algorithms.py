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


def np_policy_loss(lp, behaviour, adv, mask, *, clip_low, clip_high, aggregation,
                   proximal=None, is_cap=None, is_mode="cap", ref=None, kl_coef=0.0):
  """(loss, d loss / d lp) token by token, in float64."""
  b, t = lp.shape
  loss_tok = np.zeros((b, t))
  grad_tok = np.zeros((b, t))
  for i, j in itertools.product(range(b), range(t)):
    anchor = behaviour[i, j] if proximal is None else proximal[i, j]
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
    if ref is not None and kl_coef:
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
        weights[i, j] = 1 / (len(rows) * t)
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
                          kl_coef=kw["kl_coef"], **clip)

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
