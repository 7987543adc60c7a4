"""Checkpoint store: one checkpoint per trial epoch, at a local folder or any fsspec URL.

Tasks pass *references* (URL strings), never model bytes, so a retried or resumed
epoch starts from the last checkpoint wherever it runs.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipetune.workloads._base import Workload


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
    def save(workload: Workload, ref: str) -> None:
        import fsspec
        import torch

        buffer = io.BytesIO()
        torch.save(workload.state_dict(), buffer)
        fs, path = fsspec.core.url_to_fs(ref)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp"
        with fs.open(tmp, "wb") as fh:
            fh.write(buffer.getvalue())
        fs.mv(tmp, path)  # readers never see a half-written checkpoint

    @staticmethod
    def load(workload: Workload, ref: str) -> None:
        import fsspec
        import torch

        with fsspec.open(ref, "rb") as fh:
            state = torch.load(io.BytesIO(fh.read()), weights_only=True)
        workload.load_state_dict(state)

    @staticmethod
    def exists(ref: str) -> bool:
        import fsspec

        fs, path = fsspec.core.url_to_fs(ref)
        return fs.exists(path)
