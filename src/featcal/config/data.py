"""How calibration data is read and drawn: one options model for every reader of it (FeatCal, the RegMean
merges, bench and reproduce), so that an option means the same, with the same default, everywhere."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from featcal.config.base import StrictModel, seed_field

DEFAULT_CALIBRATION_EXAMPLES = 256


class DataOptions(StrictModel):
    """Which calibration examples are drawn from each task's data and how a source is read (docs/data.md)."""

    concern: ClassVar[str] = "calibration data (docs/data.md)"

    num_calibration_examples: int = Field(
        DEFAULT_CALIBRATION_EXAMPLES, ge=1, description="examples per task; left at the default, a task holding "
        "fewer uses them all (with a warning), while a number given is required (fewer are refused unless "
        "--allow-fewer)"
    )
    calibration_batch_size: int = Field(16, ge=1, description="examples per forward")
    seed: int = seed_field("which calibration examples are drawn")
    text_column: str | None = Field(
        None, min_length=1, description="the column of JSONL / parquet / saved-dataset data holding the texts; "
        "unset: a column named text, sentence, ..., else the one candidate string column (several are refused)",
    )
    allow_test_split: bool = Field(
        False, description="accept a saved dataset of test data (its only split 'test', or saved from a test "
        "split) as calibration data"
    )
    text_unit: Literal["line", "paragraph", "file"] | None = Field(
        None, description="one example of a plain-text file: a line, a blank-line paragraph or a whole file; unset: "
        "a folder's files, a single file's paragraphs (docs/data.md)"
    )
    data_format: Literal["image", "text"] | None = Field(
        None, description="read a folder holding several kinds of files as its images or its text files, or any "
        "file as plain text; unset: known from the folder's content or the file's suffix"
    )
    pack_texts: bool | None = Field(
        None, description="concatenate documents and cut them into max_length-token windows; unset: plain-text "
        "files read by a decoder (a causal LM) are packed, everything else is one example per record"
    )


def data_field(name: str, **changes: Any) -> Any:
    """DataOptions' field `name` for a model that takes one of its options on its own (featcal reproduce), with
    `changes` (FieldInfo keywords: another default, say) applied."""
    from pydantic.fields import FieldInfo

    info = DataOptions.model_fields[name]
    return FieldInfo.merge_field_infos(info, **changes) if changes else info
