"""What the exact method must compute, counted: why its cost cannot approach the forward floor.

The bench times calibration against a floor of one forward pass of the merged model and one of each
expert over the calibration data. The method as specified (docs/method.md §3) does more than that per block and
token, whatever the implementation: it runs the expert block once, the merged block twice (as merged,
to record the modules' inputs, then calibrated, to propagate), and accumulates, per distinct module
input, its Gram xs·xsᵀ and a cross moment with the expert side. featcal's statistics (see
calibration/maths/statistics.py and blocks/grams.py) take each Gram's block-upper triangle only
(`gram_chunks`) and each cross moment in the cheaper of its two exact forms: in×in (xs·xeᵀ, then ·Wtᵀ)
or in×out (xs·yeᵀ from the expert's output) — fc2's is in×out. Counting multiply-accumulates of a
pre-norm transformer block gives the ratio below (ViT-B/32 size: about 2.2×; the plain count, full
Grams and in×in cross moments everywhere, was 3.06×). It counts arithmetic, not time: large Gram
products run at a higher rate than a forward's many small operations, so a measured ratio can sit
below it, but never below 1 (one forward of each model is the floor of any implementation).

The same count for any family, from the block's own Linears, with the whole run's forwards, folds and solves:
calibration/planning/cost.py (`run_counts`); `run_macs` here sums it for a benchmark's run.
"""

from __future__ import annotations

from dataclasses import dataclass

from featcal.calibration.planning.cost import gram_macs


@dataclass(frozen=True)
class BlockMacs:
    """Multiply-accumulates per token of one block (attention over `tokens` positions)."""

    forward: int  # q, k, v, out projections, fc1, fc2, and the two attention products
    statistics: int  # Grams and cross moments of each distinct module input (q/k/v share theirs)

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


def block_macs(hidden: int, intermediate: int, tokens: int, *, symmetric: bool = True,
               cheaper_cross: bool = True) -> BlockMacs:
    """Counts for a CLIP/ViT/BERT-style block: inputs of width `hidden` feed q/k/v (one shared input),
    the out projection and fc1; fc2's input has width `intermediate`.

    symmetric / cheaper_cross False: full Grams and in×in cross moments (the plain count)."""
    d, m, n = hidden, intermediate, tokens
    forward = 4 * d * d + 2 * d * m + 2 * n * d
    grams = 3 * gram_macs(d, symmetric) + gram_macs(m, symmetric)
    # (input width, summed output width) of each distinct input: q/k/v, out, fc1, fc2
    groups = ((d, 3 * d), (d, d), (d, m), (m, d))
    cross = sum(min(i * i, i * o) if cheaper_cross else i * i for i, o in groups)
    return BlockMacs(forward=forward, statistics=grams + cross)


def arithmetic_cost_ratio(model_config, tokens: int | None = None) -> float:
    """Multiply-accumulates of the exact method / those of the forward floor: a CLIP vision config
    (tokens from its image and patch size), or any encoder config with `tokens` per example given."""
    if tokens is None:
        tokens = (model_config.image_size // model_config.patch_size) ** 2 + 1
    intermediate = getattr(model_config, "intermediate_size", None)  # DINOv2 gives mlp_ratio instead
    if intermediate is None:
        intermediate = model_config.hidden_size * model_config.mlp_ratio
    return block_macs(model_config.hidden_size, intermediate, tokens).ratio


def run_macs(shape, *, tasks: int, config) -> dict[str, int]:
    """Multiply-accumulates of a whole calibration (`shape`: planner.ModelShape; calibration/planning/cost.py's counts
    summed over blocks): the floor (one merged and one expert forward over every token), the forwards the method
    runs, its float32 statistics, its float64 folds and solves."""
    from featcal.calibration.planning.cost import run_counts, token_macs

    blocks = run_counts(shape, tasks=tasks, config=config)
    floor = sum(2 * token_macs(b, s.tokens, s.hidden)[0] * tasks * config.num_calibration_examples * s.tokens
                for s in shape.stacks for b in s.blocks)
    return {"floor": floor, "forwards": sum(b.forward_macs for b in blocks),
            "statistics": sum(b.statistics_macs for b in blocks), "fold": sum(b.fold_macs for b in blocks),
            "solves": sum(b.solve_macs for b in blocks)}
