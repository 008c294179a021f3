"""Work done by forked copies of this process: `Forked` (one call started now, its value asked for later)
and `fork_map` (calls shared among a few copies). A copy inherits the caller's objects, so the work is a
closure over them and only its result crosses back, pickled.

Only a process that may fork uses them: `reslab report`, which has no threads that matter, never a Ray
driver (a fork copies its threads mid-call). A copy that cannot start, or dies, leaves the work to this
process: the same result, later. An exception the work raises is raised here, as if it had run here.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Generic, TypeVar

__all__ = ["Forked", "fork_map"]

T = TypeVar("T")
_WORK: dict[int, Callable[..., Any]] = {}  # what the copies run: inherited at the fork, never pickled


def _run(key: int, *args: Any) -> Any:
    return _WORK[key](*args)


def _send(key: int, pipe: Connection) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a handler this process had (a driver's) would keep the copy alive
    try:
        answer: tuple[bool, Any] = (True, _WORK[key]())
    except BaseException as exc:  # noqa: BLE001 - every exception goes back, to be raised there
        answer = (False, exc)
    try:
        pipe.send(answer)
    except Exception:  # noqa: BLE001 - an answer that cannot be pickled: the caller does the work itself
        os._exit(1)


class Forked(Generic[T]):
    """`work` started now in a forked copy (a daemon: it ends with this process); `value()` waits for its
    result, once; `cancel()` ends the copy when its result is not wanted (an error before it is asked for)."""

    def __init__(self, work: Callable[[], T]) -> None:
        self._work = work
        context = multiprocessing.get_context("fork")
        self._pipe, writer = context.Pipe(duplex=False)
        key = id(work)
        _WORK[key] = work
        try:
            self._process: BaseProcess | None = context.Process(target=_send, args=(key, writer), daemon=True)
            self._process.start()  # flushes the standard streams first: no line comes out twice
        except OSError:
            self._process = None
        finally:
            del _WORK[key]
            writer.close()

    def value(self) -> T:
        process, self._process = self._process, None
        if process is None:
            return self._work()
        try:
            ok, answer = self._pipe.recv()
        except Exception:  # noqa: BLE001 - EOF (the copy died: the OOM killer; or its answer did not pickle) or an
            ok, answer = None, None  # answer that does not unpickle here: either way the work is done here
        finally:
            self._pipe.close()
            process.join()
        if ok is None:
            return self._work()
        if not ok:
            raise answer
        result: T = answer
        return result

    def cancel(self) -> None:
        if self._process is not None:
            self._process.kill()  # it only reads: nothing to finish
            self._process.join()
            self._process = None
        self._pipe.close()


def fork_map(work: Callable[[int], T], n: int, workers: int, chunksize: int = 1) -> list[T]:
    """[work(0), ..., work(n - 1)], shared `chunksize` at a time among `workers` forked copies."""
    key = id(work)
    _WORK[key] = work
    try:
        # a fork context starts every worker at the first submit (3.11's ProcessPoolExecutor): `_WORK` is set then
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_run, [key] * n, range(n), chunksize=chunksize))
    except (OSError, BrokenProcessPool):
        return [work(i) for i in range(n)]
    finally:
        del _WORK[key]
