"""featcal.merge: streaming equals the reference maths, outputs load, bad input is refused before work."""

import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file
from torch import nn

import featcal.merging.api as api
from featcal import MergeConfig, merge
from featcal.errors import CheckpointError, ConfigError, OutputExistsError
from featcal.io.read.checkpoint import CheckpointReader
from featcal.io.read.sources import checkpoint_state_dict
from featcal.merging import available_methods, register
from featcal.merging.methods import dare, derive_seed, task_vector, ties_from_task_vectors
from featcal.merging.methods import task_arithmetic as ta_reference
from featcal.merging.registry import Merger
from featcal.merging.writer import save_state_dict
from tests.builders.guarantees import rewrite
from tests.builders.tiny import make_family, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = {"clip": T.CLIPVisionModel, "bert": T.BertModel, "llama": T.LlamaForCausalLM, "vit": T.ViTModel,
           "t5": T.T5ForConditionalGeneration}


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_family("bert", tmp_path_factory.mktemp("bert"), n_experts=3)


def _load(directory):
    return load_file(directory / "model.safetensors")


def test_every_schema_method_is_registered():
    from featcal.config import MERGE_METHODS

    assert available_methods() == sorted(MERGE_METHODS) == sorted(
        ["average", "linear", "task_arithmetic", "ties", "dare_ta", "dare_ties", "regmean", "regmean++", "wudi"]
    )


def test_task_arithmetic_and_average_match_reference(bert):
    base, experts = bert
    b, es = _load(base), [_load(d) for d in experts.values()]
    merged = merge(base, experts, "task_arithmetic", scaling=0.4, progress=False)
    assert list(merged) == sorted(b)
    for k in b:
        assert torch.equal(merged[k], ta_reference(b[k], [e[k] for e in es], scaling=0.4)), k
    avg = merge(base, experts, "average", progress=False)
    for k in b:
        assert torch.allclose(avg[k], sum(e[k] for e in es) / 3, atol=1e-6)


def _global_ties_reference(b, es, names, density, scaling, drop_rate=None, seed=0):
    """TIES over each expert's whole task vector, concatenated (what the streaming driver must equal)."""
    taus = []
    for ename, e in es.items():
        parts = []
        for k in names:
            tau = task_vector(e[k], b[k])
            if drop_rate is not None:
                tau = dare(tau, drop_rate, torch.Generator().manual_seed(derive_seed(seed, ename, k)))
            parts.append(tau.reshape(-1))
        taus.append(torch.cat(parts))
    flat_base = torch.cat([b[k].reshape(-1) for k in names])
    flat = ties_from_task_vectors(flat_base, taus, density, scaling)
    out, i = {}, 0
    for k in names:
        out[k] = flat[i : i + b[k].numel()].reshape(b[k].shape)
        i += b[k].numel()
    return out


@pytest.mark.parametrize("method", ["ties", "dare_ties"])
def test_ties_streaming_equals_global_reference(bert, method):
    base, experts = bert
    b = _load(base)
    es = {n: _load(d) for n, d in experts.items()}
    names = sorted(b)
    drop = 0.3 if method == "dare_ties" else None
    params = {"density": 0.25, "scaling": 0.7, **({"drop_rate": drop, "seed": 5} if drop else {})}
    merged = merge(base, experts, method, progress=False, **params)
    ref = _global_ties_reference(b, es, names, 0.25, 0.7, drop_rate=drop, seed=5)
    for k in names:
        assert torch.equal(merged[k], ref[k]), k


def test_dare_ta_streaming_equals_reference_and_is_seeded(bert):
    base, experts = bert
    b = _load(base)
    es = {n: _load(d) for n, d in experts.items()}
    merged = merge(base, experts, "dare_ta", drop_rate=0.5, seed=3, progress=False)
    for k in b:
        total = sum(dare(task_vector(e[k], b[k]), 0.5, torch.Generator().manual_seed(derive_seed(3, n, k)))
                    for n, e in es.items())
        assert torch.equal(merged[k], b[k] + 0.3 * total), k
    again = merge(base, experts, "dare_ta", drop_rate=0.5, seed=3, progress=False)
    other = merge(base, experts, "dare_ta", drop_rate=0.5, seed=4, progress=False)
    assert all(torch.equal(merged[k], again[k]) for k in b)
    assert any(not torch.equal(merged[k], other[k]) for k in b)


@pytest.mark.parametrize("pair", [("dare_ta", "task_arithmetic"), ("dare_ties", "ties")])
def test_dare_with_p0_equals_its_host_method(bert, pair):
    base, experts = bert
    a = merge(base, experts, pair[0], drop_rate=0.0, density=0.3, progress=False)
    b = merge(base, experts, pair[1], density=0.3, progress=False)
    assert all(torch.equal(a[k], b[k]) for k in a)


class TwoTensors(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))
        self.b = nn.Parameter(torch.tensor(b))


def test_ties_threshold_is_global_per_expert():
    # one expert, τ = a: [0.5, 0.25, 0.125], b: [0.0625, 0.03125]; density 0.4 of 5 entries -> keep 2.
    # Globally the two largest are both in `a`, so `b` is trimmed entirely; a per-tensor threshold would
    # have kept 0.0625 in `b` (and dropped 0.25 in `a`).
    base = TwoTensors([1.0, 1.0, 1.0], [2.0, 2.0])
    expert = TwoTensors([1.5, 1.25, 1.125], [2.0625, 2.03125])
    merged = merge(base, {"only": expert}, "ties", density=0.4, scaling=1.0, progress=False)
    assert torch.equal(merged["a"], torch.tensor([1.5, 1.25, 1.0]))
    assert torch.equal(merged["b"], torch.tensor([2.0, 2.0]))


def test_plain_module_base_cannot_be_written(tmp_path, no_work):
    base, expert = TwoTensors([1.0, 1.0, 1.0], [2.0, 2.0]), TwoTensors([1.5, 1.0, 1.0], [2.0, 2.0])
    with pytest.raises(CheckpointError, match="no transformers config"):
        merge(base, {"e": expert}, out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_non_floating_tensors_come_from_the_base(tmp_path):
    base, experts = make_family("bert", tmp_path, n_experts=2)
    rewrite(base, lambda sd: sd.update({"embeddings.position_ids": torch.arange(64)[None]}))
    for i, d in enumerate(experts.values()):
        rewrite(d, lambda sd, i=i: sd.update({"embeddings.position_ids": torch.arange(64)[None] * (i + 2)}))
    for method in ("task_arithmetic", "ties"):
        merged = merge(base, experts, method, progress=False)
        assert merged["embeddings.position_ids"].dtype == torch.int64
        assert torch.equal(merged["embeddings.position_ids"], torch.arange(64)[None])
    out = tmp_path / "out"
    merge(base, experts, out=out, progress=False)
    report = json.loads((out / "featcal.json").read_text())
    assert report["tensors"]["copied_from_base"] == ["embeddings.position_ids"]


@pytest.mark.parametrize("kind", ["clip", "bert", "llama"])
def test_merged_checkpoint_loads_with_base_class(tmp_path, kind):
    base, experts = make_family(kind, tmp_path, n_experts=2)
    out = tmp_path / "merged"
    merged = merge(base, experts, "ties", out=out, progress=False)
    model = T.AutoModel.from_pretrained(out) if kind != "llama" else T.AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is CLASSES[kind]
    assert json.loads((out / "config.json").read_text())["architectures"] == [CLASSES[kind].__name__]
    loaded = checkpoint_state_dict(model)
    assert set(loaded) == set(merged)
    assert all(torch.equal(loaded[k], merged[k]) for k in merged)
    base_state = CheckpointReader(base)
    assert any(not torch.equal(base_state.get(k), merged[k]) for k in merged)


@pytest.mark.parametrize("kind", ["vit", "t5"])
def test_in_memory_models_equal_their_checkpoints(tmp_path, kind):
    """ViT is renamed on load and T5 ties its embeddings: modules must still merge like their files."""
    base_dir, expert_dirs = make_family(kind, tmp_path, n_experts=2)
    cls = CLASSES[kind]
    modules = {n: cls.from_pretrained(d) for n, d in expert_dirs.items()}
    from_files = merge(base_dir, expert_dirs, "task_arithmetic", progress=False)
    from_modules = merge(cls.from_pretrained(base_dir), modules, "task_arithmetic", progress=False)
    mixed = merge(base_dir, {"task0": modules["task0"], "task1": expert_dirs["task1"]}, progress=False)
    assert set(from_files) == set(from_modules) == set(mixed)
    for k in from_files:
        assert torch.equal(from_files[k], from_modules[k]) and torch.equal(from_files[k], mixed[k]), k
    out = tmp_path / "out"
    merge(tiny_model(kind), {n: m for n, m in modules.items()}, out=out, progress=False)
    assert type(cls.from_pretrained(out)) is cls


def test_bf16_expert_of_fp32_base(tmp_path):
    base, experts = make_family("bert", tmp_path, n_experts=2)
    rewrite(experts["task1"], lambda sd: sd.update({k: v.bfloat16() for k, v in sd.items()}))
    merged = merge(base, experts, progress=False)
    b, e0, e1 = _load(base), _load(experts["task0"]), _load(experts["task1"])
    for k in b:
        assert merged[k].dtype == torch.float32
        assert torch.equal(merged[k], ta_reference(b[k], [e0[k], e1[k].float()]))


def test_report_and_output_files(bert, tmp_path):
    base, experts = bert
    (base / "tokenizer_config.json").write_text("{}")
    try:
        out = tmp_path / "out"
        merge(base, experts, "ties", density=0.5, out=out, progress=False)
    finally:
        (base / "tokenizer_config.json").unlink()
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "featcal.json", "model.safetensors",
                                                       "tokenizer_config.json"]  # README.md: the card (io/write/card.py)
    report = json.loads((out / "featcal.json").read_text())
    assert report["command"] == "merge"
    assert report["params"] == {"method": "ties", "scaling": 0.3, "density": 0.5}
    assert set(report["inputs"]["experts"]) == {"task0", "task1", "task2"}
    assert "model.safetensors" in report["inputs"]["base"]["sha256"]
    assert report["output"]["files"] == ["model.safetensors"]
    assert report["peak_rss_mb"] > 0 and report["seconds"]["total"] >= report["seconds"]["merge"] > 0
    assert not list(tmp_path.glob(".featcal-tmp-*"))


def test_same_inputs_same_bytes(bert, tmp_path):
    base, experts = bert
    hashes = []
    for name in ("a", "b"):
        merge(base, experts, "dare_ties", seed=1, out=tmp_path / name, progress=False)
        hashes.append(json.loads((tmp_path / name / "featcal.json").read_text())["output"]["sha256"])
    assert hashes[0]["model.safetensors"] == hashes[1]["model.safetensors"]


def test_sharded_output_round_trip(tmp_path):
    base, experts = make_family("bert", tmp_path, n_experts=1)
    merged = merge(base, experts, progress=False)
    out = tmp_path / "sharded"
    out.mkdir()
    files = save_state_dict(merged, out, max_shard_size=20_000)
    assert "model.safetensors.index.json" in files and len(files) > 2
    reader = CheckpointReader(out)
    assert reader.keys() == sorted(merged) and all(torch.equal(reader.get(k), merged[k]) for k in merged)
    (out / "config.json").write_text((base / "config.json").read_text())
    assert all(torch.equal(v, merged[k]) for k, v in T.BertModel.from_pretrained(out).state_dict().items())


# --- configuration ---------------------------------------------------------------------------------


def test_config_object_and_overrides(bert):
    base, experts = bert
    cfg = MergeConfig(method="ties", density=0.5)
    a = merge(base, experts, config=cfg, progress=False)
    b = merge(base, experts, "ties", density=0.5, progress=False)
    c = merge(base, experts, config=MergeConfig(method="ties", density=0.9), density=0.5, progress=False)
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    with pytest.raises(ConfigError, match="contradicts"):
        merge(base, experts, "dare_ta", config=cfg, progress=False)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"method": "regmeen"}, r"unknown merge method 'regmeen'; valid methods: average, dare_ta, dare_ties, linear, regmean, regmean\+\+, "
                               r"task_arithmetic, ties, wudi"),
     ({"density": 0.0}, "density"), ({"density": 1.5}, "density"), ({"scaling": -1.0}, "scaling"),
     ({"drop_rate": 1.0}, "drop_rate"), ({"seed": -1}, "seed"), ({"desnity": 0.2}, "desnity")],
)
def test_bad_parameters_refused(bert, kwargs, match):
    base, experts = bert
    with pytest.raises(ConfigError, match=match):
        merge(base, experts, progress=False, **kwargs)


@pytest.mark.parametrize("names,match", [({}, "at least one"), ({"": 0}, "non-empty"), ({"a=b": 0}, "'='")])
def test_bad_expert_names(bert, names, match):
    base, _ = bert
    with pytest.raises(ConfigError, match=match):
        merge(base, {n: base for n in names}, progress=False)


# --- refusing bad input before any work -------------------------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if merging starts."""

    def boom(*a, **k):
        raise AssertionError("merging started before the input was validated")

    monkeypatch.setattr(api, "merge_family", boom)


def test_missing_paths(bert, tmp_path, no_work):
    base, experts = bert
    with pytest.raises(CheckpointError, match=r"expert 'ghost': checkpoint directory .*nowhere does not exist"):
        merge(base, {**experts, "ghost": tmp_path / "nowhere"}, progress=False)
    with pytest.raises(CheckpointError, match=r"^base: "):
        merge(tmp_path / "nowhere", experts, progress=False)


def test_family_mismatch_refused(tmp_path, no_work):
    base, experts = make_family("bert", tmp_path / "f", n_experts=2)
    other, _ = make_family("clip", tmp_path / "g", n_experts=0)
    with pytest.raises(CheckpointError, match=r"expert 'odd'.*model_type"):
        merge(base, {**experts, "odd": other}, progress=False)
    rewrite(experts["task1"], lambda sd: sd.pop("pooler.dense.bias"))
    with pytest.raises(CheckpointError, match=r"expert 'task1'.*missing tensor 'pooler.dense.bias'"):
        merge(base, experts, progress=False)
    rewrite(experts["task1"], lambda sd: sd.update({"pooler.dense.bias": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"'pooler.dense.bias' has shape \(3,\)"):
        merge(base, experts, progress=False)
    rewrite(experts["task1"], lambda sd: sd.update({"pooler.dense.bias": torch.full((32,), float("nan"))}))
    with pytest.raises(CheckpointError, match=r"expert 'task1'.*'pooler.dense.bias' contains 32 NaN"):
        merge(base, experts, progress=False)


def test_existing_output_refused_before_work(bert, tmp_path, no_work):
    base, experts = bert
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        merge(base, experts, out=out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(ConfigError, match=r"is an input \(expert 'task0'\)"):
        merge(base, experts, out=experts["task0"], overwrite=True, progress=False)


def test_overwrite_replaces(bert, tmp_path):
    base, experts = bert
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    (out / "featcal.json").write_text("{}")  # an earlier output: --overwrite replaces only those
    merge(base, experts, out=out, overwrite=True, progress=False)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()


def test_write_failure_leaves_no_partial_output(bert, tmp_path, monkeypatch):
    base, experts = bert

    def half_written(state, directory, **kw):
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(api, "save_state_dict", half_written)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space"):
        merge(base, experts, out=out, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_registry_refuses_a_second_method_of_the_same_name():
    with pytest.raises(ValueError, match="already registered"):

        @register("ties")
        class Other(Merger):
            def merge_tensor(self, name, base, experts):
                return base


def test_unmapped_reader_reads_what_safetensors_reads(tmp_path):
    from featcal.io.read.sources import UnmappedReader

    base, experts = make_family("bert", tmp_path, n_experts=1)
    rewrite(base, lambda sd: sd.update({
        "x.bf16": torch.randn(3, 4).bfloat16(), "x.int": torch.arange(5), "x.bool": torch.tensor([True, False]),
        "x.scalar": torch.tensor(2.5), "x.empty": torch.zeros(0, 3),
    }))
    mapped, unmapped = CheckpointReader(base), UnmappedReader(base)
    for k in mapped.keys():
        a, b = mapped.get(k), unmapped.get(k)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), k
    with pytest.raises(CheckpointError, match="'nope' is missing"):
        unmapped.get("nope")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    state = {k: mapped.get(k) for k in mapped.keys()}
    save_state_dict(state, sharded, max_shard_size=20_000)
    reader = UnmappedReader(sharded)
    assert all(torch.equal(reader.get(k), state[k]) for k in state)
