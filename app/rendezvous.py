"""Where the nodes of one SFT run meet: torchrun's own CLI with its tracebacks turned into one line, and in each
rank, before verl's trainer starts, the launch's go (STACK_GO: its count of the data, run while the rank imports)
and the comparison of what every node is about to run.

    python -m app.rendezvous torchrun <torchrun's arguments>   # what `make sft` starts (torchrun's own parser)
    python -m app.rendezvous rank MODULE <hydra overrides>     # what torchrun starts on each GPU

Each node's launch writes its run's fingerprint (app.spec: the composed config less what is per node, NNODES,
the model's and data's identity, the stack's code, verl's version) to a file named by STACK_RUN. Local rank 0 of
every node publishes it in torchrun's own store (the agent's, at MASTER_ADDR:MASTER_PORT); node 0 compares every
node's with its own and each node compares its own with node 0's, so a mismatch stops every node before the first
step, each saying which node differs and the first differing keys with both values. No peer checks this.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import sys
import time
from datetime import timedelta
from pathlib import Path

SAID = 86  # a rank's exit code after it printed its own one-line error: the launch adds no second line
PREFIX = "verl-stack/run/"


def mismatch(node: str, mine: dict[str, str], other: str, theirs: dict[str, str], limit: int = 3) -> str | None:
    """The one line for two nodes whose fingerprints differ, naming the first differing keys with both values;
    None where they agree."""
    keys = [k for k in dict.fromkeys([*mine, *theirs]) if mine.get(k) != theirs.get(k)]
    if not keys:
        return None

    def shown(value):
        return "absent" if value is None else value if len(value) < 90 else value[:87] + "..."
    found = [f"{k}: {shown(mine.get(k))} on {node}, {shown(theirs.get(k))} on {other}" for k in keys[:limit]]
    found += [f"and {len(keys) - limit} more"] if len(keys) > limit else []
    return (f"{node} does not run the same run as {other} ({'; '.join(found)}): make the settings, .env, ARGS, CONFIG, "
            "model and data the same on every node (only NODE_RANK differs), then start every node again")


def compare_at_rendezvous(env) -> None:
    """In a rank: publish this node's fingerprint (local rank 0) and compare (node 0 with every node, every node
    with node 0). Raises SystemExit(SAID) after one line on a mismatch."""
    import torch.distributed as dist

    mine = json.loads(Path(env["STACK_RUN"]).read_text())
    node, local = int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])
    nnodes = int(mine["NNODES"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=int(env.get("STACK_RENDEZVOUS_TIMEOUT", "600"))))
    if local == 0:
        store.set(f"{PREFIX}{node}", json.dumps(mine))
    others = range(1, nnodes) if node == 0 else [0]
    for other in others:
        store.wait([f"{PREFIX}{other}"])
        line = mismatch(f"node {node}", mine, f"node {other}", json.loads(store.get(f"{PREFIX}{other}")))
        if line:
            if local == 0:
                print(f"error: {line}", file=sys.stderr, flush=True)
            raise SystemExit(SAID)


def import_then_wait_for_go(module: str, go: Path) -> None:
    """What `module` imports, imported while the launch counts the data's lengths beside torchrun's start (both
    import transformers: most of SFT's start on a new node, docs/gpu-runs.md run 73); then held until the launch
    writes `go` once the count passed (a refusal stops torchrun instead), or until the agent that started us is gone."""
    from app.gate import import_what_it_imports

    import_what_it_imports(module)
    agent = os.getppid()
    while not go.exists():
        if os.getppid() != agent:
            raise SystemExit(1)
        time.sleep(0.05)


def rank(argv: list[str]) -> int:
    module, overrides = argv[0], argv[1:]
    env = os.environ  # a rank process, started by torchrun: its variables (RANK, MASTER_ADDR) and the launch's
    if env.get("STACK_GO"):
        import_then_wait_for_go(module, Path(env["STACK_GO"]))
    if env.get("STACK_RUN"):
        compare_at_rendezvous(env)
    if env.get("STACK_TIMELINE") and env.get("LOCAL_RANK") == "0":
        from app.timeline import Timeline

        timeline = Timeline(Path(env["STACK_TIMELINE"]), float(env["STACK_STARTED"]), new=False)
        timeline.stamp("nodes agreed, trainer starts" if env.get("STACK_RUN") else "trainer starts")
    sys.argv = [module, *overrides]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def torchrun(argv: list[str]) -> int:
    """torchrun's own parser and launcher; what it would print as a traceback becomes one line (or none, where the
    rank said it already), with its exit code."""
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # the agent's own failure report repeats what the rank printed, with a traceback-like table: ours says it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as exc:
        code = next(iter(exc.failures.values())).exitcode
        if code not in (SAID,):
            print(f"error: the SFT trainer exited with code {code} (its output is above)", file=sys.stderr, flush=True)
        return SAID
    except SignalException as exc:  # Ctrl-C or SIGTERM reached the agent: the launch says it, once
        return 128 + int(exc.sigval)
    except DistNetworkError as exc:
        from app.node import port_holder

        port = args.master_port
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc):
            holder = port_holder(port)
            print(f"error: MASTER_PORT {port} is already in use on this node{f' by {holder}' if holder else ''}: set "
                  "MASTER_PORT to a free port, the same on every node", file=sys.stderr, flush=True)
        else:
            print(f"error: torchrun could not reach node 0 at {args.master_addr}:{port} "
                  f"({' '.join(str(exc).split())[:200]}): check MASTER_ADDR / MASTER_PORT and that node 0 runs",
                  file=sys.stderr, flush=True)
        return SAID
    return 0


if __name__ == "__main__":
    role, rest = sys.argv[1], sys.argv[2:]
    try:
        sys.exit(torchrun(rest) if role == "torchrun" else rank(rest))
    except KeyboardInterrupt:
        sys.exit(130)
