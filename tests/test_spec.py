"""The job spec: examples load, defaults fill in, round trips hold, errors name fields."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest

from pipetune.errors import SpecError
from pipetune.space import Choice, LogUniform
from pipetune.spec import JobSpec, load_spec
from pipetune.system.config import MachineInfo, SystemConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
TWO_CORES = MachineInfo(cores=2, cuda_devices=0)

MINIMAL = {
    "name": "tiny",
    "workload": {"name": "lenet5", "params": {"train_samples": 100}},
    "hyperparameters": {
        "lr": {"type": "loguniform", "low": 0.001, "high": 0.1},
        "batch_size": {"type": "choice", "values": [32, 64]},
    },
    "search": {"trials": 2},
    "early_stopping": {"max_epochs": 2},
}


def with_change(path: str, value, base=MINIMAL) -> dict:
    """A deep copy of ``base`` with the dotted ``path`` set (``...`` deletes it)."""
    data = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return data


def spec_error(data: dict, machine: MachineInfo = TWO_CORES) -> SpecError:
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(data, machine=machine)
    assert "\n" not in str(info.value)
    return info.value


# -- valid specs ------------------------------------------------------------------------


def test_the_two_main_examples_ship():
    assert {"lenet_digits.yaml", "textcnn_news.yaml"} <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_on_this_machine_and_round_trip(path):
    spec = load_spec(path)
    assert spec.system.default.cores <= MachineInfo.detect().cores
    data = spec.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert JobSpec.from_dict(data) == spec


def test_lenet_example_reads_as_written():
    spec = load_spec(ROOT / "examples" / "lenet_digits.yaml", machine=TWO_CORES)
    assert spec.workload.name == "lenet5"
    assert spec.hyperparameters["lr"] == LogUniform(0.005, 0.2)
    assert spec.hyperparameters["batch_size"] == Choice((32, 64, 128))
    assert spec.system.default == SystemConfig(cores=1)
    assert spec.system.candidates()["cores"] == [SystemConfig(cores=1), SystemConfig(cores=2)]
    assert (spec.search.algorithm, spec.search.trials) == ("tpe", 6)
    assert (spec.early_stopping.policy, spec.early_stopping.max_epochs) == ("asha", 3)


def test_minimal_spec_gets_defaults():
    spec = JobSpec.from_dict(MINIMAL, machine=TWO_CORES)
    assert spec.objective.metric == "accuracy"  # the workload's first metric
    assert (spec.objective.mode, spec.objective.system) == ("max", "time")
    assert spec.system.default == SystemConfig() and spec.system.space == {}
    assert (spec.search.algorithm, spec.search.max_concurrent, spec.search.grid_points) == (
        "tpe",
        1,
        3,
    )
    assert (spec.early_stopping.min_epochs, spec.early_stopping.reduction_factor) == (1, 2)
    assert spec.pipetune.enabled and spec.pipetune.probe_plan == "one_knob"
    assert spec.pipetune.max_probes is None
    assert spec.pipetune.similarity.max_clusters == 8
    assert spec.profiler.perf == "auto"


def test_spec_survives_pickling():
    spec = load_spec(ROOT / "examples" / "lenet_digits.yaml", machine=TWO_CORES)
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_with_overrides_revalidates():
    spec = JobSpec.from_dict(MINIMAL, machine=TWO_CORES)
    changed = spec.with_overrides(trials=5, pipetune_enabled=False, machine=TWO_CORES)
    assert (changed.search.trials, changed.pipetune.enabled) == (5, False)
    assert changed.hyperparameters == spec.hyperparameters and spec.search.trials == 2
    assert spec.with_overrides(machine=TWO_CORES) == spec
    with pytest.raises(SpecError) as info:
        spec.with_overrides(trials=0, machine=TWO_CORES)
    assert (info.value.field, info.value.message) == ("search.trials", "must be >= 1, got 0")


def test_with_overrides_with_nothing_to_change_is_the_same_spec():
    spec = JobSpec.from_dict(MINIMAL, machine=TWO_CORES)
    assert spec.with_overrides() is spec
    assert spec.with_overrides(trials=None, pipetune_enabled=None) is spec
    assert spec.with_overrides(trials=2, pipetune_enabled=True, machine=TWO_CORES) is spec
    assert spec.with_overrides(pipetune_enabled=True) is spec
    changed = spec.with_overrides(trials=2, pipetune_enabled=False, machine=TWO_CORES)
    assert changed is not spec and not changed.pipetune.enabled
    # Equal but not the same type is not "nothing to change": strict fields refuse it.
    for trials in (2.0, True):
        with pytest.raises(SpecError) as info:
            spec.with_overrides(trials=trials, machine=TWO_CORES)
        assert info.value.field == "search.trials"


def test_read_job_file_is_the_raw_mapping_under_the_same_limits(tmp_path):
    from pipetune.spec import read_job_file

    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({**MINIMAL, "extra": {"lr": 1e-3}}))
    assert read_job_file(path) == {**MINIMAL, "extra": {"lr": 1e-3}}
    path.write_text("- a\n- b\n")
    for read in (read_job_file, load_spec):
        with pytest.raises(SpecError) as info:
            read(path)
        assert info.value.message == "a job spec must be a mapping of sections, got ['a', 'b']"
    path.write_text("x: " + "[" * 40 + "]" * 40 + "\n")
    with pytest.raises(SpecError) as info:
        read_job_file(path)
    assert info.value.message == "nested deeper than 32 levels"


def test_floats_in_exponent_form_are_numbers(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: e\nworkload: {name: lenet5}\n"
        "hyperparameters: {lr: {type: loguniform, low: 1e-4, high: 1E-1}}\n"
        "search: {trials: 1}\nearly_stopping: {max_epochs: 1}\n"
    )
    assert load_spec(path, machine=TWO_CORES).hyperparameters["lr"] == LogUniform(1e-4, 0.1)


USER_WORKLOAD = """
from pipetune.workloads import Workload


class F1Only(Workload):
    metrics = ("f1", "val_loss")

    def setup(self, hparams, seed): ...
    batch_size = 8
    def train_epoch(self, system, on_step=None): ...
    def evaluate(self, system): ...
    def predict(self): ...
    def state_dict(self): ...
    def load_state_dict(self, state): ...
"""


def test_user_workload_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_workloads.py").write_text(USER_WORKLOAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = with_change("workload", {"name": "my_workloads:F1Only", "params": {"any": 1}})
    spec = JobSpec.from_dict(data, machine=TWO_CORES)
    assert spec.objective.metric == "f1"
    assert spec.workload.build().params == {"any": 1}
    error = spec_error(with_change("objective.metric", "accuracy", data))
    assert (error.field, error.message) == (
        "objective.metric",
        "must be one of f1, val_loss (what my_workloads:F1Only reports), got 'accuracy'",
    )


# -- invalid specs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "field", "words"),
    [
        ("search.trials", 0, "search.trials", "must be >= 1, got 0"),
        ("search.trials", "8", "search.trials", "must be an integer, got '8'"),
        ("search.trials", ..., "search.trials", "is required"),
        ("search.trails", 3, "search.trails", "unknown field; allowed: algorithm, trials"),
        ("hyperparams", {}, "hyperparams", "unknown field; allowed: name, workload"),
        ("search.algorithm", "bayes", "search.algorithm",
         "one of grid, random, tpe or an import path"),
        ("search.max_concurrent", 0, "search.max_concurrent", ">= 1"),
        ("search", 5, "search", "must be a mapping"),
        ("early_stopping.max_epochs", ..., "early_stopping.max_epochs", "is required"),
        ("early_stopping.min_epochs", 3, "early_stopping.min_epochs", "<= max_epochs (2)"),
        ("early_stopping.reduction_factor", 1, "early_stopping.reduction_factor", ">= 2"),
        ("early_stopping.policy", "median", "early_stopping.policy",
         "one of asha, none or an import path"),
        ("name", "my job", "name", "must match"),
        ("hyperparameters", {}, "hyperparameters", "at least one"),
        ("hyperparameters.lr.low", 0.5, "hyperparameters.lr.low", "< high"),
        (
            "hyperparameters.width",
            {"type": "int", "low": 1, "high": 9},
            "hyperparameters.width",
            "not a hyperparameter of lenet5; allowed: lr",
        ),
        ("workload.name", "resnet9000", "workload.name", "resnet9000"),
        ("workload.name", "no_such_module.x:Thing", "workload.name", "no_such_module"),
        ("workload.params.colour", "red", "workload.params.colour", "allowed"),
        ("workload.params.dataset", "cifar", "workload.params.dataset", "digits"),
        ("objective.metric", "f1", "objective.metric", "accuracy, val_loss"),
        ("objective.mode", "maximize", "objective.mode", "'max' or 'min'"),
        ("objective.system", "power", "objective.system", "'time' or 'energy'"),
        ("system.default.cores", 0, "system.default.cores", ">= 1"),
        ("system.default.cores", 4, "system.default.cores", "this machine has 2"),
        ("system.default.threads", 2, "system.default.threads", "unknown knob"),
        ("system.default", [1], "system.default", "mapping"),
        ("system.space.cores", [4, 8], "system.space.cores", "no value fits: 4, 8 (this machine "
         "has 2 cores)"),
        ("system.space.cores", [], "system.space.cores", "at least one"),
        ("system.space.cores", [1, 1], "system.space.cores", "twice"),
        ("system.space.dataloader_workers", [-1], "system.space.dataloader_workers", ">= 0"),
        ("system.space.precision", ["bf16"], "system.space.precision", "needs native bf16"),
        ("system.space.precision", ["fp16"], "system.space.precision", "needs device: cuda"),
        ("system.space.tf32", [True], "system.space.tf32", "CUDA knob"),
        ("system.space.device", ["cuda"], "system.space.device", "no CUDA device"),
        ("system.space.turbo", [True], "system.space.turbo", "unknown knob; allowed: cores"),
        ("pipetune.probe_plan", "all", "pipetune.probe_plan", "'one_knob'"),
        ("pipetune.max_probes", 0, "pipetune.max_probes", ">= 1"),
        ("pipetune.enabled", "yes", "pipetune.enabled", "true or false"),
        ("pipetune.similarity.bound_factor", 0, "pipetune.similarity.bound_factor", "> 0"),
        ("pipetune.similarity.k", 3, "pipetune.similarity.k", "allowed: max_clusters"),
        ("profiler.perf", "on", "profiler.perf", "'auto' or 'off'"),
        ("profiler.watts_per_core", -1.0, "profiler.watts_per_core", "> 0"),
    ],
)
def test_invalid_field_is_named_with_what_is_allowed(path, value, field, words):
    error = spec_error(with_change(path, value))
    assert error.field == field
    assert words in error.message


def test_a_spec_must_be_a_mapping():
    assert "mapping" in spec_error([1, 2]).message


def test_machine_check_uses_the_machine_given():
    data = with_change("system.space", {"cores": [4, 8]})
    assert spec_error(data).field == "system.space.cores"
    assert JobSpec.from_dict(data, machine=MachineInfo(cores=8)).system.space["cores"][-1] == 8


def test_a_space_value_too_big_for_the_machine_passes_validation_whole():
    """Validation refuses only what cannot run at all: cores=8 on a 2-core machine is
    left in the spec (a study leaves it out, :meth:`JobSpec.fit`)."""
    data = with_change("system.space", {"cores": [1, 2, 8]})
    assert JobSpec.from_dict(data, machine=TWO_CORES).system.space["cores"] == [1, 2, 8]


def test_cuda_knobs_are_fine_on_a_cuda_machine():
    data = with_change("system.default", {"device": "cuda", "precision": "bf16"})
    data = with_change("system.space", {"precision": ["fp32", "fp16"], "tf32": [True]}, data)
    spec = JobSpec.from_dict(data, machine=MachineInfo(cores=2, cuda_devices=1))
    assert spec.system.candidates()["tf32"] == [
        SystemConfig(device="cuda", precision="bf16", tf32=True)
    ]
    assert spec_error(data).field == "system.default.device"


# -- files ------------------------------------------------------------------------------


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nsearch: {trials: 2\nearly_stopping: {max_epochs: 1}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert "invalid YAML at line" in info.value.message
    assert "\n" not in str(info.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "nope.yaml")
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    with pytest.raises(SpecError, match="empty"):
        load_spec(tmp_path / "empty.yaml")
