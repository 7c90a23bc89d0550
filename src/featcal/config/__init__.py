"""One validated schema behind the Python API, the CLI flags and YAML run files, cut by concern.

Every option featcal accepts is a field of one of these models, with its default and its valid range, so that
a bad value is rejected with the same message whichever way it arrived, before any work starts:

- base.py: the one strictness rule (`StrictModel`) and `parse`;
- data.py: how calibration data is read and drawn (`DataOptions`, shared by FeatCal, RegMean, bench, reproduce);
- featcal.py: FeatCal's options, by concern (solve, data, execution, resume, tune) -> `FeatCalConfig`;
- method_specs.py, merge.py, methods.py: the merge methods' table (`MethodSpec`), `MergeConfig`, the built-in methods;
- run.py: run options, output options and a run file's sections; files.py: reading a YAML run file.

Everything is importable from `featcal.config` as before the cut.
"""

from featcal.config.base import (
    DEFAULT_MAX_LENGTH,
    MAX_SEED,
    Device,
    FrozenStrictModel,
    StrictModel,
    parse,
    seed_field,
)
from featcal.config.data import (
    DEFAULT_CALIBRATION_EXAMPLES,
    CalibrationOptions,
    DataOptions,
    calibration_options,
    data_field,
)
from featcal.config.featcal import (
    DEFAULT_TUNE_BUDGET,
    DEFAULT_TUNE_HOLDOUT,
    MAX_COVARIANCE_EPS,
    MAX_LAMBDA_RATIO,
    SECTIONS,
    ExecutionOptions,
    FeatCalConfig,
    ResumeOptions,
    SolveOptions,
    TuneKnob,
    TuneOptions,
)
from featcal.config.files import (
    MAX_RUN_FILE_BYTES,
    MAX_RUN_FILE_DEPTH,
    MAX_RUN_FILE_VALUES,
    load_run_file,
    read_run_data,
    run_config,
)
from featcal.config.merge import RECIPE_OPTIONS, Densities, DropRates, MergeConfig, Weight, merge_field
from featcal.config.method_specs import (
    ENTRY_POINT_GROUP,
    MergeMethod,
    MethodKind,
    MethodName,
    MethodSpec,
    add_method,
    find_method,
    is_task_vector_merge,
    load_plugins,
    method_names,
    method_spec,
    own_parameters,
    registered_methods,
    unknown_method_message,
)
from featcal.config.methods import (
    BUILTIN_METHODS,
    CALIBRATED_MERGE_METHODS,
    MERGE_METHODS,
    REPORTED_WHEN_SET,
    TASK_VECTOR_METHODS,
    WHOLE_MODEL_MERGE_METHODS,
    MethodParams,
    ModulePatterns,
    RegMeanParams,
    WudiParams,
    params_model,
)
from featcal.config.run import (
    EXPERT_ENTRY_KEYS,
    CalibrateSpec,
    MergedSpec,
    MergeSpec,
    OutputDtype,
    OutputOptions,
    RunConfig,
    RunOptions,
    check_expert_kinds,
    check_tune_options,
    run_options,
)

__all__ = [
    "BUILTIN_METHODS", "CALIBRATED_MERGE_METHODS", "DEFAULT_CALIBRATION_EXAMPLES", "DEFAULT_MAX_LENGTH",
    "DEFAULT_TUNE_BUDGET", "DEFAULT_TUNE_HOLDOUT", "ENTRY_POINT_GROUP", "EXPERT_ENTRY_KEYS", "MAX_COVARIANCE_EPS", "MAX_LAMBDA_RATIO",
    "MAX_RUN_FILE_BYTES", "MAX_RUN_FILE_DEPTH", "MAX_RUN_FILE_VALUES", "MAX_SEED", "MERGE_METHODS", "RECIPE_OPTIONS",
    "REPORTED_WHEN_SET", "SECTIONS", "TASK_VECTOR_METHODS", "WHOLE_MODEL_MERGE_METHODS", "CalibrateSpec",
    "CalibrationOptions", "DataOptions", "Densities", "Device", "DropRates", "ExecutionOptions", "FeatCalConfig", "FrozenStrictModel",
    "MergeConfig", "MergeMethod", "MergeSpec", "MergedSpec", "MethodKind", "MethodName", "MethodParams",
    "MethodSpec", "ModulePatterns", "OutputDtype", "OutputOptions", "RegMeanParams", "ResumeOptions", "RunConfig",
    "RunOptions", "SolveOptions", "StrictModel", "TuneKnob", "TuneOptions", "Weight", "WudiParams", "add_method",
    "calibration_options", "check_expert_kinds", "check_tune_options", "data_field", "find_method", "is_task_vector_merge", "load_plugins", "load_run_file",
    "merge_field", "method_names", "method_spec", "own_parameters", "params_model", "parse", "read_run_data", "registered_methods",
    "run_config", "run_options", "seed_field", "unknown_method_message",
]
