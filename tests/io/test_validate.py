"""validate_family / validate_expert_names: every refusal names the expert and the first bad tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from featcal.errors import CheckpointError, ConfigError
from featcal.io.checkpoint import CheckpointReader
from featcal.io.validate import dtype_class, validate_expert_names, validate_family
from tests.builders.tiny import make_family, save, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _readers(base, experts):
    return CheckpointReader(base), {n: CheckpointReader(p) for n, p in experts.items()}


def _rewrite(directory, fn):
    """Apply fn to the state dict of a saved checkpoint and write it back."""
    f = directory / "model.safetensors"
    sd = load_file(f)
    fn(sd)
    save_file(sd, f, metadata={"format": "pt"})


@pytest.fixture
def family(tmp_path):
    return make_family("bert", tmp_path, n_experts=2)


def test_good_family_passes(family):
    validate_family(*_readers(*family))


def test_bf16_expert_of_fp32_base_is_fine(family):
    base, experts = family
    _rewrite(experts["task1"], lambda sd: sd.update({k: v.bfloat16() for k, v in sd.items() if v.is_floating_point()}))
    validate_family(*_readers(base, experts))


def test_architecture_mismatch(tmp_path, family):
    base, experts = family
    other = save(tiny_model("vit"), tmp_path / "vit")
    with pytest.raises(CheckpointError, match=r"expert 'odd'.*model_type is 'vit' but the base has 'bert'"):
        validate_family(*_readers(base, {**experts, "odd": other}))


def test_architectures_field_mismatch(family):
    base, experts = family
    cfg = experts["task0"] / "config.json"
    data = json.loads(cfg.read_text())
    data["architectures"] = ["BertForMaskedLM"]
    cfg.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"expert 'task0'.*architectures"):
        validate_family(*_readers(base, experts))


def test_missing_tensor_named_first_in_order(family):
    base, experts = family
    _rewrite(experts["task1"], lambda sd: [sd.pop(k) for k in ("pooler.dense.weight", "encoder.layer.1.output.dense.bias")])
    with pytest.raises(
        CheckpointError, match=r"expert 'task1'.*missing tensor 'encoder.layer.1.output.dense.bias' and 1 more"
    ):
        validate_family(*_readers(base, experts))


def test_extra_tensor(family):
    base, experts = family
    _rewrite(experts["task0"], lambda sd: sd.update({"head.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"expert 'task0'.*has tensor 'head.weight' that the base does not"):
        validate_family(*_readers(base, experts))


def test_prefix_hint(family):
    base, experts = family
    _rewrite(experts["task0"], lambda sd: sd.update({f"bert.{k}": sd.pop(k) for k in list(sd)}))
    with pytest.raises(CheckpointError, match="differ by a prefix"):
        validate_family(*_readers(base, experts))


def test_shape_mismatch(family):
    base, experts = family
    _rewrite(experts["task1"], lambda sd: sd.update({"pooler.dense.bias": torch.zeros(33)}))
    with pytest.raises(CheckpointError, match=r"expert 'task1'.*'pooler.dense.bias' has shape \(33,\).*\(32,\)"):
        validate_family(*_readers(base, experts))


def test_dtype_class_mismatch(family):
    base, experts = family
    _rewrite(experts["task0"], lambda sd: sd.update({"pooler.dense.bias": torch.zeros(32, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"expert 'task0'.*'pooler.dense.bias' is torch.int32 \(integer\)"):
        validate_family(*_readers(base, experts))


@pytest.mark.parametrize("bad,word", [(float("nan"), "1 NaN and 0 Inf"), (float("inf"), "0 NaN and 1 Inf")])
def test_non_finite_expert(family, bad, word):
    base, experts = family

    def poison(sd):
        sd["encoder.layer.0.attention.self.query.weight"][3, 4] = bad

    _rewrite(experts["task1"], poison)
    with pytest.raises(CheckpointError, match=rf"expert 'task1'.*'encoder.layer.0.attention.self.query.weight'.*{word}"):
        validate_family(*_readers(base, experts))
    validate_family(*_readers(base, experts), check_finite=False)  # the header checks alone pass


def test_non_finite_base(family):
    base, experts = family
    _rewrite(base, lambda sd: sd["pooler.dense.weight"].fill_(float("nan")))
    with pytest.raises(CheckpointError, match=r"^base .*'pooler.dense.weight' contains 1024 NaN"):
        validate_family(*_readers(base, experts))


@pytest.mark.parametrize(
    "names,msg", [([], "at least one"), (["a", "a"], "twice"), (["", "b"], "non-empty"), (["a=b"], "'='"),
                  ([" a"], "spaces")],
)
def test_expert_names(names, msg):
    with pytest.raises(ConfigError, match=msg):
        validate_expert_names(names)
    assert validate_expert_names(["x", "y"]) == ["x", "y"]


def test_dtype_class():
    assert dtype_class(torch.bfloat16) == dtype_class(torch.float32) == "floating"
    assert dtype_class(torch.int64) == dtype_class(torch.uint8) == "integer"
    assert dtype_class(torch.bool) == "bool"
