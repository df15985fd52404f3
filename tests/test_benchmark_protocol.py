"""The wall-clock protocol of decoding benchmarks (decoding/decode_timing.py): arms interleaved in
alternating order over passes with the same keys, the speed ratio as the geometric mean of the
passes' ratios with a Student-t 95% interval over passes, and the protocol's thresholds."""

import types

import numpy as np
import pytest
from scipy import stats

from bebop_jax.stages import decode_timing


def _fake(name, calls, tokens_per_call):
  def fn(tokens, lengths, seed):
    calls.append((name, int(seed)))
    return types.SimpleNamespace(lengths=np.full(tokens.shape[0], tokens_per_call))
  return fn


def test_passes_alternate_the_order_of_the_arms_and_share_their_keys():
  calls = []
  batches = [(np.zeros((2, 4), np.int32), np.full(2, 4))] * 3
  fns = {"a": _fake("a", calls, 5), "b": _fake("b", calls, 7), "c": _fake("c", calls, 1)}
  out = decode_timing.timed_passes(fns, batches, repeats=4)
  timed = calls[3:]  # one warm-up call per arm (one bucket)
  order = [timed[i][0] for i in range(0, len(timed), 3)]
  assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
  for name in fns:
    seeds = [s for n, s in timed if n == name]
    assert seeds == [1000 * r + i for r in range(4) for i in range(3)]
  assert out["a"].tokens == [5 * 2 * 3] * 4 and out["b"].tokens == [7 * 2 * 3] * 4
  assert len(out["a"].seconds) == 4 and all(s > 0 for s in out["a"].seconds)
  assert len(out["c"].outputs) == 3


def test_the_speed_ratio_and_its_interval_from_the_definition():
  rng = np.random.default_rng(0)
  arm = decode_timing.Passes(list(rng.uniform(1, 2, 5)), list(rng.integers(900, 1100, 5)), [])
  base = decode_timing.Passes(list(rng.uniform(1, 2, 5)), list(rng.integers(900, 1100, 5)), [])
  ratios = [(ta / sa) / (tb / sb) for sa, ta, sb, tb in
            zip(arm.seconds, arm.tokens, base.seconds, base.tokens)]
  logs = np.log(ratios)
  lo, hi = stats.t.interval(0.95, len(logs) - 1, loc=logs.mean(), scale=stats.sem(logs))
  got = decode_timing.speed_ratio(arm, base)
  assert got["speedup"] == pytest.approx(float(np.exp(logs.mean())), rel=1e-12)
  assert got["ci95"] == pytest.approx([np.exp(lo), np.exp(hi)], rel=1e-12)
  assert got["repeats"] == 5
  one = decode_timing.speed_ratio(decode_timing.Passes([2.0], [100], []),
                              decode_timing.Passes([1.0], [100], []))
  assert one == {"speedup": 0.5, "ci95": None, "repeats": 1}


def test_the_protocol_thresholds():
  row = {"repeats": 3, "prompts": 64, "ar_tokens": 4000, "spec_tokens": 4100}
  assert decode_timing.meets_protocol(row)
  for key, short in (("repeats", 2), ("prompts", 63), ("ar_tokens", 3999),
                     ("spec_tokens", 3999)):
    assert not decode_timing.meets_protocol({**row, key: short}), key
