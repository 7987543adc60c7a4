"""A sink for the sidecar tests: appends what it is sent to a file, one line per call,
buffering lines until the host is idle; ``fail`` raises; ``hold`` keeps a line back
until its time has come at an idle call, or until ``drain``."""

from __future__ import annotations

import os
import time


class FileSink:
    def __init__(self, path: str):
        self.path = path
        self.buffer: list[str] = []
        self.flushes = 0
        self.held: list[tuple[float, str]] = []

    def append(self, line: str) -> None:
        self.buffer.append(line)

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def pid(self) -> int:
        return os.getpid()

    def lines(self) -> list[str]:
        self.idle()
        with open(self.path) as f:
            return f.read().splitlines()

    def hold(self, line: str, seconds: float) -> None:
        self.held.append((time.monotonic() + seconds, line))

    def drain(self) -> None:
        self.buffer += [line for _, line in self.held]
        self.held.clear()
        self.idle()

    def idle(self) -> None:
        due = [line for at, line in self.held if at <= time.monotonic()]
        self.held = [(at, line) for at, line in self.held if at > time.monotonic()]
        self.buffer += due
        if self.buffer:
            with open(self.path, "a") as f:
                f.write("".join(f"{line}\n" for line in self.buffer))
            self.buffer.clear()
            self.flushes += 1

    def idle_flushes(self) -> int:
        return self.flushes

    def env(self, name: str) -> str | None:
        return os.environ.get(name)
