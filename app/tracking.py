"""Tracking: swanlab in local mode and verl's JSONL `file` logger, without touching verl's source.

verl reads SWANLAB_MODE / SWANLAB_LOG_DIR and VERL_FILE_LOGGER_PATH from the environment
(verl/utils/tracking.py). For GRPO the loggers live in Ray actors, which inherit the environment of
`ray start`, so launch puts these variables in the environment of `ray start` and of the driver.
"""

from __future__ import annotations

import time
from pathlib import Path

from app.common import env


def tracking_env(run: Path) -> dict[str, str]:
    """Environment that sends a run's metrics to files under `run`.

    verl's FileLogger opens its file with "wb" (truncating it on every restart), so each attempt
    writes its own logs/metrics-<UTC time>.jsonl; `report` reads them all in order.
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return {
        "SWANLAB_MODE": env("SWANLAB_MODE", "local"),
        "SWANLAB_LOG_DIR": str(run / "swanlog"),
        "VERL_FILE_LOGGER_PATH": str(run / "logs" / f"metrics-{stamp}.jsonl"),
    }


def main(command: str, argv: list[str]) -> int:
    from app.common import UserError

    raise UserError(f"`{command}` is not implemented yet")
