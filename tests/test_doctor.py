"""doctor: real sockets, real routes, real files; the whole screen through the CLI."""

from __future__ import annotations

import shutil
import socket

import pytest
from conftest import assert_one_line_error, run_app

from app.doctor import model_parameters

# Settings a developer's shell may carry that would change what doctor sees.
CLEAN = {k: "" for k in ("HEAD_IP", "MASTER_ADDR", "NNODES", "GPUS_PER_NODE", "MODEL_PATH", "DATA_DIR",
                         "TRAIN_FILE", "VAL_FILE", "CKPT_DIR", "JOB", "RAY_PORT", "EXPERIMENT", "NODE_RANK")}


def lines_of(result) -> list[str]:
    return result.stdout.splitlines()


def test_parameter_count_read_from_safetensors_headers_matches_the_model(tiny_model_dir):
    from safetensors import safe_open

    total = 0
    for path in tiny_model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                n = 1
                for dim in handle.get_slice(name).get_shape():
                    n *= dim
                total += n
    assert model_parameters(tiny_model_dir) == total > 100_000


def test_doctor_sees_the_head_listening_on_the_ray_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run_app("doctor", env={**CLEAN, "HEAD_IP": "127.0.0.1", "RAY_PORT": str(port)})
    head = next(line for line in lines_of(result) if "Ray head" in line)
    assert head.split()[0] == "OK" and f"127.0.0.1:{port} answers" in head, result.stdout
    route = next(line for line in lines_of(result) if " interface " in line)
    assert "leaves via lo" in route


def test_doctor_without_gpus_says_so_and_every_red_line_says_what_to_do(tmp_path):
    result = run_app("doctor", env={**CLEAN, "MODEL_PATH": str(tmp_path / "no-model"), "NNODES": "2",
                                    "NODE_RANK": "2", "HEAD_IP": "127.0.0.1", "DATA_DIR": str(tmp_path / "data")})
    lines = lines_of(result)
    assert result.returncode == 1, result.stdout + result.stderr
    if shutil.which("nvidia-smi") is None:
        gpu = next(line for line in lines if " GPUs " in line)
        assert "no GPU on this node" in gpu
    red = [i for i, line in enumerate(lines) if line.split()[:1] == ["FAIL"]]
    # missing model, loopback head, a rank outside 0..NNODES-1
    assert {lines[i].split()[1] for i in red} >= {"MODEL_PATH", "interface", "node"}
    rank = next(i for i in red if lines[i].split()[1] == "node")
    assert "NODE_RANK=2 but NNODES=2: the ranks are 0..1" in lines[rank]
    for i in red:
        assert lines[i + 1].strip().startswith("-> "), lines[i]
    assert lines[-1].startswith("NOT READY")


def test_doctor_is_ready_when_model_and_data_are_there(tiny_model_dir, tmp_path):
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    for split in ("train", "test"):
        (data / f"{split}.parquet").write_bytes(b"PAR1")
    result = run_app("doctor", env={**CLEAN, "JOB": "grpo", "MODEL_PATH": str(tiny_model_dir),
                                    "DATA_DIR": str(tmp_path / "data"), "CKPT_DIR": str(tmp_path / "run")})
    lines = lines_of(result)
    for name in ("MODEL_PATH", "grpo train data", "grpo val data", "disk", "network", "node rank"):
        line = next(line for line in lines if f" {name} " in line)
        assert line.split()[0] == "OK", line
    red = [line for line in lines if line.startswith("  FAIL")]
    assert result.returncode == (1 if red else 0) and (lines[-1].startswith("ready") or red), result.stdout


def test_doctor_shows_a_wrong_job_as_a_red_line_with_what_to_do():
    result = run_app("doctor", env={**CLEAN, "JOB": "ppo"})
    settings = [line for line in lines_of(result) if line.split()[:2] == ["FAIL", "settings"]]
    assert result.returncode == 1 and settings and "JOB='ppo' is not sft or grpo" in settings[0], result.stdout


def test_doctor_with_an_unreadable_config_blames_the_config_not_the_model(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("trainer: [\n")
    lines = lines_of(run_app("doctor", env={**CLEAN, "CONFIG": str(config)}))
    model = next(line for line in lines if " MODEL_PATH " in line)
    assert model.split()[0] == "WARN" and "not checked: the settings could not be read" in model, model
    settings = [line for line in lines if line.split()[:2] == ["FAIL", "settings"]]
    assert settings and "is not valid YAML" in settings[0]
