"""Resumable calibration: after every N-th block (`checkpoint_every`), an atomic checkpoint to continue from.

Layout of a resume directory (one per rank under torch.distributed: `rank-R-of-W/`):

    state.json               fingerprint, and the generations that can be resumed from
    block-0003.safetensors   calibrated parameters of block 3 (written once, never rewritten)
    chains-0004/             every chain entry (hidden states + block context) after 4 blocks

A checkpoint is committed in this order: the parameter files of the blocks calibrated since the
previous one (temp file + rename each), the chains directory (temp directory + rename), then
`state.json` (temp file + rename). A kill at any point leaves the
previous `state.json`, which names only complete files. The previous generation's chains are
deleted only after every rank has committed the new one (a barrier), so ranks killed at different
moments can still agree on a generation they all hold.

The fingerprint hashes the config (less where things are stored), the merged model's starting
weights, each expert's and the base's identity (tensor bytes in memory; file names, sizes and
mtimes on disk), the calibration tensors, the tasks and the rank layout. A state made with other
inputs is refused, naming what differs. Contexts are stored as tensors plus a JSON skeleton (no
pickle): only None, bool, int, float, str, tuples, lists and dicts of them are accepted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from featcal.errors import ConfigError, FeatCalError
from featcal.io.write.atomic import (
    CREATED_MARKER,
    OutputWriteError,
    atomic_write_text,
    make_marked,
    os_error_of,
    remove_marked_if_empty,
)

log = logging.getLogger("featcal.calibration")

STATE = "state.json"
CREATED = CREATED_MARKER  # marks a directory featcal itself created, so that only such a one is removed
FORMAT = 1
KILL_ENV = "FEATCAL_DEBUG_KILL_AFTER_BLOCK"  # tests only: SIGKILL this process once block N is finished


class ResumeStateError(ConfigError):
    """A resume directory holds state from another run (other inputs or options), or is unreadable."""


# --- fingerprints -------------------------------------------------------------------------------
def tensor_digest(h: Any, t: torch.Tensor) -> None:
    """Feed a tensor's dtype, shape and raw bytes into hash `h` (works for bf16/fp16)."""
    t = t.detach().contiguous().cpu()
    h.update(f"{t.dtype}:{tuple(t.shape)}:".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def module_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        tensor_digest(h, p)
    return h.hexdigest()


def files_digest(directory: str | os.PathLike) -> str:
    """Identity of a checkpoint directory on disk: weight/config file names, sizes and mtimes (no reading)."""
    d = Path(directory).expanduser().resolve()
    h = hashlib.sha256(str(d).encode())
    for f in sorted(d.iterdir()):
        if f.is_file() and f.suffix in {".safetensors", ".json", ".bin"}:
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def batches_digest(batches: Iterable[Mapping[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for key in sorted(batch):
            h.update(key.encode())
            tensor_digest(h, batch[key])
    return h.hexdigest()


# options added after resume states existed -> their default (the paper's method)
OPTIONS_ADDED_LATER: dict[str, Any] = {"calibrate_final_norm": False, "block_statistics": "as_merged",
                                       "calibrate_stem_norm": False, "tune_fixed": [],
                                       "tune_folds": "auto", "text_unit": None, "data_format": None,
                                       "pack_texts": None, "tune_next_token": True}


def config_digest(config: Any) -> str:
    """The config's JSON, less the fields that say where and when things are kept (not what is computed).

    A run may be resumed with another spill dir, block placement, checkpoint interval or tune cache: the result is
    the same bits either way (and states written before those fields existed keep their digest)."""
    data = config.model_dump(mode="json")
    for k in ("spill_dir", "resume_dir", "resume", "offload_blocks", "checkpoint_every", "tune_cache_gb"):
        data.pop(k, None)
    for k, default in OPTIONS_ADDED_LATER.items():  # at its default: the digest states written before it had
        if data.get(k, default) == default:
            data.pop(k, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# --- context skeletons (JSON, no pickle) ---------------------------------------------------------
def encode_context(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().contiguous().cpu()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise FeatCalError(f"block context {prefix}: non-string keys cannot be checkpointed for resume")
        return {"__dict__": {k: encode_context(v, f"{prefix}.{k}", tensors) for k, v in obj.items()}}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_context(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_context(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise FeatCalError(
        f"block context {prefix} holds a {type(obj).__name__}, which cannot be checkpointed for resume; "
        "run without a resume directory (--no-resume)"
    )


def decode_context(obj: Any, tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
    if isinstance(obj, list):
        return [decode_context(v, tensors, device) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]].to(device)
        if "__tuple__" in obj:
            return tuple(decode_context(v, tensors, device) for v in obj["__tuple__"])
        return {k: decode_context(v, tensors, device) for k, v in obj["__dict__"].items()}
    return obj


# --- the store -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Position:
    """Where a run continues: the next (stack index, layer) and the drift records so far."""

    stack: int
    layer: int
    drift: list[dict[str, Any]]

    @property
    def blocks_done(self) -> int:
        return len(self.drift)


def _key_name(key: tuple) -> str:
    return "-".join(str(k) for k in key)


class ResumeStore:
    """Reads and commits the per-block checkpoints of one rank (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, fingerprint: dict[str, str], *, rank: int = 0, world: int = 1,
                 barrier: Callable[[], None] = lambda: None) -> None:
        base = Path(root).expanduser()
        self.dir = base / f"rank-{rank}-of-{world}" if world > 1 else base
        self.root = base
        self.fingerprint = dict(fingerprint)
        self.barrier = barrier
        self._state: dict[str, Any] | None = None
        self._blocks: set[int] = set()  # block files this store wrote or restored: the only ones it deletes

    # reading
    def _read_state(self) -> dict[str, Any] | None:
        path = self.dir / STATE
        if not path.is_file():
            return None
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ResumeStateError(f"resume state {path} is unreadable ({exc}); delete that file to start again") from None
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ResumeStateError(
                f"{path} is not featcal resume state of this version "
                f"(format {state.get('format') if isinstance(state, dict) else None!r}); "
                "delete it or choose another --resume-dir"
            )
        theirs = state.get("fingerprint", {})
        differ = sorted(k for k in set(theirs) | set(self.fingerprint) if theirs.get(k) != self.fingerprint.get(k))
        if differ:
            raise ResumeStateError(
                f"resume state in {self.root} was made by a run with other inputs or options ({', '.join(differ)} "
                f"differ); rerun with the same ones, or delete {self.dir / STATE} (or choose another --resume-dir) to start again"
            )
        return state

    def available(self) -> list[Position]:
        """The generations this rank can resume from, newest last (empty: start from scratch)."""
        state = self._read_state()
        self._state = state
        if state is None:
            return []
        out = []
        for gen in _generations(self.dir / STATE, state):
            if (self.dir / gen["chains"]).is_dir():
                out.append(Position(gen["stack"], gen["layer"], gen["drift"]))
        return out

    def restore(self, position: Position, put_block: Callable[[int, dict[str, torch.Tensor]], None],
                put_chain: Callable[[tuple, torch.Tensor, Any], None], device: torch.device) -> None:
        """Load the calibrated parameters of every finished block and the chains of `position`."""
        for k in range(position.blocks_done):
            path = self.dir / _block_name(k)
            with _unreadable(path, self.dir):
                put_block(k, load_file(str(path)))
            self._blocks.add(k)
        chains = self.dir / _chains_name(position.blocks_done)
        with _unreadable(chains / "index.json", self.dir):
            index = json.loads((chains / "index.json").read_text())
            if not isinstance(index, list):
                raise ValueError("not a list of chain entries")
        for entry in index:
            with _unreadable(chains / "index.json", self.dir):
                key = tuple(entry["key"])
            path = chains / f"{_key_name(key)}.safetensors"
            with _unreadable(path, self.dir):
                tensors = load_file(str(path))
                ctx = decode_context(entry["context"], tensors, device)
                put_chain(key, tensors["__hidden__"], ctx)
        self._cleanup(keep=_chains_name(position.blocks_done))

    # writing
    def commit(self, position: Position, blocks: Mapping[int, Mapping[str, torch.Tensor]],
               chains: Iterable[tuple[tuple, torch.Tensor, Any]]) -> None:
        """Checkpoint `blocks` (index -> calibrated parameters: every block since the previous
        checkpoint, up to `position.blocks_done - 1`) and the chains that follow them, atomically.
        A write that fails (a full disk: safetensors wraps the OSError) is an OutputWriteError naming the
        resume directory."""
        try:
            self._commit(position, blocks, chains)
        except Exception as exc:
            cause = None if isinstance(exc, FeatCalError) else os_error_of(exc)
            if cause is None:
                raise
            error = OutputWriteError(f"could not write the resume checkpoint in {self.dir}: {cause.strerror or cause}; "
                                     "nothing was written to the output")
            error.errno = cause.errno
            raise error from exc

    def _commit(self, position: Position, blocks: Mapping[int, Mapping[str, torch.Tensor]],
                chains: Iterable[tuple[tuple, torch.Tensor, Any]]) -> None:
        k = position.blocks_done - 1
        if k not in blocks:
            raise FeatCalError(f"resume checkpoint after {position.blocks_done} blocks lacks block {k}")
        make_marked(self.dir)
        for i, params in sorted(blocks.items()):
            self._blocks.add(i)
            _save_atomic(self.dir / _block_name(i), {n: t.detach().contiguous().cpu() for n, t in params.items()})
        name = _chains_name(position.blocks_done)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.dir))
        index = []
        for key, hidden, ctx in chains:
            tensors: dict[str, torch.Tensor] = {}
            skeleton = encode_context(ctx, "c", tensors)
            tensors["__hidden__"] = hidden.detach().contiguous().cpu()
            save_file(tensors, str(tmp / f"{_key_name(key)}.safetensors"))
            index.append({"key": list(key), "context": skeleton})
        (tmp / "index.json").write_text(json.dumps(index))
        final = self.dir / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        previous = [g for g in (self._state or {}).get("generations", []) if g["chains"] != name][-1:]
        gen = {"chains": name, "stack": position.stack, "layer": position.layer, "drift": position.drift}
        self._state = {"format": FORMAT, "fingerprint": self.fingerprint, "generations": [*previous, gen]}
        atomic_write_text(self.dir / STATE, json.dumps(self._state, indent=1))
        _maybe_kill(k)
        self.barrier()  # every rank now holds `name`: the older generation can go
        self._state["generations"] = [gen]
        atomic_write_text(self.dir / STATE, json.dumps(self._state, indent=1))
        self._cleanup(keep=name)

    def passed(self, block: int) -> None:
        """Block `block` finished without a checkpoint (checkpoint_every > 1): nothing is written."""
        _maybe_kill(block)

    def _cleanup(self, keep: str | None) -> None:
        """Remove chain generations other than `keep` and interrupted temporary files (featcal's names only)."""
        for p in self.dir.iterdir():
            ours = _CHAINS.fullmatch(p.name) or (p.name.endswith(".tmp") and _BLOCK.fullmatch(p.name[:-4]))
            if ours and p.name != keep:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    def delete(self) -> None:
        """Remove this run's resume state (after the calibrated checkpoint is safely written, or after an
        error): the files featcal wrote, and the directories it created once they are empty. Anything
        else in a user's `--resume-dir` (their files, the output itself) stays where it is."""
        if not self.dir.is_dir():
            return
        if self._state is not None or self._blocks:  # state.json is ours only once read or written
            with contextlib.suppress(FileNotFoundError):
                (self.dir / STATE).unlink()
        for k in sorted(self._blocks):
            (self.dir / _block_name(k)).unlink(missing_ok=True)
        self._cleanup(keep=None)
        # under torchrun every rank tidies its own folder; whichever is last removes the root
        remove_marked_if_empty(self.dir)


@contextlib.contextmanager
def _unreadable(path: Path, directory: Path) -> Iterator[None]:
    """A resume file that cannot be read back (truncated by a full disk or a crash in another tool, edited,
    missing) is one ResumeStateError naming it, not a library traceback."""
    try:
        yield
    except (FeatCalError, KeyboardInterrupt):
        raise
    except Exception as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise ResumeStateError(f"resume file {path} cannot be read back ({reason}); delete {directory} (or choose "
                               "another --resume-dir) to start again") from None


def _generations(path: Path, state: dict[str, Any]) -> list[dict[str, Any]]:
    """state.json's generations, each checked: its chains directory named after its count of finished blocks,
    a (stack, layer) to continue at, one drift record per finished block."""
    gens = state.get("generations")
    bad = "has no list of generations" if not isinstance(gens, list) else None
    for gen in gens if bad is None else []:
        if not isinstance(gen, dict) or not isinstance(gen.get("drift"), list) \
                or not all(isinstance(r, dict) for r in gen["drift"]):
            bad = f"holds a generation that is no mapping with a list of drift records ({str(gen)[:80]})"
        elif not all(isinstance(gen.get(k), int) and not isinstance(gen.get(k), bool) and gen[k] >= 0
                     for k in ("stack", "layer")):
            bad = f"holds a generation without a valid stack and layer ({str(gen)[:80]})"
        elif gen.get("chains") != _chains_name(len(gen["drift"])):
            bad = f"holds a generation whose chains {gen.get('chains')!r} do not follow its {len(gen['drift'])} block(s)"
        if bad:
            break
    if bad:
        raise ResumeStateError(f"resume state {path} {bad}; delete that file to start again")
    return gens


_CHAINS = re.compile(r"\.?chains-\d{4,}(-\w+)?")  # a generation, or its temporary directory (mkdtemp suffix)
_BLOCK = re.compile(r"block-\d{4,}\.safetensors")


def _chains_name(blocks_done: int) -> str:
    return f"chains-{blocks_done:04d}"


def _block_name(block: int) -> str:
    return f"block-{block:04d}.safetensors"


def _save_atomic(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def _maybe_kill(block: int) -> None:
    """Test hook: `FEATCAL_DEBUG_KILL_AFTER_BLOCK=N` SIGKILLs the process right after block N is finished
    (after its checkpoint is committed, when it gets one)."""
    want = os.environ.get(KILL_ENV)
    if want is not None and want.strip() == str(block):
        log.warning("%s=%s: killing this process (SIGKILL) after block %d", KILL_ENV, want, block)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def common_position(per_rank: list[list[tuple[int, int, int]]]) -> int | None:
    """The most blocks done that every rank can resume from (per rank: (blocks_done, stack, layer))."""
    sets = [{p[0] for p in ps} for ps in per_rank]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None


def default_resume_dir(out: str | os.PathLike) -> Path:
    """Where `featcal calibrate --out OUT` keeps its per-block checkpoints: a hidden sibling of OUT."""
    out = Path(out).expanduser()
    return out.parent / f".{out.name}.featcal-resume"


@contextlib.contextmanager
def discard_on_error(store: ResumeStore | None) -> Iterator[None]:
    """Delete the resume state when the body fails with an error (a rerun would fail the same way, and
    the space may be what ran out); keep it on Ctrl-C / SIGTERM (KeyboardInterrupt), so a rerun resumes."""
    try:
        yield
    except ResumeStateError:
        raise  # the state belongs to another run: never delete it on the user's behalf
    except Exception:
        if store is not None:
            store.delete()
        raise
