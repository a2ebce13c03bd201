"""Testing an app that uses pg_idempotency.django.

Django's ``TestCase`` runs each test inside a transaction, so a claim cannot commit on its own
there and the decorator refuses to run (TransactionManagementError). Either test with
``TransactionTestCase`` (real commits; concurrency can be tested), or use
:class:`IdempotencyTestCaseMixin` (or the :func:`allow_in_testcase` context manager): then,
only inside a TestCase's transaction, the claim, the view with ``complete()``, and a release
each run in a savepoint. Replays, 409/422 answers and released keys behave as in production
within the one test; ``on_commit`` callbacks fire only through
``self.captureOnCommitCallbacks(execute=True)``, as with any TestCase; concurrent requests
cannot be tested this way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def allow_in_testcase() -> Iterator[None]:
    """Let idempotent views run inside Django TestCase transactions (never any other)."""
    import pg_idempotency.django as module

    module._testcase_depth += 1
    try:
        yield
    finally:
        module._testcase_depth -= 1


class IdempotencyTestCaseMixin:
    """``class MyTests(IdempotencyTestCaseMixin, TestCase)``: every test runs under
    :func:`allow_in_testcase`."""

    def _callSetUp(self) -> None:  # unittest's hook that runs setUp
        self._pg_idem_cm = allow_in_testcase()
        self._pg_idem_cm.__enter__()
        self.addCleanup(self._pg_idem_cm.__exit__, None, None, None)
        super()._callSetUp()  # type: ignore[misc]

    _pg_idem_cm: Any
    addCleanup: Callable[..., None]  # TestCase's, next in the MRO
