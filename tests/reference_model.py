"""An independent float64 numpy implementation of the policy's formulas (DESIGN.md 3), one
sequence at a time with explicit loops, used as the reference in model tests."""

from __future__ import annotations

import numpy as np


def _np(tree):
  return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x, pos, theta):  # x [T, H, D], pos [T]
  d = x.shape[-1]
  freq = theta ** (-np.arange(0, d, 2) / d)
  ang = pos[:, None] * freq[None]  # [T, D/2]
  c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def block(p, x, pos, allowed, cfg):
  """x [T, E]; allowed[i, j] True if position i may attend j."""
  h = rms(x, p["attn_norm"], cfg.norm_eps)
  q = np.einsum("te,ehd->thd", h, p["wq"])
  k = np.einsum("te,ehd->thd", h, p["wk"])
  v = np.einsum("te,ehd->thd", h, p["wv"])
  if cfg.qk_norm:
    q, k = rms(q, p["q_norm"], cfg.norm_eps), rms(k, p["k_norm"], cfg.norm_eps)
  q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
  group = cfg.num_heads // cfg.num_kv_heads
  out = np.zeros_like(q)
  t = x.shape[0]
  for i in range(t):
    js = [j for j in range(t) if allowed[i, j]]
    for hd in range(cfg.num_heads):
      kv = hd // group
      s = np.array([q[i, hd] @ k[j, kv] for j in js]) / np.sqrt(cfg.head_dim)
      w = np.exp(s - s.max())
      w /= w.sum()
      out[i, hd] = sum(wj * v[j, kv] for wj, j in zip(w, js))
  x = x + np.einsum("thd,hde->te", out, p["wo"])
  h = rms(x, p["mlp_norm"], cfg.norm_eps)
  g = h @ p["w_gate"]
  return x + (g / (1 + np.exp(-g)) * (h @ p["w_up"])) @ p["w_down"]


def forward(params, cfg, tokens, segment_ids, positions, num_draft_steps):
  """One sequence. Returns logits [T, V], mask [T], mtp_logits [K, T, V], mtp_mask [K, T].

  params: {"embed", "final_norm", "head" (or None), "layers": [per-layer dict],
           "mtp": [per-module dict with hidden_norm, embed_norm, proj, block]}
  """
  t = len(tokens)
  emb = np.asarray(params["embed"], np.float64)
  head = emb.T if params["head"] is None else np.asarray(params["head"], np.float64)
  fnorm = np.asarray(params["final_norm"], np.float64)
  allowed = np.array([[j <= i and segment_ids[i] == segment_ids[j] for j in range(t)]
                      for i in range(t)])
  x = emb[tokens]
  for p in params["layers"]:
    x = block(_np(p), x, positions, allowed, cfg)
  logits = rms(x, fnorm, cfg.norm_eps) @ head

  def valid(i, k):  # x_{i+k} exists in the same non-padding segment as x_i
    return i + k < t and segment_ids[i] != 0 and segment_ids[i + k] == segment_ids[i]

  mask = np.array([valid(i, 1) for i in range(t)])
  h_prev, mtp_logits, mtp_mask = x, [], []
  for k in range(1, num_draft_steps + 1):
    m = _np(params["mtp"][min(k, len(params["mtp"])) - 1])
    shifted = [tokens[i + k] if i + k < t else 0 for i in range(t)]
    u = np.concatenate([rms(h_prev, m["hidden_norm"], cfg.norm_eps),
                        rms(emb[shifted], m["embed_norm"], cfg.norm_eps)], -1) @ m["proj"]
    blk = {n[len("block."):]: v for n, v in m.items() if n.startswith("block.")}
    h_prev = block(blk, u, positions, allowed, cfg)
    mtp_logits.append(rms(h_prev, fnorm, cfg.norm_eps) @ head)
    mtp_mask.append([valid(i, k + 1) for i in range(t)])
  return logits, mask, np.array(mtp_logits), np.array(mtp_mask)


def params_from_model(model):
  """Unstacks a Policy's parameters into the reference's per-layer / per-module dicts."""
  c = model.config
  stacked = {n: np.asarray(v) for n, v in model.layers.arrays(np.float32).items()}
  mtp_blocks = {n: np.asarray(v) for n, v in model.mtp.blocks.arrays(np.float32).items()}
  return {
      "embed": np.asarray(model.embed[...]),
      "final_norm": np.asarray(model.final_norm[...]),
      "head": None if c.tie_embeddings else np.asarray(model.head[...]),
      "layers": [{n: v[i] for n, v in stacked.items()} for i in range(c.num_layers)],
      "mtp": [{"hidden_norm": np.asarray(model.mtp.hidden_norm[...])[m],
               "embed_norm": np.asarray(model.mtp.embed_norm[...])[m],
               "proj": np.asarray(model.mtp.proj[...])[m],
               **{f"block.{n}": v[m] for n, v in mtp_blocks.items()}}
              for m in range(c.num_mtp_modules)],
  }
