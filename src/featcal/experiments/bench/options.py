"""`featcal bench`'s options as a schema: its flags are generated from it (cli/flags.py) and it turns them into
the run's BenchSettings. Lists are comma-separated strings, parsed (with their own one-line errors) when the
settings are made; the FeatCal options of the benched calibrations are FeatCalConfig's defaults."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from featcal.config import StrictModel
from featcal.errors import ConfigError
from featcal.experiments.bench.rows import DEFAULT_SIZE, DEMO_SIZE


class BenchOptions(StrictModel):
    """What `featcal bench` is told besides where it writes (--out)."""

    concern: ClassVar[str] = "bench options"

    preset: str = Field("default", description="the zoo preset to bench on")
    seed: int = Field(0, description="the zoo's and the bench's seed")
    rows: Literal["full", "demo"] = Field(
        "full", description="which rows: full (every merge alone and + FeatCal at every size and variant) or demo "
        "(base, experts, task_arithmetic and wudi alone, TA + FeatCal reference and tuned, the best merge + FeatCal, "
        f"at one size, default {DEMO_SIZE}/task; `make demo`, docs/bench-text.md)",
    )
    calib_sizes: str | None = Field(
        None, description="calibration examples per task, comma-separated for a sweep (default: 256, or the preset's "
        f"pool; {DEMO_SIZE} with --rows demo)", json_schema_extra={"metavar": "N,M"},
    )
    methods: str | None = Field(
        None, description="merge methods, each alone and + FeatCal, comma-separated, from the method table's benched "
        "ones (default: the preset's; vision presets average,task_arithmetic,ties; text all but DARE)",
    )
    featcal_variants: str = Field(
        "reference", description="FeatCal variants, each a calibrated row per merge and size, comma-separated, from "
        "reference (the paper's method), joint_bias (bias_solve joint), final_norm (calibrate_final_norm), stem_norm "
        "(calibrate_stem_norm), sequential (block_statistics sequential), sequential_one_pass (the same solution, one "
        "forward per batch and side), tuned (--tune with its defaults, scored through the zoo's heads), tuned_soft "
        "(--tune --tune-tiebreak soft), tuned_auto (--tune --tune-tiebreak auto), blockwise (--tune --tune-scope block: ρ and λ "
        "chosen per block in one calibration), fixed_lambda (with a tuned one: "
        "--tune-fixed lambda_ratio), scaling_only (with a tuned one: only the merge's scaling searched), cross_fit (with a tuned one: --tune-folds 2), one_split (with a tuned one: "
        "--tune-folds 1), screened (with a tuned one: --tune-screen auto, candidates screened on 32 examples per task, the best confirmed), screened16 (--tune-screen 16), unconfirmed (with a screened one: --tune-confirm 0); join several with '+' (tuned+sequential_one_pass) (docs/variants.md)",
    )
    baselines: str = Field(
        "", description="comparison baselines, comma-separated, from surgery, probsurgery and the whole-model merges "
        "(regmean, regmean++, wudi), or 'all' (default: none)",
    )
    surgery_steps: int | None = Field(
        None, description="Adam steps per task of surgery and probsurgery (default: the authors' 500)"
    )
    surgery_features: Literal["recomputed", "cached"] = Field(
        "recomputed", description="surgery and probsurgery: run the frozen merged model and experts every step, the "
        "authors' procedure and cost (recomputed), or compute their features once: the same trained modules to "
        "round-off in a fraction of the time, for accuracy figures (cached)",
    )
    wudi_steps: int | None = Field(
        None, description="Adam steps per Linear of WUDI, as a benched merge, in the regime line and as a baseline "
        "(default: the preset's; 300, the authors', for the vision presets, 100 for text)",
    )
    sources: str | None = Field(
        None, description="text presets: folder of the downloaded data archives (default $FEATCAL_TEXT_SOURCES or "
        "zoo-cache/sources; `featcal zoo fetch-text` fills it)", json_schema_extra={"metavar": "DIR"},
    )
    zoo_dir: str | None = Field(None, description="zoo cache directory (default zoo-cache/<preset>-seed<seed>)",
                                json_schema_extra={"metavar": "DIR"})
    base_cache: str = Field("zoo-cache/pretrained", description="cache of pretrained bases used when the zoo is "
                            "built ('' to disable)", json_schema_extra={"metavar": "DIR"})
    overwrite: bool = Field(False, description="replace an existing output directory (one bench wrote)")
    rebuild_zoo: bool = Field(False, description="rebuild the zoo cache if it was built from another preset, seed "
                              "or zoo version (a matching cache is always reused)")
    threads: int = Field(0, description="torch CPU threads (0: torch's default)")

    def sizes(self, pool: int) -> tuple[int, ...]:
        """--calib-sizes as integers, in order, each once (default: 256, or the preset's whole pool; the demo's
        rows: DEMO_SIZE)."""
        if not self.calib_sizes:
            return (min(DEMO_SIZE if self.rows == "demo" else DEFAULT_SIZE, pool),)
        try:
            sizes = tuple(int(s) for s in self.calib_sizes.split(",") if s.strip())
        except ValueError:
            raise ConfigError(f"--calib-sizes must be comma-separated integers, not {self.calib_sizes!r}") from None
        return tuple(dict.fromkeys(sizes))

    def method_list(self) -> tuple[str, ...] | None:
        return None if self.methods is None else tuple(m.strip() for m in self.methods.split(",") if m.strip())

    def variant_list(self) -> tuple[str, ...]:
        return tuple(v.strip() for v in self.featcal_variants.split(",") if v.strip())

    def path(self, value: str | None) -> Path | None:
        return Path(value) if value else None
