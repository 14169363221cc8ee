"""Process exit codes.  Every value is documented in README.md ("Exit codes");
scripts and CI gate on them, so values never change meaning once released."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    # An unexpected internal error (a bug): a traceback was printed.
    INTERNAL_ERROR = 1
    # Command-line usage error (argparse's own convention).
    USAGE = 2
    # Input refused: tampered or unlisted patch file, missing manifest,
    # editable/VCS install, two lmcache distributions, option not available yet.
    REFUSED = 3
    NOT_INSTALLED = 4
    PRISTINE = 5
    DRIFTED = 6
    UNSUPPORTED_VERSION = 7
    FIXED_UPSTREAM = 8
    PATCHED_OLDER_REVISION = 9
    PARTIALLY_PATCHED = 10
    # Files are at the patched state but some hash check failed
    # (RECORD rows, or a named verify check).
    CHECK_FAILED = 11
    # Another patchtool holds the lock and --no-wait was given.
    LOCKED = 12
