"""The bench report: the markdown tables, the two figures (matplotlib, imported only
when drawn) and the files :func:`write_report` leaves in the output folder."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipetune.bench.results import BenchResult
from pipetune.system.config import MachineInfo


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def markdown(bench: BenchResult, *, ui_base: str | None = None) -> str:
    """The bench as markdown: setup, strategy table (a failed strategy: ``FAILED`` and
    no figures, its reason in the list below the table), oracle table, targets. With
    ``ui_base`` (:func:`pipetune.tracking.links.ui_base_url`), the bench run is a link
    into the MLflow UI."""
    lines = [
        f"### {bench.job}{' (quick)' if bench.quick else ''}",
        "",
        f"- date: {bench.date}",
        f"- machine: {bench.machine}",
        f"- command: `{bench.command}`",
        f"- data: {bench.data}",
    ]
    if bench.bench_wall_s is not None:
        lines.append(f"- whole bench wall time: {bench.bench_wall_s:.0f} s")
    if bench.bench_run_id:
        line = f"- MLflow bench run: `{bench.bench_run_id}` (experiment `pipetune-bench`)"
        if ui_base:
            from pipetune.tracking.links import run_url

            line += f": <{run_url(ui_base, bench.bench_run_id)}>"
        lines.append(line)
    lines += ["", "| strategy | tuning s | process s | vs optuna | vs V1 | best " + bench.metric
              + " | epochs | probes | GT hits | energy J | vs V1 | chosen system | train s "
              "| vs V1 | vs oracle | overhead |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for row in bench.table():
        lines.append(
            "| {strategy} | {t} | {ps} | {tp} | {tr} | {m} | {e} | {p} | {gt} | {en} "
            "| {er} | {sys} | {ts} | {tv} | {to} | {oh} |".format(
                strategy=row["strategy"] + (" (FAILED)" if row["failed"] else ""),
                t=_fmt(row["tuning_wall_s"], 1),
                ps=_fmt(row["process_wall_s"], 1), tp=_fmt(row["tuning_vs_optuna"]),
                tr=_fmt(row["tuning_vs_v1"]), m=_fmt(row[f"best_{bench.metric}"], 4),
                e=_fmt(row["epochs_run"]), p=_fmt(row["probe_epochs"]), gt=row["gt_hits"],
                en="-" if row["failed"] else
                f"{_fmt(row['energy_j'], 0)} ({row['energy_source']})",
                er=_fmt(row["energy_vs_v1"]), sys=row["chosen_system"],
                ts=_fmt(row["train_s"], 1), tv=_fmt(row["train_vs_v1"]),
                to=_fmt(row["train_vs_oracle"]),
                oh=f"{row['overhead_share']:.1%}" if not math.isnan(row["overhead_share"]) else "-",
            )
        )
    if bench.failed:
        lines += ["", "Failed (left out of every ratio):", ""]
        lines += [f"- {s.strategy} FAILED: {s.failed}" for s in bench.failed]
    ran = [s for s in bench.strategies if s.failed is None]
    if ran:
        lines += ["", "Orchestration overhead (seconds summed over epochs; share = overhead / "
                  "(overhead + epoch compute)):", "",
                  "| strategy | epoch compute s | overhead s | median per epoch s | round trip s "
                  "| worker rebuild + checkpoint s | loop gap s | share |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in ran:
        parts = s.overhead_parts_s
        lines.append(
            f"| {s.strategy} | {_fmt(s.compute_s, 1)} | {_fmt(s.overhead_s, 1)} | "
            f"{_fmt(s.overhead_median_s)} | {_fmt(parts.get('round_trip_s'), 1)} | "
            f"{_fmt(parts.get('worker_extra_s'), 1)} | {_fmt(parts.get('loop_gap_s'), 1)} | "
            + (f"{s.overhead_share:.1%} |" if not math.isnan(s.overhead_share) else "- |")
        )
    if bench.oracle:
        lines += ["", f"Oracle: params {json.dumps(bench.oracle_params, sort_keys=True)}, "
                  f"each config alone for the full epochs"
                  + (f" ({bench.oracle_wall_s:.0f} s)" if bench.oracle_wall_s else "") + ":", "",
                  f"| system | train s | s/epoch | energy J | {bench.metric} |",
                  "|---|---:|---:|---:|---:|"]
        for o in bench.oracle:
            lines.append(f"| {o.system} | {o.train_s:.1f} | {o.epoch_s:.2f} | {o.energy_j:.0f} "
                         f"| {_fmt(o.value, 4)} |")
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    for t in bench.targets():
        lines.append(f"| {t['target']} | {t['measured']} | {t['met']} |")
    return "\n".join(lines) + "\n"


def tuning_time_figure(bench: BenchResult):
    """Bar chart: tuning wall time per strategy; a failed one is an empty bar marked
    ``failed``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5))
    ax = fig.add_subplot()
    names = [s.strategy for s in bench.strategies]
    values = [0.0 if s.failed else s.tuning_wall_s for s in bench.strategies]
    bars = ax.bar(names, values, color=["#888" if n.startswith("v") else "#1f77b4" for n in names])
    for bar, v, s in zip(bars, values, bench.strategies, strict=True):
        ax.annotate("failed" if s.failed else f"{v:.0f}",
                    (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                    fontsize=8, color="#c00" if s.failed else "black")
    ax.set_ylabel("tuning wall time (s)")
    ax.set_title(f"{bench.job}: tuning time per strategy")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


def metric_time_figure(bench: BenchResult):
    """Scatter: best metric reached against tuning wall time, one point per strategy."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    markers = "osD^v<>"
    for i, s in enumerate(bench.strategies):
        if s.best_value is not None:
            # A legend, not labels: strategies often reach the same metric at similar times.
            ax.scatter([s.tuning_wall_s], [s.best_value], s=50, marker=markers[i % len(markers)],
                       label=s.strategy, alpha=0.8)
    if ax.collections:
        ax.legend(fontsize=8, loc="best")
    ax.set_xlabel("tuning wall time (s)")
    ax.set_ylabel(f"best {bench.metric}")
    ax.set_title(f"{bench.job}: best {bench.metric} vs tuning time")
    fig.tight_layout()
    return fig


def write_report(bench: BenchResult, out_dir: str | Path, *,
                 ui_base: str | None = None) -> dict[str, Path]:
    """Write ``results.md``, ``results.json``, ``tuning_time.png`` and
    ``metric_vs_time.png`` to ``out_dir``; returns the paths by kind. ``ui_base``: as
    for :func:`markdown`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": out / "results.md",
        "json": out / "results.json",
        "tuning_time": out / "tuning_time.png",
        "metric_vs_time": out / "metric_vs_time.png",
    }
    paths["markdown"].write_text(markdown(bench, ui_base=ui_base), encoding="utf-8")
    paths["json"].write_text(json.dumps(bench.to_json(), indent=2, default=str), encoding="utf-8")
    tuning_time_figure(bench).savefig(paths["tuning_time"], dpi=110)
    metric_time_figure(bench).savefig(paths["metric_vs_time"], dpi=110)
    return paths


def machine_description(machine: MachineInfo | None = None) -> str:
    """``"2 cores (Intel(R) Xeon ...), 0 CUDA devices, Linux 6.x"``."""
    import platform

    machine = machine or MachineInfo.detect()
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{machine.cores} cores ({model or 'unknown CPU'}), {machine.cuda_devices} CUDA "
            f"devices, {platform.system()} {platform.release()}")
