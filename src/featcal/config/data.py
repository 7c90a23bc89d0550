"""How calibration data is read and drawn: one options model for every reader of it (FeatCal, the RegMean
merges, bench and reproduce), so that an option means the same, with the same default, everywhere."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from featcal.config.base import DEFAULT_MAX_LENGTH, StrictModel, parse, seed_field

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


class CalibrationOptions(DataOptions):
    """Everything that decides how calibration data is read, in one frozen value: the DataOptions, the run's
    `max_length` and `allow_fewer`, and whether `num_calibration_examples` was asked for (a requirement) or left at
    its default (a ceiling). What `featcal.data.open_calibration` takes; `calibration_options` builds it from a
    FeatCalConfig or MergeConfig and the run's options."""

    model_config = ConfigDict(frozen=True, validate_assignment=False)
    concern: ClassVar[str] = "reading calibration data (docs/data.md)"

    max_length: int = Field(DEFAULT_MAX_LENGTH, description="truncate calibration texts to this many tokens")
    allow_fewer: bool = Field(
        False, description="use all examples of a task holding fewer than num_calibration_examples (with a warning)"
    )
    num_examples_explicit: bool = Field(
        False, description="num_calibration_examples was asked for (fewer refused unless allow_fewer); unset: whether "
        "it was given"
    )

    @model_validator(mode="before")
    @classmethod
    def _explicit_when_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and "num_examples_explicit" not in data:
            data = {**data, "num_examples_explicit": "num_calibration_examples" in data}
        return data

    @field_validator("max_length")
    @classmethod
    def _at_least_one(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_length must be at least 1, got {v}")
        return v

    def report(self) -> dict[str, Any]:
        """The options as a merge's featcal.json records them: the DataOptions, max_length, allow_fewer."""
        return self.model_dump(exclude={"num_examples_explicit"})


def calibration_options(config: DataOptions, *, max_length: int = DEFAULT_MAX_LENGTH,
                        allow_fewer: bool = False) -> CalibrationOptions:
    """The CalibrationOptions a FeatCalConfig or MergeConfig (any DataOptions) and the run's options set: the one
    place the configs are mapped onto the data seam. ConfigError on a bad value."""
    values = {name: getattr(config, name) for name in DataOptions.model_fields}
    return parse(CalibrationOptions, {
        **values, "max_length": max_length, "allow_fewer": allow_fewer,
        "num_examples_explicit": "num_calibration_examples" in config.model_fields_set,
    })


def data_field(name: str, **changes: Any) -> Any:
    """DataOptions' field `name` for a model that takes one of its options on its own (featcal reproduce), with
    `changes` (FieldInfo keywords: another default, say) applied."""
    from pydantic.fields import FieldInfo

    info = DataOptions.model_fields[name]
    return FieldInfo.merge_field_infos(info, **changes) if changes else info
