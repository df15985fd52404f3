"""experiments/bench_device.sh in its CPU mode (--tiny): every step runs and is tabulated."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=600):
  env = dict(os.environ, PYTHONPATH=REPO, PATH=os.path.dirname(sys.executable) + os.pathsep
             + os.environ["PATH"])
  return subprocess.run(["bash", os.path.join(REPO, "experiments", "bench_device.sh"), *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_tiny_mode_runs_every_step_and_writes_one_table(tmp_path):
  out = tmp_path / "bench"
  proc = _run("--tiny", f"--out={out}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((out / "bench_device.json").read_text())
  steps = report["steps"]
  for name in ("decode_qwen3_0p6b", "decode_quickstart", "tv_kernel", "train"):
    assert steps[name]["status"] == "ok", (name, (out / f"{name}.log").read_text()[-2000:])
  assert steps["rl"]["status"] == "skipped"  # needs --init_from
  assert steps["decode_smollm2"]["status"] == "skipped"  # needs --smollm2_from
  results = report["results"]
  for name in ("decode_qwen3_0p6b", "decode_quickstart"):
    rows = results[name]["results"]
    assert rows and all(r["ar_tokens_per_s"] > 0 and r["spec_tokens_per_s"] > 0 for r in rows)
  assert {r["batch"] for r in results["decode_qwen3_0p6b"]["results"]} == {1, 2}
  assert {r["implementation"] for r in results["tv_kernel"]["records"]} >= {
      "reference", "xla_blockwise"}
  train = results["train"]["results"]["sft"]
  assert train["new"]["step_s_median"] > 0 and train["old"]["temp_bytes"] > 0
  table = (out / "bench_device.md").read_text()
  assert "| train | sft | old / new" in table and "tokens per target forward" in table
  assert table in proc.stdout


def test_unknown_argument_is_a_clear_error(tmp_path):
  proc = _run("--gpu", f"--out={tmp_path}")
  assert proc.returncode == 2
  assert "unknown argument '--gpu'" in proc.stderr and "--smollm2_from" in proc.stderr
  proc = _run(f"--smollm2_from={tmp_path}/missing", f"--out={tmp_path}")
  assert proc.returncode == 2 and "is not a directory" in proc.stderr
