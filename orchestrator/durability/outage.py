"""Waiting out an outage: how long a service has not answered, when to try it next, when to give up.

The driver holds one `Outage` per service it depends on (run storage, the tracking store). Each
failed call is reported (`failed`), each call that works again ends the outage (`ok`). The clock
starts when the service stopped answering: a failure reported late carries the time it happened
(`failed(why, since=...)`: a worker's first failed push, long before its attempt ended), and one seen
beside the driver's own calls (the study marker's heartbeat thread, `note`) starts it too; a start
never goes back past the last call that worked. The driver `check`s an outage it knows of between
its calls, so the timeout holds while nothing of its own fails. Between
tries the driver waits a bounded, growing interval (`BACKOFF_S`: 1 s, doubling, at most 30 s), so a
long outage costs a request every 30 s, not one per poll; it prints a status line when the outage
starts and then at most every `SAY_EVERY_S` ("run storage unreachable for 2m10s; runs continue; ..."),
and once the service has been unreachable for longer than the timeout (`--outage-timeout`, default
`DEFAULT_TIMEOUT_S`) the next failure raises the error `give_up` makes: one line, nothing lost (the
run directories hold every run).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from reslab.common.errors import ConfigError, ReslabError

DEFAULT_TIMEOUT_S = 1800.0
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
SAY_EVERY_S = 30.0
T = TypeVar("T")


def fmt_duration(seconds: float) -> str:
    """`65` -> `1m05s`, `3700` -> `1h01m`, `inf` -> `--`."""
    if not math.isfinite(seconds):
        return "--"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def check_outage_timeout(seconds: float) -> float:
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"--outage-timeout: {seconds:g} s is not allowed; allowed: a number of seconds >= 0 "
                          "(how long the driver waits for an unreachable run storage before it stops)")
    return seconds


class Outage:
    """One service's outage, as the driver sees it (see the module docstring).

    `what` names the service in the lines ("run storage s3://bucket/x"); `doing` says what goes on
    meanwhile ("runs continue; finished runs wait for their push"); `give_up(line)` makes the error
    raised past the timeout from the line that describes the outage.
    """

    def __init__(self, what: str, timeout_s: float, say: Callable[[str], Any],
                 give_up: Callable[[str], ReslabError], doing: str = "") -> None:
        self.what, self.timeout_s, self.say, self.give_up = what, check_outage_timeout(timeout_s), say, give_up
        self.doing = doing
        self.since: float | None = None  # when the service stopped answering, as far as anyone saw
        self.last_ok = -math.inf  # when a call last worked: no outage started before that
        self.tries = 0
        self.next_try = 0.0
        self._said = -math.inf
        self.why = ""
        self._lock = threading.Lock()  # `note` and `ok` come from a heartbeat thread too

    @property
    def down(self) -> bool:
        return self.since is not None

    def down_for(self) -> float:
        since = self.since  # read once: `ok` may end the outage from another thread
        return time.time() - since if since is not None else 0.0

    def line(self) -> str:
        doing = f"; {self.doing}" if self.doing else ""
        return (f"{self.what} unreachable for {fmt_duration(self.down_for())}{doing} ({self.why}); "
                f"waiting up to --outage-timeout {fmt_duration(self.timeout_s)}")

    def note(self, why: str, since: float) -> None:
        """A failure seen at `since` by someone else than the caller's next try (a worker, a heartbeat
        thread): the outage started then at the latest, though not before the last call that worked.
        Nothing is said or raised here: `failed` and `check` do that."""
        with self._lock:
            start = max(since, self.last_ok)
            if self.since is None or start < self.since:
                self.since = start
            self.why = " ".join(why.split())[:300]

    def failed(self, why: str, since: float | None = None) -> None:
        """A call failed (`since`: when its failures began, for one reported late; default now): the outage
        starts or goes on; the error `give_up` makes once it is past the timeout."""
        now = time.time()
        self.note(why, now if since is None else since)
        self.next_try = now + BACKOFF_S[min(self.tries, len(BACKOFF_S) - 1)]
        self.tries += 1
        self.check()

    def check(self) -> None:
        """Between calls: nothing outside an outage; in one, its status line when one is due, and the error
        `give_up` makes once it is past the timeout."""
        since, now = self.since, time.time()
        if since is None:
            return
        if now - since > self.timeout_s:
            raise self.give_up(self.line())
        if now - self._said >= SAY_EVERY_S:
            self._said = now
            self.say(self.line())

    def ok(self) -> None:
        """A call worked: the outage, if there was one, is over."""
        with self._lock:
            if self.since is not None:
                self.say(f"{self.what} answers again after {fmt_duration(self.down_for())}")
            self.since, self.tries, self.next_try, self._said = None, 0, 0.0, -math.inf
            self.last_ok = time.time()

    def due(self) -> bool:
        """Whether the next try is due (always, outside an outage)."""
        return time.time() >= self.next_try

    def wait_out(self, call: Callable[[], T], errors: tuple[type[BaseException], ...]) -> T:
        """`call()` until it returns, waiting between tries; `give_up`'s error past the timeout."""
        while True:
            try:
                value = call()
            except errors as exc:
                self.failed(str(exc))
                time.sleep(max(0.0, self.next_try - time.time()))
                continue
            self.ok()
            return value
