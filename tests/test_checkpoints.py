"""`python -m app merge` / `gather` on real sharded checkpoints, written on CPU by real gloo processes
through verl's own FSDPCheckpointManager (tests/ckpt_factory.py), in SFT's and GRPO's layouts."""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))  # loopback_sshd
from conftest import REPO, assert_one_line_error, modes, pages_for, run_app, weight_bytes


def make_run(out: Path, model: Path, world_size: int, step: int, layout: str = "sft", lora: bool = False,
             hf_model: bool = False) -> Path:
    """A run directory with one saved step, written by `world_size` real processes."""
    cmd = [sys.executable, str(REPO / "tests" / "ckpt_factory.py"), "--model", str(model), "--out", str(out),
           "--world-size", str(world_size), "--step", str(step), "--layout", layout]
    cmd += (["--lora"] if lora else []) + (["--hf-model"] if hf_model else [])
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[int, Path]:
    """Run directories of world sizes 1 (SFT layout), 2 (GRPO layout: actor/) and 4 (SFT layout)."""
    root = tmp_path_factory.mktemp("runs")
    return {
        1: make_run(root / "w1", tiny_model_dir, 1, step=3),
        2: make_run(root / "w2", tiny_model_dir, 2, step=5, layout="grpo"),
        4: make_run(root / "w4", tiny_model_dir, 4, step=7),
    }


def load_tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_merged_tensors_equal_the_original_model_exactly(runs, tiny_model_dir, tmp_path, world_size):
    out = tmp_path / "merged"
    result = run_app("merge", env={"CKPT_DIR": str(runs[world_size]), "OUT_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    assert "forward on" in result.stdout
    merged, original = load_tensors(out), load_tensors(tiny_model_dir)
    assert set(merged) == set(original)
    for name, tensor in original.items():
        # the tiny model is stored in bf16, the merger's output dtype: the round trip must be lossless
        assert merged[name].dtype == tensor.dtype and merged[name].equal(tensor), name
    for name in ("config.json", "tokenizer.json", "generation_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merged.")]  # no temporaries left


def test_latest_step_and_default_out_dir_name(runs, tmp_path):
    result = run_app("merge", env={"CKPT_DIR": str(runs[2])}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "models" / "w2-step5" / "model.safetensors").is_file()
    assert "actor" in result.stdout  # the GRPO layout was found under global_step_5/actor


def test_missing_rank_lists_it_and_says_how_to_gather(runs, tmp_path):
    run = copy_run(runs[4], tmp_path / "run")
    for rank in (1, 3):
        (run / "global_step_7" / f"model_world_size_4_rank_{rank}.pt").unlink()
    line = assert_one_line_error(run_app("merge", env={"CKPT_DIR": str(run), "OUT_DIR": str(tmp_path / "o")}))
    assert "ranks missing: 1, 3" in line and "make gather" in line
    assert not (tmp_path / "o").exists()


def test_step_that_does_not_exist_lists_the_present_ones(runs, tmp_path):
    line = assert_one_line_error(run_app("merge", env={"CKPT_DIR": str(runs[1]), "STEP": "9",
                                                       "OUT_DIR": str(tmp_path / "o")}))
    assert "step 9 does not exist" in line and "steps present: 3" in line


def test_existing_out_dir_is_kept_without_force_and_replaced_with_it(runs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = assert_one_line_error(run_app("merge", env={"CKPT_DIR": str(runs[1]), "OUT_DIR": str(out)}))
    assert "FORCE=1" in line and (out / "keep.txt").read_text() == "mine"
    result = run_app("merge", env={"CKPT_DIR": str(runs[1]), "OUT_DIR": str(out), "FORCE": "1"})
    assert result.returncode == 0, result.stderr
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_stream_engine_writes_exactly_what_verl_merger_writes(runs, tmp_path):
    stream, verl = tmp_path / "stream", tmp_path / "verl"
    # --file-mb 1: several output files + index, as a big model gets
    result = run_app("merge", "--file-mb", "1", env={"CKPT_DIR": str(runs[4]), "OUT_DIR": str(stream)})
    assert result.returncode == 0, result.stderr
    result = run_app("merge", "--engine", "verl", env={"CKPT_DIR": str(runs[4]), "OUT_DIR": str(verl)})
    assert result.returncode == 0, result.stderr
    assert len(list(stream.glob("model-*-of-*.safetensors"))) > 1
    assert (stream / "model.safetensors.index.json").is_file()
    ours, theirs = load_tensors(stream), load_tensors(verl)
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].equal(tensor), name
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert json.loads((stream / name).read_text()) == json.loads((verl / name).read_text()), name


@pytest.mark.parametrize("engine", ["stream", "verl"])
def test_a_checkpoint_trained_with_varlen_attention_merges_into_a_model_any_transformers_loads(runs, tmp_path, engine):
    """verl writes the trainer's override_config into the checkpoint's config.json (update_model_config's setattr),
    so it names varlen_attention, which transformers knows only where app.attention is imported. The merge (a
    process that never imports it) must load it and leave no attention pinned in the merged model."""
    from transformers import AutoConfig

    from verl.utils.model import update_model_config

    run = copy_run(runs[1], tmp_path / "run")
    hf_dir = next(run.rglob("huggingface"))
    config = AutoConfig.from_pretrained(hf_dir)
    update_model_config(config, {"attn_implementation": "varlen_attention"})
    config.save_pretrained(hf_dir)
    assert json.loads((hf_dir / "config.json").read_text())["attn_implementation"] == "varlen_attention"
    out = tmp_path / "merged"
    result = run_app("merge", "--engine", engine, env={"CKPT_DIR": str(run), "OUT_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    assert "attn_implementation" not in json.loads((out / "config.json").read_text())
    if engine == "stream":
        assert "loads with transformers, forward on" in result.stdout


@pytest.mark.parametrize("damage, expected", [
    ("empty", "is empty"),
    ("truncate", "is corrupt"),
    ("duplicate", "rank 2 appears 2 times"),
    ("mixed", "different world sizes"),
    ("bad_pickle", "is corrupt and cannot be read"),
    ("no_rank0_files", "fsdp_config.json and huggingface missing"),
])
def test_damaged_shard_sets_are_one_line_errors(runs, tmp_path, damage, expected):
    run = copy_run(runs[4], tmp_path / "run")
    step = run / "global_step_7"
    shard = step / "model_world_size_4_rank_2.pt"
    if damage == "empty":
        shard.write_bytes(b"")
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "duplicate":
        shutil.copy(shard, step / "model_world_size_4_rank_2 (1).pt")  # what a file manager's copy looks like
    elif damage == "mixed":
        shutil.copy(shard, step / "model_world_size_2_rank_0.pt")
    elif damage == "bad_pickle":  # a complete zip whose pickled state dict is garbage: found when read
        import zipfile

        entries = {}
        with zipfile.ZipFile(shard) as archive:
            entries = {info.filename: archive.read(info) for info in archive.infolist()}
        with zipfile.ZipFile(shard, "w", zipfile.ZIP_STORED) as archive:
            for name, data in entries.items():
                archive.writestr(name, b"\x80\x02garbage" if name.endswith("data.pkl") else data)
    elif damage == "no_rank0_files":
        (step / "fsdp_config.json").unlink()
        shutil.rmtree(step / "huggingface")
    line = assert_one_line_error(run_app("merge", env={"CKPT_DIR": str(run), "OUT_DIR": str(tmp_path / "o")}))
    assert expected in line
    assert not (tmp_path / "o").exists()


def test_merge_killed_halfway_leaves_no_out_dir_and_the_rerun_cleans_up(runs, tmp_path):
    out = tmp_path / "merged"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPT_DIR": str(runs[4]), "OUT_DIR": str(out)}
    proc = subprocess.Popen([sys.executable, "-m", "app", "merge"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    written = []
    while time.monotonic() < deadline and proc.poll() is None and not written:
        # kill once the first weights are on disk: mid-write (verification and the rename are still ahead)
        written = [p for p in tmp_path.glob(".merged.tmp-*/*.safetensors")]
        time.sleep(0.01)
    assert written, "the merge finished or never wrote before it could be killed"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not out.exists()
    assert list(tmp_path.glob(".merged.tmp-*"))  # the killed merge's temporary is what is left
    result = run_app("merge", env={"CKPT_DIR": str(runs[4]), "OUT_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    assert "left by an interrupted merge" in result.stdout
    assert (out / "model.safetensors").is_file() and not list(tmp_path.glob(".merged.*"))


def test_merge_sigterm_is_one_line_nonzero_and_leaves_no_temporary_model_directory(runs, tmp_path):
    out = tmp_path / "merged"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPT_DIR": str(runs[4]), "OUT_DIR": str(out)}
    proc = subprocess.Popen([sys.executable, "-m", "app", "merge"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not list(tmp_path.glob(".merged.tmp-*")):
        time.sleep(0.01)
    assert proc.poll() is None, "the merge finished before it could be stopped"
    proc.send_signal(signal.SIGTERM)  # what `docker stop` / `kill` send
    stdout, stderr = proc.communicate(timeout=120)
    line = assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert proc.returncode == 143 and line.startswith("error: stopped by SIGTERM; nothing half-written was kept")
    assert list(tmp_path.iterdir()) == []  # no OUT_DIR, no .merged.tmp-*


def test_merge_into_a_read_only_out_dir_is_one_line_naming_out_dir(runs, tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    if os.geteuid() == 0:  # root ignores permission bits: a read-only mount
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(parent)]).returncode:
            pytest.skip("cannot mount a read-only tmpfs here")
    else:
        parent.chmod(0o555)
    try:
        line = assert_one_line_error(run_app("merge", env={"CKPT_DIR": str(runs[1]), "OUT_DIR": str(parent / "m")}))
        assert line.startswith(f"error: cannot write {parent} (OUT_DIR): ") and "set OUT_DIR to a writable" in line
        assert list(parent.iterdir()) == []
    finally:
        subprocess.run(["umount", str(parent)]) if os.geteuid() == 0 else parent.chmod(0o755)


def test_lora_checkpoint_gives_a_merged_full_model_plus_adapter_and_base(tiny_model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = make_run(tmp_path / "lora", tiny_model_dir, 2, step=2, lora=True)
    out = tmp_path / "merged"
    result = run_app("merge", env={"CKPT_DIR": str(run), "OUT_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    adapter = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8 and set(adapter["target_modules"]) == {"q_proj", "v_proj"}
    base, merged, original = load_tensors(out / "base"), load_tensors(out), load_tensors(tiny_model_dir)
    assert set(base) == set(merged) == set(original)
    assert all(base[name].equal(original[name]) for name in original)  # verl's base: the untouched weights
    lora = load_tensors(out / "lora_adapter")
    name = "model.layers.0.self_attn.q_proj.weight"
    a = lora[f"base_model.model.{name.replace('.weight', '.lora_A.weight')}"].float()
    b = lora[f"base_model.model.{name.replace('.weight', '.lora_B.weight')}"].float()
    expected = base[name].float() + (8 / 4) * (b @ a)
    assert not merged[name].equal(base[name])
    assert torch.allclose(merged[name].float(), expected, atol=2e-2, rtol=2e-2)
    assert merged["model.layers.0.mlp.up_proj.weight"].equal(base["model.layers.0.mlp.up_proj.weight"])
    # and base + adapter through PEFT gives the same model as the merged one
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out / "lora_adapter")
    full = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(peft(input_ids=ids).logits, full(input_ids=ids).logits, atol=5e-2)


def split_by_node(run: Path, dest: Path, world_size: int, ranks_per_node: int) -> list[Path]:
    """What a multi-node run leaves behind: each node's run dir holds only its own ranks' files; rank 0's
    node also has fsdp_config.json, huggingface/ and latest_checkpointed_iteration.txt."""
    nodes = []
    for node in range(world_size // ranks_per_node):
        node_run = copy_run(run, dest / f"node{node}")
        mine = set(range(node * ranks_per_node, (node + 1) * ranks_per_node))
        for path in node_run.rglob("*world_size_*_rank_*.pt"):
            if int(path.stem.rsplit("_", 1)[1]) not in mine:
                path.unlink()
        if node:
            for step in node_run.glob("global_step_*"):
                shard_dir = step / "actor" if (step / "actor").is_dir() else step
                (shard_dir / "fsdp_config.json").unlink()
                shutil.rmtree(shard_dir / "huggingface")
            (node_run / "latest_checkpointed_iteration.txt").unlink()
        nodes.append(node_run)
    return nodes


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real OpenSSH server for this user on 127.0.0.1 and 127.0.0.2 (two loopback "nodes"); yields the
    RSYNC_RSH that reaches it (gather honours it), its port and log."""
    from loopback_sshd import loopback_sshd, missing_tools

    missing = missing_tools()
    if missing:  # a failure, not a skip: without them gather's ssh path goes untested (.ci/run installs them)
        pytest.fail(f"install the Debian packages {' '.join(missing)} (apt-get install -y {' '.join(missing)})")
    try:
        with loopback_sshd(tmp_path_factory.mktemp("sshd")) as server:
            yield server
    except RuntimeError as error:
        pytest.fail(str(error))


def test_gather_over_ssh_from_two_nodes_into_a_fresh_dir_then_merge_is_exact(runs, tiny_model_dir, sshd, tmp_path):
    node0, node1 = split_by_node(runs[4], tmp_path, 4, 2)
    line = assert_one_line_error(run_app("merge", env={"CKPT_DIR": str(node0), "OUT_DIR": str(tmp_path / "o")}))
    assert "ranks missing: 2-3" in line
    no_step = tmp_path / "node2"  # a node whose run has not saved this step: listed, skipped, no error
    no_step.mkdir()
    here = tmp_path / "here"  # does not exist yet: the step and the latest pointer all come over ssh
    nodes = f"{getpass.getuser()}@127.0.0.1:{node0} 127.0.0.2:{node1} 127.0.0.2:{no_step}"
    result = run_app("gather", env={"CKPT_DIR": str(here), "NODES": nodes, "RSYNC_RSH": sshd["RSYNC_RSH"]})
    assert result.returncode == 0, result.stdout + result.stderr
    step = here / "global_step_7"
    assert sorted(p.name for p in step.glob("model_*")) == [f"model_world_size_4_rank_{r}.pt" for r in range(4)]
    assert (step / "fsdp_config.json").is_file() and (step / "huggingface" / "config.json").is_file()
    assert not list(step.glob("optim_*")) and not list(step.glob("extra_*"))  # not needed to merge: not copied
    assert (here / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert "next, make merge STEP=7" in result.stdout
    log = sshd["log"].read_text()  # the files really came through sshd, on both node addresses
    for address in ("127.0.0.1", "127.0.0.2"):
        assert f"on {address} port {sshd['port']}" in log, log[-2000:]
    assert f"Accepted publickey for {getpass.getuser()}" in log
    result = run_app("merge", env={"CKPT_DIR": str(here), "OUT_DIR": str(tmp_path / "merged")})
    assert result.returncode == 0, result.stderr
    merged, original = load_tensors(tmp_path / "merged"), load_tensors(tiny_model_dir)
    assert set(merged) == set(original)
    for name, tensor in original.items():
        assert merged[name].dtype == tensor.dtype and merged[name].equal(tensor), name


def test_gather_on_a_worker_node_fetches_rank0_files_and_the_latest_step(runs, sshd, tmp_path):
    node0, node1 = split_by_node(runs[2], tmp_path, 2, 1)  # GRPO layout: global_step_5/actor/
    result = run_app("gather", env={"CKPT_DIR": str(node1), "NODES": f"127.0.0.1:{node0}",
                                    "RSYNC_RSH": sshd["RSYNC_RSH"]})
    assert result.returncode == 0, result.stdout + result.stderr
    actor = node1 / "global_step_5" / "actor"
    assert (actor / "model_world_size_2_rank_0.pt").is_file() and (actor / "huggingface" / "config.json").is_file()
    assert (node1 / "latest_checkpointed_iteration.txt").read_text() == "5"


def test_gather_with_everything_present_says_nothing_to_do(runs, tmp_path):
    run = copy_run(runs[2], tmp_path / "shared")
    result = run_app("gather", env={"CKPT_DIR": str(run), "NODES": "no-such-host-anywhere"})
    assert result.returncode == 0, result.stderr
    assert "nothing to do" in result.stdout


def test_gather_refuses_a_rank_that_differs_between_nodes(runs, sshd, tmp_path):
    node0, node1 = split_by_node(runs[4], tmp_path, 4, 2)
    stale = node1 / "global_step_7" / "model_world_size_4_rank_0.pt"  # an older run's rank 0 left on node 1
    stale.write_bytes(b"x" * 100)
    line = assert_one_line_error(run_app("gather", env={"CKPT_DIR": str(node0), "NODES": f"127.0.0.2:{node1}",
                                                        "RSYNC_RSH": sshd["RSYNC_RSH"]}))
    assert "model_world_size_4_rank_0.pt differs" in line and "older run" in line


def test_gather_names_an_unreachable_node(runs, tmp_path):
    node0, _ = split_by_node(runs[4], tmp_path, 4, 2)
    line = assert_one_line_error(run_app("gather", env={"CKPT_DIR": str(node0), "NODES": "nobody@127.0.0.1:1"},
                                         timeout=120))
    assert "127.0.0.1" in line


@pytest.mark.parametrize("step", ["", "5"])
def test_gather_of_a_run_that_is_nowhere_says_so_whatever_the_step(tmp_path, step):
    missing = tmp_path / "no-such-run"
    line = assert_one_line_error(run_app("gather", env={"CKPT_DIR": str(missing), "STEP": step, "NODES": "",
                                                        "JOB": "sft"}))
    assert line == (f"error: no run directory {missing} on this node and no NODES to pull from: set CKPT_DIR to the "
                    "run, and NODES=\"host1 host2\" to the nodes that hold its shards")


# --- round 3: a full disk, the modes of what merge writes, symlink loops -------------------------------------
def test_merge_onto_a_disk_too_small_for_the_weights_is_refused_before_merging(runs, small_disk):
    disk = small_disk("2m")  # the merged tiny model's weights are ~3.3 MiB
    result = run_app("merge", env={"CKPT_DIR": str(runs[4]), "OUT_DIR": str(disk / "merged")})
    line = assert_one_line_error(result)
    assert result.returncode == 2
    assert re.fullmatch(rf"error: not enough space on the disk of {re.escape(str(disk))} \(OUT_DIR\) for the merged "
                        r"model \(its weights alone need about 3\.\d MiB, 2\.0 MiB is free there\): free space there "
                        r"or set OUT_DIR to a disk with room; nothing was written", line), line
    assert list(disk.iterdir()) == []


def test_merge_filling_the_disk_midway_is_one_line_and_leaves_nothing(runs, tiny_model_dir, small_disk):
    disk = small_disk(pages_for(weight_bytes(tiny_model_dir)))  # the weights fit, config and tokenizer do not
    result = run_app("merge", env={"CKPT_DIR": str(runs[2]), "OUT_DIR": str(disk / "merged")})
    line = assert_one_line_error(result)  # was: internal error SafetensorError ... report it
    assert result.returncode == 2
    assert re.fullmatch(rf"error: no space left on the disk of {re.escape(str(disk))} \(OUT_DIR\) writing the merged "
                        r"model \(its weights alone need about 3\.\d MiB, 3\.\d MiB is free there\): free space there "
                        r"or set OUT_DIR to a disk with room; nothing half-written was kept", line), line
    assert list(disk.iterdir()) == []


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, "0o644", "0o755"), (0o027, "0o640", "0o750")])
def test_merged_model_files_get_the_modes_of_the_users_umask(runs, tmp_path, umask, file_mode, dir_mode):
    out = tmp_path / "merged"
    result = run_app("merge", "--file-mb", "1", env={"CKPT_DIR": str(runs[1]), "OUT_DIR": str(out)}, umask=umask)
    assert result.returncode == 0, result.stderr
    found = modes(out)
    assert found.pop(".") == dir_mode
    weights = [name for name in found if name.endswith(".safetensors")]
    assert len(weights) > 1 and set(found.values()) == {file_mode}, found  # safetensors wrote each 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]


@pytest.mark.parametrize("setting", ["OUT_DIR", "CKPT_DIR"])
def test_merge_through_a_symlink_loop_is_one_line_naming_the_link(runs, tmp_path, setting):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    env = {"CKPT_DIR": str(runs[1]), "OUT_DIR": str(tmp_path / "merged"), setting: str(loop)}
    line = assert_one_line_error(run_app("merge", env=env))  # was: internal error RuntimeError: Symlink loop
    assert line.startswith(f"error: {loop} ({setting}) is a symbolic link that loops back on itself -> {loop}, ")
    assert f"point {setting} at a real file or directory" in line
    assert os.readlink(loop) == str(loop) and [p.name for p in tmp_path.iterdir()] == ["loop"]


def test_gather_onto_a_disk_too_small_for_the_shards_is_refused_before_copying(runs, sshd, tmp_path, small_disk):
    node0, node1 = split_by_node(runs[4], tmp_path, 4, 2)
    disk = small_disk("2m")
    here = disk / "run"
    result = run_app("gather", env={"CKPT_DIR": str(here), "NODES": f"127.0.0.1:{node0} 127.0.0.2:{node1}",
                                    "RSYNC_RSH": sshd["RSYNC_RSH"], "STEP": "7"})
    line = assert_one_line_error(result)
    assert re.fullmatch(rf"error: not enough space on the disk of {re.escape(str(here))}/global_step_7 "
                        r"\(CKPT_DIR\) for the \d+ files of step 7 \(they need [0-9.]+ MiB, [0-9.]+ (KiB|MiB) is free "
                        r"there\): free space there or set CKPT_DIR to a disk with room; nothing was written",
                        line), line
    assert list(disk.iterdir()) == []


# --- round 3: a host that does not resolve, whatever rsync's exit code --------------------------------------
SLOW_TRANSPORT = """#!/bin/sh
# ssh, and then a moment before it exits with ssh's code, its end of the pipes already closed (a slow ssh exit,
# a ControlMaster or ProxyCommand): rsync sees the closed connection first and exits 12, not 255
echo $$ >> "{pidfile}"
ssh -F /dev/null -o BatchMode=yes -o ConnectTimeout=10 "$@"
code=$?
exec >&- <&- 2>&-
sleep 30
exit $code
"""


@pytest.mark.parametrize("transport", ["ssh", "slow to exit"])
def test_gather_from_a_host_that_does_not_resolve_says_so_whatever_rsyncs_exit_code(runs, tmp_path, transport):
    node0, _ = split_by_node(runs[4], tmp_path, 4, 2)
    before = sorted(str(p.relative_to(node0)) for p in node0.rglob("*"))
    pidfile = tmp_path / "transport.pid"
    env = {"CKPT_DIR": str(node0), "NODES": "no-such-node.invalid", "STEP": "7"}
    if transport == "slow to exit":
        wrapper = tmp_path / "slow-ssh"
        wrapper.write_text(SLOW_TRANSPORT.format(pidfile=pidfile))
        wrapper.chmod(0o755)
        env["RSYNC_RSH"] = str(wrapper)
        probe = subprocess.Popen(["rsync", "-e", str(wrapper), "-r", "--list-only", "no-such-node.invalid:/x/"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        assert probe.wait(timeout=60) == 12  # the exit code that blamed the path; its transport still runs:
        os.killpg(probe.pid, signal.SIGTERM)
    started = time.monotonic()
    line = assert_one_line_error(run_app("gather", env=env, timeout=120))
    assert line.startswith("error: cannot resolve the host name no-such-node.invalid (NODES) to list global_step_7 "
                           "(ssh: Could not resolve hostname no-such-node.invalid: ")  # then the resolver's words
    assert line.endswith("): check its spelling, or give that node's IP address in NODES")
    assert "exists on that node" not in line and time.monotonic() - started < 25  # did not wait out the sleep
    assert sorted(str(p.relative_to(node0)) for p in node0.rglob("*")) == before
    for pid in pidfile.read_text().split() if pidfile.exists() else []:  # nothing of a transport is left running
        assert not running(int(pid)), pid


def running(pid: int, wait: float = 5) -> bool:
    """Whether `pid` still runs after `wait` s (a zombie has ended: it only waits for its reaper)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state == "Z":
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)
