"""app/node.py: what this machine has. GPUs through a real nvidia-smi stand-in (an executable on PATH that prints
what nvidia-smi prints; this machine has no GPU), read once per command and filtered as CUDA reads
CUDA_VISIBLE_DEVICES; routes and interfaces through the real kernel."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest
from conftest import REPO

from app.node import ifname_matches, interface_addresses, route_interface

SMI = """#!/bin/sh
echo called >> {calls}
cat <<'CSV'
0, GPU-aaaa, NVIDIA H200, 143771, 580.82, Default
1, GPU-bbbb, NVIDIA H200, 143771, 580.82, Exclusive_Process
CSV
"""


def nodes_gpus(tmp_path, *visible: str | None) -> list[str]:
    """node.gpus(v) for each v, in one process with the stand-in nvidia-smi first on PATH; and how often it ran."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(SMI.format(calls=tmp_path / "calls"))
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    code = ("import sys; from app import node\n"
            "for v in sys.argv[1:]:\n"
            "    g = node.gpus(None if v == 'unset' else v)\n"
            "    print(g.count, g.present, g.memory_bytes, [r['compute_mode'] for r in g.rows])")
    out = subprocess.run([sys.executable, "-c", code, *[v if v is not None else "unset" for v in visible]],
                         env={**os.environ, "PATH": f"{smi.parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines() + [f"calls {len((tmp_path / 'calls').read_text().splitlines())}"]


def test_gpus_are_asked_of_nvidia_smi_once_per_command_and_filtered_as_cuda_does(tmp_path):
    assert nodes_gpus(tmp_path, None, "1", "GPU-aa,1", "", "1,nonsense,0") == [
        "2 2 150754820096 ['Default', 'Exclusive_Process']",
        "1 2 150754820096 ['Exclusive_Process']",
        "2 2 150754820096 ['Default', 'Exclusive_Process']",
        "0 2 None []",
        "1 2 150754820096 ['Exclusive_Process']",  # CUDA stops at the first entry that names no GPU
        "calls 1"]


def test_route_to_loopback_leaves_via_lo():
    assert route_interface("127.0.0.1") == ("127.0.0.1", "lo")


def default_gateway() -> str | None:
    """This machine's default gateway (from /proc/net/route): an outside address no test has to name."""
    try:
        lines = open("/proc/net/route").read().splitlines()[1:]
    except OSError:
        return None
    for fields in (line.split() for line in lines):
        if len(fields) > 2 and fields[1] == "00000000" and fields[2] != "00000000":
            return socket.inet_ntoa(int(fields[2], 16).to_bytes(4, "little"))
    return None


def test_route_to_an_outside_address_names_the_interface_holding_the_source_address():
    gateway = default_gateway()
    if gateway is None:
        pytest.skip("this machine has no default route")
    source, name = route_interface(gateway)  # a UDP connect sends nothing
    assert name in {n for _, n in socket.if_nameindex()} and name != "lo"
    assert source in interface_addresses()[name]


def test_socket_ifname_syntax_of_nccl_and_gloo():
    assert ifname_matches("eth", "eth0") and ifname_matches("=eth0", "eth0") and not ifname_matches("=eth", "eth0")
    assert not ifname_matches("^docker,lo", "lo") and ifname_matches("^docker,lo", "ens5")
    assert ifname_matches("ib,eth", "eth1") and not ifname_matches("ib", "eth1")
    assert ifname_matches("eth0,eth1", "eth1", nccl=False) and not ifname_matches("eth", "eth0", nccl=False)


