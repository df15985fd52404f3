"""Total-variation distance between two softmax distributions, streamed over the vocabulary.

    from pallas_kernels import tv_loss
    tv = tv_loss.tv_distance(draft_logits, target_logits)  # [N]; alpha = 1 - tv
"""

from pallas_kernels.tv_loss.api import IMPLEMENTATIONS, tv_distance

__all__ = ["IMPLEMENTATIONS", "tv_distance"]
