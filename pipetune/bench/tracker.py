"""The bench in MLflow (experiment ``pipetune-bench``), beside the study runs that
:mod:`pipetune.tracking` writes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pipetune.bench.report import machine_description

if TYPE_CHECKING:
    from pipetune.bench.jobs import BenchJob
    from pipetune.bench.results import BenchResult, StrategyResult
    from pipetune.spec import JobSpec

#: Experiment the bench parent run and its per-strategy child runs are filed under.
BENCH_EXPERIMENT = "pipetune-bench"


class BenchTracker:
    """The bench in MLflow: one parent run holding the comparison, one child run per
    strategy. Each strategy's own study run (experiment ``pipetune``) is linked both
    ways: tag ``pipetune.bench_run_id`` on the study run, ``pipetune.study_run_id`` on
    the strategy's child run."""

    def __init__(self, tracking_uri: str, job: BenchJob, *, command: str):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        from pipetune.tracking import ensure_experiment

        self.client = MlflowClient(tracking_uri)
        self.experiment_id = ensure_experiment(tracking_uri, BENCH_EXPERIMENT)
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"bench-{job.spec.name}{'-quick' if job.quick else ''}",
            tags={"pipetune.kind": "bench", "pipetune.job": job.spec.name},
        )
        self.run_id: str = run.info.run_id
        self.client.log_batch(self.run_id, params=[
            Param("job", job.spec.name), Param("job_file", job.path),
            Param("quick", str(job.quick)), Param("data", job.data[:500]),
            Param("command", command[:500]), Param("machine", machine_description()[:500]),
        ])
        self.client.log_dict(self.run_id, job.spec.to_dict(), "job.json")

    def log_strategy(self, result: StrategyResult, spec: JobSpec | None) -> str:
        """A child run for one strategy's result; tags its study run with this bench.
        A failed strategy's run ends ``FAILED``, tagged ``pipetune.failure`` with its
        reason (``spec``: None when the strategy failed before it had one)."""
        import time

        from mlflow.entities import Metric, Param

        tags = {"mlflow.parentRunId": self.run_id, "pipetune.kind": "bench-strategy",
                "pipetune.strategy": result.strategy}
        if result.failed is not None:
            tags["pipetune.failure"] = result.failed[:5000]
        if result.study_run_id:
            tags["pipetune.study_run_id"] = result.study_run_id
            self.client.set_tag(result.study_run_id, "pipetune.bench_run_id", self.run_id)
            self.client.set_tag(result.study_run_id, "pipetune.bench_strategy", result.strategy)
        run = self.client.create_run(self.experiment_id, run_name=result.strategy, tags=tags)
        ts = int(time.time() * 1000)
        values = {
            "tuning_wall_s": result.tuning_wall_s, "epochs_run": result.epochs_run,
            "probe_epochs": result.probe_epochs, "groundtruth_hits": result.groundtruth_hits,
            "energy_j": result.energy_j, "overhead_share": result.overhead_share,
            "overhead_median_s": result.overhead_median_s,
        }
        if result.best_value is not None:
            values["best_value"] = result.best_value
        if result.process_wall_s is not None:
            values["process_wall_s"] = result.process_wall_s
        if result.best_epoch_s_in_study is not None:
            values["best_epoch_s_in_study"] = result.best_epoch_s_in_study
        if result.failed is not None:  # no figures: zeros would read as measured
            values = {}
        params = [Param("chosen_system", result.chosen_system or "-"),
                  Param("energy_source", result.energy_source)]
        if spec is not None:
            params += [Param("system.default", spec.system.default.label()),
                       Param("pipetune.enabled", str(spec.pipetune.enabled)),
                       Param("search.max_concurrent", str(spec.search.max_concurrent))]
        self.client.log_batch(
            run.info.run_id,
            metrics=[Metric(k, float(v), ts, 0) for k, v in values.items()
                     if not math.isnan(float(v))],
            params=params,
        )
        self.client.set_terminated(
            run.info.run_id, status="FINISHED" if result.failed is None else "FAILED")
        return run.info.run_id

    def study_run_of(self, study_id: str) -> str | None:
        """The MLflow run of study ``study_id`` (tag ``pipetune.study_id``, experiment
        ``pipetune``), or None: how a study that failed is linked to its strategy."""
        from pipetune.tracking import DEFAULT_EXPERIMENT

        experiment = self.client.get_experiment_by_name(DEFAULT_EXPERIMENT)
        if experiment is None:
            return None
        runs = self.client.search_runs(
            [experiment.experiment_id], f"tags.`pipetune.study_id` = '{study_id}'",
            max_results=1)
        return runs[0].info.run_id if runs else None

    def finish(self, bench: BenchResult, paths: Mapping[str, Path]) -> None:
        """The comparison on the parent run: per-strategy metrics and ratios, the
        report files as artifacts, tag ``pipetune.failed_strategies`` (comma-separated)
        when some failed. The run ends ``FINISHED``: the report is whole."""
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = []
        for row in bench.table():
            for key in ("tuning_wall_s", "tuning_vs_v1", "energy_vs_v1", "train_s",
                        "train_vs_v1", "train_vs_oracle", "overhead_share"):
                v = row[key]
                if v is not None and not math.isnan(float(v)):
                    metrics.append(Metric(f"{row['strategy']}.{key}", float(v), ts, 0))
            v = row[f"best_{bench.metric}"]
            if v is not None:
                metrics.append(Metric(f"{row['strategy']}.best_value", float(v), ts, 0))
        if bench.oracle_best_s is not None:
            metrics.append(Metric("oracle.best_train_s", bench.oracle_best_s, ts, 0))
        if bench.bench_wall_s is not None:
            metrics.append(Metric("bench_wall_s", bench.bench_wall_s, ts, 0))
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)
        if bench.failed:
            self.client.set_tag(self.run_id, "pipetune.failed_strategies",
                                ",".join(s.strategy for s in bench.failed))
        for path in paths.values():
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, status="FINISHED")

    def fail(self) -> None:
        self.client.set_terminated(self.run_id, status="FAILED")
