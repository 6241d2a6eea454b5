"""Whole pipelines across processes, joining, and Ctrl-C."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

import refit

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_example(name, timeout):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True, timeout=timeout)
    print(done.stdout[-4000:])
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_multiprocessing_pipeline():
    out = run_example("mp_pipeline.py", 300)
    assert out.count("all exact") == 5 and "bit-exact" in out


def test_ray_pipeline():
    try:
        import ray  # noqa: F401
    except ImportError as e:
        reason = f"ray is not installed ({e}); `pip install ray` to run examples/ray_pipeline.py"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    out = run_example("ray_pipeline.py", 600)
    assert out.count("all exact") == 5 and "bit-exact" in out
    # A rollout actor's process was killed before step 3 and Ray restarted it.
    assert "the refit failed: refit.member.dst.1 died" in out and "recover() put back [('dst', 1)]" in out


def test_ray_elastic_pipeline():
    try:
        import ray  # noqa: F401
    except ImportError as e:
        reason = f"ray is not installed ({e}); `pip install ray` to run examples/ray_elastic.py"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    out = run_example("ray_elastic.py", 600)
    assert out.count("all exact") == 6 and "bit-exact" in out
    # A replica joined before step 3, seeded with version 2 by a serving
    # replica (the trainers sent nothing), and replica 0 left before step 5.
    assert "replica 'late' joined, seeded with version 2 from replica" in out
    assert "into 3 replicas" in out and "replica 0 left; 2 replicas remain" in out
    assert "the replica that left still serves version 4 whole" in out


def test_join_errors_are_join_errors():
    with pytest.raises(refit.JoinError, match="secret: .*at least 16"):
        refit.join("127.0.0.1:1", "short")
    with pytest.raises(refit.JoinError, match="rendezvous address 'nowhere': not host:port"):
        refit.join("nowhere", "x" * 32)
    env = {k: v for k, v in os.environ.items() if k not in ("REFIT_RENDEZVOUS", "MASTER_ADDR", "REFIT_PORT")}
    code = "import refit\ntry:\n    refit.join()\nexcept refit.JoinError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60).stdout
    assert "set REFIT_RENDEZVOUS=host:port (or MASTER_ADDR and REFIT_PORT)" in out
    with pytest.raises(refit.JoinError, match="secret: .*at least 16"):
        refit.Orchestrator(secret="short")
    orch = refit.Orchestrator()
    with pytest.raises(refit.RefitError, match="call connect"):
        orch.refit_latest()
    with pytest.raises(refit.JoinError, match="did not join within"):
        orch.connect(1, 1, timeout=0.2)
    orch.close()


def test_torchrun_environment_and_wrong_secret():
    orch = refit.Orchestrator()
    host, port = orch.address.rsplit(":", 1)
    env = dict(os.environ, MASTER_ADDR=host, REFIT_PORT=port, REFIT_SECRET=orch.secret)
    env.pop("REFIT_RENDEZVOUS", None)
    code = (
        "import refit\n"
        "l = refit.Layout.from_json('{\"ranks\": 1, \"tensors\": [{\"name\": \"w\", \"dtype\": \"f32\", \"shape\": [2], \"mesh\": {\"shape\": [1]}, \"placements\": [\"replicate\"]}]}')\n"
        "d = refit.Destination(l, 0); d.join(); print('joined', flush=True); print('closed:', d.wait_closed(60))\n"
    )
    member = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        # A wrong secret is refused: that member never shows up.
        with pytest.raises(refit.JoinError):
            refit.join(orch.address, "y" * 32).wait_closed(5)
        assert member.stdout.readline().strip() == "joined"
    finally:
        orch.close()
        out, _ = member.communicate(timeout=60)
    assert "closed:" in out and "closed: None" not in out


def test_ctrl_c_interrupts_a_waiting_call():
    code = (
        "import refit, signal, time\n"
        # A shell that starts the tests in the background hands its children
        # SIGINT ignored, and Python then installs no KeyboardInterrupt
        # handler: install it, as an interactive session has it.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "orch = refit.Orchestrator()\n"
        "print('waiting', flush=True)\n"
        "t = time.time()\n"
        "try:\n"
        "    orch.connect(1, 1, timeout=120)\n"
        "except KeyboardInterrupt:\n"
        "    print(f'interrupted after {time.time() - t:.1f} s', flush=True)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "waiting"
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=30)
    assert "interrupted after" in out, out
    assert float(out.split("after ")[1].split(" s")[0]) < 30


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_forked_child_is_told_to_use_spawn():
    layout = refit.Layout.from_json('{"ranks": 1, "tensors": [{"name": "w", "dtype": "f32", "shape": [2], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}')
    system = refit.spawn_local(layout, layout)  # the runtime exists in this process now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what refit says, then leave without cleanup
        os.close(read)
        try:
            system.sources[0].step({"w": __import__("numpy").zeros(2, "float32")})
            msg = "no error"
        except refit.RefitError as e:
            msg = str(e)
        os.write(write, msg.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    assert "before it forked" in msg and "'spawn'" in msg, msg


MEMBER = """
import sys, numpy as np, refit
role, rank, address, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
src = refit.Layout.from_json('{"ranks": 1, "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 4], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}')
dst = refit.Layout.from_json('{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}')
me = refit.Source(src, rank) if role == "src" else refit.Destination(dst, rank)
a = np.zeros(me.block("w")[1], np.float32)
me.register("w", a)
me.join(address, secret)
print("joined", flush=True)
for line in sys.stdin:
    n = int(line)
    if role == "src":
        a[...] = n
        me.restore(n)  # version n holds step n's weights
        print(n, flush=True)
    else:
        print(me.load(n), a.tolist() == np.full(a.shape, n, np.float32).tolist(), flush=True)
"""


def test_a_member_process_that_died_is_replaced_by_the_one_that_rejoins():
    orch = refit.Orchestrator(deadline=20.0)
    procs = {}

    def start(role, rank):
        p = subprocess.Popen([sys.executable, "-c", MEMBER, role, str(rank), orch.address, orch.secret], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "joined"
        procs[(role, rank)] = p

    def ask(key, n):
        p = procs[key]
        p.stdin.write(f"{n}\n")
        p.stdin.flush()
        return p.stdout.readline().split()

    def step_and_check(n):
        assert ask(("src", 0), n) == [str(n)]
        assert orch.refit(n).version == n
        for rank in (0, 1):
            assert ask(("dst", rank), n) == [str(n), "True"], f"dst {rank} after refit {n}"

    try:
        for key in (("src", 0), ("dst", 0), ("dst", 1)):
            start(*key)
        orch.connect(1, 2)
        assert orch.recover() == []
        step_and_check(1)
        procs[("dst", 1)].kill()
        procs[("dst", 1)].wait()
        assert ask(("src", 0), 2) == ["2"]
        with pytest.raises(refit.MemberError):
            orch.refit(2)
        assert ask(("dst", 0), 1) == ["1", "True"], "dst 0 still serves version 1"
        with pytest.raises(refit.JoinError, match="refit.member.dst.1"):
            orch.recover(timeout=0.3)
        start("dst", 1)
        assert orch.recover(timeout=30) == [("dst", 1)]
        assert orch.recover() == []
        assert orch.refit(2).version == 2
        for rank in (0, 1):
            assert ask(("dst", rank), 2) == ["2", "True"]
        step_and_check(3)
    finally:
        orch.close()
        for p in procs.values():
            p.kill()
            p.wait()


def test_a_local_system_has_nothing_to_recover_while_its_members_live():
    layout = refit.Layout.from_json('{"ranks": 1, "tensors": [{"name": "w", "dtype": "f32", "shape": [2], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}')
    system = refit.spawn_local(layout, layout)
    assert system.orchestrator.recover() == []
    system.orchestrator.close()
