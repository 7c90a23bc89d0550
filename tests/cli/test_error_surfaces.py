"""What a failure shows (issue 53, item 7): a failed lm-eval run is one line naming the log its output went to,
not the harness's traceback in featcal's output; an output path is shown clean (`--out eval/`: eval/eval.json)."""

from __future__ import annotations

from pathlib import Path

import pytest

import featcal.evaluation.api as evaluation_api
import featcal.merging.api as merging_api
from featcal.cli.main import main
from featcal.errors import FeatCalError
from featcal.evaluation import lm_eval

FAILING_HARNESS = """import sys
print("lm-eval starting")
print("Traceback (most recent call last):\\n  File 'lm_eval/__main__.py'\\nValueError: no such task", file=sys.stderr)
sys.exit(3)
"""


def test_a_failed_harness_is_one_line_naming_its_log(tmp_path, monkeypatch, capfd):
    fake = tmp_path / "site"
    (fake / "lm_eval").mkdir(parents=True)
    (fake / "lm_eval" / "__init__.py").write_text("")
    (fake / "lm_eval" / "__main__.py").write_text(FAILING_HARNESS)
    monkeypatch.setenv("PYTHONPATH", str(fake))
    work = tmp_path / ".tmp-eval" / "lm_eval" / "merged"  # the atomic temporary folder, renamed to eval/ later
    with pytest.raises(FeatCalError) as exc:
        lm_eval.run(tmp_path / "merged", ["hellaswag"], work, batch_size=1, device=None,
                    shown=Path("eval") / "lm_eval" / "merged")
    message = str(exc.value)
    assert "\n" not in message and "Traceback" not in message
    assert "exit status 3" in message and message.endswith(str(Path("eval/lm_eval/merged/lm_eval.log")))
    log = (work / lm_eval.LOG_NAME).read_text()
    assert "lm-eval starting" in log and "ValueError: no such task" in log and "--tasks hellaswag" in log
    shown = capfd.readouterr()
    assert "Traceback" not in shown.out + shown.err and "lm-eval starting" not in shown.out


@pytest.mark.parametrize("out", ["eval/", "eval//", "eval"])
def test_eval_names_its_output_file_clean(out, monkeypatch, capsys):
    monkeypatch.setattr(evaluation_api, "evaluate", lambda *a, **k: {"results": [], "lm_eval": None})
    assert main(["eval", "--out", out, "--no-progress"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {Path('eval') / 'eval.json'}"


def test_merge_names_its_output_clean(monkeypatch, capsys):
    monkeypatch.setattr(merging_api, "merge_to", lambda request: merging_api.MergeResult({}))
    assert main(["merge", "--base", "b", "--expert", "a=x", "--out", "merged//", "--no-progress"]) == 0
    assert f"into {Path('merged')} in " in capsys.readouterr().out
