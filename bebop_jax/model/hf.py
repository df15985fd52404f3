"""Hugging Face Qwen3 and Llama checkpoints in and out: `config.json` + safetensors <->
(ModelConfig, nnx.State).

    cfg, state = hf.import_checkpoint("/ckpt/Qwen3-8B", mesh=mesh, mtp="copy_last_block")
    hf.export_checkpoint(cfg, state, "/out/qwen3-8b-mtp")   # a Qwen3ForCausalLM directory

Import reads `config.json` (architecture `Qwen3ForCausalLM`, or `LlamaForCausalLM`: the same
decoder without the per-head q/k norms) and the safetensors files (one
`model.safetensors`, or shards listed in `model.safetensors.index.json`) with the
`safetensors` numpy API. Each parameter is built straight onto its target sharding with
`jax.make_array_from_callback`: a device's shard is assembled from the layers it covers,
reading from each Hugging Face tensor only the rows and columns of that block, so no full
host copy of the model, of one stacked parameter or of one tensor ever exists.

Hugging Face names (Linear weights are [out, in]) against ours (stacked over layers):

    model.embed_tokens.weight                 [V, E]      embed          [V, E]
    model.layers.{i}.input_layernorm.weight   [E]         layers.attn_norm[i]
    ...self_attn.q_proj.weight                [H*D, E]    layers.wq[i]   [E, H, D]
    ...self_attn.k_proj / v_proj.weight       [KV*D, E]   layers.wk / wv [E, KV, D]
    ...self_attn.o_proj.weight                [E, H*D]    layers.wo[i]   [H, D, E]
    ...self_attn.q_norm / k_norm.weight       [D]         layers.q_norm / k_norm (Qwen3)
    ...post_attention_layernorm.weight        [E]         layers.mlp_norm
    ...mlp.gate_proj / up_proj.weight         [F, E]      layers.w_gate / w_up [E, F]
    ...mlp.down_proj.weight                   [E, F]      layers.w_down  [F, E]
    model.norm.weight                         [E]         final_norm
    lm_head.weight (untied only)              [V, E]      head           [E, V]

The MTP modules are not part of Qwen3 or Llama: `mtp` chooses where they come from (`MTP_MODES`).
Export writes them beside the model as `mtp.safetensors` (our own layout) with
`mtp_config.json`, which the default import mode restores, so import(export(x)) is bitwise
x. Export also writes the tokenizer files when given one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bebop_jax import sharding
from bebop_jax.model import model as policy_lib
from bebop_jax.model.config import ModelConfig

# The architectures import reads and export writes: {name: (model_type, per-head q/k norm)}.
ARCHITECTURES = {"Qwen3ForCausalLM": ("qwen3", True), "LlamaForCausalLM": ("llama", False)}
# auto: the MTP modules saved by export_checkpoint when the directory has them, else fresh.
# saved: those (an error without them). fresh: a new random initialisation (seeded).
# copy_last_block: fresh input norms and projection, each module's block a copy of the
# model's last decoder layer (a common warm start for an MTP block).
MTP_MODES = ("auto", "saved", "fresh", "copy_last_block")
MTP_WEIGHTS, MTP_CONFIG = "mtp.safetensors", "mtp_config.json"
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# The fields that must agree between a checkpoint and the config that trains it.
SHAPE_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "mlp_dim", "rope_theta", "qk_norm", "tie_embeddings", "norm_eps")


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be imported (its message names what and why)."""


# ------------------------------------------------------------------ config.json


def _unsupported(hf: Mapping[str, Any]) -> list[str]:
  """What in a Qwen3 config.json this model does not implement, one phrase each."""
  found = []
  for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"):
    if hf.get(key):
      found.append(f"mixture-of-experts ({key}={hf[key]!r})")
  if hf.get("use_sliding_window"):
    found.append(f"sliding-window attention (use_sliding_window=True, "
                 f"sliding_window={hf.get('sliding_window')!r})")
  kinds = set(hf.get("layer_types") or ()) - {"full_attention"}
  if kinds:
    found.append(f"layer_types {sorted(kinds)} (only full_attention is supported)")
  if hf.get("attention_bias"):
    found.append("attention bias (attention_bias=True)")
  if hf.get("mlp_bias"):
    found.append("MLP bias (mlp_bias=True)")
  if hf.get("rope_scaling"):
    found.append(f"rope scaling (rope_scaling={hf['rope_scaling']!r})")
  rope = hf.get("rope_parameters") or {}
  if rope.get("rope_type", "default") != "default":
    found.append(f"rope scaling (rope_parameters={rope!r})")
  if hf.get("hidden_act", "silu") != "silu":
    found.append(f"hidden_act={hf['hidden_act']!r} (only silu: SwiGLU)")
  return found


def config_from_hf(hf: Mapping[str, Any], *, num_mtp_modules: int = 1,
                   num_draft_steps: int = 3, dtype: str | None = None,
                   **overrides: Any) -> ModelConfig:
  """Our ModelConfig of a Qwen3 or Llama `config.json` dict (plus the MTP chain and
  `overrides`).

  Raises:
    CheckpointError: for another architecture, or a feature this model lacks (MoE,
      sliding window, attention or MLP bias, rope scaling, another activation), naming it.
  """
  archs = list(hf.get("architectures") or [hf.get("model_type", "?")])
  if len(archs) != 1 or archs[0] not in ARCHITECTURES:
    raise CheckpointError(f"architecture {archs} is not supported: only "
                          f"{' or '.join(ARCHITECTURES)} (dense) can be imported")
  arch = archs[0]
  found = _unsupported(hf)
  if found:
    raise CheckpointError(f"this {arch} checkpoint uses " + "; ".join(found) +
                          ", which bebop_jax's decoder does not implement")
  if dtype is None:
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    dtype = dtype if dtype in _DTYPES else "float32"
  if dtype not in _DTYPES:
    raise CheckpointError(f"dtype={dtype!r} is not allowed: one of {sorted(_DTYPES)}")
  theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10_000.0))
  heads = hf["num_attention_heads"]
  fields = dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads", heads),
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"], rope_theta=float(theta),
      qk_norm=ARCHITECTURES[arch][1],
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), dtype=dtype, param_dtype=dtype,
      num_mtp_modules=num_mtp_modules, num_draft_steps=num_draft_steps)
  return ModelConfig(**{**fields, **overrides})


def model_fields(hf_dir: str, **kwargs: Any) -> dict[str, Any]:
  """The `config.model` values of the checkpoint in `hf_dir` (its config.json, through
  `config_from_hf(..., **kwargs)`): the shape fields, dtypes and the MTP chain, as plain
  data for a config file (`config.model.update(hf.model_fields(path))`)."""
  with open(os.path.join(hf_dir, "config.json")) as f:
    cfg = config_from_hf(json.load(f), **kwargs)
  return {field: getattr(cfg, field) for field in
          SHAPE_FIELDS + ("dtype", "param_dtype", "num_mtp_modules", "num_draft_steps")}


def check_matches(checkpoint: ModelConfig, model: ModelConfig, what: str) -> None:
  """Raises CheckpointError, naming every differing field, unless the checkpoint's decoder is
  the one `model` describes (SHAPE_FIELDS)."""
  diff = [f"{k}: {getattr(checkpoint, k)!r} in the checkpoint, {getattr(model, k)!r} in "
          "config.model" for k in SHAPE_FIELDS if getattr(checkpoint, k) != getattr(model, k)]
  if diff:
    raise CheckpointError(f"{what} is a checkpoint of another model shape: " + "; ".join(diff))


def config_to_hf(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
  """The `config.json` of cfg's decoder (the MTP chain is not in it): Qwen3ForCausalLM with
  per-head q/k norms, LlamaForCausalLM without."""
  arch = next(a for a, (_, qk) in ARCHITECTURES.items() if qk == cfg.qk_norm)
  hf = {
      "architectures": [arch], "model_type": ARCHITECTURES[arch][0],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_bias": False,
      "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
      "max_window_layers": cfg.num_layers, "tie_word_embeddings": cfg.tie_embeddings,
      "torch_dtype": cfg.param_dtype, "max_position_embeddings": 40_960,
      "initializer_range": 0.02, "use_cache": True,
  }
  return {**hf, **extra}


# ------------------------------------------------------------------ the name map


def _hf_name(layer: int, ours: str) -> str:
  prefix = f"model.layers.{layer}."
  return prefix + {
      "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
      "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
      "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
      "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
      "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
      "w_down": "mlp.down_proj.weight"}[ours]


def _to_hf(name: str, w: np.ndarray) -> np.ndarray:
  """One of our tensors (no stack axis) in Hugging Face's layout; `_read_block` reads back."""
  if name in ("wq", "wk", "wv"):
    return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)
  if name == "wo":
    return np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T)
  if name in ("w_gate", "w_up", "w_down", "head"):
    return np.ascontiguousarray(w.T)
  return w


def _hf_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
  e, h, kv, d, f, v = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                       cfg.mlp_dim, cfg.vocab_size)
  return {"embed": (v, e), "head": (v, e), "final_norm": (e,), "attn_norm": (e,),
          "mlp_norm": (e,), "wq": (h * d, e), "wk": (kv * d, e), "wv": (kv * d, e),
          "wo": (e, h * d), "q_norm": (d,), "k_norm": (d,), "w_gate": (f, e),
          "w_up": (f, e), "w_down": (e, f)}[name]


def _key(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


# ------------------------------------------------------------------ reading safetensors


class _Tensors:
  """Lazy access to the tensors of a checkpoint directory's safetensors files."""

  def __init__(self, directory: str, files: Mapping[str, str]):
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    self._open = lambda f: safe_open(os.path.join(directory, f), framework="numpy")
    self.where = dict(files)  # tensor name -> file
    self._handles: dict[str, Any] = {}

  @classmethod
  def of_model(cls, directory: str) -> "_Tensors":
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
      with open(index) as f:
        return cls(directory, json.load(f)["weight_map"])
    if not os.path.exists(os.path.join(directory, SINGLE_FILE)):
      raise CheckpointError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    return cls._of_file(directory, SINGLE_FILE)

  @classmethod
  def _of_file(cls, directory: str, file: str) -> "_Tensors":
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    with safe_open(os.path.join(directory, file), framework="numpy") as f:
      return cls(directory, {k: file for k in f.keys()})

  def get(self, name: str) -> np.ndarray:
    return self.get_slice(name)[...]

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.get_slice(name).get_shape())

  def get_slice(self, name: str):
    """The tensor's lazy slice: indexing it reads only that block from the file."""
    if name not in self.where:
      raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
    file = self.where[name]
    if file not in self._handles:
      self._handles[file] = self._open(file).__enter__()
    return self._handles[file].get_slice(name)

  def close(self):
    for handle in self._handles.values():
      handle.__exit__(None, None, None)
    self._handles.clear()


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...], where: str):
  if tuple(got) != tuple(want):
    raise CheckpointError(f"tensor {name} has shape {tuple(got)} but config.json implies "
                          f"{tuple(want)} ({where})")


# ------------------------------------------------------------------ import


def _build(shape, dtype, shard: NamedSharding | jax.sharding.Sharding,
           read: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
  """An array of `shape` on `shard`, each device's block from `read(index)`."""
  return jax.make_array_from_callback(
      tuple(shape), shard, lambda index: np.asarray(read(index), dtype=dtype))


def _read_block(tensors: _Tensors, hf_name: str, name: str, cfg: ModelConfig,
                index: tuple[slice, ...], where: str) -> np.ndarray:
  """Our block `index` of one (layer's) tensor, reading only the Hugging Face rows and
  columns it needs: each layout (the inverse of `_to_hf`) maps a block to a block (head_dim
  is read whole, as it is never split)."""
  _check_shape(hf_name, tensors.shape(hf_name), _hf_shape(name, cfg), where)
  ours = (_hf_shape(name, cfg)[::-1] if name in ("w_gate", "w_up", "w_down", "head") else
          {"wq": (cfg.d_model, cfg.num_heads, cfg.head_dim),
           "wk": (cfg.d_model, cfg.num_kv_heads, cfg.head_dim),
           "wv": (cfg.d_model, cfg.num_kv_heads, cfg.head_dim),
           "wo": (cfg.num_heads, cfg.head_dim, cfg.d_model)}.get(name, _hf_shape(name, cfg)))
  bounds = [sl.indices(n)[:2] for sl, n in zip(index, ours)]
  src = tensors.get_slice(hf_name)
  d = cfg.head_dim
  if name in ("wq", "wk", "wv"):  # ours [E, H, D] <- HF [H*D, E]
    (e0, e1), (h0, h1), (d0, d1) = bounds
    block = src[h0 * d:h1 * d, e0:e1]
    return block.T.reshape(e1 - e0, h1 - h0, d)[:, :, d0:d1]
  if name == "wo":  # ours [H, D, E] <- HF [E, H*D]
    (h0, h1), (d0, d1), (e0, e1) = bounds
    block = src[e0:e1, h0 * d:h1 * d]
    return block.T.reshape(h1 - h0, d, e1 - e0)[:, d0:d1]
  if name in ("w_gate", "w_up", "w_down", "head"):  # ours = HF transposed
    (a0, a1), (b0, b1) = bounds
    return src[b0:b1, a0:a1].T
  return src[tuple(slice(lo, hi) for lo, hi in bounds)]


def _stacked_reader(tensors: _Tensors, name: str, cfg: ModelConfig, layers: list[int],
                    shape: tuple[int, ...]):
  """read(index) for a [L, ...] parameter stacked from per-layer Hugging Face tensors."""

  def read(index):
    lo, hi, _ = index[0].indices(shape[0])
    return np.stack([_read_block(tensors, _hf_name(layers[j], name), name, cfg, index[1:],
                                 "layer tensor") for j in range(lo, hi)])

  return read


def import_checkpoint(hf_dir: str, *, mesh: Mesh | None = None,
                      rules: sharding.Rules = sharding.DEFAULT_RULES,
                      dtype: str | None = None, mtp: str = "auto",
                      num_draft_steps: int | None = None, num_mtp_modules: int | None = None,
                      seed: int = 0, vocab_size: int | None = None,
                      **overrides: Any) -> tuple[ModelConfig, nnx.State]:
  """(ModelConfig, state) of a Hugging Face Qwen3 or Llama checkpoint directory.

  Args:
    hf_dir: holds config.json and model.safetensors (or shards with their index).
    mesh, rules: place every parameter straight onto its sharding under these logical-axis
      rules (None: the default device).
    dtype: parameter and compute dtype ("float32" or "bfloat16"; None: config.json's
      torch_dtype where it is one of those, else float32).
    mtp: where the MTP modules come from, one of MTP_MODES.
    num_draft_steps, num_mtp_modules: the MTP chain (None: mtp_config.json's when restoring
      saved modules, else K = 3 depths over 1 module).
    seed: initialisation of fresh MTP parameters.
    vocab_size: grow the vocabulary to this size (None: config.json's), for a tokenizer that
      adds tokens (the task markers) to one whose embedding has no spare rows. Each new row
      of the embedding (and of an untied head) is the mean of the checkpoint's rows, so a new
      token's logit is the mean of the old logits and, by Jensen's inequality, its
      probability is at most 1 / (the checkpoint's vocab size): the pretrained model's
      distribution barely moves (Hewitt, 2021).
    overrides: further ModelConfig fields (attention, remat, ...).

  Raises:
    CheckpointError: a missing file or tensor, a tensor of another shape than config.json
      implies, an unsupported architecture or feature, an unknown mtp mode.
  """
  if mtp not in MTP_MODES:
    raise CheckpointError(f"mtp={mtp!r} is not allowed: one of {MTP_MODES}")
  config_path = os.path.join(hf_dir, "config.json")
  if not os.path.exists(config_path):
    raise CheckpointError(f"{hf_dir} has no config.json (a Hugging Face checkpoint "
                          "directory holds config.json and *.safetensors)")
  with open(config_path) as f:
    hf = json.load(f)
  has_saved = os.path.exists(os.path.join(hf_dir, MTP_WEIGHTS))
  if mtp == "saved" and not has_saved:
    raise CheckpointError(f"mtp='saved' but {hf_dir} has no {MTP_WEIGHTS} (written by "
                          "export_checkpoint); use 'fresh' or 'copy_last_block'")
  source = "saved" if mtp == "saved" or (mtp == "auto" and has_saved) else (
      "fresh" if mtp == "auto" else mtp)
  chain = {"num_mtp_modules": 1, "num_draft_steps": 3}
  if source == "saved":
    with open(os.path.join(hf_dir, MTP_CONFIG)) as f:
      chain.update({k: v for k, v in json.load(f).items() if k in chain})
  if num_mtp_modules is not None:
    chain["num_mtp_modules"] = num_mtp_modules
  if num_draft_steps is not None:
    chain["num_draft_steps"] = num_draft_steps
  cfg = config_from_hf(hf, dtype=dtype, **chain, **overrides)
  file_cfg = cfg  # the shapes the files hold
  if vocab_size is not None and vocab_size != cfg.vocab_size:
    if vocab_size < cfg.vocab_size:
      raise CheckpointError(f"vocab_size={vocab_size} is smaller than the checkpoint's "
                            f"{cfg.vocab_size}; a vocabulary can grow on import, not shrink")
    cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
  param_dtype = _DTYPES[cfg.param_dtype]

  graphdef, abstract = policy_lib.abstract_state(cfg)
  if mesh is not None:
    shardings = sharding.state_shardings(abstract, mesh, rules)
  else:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda v: v.replace(device), abstract,
                             is_leaf=lambda x: isinstance(x, nnx.Variable))
  tensors = _Tensors.of_model(hf_dir)
  saved = _Tensors._of_file(hf_dir, MTP_WEIGHTS) if source == "saved" else None  # pylint: disable=protected-access
  fresh = None
  if source in ("fresh", "copy_last_block"):
    fresh = {_key(p): np.asarray(v[...]) for p, v in jax.tree_util.tree_leaves_with_path(
        nnx.state(policy_lib.MTPModules(cfg, rngs=nnx.Rngs(seed))),
        is_leaf=lambda x: isinstance(x, nnx.Variable))}

  def reader(key: tuple[str, ...], shape):
    if key == ("embed",):
      name = "model.embed_tokens.weight"
    elif key == ("final_norm",):
      name = "model.norm.weight"
    elif key == ("head",):
      name = "lm_head.weight"
    elif key[0] == "layers":
      return _stacked_reader(tensors, key[1], file_cfg, list(range(cfg.num_layers)), shape)
    elif source == "saved":
      name = ".".join(key)
      w = saved.get(name)
      _check_shape(name, w.shape, shape, MTP_WEIGHTS)
      return lambda index: w[index]
    elif source == "copy_last_block" and key[:2] == ("mtp", "blocks"):
      last = [cfg.num_layers - 1] * cfg.num_mtp_modules
      return _stacked_reader(tensors, key[2], file_cfg, last, shape)
    else:
      w = fresh[key[1:]]
      return lambda index: w[index]
    w_name = name
    base = "head" if key == ("head",) else key[0]
    if base in ("embed", "head") and cfg.vocab_size != file_cfg.vocab_size:
      full = _read_block(tensors, w_name, base, file_cfg,
                         (slice(None),) * len(shape), "top-level tensor")
      axis = 0 if base == "embed" else 1  # ours: embed [V, E], head [E, V]
      extra = cfg.vocab_size - file_cfg.vocab_size
      grown = np.concatenate([full, np.repeat(full.mean(axis=axis, keepdims=True), extra,
                                              axis=axis)], axis=axis)
      return lambda index: grown[index]
    return lambda index: _read_block(tensors, w_name, base, file_cfg, index,
                                     "top-level tensor")

  def build(path, var, shard_var):
    shape = var.get_value().shape
    value = _build(shape, param_dtype, shard_var.get_value(), reader(_key(path), shape))
    return var.replace(value)

  try:
    state = jax.tree_util.tree_map_with_path(
        build, abstract, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
  finally:
    tensors.close()
    if saved is not None:
      saved.close()
  return cfg, state


# ------------------------------------------------------------------ export


def _host(x: jax.Array) -> np.ndarray:
  return np.asarray(jax.device_get(x))


def export_checkpoint(cfg: ModelConfig, state: nnx.State, out_dir: str, *,
                      max_shard_bytes: int = 5 * 2**30, tokenizer_dir: str | None = None,
                      include_mtp: bool = True) -> list[str]:
  """Writes cfg and state as a Hugging Face Qwen3ForCausalLM directory (LlamaForCausalLM
  when cfg has no q/k norms); returns its files.

  config.json and the decoder's safetensors (shards of at most `max_shard_bytes`, with
  model.safetensors.index.json when there is more than one), in Hugging Face's names and
  layouts, the format transformers, vLLM and SGLang read; the MTP modules go to
  mtp.safetensors with mtp_config.json beside them. Tensors are fetched from the devices
  one at a time, and each shard is written and released before the next is gathered. `tokenizer_dir`: copy its tokenizer files along.
  `include_mtp=False` writes the plain Qwen3 (or Llama) checkpoint only.
  """
  os.makedirs(out_dir, exist_ok=True)
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  leaves = {_key(p): v for p, v in jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))}
  value = lambda key: leaves[key].get_value()

  # (hf name, thunk producing the tensor, bytes) in Hugging Face order.
  entries: list[tuple[str, Callable[[], np.ndarray], int]] = []

  def add(name, fn, shape, dtype):
    entries.append((name, fn, math.prod(shape) * np.dtype(dtype).itemsize))

  dt = _DTYPES[cfg.param_dtype]
  add("model.embed_tokens.weight", lambda: _host(value(("embed",))),
      _hf_shape("embed", cfg), dt)
  for i in range(cfg.num_layers):
    for ours in ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm",
                 "w_gate", "w_up", "w_down"):
      if ours in ("q_norm", "k_norm") and not cfg.qk_norm:
        continue  # Llama
      add(_hf_name(i, ours), (lambda i=i, ours=ours: _to_hf(
          ours, _host(value(("layers", ours))[i]))), _hf_shape(ours, cfg), dt)
  add("model.norm.weight", lambda: _host(value(("final_norm",))), _hf_shape("final_norm", cfg),
      dt)
  if not cfg.tie_embeddings:
    add("lm_head.weight", lambda: _to_hf("head", _host(value(("head",)))),
        _hf_shape("head", cfg), dt)

  shards: list[list[tuple[str, Callable[[], np.ndarray], int]]] = [[]]
  for entry in entries:
    if shards[-1] and sum(e[2] for e in shards[-1]) + entry[2] > max_shard_bytes:
      shards.append([])
    shards[-1].append(entry)
  written = []
  names = ([SINGLE_FILE] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  weight_map = {}
  for file, shard in zip(names, shards):
    save_file({name: fn() for name, fn, _ in shard}, os.path.join(out_dir, file),
              metadata={"format": "np"})
    weight_map.update({name: file for name, _, _ in shard})
    written.append(file)
  if len(shards) > 1:
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": sum(e[2] for e in entries)},
                 "weight_map": weight_map}, f, indent=2)
    written.append(INDEX_FILE)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config_to_hf(cfg), f, indent=2)
  written.append("config.json")

  if include_mtp:
    mtp = {".".join(k): _host(v.get_value()) for k, v in leaves.items() if k[0] == "mtp"}
    save_file(mtp, os.path.join(out_dir, MTP_WEIGHTS), metadata={"format": "np"})
    with open(os.path.join(out_dir, MTP_CONFIG), "w") as f:
      json.dump({"num_mtp_modules": cfg.num_mtp_modules,
                 "num_draft_steps": cfg.num_draft_steps, "format": "bebop_jax"}, f, indent=2)
    written += [MTP_WEIGHTS, MTP_CONFIG]
  if tokenizer_dir:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
      path = os.path.join(tokenizer_dir, name)
      if os.path.exists(path):
        with open(path, "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
          dst.write(src.read())
        written.append(name)
  return written
