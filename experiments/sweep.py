r"""Sweeps: a config file's `get_sweep(arg)` entries, run here one after another, or printed
as one command per entry (for this machine or a TPU VM pod).

  python experiments/sweep.py --config=configs/mtp_small.py --workdir=runs/mtp_sweep
  python experiments/sweep.py --config=configs/mtp_small.py --workdir=runs/mtp_sweep \
      --print_commands [--launcher=tpu_vm --tpu=NAME --zone=ZONE]

`get_sweep(arg)` returns a list of override dicts (dotted config keys to values, e.g.
{"mtp.loss": "ce"}). Entry i runs `python -m bebop_jax.main --config=FILE[:arg]` with those
overrides in <workdir>/<name>, its name made from the overrides ("00_loss=ce"). A local sweep
runs every entry in this process (the stages resume a partial entry and skip a finished
one), records each finished entry in <workdir>/sweep.json, and at the end collects the
entries' summaries into <workdir>/sweep.md. Run it again after an interruption to resume.

The tpu_vm launcher prints `gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all
--command="cd REPO && python -m bebop_jax.main ... --distributed=on"`: every host of the pod
runs the same program, and bebop_jax.main calls `jax.distributed.initialize()` first.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import time
from typing import Any, Callable, Mapping, Sequence

from absl import app, flags

from bebop_jax.stages import config as config_lib
from bebop_jax.train import metrics as metrics_lib

LAUNCHERS = ("local", "tpu_vm")
STATUS_FILE = "sweep.json"
# Summary values collected per entry when present: (column, path in the entry's summaries).
DEFAULT_METRICS = (
    ("sft pass@1", "sft.eval.pass_at_1_mean"),
    ("mtp tokens/forward (rejection)", "mtp.after.online.rejection.tokens_per_target_forward"),
    ("mtp acceptance (rejection)", "mtp.after.online.rejection.acceptance"),
    ("mtp tokens/forward (greedy_draft)",
     "mtp.after.online.greedy_draft.tokens_per_target_forward"),
    ("rl pass@1 after", "rl.pass_at_1_after"),
)


@dataclasses.dataclass(frozen=True)
class Entry:
  index: int
  overrides: dict[str, Any]
  name: str
  workdir: str


def entry_name(index: int, overrides: Mapping[str, Any]) -> str:
  """"<index>_<last key part>=<value>,..." with characters safe in a path."""
  parts = ",".join(f"{k.split('.')[-1]}={v}" for k, v in overrides.items()) or "base"
  return f"{index:02d}_" + re.sub(r"[^A-Za-z0-9._=,+-]", "-", parts)[:80]


def entries(sweep: Sequence[Mapping[str, Any]], workdir: str) -> list[Entry]:
  return [Entry(i, dict(o), entry_name(i, o), os.path.join(workdir, entry_name(i, o)))
          for i, o in enumerate(sweep)]


def _flag_value(value: Any) -> str:
  """A value as config_flags parses it on the command line."""
  if isinstance(value, str):
    return value
  if isinstance(value, (tuple, list)):
    return "(" + ", ".join(repr(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return repr(value)


def main_command(config_spec: str, entry: Entry, extra: Sequence[str] = ()) -> list[str]:
  """argv of `python -m bebop_jax.main` for one entry."""
  return (["python", "-m", "bebop_jax.main", f"--config={config_spec}"] +
          [f"--config.{k}={_flag_value(v)}" for k, v in entry.overrides.items()] +
          [f"--workdir={entry.workdir}", *extra])


def command(config_spec: str, entry: Entry, *, launcher: str = "local", tpu: str = "",
            zone: str = "", project: str = "", repo_dir: str = "~/bebop_jax") -> str:
  """One shell line that runs `entry` with `launcher`."""
  if launcher not in LAUNCHERS:
    raise ValueError(f"launcher={launcher!r} is not allowed: one of {LAUNCHERS}")
  if launcher == "local":
    return shlex.join(main_command(config_spec, entry))
  if not tpu or not zone:
    raise ValueError("the tpu_vm launcher needs --tpu (the TPU VM name) and --zone")
  remote = f"cd {repo_dir} && " + shlex.join(main_command(config_spec, entry,
                                                          ["--distributed=on"]))
  gcloud = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--zone={zone}"]
  if project:
    gcloud.append(f"--project={project}")
  return shlex.join(gcloud + ["--worker=all", f"--command={remote}"])


def _read_status(workdir: str) -> dict[str, Any]:
  return metrics_lib.read_json(os.path.join(workdir, STATUS_FILE)) or {"done": {}}


def run_local(config_path: str, arg: str | None, workdir: str, *,
              only: Sequence[int] = (), run_fn: Callable | None = None) -> list[dict]:
  """Runs every entry (or those in `only`) in this process, skipping entries sweep.json
  records as done; returns the collected rows (`collect`)."""
  from bebop_jax import stages  # pylint: disable=g-import-not-at-top  # jax only when running
  run_fn = run_fn or stages.run
  base = config_lib.load_file(config_path, arg)
  todo = entries(config_lib.load_sweep(config_path, arg), workdir)
  os.makedirs(workdir, exist_ok=True)
  status = _read_status(workdir)
  for entry in todo:
    if only and entry.index not in only:
      continue
    if entry.name in status["done"]:
      print(f"[sweep] {entry.name}: done, skipping")
      continue
    config = config_lib.validate(config_lib.apply_overrides(base, entry.overrides))
    print(f"[sweep] {entry.name} ({entry.index + 1}/{len(todo)}) in {entry.workdir}")
    start = time.perf_counter()
    os.makedirs(entry.workdir, exist_ok=True)
    run_fn(config, entry.workdir)
    status["done"][entry.name] = {"overrides": entry.overrides,
                                  "seconds": time.perf_counter() - start}
    metrics_lib.write_json_atomic(os.path.join(workdir, STATUS_FILE), status)
  rows = collect(todo)
  with open(os.path.join(workdir, "sweep.md"), "w") as f:
    f.write(table(rows))
  return rows


def _lookup(tree: Any, path: str) -> Any:
  for part in path.split("."):
    if not isinstance(tree, Mapping) or part not in tree:
      return None
    tree = tree[part]
  return tree


def summaries(workdir: str) -> dict[str, Any]:
  """{stage: its summary.json} of a workdir (the stages that completed there)."""
  out = {}
  for stage in config_lib.STAGES:
    s = metrics_lib.read_json(os.path.join(workdir, stage, "summary.json"))
    if s is not None:
      out[stage] = s
  return out


def collect(todo: Sequence[Entry], metrics=DEFAULT_METRICS) -> list[dict]:
  """One row per entry: its name, overrides, whether its stages finished, and every
  DEFAULT_METRICS value its summaries have."""
  rows = []
  for entry in todo:
    found = summaries(entry.workdir)
    row = {"name": entry.name, "overrides": entry.overrides, "stages": sorted(found)}
    for column, path in metrics:
      value = _lookup(found, path)
      if value is not None:
        row[column] = value
    rows.append(row)
  return rows


def _cell(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.3f}"
  if isinstance(value, (list, tuple)):
    return "/".join(_cell(v) for v in value)
  if isinstance(value, Mapping):
    return ", ".join(f"{k} {_cell(v)}" for k, v in value.items())
  return str(value)


def table(rows: Sequence[Mapping[str, Any]]) -> str:
  """The rows as a markdown table (columns: entry, finished stages, collected metrics)."""
  columns = [c for c, _ in DEFAULT_METRICS if any(c in r for r in rows)]
  lines = ["| entry | stages | " + " | ".join(columns) + " |",
           "|---" * (len(columns) + 2) + "|"]
  for r in rows:
    lines.append(f"| {r['name']} | {','.join(r['stages']) or '-'} | " +
                 " | ".join(_cell(r[c]) if c in r else "-" for c in columns) + " |")
  return "\n".join(lines) + "\n"


def _define_flags() -> None:
  """The CLI's flags, defined only when run as a program (bebop_jax.main defines --config
  too, and both modules may be imported in one process)."""
  flags.DEFINE_string("config", None, "Sweep config file, path[:arg]; it defines "
                      "get_config(arg) and get_sweep(arg).")
  flags.DEFINE_string("workdir", None, "Sweep directory (one subdirectory per entry).")
  flags.DEFINE_bool("print_commands", False, "Print one command per entry instead of "
                    "running them.")
  flags.DEFINE_enum("launcher", "local", list(LAUNCHERS), "How printed commands run.")
  flags.DEFINE_string("tpu", "", "tpu_vm: the TPU VM (pod slice) name.")
  flags.DEFINE_string("zone", "", "tpu_vm: its zone.")
  flags.DEFINE_string("project", "", "tpu_vm: its project (default: gcloud's).")
  flags.DEFINE_string("repo_dir", "~/bebop_jax", "tpu_vm: the checkout on every host.")
  flags.DEFINE_list("only", [], "Run only these entry indices.")
  flags.mark_flag_as_required("config")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  path, _, arg = f.config.partition(":")
  arg = arg or None
  workdir = os.path.abspath(f.workdir or os.path.join(
      "runs", os.path.splitext(os.path.basename(path))[0] + "_sweep"))
  if f.print_commands:
    for entry in entries(config_lib.load_sweep(path, arg), workdir):
      print(command(f.config, entry, launcher=f.launcher, tpu=f.tpu, zone=f.zone,
                    project=f.project, repo_dir=f.repo_dir))
    return
  if f.launcher != "local":
    raise app.UsageError("--launcher=tpu_vm only prints commands (add --print_commands)")
  rows = run_local(path, arg, workdir, only=[int(i) for i in f.only])
  print(table(rows))
  print(f"[sweep] wrote {workdir}/sweep.md and {STATUS_FILE}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
