"""``examples/notebook.ipynb`` executed in a real Jupyter kernel (nbclient), as a user
runs it: a model defined in the notebook tuned in a few lines, a progress bar, a
DataFrame, and the study in MLflow."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebook.ipynb"


def _text(output) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    return str(output.get("data", {}).get("text/plain", ""))


@pytest.mark.slow
def test_the_notebook_tunes_its_own_model_with_a_bar_and_gets_dataframes(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("PIPETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    tuning = [c for c in nb.cells if c.cell_type == "code" and "pipetune.tune(" in c.source]
    assert len(tuning) == 1
    # The study, tuned in under 10 lines of the notebook (its model in the cell before).
    lines = [line for line in tuning[0].source.splitlines() if line.strip()]
    assert len(lines) < 10
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    said = "".join(_text(o) for o in tuning[0].outputs)
    assert "pipetune: 100%" in said and "6/6" in said  # the bar, to its end
    assert "TuneResult(study notebook-digits-" in said and "best accuracy=" in said
    assert "Warning" not in "".join(_text(o) for o in outputs)
    trials_cell = next(c for c in nb.cells if c.source.strip() == "result.trials_dataframe()")
    (table,) = [o for o in trials_cell.outputs if o.output_type == "execute_result"]
    assert "text/html" in table.data and "params.lr" in table.data["text/html"]
    assert "system.interop_threads" in table.data["text/html"]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (study,) = client.search_runs(
        [client.get_experiment_by_name("pipetune").experiment_id],
        "tags.`pipetune.kind` = 'study'")
    assert study.info.status == "FINISHED"
    assert study.data.params["workload"].startswith("pipetune.workloads.shipped:mlp_")
    trials = client.search_runs([study.info.experiment_id],
                                f"tags.mlflow.parentRunId = '{study.info.run_id}'")
    assert len(trials) == 6
