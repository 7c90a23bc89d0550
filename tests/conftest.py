"""Shared by every folder: tests import their builders as `tests.builders.*` (tests/ is a package)."""

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Tests never reach a hub: fail fast instead of waiting on the network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread is faster than two, and kinder to a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
