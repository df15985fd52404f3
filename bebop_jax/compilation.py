"""Compiled programs: JAX's persistent compilation cache and releasing compiled executables."""

from __future__ import annotations

import gc
import os

import jax


def enable_compilation_cache(directory: str | None, workdir: str) -> None:
  """JAX's persistent compilation cache in `directory` (None: <workdir>/compile_cache; '':
  none), the CLIs' --compilation_cache: every compiled program is stored there and loaded
  instead of compiled again, by a rerun, by a resumed stage, and by a stage that compiles a
  program an earlier one compiled and released (`release_compiled` drops them between
  phases)."""
  if directory is None:
    directory = os.path.join(workdir, "compile_cache")
  if not directory:
    return
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def release_compiled() -> None:
  """Drops JAX's compiled executables. On CPU each compiled decoding loop maps ~1000 memory
  regions of generated code (one per kernel of its unrolled layers), so a process that
  compiles ~60 of them (prompt buckets x batch sizes x modes) reaches the kernel's
  vm.max_map_count (65530) and LLVM fails with "Cannot allocate memory". Long-running jobs
  call this between phases whose compiled functions are not reused."""
  jax.clear_caches()
  gc.collect()
