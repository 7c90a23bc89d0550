"""The options of `featcal eval` / featcal.evaluate, validated once whichever way they arrive."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from featcal.config import MAX_SEED, FrozenStrictModel

DEFAULT_TEMPLATE = "a photo of a {}."


class EvalOptions(FrozenStrictModel):
    """How the tasks are read and the models run; none of it changes what a metric means."""

    concern: ClassVar[str] = "evaluation options"

    batch_size: int = Field(16, ge=1, description="examples per forward (batches are length-sorted)")
    # 512, not calibration's DEFAULT_MAX_LENGTH (128): a score must read the whole of a test text, a calibration
    # sample need not (and changing it would change every evaluation figure made since)
    max_length: int = Field(512, ge=1, description="truncate texts to this many tokens")
    max_examples: int | None = Field(None, ge=1, description="evaluate a seeded subset of this many examples per task")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the --max-examples subset")
    split: str | None = Field(None, description="the split of a saved DatasetDict to evaluate on")
    text_column: str | None = Field(None, description="the column holding the input texts")
    text_unit: Literal["line", "paragraph", "file"] | None = Field(
        None, description="one example per line, paragraph or file of a text file or folder (as calibration reads "
        "it; default: paragraph for a file, file for a folder)")
    data_format: Literal["image", "text"] | None = Field(
        None, description="read a folder holding several kinds of files for its images or its text, or any file "
        "as plain text")
    text_unit: Literal["line", "paragraph", "file"] | None = Field(
        None, description="one example per line, paragraph or file of a text file or folder (as calibration reads "
        "it; default: paragraph for a file, file for a folder)")
    data_format: Literal["image", "text"] | None = Field(
        None, description="read a folder holding several kinds of files for its images or its text, or any file "
        "as plain text")
    label_column: str | None = Field(None, description="the column holding the labels (default: label)")
    target_column: str | None = Field(None, description="the column holding the target texts (default: target)")
    templates: tuple[str, ...] = Field((DEFAULT_TEMPLATE,), min_length=1,
                                       description="zero-shot prompt templates, each with one {} for the class name",
                                       json_schema_extra={"flag": "--template", "repeat": True, "metavar": "TEXT"})
    processor: str | None = Field(None, description="tokenizer / image processor folder for models saved without one")
    allow_calibration_overlap: bool = Field(
        False, description="score a calibrated model on examples it was calibrated on (flagged in the outputs)"
    )
    allow_pickle: bool = Field(False, description="accept pickled (*.bin) checkpoints (read with weights_only)")
    device: str = Field("cpu", description="torch device the models run on")

    @field_validator("templates")
    @classmethod
    def _one_placeholder(cls, templates: tuple[str, ...]) -> tuple[str, ...]:
        for t in templates:
            try:
                ok = t.count("{}") == 1 and t.format("x") is not None
            except (IndexError, KeyError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"template {t!r} must hold exactly one {{}} (where the class name goes)")
        return templates
