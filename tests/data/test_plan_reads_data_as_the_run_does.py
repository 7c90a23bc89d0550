"""`featcal plan` makes the data checks `featcal calibrate` makes (issue 49): the conversations the run draws are
rendered with the chat template and tokenised at check time, so a template that raises on one of them
("roles must alternate") is refused by plan, and by calibrate before any work, in the same one line."""

from __future__ import annotations

import pytest

from featcal.calibration.front import pipeline
from tests.builders.data_fixtures import conversations, save_chat_tokenizer, write_jsonl
from tests.builders.guarantees import calibrate_argv, cli, one_line_error, plan_argv
from tests.builders.pipeline_family import llama_family

pytestmark = pytest.mark.usefixtures("one_thread")

# a Llama-2-style template: turns must alternate user / assistant, else raise_exception
STRICT = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
          "<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}")


@pytest.fixture(scope="module")
def strict_family(tmp_path_factory):
    """A Llama family whose merge's tokenizer has STRICT; each task's data holds 20 alternating chats and, as
    its last record, one with two assistant turns in a row."""
    root = tmp_path_factory.mktemp("strict")
    fam = llama_family(root)
    save_chat_tokenizer(fam["merged"], template=STRICT)
    good = [c[1:] if c[0]["role"] == "system" else c for c in conversations(20)]
    bad = good[0] + [{"role": "assistant", "content": "w2 w3"}]
    data = {t: write_jsonl(root / f"{t}.jsonl", [{"messages": c} for c in [*good, bad]]) for t in fam["experts"]}
    return {**fam, "data": data}


FLAGS = ("--num-calibration-examples", "21", "--calibration-batch-size", "4")  # every record drawn


def test_plan_refuses_a_chat_template_that_raises_on_a_drawn_record_as_calibrate_does(strict_family, tmp_path,
                                                                                    capsys, monkeypatch):
    out = tmp_path / "out"
    rc, printed, err = cli(plan_argv(strict_family, out, calib_flags=FLAGS), capsys)
    assert rc == 2, printed
    line = one_line_error(err)
    assert "task 'task0'" in line and "roles must alternate" in line and "the chat template" in line, line
    assert not out.exists() and "peak memory" not in printed

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr(pipeline, "load_model", boom)
    rc, _, err = cli(calibrate_argv(strict_family, out, calib_flags=FLAGS), capsys)
    assert rc == 2 and one_line_error(err) == line
    assert not out.exists()


def test_plan_passes_when_the_run_draws_no_record_the_template_refuses(strict_family, tmp_path, capsys):
    """Only what the run would read is rendered: a sample without the bad record plans as it runs."""
    from featcal.data import sample_indices

    n = next(k for k in range(1, 21) if 20 not in sample_indices(21, k, 0))
    assert n >= 1
    rc, printed, err = cli(plan_argv(strict_family, tmp_path / "out",
                                     calib_flags=("--num-calibration-examples", str(n))), capsys)
    assert rc == 0, err
    assert "peak memory" in printed


@pytest.mark.parametrize(("command", "extra", "error"), [
    ("plan", ("--tune", "--tune-head", "task0={bad}"), "head of task 'task0': cannot read"),
    ("calibrate", ("--dry-run", "--tune", "--tune-head", "task0={bad}"), "head of task 'task0': cannot read"),
    ("calibrate", ("--dry-run", "--hub-id", "nosuch=org/x"), "'nosuch' is neither 'base' nor an expert's name"),
])  # each printed a plan (rc 0) that the run then refused
def test_a_plan_refuses_the_head_files_and_hub_ids_the_run_refuses(bert, tmp_path, capsys, command, extra, error):
    bad = tmp_path / "head.safetensors"
    bad.write_text("no safetensors")
    argv = calibrate_argv(bert, tmp_path / "out", *(e.format(bad=bad) for e in extra), command=command)
    rc, printed, err = cli(argv, capsys)
    assert rc == 2, printed
    assert error in one_line_error(err) and "peak memory" not in printed
