"""``pipetune bench``: PipeTune against hyperparameter-only tuning, joint tuning and the oracle.

Pure logic, no Prefect: ``flows/bench.py`` runs the studies; this package says what to
run and what the numbers mean. One module per reason to change:

==============  ======================================================================
``jobs``        reading a bench job file and its ``bench`` section (data root,
                fallback data, ``--quick`` sizes, the optuna-plain target)
``strategies``  the strategies as job-spec transformations, and the oracle's plan
``ray_tune``    strategy ``ray-tune``: Ray Tune on the same workload code, in a fresh
                process (``python -m pipetune.bench.ray_tune``; the ``peers`` extra)
``results``     what a study measured, the results table with its ratios and target
                checks, the JSON form
``report``      the markdown tables, the figures, the files written to the out folder
``tracker``     the bench's MLflow runs (experiment ``pipetune-bench``)
==============  ======================================================================

The names below are re-exported here; import them from :mod:`pipetune.bench`.
"""

from __future__ import annotations

from pipetune.bench.jobs import (
    OPTUNA_TARGET,
    BenchJob,
    load_bench_job,
    quick_overrides,
    resolve_data_params,
)
from pipetune.bench.report import (
    machine_description,
    markdown,
    metric_time_figure,
    tuning_time_figure,
    write_report,
)
from pipetune.bench.results import (
    BenchResult,
    OracleRow,
    StrategyResult,
    best_params_overall,
    oracle_rows,
    result_from_optuna,
    result_from_study,
)
from pipetune.bench.strategies import (
    GROUNDTRUTH_USE,
    ORACLE,
    PEERS,
    REFERENCE,
    STRATEGIES,
    oracle_spec,
    peer_unavailable,
    strategy_spec,
    system_axes,
)
from pipetune.bench.tracker import BENCH_EXPERIMENT, BenchTracker

__all__ = [
    "BENCH_EXPERIMENT",
    "GROUNDTRUTH_USE",
    "OPTUNA_TARGET",
    "ORACLE",
    "PEERS",
    "REFERENCE",
    "STRATEGIES",
    "BenchJob",
    "BenchResult",
    "BenchTracker",
    "OracleRow",
    "StrategyResult",
    "best_params_overall",
    "load_bench_job",
    "machine_description",
    "markdown",
    "metric_time_figure",
    "oracle_rows",
    "oracle_spec",
    "peer_unavailable",
    "quick_overrides",
    "resolve_data_params",
    "result_from_optuna",
    "result_from_study",
    "strategy_spec",
    "system_axes",
    "tuning_time_figure",
    "write_report",
]
