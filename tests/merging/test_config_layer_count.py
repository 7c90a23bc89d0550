"""`featcal merge` refuses a family whose config claims more layers than its weights hold, before any work
(issue 49, minor): it wrote such a merge with rc 0, and `featcal calibrate` then refused it."""

from __future__ import annotations

import json

from featcal.cli.main import main
from tests.builders.tiny import make_family, without_log_lines


def _claim_layers(directory, n: int) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] = n
    (directory / "config.json").write_text(json.dumps(config))


def test_a_config_claiming_more_layers_than_its_weights_is_refused_before_the_merge(tmp_path, capsys):
    base, experts = make_family("llama", tmp_path, n_experts=2)  # 2 layers of weights
    for d in (base, *experts.values()):
        _claim_layers(d, 3)
    out = tmp_path / "merged"
    argv = ["merge", "--base", str(base), *[a for t, d in experts.items() for a in ("--expert", f"{t}={d}")],
            "--out", str(out), "--no-progress"]
    capsys.readouterr()  # the builders' own progress bars
    assert main(argv) == 2
    err = without_log_lines(capsys.readouterr().err).strip()
    assert err.count("\n") == 0 and "config.json num_hidden_layers is 3" in err
    assert "the weights hold 2 layer(s) (model.layers.0 to model.layers.1)" in err and "layer 2 random" in err
    assert not out.exists()

    for d in (base, *experts.values()):  # the same family, its config telling the truth: merged
        _claim_layers(d, 2)
    assert main(argv) == 0 and (out / "model.safetensors").is_file()
