"""What this machine has, asked once per command: its GPUs (one nvidia-smi call), its interfaces, routes and
ports. Preflight, perf, doctor, launch, eval and the demo all read it here.

nvidia-smi and the kernel answer in milliseconds; importing torch for torch.cuda.device_count() would cost
seconds on every preflight. The GPU image has no `ip` command: interfaces come from the kernel directly.
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import re
import shutil
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SIOCGIFADDR = 0x8915  # ioctl: the IPv4 address of an interface (linux/sockios.h)
GPU_FIELDS = ("index", "uuid", "name", "memory.total", "driver_version", "compute_mode")


@dataclass(frozen=True)
class Gpus:
    """The GPUs this command may use: those the driver has, less what CUDA_VISIBLE_DEVICES hides."""

    count: int | None  # None: cannot be counted here
    source: str  # how we know, for the messages
    rows: tuple[dict[str, str], ...] = ()  # nvidia-smi's fields of each visible GPU
    present: int | None = None  # GPUs on the machine, visible or not

    @property
    def memory_bytes(self) -> int | None:
        """Memory of the smallest visible GPU."""
        sizes = [int(float(row["memory.total"])) for row in self.rows if re.fullmatch(r"[\d.]+", row["memory.total"])]
        return min(sizes) * 1024**2 if sizes else None


def _visible(rows: list[dict[str, str]], visible: str) -> tuple[list[dict[str, str]], bool]:
    """The rows CUDA shows under CUDA_VISIBLE_DEVICES, read as CUDA reads it: indices or UUID prefixes, up to the
    first entry that names no GPU (CUDA ignores the rest). Returns (rows, whether every entry named one)."""
    out = []
    for entry in (part.strip() for part in visible.split(",")):
        found = [row for row in rows if (entry.isdigit() and row["index"] == entry)
                 or (entry.startswith(("GPU-", "MIG-")) and row["uuid"].startswith(entry))]
        if not found or found[0] in out:
            return out, False
        out.append(found[0])
    return out, True


@functools.cache
def _driver_rows() -> tuple[list[dict[str, str]] | None, str]:
    """Every GPU of the machine, one nvidia-smi call per command: (rows, source); (None, why) without a driver."""
    rows: list[dict[str, str]] | None = None
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0:
                rows = [dict(zip(GPU_FIELDS, (f.strip() for f in line.split(","))))
                        for line in out.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    if rows is None:
        proc = Path("/proc/driver/nvidia/gpus")
        if not proc.is_dir():
            return None, "no nvidia-smi and no NVIDIA driver here"
        # a driver without a working nvidia-smi: its count, no details
        return [{"index": str(i), "uuid": "", "name": "?", "memory.total": "?", "driver_version": "?",
                 "compute_mode": "?"} for i, _ in enumerate(sorted(proc.iterdir()))], "/proc/driver/nvidia/gpus"
    return rows, "nvidia-smi"


@functools.cache
def gpus(visible: str | None) -> Gpus:
    """The GPUs of this node under `visible` (CUDA_VISIBLE_DEVICES; None: unset; "" hides every GPU)."""
    rows, source = _driver_rows()
    if rows is None:  # no driver: none that CUDA could use, whatever CUDA_VISIBLE_DEVICES says
        return Gpus(None, source, present=0)
    if visible is None:
        return Gpus(len(rows), source, tuple(rows), len(rows))
    shown, understood = _visible(rows, visible)
    note = "" if understood or not visible.strip() else " (CUDA stops at its first entry that names no GPU)"
    return Gpus(len(shown), f"{source} and CUDA_VISIBLE_DEVICES={visible!r}{note}", tuple(shown), len(rows))


def gpu_processes(gpus: Gpus) -> list[str]:
    """What runs on `gpus` now ("pid 123 (VLLM::EngineCore, 61234 MiB)"), from nvidia-smi; [] where it cannot tell."""
    smi = shutil.which("nvidia-smi")
    uuids = {row["uuid"] for row in gpus.rows if row.get("uuid")}
    if not smi or not uuids:
        return []
    try:
        out = subprocess.run([smi, "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    apps = [[f.strip() for f in line.split(",")] for line in out.stdout.splitlines() if line.count(",") >= 3]
    return [f"pid {pid} ({name}, {memory} MiB)" for uuid, pid, name, memory in (a[:4] for a in apps)
            if out.returncode == 0 and uuid in uuids]


# --- network ---------------------------------------------------------------------------------------------
def interface_addresses() -> dict[str, list[str]]:
    """interface name -> its addresses (IPv4 through ioctl, IPv6 from /proc/net/if_inet6)."""
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                out.setdefault(name, []).append(socket.inet_ntoa(raw[20:24]))
            except OSError:  # no IPv4 address on this interface
                out.setdefault(name, [])
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6:
                out.setdefault(fields[5], []).append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except OSError:
        pass
    return out


def route_interface(host: str) -> tuple[str, str | None]:
    """(source address, interface) this node uses to reach `host`: what NCCL/Gloo should bind to.
    A UDP connect() sends nothing; it only makes the kernel choose the route. Raises OSError."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, proto=socket.IPPROTO_UDP)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)
        source = sock.getsockname()[0]
    source_ip = ipaddress.ip_address(source.split("%")[0])
    for name, addresses in interface_addresses().items():
        if any(ipaddress.ip_address(a) == source_ip for a in addresses):
            return source, name
    return source, None


def ifname_matches(spec: str, name: str, nccl: bool = True) -> bool:
    """Whether NCCL_SOCKET_IFNAME's syntax (prefixes, `=exact`, `^exclude`, comma lists) selects `name`;
    nccl=False: GLOO_SOCKET_IFNAME's (exact names, comma list)."""
    if not nccl:
        return name in [part.strip() for part in spec.split(",")]
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    hit = any((name == part) if exact else name.startswith(part) for part in spec.split(",") if part)
    return hit != exclude


def is_local_address(host: str) -> bool:
    try:
        addresses = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    if any(a.is_loopback for a in addresses):
        return True
    mine = {ipaddress.ip_address(a) for values in interface_addresses().values() for a in values}
    return bool(addresses & mine)


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_holder(port: int) -> str | None:
    """Who listens on TCP `port` here ("python3 (pid 123)"), where psutil may tell; None where nobody does."""
    import psutil

    try:
        listening = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    except (psutil.AccessDenied, OSError):
        return None
    for conn in listening:
        try:
            return f"{psutil.Process(conn.pid).name()} (pid {conn.pid})" if conn.pid else "another user's process"
        except psutil.Error:
            return f"pid {conn.pid}"
    return None


def reachable(host: str, port: int, window: float = 10.0) -> str | None:
    """Within `window` seconds, whether anything at host:port can be reached: None when it answers; "refused"
    when the machine answers but nothing listens there yet; else why not (timed out, no route, unknown host)."""
    deadline = time.monotonic() + window
    reason = "timed out"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=max(0.5, min(3.0, deadline - time.monotonic()))):
                return None
        except ConnectionRefusedError:
            return "refused"
        except socket.gaierror as exc:
            return f"unknown host: {exc.strerror}"
        except OSError as exc:
            reason = exc.strerror or "timed out"
        time.sleep(0.5)
    return reason
