"""The zoos' optimizer: torch's multi-tensor kernels, bit for bit the per-tensor loop the zoos were built with,
so a cached zoo stays what a fresh build makes (the zoo fingerprint does not move with it)."""

import pytest
import torch

from featcal.experiments.zoo.train import optimizer


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
