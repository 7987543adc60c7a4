"""Checkpoint store: one checkpoint per trial epoch, at a local folder or any fsspec URL.

Tasks pass *references* (URL strings), never model bytes, so a retried or resumed
epoch starts from the last checkpoint wherever it runs.

Writing is off the critical path: :meth:`CheckpointStore.save_async` snapshots the
state in the caller's thread (a memory copy) and a background thread of the process
serialises and writes it, so the epoch's result goes back while the bytes travel. A
reader elsewhere that gets there first waits for the file (:meth:`load`'s
``wait_s``); a reader in the same process waits for the pending write itself.
"""

from __future__ import annotations

import copy
import io
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.errors import PipetuneError

if TYPE_CHECKING:
    from pipetune.workloads._base import Workload

#: How long a reader waits for a checkpoint another process is still writing.
DEFAULT_WAIT_S = 60.0


class _Writer:
    """One background writer thread per process, created on first use."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()

    def submit(self, ref: str, state: dict[str, Any]) -> Future:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pipetune-checkpoints")
            future = self._pool.submit(CheckpointStore.write_state, state, ref)
            self._pending[ref] = future
        future.add_done_callback(lambda _f, ref=ref: self._forget(ref, _f))
        return future

    def _forget(self, ref: str, future: Future) -> None:
        with self._lock:
            if self._pending.get(ref) is future:
                del self._pending[ref]

    def pending(self, ref: str) -> Future | None:
        with self._lock:
            return self._pending.get(ref)

    def flush(self) -> None:
        """Wait for every write this process queued; raise the first that failed."""
        with self._lock:
            futures = list(self._pending.values())
        for future in futures:
            future.result()


_WRITER = _Writer()


def flush_checkpoints() -> None:
    """Block until this process's background checkpoint writes are on storage."""
    _WRITER.flush()


class CheckpointStore:
    """Checkpoints under ``root`` (a folder path or fsspec URL such as ``s3://bucket/x``).

    >>> store = CheckpointStore("/tmp/ckpts")
    >>> store.ref("study-1", 3, 2)
    '/tmp/ckpts/study-1/trial-003/epoch-002.pt'
    """

    def __init__(self, root: str | Path):
        self.root = str(root).rstrip("/")

    def ref(self, study_id: str, trial_id: int, epoch: int) -> str:
        return f"{self.root}/{study_id}/trial-{trial_id:03d}/epoch-{epoch:03d}.pt"

    @staticmethod
    def write_state(state: dict[str, Any], ref: str) -> None:
        import fsspec
        import torch

        buffer = io.BytesIO()
        torch.save(state, buffer)
        fs, path = fsspec.core.url_to_fs(ref)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp"
        with fs.open(tmp, "wb") as fh:
            fh.write(buffer.getvalue())
        fs.mv(tmp, path)  # readers never see a half-written checkpoint

    @staticmethod
    def save(workload: Workload, ref: str) -> None:
        CheckpointStore.write_state(workload.state_dict(), ref)

    @staticmethod
    def save_async(workload: Workload, ref: str) -> Future:
        """Snapshot ``workload``'s state now; write it in the background."""
        return _WRITER.submit(ref, _snapshot(workload.state_dict()))

    @staticmethod
    def load(workload: Workload, ref: str, wait_s: float = DEFAULT_WAIT_S) -> None:
        import fsspec
        import torch

        pending = _WRITER.pending(ref)
        if pending is not None:
            pending.result()
        fs, path = fsspec.core.url_to_fs(ref)
        deadline = time.monotonic() + wait_s
        while not fs.exists(path):
            if time.monotonic() >= deadline:
                raise PipetuneError(f"checkpoint {ref} did not appear within {wait_s:.0f} s")
            time.sleep(0.05)
            fs.invalidate_cache(path)
        with fs.open(path, "rb") as fh:
            state = torch.load(io.BytesIO(fh.read()), weights_only=True)
        workload.load_state_dict(state)

    @staticmethod
    def wait_written(ref: str) -> None:
        """Block until this process's background write of ``ref`` (if any) is done.

        A trial continuing from memory calls this before it trains on: if its process
        dies in the next epoch, the epoch it continues from is already on storage, so
        the retry elsewhere finds it. The write ran during the result's round trip,
        so this usually returns at once."""
        pending = _WRITER.pending(ref)
        if pending is not None:
            pending.result()

    @staticmethod
    def exists(ref: str) -> bool:
        import fsspec

        fs, path = fsspec.core.url_to_fs(ref)
        return fs.exists(path)


def _snapshot(state: Any) -> Any:
    """A copy of a state dict that later training steps cannot change."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_snapshot(v) for v in state)
    return copy.deepcopy(state)
