r"""Ahead-of-time compile of both RL programs on a simulated split pod (bebop_jax.rl.aot).

  python experiments/aot_compile_rl.py --config=configs/pod_qwen3_rl.py:8b --num_devices=256 \
      --out=runs/aot_rl_8b.json

Simulates --num_devices host (CPU) devices, splits them per the config's rl.placement (e.g.
128 learner + 128 rollout devices), compiles the learner's policy update and the rollout
program (speculative.start) from abstract state (nothing is materialised), and prints per
program its mesh, devices, compile time and per-device memory (argument, output, temp). The
JSON written with --out is compile_programs' result (device ids included).

The learner's policy update alone, with config overrides (e.g. the dense head against the
fused one, without gradient accumulation; docs/rl.md has the numbers):

  python experiments/aot_compile_rl.py --config=configs/pod_qwen3_rl.py:8b --learner_only \
      --set rl.head=dense --set rl.train.grad_accum_steps=1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

GIB = 2 ** 30


def _parse(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True,
                      help="config file, optionally with its argument: path[:arg]")
  parser.add_argument("--num_devices", type=int, default=256,
                      help="simulated host devices (learner + rollout sub-meshes)")
  parser.add_argument("--prompt_len", type=int, default=None,
                      help="rollout prompt bucket (default: the bucket of rl.max_prompt_len)")
  parser.add_argument("--completion_len", type=int, default=None,
                      help="completion budget (default: rl.rollout.max_new_tokens)")
  parser.add_argument("--out", default=None, help="write the results as JSON here")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config key (dotted path; the value a Python literal "
                           "or a string), e.g. rl.head=dense; repeatable")
  parser.add_argument("--learner_only", action="store_true",
                      help="compile only the learner's policy update")
  args = parser.parse_args(argv)
  if args.num_devices < 2:
    parser.error(f"--num_devices={args.num_devices} is not allowed: at least 2 (one learner "
                 "and one rollout device)")
  return args


def _override(config, assignment: str) -> None:
  """config[KEY] = VALUE for --set KEY=VALUE (VALUE a Python literal, else a string)."""
  import ast  # pylint: disable=g-import-not-at-top
  key, sep, text = assignment.partition("=")
  if not sep:
    raise SystemExit(f"--set {assignment!r} is not allowed: KEY=VALUE")
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    value = text
  *path, last = key.split(".")
  parent = config
  for part in path:
    parent = parent[part]
  parent[last] = value


def _table(result: dict) -> str:
  header = (f"{'program':<26} {'mesh':<16} {'devices':<10} {'compile s':>9} "
            f"{'arg GiB':>8} {'out GiB':>8} {'temp GiB':>9}")
  lines = [header, "-" * len(header)]
  for side in ("learner", "rollout"):
    if side not in result:
      continue
    info = result[side]
    ids = info["mesh"]["devices"]
    mesh = "x".join(f"{a}{n}" for a, n in info["mesh"]["shape"].items())
    mem = info["memory"]
    gib = lambda k: mem.get(k, float("nan")) / GIB  # pylint: disable=cell-var-from-loop
    lines.append(f"{side + ' ' + info['program']:<26} {mesh:<16} "
                 f"{f'{ids[0]}-{ids[-1]}':<10} {info['compile_s']:>9.1f} "
                 f"{gib('argument_size_in_bytes'):>8.2f} {gib('output_size_in_bytes'):>8.2f} "
                 f"{gib('temp_size_in_bytes'):>9.2f}")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = _parse(argv)
  # Before jax is imported: the simulated devices (replacing any device count given).
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(
      flags + [f"--xla_force_host_platform_device_count={args.num_devices}"])
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax  # pylint: disable=g-import-not-at-top
  from bebop_jax.stages import config as config_lib  # pylint: disable=g-import-not-at-top
  from bebop_jax.rl import aot  # pylint: disable=g-import-not-at-top

  if jax.device_count() != args.num_devices:
    raise RuntimeError(f"asked for {args.num_devices} simulated devices but JAX has "
                       f"{jax.device_count()} ({jax.default_backend()}): was jax imported "
                       "before XLA_FLAGS was set?")
  path, _, arg = args.config.partition(":")
  config = config_lib.load_file(path, arg or None)
  for assignment in args.set:
    _override(config, assignment)
  settings = config_lib.settings(config)  # validates it
  start = time.perf_counter()
  result = aot.compile_programs(settings, prompt_len=args.prompt_len,
                                completion_len=args.completion_len,
                                learner_only=args.learner_only)
  result.update(config=args.config, overrides=args.set, total_s=time.perf_counter() - start)
  print(f"{args.config} {' '.join(args.set)} on {args.num_devices} simulated devices: "
        f"{result['placement']}")
  print(_table(result))
  for side in ("learner", "rollout"):
    if side not in result:
      continue
    info = result[side]
    print(f"{side}: state {info['state_bytes'] / GIB:.2f} GiB, per device "
          f"{info['state_bytes_per_device'] / GIB:.3f} GiB; "
          + ", ".join(f"{k} {info[k]}" for k in ("rows", "length", "head", "grad_accum_steps",
                                                 "prompt_len", "max_new_tokens",
                                                 "cache_length")
                      if k in info))
  if "rollout" in result:
    print(f"devices disjoint: learner {len(result['learner']['input_devices'])}, rollout "
          f"{len(result['rollout']['input_devices'])}; total {result['total_s']:.1f}s")
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
