"""torchrun with 2 gloo ranks gives the checkpoint of 1 process (CLIP; BERT with padding and uneven shards)."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from featcal.calibration.maths.distributed import RankGroup, _sum_tensors
from featcal.calibration.maths.statistics import TaskSums
from featcal.calibration.resume.store import CREATED, KILL_ENV, default_resume_dir
from featcal.cli.main import main
from featcal.errors import CalibrationDataError
from tests.builders.distributed import max_param_diff, ranked_argv, torchrun
from tests.builders.pipeline_family import bert_family, clip_family


def test_two_gloo_ranks_match_one_process_bert_padding_uneven(tmp_path):
    fam = bert_family(tmp_path / "fam", n_texts=6)  # 3 batches per task: rank 0 runs two, rank 1 one
    assert main(ranked_argv(fam, tmp_path / "one", 6)) == 0
    proc = torchrun(ranked_argv(fam, tmp_path / "two", 6))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 of 2 (gloo backend)" in proc.stderr
    assert max_param_diff(T.BertModel, tmp_path / "one", tmp_path / "two") < 1e-5
    assert proc.stdout.count("calibrated checkpoint:") == 1  # only rank 0 reports (and writes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fam", "one", "two"]  # no resume state left


def test_two_gloo_ranks_killed_then_resumed_match_one_process_clip(tmp_path):
    fam = clip_family(tmp_path / "fam", n_images=4)
    assert main(ranked_argv(fam, tmp_path / "one", 4)) == 0
    killed = torchrun(ranked_argv(fam, tmp_path / "two", 4), **{KILL_ENV: "0"})
    assert killed.returncode != 0
    state = default_resume_dir(tmp_path / "two")
    assert {p.name for p in state.iterdir()} == {"rank-0-of-2", "rank-1-of-2", CREATED}  # CREATED: featcal made it
    resumed = torchrun(ranked_argv(fam, tmp_path / "two", 4))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "1 block(s) already calibrated" in resumed.stderr
    assert max_param_diff(T.CLIPVisionModel, tmp_path / "one", tmp_path / "two") < 1e-5
    assert not state.exists()


def test_every_rank_needs_a_batch_of_every_task():
    assert RankGroup(1, 3).shard(7, "a") == [1, 4]
    with pytest.raises(CalibrationDataError, match="task 'a' has 2 calibration batch.*3 ranks"):
        RankGroup(0, 3).shard(2, "a")


def test_statistics_flatten_in_a_canonical_order():
    s = TaskSums()
    s.add_gram("q", torch.randn(5, 3), None)
    s.add_norm("ln", torch.randn(5, 3), None)
    s.add_cross("q", torch.randn(5, 3), torch.randn(5, 3), None)
    s.add_cross_linear("q", "q")
    names = [n for n, _ in _sum_tensors(s)]
    assert names == ["grams.q.sw", "grams.q.sx", "grams.q.sxx", "cross.q.sxe", "cross.q.sxxe",
                     "norms.ln.sw", "norms.ln.sz", "norms.ln.szz"]


def test_two_gloo_ranks_one_pass_matches_one_process_and_sequential(tmp_path):
    """block_statistics sequential_one_pass under torchrun: every stage's task sums all-reduced before its solve."""
    fam = bert_family(tmp_path / "fam", n_texts=6)  # 3 batches per task: rank 0 runs two, rank 1 one
    one_pass = ["--block-statistics", "sequential_one_pass"]
    assert main(ranked_argv(fam, tmp_path / "seq", 6) + ["--block-statistics", "sequential"]) == 0
    assert main(ranked_argv(fam, tmp_path / "one", 6) + one_pass) == 0
    proc = torchrun(ranked_argv(fam, tmp_path / "two", 6) + one_pass)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_param_diff(T.BertModel, tmp_path / "one", tmp_path / "seq") == 0.0
    assert max_param_diff(T.BertModel, tmp_path / "one", tmp_path / "two") < 1e-5
