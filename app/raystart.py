"""`python -m app.raystart ARGS...`: Ray's `ray ARGS...` (here `ray start --block`), leaving Ray's record of this
node's current cluster as it was found.

`ray start` writes its cluster's address to `<Ray temp dir>/ray_current_cluster`, and a plain `ray.init()` on this
node (no address, e.g. `python -m verl.trainer.main_ppo`) joins whatever that names. Stopping `ray start --block`
does not reset it (only a machine-wide `ray stop` does), so a later plain program would try to join a dead head.
Ray ends `--block` on SIGTERM through sys.exit, after stopping its processes (when the launch stops it, and when the
kernel sends the SIGTERM because the launch itself was killed: app/common.ends_with_us), and through os._exit when
its processes die (a worker's head went away): the file is reset at both. Written by hand: Ray has no flag for it."""

import atexit
import os
import sys
from pathlib import Path


def flag(args: list[str], name: str) -> str | None:
    """`--name VALUE` or `--name=VALUE` in `ray start`'s arguments."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def names_port(content: str | None, port: str) -> bool:
    """Ray writes the address as it sees it (possibly the node's primary address): the port is what identifies the
    cluster this `ray start` joined or started, which is gone once it ends."""
    return content is not None and content.rsplit(":", 1)[-1] == port


def read(path: Path) -> str | None:
    """The record, or None where there is none or it cannot be read (a traceback at exit would help no one)."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def keep_address_file(args: list[str]) -> None:
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(flag(args, "--temp-dir")))
    port = flag(args, "--port") or "6379" if "--head" in args else (flag(args, "--address") or "").rsplit(":", 1)[-1]
    before = read(path)

    def restore() -> None:
        now = read(path)
        if not names_port(now, port):
            return  # never written by this `ray start`, or by another cluster since: not ours to touch
        try:
            if before is not None and not names_port(before, port):
                path.write_text(before)
            else:
                path.unlink(missing_ok=True)
        except OSError as exc:
            print(f"warning: could not reset {path} ({exc.strerror}): a plain ray.init() here would try to join "
                  f"{now}; remove the file or run `ray stop`", file=sys.stderr, flush=True)

    atexit.register(restore)  # before Ray's own hooks, so it runs after them (atexit runs last-in, first-out)
    leave, ours = os._exit, os.getpid()

    def restore_and_leave(code: int) -> None:
        if os.getpid() == ours:  # not in a child forked from here
            restore()
        leave(code)

    os._exit = restore_and_leave  # this process runs nothing but Ray's CLI


if __name__ == "__main__":
    keep_address_file(sys.argv[1:])
    from ray.scripts.scripts import main

    sys.argv[0] = "ray"
    sys.exit(main())
