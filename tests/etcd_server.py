"""A real etcd server for tests: one member on free loopback ports with its own data dir.

`stop` kills it (-9, as a crash would) and `start` brings it back on the same ports and
data, leases and keys included. The binary comes from Debian's `etcd-server` (scripts/test
installs it when missing).
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from disagg.demo import free_port


class EtcdServer:
    def __init__(self, data_dir: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed: apt-get install -y etcd-server")
        self.binary, self.data_dir = binary, data_dir
        self.port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.url = f"etcd://{self.endpoint}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"etcd-{self.port}.log"

    def start(self, timeout_s: float = 20.0) -> None:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary,
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--listen-metrics-urls=",
        ]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(client + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"etcd did not answer within {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
