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


# --- the on-disk families (tests/builders/pipeline_family.py) most CLI and pipeline tests share ---------------
# Module-scoped, as each file had them: a file needing another family of the same name defines its own fixture,
# which takes precedence there.


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    from tests.builders.pipeline_family import clip_family

    return clip_family(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from tests.builders.pipeline_family import bert_family

    return bert_family(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.builders.pipeline_family import llama_family

    return llama_family(tmp_path_factory.mktemp("llama"))


# --- "before any work": a refusal must come before these run -------------------------------------------------


@pytest.fixture
def no_calibration_work(monkeypatch):
    """Fail the test if the pipeline gets as far as loading a model or preprocessing data."""
    import featcal.calibration.front.pipeline as pipeline

    def boom(*a, **k):
        raise AssertionError("calibration work started before the input was validated")

    monkeypatch.setattr(pipeline, "load_model", boom)
    monkeypatch.setattr(pipeline, "_load_calibration", boom)


@pytest.fixture
def no_merge_work(monkeypatch):
    """Fail the test if merging starts before the input was validated."""
    import featcal.merging.api as merge_api

    def boom(*a, **k):
        raise AssertionError("merging started before the input was validated")

    monkeypatch.setattr(merge_api, "merge_family", boom)
