#!/usr/bin/env python3
"""Provision a real ``redis-server`` for the shared-tier (RESP) tests and gates.

The RESP tier is proven against a real Redis, never a stand-in.  This script
finds one, or installs Debian's package, and says in one line why not when it
cannot:

1. ``$LMCACHE_PATCHTOOL_REDIS_SERVER`` (a path to a ``redis-server`` binary);
2. ``redis-server`` on ``PATH``;
3. as root on a Debian-like machine: ``apt-get install -y --no-install-recommends
   redis-server`` (after an ``apt-get update`` when the package lists are
   empty), under the provisioning lock, with its progress on stderr and in
   ``provision.log`` like every other environment.

Anything else is :class:`RedisUnavailable` with the reason; the tests turn it
into a skip that names the reason, never a silent pass.

The server the tests start is their own: ``gate/
redis_proc.py`` runs it on 127.0.0.1 on a free port in a temporary directory.
A system service the package may have started is never used.

Command line: ``python -m lab.provision_redis`` prints the binary's path
(or the reason, exit 1).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from lab import provision  # a sibling script, not a package

REDIS_SERVER_ENV = "LMCACHE_PATCHTOOL_REDIS_SERVER"
APT_PACKAGE = "redis-server"


class RedisUnavailable(RuntimeError):
    """No redis-server here and none can be installed (the message says why)."""


def _on_path() -> Path | None:
    found = shutil.which("redis-server")
    return Path(found) if found else None


def _apt_install() -> None:
    """Debian's redis-server, as root; refreshes empty package lists once."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    steps = provision.Steps("redis-server", 2)
    steps.step(f"apt-get install {APT_PACKAGE}")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", APT_PACKAGE]
    try:
        provision._run(cmd, steps, env=env)
    except subprocess.CalledProcessError:
        steps.step("apt-get update, then install again")
        provision._run(["apt-get", "update", "-q"], steps, env=env)
        provision._run(cmd, steps, env=env)


def redis_server() -> Path:
    """The ``redis-server`` binary to run (installed here when it can be)."""
    override = os.environ.get(REDIS_SERVER_ENV, "").strip()
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise RedisUnavailable(f"${REDIS_SERVER_ENV}={override}: not an executable file")
        return path
    found = _on_path()
    if found:
        return found
    if shutil.which("apt-get") is None:
        raise RedisUnavailable("no redis-server on PATH and no apt-get to install it "
                               f"(set ${REDIS_SERVER_ENV} to a redis-server binary)")
    if os.geteuid() != 0:
        raise RedisUnavailable("no redis-server on PATH and not root, so apt-get cannot install it "
                               f"(install redis-server, or set ${REDIS_SERVER_ENV})")
    with provision._locked("redis-server"):
        found = _on_path()
        if found is None:
            try:
                _apt_install()
            except (subprocess.CalledProcessError, OSError) as exc:
                raise RedisUnavailable(f"apt-get install {APT_PACKAGE} failed: {exc}") from exc
            found = _on_path()
    if found is None:
        raise RedisUnavailable(f"apt-get installed {APT_PACKAGE} but no redis-server is on PATH")
    provision.progress(f"redis-server: {found}")
    return found


def main() -> int:
    try:
        print(redis_server())
    except RedisUnavailable as exc:
        print(f"provision_redis: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
