"""``--transport zmq --workers N``: the server's own workers, as ``join`` processes here.

A run on one machine needs no key folder or second shell: the launcher splits the clients
among N workers, makes keys for the run in a private temporary folder and ends the workers
after the server's goodbyes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import structlog

from foltr_async.distributed.claims import agent_ids
from foltr_async.errors import FoltrError, ScenarioError
from foltr_async.runtime.zmq_keys import ServerKeys, load_server_keys, make_keys
from foltr_async.scenario.load import Scenario

__all__ = ["LocalWorkers"]

log = structlog.get_logger()


class LocalWorkers:
    """``--transport zmq --workers N``: N ``join`` processes on this machine, keys made for the
    run in a private temporary folder (unless ``insecure``), logs in ``OUT/workers/``."""

    def __init__(
        self, scenario: Scenario, scenario_args: list[str], n: int, log_dir: Path, insecure: bool
    ) -> None:
        if n < 1:
            raise FoltrError(f"--workers: expected an integer >= 1, got {n}")
        clients = max(cfg.federation.clients for cfg in scenario.variants.values())
        chunks = [c for c in np.array_split(np.arange(clients), n) if c.size]
        if not chunks:
            raise ScenarioError("--transport zmq: the scenario has no honest clients to host")
        self.specs = [agent_ids(c.tolist()) for c in chunks]
        self.scenario_args = scenario_args
        self.log_dir = Path(log_dir)
        self.insecure = insecure
        self.procs: list[subprocess.Popen] = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.key_dir: Path | None = None
        if not insecure:
            self._tmp = tempfile.TemporaryDirectory(prefix="foltr-keys-")
            self.key_dir = Path(self._tmp.name)
            make_keys(self.key_dir, workers=len(self.specs))

    def server_keys(self) -> ServerKeys | None:
        return None if self.key_dir is None else load_server_keys(self.key_dir)

    def command(self, i: int, endpoint: str) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "foltr_async",
            "join",
            *self.scenario_args,
            "--connect",
            endpoint,
            "--agents",
            self.specs[i],
            "--name",
            f"worker-{i}",
            "--exit-with",
            str(os.getpid()),
        ]
        return cmd + (["--insecure"] if self.key_dir is None else ["--keys", str(self.key_dir)])

    def launch(self, endpoint: str) -> None:
        endpoint = endpoint.replace("0.0.0.0", "127.0.0.1").replace("//*", "//127.0.0.1")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for i in range(len(self.specs)):
            with open(self.log_dir / f"worker-{i}.log", "ab") as fh:
                self.procs.append(
                    subprocess.Popen(
                        self.command(i, endpoint),
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        log.info("workers_started", n=len(self.procs), logs=str(self.log_dir))

    def check(self) -> None:
        """A worker that ended before hosting its clients cannot come back: say why."""
        for i, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None and code != 0:
                log_file = self.log_dir / f"worker-{i}.log"
                lines = log_file.read_text(errors="replace").strip().splitlines()
                raise FoltrError(
                    f"worker-{i} exited with code {code}: "
                    f"{lines[-1] if lines else 'no output'} (log: {log_file})"
                )

    def stop(self, grace: float = 10.0) -> None:
        """After the goodbyes: wait for the workers, then end the stragglers."""
        deadline = time.monotonic() + grace
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
