"""The Docker side of every make target (RUNTIME=auto|docker) and of `make build`.

    python -m app.containers run SERVICE COMMAND [ARGS...]   # what `make TARGET` runs unless RUNTIME=local
    python -m app.containers build                          # what `make build` runs

`run` decides the runtime (RUNTIME=auto: docker only where an engine answers AND the image is on this node;
it says which it chose and why), then execs `docker compose ... run --rm --pull never -e NAME ... -v SRC:DST
... SERVICE python -m app COMMAND ARGS`: the settings by name, every path setting mounted at the same path,
you as the user with a HOME on the host, the GPU and InfiniBand overlays where this node has them. It never
pulls and never builds. `build` builds FLAVOR=gpu|cpu through compose.build.yaml. docs/containers.md has it all.

Standard library only: it runs on a node's bare python3 before any venv or image exists.
"""

from __future__ import annotations

import contextlib
import functools
import grp
import http.server
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

from app.common import PASS_NAMES, PASS_PREFIXES, UserError, say

REPO = Path(__file__).resolve().parent.parent
DEFAULT_IMAGE = "verl-stack:0.1.0"
GPU_SERVICES = ("sft-runner", "ray-head", "ray-worker")
SERVICES = ("gsm8k-prep", "merger", *GPU_SERVICES)

# Host values that would break the image's own: its libraries and CUDA toolkit live elsewhere.
NOT_PASSED = ("LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH")

# Path settings: mounted at the same absolute path. "dir": a directory the run writes into (created, as
# you, when missing, and mounted); "out": what the run creates, replaces or moves aside as a whole (merge,
# FRESH=1, tiny-model: atomic renames beside it), so its parent is mounted (created as you when missing);
# "in": mounted when it exists (else the app inside says it is missing, as it would without docker).
PATH_SETTINGS = {
    "DATA_DIR": "dir", "CKPT_DIR": "out", "OUT_DIR": "out", "SMOKE_DIR": "out", "OUT": "out", "FIX": "out",
    "TRAIN_FILE": "in", "VAL_FILE": "in", "MODEL_PATH": "in", "RUN": "in", "MODEL": "in", "GSM8K_SOURCE": "in",
    "RAY_AUTH_TOKEN_PATH": "in",
}
# Where a host directory must not go: the image's own system and code (these trees, and these directories).
IMAGE_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys", "/usr",
               "/opt/venv", "/opt/verl-stack")
IMAGE_DIRS = ("/", "/var", "/opt", "/home", "/home/stack", "/root", "/run", "/tmp")


def env(name: str, default: str | None = None) -> str | None:
    """make's `name` (the command line, the shell, .env); empty counts as unset, as Make exports unset variables
    empty. The docker side's own settings (RUNTIME, IMAGE, GPU, IB, ...) decide where the app runs."""
    return shell().get(name) or default


def shell() -> dict[str, str]:
    # the docker side runs before any venv (stdlib only) and decides where the app runs: it reads make's
    # environment itself, here alone; the app's settings come from app.settings (app_environ)
    return dict(os.environ)


def passthrough_names() -> tuple[str, ...]:
    """The settings handed to the container by name: the registry's (the one list) and the local plan's."""
    from app.settings import passthrough_names as registry_names

    return tuple(dict.fromkeys((*registry_names(), *(n for n in PASS_NAMES if n not in NOT_PASSED))))


def passed_env(environ: dict[str, str]) -> list[str]:
    """The names, set and non-empty in `environ`, that reach the container."""
    names = set(passthrough_names())
    return sorted(k for k, v in environ.items()
                  if v and k not in NOT_PASSED and (k in names or k.startswith(PASS_PREFIXES)))


# --- the engine ---------------------------------------------------------------------------------------
def docker(*args: str, timeout: float = 30) -> subprocess.CompletedProcess | None:
    """`docker ARGS`, captured; None when there is no docker CLI or it did not answer in time."""
    if not shutil.which("docker"):
        return None
    try:
        return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def engine_answers() -> bool:
    result = docker("version", "--format", "{{.Server.Version}}", timeout=10)
    return result is not None and result.returncode == 0 and bool(result.stdout.strip())


def compose_available() -> bool:
    result = docker("compose", "version", "--short", timeout=10)
    return result is not None and result.returncode == 0


def image_exists(image: str) -> bool:
    result = docker("image", "inspect", "--format", "{{.Id}}", image)
    return result is not None and result.returncode == 0


def nvidia_runtime() -> bool:
    result = docker("info", "--format", "{{json .Runtimes}}")
    return result is not None and result.returncode == 0 and "nvidia" in result.stdout


def memlock_allowed(image: str) -> str | None:
    """None when a container of `image` may have memlock unlimited, else the engine's reason."""
    result = docker("run", "--rm", "--pull", "never", "--network", "none", "--ulimit", "memlock=-1:-1",
                    "--entrypoint", "true", image, timeout=120)
    if result is None:
        return "the Docker engine did not answer"
    if result.returncode == 0:
        return None
    lines = [line.strip() for line in result.stderr.splitlines()
             if line.strip() and not line.startswith("Run 'docker")]
    return lines[0].removeprefix("docker: ") if lines else f"exit code {result.returncode}"


def image_name() -> str:
    return env("IMAGE", DEFAULT_IMAGE)


def setting(name: str, default: str) -> str:
    return env(name, default).strip().lower()


# --- paths --------------------------------------------------------------------------------------------
def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


class Mounts:
    """Host directories mounted at container paths. A path the user gave keeps its spelling inside (the
    target), while the source is where it really is (symlinks resolved), so a checkout or a setting reached
    through a symlink means the same files inside as outside."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, str]] = []  # (source, target, mode: rw | ro | compose)

    def host_of(self, path: str) -> str | None:
        """The host path behind container path `path` (deepest mount wins), None for the image's own."""
        covering = [(source, mounted) for source, mounted, _ in self.items if _under(path, mounted)]
        if not covering:
            return None
        source, mounted = max(covering, key=lambda item: len(item[1]))
        rel = os.path.relpath(path, mounted)
        return source if rel == "." else os.path.join(source, rel)

    def resolve(self, path: str, depth: int = 0) -> str | None:
        """Where container path `path` leads on the host, following symlinks as the container would (an
        absolute link is a container path), None when it leaves the mounts."""
        parts = [part for part in path.split("/") if part]
        current = "/"
        for i, part in enumerate(parts):
            following = os.path.join(current, part)
            host = self.host_of(following)
            if host is not None and os.path.islink(host) and depth < 40:
                link = os.readlink(host)
                base = link if os.path.isabs(link) else os.path.join(current, link)
                return self.resolve(os.path.normpath(os.path.join(base, *parts[i + 1:])), depth + 1)
            current = following
        return self.host_of(current)

    def add(self, source: str, target: str, mode: str = "rw") -> None:
        """Mount `source` at `target`, unless container path `target` already leads there."""
        host = self.resolve(target)
        if host is None or os.path.realpath(host) != os.path.realpath(source):
            self.items.append((source, target, mode))

    def add_path(self, real: str, given: str) -> None:
        """Make container path `given` lead to host directory `real`: at its real path first (so that
        symlinks inside other mounts resolve), then at the path as given if that still does not lead there."""
        self.add(real, real)
        self.add(real, given)

    def flags(self) -> list[str]:
        return [arg for source, target, mode in self.items if mode != "compose"
                for arg in ("-v", f"{source}:{target}" + (":ro" if mode == "ro" else ""))]


def mount_dir(name: str, raw: str, cwd: Path) -> tuple[str, str] | None:
    """(source, target) to mount for setting `name`=`raw`, None when nothing needs mounting; creates a
    missing output directory as you; a UserError when it cannot be mounted."""
    given = os.path.normpath(os.path.join(cwd, os.path.expanduser(raw)))
    kind = PATH_SETTINGS.get(name, "in")
    if kind == "in" and not os.path.exists(given):
        return None  # an input that is not here: the app inside says so, as it would without docker
    target = given if kind == "dir" or (kind == "in" and os.path.isdir(given)) else os.path.dirname(given)
    if target in IMAGE_DIRS or any(_under(target, tree) for tree in IMAGE_TREES):
        what = "it" if target == given else f"its directory {target}"
        raise UserError(f"{name}={raw}: {what} cannot be mounted into the container at the same path (part of "
                        "the image): use a directory of its own, e.g. under /data or your home")
    if not os.path.isdir(target):
        try:
            os.makedirs(target, exist_ok=True)
        except OSError as exc:
            raise UserError(f"{name}={raw}: cannot create {target} ({exc.strerror}): pick a directory you can "
                            "write") from None
    return os.path.realpath(target), target


def arg_paths(command: list[str]) -> list[tuple[str, str]]:
    """Paths given as arguments: `data check FILE [--fix OUT]`, `tiny-model DIR`."""
    if command[:2] == ["data", "check"]:
        rest, found = command[2:], []
        for i, arg in enumerate(rest):
            if i and rest[i - 1] == "--fix":
                found.append(("FIX", arg))
            elif not arg.startswith("-") and (i == 0 or rest[i - 1] not in ("--kind", "--fix")):
                found.append(("FILE", arg))
        return found
    if command[:1] == ["tiny-model"] and len(command) > 1 and not command[1].startswith("-"):
        return [("OUT", command[1])]
    return []


def path_mounts(environ: dict[str, str], command: list[str], cwd: Path) -> Mounts:
    mounts = Mounts()
    for sub in ("data", "models", "checkpoints"):  # compose.yaml mounts these itself, at the same path
        (REPO / sub).mkdir(exist_ok=True)  # so that Docker does not create them owned by root
        mounts.add(os.path.realpath(REPO / sub), str(REPO / sub), "compose")
    wanted = [(name, environ[name]) for name in PATH_SETTINGS if environ.get(name)]
    for name, raw in [*wanted, *arg_paths(command)]:
        if name == "GSM8K_SOURCE" and raw == "hf":
            continue
        found = mount_dir(name, raw, cwd)
        if found:
            mounts.add_path(*found)
    for extra in (environ.get("MOUNTS") or "").split():
        if not os.path.isabs(extra) or not os.path.isdir(extra):
            raise UserError(f"MOUNTS: {extra} is not an existing absolute directory: list host directories "
                            "to mount at the same path, separated by spaces")
        mounts.add_path(os.path.realpath(extra), os.path.normpath(extra))
    return mounts


# --- you, inside --------------------------------------------------------------------------------------
def state_dir() -> Path:
    """Host directory for the containers' HOME and caches: yours, persistent, outside the checkout."""
    base = env("STACK_HOME")
    if base:
        return Path(base).expanduser().resolve()
    cache = Path(env("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (cache / "verl-stack").resolve()


def write_if_changed(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def identity_mounts(mounts: Mounts, service: str) -> dict[str, str]:
    """Run as you: a passwd/group entry (ssh, getpass and Triton need one), a writable HOME and caches under
    state_dir(), your ~/.ssh read-only for the merger. Returns the environment to set inside."""
    uid, gid = os.getuid(), os.getgid()
    home = env("HOME") or str(Path.home())  # your HOME here is ssh's home inside (~/.ssh)
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = f"u{uid}"
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = f"g{gid}"
    state = state_dir()
    inside_home = state / "home"
    try:
        (state / "etc").mkdir(parents=True, exist_ok=True)
        inside_home.mkdir(parents=True, exist_ok=True)
        passwd = f"root:x:0:0:root:{home if uid == 0 else '/root'}:/bin/sh\n" + (
            f"{name}:x:{uid}:{gid}::{home}:/bin/sh\n" if uid else "")
        groups = "root:x:0:\n" + (f"{group}:x:{gid}:\n" if gid else "")
        write_if_changed(state / "etc" / "passwd", passwd)
        write_if_changed(state / "etc" / "group", groups)
    except OSError as exc:
        raise UserError(f"cannot prepare {state} for the containers' HOME ({exc.strerror}): set STACK_HOME to "
                        "a directory you can write") from None
    mounts.add(str(state / "etc" / "passwd"), "/etc/passwd", "ro")
    mounts.add(str(state / "etc" / "group"), "/etc/group", "ro")
    mounts.add(os.path.realpath(inside_home), str(inside_home))
    ssh = Path(home) / ".ssh"
    if service == "merger" and ssh.is_dir():
        mounts.add(os.path.realpath(ssh), str(ssh), "ro")
    # the compile caches too (Triton, Inductor), else in the container's /tmp and compiled again by every run
    # (93 s in the first GRPO step at 0.5B; warm, its first old log-prob 16 s not 34: docs/gpu-runs.md 11, 13)
    cache = inside_home / ".cache"
    return {"HOME": str(inside_home), "XDG_CACHE_HOME": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor")}


# --- the plan -----------------------------------------------------------------------------------------
def compose_files(service: str, image: str) -> list[str]:
    """compose.yaml plus the overlays this node supports (GPU=auto|0|1, IB=auto|0|1)."""
    files = ["compose.yaml"]
    gpu, ib = setting("GPU", "auto"), setting("IB", "auto")
    if service in GPU_SERVICES and (gpu == "1" or (gpu == "auto" and nvidia_runtime())):
        files.append("compose.gpu.yaml")
    if service in GPU_SERVICES and (ib == "1" or (ib == "auto" and os.path.exists("/dev/infiniband"))):
        reason = memlock_allowed(image)
        if reason:
            raise UserError(f"this Docker engine may not raise memlock for InfiniBand ({reason}; rootless Docker "
                            "lacks CAP_SYS_RESOURCE): run the engine as root, or IB=0 to run without RDMA")
        files.append("compose.ib.yaml")
    return files


def plan(service: str, command: list[str], environ: dict[str, str], cwd: Path) -> tuple[list[str], dict[str, str]]:
    """The `docker compose ... run` argv and the environment compose runs with."""
    if service not in SERVICES:
        raise UserError(f"unknown service {service!r}: one of {', '.join(SERVICES)}")
    image = image_name()
    mounts = path_mounts(environ, command, cwd)
    inside = identity_mounts(mounts, service)
    names = passed_env(environ)
    files = compose_files(service, image)
    argv = ["docker", "compose", "--project-directory", str(REPO)]
    argv += [arg for file in files for arg in ("-f", str(REPO / file))]
    argv += ["run", "--rm", "--pull", "never"]
    for name in [*names, *(f"{name}={value}" for name, value in inside.items())]:
        argv += ["-e", name]
    argv += mounts.flags()
    argv += [service, "python", "-m", "app", *command]
    compose_env = {**environ, "UID": str(os.getuid()), "GID": str(os.getgid()), "PWD": str(REPO), "IMAGE": image}
    return argv, compose_env


def choose_runtime() -> tuple[str, str]:
    """(runtime, why): RUNTIME=docker|local as asked; auto = docker only where the engine answers and the
    image is on this node."""
    runtime = setting("RUNTIME", "auto")
    image = image_name()
    if runtime not in ("auto", "docker", "local"):
        raise UserError(f"RUNTIME={runtime}: use auto, docker or local")
    if runtime == "local":
        return "local", "RUNTIME=local"
    if not engine_answers():
        if runtime == "docker":
            raise UserError("RUNTIME=docker but no Docker engine answers (`docker version`): start it, or run "
                            "with RUNTIME=local")
        return "local", "no Docker engine answers"
    if not image_exists(image):
        if runtime == "docker":
            raise UserError(f"image {image} not found on this node: make build, or docker load -i FILE")
        return "local", f"image {image} is not on this node (make build, or docker load -i FILE, for docker)"
    if not compose_available():
        raise UserError("the Docker engine answers but `docker compose` (v2) is missing: install the compose "
                        "plugin (docs/containers.md), or run with RUNTIME=local")
    return "docker", f"image {image}"


def app_environ() -> dict[str, str]:
    """The environment the app will see: the shell's plus the lines of .env it does not set (the settings
    registry's reading), so that a path set only in .env is mounted and its value passed. On a bare host
    without python-dotenv, the shell's alone (compose still hands .env to the container)."""
    try:
        from app.settings import load

        return load(shell()).environ()
    except ModuleNotFoundError:
        return shell()


def run(service: str, command: list[str]) -> int:
    runtime, why = choose_runtime()
    if runtime == "local":
        say(f"runtime: local ({why})")
        os.execv(sys.executable, [sys.executable, "-m", "app", *command])
    # relative paths mean what they mean inside: the container's working directory is the checkout
    argv, compose_env = plan(service, command, app_environ(), REPO)
    say(f"runtime: docker ({why})")
    say(f"$ {shlex.join(argv)}")  # -e NAME carries no value: secrets stay out of this line
    os.chdir(REPO)
    os.execvpe(argv[0], argv, compose_env)
    return 0  # not reached


# --- build --------------------------------------------------------------------------------------------
def cuda_image() -> str:
    match = re.search(r"^ARG CUDA_IMAGE=(\S+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert match, "Dockerfile lacks ARG CUDA_IMAGE"
    return match.group(1)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the stdlib's signature
        pass


BUILD_FILES_PORT = 45871  # fixed, so that the URL (a build arg) stays the same and the layer cache holds


@contextlib.contextmanager
def served(files: dict[str, Path]) -> Iterator[str | None]:
    """Serve `files` (name -> host file or directory) on 127.0.0.1 for the build; yields the URL."""
    if not files:
        yield None
        return
    raw = env("BUILD_FILES_PORT", str(BUILD_FILES_PORT))
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise UserError(f"BUILD_FILES_PORT={raw}: a TCP port number (1-65535) free on 127.0.0.1")
    port = int(raw)
    with tempfile.TemporaryDirectory(prefix="verl-stack-build-") as tmp:
        for name, source in files.items():
            os.symlink(source, Path(tmp) / name)
        handler = functools.partial(_Quiet, directory=tmp)
        try:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        except OSError as exc:
            raise UserError(f"cannot serve SITE_CA/WHEELS to the build on 127.0.0.1:{port} ({exc.strerror}): "
                            "set BUILD_FILES_PORT to a free port") from None
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()


def build() -> int:
    flavor = setting("FLAVOR", "gpu")
    if flavor not in ("gpu", "cpu"):
        raise UserError(f"FLAVOR={flavor}: use gpu (CUDA, the default) or cpu (tests, laptops)")
    if not engine_answers():
        raise UserError("no Docker engine answers (`docker version`): start it, then rerun make build")
    if not compose_available():
        raise UserError("`docker compose` (v2) is missing: install the compose plugin (docs/containers.md)")
    base = env("BASE_IMAGE") or (cuda_image() if flavor == "gpu" else None)
    if not base:
        raise UserError("FLAVOR=cpu needs BASE_IMAGE: a Debian/Ubuntu image with python3 on this node "
                        "(scripts/offline-base.sh NAME makes one without a registry)")
    if flavor == "cpu" and not image_exists(base):
        raise UserError(f"base image {base} not found on this node: scripts/offline-base.sh {base}, or docker "
                        "load -i FILE (make build never pulls it)")
    files: dict[str, Path] = {}
    for name, served_as, is_dir in (("SITE_CA", "ca.crt", False), ("WHEELS", "wheels", True)):
        raw = env(name)
        if not raw:
            continue
        path = Path(raw).expanduser().resolve()
        if not (path.is_dir() if is_dir else path.is_file()):
            raise UserError(f"{name}={raw} is not {'a directory' if is_dir else 'a file'}: "
                            f"{'a directory of wheels' if is_dir else 'the site CA bundle (PEM)'}, or unset it")
        files[served_as] = path
    if flavor == "cpu" and not (env("TORCH_INDEX_URL") or "wheels" in files):
        raise UserError("FLAVOR=cpu needs a CPU torch: TORCH_INDEX_URL=<index with CPU wheels> or "
                        "WHEELS=<directory with the torch CPU wheel>")
    builder = setting("BUILDER", "buildkit")
    if builder not in ("buildkit", "legacy"):
        raise UserError(f"BUILDER={builder}: use buildkit (default) or legacy")
    image = image_name()
    started = time.monotonic()
    with served(files) as url:
        build_env = {**shell(), "IMAGE": image, "FLAVOR": flavor, "BASE_IMAGE": base,
                     "BUILD_FILES_URL": url or "", "DOCKER_BUILDKIT": "1" if builder == "buildkit" else "0"}
        argv = ["docker", "compose", "--project-directory", str(REPO), "-f", str(REPO / "compose.build.yaml"),
                "build", "image"]
        say(f"building {image} (FLAVOR={flavor}, BASE_IMAGE={base}, BUILDER={builder}"
            + (f", serving {', '.join(sorted(files))} on {url}" if url else "") + ")")
        say(f"$ {shlex.join(argv)}")
        rc = subprocess.run(argv, cwd=REPO, env=build_env).returncode
    if rc != 0:
        raise UserError(f"the image build failed (exit code {rc}, its output is above): fix the cause and rerun "
                        "make build (finished stages are cached)")
    say(f"built {image} (FLAVOR={flavor}) in {time.monotonic() - started:.0f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["build"] and len(argv) == 1:
            return build()
        if argv[:1] == ["run"] and len(argv) >= 3:
            return run(argv[1], argv[2:])
        if argv[:1] in (["-h"], ["--help"]):
            print(__doc__)
            return 0
        raise UserError("usage: python -m app.containers run SERVICE COMMAND [ARGS...] | build")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
