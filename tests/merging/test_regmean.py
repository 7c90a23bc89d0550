"""RegMean and RegMean++ on tiny models: exact special cases, the closed form, forward-order inputs."""

import copy

import pytest
import torch

from featcal.errors import CalibrationDataError, CheckpointError
from featcal.merging.regmean import regmean
from featcal.merging.regmean_grams import regmean_weight, scale_off_diagonal
from tests.builders.tiny import make_family, perturbed, sample_inputs, tiny_model


def family(kind, n=3, scale=0.2):
    base = tiny_model(kind)
    experts = {f"t{i}": perturbed(base, 100 + i, scale) for i in range(n)}
    calib = {t: [sample_inputs(kind, batch=4, seed=i), sample_inputs(kind, batch=4, seed=10 + i)]
             for i, t in enumerate(experts)}
    return base, experts, calib


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("plus_plus", [False, True])
@pytest.mark.parametrize("kind", ["clip", "llama", "t5"])
def test_one_expert_gives_the_expert(kind, plus_plus):
    base, experts, calib = family(kind, n=1)
    merged = regmean(base, experts, calib, plus_plus=plus_plus)
    assert max_diff(experts["t0"].state_dict(), merged.state_dict()) < 1e-5


@pytest.mark.parametrize("plus_plus", [False, True])
def test_identical_experts_give_them_back(plus_plus):
    base, experts, calib = family("bert", n=1)
    same = {"a": experts["t0"], "b": copy.deepcopy(experts["t0"])}
    merged = regmean(base, same, {"a": calib["t0"], "b": sample_inputs("bert", batch=4, seed=7)}, plus_plus=plus_plus)
    assert max_diff(experts["t0"].state_dict(), merged.state_dict()) < 1e-5


def test_closed_form_is_least_squares_on_the_stacked_inputs():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(50, 6, generator=g), torch.randn(30, 6, generator=g) * 2]
    ws = [torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in xs]
    grams = [x.double().T @ x.double() / len(x) for x in xs]
    # alpha = 1: argmin Σ_t (1/n_t)‖X_t Wᵀ − X_t W_tᵀ‖²
    a = torch.cat([x.double() / len(x) ** 0.5 for x in xs])
    y = torch.cat([x.double() @ w.T / len(x) ** 0.5 for x, w in zip(xs, ws, strict=True)])
    ref = torch.linalg.lstsq(a, y).solution.T
    torch.testing.assert_close(regmean_weight(grams, ws, alpha=1.0), ref)
    # alpha = 0: diagonal Grams, i.e. a per-input-channel weighted average of the experts
    diag = [torch.diagonal(gm) for gm in grams]
    ref0 = sum(w * d for w, d in zip(ws, diag, strict=True)) / sum(diag)
    torch.testing.assert_close(regmean_weight(grams, ws, alpha=0.0), ref0)


def test_scale_off_diagonal_keeps_the_diagonal():
    gm = torch.arange(9.0).reshape(3, 3)
    out = scale_off_diagonal(gm, 0.5)
    assert torch.equal(torch.diagonal(out), torch.diagonal(gm))
    assert out[0, 1] == 0.5 * gm[0, 1] and out[2, 0] == 0.5 * gm[2, 0]


def test_non_linear_parameters_are_averaged_and_linears_solved():
    base, experts, calib = family("clip")
    merged = regmean(base, experts, calib).state_dict()
    sds = [e.state_dict() for e in experts.values()]
    for name in ("encoder.layers.0.layer_norm1.weight", "encoder.layers.1.mlp.fc1.bias", "embeddings.patch_embedding.weight"):
        torch.testing.assert_close(merged[name], sum(s[name] for s in sds) / 3)
    w = "encoder.layers.0.mlp.fc1.weight"
    assert (merged[w] - sum(s[w] for s in sds) / 3).abs().max() > 1e-3


def test_plus_plus_uses_the_merged_models_propagated_inputs():
    """Independent reference for CLIP: block l's Grams from expert block l on merged hidden_states[l]."""
    base, experts, calib = family("clip")
    got = regmean(base, experts, calib, plus_plus=True, alpha=0.9)
    plain = regmean(base, experts, calib, plus_plus=False, alpha=0.9)

    ref = copy.deepcopy(base)
    sds = [e.state_dict() for e in experts.values()]
    ref.load_state_dict({k: sum(s[k] for s in sds) / 3 for k in sds[0]})
    for layer in range(2):
        acts = {}
        for t, expert in experts.items():
            block = expert.encoder.layers[layer]
            feats = {}
            hooks = [m.register_forward_hook(lambda _m, a, _o, n=n, feats=feats: feats.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1])))
                     for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
            with torch.no_grad():
                for b in calib[t]:
                    h = ref(**b, output_hidden_states=True).hidden_states[layer]
                    block(h, None)
            for hk in hooks:
                hk.remove()
            acts[t] = {n: torch.cat(v).double() for n, v in feats.items()}
        for n, m in ref.encoder.layers[layer].named_modules():
            if isinstance(m, torch.nn.Linear):
                grams = [acts[t][n].T @ acts[t][n] / len(acts[t][n]) for t in experts]
                ws = [e.encoder.layers[layer].get_submodule(n).weight.detach() for e in experts.values()]
                with torch.no_grad():
                    m.weight.copy_(regmean_weight(grams, ws, alpha=0.9))
    assert max_diff(ref.state_dict(), got.state_dict()) < 1e-4
    assert max_diff(plain.state_dict(), got.state_dict()) > 1e-3


def test_checkpoint_paths_work_like_models(tmp_path):
    base_dir, expert_dirs = make_family("clip", tmp_path, n_experts=2, scale=0.2)
    calib = {t: sample_inputs("clip", batch=4, seed=i) for i, t in enumerate(expert_dirs)}
    from featcal.io.read.models import load_model

    from_paths = regmean(base_dir, expert_dirs, calib)
    from_models = regmean(load_model(base_dir), {t: load_model(p) for t, p in expert_dirs.items()}, calib)
    assert max_diff(from_models.state_dict(), from_paths.state_dict()) == 0.0


def test_bad_inputs_are_refused_naming_the_problem():
    base, experts, calib = family("clip", n=2)
    with pytest.raises(CalibrationDataError, match="'t1'"):
        regmean(base, experts, {"t0": calib["t0"]})
    with pytest.raises(CalibrationDataError, match="empty"):
        regmean(base, experts, {"t0": calib["t0"], "t1": []})
    other = tiny_model("clip")
    other.encoder.layers[0].mlp.fc1 = torch.nn.Linear(32, 48)
    with pytest.raises(CheckpointError, match="encoder.layers.0.mlp.fc1"):
        regmean(base, {"t0": experts["t0"], "t1": other}, calib)


def test_a_bad_last_expert_is_refused_before_any_model_is_loaded(tmp_path, monkeypatch):
    import importlib

    rm = importlib.import_module("featcal.merging.regmean")  # the package exports a function of that name

    base_dir, expert_dirs = make_family("clip", tmp_path, n_experts=2)
    expert_dirs["broken"] = tmp_path / "nowhere"
    loaded = []
    monkeypatch.setattr(rm, "load", lambda m, what: loaded.append(what))
    calib = {t: sample_inputs("clip") for t in expert_dirs}
    with pytest.raises(CheckpointError, match="expert 'broken'"):
        regmean(base_dir, expert_dirs, calib)
    assert loaded == []


def _bert_texts(lengths, g):
    """One padded batch of token ids (pad id 0, right padding), and the same examples unpadded, one per batch."""
    ids = torch.randint(2, 100, (len(lengths), max(lengths)), generator=g)
    mask = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    single = [{"input_ids": ids[i : i + 1, :n], "attention_mask": mask[i : i + 1, :n]} for i, n in enumerate(lengths)]
    return [{"input_ids": ids, "attention_mask": mask}], single


@pytest.mark.parametrize("plus_plus", [False, True])
def test_padding_tokens_weigh_nothing_in_the_grams(plus_plus):
    """A padded BERT batch gives the RegMean of the same examples fed unpadded one by one: padding
    (attention_mask 0) weighs 0 in the Grams, as in FeatCal. Unweighted Grams would count the pad tokens."""
    base = tiny_model("bert")
    experts = {"t0": perturbed(base, 100, 0.2), "t1": perturbed(base, 101, 0.2)}
    g = torch.Generator().manual_seed(0)
    padded, single = {}, {}
    for t, lengths in {"t0": [8, 5, 3], "t1": [6, 8, 2]}.items():
        padded[t], single[t] = _bert_texts(lengths, g)
    a = regmean(base, experts, padded, plus_plus=plus_plus).state_dict()
    b = regmean(base, experts, single, plus_plus=plus_plus).state_dict()
    assert max_diff(a, b) < 1e-5
    w = "encoder.layer.0.attention.self.query.weight"
    assert (a[w] - (experts["t0"].state_dict()[w] + experts["t1"].state_dict()[w]) / 2).abs().max() > 1e-3  # solved


def test_token_weights_follow_the_adapter():
    """T5: encoder modules read the encoder mask, cross-attention k/v the encoder mask too, decoder
    modules the decoder mask; an architecture without an adapter weighs every token 1."""
    from featcal.merging.regmean_grams import TokenWeights

    batch = sample_inputs("t5", batch=2, seq=8)
    batch["decoder_attention_mask"] = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    fn = TokenWeights(tiny_model("t5")).for_batch(batch)
    enc, dec = torch.zeros(2, 8, 32), torch.zeros(2, 4, 32)
    enc_mask, dec_mask = batch["attention_mask"].float(), batch["decoder_attention_mask"].float()
    assert torch.equal(fn("encoder.block.1.layer.0.SelfAttention.q", enc), enc_mask)
    assert torch.equal(fn("decoder.block.0.layer.1.EncDecAttention.k", enc), enc_mask)
    assert torch.equal(fn("decoder.block.0.layer.1.EncDecAttention.q", dec), dec_mask)
    assert torch.equal(fn("lm_head", dec), dec_mask)  # outside the blocks: the last stack's tokens
    bert = TokenWeights(tiny_model("bert")).for_batch(sample_inputs("bert"))
    assert bert("pooler.dense", torch.zeros(2, 32)) is None  # pooled: one token per example
    plain = TokenWeights(torch.nn.Sequential(torch.nn.Linear(32, 32))).for_batch(sample_inputs("bert"))
    assert plain("0", torch.zeros(2, 8, 32)) is None
