"""gate/procs.py against stand-in processes (a tiny
stdlib HTTP server).

The stand-in can delay its readiness, spawn a grandchild in its process group,
exit early, or ignore SIGTERM, so start / readiness / kill / verify-gone /
timeout / cleanup are all exercised without lmcache or torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

from gate import procs

STANDIN = textwrap.dedent('''
    import argparse, http.server, json, os, signal, subprocess, sys, time

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--exit-early", type=int)
    ap.add_argument("--grandchild", action="store_true")
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--unhealthy", action="store_true")
    a = ap.parse_args()
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.grandchild:
        kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"GRANDCHILD {kid.pid}", flush=True)
    print("booting", flush=True)
    time.sleep(a.delay)
    if a.exit_early is not None:
        print("giving up", flush=True)
        sys.exit(a.exit_early)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "unhealthy" if a.unhealthy else "healthy"}).encode()
            self.send_response(200 if self.path == "/healthcheck" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", a.port), H)
    print(f"READY on {a.port}", flush=True)
    srv.serve_forever()
''')


@pytest.fixture()
def standin(tmp_path: Path) -> Path:
    path = tmp_path / "standin.py"
    path.write_text(STANDIN)
    return path


def _argv(script: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, str(script), "--port", str(port), *extra]


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _grandchild_pid(proc: procs.ManagedProcess) -> int:
    text = procs.wait_until(lambda: "GRANDCHILD" in proc.log_text() and proc.log_text(), 10,
                            what="grandchild line")
    return int(text.split("GRANDCHILD ")[1].split()[0])


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = procs.free_ports(4)
    assert len(set(ports)) == 4 and all(1024 < p < 65536 for p in ports)


def test_start_http_ready_kill_and_verify_group_gone(standin: Path, tmp_path: Path) -> None:
    port = procs.free_port()
    with procs.Supervisor() as sup:
        proc = sup.start("standin", _argv(standin, port, "--delay", "0.5", "--grandchild"),
                         log_path=tmp_path / "standin.log",
                         ready=procs.http_probe(f"http://127.0.0.1:{port}/healthcheck",
                                                json_subset={"status": "healthy"}),
                         ready_timeout=30)
        assert proc.alive()
        assert proc.ready_at - proc.started_at >= 0.5  # readiness came from the process, after its delay
        assert "GET http://127.0.0.1" in proc.readiness
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)  # its own process group
        kid = _grandchild_pid(proc)
        assert _alive(kid) and os.getpgid(kid) == proc.pgid
        proc.kill()
        assert proc.returncode == -signal.SIGKILL
        assert not _alive(proc.pid) and not _alive(kid)
        assert procs.group_members(proc.pgid) == []
        assert proc.killed_with == "SIGKILL"


def test_log_line_readiness(standin: Path, tmp_path: Path) -> None:
    port = procs.free_port()
    log = tmp_path / "s.log"
    with procs.Supervisor() as sup:
        proc = sup.start("standin", _argv(standin, port, "--delay", "0.3"), log_path=log,
                         ready=lambda p: procs.log_probe(p.log_path, r"READY on \d+"), ready_timeout=30)
        assert "READY on" in proc.log_text()
        assert "log line" in proc.readiness


def test_tcp_readiness(standin: Path, tmp_path: Path) -> None:
    port = procs.free_port()
    with procs.Supervisor() as sup:
        proc = sup.start("standin", _argv(standin, port), log_path=tmp_path / "s.log",
                         ready=procs.tcp_probe("127.0.0.1", port), ready_timeout=30)
        assert proc.alive()


def test_exit_before_ready_raises_startup_error_with_log_tail(standin: Path, tmp_path: Path) -> None:
    port = procs.free_port()
    with procs.Supervisor() as sup:
        t0 = time.monotonic()
        with pytest.raises(procs.StartupError) as err:
            sup.start("standin", _argv(standin, port, "--exit-early", "3"), log_path=tmp_path / "s.log",
                      ready=procs.http_probe(f"http://127.0.0.1:{port}/healthcheck"), ready_timeout=60)
        assert time.monotonic() - t0 < 30  # noticed the exit, did not wait out the timeout
        assert not isinstance(err.value, procs.ReadinessTimeout)
        assert "exit code 3" in str(err.value) and "giving up" in str(err.value)


def test_readiness_timeout_kills_the_process(standin: Path, tmp_path: Path) -> None:
    port = procs.free_port()
    with procs.Supervisor() as sup:
        with pytest.raises(procs.ReadinessTimeout) as err:
            sup.start("standin", _argv(standin, port, "--unhealthy", "--grandchild"), log_path=tmp_path / "s.log",
                      ready=procs.http_probe(f"http://127.0.0.1:{port}/healthcheck",
                                             json_subset={"status": "healthy"}),
                      ready_timeout=1.5)
        assert "status='unhealthy'" in str(err.value) and "after 1.5 s" in str(err.value)
        proc = sup.processes[-1]
        assert not proc.alive() and procs.group_members(proc.pgid) == []


def test_stop_escalates_to_sigkill(standin: Path, tmp_path: Path) -> None:
    port = procs.free_port()
    with procs.Supervisor() as sup:
        proc = sup.start("standin", _argv(standin, port, "--ignore-term"), log_path=tmp_path / "s.log",
                         ready=procs.http_probe(f"http://127.0.0.1:{port}/healthcheck"), ready_timeout=30)
        t0 = time.monotonic()
        proc.stop(grace=0.5)
        assert 0.5 <= time.monotonic() - t0 < 10
        assert proc.returncode == -signal.SIGKILL and not proc.alive()
        assert proc.killed_with == "SIGKILL"


def test_stop_graceful_when_sigterm_is_obeyed(standin: Path, tmp_path: Path) -> None:
    port = procs.free_port()
    with procs.Supervisor() as sup:
        proc = sup.start("standin", _argv(standin, port, "--grandchild"), log_path=tmp_path / "s.log",
                         ready=procs.http_probe(f"http://127.0.0.1:{port}/healthcheck"), ready_timeout=30)
        kid = _grandchild_pid(proc)
        proc.stop(grace=10)
        assert proc.killed_with == "SIGTERM" and proc.returncode == -signal.SIGTERM
        assert not _alive(kid) and procs.group_members(proc.pgid) == []


def test_cleanup_on_exception(standin: Path, tmp_path: Path) -> None:
    port = procs.free_port()
    sup = procs.Supervisor()
    pids: list[int] = []
    dirs: list[Path] = []
    marker: list[str] = []
    with pytest.raises(RuntimeError, match="boom"):
        with sup:
            proc = sup.start("standin", _argv(standin, port, "--grandchild"), log_path=tmp_path / "s.log",
                             ready=procs.http_probe(f"http://127.0.0.1:{port}/healthcheck"), ready_timeout=30)
            pids += [proc.pid, _grandchild_pid(proc)]
            dirs.append(sup.tempdir(prefix="procs-test-"))
            (dirs[0] / "f").write_text("x")
            sup.add_cleanup("marker", lambda: marker.append("ran"))
            raise RuntimeError("boom")
    assert not any(_alive(p) for p in pids)
    assert not dirs[0].exists()
    assert marker == ["ran"]
    assert sup.cleanup_errors == []


DRIVER = textwrap.dedent('''
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    from gate import procs
    port = procs.free_port()
    with procs.Supervisor() as sup:
        d = sup.tempdir(prefix="procs-driver-")
        p = sup.start("standin", [sys.executable, sys.argv[2], "--port", str(port), "--grandchild"],
                      log_path=d / "s.log", ready=procs.http_probe(f"http://127.0.0.1:{port}/healthcheck"),
                      ready_timeout=30)
        kid = int(procs.wait_until(lambda: "GRANDCHILD" in p.log_text() and p.log_text(), 10)
                  .split("GRANDCHILD ")[1].split()[0])
        print(json.dumps({"pid": p.pid, "kid": kid, "dir": str(d)}), flush=True)
        time.sleep(600)
''')


def _start_driver(standin: Path, tmp_path: Path) -> subprocess.Popen:
    """A supervising process (DRIVER) that prints its child's pid, then sleeps."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    return subprocess.Popen([sys.executable, str(driver), str(REPO), str(standin)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_supervisor_cleans_up_on_signal(standin: Path, tmp_path: Path, sig: int) -> None:
    p = _start_driver(standin, tmp_path)
    try:
        info = json.loads(p.stdout.readline())
        assert _alive(info["pid"]) and _alive(info["kid"]) and Path(info["dir"]).exists()
        p.send_signal(sig)
        rc = p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc != 0  # interrupted, not a normal exit
    assert not _alive(info["pid"]) and not _alive(info["kid"])
    assert not Path(info["dir"]).exists()


def test_children_die_with_a_sigkilled_supervisor(standin: Path, tmp_path: Path) -> None:
    """No cleanup code runs on SIGKILL; PR_SET_PDEATHSIG still takes the child down."""
    p = _start_driver(standin, tmp_path)
    try:
        info = json.loads(p.stdout.readline())
        assert _alive(info["pid"])
        p.kill()
        p.wait(timeout=30)
        procs.wait_until(lambda: not _alive(info["pid"]), 10, what="the orphan to die")
    finally:
        if p.poll() is None:
            p.kill()
        procs.remove_path(info["dir"])
    assert not _alive(info["pid"])


def test_missing_command_is_a_startup_error(tmp_path: Path) -> None:
    with procs.Supervisor() as sup:
        with pytest.raises(procs.StartupError, match="not found"):
            sup.start("ghost", ["/nonexistent/binary"], log_path=tmp_path / "g.log")


def test_atexit_fallback_when_the_block_is_never_left(standin: Path, tmp_path: Path) -> None:
    """A supervisor that is entered but never left is still closed at interpreter exit."""
    script = tmp_path / "abandon.py"
    script.write_text(textwrap.dedent(f'''
        import json, sys
        from gate import procs
        port = procs.free_port()
        sup = procs.Supervisor().__enter__()
        d = sup.tempdir(prefix="procs-abandon-")
        p = sup.start("standin", [sys.executable, {str(standin)!r}, "--port", str(port)], log_path=d / "s.log",
                      ready=procs.http_probe(f"http://127.0.0.1:{{port}}/healthcheck"), ready_timeout=30)
        print(json.dumps({{"pid": p.pid, "dir": str(d)}}), flush=True)
    '''))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    info = json.loads(out.stdout.splitlines()[-1])
    assert not _alive(info["pid"])
    assert not Path(info["dir"]).exists()


def test_wait_until_times_out() -> None:
    with pytest.raises(TimeoutError, match="the thing"):
        procs.wait_until(lambda: False, 0.2, poll=0.01, what="the thing")
    assert procs.wait_until(lambda: 42, 1) == 42


def test_module_stays_torch_free() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys; "
                          "from gate import procs; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
