"""GGUF files (llama.cpp's format) as merge and calibration inputs, dequantised to float32.

Why: small decoders are often published only as GGUF (SmolLM2, Gemma 3 in the offline set). featcal
reads them through transformers' own GGUF loader (`load_gguf_checkpoint`, the one behind
`from_pretrained(dir, gguf_file=...)`, which also undoes llama.cpp's q/k permutation) and holds the
dequantised model in memory: GGUF blocks are quantised in groups, so there is no tensor-by-tensor
streaming to gain, and these models are small. The model is built by featcal (a fresh model of the
config's built-in class, `trust_remote_code` never), so `accelerate` is not needed; the `gguf`
package is (`pip install gguf`, or `pip install 'featcal[gguf]'`). What is written is always
safetensors; featcal.json marks each such input `dequantised_from_gguf`.

A `.gguf` path, or a folder holding exactly one `.gguf` and no safetensors weights, is a GGUF input.
Refused before any work: a truncated or unreadable file, an architecture transformers cannot read
from GGUF, an expert GGUF of another architecture than the base (checked from its header, before
it is dequantised), several `.gguf` files in one folder.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from featcal.errors import CheckpointError
from featcal.io.read.sources import ModuleSource
from featcal.io.read.tensor_source import DictSource
from featcal.io.read.validate import config_differences, describe_differences

log = logging.getLogger(__name__)
_BLOCK = re.compile(r"(?:^|\.)blk\.(\d+)\.")

INSTALL_HINT = "pip install gguf (or pip install 'featcal[gguf]')"


def gguf_file(path: Any) -> Path | None:
    """The GGUF file a merge/calibration input names, or None when it is no GGUF input."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    p = Path(path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p
    if not p.is_dir() or any(not f.name.startswith("adapter_model") for f in p.glob("*.safetensors")):
        return None
    found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() == ".gguf")
    if len(found) > 1:
        raise CheckpointError(f"{p} holds several GGUF files ({', '.join(f.name for f in found)}); name the one to read")
    return found[0] if found else None


def require_gguf() -> None:
    """Refuse, with the command that fixes it, when the `gguf` package is missing."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise CheckpointError(f"reading GGUF files needs the gguf package: {INSTALL_HINT}") from None


# (resolved path, size, mtime) -> config: transformers parses every header field in Python (the tokenizer's
# tokens and merges too), ~15 s for SmolLM2; checks and calibration ask for one file's config several times
_CONFIGS: dict[tuple[str, int, int], Any] = {}


def gguf_config(file: Path, label: str):
    """The transformers config in a GGUF header (no tensor is read), with `architectures` set."""
    import copy

    require_gguf()  # before the cache: dequantising needs the package whatever the header says
    st = file.stat()
    key = (str(file.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CONFIGS:
        if len(_CONFIGS) >= 32:  # configs are small; the bound only keeps a long-lived process tidy
            _CONFIGS.clear()
        _CONFIGS[key] = _read_config(file, label)
    return copy.deepcopy(_CONFIGS[key])


def _read_config(file: Path, label: str):
    import transformers

    blocks = _header_blocks(file, label)  # parsed by gguf itself first: its errors say what is wrong
    try:
        config = transformers.AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name,
                                                       trust_remote_code=False)
    except Exception as exc:  # truncated header, unsupported architecture, not a GGUF file
        reason = " ".join(str(exc).split())[:300]
        raise CheckpointError(f"{label}: cannot read the GGUF file {file}: {reason} (truncated or not GGUF?)") from None
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # dequantised: the output is plain float weights
    claimed = max(getattr(config, "num_hidden_layers", 0) or 0, getattr(config, "num_decoder_layers", 0) or 0)
    if blocks is not None and claimed != blocks:
        raise CheckpointError(f"{label}: the GGUF file {file} claims {claimed} blocks in its header but holds "
                              f"tensors of {blocks}; the file is inconsistent")
    if not getattr(config, "architectures", None):
        config.architectures = [_model_class(config).__name__]
    return config


def _header_blocks(file: Path, label: str) -> int | None:
    """How many blocks (`blk.N.` in llama.cpp's tensor names) the file holds tensors for, from its header; the
    header parsed with the gguf package, so that a malformed one is named as such (transformers reports any
    failure as "not a valid JSON file"). None when the names hold no blocks."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise CheckpointError(f"{label}: the GGUF header of {file} cannot be parsed ({reason}): the file is truncated, "
                              "corrupt or not GGUF (an entry may claim more bytes than the file holds)") from None
    indices = {int(m.group(1)) for t in reader.tensors for m in [_BLOCK.search(t.name)] if m}
    del reader  # its memory map
    return max(indices) + 1 if indices else None


def _model_class(config) -> type:
    """The config's built-in class for a language model (GGUF files hold decoders and T5s), else AutoModel's."""
    import transformers

    from featcal.io.read.models import model_class_for

    cls = model_class_for(config)
    if cls is not transformers.AutoModel:
        return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForSeq2SeqLM, transformers.AutoModel):
        try:
            return auto._model_mapping[type(config)]
        except KeyError:
            continue
    raise CheckpointError(f"no transformers model class for a {type(config).__name__}")


def load_gguf_model(file: Path, label: str, config=None) -> torch.nn.Module:
    """The GGUF file's model, dequantised to float32 (transformers' GGUF tensor loader, no accelerate)."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from featcal.io.read.param_sources import parameter_aliases

    config = config if config is not None else gguf_config(file, label)
    cls = _model_class(config)
    with torch.device("meta"):
        layout = cls(config)  # tells the loader which GGUF name is which parameter
    bar = hf_gguf.tqdm  # its per-tensor bar ignores --no-progress; featcal logs the file instead
    hf_gguf.tqdm = functools.partial(bar, disable=True)
    try:
        tensors = hf_gguf.load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=layout,
                                               torch_dtype=torch.float32)["tensors"]
    except Exception as exc:
        reason = " ".join(str(exc).split())[:300]
        raise CheckpointError(f"{label}: cannot dequantise the GGUF file {file}: {reason} (truncated?)") from None
    finally:
        hf_gguf.tqdm = bar
    expected = layout.state_dict()
    for name in sorted(tensors):  # before the model is built: a header may claim far larger shapes than the file
        want = expected.get(name)
        if want is not None and tuple(want.shape) != tuple(tensors[name].shape):
            raise CheckpointError(f"{label}: the GGUF file {file} holds {name!r} with shape {tuple(tensors[name].shape)} "
                                  f"but its header's config makes it {tuple(want.shape)}; the file is inconsistent")
    model = cls(config).to(torch.float32)
    result = model.load_state_dict(tensors, strict=False)
    tied = {n for names in parameter_aliases(model).values() for n in names[1:]}
    buffers = {n for n, _ in model.named_buffers()}
    missing = [n for n in result.missing_keys if n not in tied and n not in buffers]
    if missing:
        raise CheckpointError(
            f"{label}: the GGUF file {file} lacks {len(missing)} tensor(s) of a {cls.__name__}, e.g. {missing[0]!r}"
        )
    model.tie_weights()
    return model.eval()


class GGUFSource(ModuleSource):
    """A GGUF input, dequantised: an in-memory model whose `path` is the file and whose report says so."""

    def __init__(self, file: Path, label: str, config=None) -> None:
        self.file = Path(file)
        super().__init__(load_gguf_model(self.file, label, config), label=str(self.file))
        self.path = self.file

    def describe(self) -> dict[str, Any]:
        from featcal.io.read.hashes import file_sha256

        return {"path": str(self.file), "sha256": {self.file.name: file_sha256(self.file)},
                "dequantised_from_gguf": True, "dtype": "float32"}

    def save_config(self, directory: Path) -> None:
        """config.json (+ generation config) and, when transformers can rebuild it, the GGUF's tokenizer."""
        super().save_config(directory)
        save_gguf_tokenizer(self.file, directory)


class GGUFHeader(ModuleSource):
    """A GGUF input's names, shapes and config without dequantising it (a model on the meta device):
    what the header checks need; `get` refuses, since there are no values."""

    def __init__(self, file: Path, label: str) -> None:  # no ModuleSource.__init__: it copies tensors to the CPU
        from transformers.modeling_utils import remove_tied_weights_from_state_dict, revert_weight_conversion

        from featcal.io.read.sources import module_config

        config = gguf_config(file, label)
        with torch.device("meta"):
            model = _model_class(config)(config)
        state = remove_tied_weights_from_state_dict(dict(model.state_dict()), model)
        # the names checkpoint_state_dict gives GGUFSource
        DictSource.__init__(self, revert_weight_conversion(model, state), str(file))
        self.module, self.path = model, Path(file)
        self._config = module_config(model)

    def get(self, name: str) -> torch.Tensor:
        raise CheckpointError(f"{self.path}: the GGUF header holds no values (dequantise it with GGUFSource)")


def save_gguf_tokenizer(file: Path, directory: Path) -> bool:
    """Write the tokenizer stored in a GGUF file into `directory`; False (logged) when it cannot be rebuilt."""
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name,
                                                             trust_remote_code=False)
        tokenizer.save_pretrained(directory)
        return True
    except Exception as exc:
        log.warning("%s: its tokenizer could not be rebuilt (%s); the output has no tokenizer files", file,
                    " ".join(str(exc).split())[:200])
        return False


def open_gguf(item: Any, label: str, base: Any | None = None, *, header_only: bool = False
              ) -> GGUFSource | GGUFHeader | None:
    """A GGUF input as a source, or None when `item` is no GGUF input.

    An expert's architecture is compared with the base's from the header, before it is dequantised;
    `header_only`: names, shapes and config only (GGUFHeader), nothing dequantised.
    """
    try:
        file = gguf_file(item)
    except CheckpointError as exc:
        raise CheckpointError(f"{label}: {exc}") from None
    if file is None:
        return None
    config = gguf_config(file, label)
    if base is not None:
        want = base.config.get("model_type")
        if want is not None and config.model_type != want:
            raise CheckpointError(
                f"{label}: the GGUF file {file} holds a {config.model_type} model but the base is {want}; "
                "experts must be fine-tunes of the base architecture"
            )
        found = config_differences(base.config, config.to_dict())  # before anything is built from the header:
        if found:  # its head count also decides how q/k rows are un-permuted
            raise CheckpointError(f"{label}: the GGUF file {file} has in its header config "
                                  f"{describe_differences(found)}; experts must share the base's architecture")
    if header_only:
        return GGUFHeader(file, label)
    log.info("%s: dequantising %s to float32", label, file)
    return GGUFSource(file, label, config)
