"""The dashboard process: `mlflow server` over the workspace store, started and stopped by reslab.

`start_dashboard` checks the address (`check_bind`), creates the SQLite schema under the drivers'
lock, starts the server in its own process group under `reaper.watch`, and waits until it answers;
`Dashboard.stop` ends it. The URL of each study's runs view comes from `tracking.views`.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from reslab.common.io import file_lock
from reslab.orchestrator.durability import reaper
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tracking.store import TrackingUnavailable, import_mlflow, probe_store, store_error, store_uri


def _mlflow_cli() -> list[str]:
    exe = Path(sys.executable).with_name("mlflow")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]


@dataclass
class Dashboard:
    process: subprocess.Popen
    url: str
    reaper: subprocess.Popen | None = None

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM the server's process group (uvicorn and its worker), then SIGKILL if needed."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.reaper is not None:
            self.reaper.terminate()
            self.reaper.wait()
            self.reaper = None
        return self.process.returncode


def check_bind(host: str, port: int) -> bool:
    """Raise `TrackingUnavailable` naming --host/--port when a server could not listen there (an
    unknown host, an address of another machine, a port in use); return whether it is loopback."""
    if not 0 < port < 65536:
        raise TrackingUnavailable(f"--port {port}: expected a port from 1 to 65535 (the UI's URL must be known)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise TrackingUnavailable(f"--host {host!r}: not an address of this machine ({exc}); "
                                  "use 127.0.0.1 (the default) or one of this machine's addresses") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise TrackingUnavailable(f"--port {port}: {host}:{port} is already in use; stop what listens "
                                          "there or pick another port (--port)") from None
            raise TrackingUnavailable(f"--host {host!r}: cannot listen on {host}:{port} ({exc.strerror}); "
                                      "use 127.0.0.1 (the default) or one of this machine's addresses") from None
    return ipaddress.ip_address(address[0]).is_loopback


def start_dashboard(workspace: Workspace, *, host: str = "127.0.0.1", port: int = 5000,
                    tracking_uri: str | None = None, timeout: float = 120.0, log_path: Path | None = None) -> Dashboard:
    """Serve the MLflow UI for the workspace store and wait until it answers.

    `mlflow server --workers 1` with job execution off (`MLFLOW_SERVER_ENABLE_JOB_EXECUTION`
    false; reslab submits no MLflow jobs) starts in ~8 s and ~0.5 GB. It runs in its own process
    group so `stop` ends the server and its worker together, and under `reaper.watch`, which ends
    them within a second if this process dies without stopping them (SIGKILL included). The port
    is checked before the server starts (a busy port would otherwise answer the health check for
    it), and a host other than loopback is warned about: the MLflow UI has no authentication.
    """
    if not check_bind(host, port):
        print(f"reslab: warning: --host {host} serves the MLflow UI, which has no authentication, to every "
              "machine that can reach this one; use the default 127.0.0.1 with an SSH tunnel instead", file=sys.stderr)
    uri = store_uri(tracking_uri or workspace.default_tracking_uri())
    workspace.root.mkdir(parents=True, exist_ok=True)  # the server's log and artifacts live there
    if uri.startswith("sqlite:"):
        # Create the schema first, under the drivers' lock: the server would otherwise race its
        # own migration, or a driver's. A file that is not a database is one line naming it.
        with file_lock(workspace.tracking_lock):
            try:
                import_mlflow()(tracking_uri=uri).search_experiments(max_results=1)
            except Exception as exc:  # sqlalchemy/sqlite errors arrive wrapped variously
                raise store_error(uri, exc) from None
    else:
        probe_store(uri)  # a wrong password or database, one that is down: one line before a server starts
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    parts = urllib.parse.urlsplit(uri)
    if parts.password is not None and parts.scheme.startswith("postgres"):
        # libpq reads PGPASSWORD: the password stays off the server's command line (visible in `ps`)
        env["PGPASSWORD"] = urllib.parse.unquote(parts.password)
        uri = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", "@", 1)).geturl()
    cmd = [
        *_mlflow_cli(), "server", "--backend-store-uri", uri,
        "--default-artifact-root", workspace.artifacts.as_uri(),
        "--artifacts-destination", workspace.artifacts.as_uri(),
        "--host", host, "--port", str(port), "--workers", "1",
    ]
    log_path = log_path or workspace.root / "dashboard.log"
    with open(log_path, "ab") as log_f:
        proc = subprocess.Popen(cmd, env=env, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    dash = Dashboard(proc, url, reaper.watch([proc.pid]))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                last = (log_path.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise TrackingUnavailable(f"mlflow server exited with code {proc.returncode} ({last.strip()}); "
                                          f"log: {log_path}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200 and proc.poll() is None:
                        return dash
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TrackingUnavailable(f"mlflow server did not answer on {url} within {timeout:.0f}s; log: {log_path}")
    except BaseException:  # Ctrl-C while waiting included: never leave a server behind
        dash.stop()
        raise
