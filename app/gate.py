"""`python -m app.gate [--preload A,B] [--ray] MODULE ARGS...`: `python -m MODULE ARGS...`, held at the start until a
line comes on stdin, having imported A and B first. --ray: joins the Ray cluster at RAY_ADDRESS before MODULE runs,
as a job without a runtime_env, so that MODULE (verl's driver) does not start one with its own (RAY_WARM_WORKERS).

grpo-head starts verl's driver this way together with the Ray head: the driver imports what MODULE imports (verl,
torch, Ray: seconds to tens of seconds, docs/benchmarks.md) while the head starts and the nodes join, and runs once
the cluster is ready; `make demo` starts A1's eval this way with GRPO (--preload: what the eval imports only inside
its functions). A go line that is a JSON list adds those arguments to MODULE's: grpo-head's last ones are known only
once the count of the prompts, beside the head's start, has chosen them. End of input (the launch stopped first)
exits 0 without running it. On a terminal it runs at once."""

import ast
import contextlib
import importlib
import importlib.util
import json
import runpy
import sys


def import_what_it_imports(module: str) -> None:
    """The module's own top-level imports, not the module: importing it would run its code twice (once here, once as
    __main__). Any failure is left to the real run, which meets it again and reports it as `python -m` does."""
    with contextlib.suppress(Exception):
        source = importlib.util.find_spec(module).loader.get_source(module)
        for node in ast.parse(source).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                importlib.import_module(name)


def main() -> int:
    argv = sys.argv[1:]
    preload, argv = (argv[1].split(","), argv[2:]) if argv[0] == "--preload" else ([], argv)
    join_ray = argv[0] == "--ray"
    argv = argv[1:] if join_ray else argv
    module, args = argv[0], argv[1:]
    for name in preload:
        with contextlib.suppress(Exception):  # as above: the real run meets any failure again
            importlib.import_module(name)
    import_what_it_imports(module)
    if not sys.stdin.isatty():
        go = sys.stdin.readline()
        if not go:
            return 0
        args += json.loads(go) if go.startswith("[") else []
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    if not found:  # as `python -m` says it, without a traceback
        print(f"{sys.executable}: No module named {module}", file=sys.stderr)
        return 1
    if join_ray:  # Ray prestarts its workers for a job without a runtime_env only; the raylets hold verl's
        import ray

        ray.init()  # at RAY_ADDRESS, the launch's, as verl's own ray.init would join
    sys.argv = [module, *args]  # run_module sets argv[0] to the module's file, as `python -m` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
