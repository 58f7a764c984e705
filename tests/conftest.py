"""Start the forkserver of launch.forked as the session starts: it imports torch and
torchvision (about 6 s of one core) while the first tests' launches leave the other core
idle, instead of when the first forked run needs it."""

from __future__ import annotations

import launch


def pytest_sessionstart(session) -> None:
    marks = session.config.getoption("markexpr")
    if "gpu" not in marks or "not gpu" in marks:  # the GPU lane (-m gpu ...) forks nothing
        launch.forkserver()
