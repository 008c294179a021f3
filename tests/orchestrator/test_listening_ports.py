"""What a `reslab run` exposes: during a real study on a local Ray instance, every TCP port that
the driver or any process it started listens on is bound to loopback; after a SIGKILL of the
driver, none of those processes lives on for more than a few seconds.

Sockets are attributed to processes through /proc (`/proc/net/tcp{,6}` inodes matched against
each process's `/proc/<pid>/fd`), so other users of the machine do not count; when iproute2's
`ss` is installed, each socket found is also checked to appear in `ss -ltnH` as listed there.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from orch_helpers import write_study

from reslab.orchestrator.durability import reaper

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LISTEN = "0A"


def listening_sockets() -> dict[int, tuple[str, int]]:
    """{inode: (address, port)} of every TCP socket in LISTEN state on this machine."""
    out = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state != LISTEN:
                continue
            hex_ip, hex_port = local.split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints the address as 32-bit words in host (little-endian) order
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(packed) if width == 4 else ipaddress.IPv6Address(packed)
            out[inode] = (str(address), int(hex_port, 16))
    return out


def socket_inodes(pid: int) -> set[int]:
    found = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def tree_listeners(root: int) -> dict[tuple[str, int], str]:
    """{(address, port): process name} for the LISTEN sockets of `root` and its descendants."""
    sockets = listening_sockets()
    out = {}
    for pid in reaper.descendants([root]):
        for inode in socket_inodes(pid) & sockets.keys():
            out[sockets[inode]] = f"{comm(pid)}[{pid}]"
    return out


def test_a_local_run_listens_on_loopback_only_and_dies_with_its_driver(tmp_path):
    spec = write_study(tmp_path, name="ports", steps=400)
    log = tmp_path / "driver.log"
    cmd = [sys.executable, "-c", "import sys; from reslab.orchestrator.cli import main; sys.exit(main())",
           "run", str(spec), "--workspace", str(tmp_path / "ws"), "--max-concurrent", "2"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log, "w") as out:
        driver = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    seen: dict[tuple[str, int], str] = {}
    try:
        deadline = time.monotonic() + 150
        # sample until the training workers run, then a few more times while they train
        samples_with_workers = 0
        while samples_with_workers < 5:
            assert driver.poll() is None, f"the driver exited early:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no Ray worker started:\n{log.read_text()[-3000:]}"
            now = tree_listeners(driver.pid)
            seen.update(now)
            if any((tmp_path / "ws").rglob("metrics.jsonl")):
                samples_with_workers += 1
            time.sleep(1.0)
        tree = reaper.descendants([driver.pid])[1:]
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()

    assert len(seen) >= 4, f"expected the GCS, raylet, agents and workers to listen somewhere: {seen}"
    exposed = {f"{addr}:{port}": who for (addr, port), who in seen.items() if not is_loopback(addr)}
    assert not exposed, f"listening beyond loopback: {exposed}"
    if shutil.which("ss"):
        listed = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
        assert any(f":{port} " in listed for _, port in seen), listed

    killed_at = time.monotonic()
    while (left := [pid for pid in tree if alive(pid)]) and time.monotonic() - killed_at < 5:
        time.sleep(0.2)
    if left:
        names = {pid: comm(pid) for pid in left}
        for pid in left:  # clean up before failing
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{len(left)} processes outlived the SIGKILLed driver by 5 s: {names}")
