"""Tiny on-disk families for the pipeline and CLI tests: base, experts, a Task Arithmetic merge, data.

Holds no tests itself.
"""

from __future__ import annotations

from pathlib import Path

from tests.builders.data_fixtures import (
    CHAT_TEMPLATE,
    save_chat_tokenizer,
    save_image_processor,
    save_tokenizer,
    sentences,
    write_jsonl,
    write_png_folder,
)
from tests.builders.tiny import make_family, tiny_model


def task_arithmetic(kind: str, base_dir: Path, expert_dirs: dict[str, Path], out: Path, scale: float = 0.3) -> Path:
    """θ0 + s·Σ(θt − θ0), written as a checkpoint (the merge is not what these tests examine)."""
    cls = type(tiny_model(kind))
    base = cls.from_pretrained(base_dir).state_dict()
    experts = [cls.from_pretrained(d).state_dict() for d in expert_dirs.values()]
    merged = cls.from_pretrained(base_dir)
    merged.load_state_dict({
        k: v + scale * sum(e[k] - v for e in experts) if v.is_floating_point() else v for k, v in base.items()
    })
    merged.save_pretrained(out)
    return out


def clip_family(root: Path, n_experts: int = 2, n_images: int = 4) -> dict:
    """A CLIPVisionModel family whose image processor lives with the base only, plus image folders."""
    base, experts = make_family("clip", root, n_experts)
    save_image_processor(base)
    merged = task_arithmetic("clip", base, experts, root / "merged")
    data = {t: write_png_folder(root / f"data-{t}", n_per_class=n_images // 2, seed=i) for i, t in enumerate(experts)}
    return {"base": base, "experts": experts, "merged": merged, "data": data}


def bert_family(root: Path, n_experts: int = 2, n_texts: int = 6) -> dict:
    """A BertModel family with its tokenizer saved beside the merge, plus JSONL texts per task."""
    base, experts = make_family("bert", root, n_experts)
    merged = task_arithmetic("bert", base, experts, root / "merged")
    save_tokenizer(merged, "bert")
    data = {
        t: write_jsonl(root / f"{t}.jsonl", [{"text": s} for s in sentences(n_texts, seed=i)])
        for i, t in enumerate(experts)
    }
    return {"base": base, "experts": experts, "merged": merged, "data": data}


def t5_family(root: Path, n_experts: int = 2, n_texts: int = 6) -> dict:
    """A T5ForConditionalGeneration family with a tokenizer, plus JSONL texts with targets per task."""
    base, experts = make_family("t5", root, n_experts)
    merged = task_arithmetic("t5", base, experts, root / "merged")
    save_tokenizer(merged, "t5")
    data = {
        t: write_jsonl(
            root / f"{t}.jsonl",
            [{"text": s, "target": g} for s, g in zip(sentences(n_texts, seed=i), sentences(n_texts, seed=50 + i), strict=True)],
        )
        for i, t in enumerate(experts)
    }
    return {"base": base, "experts": experts, "merged": merged, "data": data}


def llama_family(root: Path, n_experts: int = 2, *, template_with: str = "merged") -> dict:
    """A LlamaForCausalLM family; a chat tokenizer saved with the merge (`template_with="merged"`), or a
    tokenizer without a chat template there and one with it beside every expert (`"experts"`)."""
    base, experts = make_family("llama", root, n_experts)
    merged = task_arithmetic("llama", base, experts, root / "merged")
    on_experts = template_with == "experts"
    save_chat_tokenizer(merged, template=None if on_experts else CHAT_TEMPLATE)
    for d in experts.values() if on_experts else ():
        save_chat_tokenizer(d)
    return {"base": base, "experts": experts, "merged": merged, "data": {}}


def llama_text_family(root: Path, texts: dict[str, list[str]]) -> dict:
    """Two Llama experts (scale 0.2), their Task Arithmetic merge and a T5 tokenizer saved beside every model;
    each task's `texts` as JSONL calibration data."""
    base, experts = make_family("llama", root, len(texts), scale=0.2)
    merged = task_arithmetic("llama", base, experts, root / "merged")
    for d in (base, merged, *experts.values()):
        save_tokenizer(d, "t5")
    data = {t: write_jsonl(root / f"calib-{t}.jsonl", [{"text": s} for s in rows]) for t, rows in texts.items()}
    return {"base": base, "experts": experts, "merged": merged, "data": data}


def saved_model_family(model, root: Path) -> dict:
    """`model` as a base with two perturbed experts and their merge (tiny.family_of), each saved by save_pretrained
    into `root` (the merged folder with a tokenizer), and a JSONL of six texts per task: what the command line
    reads; "merged_model" is the merge in memory."""
    from tests.builders.data_fixtures import save_tokenizer, sentences, write_jsonl
    from tests.builders.tiny import family_of

    base, experts, merged = family_of(model)
    dirs = {"base": root / "base", "merged": root / "merged"}
    base.save_pretrained(dirs["base"])
    merged.save_pretrained(dirs["merged"])
    save_tokenizer(dirs["merged"], "bert")
    for t, e in experts.items():
        e.save_pretrained(root / t)
    return {**dirs, "experts": {t: root / t for t in experts}, "merged_model": merged,
            "data": {t: write_jsonl(root / f"{t}.jsonl", [{"text": s} for s in sentences(6, seed=i)])
                     for i, t in enumerate(experts)}}
