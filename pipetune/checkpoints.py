"""Checkpoint store: one checkpoint per trial epoch, at a local folder, any fsspec URL,
or MLflow's artifact proxy (:mod:`pipetune.storage`).

Tasks pass *references* (URL strings), never model bytes, so a retried or resumed
epoch starts from the last checkpoint wherever it runs.

An epoch's result goes back only once its checkpoint is on storage
(:func:`pipetune.runner.run_epoch`): a store that is full or refuses the write fails
that epoch with one line naming the file and the OS error
(:class:`~pipetune.errors.CheckpointWriteError`), instead of a later epoch, a resume or
the best model's evaluation finding the file missing. :meth:`CheckpointStore.save_async`
still writes in a background thread for callers that overlap the write with other
work; a failed background write is raised to the next reader of that checkpoint in the
process and by :func:`flush_checkpoints`. A reader elsewhere that gets there first
waits for the file (:meth:`load`'s ``wait_s``).
"""

from __future__ import annotations

import copy
import io
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.errors import CheckpointWriteError, PipetuneError, StorageError
from pipetune.storage import is_local, resolve_location, storage_for

if TYPE_CHECKING:
    from pipetune.workloads._base import Workload

logger = logging.getLogger(__name__)

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
        # A failed write stays pending until :meth:`flush` reports it: a reader of
        # ``ref`` in this process then gets its error, not a wait for a file that
        # will never come.
        if future.exception() is not None:
            return
        with self._lock:
            if self._pending.get(ref) is future:
                del self._pending[ref]

    def pending(self, ref: str) -> Future | None:
        with self._lock:
            return self._pending.get(ref)

    def flush(self) -> None:
        """Wait for every write this process queued; raise the first that failed (the
        failures are then forgotten)."""
        with self._lock:
            futures = list(self._pending.items())
        failed = None
        for ref, future in futures:
            if future.exception() is not None:
                with self._lock:
                    if self._pending.get(ref) is future:
                        del self._pending[ref]
                failed = failed or future
        if failed is not None:
            failed.result()


_WRITER = _Writer()


def flush_checkpoints() -> None:
    """Block until this process's background checkpoint writes are on storage."""
    _WRITER.flush()


#: Environment variable naming the default checkpoint location (a team stack's store).
CHECKPOINTS_ENV = "PIPETUNE_CHECKPOINTS"


def default_checkpoint_root() -> str:
    """``$PIPETUNE_CHECKPOINTS``, else ``<pipetune home>/checkpoints``."""
    from pipetune.home import pipetune_home

    return os.environ.get(CHECKPOINTS_ENV, "").strip() or str(pipetune_home() / "checkpoints")


def resolve_checkpoint_root(
    root: str, tracking_uri: str, run_artifact_uri: Callable[[], str]
) -> str:
    """Where a study's checkpoints go, as a URL every worker can use: ``mlflow`` means
    ``<the study run's artifacts>/checkpoints`` (``run_artifact_uri()`` is asked only
    then: it costs a call to the tracking server); ``mlflow-artifacts:`` URIs become the
    tracking server's proxy address; anything else is kept."""
    if root == "mlflow":
        root = f"{run_artifact_uri().rstrip('/')}/checkpoints"
    return resolve_location(root, tracking_uri)


class CheckpointStore:
    """Checkpoints under ``root`` (a folder path or fsspec URL such as ``s3://bucket/x``).

    >>> store = CheckpointStore("/tmp/ckpts")
    >>> store.ref("study-1", 3, 2)
    '/tmp/ckpts/study-1/trial-003/epoch-002.pt'
    """

    #: Pruning policies: ``best-and-last`` (each ended trial keeps its last checkpoint
    #: and its best epoch's), ``all`` (none of its checkpoints is deleted). Under both,
    #: what a lost or frozen worker wrote for an epoch that was sent again (the
    #: superseded attempts, :func:`superseded_attempts`) is deleted: no result is there.
    KEEP_POLICIES = ("best-and-last", "all")

    def __init__(self, root: str | Path, keep: str = "best-and-last"):
        if keep not in self.KEEP_POLICIES:
            raise PipetuneError(
                f"checkpoint keep policy must be one of {', '.join(self.KEEP_POLICIES)}, "
                f"got {keep!r}")
        self.root = str(root).rstrip("/")
        self.keep = keep
        self._pruner: ThreadPoolExecutor | None = None
        self._pruning: list[Future] = []

    def __getstate__(self) -> dict[str, Any]:  # the pruner stays in the driver
        return {**self.__dict__, "_pruner": None, "_pruning": []}

    def prune_trial(self, results: Sequence[Any], metric: str, mode: str) -> list[str]:
        """Under the ``best-and-last`` policy, delete an ended trial's other checkpoints
        in the background (the study does not wait on storage); the refs let go. Under
        either policy, the superseded attempts of its epochs go too."""
        refs = [] if self.keep == "all" else self.prunable(results, metric, mode)
        self.prune_superseded(results)
        if refs:
            self._remove_later(self.remove, refs)
        return refs

    def prune_superseded(self, results: Sequence[Any]) -> None:
        """Delete, in the background, what earlier attempts of these results' epochs
        may have written (a worker that woke up, or ran on unseen, writes late: the
        study calls this again at its end)."""
        refs = [old for r in results if r.checkpoint
                for old in superseded_attempts(r.checkpoint)]
        if refs:
            self._remove_later(self._remove_present, refs)

    def _remove_later(self, remove: Callable[[Sequence[str]], int], refs: list[str]) -> None:
        if self._pruner is None:
            self._pruner = ThreadPoolExecutor(1, thread_name_prefix="pipetune-prune")
        self._pruning.append(self._pruner.submit(remove, refs))

    @staticmethod
    def _remove_present(refs: Sequence[str]) -> int:
        """Delete those of ``refs`` that exist; how many."""
        present = [ref for ref in refs if CheckpointStore.exists(ref)]
        return CheckpointStore.remove(present)

    def wait_pruned(self) -> int:
        """Wait for the deletions asked so far; how many checkpoints they removed. A
        deletion that failed is logged, not raised: a left-over file costs only space."""
        removed = 0
        for future in self._pruning:
            try:
                removed += future.result()
            except Exception:  # noqa: BLE001
                logger.warning("pruning checkpoints failed", exc_info=True)
        self._pruning.clear()
        return removed

    def ref(self, study_id: str, trial_id: int, epoch: int) -> str:
        return f"{self.root}/{study_id}/trial-{trial_id:03d}/epoch-{epoch:03d}.pt"

    @staticmethod
    def write_state(state: dict[str, Any], ref: str) -> None:
        """Serialise ``state`` and write it at ``ref``. A store that refuses it (no
        space left, over quota, read-only) raises :class:`CheckpointWriteError`, one
        line naming the file and the OS error; nothing half-written is left there."""
        import torch

        buffer = io.BytesIO()
        torch.save(state, buffer)
        try:
            storage_for(ref).write(ref, buffer.getvalue())
        except (OSError, StorageError) as e:  # a folder, or MLflow's proxy saying no
            why = f"[Errno {e.errno}] {e.strerror}" \
                if isinstance(e, OSError) and e.errno and e.strerror else str(e)
            raise CheckpointWriteError(
                f"checkpoint store refused {ref} ({len(buffer.getbuffer())} bytes): "
                f"{why}") from e

    @staticmethod
    def save(workload: Workload, ref: str) -> None:
        CheckpointStore.write_state(workload.state_dict(), ref)

    @staticmethod
    def save_async(workload: Workload, ref: str) -> Future:
        """Snapshot ``workload``'s state now; write it in the background when ``ref`` is
        on this host's disk, else now.

        A worker that dies between an epoch's result and its background write loses
        the checkpoint the retry elsewhere needs. On local disk that window is a few
        milliseconds (and a worker's disk is only shared on one host anyway); a write
        to a server (MLflow's proxy, object storage) takes longer, so there the result
        waits for the checkpoint to be on storage: a dead worker loses nothing."""
        if is_local(ref):
            return _WRITER.submit(ref, _snapshot(workload.state_dict()))
        done: Future = Future()
        CheckpointStore.save(workload, ref)
        done.set_result(None)
        return done

    @staticmethod
    def load(workload: Workload, ref: str, wait_s: float = DEFAULT_WAIT_S) -> None:
        workload.load_state_dict(CheckpointStore.read_state(ref, wait_s))

    @staticmethod
    def read_state(ref: str, wait_s: float = DEFAULT_WAIT_S) -> dict[str, Any]:
        """The state saved at ``ref``, waiting up to ``wait_s`` for a writer elsewhere
        (a file that is missing, or on storage that can show a file half-copied, one
        that does not deserialise yet, is read again until then)."""
        import torch

        pending = _WRITER.pending(ref)
        if pending is not None:
            pending.result()
        storage = storage_for(ref)
        deadline = time.monotonic() + wait_s
        while True:
            data = storage.read(ref)
            why = "did not appear"
            if data is not None:
                try:
                    return torch.load(io.BytesIO(data), weights_only=True)
                except (EOFError, RuntimeError) as e:
                    if not storage.partial_reads:  # written whole or not at all: final
                        raise
                    why = f"stayed unreadable ({type(e).__name__}: {e})"
            if time.monotonic() >= deadline:
                raise PipetuneError(f"checkpoint {ref} {why} within {wait_s:.0f} s")
            time.sleep(0.05)

    @staticmethod
    def read_bytes(ref: str) -> bytes:
        """The checkpoint file's bytes as stored (to copy it elsewhere)."""
        data = storage_for(ref).read(ref)
        if data is None:
            raise PipetuneError(f"checkpoint {ref} does not exist")
        return data

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
        return storage_for(ref).exists(ref)

    @staticmethod
    def prunable(results: Sequence[Any], metric: str, mode: str) -> list[str]:
        """The checkpoints of an ended trial that the pruning policy lets go: all but
        the last (the trial's model, what a resume and the best-model evaluation read)
        and the best by ``metric`` (``mode`` ``max`` or ``min``)."""
        refs = [r.checkpoint for r in results if r.checkpoint]
        if len(refs) <= 1:
            return []
        scored = [r for r in results if r.checkpoint and metric in r.metrics]
        keep = {refs[-1]}
        if scored:
            pick = max if mode == "max" else min
            keep.add(pick(scored, key=lambda r: r.metrics[metric]).checkpoint)
        return [ref for ref in dict.fromkeys(refs) if ref not in keep]

    @staticmethod
    def remove(refs: Sequence[str]) -> int:
        """Delete ``refs`` (each once; one already gone is fine); how many were asked."""
        for ref in refs:
            storage_for(ref).remove(ref)
        return len(refs)


_ATTEMPT = re.compile(r"\.attempt-\d+(?=\.[^./]*$|$)")


def attempt_ref(ref: str, attempt: int) -> str:
    """Where the ``attempt``-th sending of an epoch writes its checkpoint: ``ref`` for the
    first, ``epoch-002.attempt-2.pt`` for the second, and so on.

    An epoch sent again because its worker froze or was lost writes a file of its own,
    so the first worker, should it wake up or still be running unseen, cannot overwrite
    the checkpoint the trial goes on from (the trial's checkpoint is the reference its
    result carries).

    >>> attempt_ref("/ck/s/trial-001/epoch-002.pt", 2)
    '/ck/s/trial-001/epoch-002.attempt-2.pt'
    >>> attempt_ref("/ck/s/trial-001/epoch-002.attempt-2.pt", 3)
    '/ck/s/trial-001/epoch-002.attempt-3.pt'
    """
    base = _ATTEMPT.sub("", ref)
    if attempt <= 1:
        return base
    head, dot, suffix = base.rpartition(".")
    if not dot or "/" in suffix:
        return f"{base}.attempt-{attempt}"
    return f"{head}.attempt-{attempt}.{suffix}"


def superseded_attempts(ref: str) -> list[str]:
    """The references earlier attempts of ``ref``'s epoch wrote to, if it is a later
    attempt (:func:`attempt_ref`); none for a first attempt.

    >>> superseded_attempts("/ck/s/trial-001/epoch-002.attempt-3.pt")
    ['/ck/s/trial-001/epoch-002.pt', '/ck/s/trial-001/epoch-002.attempt-2.pt']
    """
    found = _ATTEMPT.search(ref)
    if found is None:
        return []
    attempt = int(found.group(0).rsplit("-", 1)[1])
    return [attempt_ref(ref, k) for k in range(1, attempt)]


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
