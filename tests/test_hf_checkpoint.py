"""Hugging Face Qwen3 checkpoints (bebop_jax/model/hf.py): a tiny checkpoint written here
with safetensors from numpy, imported and checked against an independent numpy forward of the
Hugging Face definition (tests/hf_qwen3_reference.py), exported and re-imported bitwise,
imported sharded on 8 simulated devices, and every unsupported input rejected by name.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from bebop_jax import sharding
from bebop_jax.model import hf
from bebop_jax.model import model as policy_lib

import hf_qwen3_reference  # tests/ is on sys.path (pytest rootdir conftest)

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            rope_theta=1_000_000.0)


def hf_config(tie: bool, **extra) -> dict:
  return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
          "attention_bias": False, "use_sliding_window": False, "rope_scaling": None,
          "tie_word_embeddings": tie, "torch_dtype": "float32", **TINY, **extra}


def hf_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """Random float32 weights under Hugging Face's Qwen3 names and shapes."""
  rng = np.random.default_rng(seed)
  e, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
  h, kv, d = (config["num_attention_heads"], config["num_key_value_heads"],
              config["head_dim"])
  normal = lambda *shape: (rng.normal(size=shape) / np.sqrt(shape[-1])).astype(np.float32)
  scale = lambda n: (1.0 + 0.1 * rng.normal(size=(n,))).astype(np.float32)
  out = {"model.embed_tokens.weight": normal(v, e), "model.norm.weight": scale(e)}
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    out.update({
        p + "input_layernorm.weight": scale(e), p + "post_attention_layernorm.weight": scale(e),
        p + "self_attn.q_proj.weight": normal(h * d, e),
        p + "self_attn.k_proj.weight": normal(kv * d, e),
        p + "self_attn.v_proj.weight": normal(kv * d, e),
        p + "self_attn.o_proj.weight": normal(e, h * d),
        p + "self_attn.q_norm.weight": scale(d), p + "self_attn.k_norm.weight": scale(d),
        p + "mlp.gate_proj.weight": normal(f, e), p + "mlp.up_proj.weight": normal(f, e),
        p + "mlp.down_proj.weight": normal(e, f)})
  if not config["tie_word_embeddings"]:
    out["lm_head.weight"] = normal(v, e)
  return out


def write_checkpoint(directory, config: dict, tensors: dict[str, np.ndarray], *,
                     shards: int = 1) -> str:
  """config.json + model.safetensors, or `shards` files with model.safetensors.index.json."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  names = sorted(tensors)
  if shards == 1:
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return str(directory)
  weight_map = {}
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = names[s::shards]
    save_file({n: tensors[n] for n in part}, os.path.join(directory, file))
    weight_map.update({n: file for n in part})
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return str(directory)


def logits_of(cfg, state, tokens: np.ndarray) -> np.ndarray:
  graphdef = policy_lib.abstract_state(cfg)[0]
  t = tokens.shape[1]
  out = jax.jit(lambda s, x: nnx.merge(graphdef, s)(
      x, jnp.broadcast_to(jnp.arange(t), x.shape), jnp.ones_like(x), num_draft_steps=0)
                )(state, jnp.asarray(tokens))
  return np.asarray(out["logits"])


def flat(state) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p): np.asarray(jax.device_get(v)) for p, v in
          jax.tree_util.tree_leaves_with_path(state)}


TOKENS = np.random.default_rng(7).integers(0, TINY["vocab_size"], (2, 24), dtype=np.int32)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("shards", [1, 3], ids=["one_file", "index"])
def test_import_matches_a_numpy_forward_of_the_hf_definition(tmp_path, tie, shards):
  config = hf_config(tie)
  tensors = hf_tensors(config)
  path = write_checkpoint(tmp_path / "ckpt", config, tensors, shards=shards)
  cfg, state = hf.import_checkpoint(path, mtp="fresh", attention="dense")
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.head_dim) == (256, 32, 3, 16)
  assert cfg.tie_embeddings == tie and cfg.rope_theta == 1e6 and cfg.param_dtype == "float32"
  assert ("head" in flat(state).__repr__()) == (not tie)
  got = logits_of(cfg, state, TOKENS)
  for b in range(TOKENS.shape[0]):
    want = hf_qwen3_reference.forward(tensors, config, TOKENS[b])
    np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-5)
  # The reference is sensitive to what it checks: a wrong RoPE base changes the logits.
  other = hf_qwen3_reference.forward(tensors, {**config, "rope_theta": 10_000.0}, TOKENS[0])
  assert np.abs(other - got[0]).max() > 1e-3


def test_blockwise_attention_path_matches_too(tmp_path):
  config = hf_config(True)
  tensors = hf_tensors(config, seed=1)
  cfg, state = hf.import_checkpoint(write_checkpoint(tmp_path, config, tensors), mtp="fresh",
                                    attention="blockwise", attention_block_size=8)
  want = hf_qwen3_reference.forward(tensors, config, TOKENS[1])
  np.testing.assert_allclose(logits_of(cfg, state, TOKENS)[1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_round_trip_is_bitwise(tmp_path, tie):
  cfg0 = policy_lib.ModelConfig(**{**dict(vocab_size=256, d_model=32, num_layers=3,
                                          num_heads=4, num_kv_heads=2, head_dim=16,
                                          mlp_dim=48, tie_embeddings=tie),
                                   "num_mtp_modules": 2, "num_draft_steps": 3})
  state0 = nnx.state(policy_lib.Policy(cfg0, rngs=nnx.Rngs(3)))
  out = tmp_path / "export"
  files = hf.export_checkpoint(cfg0, state0, str(out), max_shard_bytes=40_000)
  assert "model.safetensors.index.json" in files and "mtp.safetensors" in files
  assert sum(f.startswith("model-") for f in files) > 1
  cfg1, state1 = hf.import_checkpoint(str(out))  # mtp="auto": the saved modules
  assert (cfg1.num_mtp_modules, cfg1.num_draft_steps) == (2, 3)
  for field in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "mlp_dim", "rope_theta", "tie_embeddings", "norm_eps",
                "param_dtype"):
    assert getattr(cfg1, field) == getattr(cfg0, field), field
  a, b = flat(state0), flat(state1)
  assert a.keys() == b.keys()
  for name in a:
    assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name

  # What was written is Hugging Face's layout: the numpy forward reads it directly.
  with open(out / "config.json") as f:
    config = json.load(f)
  with open(out / "model.safetensors.index.json") as f:
    weight_map = json.load(f)["weight_map"]
  tensors = {}
  for name, file in weight_map.items():
    with safe_open(str(out / file), framework="numpy") as f:
      tensors[name] = f.get_tensor(name)
  assert ("lm_head.weight" in tensors) == (not tie)
  want = hf_qwen3_reference.forward(tensors, config, TOKENS[0])
  np.testing.assert_allclose(logits_of(cfg1, state1, TOKENS)[0], want, rtol=1e-5, atol=1e-5)


def test_import_then_export_rewrites_the_same_tensors(tmp_path):
  config = hf_config(False)
  tensors = hf_tensors(config, seed=2)
  cfg, state = hf.import_checkpoint(write_checkpoint(tmp_path / "in", config, tensors),
                                    mtp="fresh")
  hf.export_checkpoint(cfg, state, str(tmp_path / "out"))
  with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as f:
    assert set(f.keys()) == set(tensors)
    for name in tensors:
      assert np.array_equal(f.get_tensor(name), tensors[name]), name


def llama_config(tie: bool) -> dict:
  return {**hf_config(tie), "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def llama_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """Random weights under Llama's names: Qwen3's without the per-head q/k norms."""
  return {k: v for k, v in hf_tensors(config, seed).items()
          if not k.endswith(("q_norm.weight", "k_norm.weight"))}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_llama_import_matches_a_numpy_forward_and_exports_back(tmp_path, tie):
  config = llama_config(tie)
  tensors = llama_tensors(config, seed=3)
  cfg, state = hf.import_checkpoint(write_checkpoint(tmp_path / "in", config, tensors),
                                    mtp="fresh", attention="dense")
  assert not cfg.qk_norm and "q_norm" not in repr(flat(state))
  got = logits_of(cfg, state, TOKENS)
  for b in range(TOKENS.shape[0]):
    np.testing.assert_allclose(got[b], hf_qwen3_reference.forward(tensors, config, TOKENS[b]),
                               rtol=1e-5, atol=1e-5)
  hf.export_checkpoint(cfg, state, str(tmp_path / "out"))
  written = json.load(open(tmp_path / "out" / "config.json"))
  assert (written["architectures"], written["model_type"]) == (["LlamaForCausalLM"], "llama")
  with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as f:
    assert set(f.keys()) == set(tensors)
    for name in tensors:
      assert np.array_equal(f.get_tensor(name), tensors[name]), name
  # A Qwen3 config.json over Llama tensors names the missing norm.
  qwen = write_checkpoint(tmp_path / "qwen", hf_config(tie), tensors)
  with pytest.raises(hf.CheckpointError, match=r"self_attn\.[qk]_norm\.weight.* is missing"):
    hf.import_checkpoint(qwen, mtp="fresh")


def test_bfloat16_checkpoint_imports_in_bfloat16(tmp_path):
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  config = hf_config(True, torch_dtype="bfloat16")
  tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_tensors(config).items()}
  cfg, state = hf.import_checkpoint(write_checkpoint(tmp_path, config, tensors), mtp="fresh")
  assert cfg.param_dtype == cfg.dtype == "bfloat16"
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state))
  embed = np.asarray(jax.device_get(state["embed"][...]))
  assert np.array_equal(embed, tensors["model.embed_tokens.weight"])


def test_mtp_modes(tmp_path):
  config = hf_config(True)
  tensors = hf_tensors(config)
  path = write_checkpoint(tmp_path, config, tensors)
  cfg, copied = hf.import_checkpoint(path, mtp="copy_last_block", num_mtp_modules=2,
                                     num_draft_steps=4)
  assert (cfg.num_mtp_modules, cfg.num_draft_steps) == (2, 4)
  last = cfg.num_layers - 1
  for name in ("wq", "wo", "w_down", "attn_norm", "q_norm"):
    layer = np.asarray(copied["layers"][name][...][last])
    for m in range(2):
      assert np.array_equal(np.asarray(copied["mtp"]["blocks"][name][...][m]), layer), name
  _, fresh_a = hf.import_checkpoint(path, mtp="fresh", seed=5)
  _, fresh_b = hf.import_checkpoint(path, mtp="fresh", seed=5)
  _, fresh_c = hf.import_checkpoint(path, mtp="fresh", seed=6)
  proj = lambda s: np.asarray(s["mtp"]["proj"][...])
  assert np.array_equal(proj(fresh_a), proj(fresh_b))
  assert not np.array_equal(proj(fresh_a), proj(fresh_c))
  with pytest.raises(hf.CheckpointError, match="mtp='saved' but .* has no mtp.safetensors"):
    hf.import_checkpoint(path, mtp="saved")
  with pytest.raises(hf.CheckpointError, match="mtp='none' is not allowed: one of"):
    hf.import_checkpoint(path, mtp="none")


def test_sharded_import_on_8_devices_gives_the_same_logits(tmp_path):
  config = hf_config(False, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
  tensors = hf_tensors(config, seed=4)
  path = write_checkpoint(tmp_path, config, tensors, shards=2)
  cfg, ref_state = hf.import_checkpoint(path, mtp="fresh")
  want = logits_of(cfg, ref_state, TOKENS)
  mesh = sharding.make_mesh((2, 4), ("fsdp", "tensor"))
  cfg, state = hf.import_checkpoint(path, mtp="fresh", mesh=mesh)
  expected = sharding.state_shardings(policy_lib.abstract_state(cfg)[1], mesh,
                                      sharding.DEFAULT_RULES)
  for (path_, got), (_, sh) in zip(
      jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)),
      jax.tree_util.tree_leaves_with_path(expected,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable))):
    assert got[...].sharding == sh.get_value(), jax.tree_util.keystr(path_)
  assert not state["embed"][...].sharding.is_fully_replicated
  assert len(state["layers"]["wq"][...].addressable_shards) == 8
  for k, v in flat(state).items():
    assert np.array_equal(v, flat(ref_state)[k]), k
  with sharding.use_mesh(mesh, sharding.DEFAULT_RULES):
    got = logits_of(cfg, state, TOKENS)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,message", [
    (dict(architectures=["Qwen3MoeForCausalLM"]), r"architecture \['Qwen3MoeForCausalLM'\] "
     r"is not supported: only Qwen3ForCausalLM"),
    (dict(architectures=["MistralForCausalLM"]),
     "MistralForCausalLM.*only Qwen3ForCausalLM or LlamaForCausalLM"),
    (dict(architectures=["LlamaForCausalLM"], model_type="llama",
          rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope scaling"),
    (dict(num_experts=8), r"mixture-of-experts \(num_experts=8\)"),
    (dict(use_sliding_window=True, sliding_window=4096), "sliding-window attention"),
    (dict(layer_types=["full_attention", "sliding_attention", "full_attention"]),
     r"layer_types \['sliding_attention'\]"),
    (dict(attention_bias=True), r"attention bias \(attention_bias=True\)"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope scaling"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_unsupported_architectures_and_fields_are_named(tmp_path, change, message):
  config = hf_config(True)
  path = write_checkpoint(tmp_path, {**config, **change}, hf_tensors(config))
  with pytest.raises(hf.CheckpointError, match=message):
    hf.import_checkpoint(path, mtp="fresh")


def test_missing_or_misshapen_tensors_and_files_are_named(tmp_path):
  config = hf_config(True)
  tensors = hf_tensors(config)
  missing = {k: v for k, v in tensors.items() if "layers.2.mlp.up_proj" not in k}
  with pytest.raises(hf.CheckpointError, match="model.layers.2.mlp.up_proj.weight.*missing"):
    hf.import_checkpoint(write_checkpoint(tmp_path / "a", config, missing), mtp="fresh")
  other = hf_config(True, intermediate_size=40)  # the config of another model shape
  with pytest.raises(hf.CheckpointError, match=r"mlp\.\w+_proj\.weight has shape \((48, 32|32, "
                     r"48)\) but config.json implies \((40, 32|32, 40)\)"):
    hf.import_checkpoint(write_checkpoint(tmp_path / "b", other, tensors), mtp="fresh")
  with pytest.raises(hf.CheckpointError, match="has no config.json"):
    hf.import_checkpoint(str(tmp_path / "nowhere"))
  os.makedirs(tmp_path / "c")
  with open(tmp_path / "c" / "config.json", "w") as f:
    json.dump(config, f)
  with pytest.raises(hf.CheckpointError, match="neither model.safetensors nor"):
    hf.import_checkpoint(str(tmp_path / "c"), mtp="fresh")


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_the_vocabulary_grows_by_mean_rows_and_keeps_the_old_logits(tmp_path, tie):
  """A tokenizer that adds tokens (the task markers) grows the embedding on import: each new
  row is the mean of the old ones, so the old tokens' logits are unchanged and a new token's
  logit is the mean of the old logits (probability at most 1 / the old vocab size)."""
  config = llama_config(tie)
  path = write_checkpoint(tmp_path, config, llama_tensors(config, seed=5))
  v = config["vocab_size"]
  cfg0, state0 = hf.import_checkpoint(path, mtp="fresh", attention="dense")
  cfg, state = hf.import_checkpoint(path, mtp="fresh", attention="dense", vocab_size=v + 24)
  assert cfg.vocab_size == v + 24
  emb = np.asarray(state["embed"][...])
  np.testing.assert_array_equal(emb[:v], np.asarray(state0["embed"][...]))
  np.testing.assert_allclose(emb[v:], np.broadcast_to(emb[:v].mean(0), emb[v:].shape),
                             rtol=1e-6)
  old, new = logits_of(cfg0, state0, TOKENS), logits_of(cfg, state, TOKENS)
  np.testing.assert_allclose(new[..., :v], old, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new[..., v:], np.broadcast_to(
      old.mean(-1, keepdims=True), new[..., v:].shape), rtol=1e-4, atol=1e-4)
  probs = jax.nn.softmax(new, axis=-1)
  assert float(probs[..., v:].max()) <= 1.0 / v
  with pytest.raises(hf.CheckpointError, match="smaller than the checkpoint's"):
    hf.import_checkpoint(path, mtp="fresh", vocab_size=v - 1)
