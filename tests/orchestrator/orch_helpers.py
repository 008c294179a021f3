"""Helpers shared by the orchestrator tests (a module with a unique name, unlike conftest)."""

from __future__ import annotations

import contextlib
import socket
import textwrap
import threading
from pathlib import Path

# Two arms x two seeds of a 2-layer, d=32 decoder on 32-token windows: ~1 s per run on one core.
TINY_STUDY = """
study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 4, warmup_steps: 2, lr: 3.0e-3}}
  train: {{steps: {steps}, eval_every: 3, log_every: 1, eval_windows: 8, tail_k: 2, checkpoint_every: 3}}
  cost: {{decode_batch: 2, new_tokens: 2, repeats: 1}}  # every cost metric, measured in ~0.1 s
arms:
  control: prenorm
  attnres: {{residual: attnres}}
seeds: 2
comparisons:
  - {{name: main, control: control, treatments: [attnres], exploratory: true}}
"""


def write_study(directory: Path, name: str = "tiny", steps: int = 6, text: str | None = None) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(textwrap.dedent(text if text is not None else TINY_STUDY.format(name=name, steps=steps)))
    return path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it), for a server a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TcpProxy:
    """A TCP forwarder on 127.0.0.1 in front of a server, which a test stops (the listener and every open
    connection closed: clients see the server vanish mid-request) and starts again on the same port."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port, self.port = upstream_port, free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        for s in ([listener] if listener else []) + conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:  # each socket is the source of one pump, which closes it
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_RDWR)
            src.close()


class KilledDriver(BaseException):
    """What a SIGKILLed driver leaves behind cannot be produced in-process by a signal (pytest would die with
    it); raising past every handler after a given number of completed runs leaves the storage and the run
    directories exactly as a killed driver does: the run in flight claimed and checkpointed, the rest queued."""


def dying_backend(survive: int, error: type[BaseException] = KilledDriver):
    """An in-process backend (`LocalBackend`) whose driver is killed (`KilledDriver`) at its poll after
    `survive` completed runs; `error=KeyboardInterrupt` is a Ctrl-C landing where the driver waits."""
    from reslab.orchestrator.dispatch.local_backend import LocalBackend

    class DyingBackend(LocalBackend):
        def __init__(self) -> None:
            super().__init__()
            self.survive = survive

        def poll(self, timeout):
            if self.survive == 0:
                raise error
            self.survive -= 1
            return super().poll(timeout)

    return DyingBackend()
