r"""Writes a tiny Hugging Face Qwen3 checkpoint made here: nothing is downloaded.

  python -m experiments.make_tiny_qwen3 --out=runs/tiny_qwen3
  python -m bebop_jax.main --config=configs/qwen3_hf.py:runs/tiny_qwen3 --workdir=runs/hf_tiny

The directory holds what a released checkpoint holds: config.json (Qwen3ForCausalLM),
model.safetensors with random weights (bebop_jax's initialisation, exported by
`hf.export_checkpoint` without MTP modules), and a byte-level BPE tokenizer.json trained
with the `tokenizers` package on the synthetic tasks' text, in Qwen3's style (NFC
normalizer, Qwen's split regex, its own <|endoftext|> / <|im_start|> / <|im_end|> special
tokens). The task markers are not in it: bebop_jax's tokenizer adds them on load, as it does
for a real Qwen3 tokenizer.json.
"""

from __future__ import annotations

import os

from absl import app, flags
from flax import nnx

# Qwen2/Qwen3's pre-tokenizer regex.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def task_texts(num_per_task: int, seed: int = 0) -> list[str]:
  """bos prompt demonstration eos of each task, as the SFT pipeline writes them."""
  from bebop_jax import tasks  # pylint: disable=g-import-not-at-top
  from bebop_jax.tasks import base  # pylint: disable=g-import-not-at-top
  out = []
  for name in tasks.TASK_NAMES:
    task = tasks.get_task(name)
    for i in range(num_per_task):
      ex = task.sample(seed + i)
      out.append(base.BOS_MARKER + ex.prompt + ex.demonstration + base.EOS_MARKER)
  return out


def train_tokenizer(out_dir: str, *, vocab_size: int = 600, num_texts: int = 300) -> str:
  """A Qwen3-style byte-level BPE tokenizer.json trained on task text; returns its path."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(task_texts(num_texts // 3), trainer)
  tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "tokenizer.json")
  tok.save(path)
  return path


def make_checkpoint(out_dir: str, *, tie_embeddings: bool = True, seed: int = 0,
                    **model: int) -> str:
  """tokenizer.json, then config.json + model.safetensors of a random Qwen3 whose vocabulary
  fits that tokenizer with the markers added. `model`: ModelConfig shape fields."""
  from bebop_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from bebop_jax.model import hf  # pylint: disable=g-import-not-at-top
  from bebop_jax.model import model as policy_lib  # pylint: disable=g-import-not-at-top
  path = train_tokenizer(out_dir)
  vocab = tokenizer_lib.HFTokenizer(path).vocab_size
  shape = dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
               mlp_dim=128, rope_theta=1_000_000.0)
  cfg = policy_lib.ModelConfig(vocab_size=vocab, tie_embeddings=tie_embeddings,
                               **{**shape, **model})
  state = nnx.state(policy_lib.Policy(cfg, rngs=nnx.Rngs(seed)))
  hf.export_checkpoint(cfg, state, out_dir, include_mtp=False)
  return out_dir


_OUT = flags.DEFINE_string("out", "runs/tiny_qwen3", "Checkpoint directory to write.")
_UNTIED = flags.DEFINE_bool("untied", False, "A separate lm_head (default: tied).")


def main(argv):
  del argv
  out = make_checkpoint(_OUT.value, tie_embeddings=not _UNTIED.value)
  print(f"wrote {sorted(os.listdir(out))} to {out}")


if __name__ == "__main__":
  app.run(main)
