"""Running the Python API both ways (sync and async) and the installed console script."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pg_idempotency import aio
from pgharness import WAIT_BOUND

CLI = Path(sys.executable).parent / "pg-idempotency"


async def call(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _enter:
    """``async with _enter(op)`` for either flavour's Operation."""

    def __init__(self, op: Any) -> None:
        self.op = op

    async def __aenter__(self) -> Any:
        if isinstance(self.op, aio.Operation):
            return await self.op.__aenter__()
        return self.op.__enter__()

    async def __aexit__(self, *exc: Any) -> Any:
        if isinstance(self.op, aio.Operation):
            return await self.op.__aexit__(*exc)
        return self.op.__exit__(*exc)


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k != "DATABASE_URL" and not k.startswith("PG")}
    base["LC_ALL"] = "C"
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=WAIT_BOUND,
                          env={**base, **(env or {})}, stdin=subprocess.DEVNULL)
