"""The Ray cluster of emulated hosts (scripts/ray-cluster.sh): a head and
three worker nodes, each in a network namespace of its own, started with
Ray's own commands; a task placed on each worker node by its resource runs
in that node's namespace (its address); `down` leaves nothing behind
(namespaces, the bridge, Ray's processes and session files), and so does
an `up` that fails. On it, examples/ray_cluster.py as a user runs it:
FSDP2 trainers of a transformers Qwen2 on two nodes, rollout ranks on a
third behind a shaped link, five refits verified element by element, one
node lost mid-refit and replaced. Root, `ip`, `tc` and Ray needed
(skipped otherwise); the refits also need transformers."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

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
    """What the script and the example may have made that is still there."""
    netns = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split() if n.startswith("refit-ray-")]
    bridge = subprocess.run(["ip", "link", "show", "refitraybr0"], capture_output=True).returncode == 0
    files = [f for f in os.listdir("/tmp") if f.startswith(("ray-refit-", "refit-ray-checkpoint-"))]
    files += [f"/dev/shm/{f}" for f in os.listdir("/dev/shm") if f.startswith("refit-")] if os.path.isdir("/dev/shm") else []
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


EXAMPLE = """
import sys
sys.path.insert(0, {examples!r})
import ray_cluster
import ray.cloudpickle
ray.cloudpickle.register_pickle_by_value(ray_cluster)  # its actors, as `python examples/ray_cluster.py` ships them

def lose_a_node(step, plan_bytes):
    # The test kills node 2 (trainer rank 1's) while this refit moves
    # bytes, and starts a replacement node, then says so.
    if step == 3:
        print(f"IN FLIGHT {{plan_bytes}}", flush=True)
        if sys.stdin.readline().strip() != "replaced":
            raise SystemExit("the test did not replace the node")

sys.exit(ray_cluster.main(
    ["--address", "10.78.0.1:6379", "--gloo-ifname", "eth0", "--steps", "5", "--deadline", "30"], on_refit=lose_a_node))
"""


def received(k):
    """Bytes host K's link has received so far."""
    out = subprocess.run(["ip", "-j", "-s", "-n", f"refit-ray-{k}", "link", "show", "eth0"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["stats64"]["rx"]["bytes"]


@pytest.mark.skipif(shutil.which("tc") is None, reason="needs tc")
def test_refits_across_ray_nodes_are_exact_and_survive_a_node_lost_mid_refit(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    # Trainer nodes 1 and 2 unshaped (FSDP2's gloo traffic between them),
    # the rollout node's link at 3 MB/s each way: a refit of the 8.9 MB
    # policy takes about 3 s, long enough to lose a node in the middle.
    env = dict(os.environ, ROLES="train train rollout", RATES="- - 3")
    log = tmp_path / "driver.stderr"
    lines = []
    try:
        up = subprocess.run([SCRIPT, "up", "3", RAY], env=env, capture_output=True, text=True, timeout=240)
        assert up.returncode == 0, up.stderr[-2000:]
        with open(log, "w") as err:
            driver = subprocess.Popen(
                [SCRIPT, "exec", "0", sys.executable, "-c", EXAMPLE.format(examples=os.path.join(ROOT, "examples"))],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            watchdog = threading.Timer(900, driver.kill)
            watchdog.start()
            try:
                for line in driver.stdout:
                    lines.append(line.rstrip())
                    if line.startswith("IN FLIGHT"):
                        plan_bytes = int(line.split()[2])
                        # Mid-refit: a quarter of the bytes have reached the
                        # rollout node, then trainer rank 1's node is lost.
                        start, t0 = received(3), time.monotonic()
                        while received(3) - start < plan_bytes // 4 and time.monotonic() - t0 < 60:
                            time.sleep(0.05)
                        lines.append(f"(test: node 2 killed after {received(3) - start} bytes of the refit)")
                        subprocess.run([SCRIPT, "kill", "2"], check=True, timeout=60)
                        add = subprocess.run([SCRIPT, "add", "4", RAY], env=dict(os.environ, ROLE="train"), capture_output=True, text=True, timeout=240)
                        assert add.returncode == 0, add.stderr[-2000:]
                        driver.stdin.write("replaced\n")
                        driver.stdin.flush()
                code = driver.wait(timeout=60)
            finally:
                watchdog.cancel()
                if driver.poll() is None:
                    driver.kill()
        out = "\n".join(lines)
        assert code == 0, out + "\n" + log.read_text()[-4000:]
    finally:
        subprocess.run([SCRIPT, "down"], capture_output=True, timeout=120)
    print(out)
    model_bytes = int(re.search(r"\((\d+) bytes of bf16 weights\)", out).group(1))
    # Placement groups put each trainer rank on a node of its own (which
    # rank on which node is Ray's choice), both rollout ranks on node 3.
    placed = [sorted(eval(p)) for p in re.findall(r"^driver: trainer ranks on (\[.*\])$", out, re.M)]
    assert placed[0] == ["10.78.0.2", "10.78.0.3"], placed
    assert "rollout ranks on ['10.78.0.4', '10.78.0.4']" in out
    # Five refits verified, each moving the whole policy over the rollout
    # node's emulated link.
    done = re.findall(r"^step (\d): loss .* refit of version (\d) .* the rollout node received (\d+)\); every rollout element", out, re.M)
    assert [(int(s), int(v)) for s, v, _ in done] == [(k, k) for k in range(1, 6)]
    assert all(int(r) >= model_bytes for _, _, r in done), done
    # The node lost mid-refit: the refit failed within its deadline naming
    # the lost member, the rollouts kept version 2 whole, the trainers came
    # back (rank 1 on the replacement node) and were put back by recover().
    failed = re.search(r"^step 3: the refit of version 3 failed after ([\d.]+) s: MemberError: (.*)$", out, re.M)
    assert failed, out
    assert float(failed.group(1)) < 30
    assert "step 3: every rollout rank still serves version 2, every element the trainers'" in out
    assert placed[1:] == [["10.78.0.2", "10.78.0.5"]], placed
    back = re.search(r"put back by recover\(\): (\[.*\])", out).group(1)
    assert sorted(eval(back)) == [("src", 0), ("src", 1)]
    assert "5 steps: every refit verified on every rollout rank" in out
    assert left_behind() == NOTHING
