"""The Ray cluster of emulated hosts (scripts/ray-cluster.sh, issue 54's
first piece): a head and three worker nodes, each in a network namespace
of its own, started with Ray's own commands; a task placed on each worker
node by its resource runs in that node's namespace (its address); `down`
leaves nothing behind (namespaces, the bridge, Ray's processes and session
files), and so does an `up` that fails. Root, `ip` and Ray needed (skipped
otherwise)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "scripts", "ray-cluster.sh")
RAY = os.path.join(os.path.dirname(sys.executable), "ray")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or not os.path.exists(RAY),
    reason="needs root, iproute2 and the ray command beside this Python",
)

DRIVER = """
import json, ray
ray.init(address="10.78.0.1:6379", logging_level="ERROR")
@ray.remote(num_cpus=0)
def where():
    return ray.util.get_node_ip_address()
print(json.dumps({k: ray.get(where.options(resources={f"host{k}": 0.01}).remote()) for k in (1, 2, 3)}))
"""


def left_behind():
    """What the script may have made that is still there."""
    netns = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split() if n.startswith("refit-ray-")]
    bridge = subprocess.run(["ip", "link", "show", "refitraybr0"], capture_output=True).returncode == 0
    files = [f for f in os.listdir("/tmp") if f.startswith("ray-refit-")]
    procs = subprocess.run(["pgrep", "-f", "ray-refit-|10.78.0.1:6379"], capture_output=True, text=True).stdout.split()
    return {"netns": netns, "bridge": bridge, "files": files, "processes": procs}


NOTHING = {"netns": [], "bridge": False, "files": [], "processes": []}


def test_a_cluster_of_emulated_hosts_places_tasks_per_node_and_leaves_nothing_behind():
    try:
        up = subprocess.run([SCRIPT, "up", "3", RAY], capture_output=True, text=True, timeout=240)
        assert up.returncode == 0, up.stderr[-2000:]
        assert up.stdout.strip().splitlines()[-1] == "10.78.0.1:6379"
        run = subprocess.run([SCRIPT, "exec", "0", sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-2000:]
        placed = json.loads(run.stdout.strip().splitlines()[-1])
        assert placed == {"1": "10.78.0.2", "2": "10.78.0.3", "3": "10.78.0.4"}
    finally:
        subprocess.run([SCRIPT, "down"], capture_output=True, timeout=120)
    assert left_behind() == NOTHING


def test_an_up_that_fails_leaves_nothing_behind():
    up = subprocess.run([SCRIPT, "up", "2", "/bin/false"], capture_output=True, text=True, timeout=120)
    assert up.returncode != 0
    assert left_behind() == NOTHING
