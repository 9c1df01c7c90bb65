"""The worker's exit codes, in one place: what each means to a restart policy (docs/operating.md).

A supervisor reads these to decide whether a restart can help. Transient codes (1, 3, 4, 6) may
clear by themselves; the others (2, 5, 7, 8) need an operator: restarting on them only loops. Where several
ranks fail, the launcher returns the most severe of their codes (``most_severe``).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    CONFIG = 2
    SHUTDOWN_TIMEOUT = 3
    KAFKA_UNREACHABLE = 4
    LOGIN_REFUSED = 5
    SNAPSHOTS_FAILING = 6
    RESTORE_REFUSED = 7
    OUTPUT_TOPIC_MISSING = 8

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    ExitCode.OK: "a requested stop, or --until-end / --max-events reached: positions committed",
    ExitCode.FAILED: "a peer rank failed, or an unexpected error (traceback in the log)",
    ExitCode.CONFIG: "the configuration is invalid; each bad field is named",
    ExitCode.SHUTDOWN_TIMEOUT: "a stop outlasted distributed.shutdown_grace_seconds",
    ExitCode.KAFKA_UNREACHABLE: "no Kafka broker answered at start-up",
    ExitCode.LOGIN_REFUSED: "the brokers refused the login",
    ExitCode.SNAPSHOTS_FAILING: "checkpoint.max_consecutive_failures snapshots in a row failed to write",
    ExitCode.RESTORE_REFUSED: "snapshots exist and none loads: nothing was removed",
    ExitCode.OUTPUT_TOPIC_MISSING: "a topic the worker writes is missing and could not be created",
}

# Most severe first. Permanent causes an operator must fix outrank transient ones: the transient
# codes of some ranks are often the echo of another rank's permanent one. Last come 1 and 3, which
# a rank also gives when a peer died (1), or when it could not stop in time because one did (3).
SEVERITY = (
    ExitCode.CONFIG,
    ExitCode.RESTORE_REFUSED,
    ExitCode.LOGIN_REFUSED,
    ExitCode.OUTPUT_TOPIC_MISSING,
    ExitCode.SNAPSHOTS_FAILING,
    ExitCode.KAFKA_UNREACHABLE,
    ExitCode.FAILED,
    ExitCode.SHUTDOWN_TIMEOUT,
    ExitCode.OK,
)


def as_exit_code(status: int) -> ExitCode:
    """A process's exit status as the worker's code: one the worker does not give (killed by a
    signal, an interpreter abort) is a plain failure.

    >>> as_exit_code(7).name, as_exit_code(-9).name, as_exit_code(134).name
    ('RESTORE_REFUSED', 'FAILED', 'FAILED')
    """
    return ExitCode(status) if status in ExitCode._value2member_map_ else ExitCode.FAILED


def most_severe(statuses: Iterable[int]) -> ExitCode:
    """The code a launcher returns for its ranks' exit statuses (OK for none).

    >>> most_severe([1, 7, 0]).name, most_severe([-15, 4]).name, most_severe([]).name
    ('RESTORE_REFUSED', 'KAFKA_UNREACHABLE', 'OK')
    """
    return min((as_exit_code(s) for s in statuses), key=SEVERITY.index, default=ExitCode.OK)
