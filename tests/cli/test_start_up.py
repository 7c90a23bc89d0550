"""Start-up and argparse's errors (issue 53, items 5 and 7): `featcal --version` and `--help` import neither
torch nor transformers (they took 4.6 s), a sub-command's --help imports what that command needs and no other
command's module, and an argparse error is two lines (the command's usage in short, then the error), not the
command's 24 to 39 lines of usage. `featcal supported` refuses a folder without a config.json or an unknown
name without torch; its other answers need torch (transformers 5's config classes import it where it is installed,
and the structure is checked on a model built on the meta device)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from featcal.cli.commands import COMMANDS, HELP
from featcal.cli.main import build_parser, chosen_command, main

PROBE = """
import contextlib, io, sys
from featcal.cli.main import main
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        main({argv!r})
except SystemExit as exc:
    assert exc.code == 0, exc.code
heavy = sorted(m for m in ("torch", "transformers", "featcal.config") if m in sys.modules)
commands = sorted(m for m in sys.modules if m.startswith("featcal.cli.") and m.endswith("_cmd"))
print(heavy, commands)
print(out.getvalue())
"""


def _probe(argv: list[str]) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True,
                          timeout=120, check=True)
    first, _, rest = done.stdout.partition("\n")
    return first, rest


@pytest.mark.parametrize("argv", [["--version"], ["--help"]])
def test_version_and_help_import_no_torch_nor_any_command_module(argv):
    imported, shown = _probe(argv)
    assert imported == "[] []", imported  # nothing heavy, no command module
    if argv == ["--help"]:
        for name in COMMANDS:  # every command listed with its one line
            assert name in shown and HELP[name].split()[0] in shown


@pytest.mark.parametrize("command", ["calibrate", "merge", "run", "plan", "supported", "eval"])
def test_a_commands_help_imports_its_own_module_and_no_torch(command):
    imported, shown = _probe([command, "--help"])
    heavy, commands = imported.split("] ")
    assert "torch" not in heavy and "transformers" not in heavy, imported
    assert commands == f"['featcal.cli.{command}_cmd']", imported
    assert f"featcal {command}" in shown


def test_supported_refuses_a_folder_without_config_and_an_unknown_name_without_torch(tmp_path):
    # the two refusals given before any config is read; every other answer needs torch (blocks/catalog.py:
    # transformers 5's config classes import it, and the check builds the model on the meta device)
    for name, why in ((str(tmp_path), "has no config.json"), ("nosuchtype", "nor a transformers model type")):
        imported, shown = _probe(["supported", name])
        heavy, commands = imported.split("] ")
        assert "torch" not in heavy and "featcal.config" not in heavy, imported
        assert commands == "['featcal.cli.supported_cmd']", imported
        assert shown.startswith(f"{name}: NOT SUPPORTED: ") and why in shown, shown


def test_supported_on_a_checkpoint_folder_prints_its_blocks(tmp_path):
    from transformers import LlamaConfig

    folder = tmp_path / "llama"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256).save_pretrained(folder)
    imported, shown = _probe(["supported", str(folder)])
    assert "featcal.config" not in imported, imported  # calibrate's flags and schemas: not for this command
    assert shown == (
        f"{folder}: supported (LlamaModel)\n"
        "  decoder: 2 × LlamaDecoderLayer at layers (entry (the model); one layer type)\n"
        "    calibrated per block: 7 Linear, 2 rmsnorm\n"
        "    kept merged: nothing\n\n"
    ), shown


def test_the_command_is_found_on_the_line():
    assert chosen_command(["--quiet", "--log-level", "info", "calibrate", "--expert", "run=x"]) == "calibrate"
    assert chosen_command(["--version"]) is None
    # the parser main uses builds that command alone in full, the others by name: the same parse
    full = build_parser().parse_args(["merge", "--base", "b", "--expert", "a=x", "--out", "o"])
    one = build_parser("merge").parse_args(["merge", "--base", "b", "--expert", "a=x", "--out", "o"])
    assert vars(full) == vars(one)


@pytest.mark.parametrize(("argv", "usage", "error"), [
    (["calibrate", "--base", "b"], "usage: featcal calibrate [options]",
     "the following arguments are required: --merged, --expert, --calib, --out"),
    (["calibrate", "--lambda-ratio", "x"], "usage: featcal calibrate [options]", "argument --lambda-ratio"),
    (["merge", "--method", "nope"], "usage: featcal merge [options]", "argument --method: invalid choice"),
    (["run"], "usage: featcal run FILE.yaml [options]", "the following arguments are required: FILE.yaml"),
    (["frobnicate"], "usage: featcal COMMAND ... [options]", "argument COMMAND: invalid choice: 'frobnicate'"),
    ([], "usage: featcal COMMAND ... [options]", "the following arguments are required: COMMAND"),
])
def test_an_argparse_error_is_the_short_usage_and_the_error(argv, usage, error, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(usage) and "--help" in lines[0]
    assert lines[1].startswith("featcal: error: ") and error in lines[1]
