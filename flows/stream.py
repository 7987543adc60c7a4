"""A stream of tuning jobs (the paper's online scenario) submitted to a deployment.

Jobs arrive as a Poisson process: exponential gaps between arrivals at ``rate`` jobs
per minute, drawn from a seeded generator, each arrival picking one of the given job
files. Every arrival becomes a flow run of the study deployment (created with
``run_deployment``, so the server checks its parameters), all pointed at one MLflow
store and one ground truth. Jobs queue at the work pool (its concurrency limit, 1 in
``deployments/README.md``), so a job's response time is

    response = queue wait (scheduled -> running) + tuning time (running -> done)

both read from the flow runs the Prefect server recorded. Run the same stream with
``pipetune=False`` to compare against hyperparameter-only tuning.

The arrival process and the timing arithmetic are plain functions
(:func:`poisson_arrivals`, :func:`job_timing`, :func:`summarize`); :func:`stream_flow`
only wires them to Prefect.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger
from pydantic import Field

from flows.params import TrialsOverride
from pipetune.confine import Confinement, enforced

#: The deployment streams submit to unless told otherwise (deployments/prefect.yaml).
DEFAULT_DEPLOYMENT = "pipetune-study/on-demand"

#: Small jobs of three workloads, in the repository's examples folder.
DEFAULT_JOBS = tuple(
    str(Path(__file__).resolve().parents[1] / "examples" / name)
    for name in ("tiny_synthetic.yaml", "tiny_lenet.yaml", "tiny_textcnn.yaml")
)


@dataclass(frozen=True)
class Arrival:
    """Job ``index`` arrives ``at_s`` seconds after the stream starts, running ``job``."""

    index: int
    at_s: float
    job: str


def poisson_arrivals(
    rate_per_min: float, jobs: int, seed: int, job_files: Sequence[str]
) -> list[Arrival]:
    """``jobs`` arrivals of a Poisson process with ``rate_per_min`` jobs per minute.

    Gaps are exponential with mean ``60 / rate_per_min`` seconds; each arrival picks
    a job file uniformly. The same arguments give the same stream.

    >>> [round(a.at_s, 1) for a in poisson_arrivals(6.0, 3, seed=1, job_files=["a.yaml"])]
    [1.4, 20.2, 34.7]
    """
    if rate_per_min <= 0:
        raise ValueError(f"rate_per_min must be > 0, got {rate_per_min}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if not job_files:
        raise ValueError("job_files must name at least one job file")
    gaps = random.Random(seed)
    picks = random.Random(seed + 1)  # separate, so adding a job file keeps the timings
    arrivals: list[Arrival] = []
    t = 0.0
    for i in range(jobs):
        t += gaps.expovariate(rate_per_min / 60.0)
        arrivals.append(Arrival(i, t, job_files[picks.randrange(len(job_files))]))
    return arrivals


@dataclass(frozen=True)
class JobTiming:
    """How one submitted job went, from its flow run (times in seconds).

    ``queue_wait_s``: scheduled -> running (``None`` if it never started);
    ``tuning_s``: running -> end; ``response_s``: scheduled -> end (their sum).
    ``probe_epochs`` / ``groundtruth_hits`` come from the MLflow parent run when found.
    """

    index: int
    job: str
    pipetune: bool
    flow_run_id: str
    flow_run_name: str
    state: str
    arrival_s: float
    queue_wait_s: float | None
    tuning_s: float | None
    response_s: float | None
    probe_epochs: float | None = None
    groundtruth_hits: float | None = None
    parent_run_id: str | None = None


def _seconds(later: datetime | None, earlier: datetime | None) -> float | None:
    if later is None or earlier is None:
        return None
    return (later - earlier).total_seconds()


def job_timing(arrival: Arrival, flow_run: Any, *, pipetune: bool) -> JobTiming:
    """The timing of ``arrival`` from its (final) Prefect ``flow_run``.

    The run was created scheduled for "now" at arrival, so its expected start time is
    the arrival time on the server's clock; start and end are when it entered and
    left the Running state.
    """
    scheduled = flow_run.expected_start_time
    started = flow_run.start_time
    ended = flow_run.end_time
    return JobTiming(
        index=arrival.index,
        job=arrival.job,
        pipetune=pipetune,
        flow_run_id=str(flow_run.id),
        flow_run_name=flow_run.name,
        state=flow_run.state.name if flow_run.state else "UNKNOWN",
        arrival_s=arrival.at_s,
        queue_wait_s=_seconds(started, scheduled),
        tuning_s=_seconds(ended, started),
        response_s=_seconds(ended, scheduled),
    )


def summarize(timings: Sequence[JobTiming]) -> dict[str, float]:
    """Means (and the 95th percentile of response) over the jobs that completed."""
    done = [t for t in timings if t.state == "Completed" and t.response_s is not None]
    out: dict[str, float] = {"jobs": float(len(timings)), "completed": float(len(done))}
    if not done:
        return out
    response = sorted(t.response_s for t in done)
    out["mean_queue_wait_s"] = statistics.fmean(t.queue_wait_s for t in done)
    out["mean_tuning_s"] = statistics.fmean(t.tuning_s for t in done)
    out["mean_response_s"] = statistics.fmean(response)
    out["p95_response_s"] = response[min(len(response) - 1, round(0.95 * (len(response) - 1)))]
    probes = [t.probe_epochs for t in done if t.probe_epochs is not None]
    if probes:
        out["probe_epochs"] = float(sum(probes))
    hits = [t.groundtruth_hits for t in done if t.groundtruth_hits is not None]
    if hits:
        out["groundtruth_hits"] = float(sum(hits))
    return out


def _study_records(tracking_uri: str, flow_run_ids: Sequence[str]) -> dict[str, Any]:
    """MLflow parent runs of the given flow runs, by flow-run id."""
    from mlflow.tracking import MlflowClient

    from pipetune.tracking import DEFAULT_EXPERIMENT

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(DEFAULT_EXPERIMENT)
    if experiment is None:
        return {}
    found: dict[str, Any] = {}
    for run_id in flow_run_ids:
        runs = client.search_runs(
            [experiment.experiment_id],
            filter_string=(
                f"tags.`prefect.flow_run_id` = '{run_id}' and tags.`pipetune.kind` = 'study'"
            ),
            max_results=1,
        )
        if runs:
            found[run_id] = runs[0]
    return found


def confine_stream(
    job_files: Sequence[str],
    tracking_uri: str | None,
    *,
    from_deployment: bool,
    job_variables: Mapping[str, Any] | None = None,
    policy: Confinement | None = None,
) -> tuple[list[str], Confinement | None]:
    """The job files a stream run reads, checked (absolute and resolved) against the
    worker's :class:`~pipetune.confine.Confinement` when the stream itself runs from a
    deployment, and that policy (``None`` otherwise). Its ``tracking_uri`` is checked
    too (the stream writes the MLflow experiment); ``groundtruth_path`` goes on to the
    study runs, which check it."""
    if not from_deployment:
        return list(job_files), None
    from pipetune.tracking import default_tracking_uri

    policy = policy or Confinement.from_env()
    policy.check_job_variables(job_variables)
    checked = [policy.check_path(f"job_files.{i}", path, expanduser=False)
               for i, path in enumerate(job_files)]
    if tracking_uri and tracking_uri != default_tracking_uri():
        policy.check_tracking_uri("tracking_uri", tracking_uri)
    return checked, policy


@flow(name="pipetune-stream", log_prints=False)
def stream_flow(
    job_files: list[str],
    rate_per_min: Annotated[float, Field(gt=0)] = 2.0,
    jobs: Annotated[int, Field(ge=1)] = 6,
    seed: int = 0,
    deployment: str = DEFAULT_DEPLOYMENT,
    pipetune: bool = True,
    trials: TrialsOverride = None,
    tracking_uri: str | None = None,
    groundtruth_path: str | None = None,
    poll_s: Annotated[float, Field(gt=0)] = 2.0,
    timeout_s: Annotated[float, Field(gt=0)] | None = None,
) -> dict[str, Any]:
    """Submit ``jobs`` Poisson arrivals of ``job_files`` to ``deployment`` and wait.

    Each job file is read and checked here, then sent inline (so the flow run does
    not depend on this process's working directory). Returns ``{"jobs": [JobTiming
    as dict, ...], "summary": summarize(...)}``.
    """
    from prefect.runtime import deployment as this_deployment
    from prefect.runtime import flow_run as this_run

    from pipetune.spec import load_spec
    from pipetune.tracking import default_tracking_uri, ensure_experiment

    logger = get_run_logger()
    from_deployment = bool(this_deployment.id)
    job_files, policy = confine_stream(
        job_files, tracking_uri, from_deployment=from_deployment,
        job_variables=this_run.job_variables if from_deployment else None)
    with enforced(policy):  # each job file's import-path workload checked, then imported
        specs = {path: load_spec(path).to_dict() for path in dict.fromkeys(job_files)}
    tracking_uri = tracking_uri or default_tracking_uri()
    ensure_experiment(tracking_uri)  # once, before the flow runs fan out
    arrivals = poisson_arrivals(rate_per_min, jobs, seed, job_files)
    submitted = _submit_arrivals(
        arrivals, specs, deployment=deployment, pipetune=pipetune, trials=trials,
        tracking_uri=tracking_uri, groundtruth_path=groundtruth_path, seed=seed, logger=logger)
    finished = _wait_until_final(submitted, poll_s=poll_s, timeout_s=timeout_s)
    timings = _job_timings(submitted, finished, tracking_uri=tracking_uri, pipetune=pipetune)
    return {"jobs": [asdict(t) for t in timings], "summary": summarize(timings)}


def _submit_arrivals(
    arrivals: Sequence[Arrival],
    specs: Mapping[str, dict[str, Any]],
    *,
    deployment: str,
    pipetune: bool,
    trials: int | None,
    tracking_uri: str,
    groundtruth_path: str | None,
    seed: int,
    logger: Any,
) -> list[tuple[Arrival, Any]]:
    """Each arrival, at its time, as a flow run of ``deployment``; the flow runs
    created, in order."""
    from prefect.deployments import run_deployment

    mode = "pipetune" if pipetune else "no-pipetune"
    submitted: list[tuple[Arrival, Any]] = []
    start = time.monotonic()
    for arrival in arrivals:
        time.sleep(max(0.0, arrival.at_s - (time.monotonic() - start)))
        parameters: dict[str, Any] = {
            "job": specs[arrival.job],
            "pipetune": pipetune,
            "tracking_uri": tracking_uri,
        }
        if trials is not None:
            parameters["trials"] = trials
        if groundtruth_path is not None:
            parameters["groundtruth_path"] = groundtruth_path
        flow_run = run_deployment(
            deployment,
            parameters=parameters,
            timeout=0,
            tags=["pipetune-stream", mode],
            flow_run_name=f"stream-{seed}-{mode}-job{arrival.index}",
        )
        logger.info("t=%.1fs job %d (%s) -> flow run %s", arrival.at_s, arrival.index,
                    arrival.job, flow_run.name)
        submitted.append((arrival, flow_run))
    return submitted


def _wait_until_final(
    submitted: Sequence[tuple[Arrival, Any]], *, poll_s: float, timeout_s: float | None
) -> dict[str, Any]:
    """Poll the server every ``poll_s`` until every submitted flow run is final; the
    final flow runs by id. :class:`TimeoutError` after ``timeout_s``."""
    from prefect.client.orchestration import get_client

    finished: dict[str, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while len(finished) < len(submitted):
            for _, run in submitted:
                if str(run.id) in finished:
                    continue
                current = client.read_flow_run(run.id)
                if current.state is not None and current.state.is_final():
                    finished[str(run.id)] = current
            if len(finished) == len(submitted):
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(submitted) - len(finished)} of {len(submitted)} stream jobs "
                    f"still running after {timeout_s:.0f} s"
                )
            time.sleep(poll_s)
    return finished


def _job_timings(
    submitted: Sequence[tuple[Arrival, Any]], finished: Mapping[str, Any], *,
    tracking_uri: str, pipetune: bool,
) -> list[JobTiming]:
    """Each submitted job's timing, with its study's probe epochs and ground-truth hits
    from its MLflow parent run when found."""
    records = _study_records(tracking_uri, list(finished))
    timings = []
    for arrival, run in submitted:
        timing = job_timing(arrival, finished[str(run.id)], pipetune=pipetune)
        record = records.get(str(run.id))
        if record is not None:
            metrics = record.data.metrics
            timing = JobTiming(**{
                **asdict(timing),
                "probe_epochs": metrics.get("study_probe_epochs"),
                "groundtruth_hits": metrics.get("study_groundtruth_hits"),
                "parent_run_id": record.info.run_id,
            })
        timings.append(timing)
    return timings
