"""The global flags (cli/manners.py), read on stderr as a user sees it: --version, --no-progress on every
command, --quiet, each warning once, --threads, and `calibrate --plot`."""

from __future__ import annotations

import argparse
import logging
import re
import sys

import pytest
import torch
import yaml

import featcal
from featcal.cli import manners
from featcal.cli.main import build_parser, main
from featcal.io.process import extras
from tests.builders.data_fixtures import sentences, write_jsonl
from tests.builders.pipeline_family import llama_text_family

# a tqdm bar: "40%|####", or its elapsed-time bracket "[00:01<...", "[00:00, 3.1it/s]"; transformers' own
BAR = re.compile(r"\d+%\||\[\d+:\d\d[<,\]]|Loading weights|Writing model shards")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A tiny Llama family with tokenizers everywhere, its Task Arithmetic merge and JSONL texts per task."""
    texts = {t: sentences(4, seed=i) for i, t in enumerate(("task0", "task1"))}
    return llama_text_family(tmp_path_factory.mktemp("manners"), texts)


def _pairs(flag: str, named: dict) -> list[str]:
    return [a for n, p in named.items() for a in (flag, f"{n}={p}")]


def _merge(fam, out, *extra) -> list[str]:
    return ["merge", "--base", str(fam["base"]), *_pairs("--expert", fam["experts"]), "--out", str(out), *extra]


def _calibrate(fam, out, *extra, n: int = 4, command: str = "calibrate") -> list[str]:
    return [command, "--base", str(fam["base"]), "--merged", str(fam["merged"]), *_pairs("--expert", fam["experts"]),
            *_pairs("--calib", fam["data"]), "--out", str(out), "--num-calibration-examples", str(n),
            "--calibration-batch-size", "2", *extra]


def _run(argv: list[str], capfd) -> tuple[int, str, str]:
    capfd.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return rc, out, err


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"featcal {featcal.__version__}\n"


def test_every_command_takes_the_global_flags_before_or_after_its_name():
    parser = build_parser()
    commands = [["supported"], ["zoo", "show", "somewhere"]]
    for argv in commands:
        plain = parser.parse_args(argv)
        assert (plain.quiet, plain.verbose, plain.log_level, plain.no_progress, plain.threads) == (
            False, False, None, False, 0)
        for flags in (["--quiet", "--no-progress", "--threads", "3"], ["--log-level", "error"]):
            before, after = parser.parse_args([*flags, *argv]), parser.parse_args([*argv, *flags])
            assert vars(before) == vars(after) != vars(plain)
    # merge defines --no-progress itself: given before the command name, it is not reset by merge's parser
    argv = ["merge", "--base", "b", "--expert", "t=e", "--out", "o"]
    assert parser.parse_args(["--no-progress", *argv]).no_progress is True
    assert parser.parse_args(argv).no_progress is False
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)][0].choices
    for name, sub in subs.items():
        for flag in ("--quiet", "--verbose", "--log-level", "--no-progress", "--threads"):
            assert flag in sub._option_string_actions, (name, flag)


def test_quiet_with_verbose_is_refused_in_one_line(capfd):
    rc, _, err = _run(["-q", "supported", "--verbose"], capfd)
    assert rc == 2 and err == "featcal: error: --quiet and --verbose both set the log level: give one\n"


def test_no_progress_draws_no_bar_on_any_command(family, tmp_path, capfd):
    regmean = ["--method", "regmean", *_pairs("--calib", family["data"]), "--num-calibration-examples", "4"]
    # the check can fail: without the flag, regmean's model loads draw transformers' bars
    rc, out, err = _run(_merge(family, tmp_path / "bars", *regmean), capfd)
    assert rc == 0 and BAR.search(err), err[-2000:]

    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump({
        "merge": {"base": str(family["base"]), "experts": {t: str(p) for t, p in family["experts"].items()}},
        "calibrate": {"calibration": {t: str(p) for t, p in family["data"].items()},
                      "config": {"num_calibration_examples": 4, "calibration_batch_size": 2}},
        "out": str(tmp_path / "run-out"),
    }))
    held = write_jsonl(tmp_path / "held.jsonl", [{"text": s} for s in sentences(3, seed=9)])
    commands = {
        "merge regmean": _merge(family, tmp_path / "m1", *regmean, "--no-progress"),
        "merge (flag first)": ["--no-progress", *_merge(family, tmp_path / "m2")],
        "calibrate": _calibrate(family, tmp_path / "c1", "--no-progress"),
        "calibrate --tune": _calibrate(family, tmp_path / "c2", "--tune", "--tune-budget", "3", "--no-progress"),
        "run": ["run", str(run_file), "--no-progress"],
        "plan": _calibrate(family, tmp_path / "p", "--no-progress", command="plan"),
        "eval": ["eval", "--model", f"m={family['merged']}", "--task", f"t={held}", "--out", str(tmp_path / "e"),
                 "--no-progress"],
        "supported": ["supported", str(family["merged"]), "--no-progress"],
    }
    for name, argv in commands.items():
        rc, out, err = _run(argv, capfd)
        assert rc == 0, (name, err[-2000:])
        assert not BAR.search(err) and not BAR.search(out), (name, err[-2000:])


def test_quiet_shows_only_warnings_and_errors(family, tmp_path, capfd):
    few = {"n": 6}  # 4 texts per task: with --allow-fewer, a warning per task
    rc, _, err = _run(_calibrate(family, tmp_path / "loud", "--allow-fewer", **few), capfd)
    assert rc == 0 and "INFO " in err and BAR.search(err)  # what --quiet takes away
    rc, out, err = _run(["--quiet", *_calibrate(family, tmp_path / "quiet", "--allow-fewer", **few)], capfd)
    assert rc == 0 and "calibrated checkpoint" in out  # the command's own output stays on stdout
    lines = err.splitlines()
    assert len([line for line in lines if line.startswith("WARNING ")]) == 2, err  # one per task, each once
    assert all(line.startswith(("WARNING ", "ERROR ", "featcal: ")) for line in lines), err
    rc, _, err = _run(["--log-level", "error", *_calibrate(family, tmp_path / "errors-only", "--allow-fewer", **few)],
                      capfd)
    assert rc == 0 and "WARNING" not in err


def _namespace(**flags) -> argparse.Namespace:
    values = dict(quiet=False, verbose=False, log_level=None, no_progress=False, threads=0, command="supported")
    return argparse.Namespace(**{**values, **flags})


def test_each_warning_is_printed_once(capfd):
    from huggingface_hub.utils import logging as hub_logging

    # a library configured as huggingface_hub and datasets configure theirs: its own stderr handler, propagating
    library = logging.getLogger("somelib")
    own = logging.StreamHandler(sys.stderr)
    library.addHandler(own)
    log = logging.getLogger("featcal.test_manners")
    capfd.readouterr()
    try:
        with manners.applied(_namespace()):
            logging.getLogger("somelib.part").warning("the library says so")
            for drift in (0.25, 0.5, 0.75):  # the same check on three fits: shown once
                log.warning("drift got worse: %.3g -> %.3g (block %s)", drift, drift + 0.1, "encoder")
            log.warning("task %s holds %d examples", "a", 3)  # what a warning names is kept apart
            log.warning("task %s holds %d examples", "b", 3)
    finally:
        library.removeHandler(own)
    err = capfd.readouterr().err
    assert err.count("the library says so") == 1, err
    hub = logging.LogRecord("huggingface_hub.file_download", logging.WARNING, "", 0, "x", None, None)
    hub_logging.get_logger("huggingface_hub.file_download")  # configures huggingface_hub's own handler
    assert not manners.NotShownElsewhere().filter(hub)  # so ours leaves its records to it
    assert err.count("drift got worse") == 1 and "0.25 -> 0.35" in err
    assert "task a holds" in err and "task b holds" in err
    assert "featcal: 2 repeat(s) of the warnings above" in err
    with manners.applied(_namespace(verbose=True)):
        for drift in (0.25, 0.5):
            log.warning("drift got worse: %.3g", drift)
    assert capfd.readouterr().err.count("drift got worse") == 2  # --verbose shows every repeat


def test_threads_sets_torch_threads(family, capfd):
    before = torch.get_num_threads()
    try:
        assert _run(["supported", str(family["merged"]), "--threads", "1"], capfd)[0] == 0
        assert torch.get_num_threads() == 1
        rc, _, err = _run(["--threads", "-2", "supported"], capfd)
        assert rc == 2 and "--threads must be 0" in err
    finally:
        torch.set_num_threads(before)


def test_calibrate_plot_writes_drift_png_beside_the_checkpoint(family, tmp_path, capfd, monkeypatch):
    out = tmp_path / "plotted"
    rc, stdout, err = _run(_calibrate(family, out, "--plot", "--no-progress"), capfd)
    assert rc == 0, err
    png = (out / "drift.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    assert f"drift figure: {out / 'drift.png'}" in stdout and (out / "model.safetensors").is_file()

    monkeypatch.setattr(extras, "installed", lambda module: module != "matplotlib")
    rc, _, err = _run(_calibrate(family, tmp_path / "no-matplotlib", "--plot"), capfd)
    assert rc == 2 and len(err.splitlines()) == 1 and "pip install 'featcal[plot]'" in err
    assert not (tmp_path / "no-matplotlib").exists()  # refused before any work
