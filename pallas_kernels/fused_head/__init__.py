"""A fused, vocabulary-chunked LM head: losses of softmax(h W) without [N, V] logits.

    from pallas_kernels import fused_head
    out = fused_head.fused_head(draft_hidden, head, target_hidden=target_hidden, tokens=tokens)
    out["tv"], out["kl"], out["ce"], out["logprob"], out["entropy"]
"""

from pallas_kernels.fused_head.api import (IMPLEMENTATIONS, cross_entropy, fused_head,
                                           kl_divergence, token_logprob_and_entropy,
                                           tv_distance)

__all__ = ["IMPLEMENTATIONS", "cross_entropy", "fused_head", "kl_divergence",
           "token_logprob_and_entropy", "tv_distance"]
