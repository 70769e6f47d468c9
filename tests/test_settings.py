"""Settings (app/settings.py): one registry, read once, one precedence (shell > .env > default), every
bad value refused in one line before anything starts, and the artefacts rendered from the registry
(compose's pass-through list, README tables in English and 中文, .env.example) agreeing with it.

Through real processes: `python -m app ...` and `make ...` subprocesses with a real .env file.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app import settings as st
from conftest import REPO, assert_one_line_error, run_app


def settings_table(result) -> dict[str, tuple[str, str]]:
    """`python -m app settings` output -> name: (source, value)."""
    assert result.returncode == 0, result.stderr
    out = {}
    for line in result.stdout.splitlines()[1:]:
        match = re.match(r"  (\S+)\s+(shell|\.env|ARGS|CONFIG|slurm|kubernetes|skypilot|default|unset)\s?\s*(.*)$", line)
        if match:
            out[match.group(1)] = (match.group(2), match.group(3).strip())
    return out


@pytest.fixture
def dotenv(tmp_path) -> Path:
    return tmp_path / "node.env"


def app_with(dotenv: Path, *args: str, text: str = "", **env: str):
    dotenv.write_text(text)
    return run_app(*args, env={"ENV_FILE": str(dotenv), **env})


# --- precedence, quoting, empty values ----------------------------------------------------------------

def test_shell_wins_over_dotenv_which_wins_over_the_default(dotenv):
    shown = settings_table(app_with(dotenv, "settings", text="NNODES=2\nNODE_RANK=1\n", NNODES="3"))
    assert shown["NNODES"] == ("shell", "3")
    assert shown["NODE_RANK"] == (".env", "1")
    assert shown["MASTER_PORT"] == ("default", "29500")
    assert shown["HEAD_IP"] == ("unset", "")


def test_an_empty_shell_value_counts_as_unset_and_dotenv_fills_it(dotenv):
    shown = settings_table(app_with(dotenv, "settings", text="HEAD_IP=127.0.0.2\n", HEAD_IP="", RAY_PORT=""))
    assert shown["HEAD_IP"] == (".env", "127.0.0.2")
    assert shown["RAY_PORT"] == ("default", "6379")


def test_dotenv_quotes_are_removed_and_a_caret_survives(dotenv):
    text = ('ARGS="optim.lr=1e-5 trainer.total_epochs=2"\nNCCL_SOCKET_IFNAME=^docker,lo\n'
            "RAY_START_ARGS='--num-cpus 2'  # a comment\nexport PROJECT=mine\n")
    shown = settings_table(app_with(dotenv, "settings", text=text))
    assert shown["ARGS"] == (".env", "optim.lr=1e-5 trainer.total_epochs=2")
    assert shown["NCCL_SOCKET_IFNAME"] == (".env", "^docker,lo")
    assert shown["RAY_START_ARGS"] == (".env", "--num-cpus 2")
    assert shown["PROJECT"] == (".env", "mine")


def test_dotenv_lines_reach_the_processes_a_command_starts(dotenv, tmp_path):
    """NCCL and verl read their own variables: a .env line the app does not register still reaches them."""
    dotenv.write_text("NCCL_SOCKET_IFNAME=^docker,lo\nNCCL_P2P_DISABLE=1\n")
    loaded = st.load({"ENV_FILE": str(dotenv), "NCCL_P2P_DISABLE": "0"})
    environ = loaded.environ({"EXTRA": "x"})
    assert environ["NCCL_SOCKET_IFNAME"] == "^docker,lo" and environ["NCCL_P2P_DISABLE"] == "0"
    assert environ["EXTRA"] == "x"


def test_make_passes_command_line_and_dotenv_through_to_the_app(tmp_path):
    """`make settings NODE_RANK=1` in a directory with a .env: the command line wins, quotes and ^ survive."""
    (tmp_path / ".env").write_text('NODE_RANK=0\nARGS="optim.lr=1e-5 trainer.total_epochs=2"\n'
                                   "GLOO_SOCKET_IFNAME=^lo\nIB=1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ENV_FILE", "NODE_RANK", "ARGS", "GLOO_SOCKET_IFNAME", "IB")}
    result = subprocess.run(["make", "--no-print-directory", "-s", "-f", str(REPO / "Makefile"), "settings",
                             "RUNTIME=local", f"PYTHON={sys.executable}", "NODE_RANK=1"],
                            cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=120)
    shown = settings_table(result)
    assert shown["NODE_RANK"] == ("shell", "1")
    assert shown["ARGS"] == (".env", "optim.lr=1e-5 trainer.total_epochs=2")
    assert shown["GLOO_SOCKET_IFNAME"] == (".env", "^lo")
    # make reads no .env: an IB there is not used, and the app says so
    assert shown["IB"] == ("default", "auto") and "make reads IB from the command line or shell only" in result.stdout


def test_secrets_are_never_printed(dotenv):
    result = app_with(dotenv, "settings", text="RAY_AUTH_TOKEN=s3cret\n", SWANLAB_API_KEY="k3y")
    assert "s3cret" not in result.stdout and "k3y" not in result.stdout
    assert settings_table(result)["RAY_AUTH_TOKEN"] == (".env", "***")


# --- one refusal per bad value: exit code and the one line ---------------------------------------------

@pytest.mark.parametrize("command, name, value, expected", [
    (["check", "grpo"], "HEAD_IP", "localhost:6379", "HEAD_IP='localhost:6379' is not an IP address"),
    (["check", "grpo"], "HEAD_IP", "300.1.1.1", "HEAD_IP='300.1.1.1' is not an IP address"),
    (["grpo-worker"], "HEAD_IP", "300.1.1.1", "HEAD_IP='300.1.1.1' is not an IP address"),
    (["sft"], "MASTER_ADDR", "300.1.1.1", "MASTER_ADDR='300.1.1.1' is not an IP address or a hostname"),
    (["sft"], "MASTER_ADDR", "node0:29500", "MASTER_ADDR='node0:29500' is not an IP address or a hostname"),
    (["grpo-worker"], "NODE_IP", "node1", "NODE_IP='node1' is not an IP address"),
    (["grpo-head"], "DASHBOARD_HOST", "0.0.0.0.0", "DASHBOARD_HOST='0.0.0.0.0' is not an IP address"),
    (["grpo-head"], "RAY_PORT", "70000", "RAY_PORT='70000' is not a port number 1-65535"),
    (["check", "sft"], "MASTER_PORT", "99999", "MASTER_PORT='99999' is not a port number 1-65535"),
    (["board"], "BOARD_PORT", "0", "BOARD_PORT='0' is not a port number 1-65535"),
    (["board"], "BOARD_HOST", "localhost", "BOARD_HOST='localhost' is not an IPv4 address"),
    (["check", "sft"], "GPUS_PER_NODE", "abc", "GPUS_PER_NODE='abc' is not a whole number >= 0"),
    (["sft"], "GPUS_PER_NODE", "-2", "GPUS_PER_NODE='-2' is not a whole number >= 0"),
    (["grpo-head"], "NNODES", "0", "NNODES='0' is not a whole number >= 1"),
    (["sft"], "NODE_RANK", "one", "NODE_RANK='one' is not a whole number >= 0"),
    (["grpo-worker"], "WAIT_TIMEOUT", "10m", "WAIT_TIMEOUT='10m' is not a whole number >= 0"),
    (["smoke"], "SMOKE_STEPS", "many", "SMOKE_STEPS='many' is not a whole number >= 0"),
    (["eval"], "LIMIT", "-1", "LIMIT='-1' is not a whole number >= 1"),
    (["sft"], "DRY_RUN", "maybe", "DRY_RUN='maybe' is not 1 or 0"),
    (["merge"], "JOB", "ppo", "JOB='ppo' is not sft or grpo"),
    (["eval"], "EVAL_BACKEND", "tgi", "EVAL_BACKEND='tgi' is not auto, vllm, hf or reference"),
    (["sft"], "SWANLAB_MODE", "online", "SWANLAB_MODE='online' is not local, offline, cloud or disabled"),
    (["check", "sft"], "ARGS", "optim.lr='1e-5", "ARGS cannot be split like a shell line"),
    (["grpo-head"], "RAY_START_ARGS", '--num-cpus "2', "RAY_START_ARGS cannot be split like a shell line"),
])
def test_a_bad_value_is_refused_in_one_line_naming_the_variable(command, name, value, expected):
    result = run_app(*command, env={name: value, "DRY_RUN": "1" if name != "DRY_RUN" else value})
    line = assert_one_line_error(result)
    assert result.returncode == 2
    assert line.startswith(f"error: {expected}"), line
    assert f"set {name}" in line or "check its quotes" in line  # and what to do


def test_a_bad_value_in_dotenv_says_it_came_from_dotenv(dotenv):
    result = app_with(dotenv, "check", "sft", text="GPUS_PER_NODE=abc\nMODEL_PATH=/nonexistent\n")
    line = assert_one_line_error(result)
    assert line.startswith("error: GPUS_PER_NODE='abc' (from .env) is not a whole number >= 0"), line
    assert "MODEL_PATH" not in line


def test_doctor_lists_every_bad_value_as_a_red_line_beside_its_other_checks(dotenv):
    result = app_with(dotenv, "doctor", text="GPUS_PER_NODE=abc\nRAY_PORT=70000\nJOB=ppo\n")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    red = [line.split(None, 2)[2] for line in result.stdout.splitlines() if line.startswith("  FAIL  settings")]
    assert [line.split("=")[0] for line in red] == ["GPUS_PER_NODE", "RAY_PORT", "JOB"], result.stdout
    assert "(from .env) is not a whole number >= 0" in red[0] and any(" /dev/shm " in line for line in result.stdout.splitlines())


def test_a_command_is_not_refused_for_a_variable_it_does_not_read(dotenv):
    # prep reads no cluster settings: a node's broken HEAD_IP is for grpo to refuse
    result = app_with(dotenv, "prep", "gsm8k", "--no-such-flag", text="HEAD_IP=300.1.1.1\n")
    line = assert_one_line_error(result)
    assert "HEAD_IP" not in line and "--no-such-flag" in line


def test_an_unreadable_dotenv_line_is_one_line_naming_the_file_and_line(dotenv):
    result = app_with(dotenv, "settings", text="NNODES=1\nthis is not a setting\n")
    line = assert_one_line_error(result)
    assert f"{dotenv} line 2" in line and "NAME=value" in line


@pytest.mark.parametrize("value", ["127.0.0.1", "::1", "fe80::1", "node0", "node-0.cluster.internal"])
def test_master_addr_takes_an_ip_address_or_a_hostname(value):
    assert st.parse(st.BY_NAME["MASTER_ADDR"], value) == value


@pytest.mark.parametrize("name, value", [("HEAD_IP", "::1"), ("HEAD_IP", "127.0.0.2"), ("RAY_PORT", "65535"),
                                         ("MASTER_PORT", "1"), ("GPUS_PER_NODE", "0"), ("DRY_RUN", "true")])
def test_edge_values_that_are_allowed_pass(name, value):
    st.parse(st.BY_NAME[name], value)


# --- what the registry renders ---------------------------------------------------------------------------

def test_containers_get_every_pass_through_setting_of_the_registry_by_name():
    from app.containers import passthrough_names as container_names

    assert set(st.passthrough_names()) <= set(container_names())
    assert "environment:\n    - NNODES" not in (REPO / "compose.yaml").read_text()  # no second, hand-kept list
    result = run_app("settings", "--compose-env")
    assert result.returncode == 0 and result.stdout.split() == st.passthrough_names()


def test_the_settings_page_in_english_and_chinese_is_the_registrys():
    text = (REPO / "docs" / "settings.md").read_text(encoding="utf-8")
    assert text == st.render_settings_doc(), "run `python -m app settings --write`"
    english, chinese = text.split("## 中文", 1)
    for var in st.REGISTRY:
        assert var.zh and var.doc, var.name
        assert f"| `{var.name}` |" in english and f"| `{var.name}` |" in chinese


def test_env_example_is_the_registrys_and_sets_nothing():
    text = (REPO / ".env.example").read_text()
    assert text == st.render_env_example(), "run `python -m app settings --write`"
    assert st.read_dotenv(REPO / ".env.example") == {}  # a copied, unchanged .env sets nothing


def test_settings_command_prints_every_variable_and_make_help_lists_it(dotenv):
    shown = settings_table(app_with(dotenv, "settings"))
    assert list(shown) == [var.name for var in st.REGISTRY]
    help_text = subprocess.run(["make", "--no-print-directory", "help", "RUNTIME=local"], cwd=REPO,
                               capture_output=True, text=True, timeout=60).stdout
    assert re.search(r"^  make settings\s+every variable", help_text, re.M)


def test_defaults_examples_and_tests_name_no_address_outside_loopback():
    """Only 127.0.0.0/8 (and 0.0.0.0, "every interface") is ever written as an address."""
    files = [REPO / "README.md", REPO / ".env.example", REPO / "Makefile", REPO / "compose.yaml",
             *sorted((REPO / "app").glob("*.py")), *sorted((REPO / "tests").glob("*.py"))]
    written = [(var.name, text) for var in st.REGISTRY for text in (var.default, var.example) if text]
    written += [(str(path.relative_to(REPO)), path.read_text(encoding="utf-8")) for path in files]
    for where, text in written:
        for candidate in re.findall(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])", text):
            try:
                address = ipaddress.ip_address(candidate)
            except ValueError:
                continue  # 300.1.1.1: an example of what is refused
            assert address.is_loopback or address.is_unspecified, f"{where}: {candidate}"


# --- layout: environment reads, the run directory's marker, the model-directory check -------------------

def test_at_most_six_environment_reads_outside_settings_each_with_a_comment_why():
    reads = []
    for path in sorted((REPO / "app").glob("*.py")):
        if path.name == "settings.py":
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.search(r"os\.environ|os\.getenv|getenv\(", line) and not line.lstrip().startswith("#"):
                reads.append((path.name, i + 1))
                context = "\n".join(lines[max(0, i - 2):i + 1])
                assert "#" in context, f"{path.name}:{i + 1} reads the environment without saying why"
    # the CLI's debug switch, compose's environment, the node check's task, the token for the wait's driver, a rank
    # of torchrun's, a Ray worker's (app/rayworker.py)
    assert len(reads) <= 6, reads


def test_the_latest_checkpoint_marker_is_named_in_one_place():
    named = [p.name for p in (REPO / "app").glob("*.py") if "latest_checkpointed_iteration.txt" in p.read_text()]
    assert named == ["runs.py"]


def model_without_weights(tiny_model_dir, where: Path) -> Path:
    where.mkdir(parents=True)
    for entry in tiny_model_dir.iterdir():
        if entry.is_file() and entry.suffix not in (".safetensors", ".bin"):
            shutil.copy(entry, where)
    return where


def test_preflight_refuses_a_model_directory_without_weights(tiny_model_dir, tmp_path):
    model = model_without_weights(tiny_model_dir, tmp_path / "model")
    line = assert_one_line_error(run_app("check", "sft", env={"MODEL_PATH": str(model)}))
    assert f"MODEL_PATH: {model} has no weights (*.safetensors or *.bin)" in line


def test_doctor_reports_an_empty_weights_file_instead_of_crashing(tiny_model_dir, tmp_path):
    model = model_without_weights(tiny_model_dir, tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"")
    result = run_app("doctor", env={"MODEL_PATH": str(model), "JOB": "sft", "HEAD_IP": "", "MASTER_ADDR": "",
                                    "NNODES": "", "GPUS_PER_NODE": "", "CKPT_DIR": str(tmp_path / "run")})
    assert "Traceback" not in result.stderr and result.returncode == 1, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if " MODEL_PATH " in line)
    assert line.split()[0] == "FAIL" and "an empty weights file (model.safetensors)" in line
    assert any(" disk " in line for line in result.stdout.splitlines())


def test_eval_refuses_a_model_directory_without_weights_in_one_line(tiny_model_dir, tmp_path):
    model = model_without_weights(tiny_model_dir, tmp_path / "model")
    line = assert_one_line_error(run_app("eval", env={"MODEL": str(model), "STEP": ""}))
    assert f"{model} has no weights" in line and "MODEL must be" in line


def test_doctor_says_which_node_settings_are_unset(dotenv, tmp_path):
    result = app_with(dotenv, "doctor", text="NNODES=1\n", HEAD_IP="", MASTER_ADDR="", JOB="sft",
                      CKPT_DIR=str(tmp_path / "run"))
    line = next(line for line in result.stdout.splitlines() if " settings " in line)
    assert f"1 from {dotenv}" in line and "unset (defaults apply): " in line
    unset = line.split("unset (defaults apply): ", 1)[1].split(", ")
    assert "HEAD_IP" in unset and "MASTER_ADDR" in unset and "NNODES" not in unset


def test_compose_interpolation_defaults_are_the_registrys():
    text = (REPO / "compose.yaml").read_text()
    defaults = dict(re.findall(r"\$\{(\w+):-([^}]*)\}", text))
    assert defaults and all(st.BY_NAME[name].default == value for name, value in defaults.items()), defaults


# --- a .env that would be misread --------------------------------------------------------------------

def test_a_launch_refuses_a_misspelt_setting_in_dotenv_and_doctor_warns_of_it(dotenv):
    # a typo, then names handed on to the processes or read by others (wandb, the NVIDIA runtime), one's own
    theirs = ("NCCL_SOCKET_IFNAME=lo\nWANDB_API_KEY=x\nNVIDIA_VISIBLE_DEVICES=all\nGPUS=2\nMY_OWN_THING=1\n"
              "STEPS=100\nMODELS=/m\n")  # plurals of settings (STEP, MODEL) may be anyone's
    line = assert_one_line_error(app_with(dotenv, "sft", text="NNODE=2\n" + theirs, DRY_RUN="1"))
    assert line == (f"error: {dotenv}: NNODE (did you mean NNODES?) is not a setting, so the stack would not read "
                    "it: rename (`make settings` lists every setting)")
    line = assert_one_line_error(app_with(dotenv, "grpo-worker", text="DATADIR=/x\nmodel_path=/y\n", DRY_RUN="1"))
    assert "DATADIR (did you mean DATA_DIR?), model_path (did you mean MODEL_PATH?) are not a setting" in line
    doctor = app_with(dotenv, "doctor", text="NNODE=2\n" + theirs).stdout
    assert "in " + str(dotenv) + " but no setting: NNODE (did you mean NNODES?)" in doctor
    assert "(did" not in doctor.split("NNODE (did you mean NNODES?)", 1)[1]  # the others are not flagged
    assert app_with(dotenv, "settings", text="NNODE=2\n").returncode == 0  # only a launch refuses
    # the others alone do not stop a launch
    assert "not a setting" not in app_with(dotenv, "sft", text=theirs, DRY_RUN="1").stderr
    # a letter more or less inside a longer name: a typo no case or underscore rule catches
    line = assert_one_line_error(app_with(dotenv, "sft", text="GPU_PER_NODE=2\nMASTER_ADR=127.0.0.1\n", DRY_RUN="1"))
    assert "GPU_PER_NODE (did you mean GPUS_PER_NODE?), MASTER_ADR (did you mean MASTER_ADDR?) are not a setting" in line


def test_a_setting_written_twice_with_different_values_in_dotenv_is_refused_by_a_launch(dotenv):
    text = "NNODES=1\nMODEL_PATH=/m\nNNODES=2\nGPUS_PER_NODE=1\nGPUS_PER_NODE=1\n"  # the same value twice is fine
    line = assert_one_line_error(app_with(dotenv, "sft", text=text, DRY_RUN="1"))
    assert line == (f"error: {dotenv} sets NNODES (line 1: 1, line 3: 2): only the last counts; keep one line each")
    assert "set twice in " + str(dotenv) + ", the last counts: NNODES (line 1: 1, line 3: 2)" in \
        app_with(dotenv, "doctor", text=text).stdout


def test_env_file_naming_a_directory_is_refused_not_read_as_no_settings(tmp_path):
    line = assert_one_line_error(run_app("settings", env={"ENV_FILE": str(tmp_path)}))
    assert line == f"error: ENV_FILE={tmp_path} is not a file: point it at your dotenv file, or unset it to read ./.env"


def test_make_hands_args_to_the_app_as_written_hydras_interpolations_included(tmp_path):
    """make would expand ${oc.env:HOSTNAME,n} on its command line as a make variable, to nothing."""
    args = "trainer.project_name=x-${oc.env:HOSTNAME,n} trainer.experiment_name=mine"
    result = subprocess.run(["make", "-s", "--no-print-directory", "settings", f"ARGS={args}", "RUNTIME=local"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "ENV_FILE": os.devnull})
    table = settings_table(result)
    assert table["ARGS"] == ("shell", args)
    assert table["EXPERIMENT"] == ("ARGS", "mine")  # an ARGS key that a setting owns is that setting


def test_a_dotenv_that_is_not_utf8_and_a_missing_env_file_are_refused_in_one_line(dotenv, tmp_path):
    dotenv.write_bytes(b"NNODES=1\nHEAD_IP=\xff\xfe\n")
    line = assert_one_line_error(run_app("settings", env={"ENV_FILE": str(dotenv)}))
    assert line == f"error: {dotenv} line 2 is not UTF-8 text: save the file as UTF-8 (compose reads it as UTF-8 too)"
    missing = tmp_path / "nope.env"
    line = assert_one_line_error(run_app("settings", env={"ENV_FILE": str(missing)}))
    assert line == f"error: ENV_FILE={missing} does not exist: point it at your dotenv file, or unset it to read ./.env"


@pytest.mark.parametrize("name", ["MODEL_PATH", "CKPT_DIR", "TRAIN_FILE"])
def test_a_path_setting_through_a_symlink_loop_is_one_line_naming_the_link(tmp_path, name):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    line = assert_one_line_error(run_app("check", "sft", env={name: str(tmp_path / "loop" / "x")}))
    assert f"{tmp_path / 'loop'} is a symbolic link that loops back on itself" in line and f"point {name} at" in line
