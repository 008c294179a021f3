"""docker/: the compose stack, the KubeRay manifest and the images, checked without a Docker engine.

What each check stands for: Ray refuses nodes of different versions, so every Ray node runs the one image whose
packages come pinned from docker/requirements.lock, within pyproject's ranges; each GPU worker reserves its own
device; nothing inline is a secret and every `${VAR}` the compose file reads is documented in .env.example; MLflow
answers the Host header the workers send. The compose file is also validated by `docker compose config` where the
plugin exists (not on this project's CI machines: there the structural checks below stand alone).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET", re.IGNORECASE)
VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")
# a literal in place of a secret, e.g. `postgresql://user:password@host`
URL_PASSWORD = re.compile(r"://[^/\s:@]+:[^@\s${}]+@")
IMAGE_EXTRAS = ("gpu", "hub", "postgres")


def _env_example() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in (DOCKER / ".env.example").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def _interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation: `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?err}`, `${VAR?err}`, `$$`."""
    if isinstance(node, dict):
        return {key: _interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [_interpolate(value, env) for value in node]
    if not isinstance(node, str):
        return node

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2) or "", match.group(3) or ""
        value = env.get(name)
        if (op.startswith(":") and not value) or (not op.startswith(":") and value is None):
            if op.endswith("?"):
                raise KeyError(f"${{{name}}} is required: {arg}")
            return arg if op else ""
        return value or ""

    parts = node.split("$$")
    return "$".join(VARIABLE.sub(one, part) for part in parts)


@pytest.fixture(scope="module")
def lock() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (DOCKER / "requirements.lock").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and re.fullmatch(r"[0-9][0-9A-Za-z.]*", version), f"requirements.lock: {line!r} is not name==version"
        pins[canonicalize_name(name)] = version
    return pins


@pytest.fixture(scope="module")
def compose_text() -> str:
    return (DOCKER / "compose.yaml").read_text()


@pytest.fixture(scope="module")
def compose(compose_text: str) -> dict[str, Any]:
    """compose.yaml as Compose reads it with .env.example, its empty required secrets filled with a dummy."""
    env = {key: value or f"dummy-{key.lower()}" for key, value in _env_example().items()}
    return _interpolate(yaml.safe_load(compose_text), env)


@pytest.fixture(scope="module")
def kuberay() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((DOCKER / "kuberay.yaml").read_text()))


def _ray_cluster(kuberay: list[dict[str, Any]]) -> dict[str, Any]:
    (cluster,) = [doc for doc in kuberay if doc["kind"] == "RayCluster"]
    return cluster


def _command(service: dict[str, Any]) -> str:
    command = service.get("command", "")
    return command if isinstance(command, str) else " ".join(command)


def _ray_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if _command(s).startswith("ray start")}


def _gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if "gpu" in d.get("capabilities", [])]


def test_lock_pins_what_pyproject_asks_for(lock):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + [req for extra in IMAGE_EXTRAS for req in extras.get(extra, [])]
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in lock, f"requirements.lock lacks {req.name} (pyproject: {text}); rerun docker/lock.sh"
        assert req.specifier.contains(lock[name], prereleases=True), \
            f"requirements.lock pins {req.name}=={lock[name]}, outside pyproject's {text}; rerun docker/lock.sh"
    for name in ("ray", "torch", "mlflow", "psycopg", "psycopg-binary", "pyarrow"):
        assert name in lock, f"requirements.lock lacks {name}"


def test_images_install_from_the_lock_on_one_pinned_base():
    bases = set()
    for dockerfile in ("Dockerfile", "mlflow.Dockerfile"):
        text = (DOCKER / dockerfile).read_text()
        (base,) = re.findall(r"^ARG BASE=(\S+)$", text, re.MULTILINE)
        image, _, tag = base.partition("@")[0].rpartition(":")
        assert image and re.search(r"\d", tag) and tag != "latest", f"{dockerfile}: base {base!r} is not pinned by tag"
        assert re.search(r"^FROM \$\{BASE\}$", text, re.MULTILINE), f"{dockerfile}: FROM is not the pinned ARG BASE"
        assert "COPY docker/requirements.lock /tmp/requirements.lock" in text
        installs = re.findall(r"pip install ([^&\n]*)", text)
        assert installs, f"{dockerfile} installs nothing"
        for args in installs:
            assert re.search(r"-[rc] /tmp/requirements\.lock", args) or "--no-deps" in args, \
                f"{dockerfile}: `pip install {args}` does not take its versions from the lock"
        bases.add(base)
    assert len(bases) == 1, f"the images start from different bases: {bases}"
    assert "-r /tmp/requirements.lock" in (DOCKER / "Dockerfile").read_text()


def test_the_baked_code_version_is_what_reslab_reads(monkeypatch):
    from reslab.orchestrator.attempt.envinfo import code_version

    text = (DOCKER / "Dockerfile").read_text()
    (template,) = re.findall(r'^ENV RESLAB_CODE_VERSION="(.*)"$', text, re.MULTILINE)
    assert re.search(r"^ARG RESLAB_GIT_SHA", text, re.MULTILINE)
    assert 'org.opencontainers.image.revision="${RESLAB_GIT_SHA}"' in text
    sha = "0123456789abcdef0123456789abcdef01234567"
    value = template.replace('\\"', '"').replace("${RESLAB_GIT_SHA}", sha).replace("${RESLAB_GIT_DIRTY}", "false")
    monkeypatch.setenv("RESLAB_CODE_VERSION", value)
    assert code_version() == {"git_sha": sha, "git_dirty": False, "git_diff_sha256": None}


def test_every_ray_node_runs_the_one_image_with_the_locks_ray(compose, kuberay, lock):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (ray_range,) = [Requirement(r) for r in project["dependencies"] if canonicalize_name(Requirement(r).name) == "ray"]
    assert ray_range.specifier.contains(lock["ray"])

    nodes = _ray_services(compose)
    assert {_command(s).split()[2].split("=")[0] for s in nodes.values()} == {"--head", "--address"}
    images = {(s["image"], s["build"]["dockerfile"]) for s in nodes.values()}
    assert images == {("reslab:latest", "docker/Dockerfile")}, f"Ray nodes run different images: {images}"

    cluster = _ray_cluster(kuberay)
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["spec"]["rayVersion"] == lock["ray"], "kuberay.yaml rayVersion differs from the lock's ray"
    pods = [cluster["spec"]["headGroupSpec"]] + cluster["spec"]["workerGroupSpecs"]
    assert {c["image"] for pod in pods for c in pod["template"]["spec"]["containers"]} == {"reslab:latest"}


def test_one_gpu_per_worker_on_distinct_devices(compose):
    workers = {name: s for name, s in _ray_services(compose).items() if _gpu_devices(s)}
    assert len(workers) >= 2, "compose.yaml should show the one-service-per-GPU pattern with two workers"
    ids = []
    for name, service in workers.items():
        (device,) = _gpu_devices(service)
        assert "count" not in device and len(device["device_ids"]) == 1, f"{name}: reserve one GPU by device_ids"
        assert "--num-gpus=1" in _command(service), f"{name}: ray start should advertise its one GPU"
        ids += device["device_ids"]
    assert len(set(ids)) == len(ids), f"two workers share a GPU: {ids}"
    head = compose["services"]["ray-head"]
    assert not _gpu_devices(head) and "--num-gpus=0" in _command(head)


def test_every_service_has_a_healthcheck_and_a_restart_policy(compose):
    for name, service in compose["services"].items():
        assert service.get("restart") in {"always", "unless-stopped", "on-failure"}, f"{name}: no restart policy"
        test = service.get("healthcheck", {}).get("test")
        assert test and test[0] in {"CMD", "CMD-SHELL"}, f"{name}: no healthcheck"
        for dependency, how in service.get("depends_on", {}).items():
            assert how == {"condition": "service_healthy"}, f"{name} starts before {dependency} is healthy"
    assert compose["services"]["postgres"]["healthcheck"]["test"][1] == "pg_isready"
    assert compose["services"]["ray-head"]["healthcheck"]["test"][1:3] == ["ray", "status"]


def test_no_secret_is_written_inline(compose_text, kuberay):
    raw = yaml.safe_load(compose_text)
    for name, service in raw["services"].items():
        for key, value in service.get("environment", {}).items():
            if SECRET_NAME.search(key):
                assert re.fullmatch(r"\$\{\w+(:?[-?][^}]*)?\}", str(value)), f"{name}: {key} is inline, not ${{VAR}}"
        for text in [_command(service), *map(str, service.get("environment", {}).values())]:
            assert not URL_PASSWORD.search(text), f"{name}: a password inside a URL: {text}"
        assert "POSTGRES_PASSWORD=" not in _command(service) and "--password" not in _command(service)
    assert raw["services"]["ray-head"]["environment"]["RAY_AUTH_MODE"] == "token"

    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "docker/.env"])
        assert ignored.returncode == 0, "git would commit docker/.env, the secrets file"
    for key, value in _env_example().items():
        if SECRET_NAME.search(key):
            assert value == "", f".env.example holds a value for the secret {key}"

    assert not [doc for doc in kuberay if doc["kind"] == "Secret"], "kuberay.yaml must not carry a Secret's values"
    for pod in [_ray_cluster(kuberay)["spec"]["headGroupSpec"], *_ray_cluster(kuberay)["spec"]["workerGroupSpecs"]]:
        for container in pod["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            token = env["RAY_AUTH_TOKEN"].get("valueFrom", {}).get("secretKeyRef", {})
            assert token.get("name") == "reslab-secrets", "kuberay.yaml: RAY_AUTH_TOKEN should come from the Secret"
            for name, entry in env.items():
                assert not (SECRET_NAME.search(name) and "value" in entry), f"kuberay.yaml: {name} is inline"


def test_every_variable_is_documented_in_env_example(compose_text):
    used = {m.group(1) for m in VARIABLE.finditer(compose_text.replace("$$", ""))}
    assert used, "compose.yaml reads no variable from .env"
    missing = used - set(_env_example())
    assert not missing, f"compose.yaml reads {sorted(missing)}, which docker/.env.example does not define"


def test_the_usage_comments_name_studies_that_exist(compose_text):
    texts = [compose_text] + [(DOCKER / name).read_text() for name in ("kuberay.yaml", "Dockerfile")]
    named = {m for text in texts for m in re.findall(r"experiments/[\w.-]+\.yaml", text)}
    assert "experiments/quickstart.yaml" in named
    for study in named:
        assert (ROOT / study).is_file(), f"docker/ names {study}, which does not exist"


def _documented_commands() -> list[tuple[str, list[str]]]:
    """Every complete `reslab SUBCOMMAND ...` line of README's Cluster section and docker/'s usage comments."""
    readme = (ROOT / "README.md").read_text()
    texts = {"README.md": readme[readme.index("## Cluster"):readme.index("\n## ", readme.index("## Cluster") + 1)]}
    texts |= {f"docker/{name}": (DOCKER / name).read_text() for name in ("compose.yaml", "kuberay.yaml")}
    commands = []
    for source, text in texts.items():
        for line in re.sub(r"\\\n[#\s]*", " ", text).splitlines():
            line = line.lstrip("# ").split("  #")[0]
            match = re.search(r"(?:^|\s)reslab ((?:run|submit|status|compare|report|convert|tune|plan)\b.*)", line)
            if match and "..." not in match.group(1):
                commands.append((source, shlex.split(match.group(1))))
    return commands


def test_the_documented_commands_parse_and_name_studies_that_exist():
    from reslab.orchestrator.cli import build_parser

    commands = _documented_commands()
    assert {argv[0] for _, argv in commands} >= {"run", "submit", "status", "compare"}
    parser = build_parser()
    for source, argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{source}: `reslab {shlex.join(argv)}` does not parse")
        study = argv[1].removeprefix("/opt/reslab/")
        assert (ROOT / study).is_file(), f"{source}: {study} does not exist"


def test_storage_scratch_and_tracking_follow_the_contract(compose, kuberay):
    for name, service in _ray_services(compose).items():
        env = service["environment"]
        assert env["RESLAB_STORAGE"] and env["RESLAB_SCRATCH"] == "/scratch", name
        storage = env["RESLAB_STORAGE"]
        if storage.startswith("/"):
            mounts = [v.split(":")[1] for v in service["volumes"] if ":" in v]
            assert any(storage.startswith(m + "/") for m in mounts), f"{name}: {storage} is not on a shared mount"
        assert "/scratch" in service["volumes"], f"{name}: scratch should be the container's own volume"
    config = next(doc for doc in kuberay if doc["kind"] == "ConfigMap")["data"]
    assert config["RESLAB_STORAGE"].startswith(("s3://", "gs://")) and config["RESLAB_SCRATCH"] == "/scratch"
    assert config["RAY_AUTH_MODE"] == "token" and config["MLFLOW_TRACKING_URI"]


def _allowed_hosts(service: dict[str, Any]) -> list[str]:
    (hosts,) = re.findall(r"--allowed-hosts[ =](\S+)", _command(service))
    return hosts.split(",")


def test_mlflow_allows_the_host_the_workers_use_and_stores_in_postgres(compose):
    mlflow = compose["services"]["mlflow"]
    for name, service in _ray_services(compose).items():
        netloc = urlsplit(service["environment"]["MLFLOW_TRACKING_URI"]).netloc
        assert netloc in _allowed_hosts(mlflow), f"{name} reaches MLflow as {netloc}, which MLflow answers with 403"
        assert netloc in mlflow["healthcheck"]["test"][-1], "mlflow's healthcheck should send the workers' Host"
    uri = mlflow["environment"]["MLFLOW_BACKEND_STORE_URI"]
    assert uri.startswith("postgresql+psycopg://") and "@postgres:" in uri
    assert "--backend-store-uri" not in _command(mlflow), "the store URI belongs in the environment"


def _docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _docker_compose(), reason="no `docker compose` plugin here (the structural checks stand in)")
def test_docker_compose_config(tmp_path):
    env = tmp_path / ".env"
    env.write_text("".join(f"{k}={v or 'dummy-' + k.lower()}\n" for k, v in _env_example().items()))
    out = subprocess.run(["docker", "compose", "-f", str(DOCKER / "compose.yaml"), "--env-file", str(env),
                          "config", "--quiet"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and the live processes below it, with what each reaped of its children."""
    from reslab.orchestrator.durability import reaper

    ticks = 0
    for p in set(reaper.descendants([pid])):
        try:
            text = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        ticks += sum(int(v) for v in text[text.rindex(")") + 2:].split()[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_mlflow_healthcheck_passes_for_the_workers_host_and_a_stranger_gets_403(compose, tmp_path):
    """The compose file's --allowed-hosts and healthcheck, run against a real MLflow server (SQLite store, another
    port: the Host header is what MLflow checks, not the port it listens on)."""
    mlflow = compose["services"]["mlflow"]
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--allowed-hosts",
         ",".join(_allowed_hosts(mlflow))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        # bounded by the CPU the server uses to come up (~10-20 s), which load does not stretch as it stretches wall
        # time (131 s at a load of 50: issue 52, item 22); the wall clock is a safety net only
        deadline = time.monotonic() + 900
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, "mlflow server exited"
                cpu = _tree_cpu_seconds(server.pid)
                assert cpu < 300 and time.monotonic() < deadline, f"mlflow server did not start ({cpu:.0f} CPU s)"
                time.sleep(0.5)
        command = mlflow["healthcheck"]["test"]
        assert command[:3] == ["CMD", "python", "-c"]
        check = command[3].replace("127.0.0.1:5000", f"127.0.0.1:{port}")
        assert subprocess.run([sys.executable, "-c", check], capture_output=True).returncode == 0
        stranger = urllib.request.Request(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1",
                                          headers={"Host": "attacker.example:5000"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(stranger, timeout=5)
        assert refused.value.code == 403
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:  # killed and reaped, so no process outlives the test
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
