"""Find every model and dataset a setting needs BEFORE any work, or stop with one message.

Each id is looked up, in order, in: --model-dir / --data-dir (one folder per hub id, e.g.
D/openai/clip-vit-base-patch32/ or D/tanganke/eurosat/; a dataset config may sit in a subfolder,
D/nyu-mll/glue/cola/), the Hugging Face cache (HF_HOME), and — unless HF_HUB_OFFLINE /
HF_DATASETS_OFFLINE is set — the hub itself. Everything missing is reported together, so a user
without network learns in seconds what to fetch and where to put it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal.errors import CalibrationDataError, CheckpointError
from featcal.experiments.reproduce.settings import DatasetRef, Setting

_TRUE = {"1", "on", "yes", "true"}
HUB_TIMEOUT_S = 10.0


class UnresolvedInputsError(CheckpointError):
    """Some model or dataset ids of a setting are neither local nor reachable."""


@dataclass(frozen=True)
class Sources:
    """Where local copies live (None: not given)."""

    model_dir: Path | None = None
    data_dir: Path | None = None


@dataclass
class Resolved:
    """Where each id will be read from: a local path, or the hub id itself (fetched on load)."""

    models: dict[str, str] = field(default_factory=dict)
    datasets: dict[tuple[str, str | None], str] = field(default_factory=dict)

    def model(self, model_id: str) -> str:
        return self.models[model_id]

    def describe(self) -> dict[str, str]:
        out = dict(self.models)
        out.update({f"{i}" + (f" ({c})" if c else ""): where for (i, c), where in self.datasets.items()})
        return out


def hub_offline() -> bool:
    """Offline flags as set NOW (huggingface_hub and datasets read them only at import)."""
    return any(os.environ.get(v, "0").strip().lower() in _TRUE
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def local_model(model_id: str, sources: Sources) -> Path | None:
    if sources.model_dir is None:
        return None
    path = Path(sources.model_dir) / model_id
    return path if (path / "config.json").is_file() else None


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def local_dataset(ref: DatasetRef, sources: Sources) -> Path | None:
    if sources.data_dir is None:
        return None
    root = Path(sources.data_dir) / ref.id
    for path in ([root / ref.config] if ref.config else []) + [root]:
        if _is_saved_dataset(path):
            return path
    return None


def _cached_model(model_id: str) -> str | None:
    from huggingface_hub import snapshot_download

    from featcal.io.read.checkpoint import HUB_PATTERNS

    try:
        return snapshot_download(model_id, local_files_only=True, allow_patterns=HUB_PATTERNS)
    except Exception:
        return None


def _hub_has(repo_id: str, repo_type: str) -> bool:
    if hub_offline():
        return False
    from huggingface_hub import HfApi

    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=HUB_TIMEOUT_S)
        return True
    except Exception:
        return False


def _resolve_model(model_id: str, sources: Sources) -> str | None:
    local = local_model(model_id, sources)
    if local is not None:
        return str(local)
    cached = _cached_model(model_id)
    if cached is not None:
        return cached
    return model_id if _hub_has(model_id, "model") else None


def _cached_dataset(ref: DatasetRef) -> bool:
    """True when `datasets` can build this dataset from its own cache (HF_HOME/datasets)."""
    import datasets

    try:
        datasets.load_dataset_builder(ref.id, ref.config)
        return True
    except Exception:
        return False


@contextlib.contextmanager
def _datasets_offline() -> Iterator[None]:
    """Make `datasets` look only at its cache (its offline flag is read at import, so set it here)."""
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def _resolve_datasets(refs: list[DatasetRef], sources: Sources, pool: ThreadPoolExecutor) -> list[str | None]:
    """Local folder, else the datasets cache, else the hub; cache checks run together, offline."""
    hits: list[str | None] = [None if (p := local_dataset(r, sources)) is None else str(p) for r in refs]
    todo = [i for i, hit in enumerate(hits) if hit is None]
    with _datasets_offline():
        cached = list(pool.map(lambda i: _cached_dataset(refs[i]), todo))
    remote = [i for i, ok in zip(todo, cached, strict=True) if not ok]
    on_hub = list(pool.map(lambda i: _hub_has(refs[i].id, "dataset"), remote))
    for i, ok in zip(todo, cached, strict=True):
        hits[i] = refs[i].id if ok else None
    for i, ok in zip(remote, on_hub, strict=True):
        hits[i] = refs[i].id if ok else None
    return hits


def resolve_all(setting: Setting, sources: Sources) -> Resolved:
    """Resolve every id of `setting`, concurrently; raise UnresolvedInputsError listing all misses."""
    models = setting.model_ids()
    refs = setting.dataset_refs()
    with ThreadPoolExecutor(max_workers=8) as pool:
        model_hits = list(pool.map(lambda m: _resolve_model(m, sources), models))
        data_hits = _resolve_datasets(refs, sources, pool)
    missing_models = [m for m, hit in zip(models, model_hits, strict=True) if hit is None]
    missing_data = [r for r, hit in zip(refs, data_hits, strict=True) if hit is None]
    if missing_models or missing_data:
        raise UnresolvedInputsError(unresolved_message(setting.name, missing_models, missing_data, sources))
    return Resolved(
        models=dict(zip(models, model_hits, strict=True)),  # type: ignore[arg-type]
        datasets={(r.id, r.config): hit for r, hit in zip(refs, data_hits, strict=True)},  # type: ignore[misc]
    )


def unresolved_message(
    setting: str, models: Iterable[str], datasets: Iterable[DatasetRef], sources: Sources
) -> str:
    models, datasets = list(models), list(datasets)
    where = ("HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set" if hub_offline()
             else "the hub did not answer for them (no network, no access, or no such id)")
    lines = [f"setting {setting}: {len(models)} model id(s) and {len(datasets)} dataset id(s) are not available "
             f"locally and {where}:"]
    if models:
        lines.append("  models:   " + ", ".join(models))
    if datasets:
        lines.append("  datasets: " + ", ".join(d.label for d in datasets))
    example_model = models[0] if models else "openai/clip-vit-base-patch32"
    example_data = datasets[0] if datasets else DatasetRef("tanganke/eurosat")
    data_path = example_data.id + (f"/{example_data.config}" if example_data.config else "")
    lines += [
        "Point featcal at local copies:",
        f"  --model-dir D  one folder per model id, saved with save_pretrained (D/{example_model}/config.json)"
        + (f"; searched {sources.model_dir}" if sources.model_dir else ""),
        f"  --data-dir D   one folder per dataset id, saved with save_to_disk (D/{data_path}/); same columns "
        "as on the hub" + (f"; searched {sources.data_dir}" if sources.data_dir else ""),
        "  or HF_HOME=<a Hugging Face cache holding them> with HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1.",
    ]
    return "\n".join(lines)


def load_split(resolved: Resolved, ref: DatasetRef, split: str) -> Any:
    """One split of a resolved dataset, from disk (load_from_disk) or through datasets.load_dataset."""
    import datasets

    where = resolved.datasets[(ref.id, ref.config)]
    if Path(where).exists():
        data = datasets.load_from_disk(where)
        if isinstance(data, datasets.Dataset):
            raise CalibrationDataError(
                f"{where} holds a single Dataset; save a DatasetDict with a {split!r} split (dataset {ref.label})"
            )
        if split not in data:
            raise CalibrationDataError(f"dataset {ref.label} at {where} has no split {split!r} (has {list(data)})")
        return data[split]
    try:
        return datasets.load_dataset(ref.id, ref.config, split=split)
    except ValueError as exc:
        raise CalibrationDataError(f"dataset {ref.label}: cannot load split {split!r}: {exc}") from None


def local_dir(resolved: Resolved, model_id: str, *, allow_pickle: bool = False) -> Path:
    """A local directory for a resolved model (downloading a hub snapshot if needed)."""
    from featcal.io.read.checkpoint import resolve_checkpoint

    return resolve_checkpoint(resolved.model(model_id), allow_pickle=allow_pickle)
