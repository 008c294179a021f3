"""`workspace.read_runs_in_order`: every run read once, in order, on the caller's thread, whether or not the
read-ahead threads start (issue 39: status, report and the plan's counts read 10^5 run folders through it)."""

import os
import threading

import pytest

from reslab.orchestrator.durability import workspace as ws


def _folders(root, n):
    ids = [f"run-{i:04d}" for i in range(n)]
    for i, run_id in enumerate(ids):
        (root / run_id).mkdir()
        if i % 7:  # some runs have no file: the read-ahead skips what it cannot open
            (root / run_id / "status").write_text(f'{{"i": {i}}}')
    return ids


@pytest.mark.parametrize("cold", [False, True], ids=["cache-warm", "read-ahead"])
def test_every_run_is_read_once_in_order_on_the_callers_thread(tmp_path, monkeypatch, cold):
    ids = _folders(tmp_path, 50)
    monkeypatch.setattr(ws, "READ_AHEAD_CHUNK", 8)
    monkeypatch.setattr(ws, "COLD_S_PER_RUN", 0.0 if cold else 1e9)  # 0: every chunk counts as slow
    advised: list[str] = []
    fadvise = os.posix_fadvise

    def counting(fd, offset, length, advice):
        advised.append(threading.current_thread().name)
        return fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", counting)
    caller = threading.current_thread()
    seen = []

    def read(i):
        assert threading.current_thread() is caller
        seen.append(i)
        status = ws.RunDir(tmp_path / ids[i]).status()
        return ids[i], status

    out = list(ws.read_runs_in_order(tmp_path, ids, ("status", "absent.json"), read))
    assert seen == list(range(50))
    assert [run_id for run_id, _ in out] == ids
    assert [s and s["i"] for _, s in out] == [None if i % 7 == 0 else i for i in range(50)]
    if cold:  # chunks after the first were fetched ahead, on the read-ahead threads, files that exist only
        assert advised and all(name.startswith("read-ahead") for name in advised)
        assert len(advised) == sum(1 for i in range(8, 50) if i % 7)
    else:
        assert advised == []


def test_stopping_early_shuts_the_read_ahead_down(tmp_path, monkeypatch):
    ids = _folders(tmp_path, 40)
    monkeypatch.setattr(ws, "READ_AHEAD_CHUNK", 4)
    monkeypatch.setattr(ws, "COLD_S_PER_RUN", 0.0)
    reads = ws.read_runs_in_order(tmp_path, ids, ("status",), lambda i: i)
    assert [next(reads) for _ in range(6)] == list(range(6))
    reads.close()
    ahead = [t for t in threading.enumerate() if t.name.startswith("read-ahead")]
    for thread in ahead:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in ahead)
