"""``pipetune ui``'s Prefect side: the flow runs of this folder's studies, beside the
MLflow UI, from one command.

Where they are served already, nothing starts: your Prefect server
(``PREFECT_API_URL``), or this folder's warm local service (``pipetune service``).
Otherwise a local Prefect server starts over the pipetune home's Prefect database, as
``pipetune tune`` starts one (light: the settings of :mod:`pipetune.prefect_server`),
beside the MLflow UI's start, and stops with it.
"""

from __future__ import annotations

import os
import threading
from typing import Any


class PrefectUi:
    """The Prefect UI for ``pipetune ui``: found or started in the background
    (:meth:`begin`), its lines printed once it answers (:meth:`lines`)."""

    def __init__(self) -> None:
        self.url = ""  # the UI's address, once known
        self.whose = ""  # what serves it, in words
        self.error: str | None = None
        self.server: Any = None  # a server started here
        self._thread: threading.Thread | None = None

    @classmethod
    def begin(cls) -> PrefectUi:
        ui = cls()
        api = os.environ.get("PREFECT_API_URL", "").strip()
        warm = _warm_service_api()
        if api:
            ui.url, ui.whose = api.removesuffix("/").removesuffix("/api"), "your Prefect server"
        elif warm:
            ui.url, ui.whose = warm.removesuffix("/api"), "the warm local service"
        else:
            ui._thread = threading.Thread(target=ui._start, name="pipetune-prefect-ui",
                                          daemon=True)
            ui._thread.start()
        return ui

    def _start(self) -> None:
        from pipetune.home import pipetune_home
        from pipetune.prefect_server import LocalPrefectServer

        try:
            server = LocalPrefectServer(log_path=pipetune_home() / "prefect-ui.log")
            self.server = server
            server.start()
            self.url, self.whose = server.api_url.removesuffix("/api"), "started here"
        except Exception as e:  # noqa: BLE001 - said as one line; MLflow's UI goes on
            self.error = f"{type(e).__name__}: {e}"

    def lines(self, flow_run_id: str | None, timeout: float) -> list[str]:
        """What to print: where the flow runs are, and the study's own flow run."""
        if self._thread is not None:
            self._thread.join(timeout)
        if not self.url:
            why = self.error or f"it did not answer within {timeout:.0f} s"
            return [f"Prefect UI not started ({why}); `prefect server start` serves it"]
        said = [f"Prefect UI ({self.whose}), the studies' flow runs: {self.url}/runs"]
        if flow_run_id:
            said.append(f"  its flow run: {self.url}/runs/flow-run/{flow_run_id}")
        return said

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join(30)
        if self.server is not None:
            self.server.stop()


def _warm_service_api() -> str:
    """The Prefect API of this folder's warm service, where one is alive."""
    from pipetune.service import services

    here = os.path.realpath(os.getcwd())
    for record in services():
        if record.get("alive") and os.path.realpath(record.get("cwd", "")) == here:
            return str(record.get("api_url") or "")
    return ""
