"""Config validation, atomic outputs and safe checkpoint reading."""

import pytest

from featcal.config import FeatCalConfig, MergeConfig, parse
from featcal.errors import CheckpointError, ConfigError, OutputExistsError
from featcal.io.read.checkpoint import CheckpointReader
from featcal.io.write.atomic import atomic_output_dir
from tests.builders.tiny import make_family


def test_featcal_defaults_match_demo():
    c = FeatCalConfig()
    assert (c.lambda_ratio, c.anchor_blend_rho, c.teacher_interp_alpha) == (0.05, 2.2, 0.25)
    assert (c.num_calibration_examples, c.calibration_batch_size) == (256, 16)


@pytest.mark.parametrize(
    "data,where",
    [({"method": "nope"}, "method"), ({"density": 1.5}, "density"), ({"scaling": -1}, "scaling"),
     ({"drop_rate": 1.0}, "drop_rate"), ({"typo": 1}, "typo")],
)
def test_merge_config_rejects(data, where):
    with pytest.raises(ConfigError, match=where):
        parse(MergeConfig, data)


def test_atomic_output_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_output_dir(out) as tmp:
        (tmp / "half.safetensors").write_bytes(b"x")
        raise RuntimeError("disk full")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_refuses_non_empty(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(OutputExistsError, match="--overwrite"), atomic_output_dir(out):
        pass
    assert (out / "keep.txt").read_text() == "precious"
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]


def test_reader_refuses_pickle_and_missing(tmp_path):
    import torch

    (tmp_path / "p").mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "p" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="allow-pickle"):
        CheckpointReader(tmp_path / "p")
    assert torch.equal(CheckpointReader(tmp_path / "p", allow_pickle=True).get("w"), torch.ones(2))
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nowhere")


def test_reader_truncated_file(tmp_path):
    base, _ = make_family("bert", tmp_path, n_experts=1)
    f = base / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointReader(base)
