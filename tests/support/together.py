"""Run callables at once, as ranks would run (threads of one process): the shared-memory tests."""
import threading
from typing import Callable, Sequence


def run_together(callables: Sequence[Callable[[], None]], timeout_s: float = 60.0) -> None:
    """Start every callable in its own thread, wait for all; re-raise the first error."""
    errors = []

    def run(f):
        try:
            f()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f,)) for f in callables]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
