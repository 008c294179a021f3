"""`dashboard`: serve the MLflow UI for the workspace store."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from reslab.orchestrator.cli.args import add_workspace_args, interrupt_on_sigterm, port
from reslab.orchestrator.durability.storage import redact
from reslab.orchestrator.durability.workspace import Workspace


def cmd_dashboard(args: argparse.Namespace) -> int:
    from reslab.orchestrator.tracking.dashboard import start_dashboard
    from reslab.orchestrator.tracking.views import study_links

    workspace = Workspace.at(args.workspace)
    uri = workspace.tracking_uri(args.tracking_uri)
    if uri.startswith(("http://", "https://")):
        print(f"tracking server: {redact(uri)} (already served; nothing to start)")
        return 0
    interrupt_on_sigterm()
    print(f"starting the MLflow UI for {redact(uri)} ...", flush=True)
    dash = start_dashboard(workspace, host=args.host, port=args.port, tracking_uri=uri)
    print(f"MLflow UI: {dash.url}  (Ctrl-C to stop; log: {workspace.root / 'dashboard.log'})", flush=True)
    try:
        for study, link in study_links(uri, dash.url):  # each study's runs, grouped by arm
            print(f"  {study}: {link}", flush=True)
        while dash.process.poll() is None:
            time.sleep(0.5)
        print(f"reslab: the MLflow server exited with code {dash.process.returncode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        dash.stop()
        print("MLflow UI stopped", flush=True)
        return 0


def register(sub: Any) -> None:
    p = sub.add_parser("dashboard", help="serve the MLflow UI for the workspace store on 127.0.0.1")
    add_workspace_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=5000)
    p.set_defaults(func=cmd_dashboard)
