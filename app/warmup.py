"""What a GRPO node prepares while Ray and verl's driver start: vLLM's model-info cache for the model.

Before it loads a model, vLLM's server inspects the model's class in a subprocess that imports vLLM once
more, unless VLLM_CACHE_ROOT/modelinfos holds the answer for that model file (keyed by the file's hash).
On a fresh machine or container that cache is empty, and the inspection took 25 s of the GRPO start-up on
1xH200 (docs/gpu-runs.md run 20), about two minutes after `make grpo-head` began; with the cache warmed, the
server started its engine 2 s after its arguments instead of 27 (run 21). grpo-head and grpo-worker
start this in the background right after preflight; it fills the cache through vLLM's own registry, so what
the server later reads is what it would have written itself. Best effort: it never fails a launch (without
it, vLLM inspects the model as before), and its output goes to a log file.

    python -m app.warmup ARCHITECTURE...    (what the launchers start, with config.json's architectures)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from app.common import ends_with_us, raise_terminated, say, stop_group
from app.runs import read_model


def start(model_path: Path | None, log: Path, environ: dict[str, str]) -> subprocess.Popen | None:
    """This module as a background process, its output in `log`; None where there is no model to warm.
    In a process group of its own, so that stopping it reaches vLLM's inspection subprocess too."""
    names = read_model(model_path).architectures if model_path is not None else []
    if not names:
        return None
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "app.warmup", *names], env=environ,
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=ends_with_us)
    # reaped when it ends (about 45 s in), not left a zombie until the launch ends (run 21)
    threading.Thread(target=process.wait, daemon=True).start()
    say(f"warming vLLM's model-info cache in the background (log: {log})")
    return process


def stop(process: subprocess.Popen | None) -> None:
    """Ends what is left of it when the launch ends (an early failure, Ctrl-C, SIGTERM): its whole group."""
    stop_group(process, grace=10.0)


def main(argv: list[str]) -> int:
    # SIGTERM from stop() as an exception: vLLM's subprocess.run then kills its inspection child and removes
    # its temporary directory
    signal.signal(signal.SIGTERM, raise_terminated)
    began = time.monotonic()
    try:
        from vllm.model_executor.models.registry import ModelRegistry
    except Exception as exc:  # noqa: BLE001 - any failure to import means: nothing to warm, vLLM will say why
        print(f"vLLM is not importable here ({type(exc).__name__}: {exc}): nothing warmed")
        return 0
    imported = time.monotonic() - began
    for name in argv:  # the model's architectures (config.json), as the launch read them
        t = time.monotonic()
        try:
            # the call vLLM's ModelConfig makes per architecture: reads the cache, else inspects and writes it
            info = ModelRegistry._try_inspect_model_cls(name)
        except Exception as exc:  # noqa: BLE001 - the server will inspect (and report) it itself
            print(f"{name}: not warmed ({type(exc).__name__}: {exc})")
            continue
        if info is not None:
            state = "in vLLM's model-info cache"
        elif name not in ModelRegistry.models:
            state = "not an architecture vLLM implements by that name (the server resolves it)"
        else:
            state = "not warmed: vLLM could not inspect it (its error is above)"
        print(f"{name}: {state} ({time.monotonic() - t:.1f}s)")
    print(f"done in {time.monotonic() - began:.1f}s (vLLM imported in {imported:.1f}s)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # stopped (app.common.Terminated is one): nothing to report
        sys.exit(143)
