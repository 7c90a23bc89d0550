"""validate_family / validate_expert_names: every refusal names the expert and the first bad tensor."""

import json

import pytest
import torch

from featcal.errors import CheckpointError, ConfigError
from featcal.io.read.checkpoint import CheckpointReader
from featcal.io.read.validate import dtype_class, validate_expert_names, validate_family
from tests.builders.guarantees import rewrite
from tests.builders.tiny import make_family, save, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _readers(base, experts):
    return CheckpointReader(base), {n: CheckpointReader(p) for n, p in experts.items()}


def _refused_after(family, which: str, change, match: str) -> None:
    """After `change` to the tensors of expert `which` (or of the "base"), validate_family refuses the family
    with a message matching `match`."""
    base, experts = family
    rewrite(base if which == "base" else experts[which], change)
    with pytest.raises(CheckpointError, match=match):
        validate_family(*_readers(base, experts))


@pytest.fixture
def family(tmp_path):
    return make_family("bert", tmp_path, n_experts=2)


def test_good_family_passes(family):
    validate_family(*_readers(*family))


def test_bf16_expert_of_fp32_base_is_fine(family):
    base, experts = family
    rewrite(experts["task1"], lambda sd: sd.update({k: v.bfloat16() for k, v in sd.items() if v.is_floating_point()}))
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
    rewrite(experts["task1"], lambda sd: [sd.pop(k) for k in ("pooler.dense.weight", "encoder.layer.1.output.dense.bias")])
    with pytest.raises(
        CheckpointError, match=r"expert 'task1'.*missing tensor 'encoder.layer.1.output.dense.bias' and 1 more"
    ):
        validate_family(*_readers(base, experts))


def test_extra_tensor(family):
    _refused_after(family, "task0", lambda sd: sd.update({"head.weight": torch.zeros(2)}),
                   r"expert 'task0'.*has tensor 'head.weight' that the base does not")


def test_prefix_hint(family):
    _refused_after(family, "task0", lambda sd: sd.update({f"bert.{k}": sd.pop(k) for k in list(sd)}),
                   "differ by a prefix")


def test_shape_mismatch(family):
    _refused_after(family, "task1", lambda sd: sd.update({"pooler.dense.bias": torch.zeros(33)}),
                   r"expert 'task1'.*'pooler.dense.bias' has shape \(33,\).*\(32,\)")


def test_dtype_class_mismatch(family):
    _refused_after(family, "task0",
                   lambda sd: sd.update({"pooler.dense.bias": torch.zeros(32, dtype=torch.int32)}),
                   r"expert 'task0'.*'pooler.dense.bias' is torch.int32 \(integer\)")


@pytest.mark.parametrize("bad,word", [(float("nan"), "1 NaN and 0 Inf"), (float("inf"), "0 NaN and 1 Inf")])
def test_non_finite_expert(family, bad, word):
    base, experts = family

    def poison(sd):
        sd["encoder.layer.0.attention.self.query.weight"][3, 4] = bad

    rewrite(experts["task1"], poison)
    with pytest.raises(CheckpointError, match=rf"expert 'task1'.*'encoder.layer.0.attention.self.query.weight'.*{word}"):
        validate_family(*_readers(base, experts))
    validate_family(*_readers(base, experts), check_finite=False)  # the header checks alone pass


def test_non_finite_base(family):
    _refused_after(family, "base", lambda sd: sd["pooler.dense.weight"].fill_(float("nan")),
                   r"^base .*'pooler.dense.weight' contains 1024 NaN")


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
