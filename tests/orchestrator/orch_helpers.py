"""Helpers shared by the orchestrator tests (a module with a unique name, unlike conftest)."""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

# Two arms x two seeds of a 2-layer, d=32 decoder on 32-token windows: ~1 s per run on one core.
TINY_STUDY = """
study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 4, warmup_steps: 2, lr: 3.0e-3}}
  train: {{steps: {steps}, eval_every: 3, log_every: 1, eval_windows: 8, tail_k: 2, checkpoint_every: 3}}
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
