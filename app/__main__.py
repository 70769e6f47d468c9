"""`python -m app <command> ...`: the one CLI. Each command lives in the module of its stage and is
imported only when used, so the plan/preflight path stays fast (no torch import to print help)."""

from __future__ import annotations

import importlib
import os
import signal
import sys

from app.common import Terminated, UserError, stop_once, write_line

# Top-level packages the stack imports (pyproject.toml's dependencies and what they bring). A
# ModuleNotFoundError for one of them means this interpreter is not the stack's environment, not a bug.
DEPENDENCIES = {"omegaconf", "hydra", "yaml", "pyarrow", "pandas", "numpy", "torch", "transformers",
                "tokenizers", "tensordict", "ray", "verl", "datasets", "safetensors", "peft", "accelerate",
                "swanlab", "matplotlib", "rich", "tqdm", "psutil", "huggingface_hub", "dotenv"}

# command -> (module, one-line help). Each module exposes main(command, argv, settings) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "prep": ("app.data", "prepare datasets for verl: prep [gsm8k|arith] (default both)"),
    "data": ("app.data", "check (and fix) your own parquet: data check FILE [--kind rl|sft] [--fix OUT]"),
    "check": ("app.preflight", "preflight: compose the sft|grpo config and reject what would fail later"),
    "config": ("app.preflight", "print the composed sft|grpo config"),
    "sft": ("app.launch", "launch SFT on this node (torchrun; same line on every node but NODE_RANK)"),
    "grpo-head": ("app.launch", "start the Ray head, wait for the workers, run GRPO"),
    "grpo-worker": ("app.launch", "join the Ray head and stay until it goes away"),
    "gather": ("app.checkpoints", "pull every node's checkpoint shards into one directory"),
    "merge": ("app.checkpoints", "merge FSDP shards of STEP into a Hugging Face model and verify it"),
    "eval": ("app.eval", "GSM8K test accuracy of a merged model"),
    "report": ("app.tracking", "plots and a summary of a run from its JSONL log"),
    "board": ("app.tracking", "serve the local swanlab dashboard"),
    "doctor": ("app.doctor", "is this node ready? one screen, with what to do for each red line"),
    "smoke": ("app.smoke", "the whole pipeline on one GPU with a tiny local model"),
    "demo": ("app.demo", "proof of learning on one GPU: SFT then GRPO raise a tiny model's arith accuracy"),
    "tiny-model": ("app.tiny", "write a tiny random Qwen2 model + tokenizer (tests, smoke, benchmarks)"),
    "slurm": ("app.schedulers", "write an sbatch script for the run: slurm sft|grpo (SUBMIT=1 submits it)"),
    "k8s": ("app.schedulers", "write Kubernetes manifests for the run: k8s sft|grpo (RayJob, PyTorchJob)"),
    "settings": ("app.settings", "every variable, its value here and where it came from (shell, .env, default)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m app <command> [args]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def debug() -> bool:
    # APP_DEBUG from the environment, not the settings: the traceback switch must work when importing or
    # loading them is what failed
    return bool(os.environ.get("APP_DEBUG"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        write_line(f"error: unknown command {command!r}; run `python -m app --help` for the list", sys.stderr)
        return 2
    # SIGTERM (docker stop, kill, timeout) unwinds like Ctrl-C: temporaries removed, children stopped
    signal.signal(signal.SIGTERM, stop_once)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where it is ignored (a background job)
        signal.signal(signal.SIGINT, stop_once)
    try:
        from app.settings import load

        settings = load()  # the one read of the environment and .env for this command
        if command != "doctor":  # doctor lists a bad value as one red line among all its checks
            settings.check(command)  # a bad value of a variable this command reads: one line, before anything
        module = importlib.import_module(COMMANDS[command][0])
        return int(module.main(command, rest, settings) or 0)
    except UserError as exc:
        if str(exc):  # empty: a child process printed the one line already
            write_line(f"error: {exc}", sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top not in DEPENDENCIES or debug():
            raise
        write_line(f"error: {sys.executable} cannot import {top!r}, which the stack needs: run `make setup` and use "
                   "its .venv (leave PYTHON unset), install the stack into this interpreter (pip install -e .), or "
                   "point PYTHONPATH at a site-packages that has it (RUNTIME=local PYTHON=... PYTHONPATH=...)",
                   sys.stderr)
        return 2
    except Terminated:
        write_line("error: stopped by SIGTERM; nothing half-written was kept, rerun the same command", sys.stderr)
        return 143
    except KeyboardInterrupt:
        write_line("error: interrupted; nothing half-written was kept, rerun the same command", sys.stderr)
        return 130
    except Exception as exc:  # a bug, not a user mistake: still one line unless asked for more
        if debug():
            raise
        write_line(f"error: internal error {type(exc).__name__}: {exc} "
                   "(rerun with APP_DEBUG=1 for the traceback and report it)", sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
