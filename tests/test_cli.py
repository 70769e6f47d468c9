import os
import re

import pytest

from conftest import assert_one_line_error, modes, pages_for, run_app, weight_bytes


def test_help_lists_every_command():
    from app.__main__ import COMMANDS

    result = run_app("--help")
    assert result.returncode == 0
    for name in COMMANDS:
        assert f"  {name} " in result.stdout


def test_unknown_command_is_one_line_error():
    line = assert_one_line_error(run_app("no-such-command"))
    assert "python -m app --help" in line


def test_every_command_module_imports_and_has_main():
    import importlib

    from app.__main__ import COMMANDS

    for module_name, _ in COMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a stage another piece of work has not delivered yet
            if exc.name == module_name:
                continue
            raise
        assert callable(module.main), module_name


def test_tiny_model_loads_and_generates(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4 or out[0, -1] == tok.eos_token_id
    assert tok.decode(tok("#### 1,234")["input_ids"]) == "#### 1,234"


@pytest.mark.parametrize("command", ["prep", "data", "check", "config", "merge", "gather", "eval", "report",
                                     "tiny-model"])
def test_a_usage_mistake_is_one_line_error_for_every_command(command):
    line = assert_one_line_error(run_app(command, "--no-such-flag"))
    assert f"python -m app {command} --help" in line


def test_tiny_model_refuses_an_existing_directory_and_make_force_replaces_it(tmp_path):
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "old.txt").write_text("from before")
    line = assert_one_line_error(run_app("tiny-model", env={"OUT": str(out)}))
    assert line == f"error: {out} already exists: FORCE=1 (--force) replaces it, or choose another OUT"
    result = run_app("tiny-model", env={"OUT": str(out), "FORCE": "1"})  # what `make tiny-model FORCE=1` passes
    assert result.returncode == 0, result.stderr
    assert (out / "config.json").is_file() and not (out / "old.txt").exists()


def test_tiny_model_on_a_disk_too_small_for_its_weights_is_refused_before_writing(small_disk):
    disk = small_disk("2m")  # the tiny model's weights are ~3.3 MiB
    result = run_app("tiny-model", env={"OUT": str(disk / "tiny")})
    line = assert_one_line_error(result)
    assert result.returncode == 2
    assert re.fullmatch(rf"error: not enough space on the disk of {re.escape(str(disk))} \(OUT\) for the tiny model "
                        r"\(its weights alone need about 3\.\d MiB, 2\.0 MiB is free there\): free space there or "
                        r"set OUT to a disk with room; nothing was written", line), line
    assert list(disk.iterdir()) == []


def test_tiny_model_filling_the_disk_midway_is_one_line_and_leaves_nothing(small_disk, tiny_model_dir):
    disk = small_disk(pages_for(weight_bytes(tiny_model_dir)))  # room for the weights, not the tokenizer beside
    result = run_app("tiny-model", env={"OUT": str(disk / "tiny")})  # was: internal error SafetensorError
    line = assert_one_line_error(result)
    assert result.returncode == 2
    assert re.fullmatch(rf"error: no space left on the disk of {re.escape(str(disk))} \(OUT\) writing the tiny model "
                        r"\(its weights alone need about 3\.\d MiB, 3\.\d MiB is free there\): free space there or set "
                        r"OUT to a disk with room; nothing half-written was kept", line), line
    assert list(disk.iterdir()) == []


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, "0o644", "0o755"), (0o027, "0o640", "0o750")])
def test_tiny_model_files_get_the_modes_of_the_users_umask(tmp_path, umask, file_mode, dir_mode):
    out = tmp_path / "tiny"
    result = run_app("tiny-model", env={"OUT": str(out)}, umask=umask)
    assert result.returncode == 0, result.stderr
    found = modes(out)
    assert found.pop(".") == dir_mode
    assert "model.safetensors" in found and set(found.values()) == {file_mode}, found  # safetensors wrote 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_tiny_model_out_that_is_a_symlink_loop_is_one_line_and_the_link_stays(tmp_path):
    loop = tmp_path / "tiny"
    loop.symlink_to(loop)
    line = assert_one_line_error(run_app("tiny-model", env={"OUT": str(loop), "FORCE": "1"}))
    assert line.startswith(f"error: {loop} (OUT) is a symbolic link that loops back on itself -> {loop}, ")
    assert line.endswith(f"point OUT at a real file or directory, or repoint the link (ln -sfn TARGET {loop})")
    assert os.readlink(loop) == str(loop) and [p.name for p in tmp_path.iterdir()] == ["tiny"]
