"""The docker side's plan without an engine (app/containers.py): what `make TARGET` would hand to
`docker compose run`. The engine itself is exercised by tests/containers (make test-containers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app import containers
from app.common import UserError
from conftest import REPO


@pytest.fixture
def no_overlays(monkeypatch, tmp_path):
    monkeypatch.setenv("GPU", "0")
    monkeypatch.setenv("IB", "0")
    monkeypatch.setenv("STACK_HOME", str(tmp_path / "state"))


def flags(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def test_plan_passes_settings_by_name_with_the_launch_prefixes_but_not_host_library_paths(no_overlays, tmp_path):
    environ = {"NODE_RANK": "1", "NCCL_IB_GID_INDEX": "3", "TORCH_NCCL_BLOCKING_WAIT": "1", "RSYNC_RSH": "ssh -p 2",
               "CUDA_VISIBLE_DEVICES": "0,1", "LD_LIBRARY_PATH": "/host/lib", "CUDA_HOME": "/host/cuda",
               "EMPTY_MAKE_EXPORT": "", "FRESH": "", "UNRELATED": "x"}
    argv, compose_env = containers.plan("sft-runner", ["sft"], environ, REPO)
    passed = flags(argv, "-e")
    for name in ("NODE_RANK", "NCCL_IB_GID_INDEX", "TORCH_NCCL_BLOCKING_WAIT", "RSYNC_RSH", "CUDA_VISIBLE_DEVICES"):
        assert name in passed, name
    for name in ("LD_LIBRARY_PATH", "CUDA_HOME", "FRESH", "UNRELATED"):
        assert name not in passed, name
    assert "ssh -p 2" not in " ".join(argv)
    assert argv[-5:] == ["sft-runner", "python", "-m", "app", "sft"] and "--pull" in argv
    assert compose_env["UID"] == str(os.getuid()) and compose_env["PWD"] == str(REPO)
    assert "compose.gpu.yaml" not in " ".join(argv) and "compose.ib.yaml" not in " ".join(argv)


def test_plan_mounts_outside_paths_at_the_same_path_and_writable_parents_of_outputs(no_overlays, tmp_path):
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    environ = {"MODEL_PATH": str(model), "DATA_DIR": str(tmp_path / "new" / "data"),
               "OUT_DIR": str(tmp_path / "out" / "merged"), "TRAIN_FILE": str(tmp_path / "missing.parquet")}
    argv, _ = containers.plan("merger", ["merge"], environ, REPO)
    mounts = flags(argv, "-v")
    assert f"{model}:{model}" in mounts
    assert f"{tmp_path / 'new' / 'data'}:{tmp_path / 'new' / 'data'}" in mounts and (tmp_path / "new" / "data").is_dir()
    assert f"{tmp_path / 'out'}:{tmp_path / 'out'}" in mounts and not (tmp_path / "out" / "merged").exists()
    assert not any("missing.parquet" in m for m in mounts)  # an input that is not here: the app says so inside
    assert not any(m.startswith(f"{REPO}/data:") for m in mounts)  # compose.yaml mounts the checkout's own


def test_plan_follows_symlinks_as_the_container_would(no_overlays, tmp_path):
    real = tmp_path / "real-model"
    real.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "link").symlink_to(real)
    environ = {"CKPT_DIR": str(outside / "run"), "MODEL_PATH": str(outside / "link")}
    argv, _ = containers.plan("sft-runner", ["sft"], environ, REPO)
    mounts = flags(argv, "-v")
    assert f"{outside}:{outside}" in mounts  # CKPT_DIR's parent
    assert f"{real}:{real}" in mounts  # the link inside that mount resolves in the container too


def test_paths_inside_the_image_are_refused_in_one_line(no_overlays):
    for name, value in (("DATA_DIR", "/usr/share/x"), ("OUT_DIR", "/merged"), ("MODEL_PATH", "/etc")):
        with pytest.raises(UserError) as info:
            containers.plan("merger", ["merge"], {name: value}, REPO)
        assert str(info.value).startswith(f"{name}={value}:") and "\n" not in str(info.value)


def test_merger_gets_your_ssh_read_only_only_when_you_have_one(no_overlays, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    (tmp_path / "me").mkdir()
    argv, _ = containers.plan("merger", ["gather"], {}, REPO)
    assert not any(".ssh" in m for m in flags(argv, "-v")) and not (tmp_path / "me" / ".ssh").exists()
    (tmp_path / "me" / ".ssh").mkdir()
    argv, _ = containers.plan("merger", ["gather"], {}, REPO)
    assert f"{tmp_path / 'me' / '.ssh'}:{tmp_path / 'me' / '.ssh'}:ro" in flags(argv, "-v")
    argv, _ = containers.plan("sft-runner", ["sft"], {}, REPO)
    assert not any(".ssh" in m for m in flags(argv, "-v"))
    passwd = (tmp_path / "state" / "etc" / "passwd").read_text()
    assert f":{os.getuid()}:{os.getgid()}:" in passwd and str(tmp_path / "me") in passwd


def test_gpu_1_adds_the_gpu_overlay_without_asking_the_engine(no_overlays, monkeypatch):
    monkeypatch.setenv("GPU", "1")
    argv, _ = containers.plan("ray-worker", ["grpo-worker"], {}, REPO)
    assert str(REPO / "compose.gpu.yaml") in argv
    argv, _ = containers.plan("merger", ["merge"], {}, REPO)
    assert str(REPO / "compose.gpu.yaml") not in argv  # GPUs go to the GPU services only


def test_compile_caches_live_in_the_persistent_home_not_in_the_containers_tmp(no_overlays, tmp_path):
    """Triton's and Inductor's caches inside the mounted HOME under STACK_HOME (kept on the host), not in the
    container's own /tmp, which every `docker compose run --rm` starts empty."""
    argv, _ = containers.plan("ray-head", ["grpo-head"], {}, REPO)
    inside = dict(value.split("=", 1) for value in flags(argv, "-e") if "=" in value)
    home = Path(inside["HOME"])
    assert f"{home}:{home}" in flags(argv, "-v") and home.is_relative_to(tmp_path / "state")
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert Path(inside[name]).is_relative_to(home), name
