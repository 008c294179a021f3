"""A tracking URI with credentials in it (`http://user:password@host`): the server probe sends them
as Basic auth (as MLflow's client does) instead of taking `user:password@host` for a host name, and
`reslab dashboard` never prints the password (issue 22, item 4).

A real HTTP server on 127.0.0.1 (the standard library's) that answers MLflow's two probe paths
only with the right Authorization header: a stand-in for an MLflow server behind basic auth, since
the probe is all that is tested here.
"""

from __future__ import annotations

import base64
import http.server
import threading

import pytest

from reslab.orchestrator.cli import main
from reslab.orchestrator.tracking.store import TrackingUnavailable, check_server

EXPECTED = "Basic " + base64.b64encode(b"mlflow:s3cr3t pw").decode()


class _BasicAuthOnly(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        ok = self.headers.get("Authorization") == EXPECTED and self.path.split("?")[0] in (
            "/health", "/api/2.0/mlflow/experiments/search")
        self.send_response(200 if ok else 401)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BasicAuthOnly)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_credentials_in_the_uri_reach_the_server_as_basic_auth(server):
    check_server(f"http://mlflow:s3cr3t%20pw@127.0.0.1:{server}")  # percent-encoded, as in a URI
    with pytest.raises(TrackingUnavailable, match="HTTP 401") as err:
        check_server(f"http://mlflow:wrong@127.0.0.1:{server}")
    assert "wrong" not in str(err.value)


def test_the_dashboard_prints_no_password(capsys):
    assert main(["dashboard", "--tracking-uri", "http://mlflow:s3cr3t@mlflow.example:5000"]) == 0
    out = capsys.readouterr().out
    assert "s3cr3t" not in out and "http://mlflow:***@mlflow.example:5000" in out
