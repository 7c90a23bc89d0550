"""Label-free selection of FeatCal's hyperparameters (issue 17): `tune` in FeatCalConfig.

Why: ρ, λ, α and where the merge starts move FeatCal's result a lot, and the right values differ between
models, while a user has an unlabeled calibration set and nothing else. So each task's calibration
examples are split (seeded) into a fit part and a held-out part (split.py); each candidate setting is
calibrated on the fit part and scored on the held-out part by a criterion that needs no labels (score.py):
the final-feature drift from the experts, and, where every task has a head, first the disagreement with the
experts' predictions through it: a task head given (`heads`, `--tune-head`), or for a causal LM the model's
own LM head, whose next-token predictions on the held-out calibration windows are compared with the
expert's (tune_next_token, on by default; features.py).

The search (search.py) is a deterministic pattern search along fixed ladders, one knob at a time (the
starting merge's scaling where the merge can be rebuilt, merges.py, then ρ, λ, α), from the configured
values (the paper's by default): the first candidate IS the configured setting, so the choice never scores
worse on the held-out part. The chosen setting is then refit on ALL calibration examples by a plain
calibration (run.py), and the search recorded (record.py; result.TuningRecord).

Cross-fitting (`tune_folds` k ≥ 2; `auto`, the default, where one split would hold out ≤ 4 examples per task):
each task's examples are dealt into k folds, a candidate is calibrated k times, each time without one fold,
and every example is scored by the calibration that did not see it; the scores are pooled (combine_folds).

Reuse: the experts' held-out features and predictions are computed once for all candidates. Statistics
are not shared between candidates: past block 1 every block's statistics are taken on the chain calibrated
with the candidate's own values, so the identity that makes α free (statistics.py) holds within one block
only, and using it would change the method (a per-block choice), not reuse its work.
"""

from featcal.calibration.tuning.features import (
    NEXT_TOKEN,
    Head,
    NextToken,
    expert_reference,
    has_lm_head,
    pooled_output,
)
from featcal.calibration.tuning.heads import check_request, load_heads
from featcal.calibration.tuning.merges import TASK_VECTOR_METHODS, merge_scaling_from_report, rescale_merge
from featcal.calibration.tuning.record import CRITERION, summary_line
from featcal.calibration.tuning.run import calibrate_tuned
from featcal.calibration.tuning.score import Score, combine_folds, evidence, score
from featcal.calibration.tuning.search import (
    MAX_MERGE_SCALING,
    Setting,
    candidate_cost,
    max_candidates,
    planned_calibrations,
    resolve_fixed,
    resolve_tiebreak,
    tune_calibrations,
)
from featcal.calibration.tuning.split import (
    AUTO_SOFT_MAX_HELD,
    Split,
    folds_record,
    one_split_held_out,
    resolve_folds,
    screen_examples,
    split_calibration,
    split_folds,
)

__all__ = [
    "AUTO_SOFT_MAX_HELD", "CRITERION", "MAX_MERGE_SCALING", "NEXT_TOKEN", "TASK_VECTOR_METHODS", "Head", "NextToken",
    "Score", "Setting", "Split", "calibrate_tuned", "candidate_cost", "check_request", "combine_folds", "evidence",
    "expert_reference", "folds_record", "has_lm_head", "load_heads", "max_candidates", "merge_scaling_from_report",
    "one_split_held_out", "planned_calibrations", "pooled_output", "rescale_merge", "resolve_fixed", "resolve_folds", "resolve_tiebreak",
    "score", "screen_examples", "split_calibration", "split_folds", "summary_line", "tune_calibrations",
]
