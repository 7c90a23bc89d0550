"""What the exact method must compute, counted: why its cost cannot approach the forward floor.

The bench times calibration against a floor of one forward pass of the merged model and one of each
expert over the calibration data. The method as specified (SPEC §2) does more than that per block and
token, whatever the implementation: it runs the expert block once, the merged block twice (as merged,
to record the modules' inputs, then calibrated, to propagate), and accumulates two Gram products per
distinct module input (xs·xsᵀ and xs·xeᵀ). Counting multiply-accumulates of a pre-norm transformer
block gives the ratio below. It counts arithmetic, not time: large Gram products run at a higher
rate than a forward's many small operations, so measured ratios can sit below it; but the statistics
alone are about 1.56× the floor's arithmetic for any width (fc2's input Gram dominates), which is why
a time ratio near 1 is out of reach for the exact method.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockMacs:
    """Multiply-accumulates per token of one block (attention over `tokens` positions)."""

    forward: int  # q, k, v, out projections, fc1, fc2, and the two attention products
    statistics: int  # xs·xsᵀ and xs·xeᵀ for each distinct module input (q/k/v share theirs)

    @property
    def floor(self) -> int:
        """One merged and one expert forward of the block."""
        return 2 * self.forward

    @property
    def exact_method(self) -> int:
        """Expert forward, merged forward as merged, merged forward calibrated, and the statistics."""
        return 3 * self.forward + self.statistics

    @property
    def ratio(self) -> float:
        return self.exact_method / self.floor


def block_macs(hidden: int, intermediate: int, tokens: int) -> BlockMacs:
    """Counts for a CLIP/ViT/BERT-style block: inputs of width `hidden` feed q/k/v (one shared input),
    the out projection and fc1; fc2's input has width `intermediate`."""
    d, m, n = hidden, intermediate, tokens
    forward = 4 * d * d + 2 * d * m + 2 * n * d
    statistics = 2 * (3 * d * d + m * m)
    return BlockMacs(forward=forward, statistics=statistics)


def arithmetic_cost_ratio(model_config, tokens: int | None = None) -> float:
    """Multiply-accumulates of the exact method / those of the forward floor: a CLIP vision config
    (tokens from its image and patch size), or any encoder config with `tokens` per example given."""
    if tokens is None:
        tokens = (model_config.image_size // model_config.patch_size) ** 2 + 1
    intermediate = getattr(model_config, "intermediate_size", None)  # DINOv2 gives mlp_ratio instead
    if intermediate is None:
        intermediate = model_config.hidden_size * model_config.mlp_ratio
    return block_macs(model_config.hidden_size, intermediate, tokens).ratio
