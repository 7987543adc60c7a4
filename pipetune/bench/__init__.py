"""``pipetune bench``: PipeTune against hyperparameter-only tuning, joint tuning and the oracle.

Pure logic, no Prefect: ``flows/bench.py`` runs the studies; this package says what to
run and what the numbers mean. One module per reason to change:

==============  ======================================================================
``jobs``        reading a bench job file and its ``bench`` section (data root,
                fallback data, ``--quick`` sizes, the optuna-plain target)
``strategies``  the strategies as job-spec transformations, and the oracle's plan
``optuna_plain`` strategies ``optuna-plain`` and ``optuna-compiled``: plain Optuna on
                the same workload code, in a fresh process with nothing of Prefect, Dask
                or MLflow (``python -m pipetune.bench.optuna_plain``)
``ray_tune``    strategy ``ray-tune``: Ray Tune on the same workload code, in a fresh
                process (``python -m pipetune.bench.ray_tune``; the ``peers`` extra)
``results``     what a study measured, the results table with its ratios and target
                checks, the JSON form
``report``      the markdown tables, the figures, the files written to the out folder
``tracker``     the bench's MLflow runs (experiment ``pipetune-bench``)
==============  ======================================================================

The names below are re-exported here, loaded on first use (a peer's fresh process,
``python -m pipetune.bench.optuna_plain``, imports only what it runs); import them from
:mod:`pipetune.bench`.
"""

from __future__ import annotations

from pipetune.lazy import lazy_names

_WHERE = {
    "BENCH_EXPERIMENT": "pipetune.bench.tracker",
    "BenchJob": "pipetune.bench.jobs",
    "BenchResult": "pipetune.bench.results",
    "BenchTracker": "pipetune.bench.tracker",
    "GROUNDTRUTH_USE": "pipetune.bench.strategies",
    "OPTUNA_TARGET": "pipetune.bench.jobs",
    "ORACLE": "pipetune.bench.strategies",
    "OracleRow": "pipetune.bench.results",
    "PEERS": "pipetune.bench.strategies",
    "REFERENCE": "pipetune.bench.strategies",
    "STRATEGIES": "pipetune.bench.strategies",
    "StrategyResult": "pipetune.bench.results",
    "best_params_overall": "pipetune.bench.results",
    "load_bench_job": "pipetune.bench.jobs",
    "machine_description": "pipetune.bench.report",
    "markdown": "pipetune.bench.report",
    "metric_time_figure": "pipetune.bench.report",
    "oracle_rows": "pipetune.bench.results",
    "oracle_spec": "pipetune.bench.strategies",
    "peer_unavailable": "pipetune.bench.strategies",
    "quick_overrides": "pipetune.bench.jobs",
    "resolve_data_params": "pipetune.bench.jobs",
    "result_from_optuna": "pipetune.bench.results",
    "result_from_study": "pipetune.bench.results",
    "strategy_spec": "pipetune.bench.strategies",
    "system_axes": "pipetune.bench.strategies",
    "tuning_time_figure": "pipetune.bench.report",
    "write_report": "pipetune.bench.report",
}

__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
