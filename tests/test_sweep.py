"""The seeded MTP loss sweep's aggregation: mean and standard error over seeds, the
difference to ce and whether it exceeds two standard errors."""

import numpy as np

from experiments import sweep_mtp_losses as sweep


def _run(drafter, seed, tpf, acc):
  return {"start": "warm", "drafter": drafter, "mode": "rejection", "seed": seed,
          "acceptance_online": acc, "tokens_per_target_forward": tpf}


def test_aggregate_means_standard_errors_and_significance():
  runs = [_run("ce", 0, 3.0, [0.9, 0.8]), _run("ce", 1, 3.2, [0.92, 0.84]),
          _run("ce", 2, 3.1, [0.91, 0.82]),
          _run("e2e_tv", 0, 3.6, [0.95, 0.9]), _run("e2e_tv", 1, 3.5, [0.94, 0.9]),
          _run("e2e_tv", 2, 3.7, [0.96, 0.9]),
          _run("kl", 0, 3.1, [0.9, 0.8]), _run("kl", 1, 3.3, [0.9, 0.8]),
          _run("kl", 2, 3.0, [0.9, 0.8])]
  rows = {r["drafter"]: r for r in sweep.aggregate(runs)}
  ce, e2e, kl = rows["ce"], rows["e2e_tv"], rows["kl"]
  assert ce["seeds"] == 3 and "vs_ce" not in ce
  np.testing.assert_allclose(ce["tokens_per_target_forward"], 3.1)
  np.testing.assert_allclose(ce["tokens_per_target_forward_se"],
                             np.std([3.0, 3.2, 3.1], ddof=1) / np.sqrt(3))
  np.testing.assert_allclose(e2e["acceptance_online"], [0.95, 0.9])
  np.testing.assert_allclose(e2e["vs_ce"]["diff"], 0.5)
  assert e2e["vs_ce"]["beyond_2se"] and not kl["vs_ce"]["beyond_2se"]
  assert "(> 2 SE)" in sweep.table(list(rows.values()))
