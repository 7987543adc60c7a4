"""The bench driver: each strategy of :mod:`pipetune.bench` as one real study flow.

Every strategy runs :func:`flows.study.study_flow` (its own flow run, its own
embedded Dask cluster, its own MLflow study run), one after the other, so the
strategies see the same machine in turn. The driver captures each study's engine
through the progress listener (the flow runs in this process) to read the per-epoch
figures the flow's summary does not return: orchestration overhead, the epoch times
of the best trial, the oracle's per-config training times.

A strategy that fails (the study flow refuses or stops on a broken workload with a
:class:`~pipetune.errors.PipetuneError`; the Optuna child process fails, or every one
of its trials does) is recorded as failed with its one-line reason, and the bench goes
on with the next one. Anything else (Ctrl-C, a bug) ends the bench.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipetune.bench import (
    GROUNDTRUTH_USE,
    ORACLE,
    STRATEGIES,
    BenchJob,
    BenchResult,
    BenchTracker,
    StrategyResult,
    best_params_overall,
    machine_description,
    oracle_rows,
    oracle_spec,
    result_from_study,
    strategy_spec,
    write_report,
)
from pipetune.bench.peer_process import OptunaRunFailed
from pipetune.bench.ray_tune import RayTuneRunFailed
from pipetune.dask.address import default_address
from pipetune.errors import BrokenWorkload, PipetuneError
from pipetune.spec import JobSpec
from pipetune.system.config import MachineInfo
from pipetune.tracking.links import ui_base_url


def _say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_study(
    spec: JobSpec,
    *,
    name: str,
    tracking_uri: str,
    checkpoint_root: str,
    groundtruth_path: str,
    dask_address: str | None = None,
    seen: list[Any] | None = None,
) -> tuple[dict[str, Any], Any]:
    """Run one study flow on the cluster at ``dask_address`` (default: this process's
    embedded cluster, started once and shared by every strategy); return its summary
    and the engine it drove. ``seen`` collects the engines the flow drove (the study
    of a flow that raised is its last)."""
    from flows.study import study_flow
    from pipetune.session import collecting_opened

    seen = [] if seen is None else seen
    with collecting_opened(seen):
        summary = study_flow.with_options(flow_run_name=f"bench-{name}")(
            job=spec.to_dict(),
            dask_address=dask_address,
            tracking_uri=tracking_uri,
            checkpoint_root=checkpoint_root,
            groundtruth_path=groundtruth_path,
        )
    study = next((s for s in seen if s.study_id == summary["study_id"]), None)
    if study is None:
        raise RuntimeError(f"study {summary['study_id']} ran but its engine was not seen")
    return summary, study


OPTUNA = ("optuna-plain", "optuna-compiled")


def run_optuna_plain(spec: JobSpec, out: Path, *, cores: int,
                     name: str = "optuna-plain") -> StrategyResult:
    """The user's alternative, in a fresh process so its whole-process time is honest;
    compiling (``optuna-compiled``) into a fresh compile cache of its own."""
    import os

    from pipetune.bench import result_from_optuna
    from pipetune.bench.peer_process import run_subprocess

    job_file = out / f"{name}-job.json"
    job_file.write_text(json.dumps(spec.to_dict()))  # JSON is YAML: load_spec reads it
    cache = out / f"compile-cache-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "PIPETUNE_SET_INDUCTOR_CACHE"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return result_from_optuna(run_subprocess(job_file, n_jobs=cores, env=env), name)


def run_ray_tune(spec: JobSpec, out: Path, *, cores: int) -> StrategyResult:
    """Strategy ray-tune: Ray Tune in a fresh process, so its whole-process time
    (imports, Ray's own processes) is honest. A child that cannot import Ray Tune is a
    failed strategy with its one line."""
    from pipetune.bench.ray_tune import STRATEGY, RayTuneUnavailable, run_subprocess
    from pipetune.bench.results import result_from_optuna

    job_file = out / "ray-tune-job.json"
    job_file.write_text(json.dumps(spec.to_dict()))  # JSON is YAML: load_spec reads it
    try:
        return result_from_optuna(run_subprocess(job_file, n_jobs=cores), STRATEGY)
    except RayTuneUnavailable as e:
        return StrategyResult.failure("ray-tune", e.line)


def _failure_reason(error: PipetuneError | OptunaRunFailed | RayTuneRunFailed) -> str:
    """One line: what a broken workload or a failed Optuna or Ray Tune child said, else
    the refusal with its type."""
    if isinstance(error, OptunaRunFailed):
        return f"the Optuna process exited {error.exit_code}: {error.reason}"
    if isinstance(error, RayTuneRunFailed):
        return f"the Ray Tune process exited {error.exit_code}: {error.reason}"
    if isinstance(error, BrokenWorkload):
        return str(error)
    return f"{type(error).__name__}: {error}"


def run_bench(
    job: BenchJob,
    *,
    out_dir: str | Path,
    tracking_uri: str,
    command: str,
    strategies: Sequence[str] = STRATEGIES,
    oracle: bool = True,
    dask_address: str | None = None,
    machine: MachineInfo | None = None,
) -> tuple[BenchResult, dict[str, Path]]:
    """Run ``strategies`` (then the oracle) on ``job``; write the report to ``out_dir``
    and the bench to MLflow. Returns the result and the report's paths. A strategy that
    fails is in the result as failed (:attr:`StrategyResult.failed`, its reason) and
    the bench goes on; the oracle runs when some strategy found best params."""
    machine = machine or MachineInfo.detect()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # On a cluster of other hosts the workers cannot reach this folder: the studies then
    # use the default store ($PIPETUNE_CHECKPOINTS: on a team stack, the MLflow proxy).
    remote = bool(dask_address or default_address())
    checkpoint_root = None if remote else str(out / "checkpoints")
    tracker = BenchTracker(tracking_uri, job, command=command)
    started = time.time()
    results: list[StrategyResult] = []
    bench = _new_bench_result(job, machine, command, tracker, results)
    run = _BenchRun(job=job, machine=machine, out=out, tracking_uri=tracking_uri,
                    dask_address=dask_address, checkpoint_root=checkpoint_root, tracker=tracker)
    try:
        for name in strategies:
            run.strategy(name, results)
        params = best_params_overall(results, job.spec.objective.mode)
        if oracle and params is None:
            _say("oracle: skipped, no strategy found best params")
        if oracle and params is not None:
            run.oracle(bench, params)
        bench.bench_wall_s = time.time() - started
        paths = write_report(bench, out, ui_base=ui_base_url(tracking_uri))
        tracker.finish(bench, paths)
    except BaseException:
        tracker.fail()
        raise
    return bench, paths


def _new_bench_result(job: BenchJob, machine: MachineInfo, command: str,
                      tracker: BenchTracker, results: list[StrategyResult]) -> BenchResult:
    """The bench's result before anything ran: ``results`` fills in as strategies end."""
    return BenchResult(
        job=job.spec.name, metric=str(job.spec.objective.metric), mode=job.spec.objective.mode,
        data=job.data, quick=job.quick, machine=machine_description(machine), command=command,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), strategies=results,
        bench_run_id=tracker.run_id, optuna_target=job.optuna_target,
    )


@dataclasses.dataclass
class _BenchRun:
    """What every strategy and the oracle of one bench share: the job, the machine,
    where they write (checkpoints, ground truth) and what records them."""

    job: BenchJob
    machine: MachineInfo
    out: Path
    tracking_uri: str
    dask_address: str | None
    checkpoint_root: str | None
    tracker: BenchTracker

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    @property
    def groundtruth(self) -> Path:
        return self.out / "groundtruth.json"

    def strategy(self, name: str, results: list[StrategyResult]) -> None:
        """Run strategy ``name``; add its result (failed, with its reason, when it
        refused or broke) to ``results`` and log it."""
        spec: JobSpec | None = None
        seen: list[Any] = []
        call_started = time.time()
        try:
            spec = self._strategy_spec(name)
            result = self._run_strategy(name, spec, seen, call_started)
        except (PipetuneError, OptunaRunFailed, RayTuneRunFailed) as e:
            run_id = self.tracker.study_run_of(seen[-1].study_id) if seen else None
            result = StrategyResult.failure(name, _failure_reason(e), study_run_id=run_id)
        finally:
            shutil.rmtree(self.checkpoints, ignore_errors=True)
        results.append(result)
        self.tracker.log_strategy(result, spec)
        if result.failed is not None:
            _say(f"{name}: FAILED after {time.time() - call_started:.1f} s, going on: "
                 f"{result.failed}")
        else:
            _say(f"{name}: {result.tuning_wall_s:.1f} s, best {result.best_value}, "
                 f"{result.epochs_run} epochs ({result.probe_epochs} probes), "
                 f"system [{result.chosen_system}]")

    def _strategy_spec(self, name: str) -> JobSpec:
        spec = strategy_spec(name, self.job.spec, self.machine)
        if spec.pipetune.enabled:  # cold compiles into a fresh cache, warm reuses it
            spec = spec.model_copy(update={"pipetune": spec.pipetune.model_copy(
                update={"compile_cache": f"bench-{self.tracker.run_id[:12]}"})})
        return spec

    def _run_strategy(self, name: str, spec: JobSpec, seen: list[Any],
                      call_started: float) -> StrategyResult:
        if GROUNDTRUTH_USE[name] == "fresh" and self.groundtruth.exists():
            self.groundtruth.unlink()
        _say(f"{name}: {spec.search.trials} trials, default "
             f"[{spec.system.default.label()}], max_concurrent "
             f"{spec.search.max_concurrent}, pipetune "
             f"{'on' if spec.pipetune.enabled else 'off'}")
        if name in OPTUNA:
            return run_optuna_plain(spec, self.out, cores=self.machine.cores, name=name)
        if name == "ray-tune":
            return run_ray_tune(spec, self.out, cores=self.machine.cores)
        summary, study = run_study(
            spec, name=name, tracking_uri=self.tracking_uri,
            checkpoint_root=self.checkpoint_root, groundtruth_path=str(self.groundtruth),
            dask_address=self.dask_address, seen=seen,
        )
        return dataclasses.replace(
            result_from_study(name, study, summary["tuning_wall_s"], summary["parent_run_id"]),
            process_wall_s=time.time() - call_started)

    def oracle(self, bench: BenchResult, params: dict[str, Any]) -> None:
        """The best params found under each system config; into ``bench.oracle``."""
        spec = oracle_spec(self.job.spec, params, self.machine)
        _say(f"oracle: {params} under {spec.search.trials} system configs")
        o_started = time.time()
        summary, study = run_study(
            spec, name=ORACLE, tracking_uri=self.tracking_uri,
            checkpoint_root=self.checkpoint_root, groundtruth_path=str(self.groundtruth),
            dask_address=self.dask_address,
        )
        bench.oracle = oracle_rows(study)
        bench.oracle_params = params
        bench.oracle_wall_s = time.time() - o_started
        client = self.tracker.client
        client.set_tag(summary["parent_run_id"], "pipetune.bench_run_id", self.tracker.run_id)
        client.set_tag(summary["parent_run_id"], "pipetune.bench_strategy", ORACLE)
        shutil.rmtree(self.checkpoints, ignore_errors=True)
