"""Fixtures for the gpumem Python tests: a real gpumemd on the host backend.

The build is found through $GPUMEM_BUILD (default: build under the repo
root); the package through PYTHONPATH=python, or the repo's python/ dir.
"""

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("GPUMEM_BUILD") or REPO / "build").resolve()
os.environ["GPUMEM_LIB"] = str(BUILD / "lib" / "libgpumem.so.1")  # the build under test
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))


def wait_for(cond, timeout=5.0, what="condition"):
    """Poll cond() until it returns a true value (returned) or timeout
    seconds pass (the test fails)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            pytest.fail("timed out after %.1f s waiting for %s" % (timeout, what))
        time.sleep(0.005)


class Daemon:
    """A gpumemd process on the host backend, on a socket of its own."""

    def __init__(self, *extra):
        for exe in ("gpumemd", "gpumemctl"):
            if not (BUILD / "bin" / exe).exists():
                pytest.fail("no %s in %s/bin: build first (make O=... all)" % (exe, BUILD))
        self.dir = tempfile.mkdtemp(prefix="gpumem-py.")
        self.sock = os.path.join(self.dir, "sock")
        self.log_path = os.path.join(self.dir, "log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(BUILD / "bin" / "gpumemd"), "--backend", "host", "--socket", self.sock,
             "--host-devices", "2", "--host-device-size", "256M", *extra],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(self._answers, 10.0, "gpumemd to answer on " + self.sock)

    def _answers(self):
        if self.proc.poll() is not None:
            pytest.fail("gpumemd exited with %s:\n%s" % (self.proc.returncode, self.log()))
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.sock)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def ctl(self, *args):
        """Run gpumemctl --json on this daemon; its parsed output."""
        out = subprocess.run([str(BUILD / "bin" / "gpumemctl"), "--socket", self.sock,
                              "--json", *args], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def stop(self):
        """SIGTERM; gpumemd must exit 0. Stopping twice checks once."""
        if self._log.closed:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()
        log = self.log()
        shutil.rmtree(self.dir, ignore_errors=True)
        assert rc == 0, "gpumemd exited %s:\n%s" % (rc, log)


@pytest.fixture(scope="session")
def daemon():
    d = Daemon()
    yield d
    d.stop()


@pytest.fixture
def make_daemon():
    """Start extra daemons for one test; stopped (and checked) after it."""
    made = []

    def make(*extra):
        d = Daemon(*extra)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()


_ids = itertools.count()


@pytest.fixture
def tag():
    """A maker of tags no other test uses: tag("kv") -> "t3-kv"."""
    n = next(_ids)
    return lambda base: "t%d-%s" % (n, base)


@pytest.fixture
def worker(daemon):
    import gpumem

    with gpumem.connect(daemon.sock, name="pytest-worker") as c:
        yield c


@pytest.fixture
def controller(daemon):
    import gpumem

    with gpumem.connect(daemon.sock, name="pytest-controller", role="controller") as c:
        yield c
