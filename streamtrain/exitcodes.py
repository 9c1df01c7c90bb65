"""The worker's exit codes, in one place: what each means to a restart policy (docs/operating.md).

A supervisor reads these to decide whether a restart can help. Transient codes (1, 3, 4, 6) may
clear by themselves; the others need an operator: restarting on them only loops.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # a requested stop, or --until-end / --max-events reached: positions committed
    FAILED = 1  # a peer rank failed, or an unexpected error (traceback in the log)
    CONFIG = 2  # the configuration is invalid; each bad field is named
    SHUTDOWN_TIMEOUT = 3  # a stop outlasted distributed.shutdown_grace_seconds
    KAFKA_UNREACHABLE = 4  # no Kafka broker answered at start-up
    LOGIN_REFUSED = 5  # the brokers refused the login
    SNAPSHOTS_FAILING = 6  # checkpoint.max_consecutive_failures snapshots in a row failed to write
    RESTORE_REFUSED = 7  # snapshots exist and none loads: nothing was removed
    OUTPUT_TOPIC_MISSING = 8  # a topic the worker writes is missing and could not be created
