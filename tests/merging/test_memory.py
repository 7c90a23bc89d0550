"""Merging streams: its peak tensor memory does not grow with the number of experts.

Two meters, both exact and deterministic (no RSS noise):
- every tensor any torch op creates is tracked by storage until it is freed (a dispatch mode), so the
  peak counts the base, the result, accumulators, task vectors and the expert tensors read;
- a patched reader counts how many expert tensors are alive at once.
A naive merge that loads all experts first is measured too, to show that the meter sees growth.
"""

import weakref

import pytest
import torch
import transformers as T
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from featcal import merge
from featcal.io.read.checkpoint import CheckpointReader
from featcal.io.read.sources import UnmappedReader
from tests.builders.tiny import perturbed, save

pytestmark = pytest.mark.usefixtures("one_thread")

N_SMALL, N_LARGE = 2, 6


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages alive at once, among those created or touched by torch ops."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, live tensors]
        self.current = self.peak = 0

    def track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0:
            return
        entry = self.storages.setdefault(ptr, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.track(t)
        return out


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A BERT big enough that one expert (~3.5 MB) dwarfs its largest tensor (256 KiB)."""
    root = tmp_path_factory.mktemp("mem")
    config = T.BertConfig(vocab_size=200, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    base = T.BertModel(config).eval()
    base_dir = save(base, root / "base")
    experts = {f"t{i}": save(perturbed(base, 100 + i), root / f"e{i}") for i in range(N_LARGE)}
    expert_bytes = sum(p.numel() * p.element_size() for p in base.state_dict().values())
    largest = max(p.numel() * p.element_size() for p in base.state_dict().values())
    return base_dir, experts, expert_bytes, largest


@pytest.fixture
def reads(monkeypatch):
    """Count expert tensors alive at once (tensors read from any checkpoint but the base)."""
    state = {"alive": 0, "peak": 0}
    original = UnmappedReader.get

    def counting_get(self, name):
        t = original(self, name)
        if self.path.name != "base":
            state["alive"] += 1
            state["peak"] = max(state["peak"], state["alive"])

            def gone():
                state["alive"] -= 1

            weakref.finalize(t, gone)
        return t

    monkeypatch.setattr(UnmappedReader, "get", counting_get)
    return state


def _peak(fn) -> int:
    with LiveTensorBytes() as meter:
        fn()
    return meter.peak


def _subset(experts, n):
    return dict(list(experts.items())[:n])


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "dare_ties"])
def test_peak_memory_does_not_grow_with_experts(family, reads, method):
    base, experts, expert_bytes, largest = family
    peaks = {}
    for n in (N_SMALL, N_LARGE):
        reads["peak"] = 0
        peaks[n] = _peak(lambda n=n: merge(base, _subset(experts, n), method, progress=False))
        assert reads["peak"] == 1, f"{reads['peak']} expert tensors were alive at once with {n} experts"
    growth = peaks[N_LARGE] - peaks[N_SMALL]
    print(f"{method}: peak live tensor bytes {peaks}, one expert {expert_bytes}, largest tensor {largest}")
    # 4 more experts = 4 × 3.5 MB if they were held; streaming may differ by at most a tensor or so
    assert growth <= 2 * largest, (peaks, expert_bytes, largest)
    assert peaks[N_LARGE] < 4 * expert_bytes  # the result, the base, a few accumulators


def test_the_meter_sees_a_non_streaming_merge_grow(family):
    base, experts, expert_bytes, _ = family

    def naive(n):
        readers = [CheckpointReader(d) for d in _subset(experts, n).values()]
        held = [{k: r.get(k).clone() for k in r.keys()} for r in readers]
        return {k: sum(h[k] for h in held) / n for k in held[0]}

    growth = _peak(lambda: naive(N_LARGE)) - _peak(lambda: naive(N_SMALL))
    assert growth >= (N_LARGE - N_SMALL) * expert_bytes * 0.9
