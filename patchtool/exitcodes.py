"""Process exit codes.

Every code is documented in docs/reference.md ("Exit codes"); scripts and CI gate on
them, so values never change meaning once released.  The install states that
map to some of them are :mod:`patchtool.states`.
"""

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
    # Another patchtool held the lock longer than LMCACHE_PATCHTOOL_LOCK_TIMEOUT.
    LOCKED = 12
    # A restore check (verify --restore, verify --roundtrip, the ci gate's
    # roundtrip/restore phases) ran to a verdict, and the verdict is FAIL.
    RESTORE_FAILED = 13
    # A restore check could not reach a verdict: the script errored, timed
    # out or printed no report.  Kept apart from 13 so a CI can retry it.
    RESTORE_ERROR = 14
    # A wheel does not match the manifest: a target file's pre-image hash
    # differs, or a member does not match the wheel's own RECORD.
    WHEEL_MISMATCH = 15
    # ci: no patch set for a pinned version newer than (or between) the
    # versions the shipped sets cover: port the series or confirm an
    # upstream fix.  (Older than every covered version: UNSUPPORTED_VERSION.)
    NO_PATCH_SET = 16
    # ci: pip could not download or install a wheel.
    PIP_FAILED = 17
    # ci: every phase passed but with warnings, and --allow-warnings was not given.
    CI_WARNINGS = 18
    # The filesystem refused a write (full disk, file-size limit, read-only
    # mount, I/O error): the transaction was rolled back, nothing changed.
    WRITE_FAILED = 19
    # l2 scan: the fs L2 tier, as the command leaves it, holds objects this
    # install never reads or reads wrongly (never-read, unpatched,
    # size-mismatch); quarantine can move them aside.
    L2_FLAGGED = 20
    # l2 scan: nothing flagged is left, but a set holds several sizes and the
    # tier cannot tell which one the reader writes; nothing in it was judged
    # or moved (name the size with --expect-size).
    L2_AMBIGUOUS = 21
