r"""The table of experiments/bench_device.sh: reads what its steps wrote in --dir.

  python -m experiments.bench_device_table --dir=runs/bench_device

Prints one markdown table (also DIR/bench_device.md) and writes DIR/bench_device.json with
every step's status, seconds and results.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

_DIR = flags.DEFINE_string("dir", "runs/bench_device", "bench_device.sh's output directory.")

STEPS = ("decode_qwen3_0p6b", "decode_quickstart", "decode_smollm2", "tv_kernel", "train", "rl")


def read_steps(directory: str) -> dict[str, dict]:
  """{step: {"status": ok | failed (rc N) | timed out | skipped, "seconds"}} from steps.tsv."""
  steps = {}
  with open(os.path.join(directory, "steps.tsv")) as f:
    for line in f:
      name, rc, seconds = line.rstrip("\n").split("\t")
      status = {"0": "ok", "skipped": "skipped", "124": "timed out"}.get(rc, f"failed (rc {rc})")
      steps[name] = {"status": status, "seconds": int(seconds)}
  return steps


def _load(directory: str, name: str):
  path = os.path.join(directory, name)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def rows(directory: str) -> tuple[list[str], dict]:
  """(table lines, results by step)."""
  results = {}
  lines = ["| step | what | figure | value |", "|---|---|---|---|"]
  for name in ("decode_qwen3_0p6b", "decode_quickstart", "decode_smollm2"):
    r = results[name] = _load(directory, f"{name}.json")
    for row in (r or {}).get("results", []):
      what = f"{r['model']}, batch {row['batch']}, T={row['temperature']:g}, {row['mode']}"
      lines.append(f"| {name} | {what} | AR tokens/s | {row['ar_tokens_per_s']:.1f} |")
      ci = row.get("speedup_ci95")
      ci = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
      lines.append(f"| {name} | {what} | speculative tokens/s (ratio [95% over "
                   f"{row.get('repeats', 1)} passes]) | "
                   f"{row['spec_tokens_per_s']:.1f} ({row['speedup']:.2f}x{ci}) |")
      lines.append(f"| {name} | {what} | tokens per target forward | "
                   f"{row['tokens_per_target_forward']:.2f} |")
      if "decode_phase_speedup" in row:
        lines.append(f"| {name} | {what} | AR fixed share; decode-phase ratio | "
                     f"{row['ar_fixed_share']:.0%}; {row['decode_phase_speedup']:.2f}x |")
  r = results["tv_kernel"] = _load(directory, "tv_kernel.json")
  for rec in (r or {}).get("records", []):
    what = f"V={rec['vocab']}, N={rec['rows']}, {rec['implementation']} ({r['backend']})"
    if "error" in rec:
      lines.append(f"| tv_kernel | {what} | error | {rec['error'][:80]} |")
    elif "median_s" in rec:
      ratio = (f" ({rec['time_vs_reference']:.2f}x ref time, {rec['temp_vs_reference']:.3f}x "
               "ref temp)" if "time_vs_reference" in rec else "")
      lines.append(f"| tv_kernel | {what} | fwd+bwd ms; temp MiB | {rec['median_s'] * 1e3:.2f}; "
                   f"{rec['temp_bytes'] / 2**20:.1f}{ratio} |")
  r = results["train"] = _load(directory, "train.json")
  for stage, res in ((r or {}).get("results") or {}).items():
    for path in ("old", "new"):
      p = res[path]
      lines.append(f"| train | {stage}, {path} path | step s; model FLOP/s of matmul; temp MB | "
                   f"{p['step_s_median']:.4f}; {p['flops_utilization']:.1%}; "
                   f"{p['temp_bytes'] / 1e6:.0f} |")
    lines.append(f"| train | {stage} | old / new step time (median, min); temp ratio | "
                 f"{res['speedup']:.2f}x, {res['speedup_of_min']:.2f}x; "
                 f"{res['temp_memory_ratio']:.3f} |")
  r = results["rl"] = _load(directory, os.path.join("rl", "bench_rl.json"))
  for arm, a in ((r or {}).get("arms") or {}).items():
    lines.append(f"| rl | {arm} | s per RL step (rollout share) | {a['step_s']:.2f} "
                 f"({a['rollout_share']:.0%}) |")
  return lines, results


def main(argv):
  del argv
  directory = _DIR.value
  steps = read_steps(directory)
  lines, results = rows(directory)
  status = ["| step | status | seconds |", "|---|---|---|"] + [
      f"| {name} | {s['status']} | {s['seconds']} |" for name, s in steps.items()]
  text = "\n".join(status) + "\n\n" + "\n".join(lines) + "\n"
  print(text)
  with open(os.path.join(directory, "bench_device.md"), "w") as f:
    f.write(text)
  with open(os.path.join(directory, "bench_device.json"), "w") as f:
    json.dump({"steps": steps, "results": results}, f, indent=1)
  print(f"wrote {os.path.join(directory, 'bench_device.json')}")


if __name__ == "__main__":
  app.run(main)
