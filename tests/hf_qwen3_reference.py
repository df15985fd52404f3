"""An independent numpy forward of Hugging Face's Qwen3ForCausalLM and LlamaForCausalLM,
written from their published definitions (transformers' modeling_qwen3 and modeling_llama,
which differ only in Qwen3's per-head q/k RMSNorm), over the checkpoint's own tensor names:

  RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)
  per layer:  x = RMSNorm_in(h)
              q, k, v = x Wq^T, x Wk^T, x Wv^T, split into heads of head_dim
              (Qwen3 only) q, k = RMSNorm_q(q), RMSNorm_k(k) per head; then RoPE (rotate-half,
                     inv_freq_j = theta^(-2j/D), cos/sin of [freqs, freqs])
              grouped-query attention: query head j reads kv head j // (H / KV), causal,
                     scale 1/sqrt(D); h += attn Wo^T
              x = RMSNorm_post(h); h += (silu(x Wg^T) * x Wu^T) Wd^T
  logits = RMSNorm_final(h) W_lm^T  (W_lm = the embedding when tie_word_embeddings)

float64 throughout; nothing here is shared with bebop_jax.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np


def _rms_norm(x, w, eps):
  return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def forward(tensors: Mapping[str, np.ndarray], config: Mapping, tokens: np.ndarray
            ) -> np.ndarray:
  """Logits [T, V] of one sequence of token ids [T] (positions 0..T-1)."""
  w = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
  eps, theta = config["rms_norm_eps"], config["rope_theta"]
  heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
  d = config["head_dim"]
  t = len(tokens)
  h = w["model.embed_tokens.weight"][tokens]
  inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  freqs = np.arange(t, dtype=np.float64)[:, None] * inv_freq[None, :]
  emb = np.concatenate([freqs, freqs], axis=-1)
  cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]  # [T, 1, D]
  causal = np.tril(np.ones((t, t), bool))
  for i in range(config["num_hidden_layers"]):
    p = lambda name: w[f"model.layers.{i}.{name}.weight"]
    x = _rms_norm(h, p("input_layernorm"), eps)
    q = (x @ p("self_attn.q_proj").T).reshape(t, heads, d)
    k = (x @ p("self_attn.k_proj").T).reshape(t, kv_heads, d)
    v = (x @ p("self_attn.v_proj").T).reshape(t, kv_heads, d)
    if f"model.layers.{i}.self_attn.q_norm.weight" in w:  # Qwen3; Llama has no q/k norm
      q = _rms_norm(q, p("self_attn.q_norm"), eps)
      k = _rms_norm(k, p("self_attn.k_norm"), eps)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    group = heads // kv_heads
    k = np.repeat(k, group, axis=1)  # repeat_kv: head j -> kv head j // group
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    scores = np.where(causal[None], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    attn = np.einsum("hts,shd->thd", probs, v).reshape(t, heads * d)
    h = h + attn @ p("self_attn.o_proj").T
    x = _rms_norm(h, p("post_attention_layernorm"), eps)
    gate = x @ p("mlp.gate_proj").T
    h = h + ((gate / (1.0 + np.exp(-gate))) * (x @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
  h = _rms_norm(h, w["model.norm.weight"], eps)
  head = (w["model.embed_tokens.weight"] if config["tie_word_embeddings"]
          else w["lm_head.weight"])
  return h @ head.T
