"""The zoos' optimizer: torch's multi-tensor kernels, bit for bit the per-tensor loop the zoos were built with,
so a cached zoo stays what a fresh build makes (the zoo fingerprint does not move with it)."""

import pytest
import torch

from featcal.experiments.zoo.train import FinetuneSettings, optimizer, step_rows, trainable_parameters


def _trained(make_optimizer) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    opt = make_optimizer(list(model.parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = torch.randint(0, 50, (8, 5), generator=g)
        loss = torch.nn.functional.cross_entropy(model(ids).mean(1), torch.randint(0, 4, (8,), generator=g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_zoo_optimizer_is_the_per_tensor_loop_bit_for_bit(kind):
    loop = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01, foreach=False),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=3e-2, momentum=0.9, weight_decay=0.01, foreach=False)}[kind]
    ours = _trained(lambda ps: optimizer(ps, 3e-3 if kind == "adamw" else 3e-2, 0.01, kind))
    reference = _trained(loop)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(ours, _trained(lambda ps: optimizer(ps, 1e-3, 0.01, kind)),
                                                     strict=True))  # the comparison can tell settings apart


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        optimizer([torch.nn.Parameter(torch.zeros(2))], 1e-3, 0.0, "lion")


def test_ungrouped_steps_draw_as_the_zoos_always_did():
    """length_groups 0 keeps one randint per step, so the vision zoos' and text-tiny's batches are unchanged."""
    settings = FinetuneSettings(steps=5, batch_size=4, lr=1e-3)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    rows = step_rows(20, settings, g1)
    for _ in range(5):
        assert torch.equal(next(rows), torch.randint(0, 20, (4,), generator=g2))


def test_length_groups_put_short_texts_together_and_keep_every_draw():
    lengths = torch.tensor([3, 40, 5, 38, 4, 39, 6, 41] * 4)
    grouped = FinetuneSettings(steps=8, batch_size=4, lr=1e-3, length_groups=4)
    g, g_ref = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    rows = step_rows(len(lengths), grouped, g, lengths)
    steps = [next(rows) for _ in range(4)]
    drawn = torch.randint(0, len(lengths), (16,), generator=g_ref)  # the same draws, in another grouping
    assert sorted(torch.cat(steps).tolist()) == sorted(drawn.tolist())
    widths = sorted(int(lengths[s].max()) for s in steps)
    ungrouped = sorted(int(lengths[drawn[i:i + 4]].max()) for i in range(0, 16, 4))
    assert sum(widths) < sum(ungrouped)  # short rows share steps: narrower trimmed batches
    with pytest.raises(ValueError, match="needs each example's length"):
        next(step_rows(len(lengths), grouped, g))


def test_frozen_blocks_leave_the_embeddings_and_lower_blocks_at_the_base():
    import transformers

    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                  intermediate_size=32)
    model = transformers.BertModel(cfg)
    params = trainable_parameters(model, 2)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(n.startswith("encoder.layer.2.") for n in names)
    assert len(params) == len(names)
    everything = trainable_parameters(model, -1)
    assert not any(p is q for p in everything for q in model.pooler.parameters())
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if not n.startswith("pooler.")}
    with pytest.raises(ValueError, match="frozen_blocks must be -1"):
        trainable_parameters(model, 3)
