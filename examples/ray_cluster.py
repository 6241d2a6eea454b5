"""refit on a Ray cluster of several hosts: FSDP2 trainer actors on two
nodes, rollout actors on a third, placed by placement groups; one
orchestrator actor refits after every optimizer step; a lost node is
replaced and the refits go on.

The cluster: worker nodes that offer Ray the resources "train" (two
nodes, one trainer each) and "rollout" (one node, both rollout ranks).
On one machine, scripts/ray-cluster.sh makes such a cluster of emulated
hosts (network namespaces, links shaped by the kernel):

    ROLES="train train rollout" RATES="- - 20" scripts/ray-cluster.sh up 3
    scripts/ray-cluster.sh exec 0 python examples/ray_cluster.py --address 10.78.0.1:6379 --gloo-ifname eth0
    scripts/ray-cluster.sh down

What runs (the driver: this process, on a node of the cluster):
- an orchestrator actor (`refit.Orchestrator`) on the driver's node;
- 2 trainer actors, one per "train" node (a STRICT_SPREAD placement
  group): a transformers Qwen2 built from a config (random weights,
  nothing downloaded), sharded by FSDP2 over gloo across the two nodes,
  AdamW on next-token loss; each rank's FSDP2 shards are its refit source,
  read in place (`layout_from_dtensors`, `Source.in_place`); after every
  step the trainers write a distributed checkpoint (torch DCP) to
  `--checkpoint`, a directory every trainer node reaches;
- 2 rollout actors on the "rollout" node (a STRICT_PACK placement group):
  TP2 in bf16 as the engines split it (`tp_inference_layout`), each
  holding its blocks as torch tensors. Between nodes the bytes go by TCP,
  between the rollout ranks by shared memory.

After every step the orchestrator refits the step's version; each rollout
rank loads it and every element is verified against the trainers': for
each pair of (trainer, rollout) ranks, the part of each tensor both hold
is hashed (bf16) on both sides and compared. The rollout node's received
bytes during the refit are printed beside the bytes the plan moves.

A refit that fails because a trainer was lost (its node died mid-refit)
is handled as a user would: the rollout ranks are checked to serve the version before,
whole; both trainers are started again in their placement group's
bundles (Ray places a lost node's bundle on a node that joins with the
same resource), load the last checkpoint, mark it as its version
(`Source.restore`) and join; `recover()` puts them in the lost members'
places, and the refit of that version runs again.

    python examples/ray_cluster.py --address HEAD:6379 [--steps 5] [--gloo-ifname IF]

Exits non-zero on a wrong element, a refit that fails twice, or one that
fails for another reason than a lost trainer.
"""

import argparse
import hashlib
import math
import shutil
import socket
import sys
import tempfile
import time
from datetime import timedelta

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

import refit

TRAINERS, ROLLOUTS = 2, 2


def policy_config(hidden, layers, vocab):
    """A Qwen2 config (``hidden`` a multiple of 64: heads of 32, half as
    many KV heads, as the engines split them over TP2)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def digest(t):
    """The SHA-256 of a tensor's elements as bf16."""
    import torch

    return hashlib.sha256(t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def cut(t, block, box):
    """The part ``box`` (offset, extent: global coordinates) of ``t``, the
    rank's block ``block`` (offset, extent) of its tensor."""
    (at, _), (offset, extent) = block, box
    return t[tuple(slice(o - a, o - a + e) for o, a, e in zip(offset, at, extent))]


def received_bytes():
    """Bytes this host's network interfaces (all but loopback) received so
    far (/proc/net/dev: the reading process's network namespace)."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, data = line.split(":", 1)
            if name.strip() != "lo":
                total += int(data.split()[0])
    return total


@ray.remote(num_cpus=0)
class Refitter:
    """The orchestrator actor: the rendezvous every member joins, and the
    refits."""

    def __init__(self, deadline):
        self.orch = refit.Orchestrator(bind=f"{ray.util.get_node_ip_address()}:0", deadline=deadline)

    def rendezvous(self):
        return self.orch.address, self.orch.secret

    def connect(self, src_ranks, dst_ranks, timeout):
        plan = self.orch.connect(src_ranks=src_ranks, dst_ranks=dst_ranks, timeout=timeout)
        return {"bytes": plan.bytes, "fingerprint": plan.fingerprint}

    def refit(self, version):
        """The refit's report, or the error that failed it (as words) and
        how long it ran."""
        t = time.perf_counter()
        try:
            r = self.orch.refit(version)
        except refit.RefitError as e:
            return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t}
        return {"version": r.version, "bytes": r.bytes, "seconds": r.seconds, "transfer_seconds": r.transfer_seconds}

    def recover(self, timeout):
        return self.orch.recover(timeout=timeout)

    def close(self):
        self.orch.close()


@ray.remote(num_cpus=1)
class Trainer:
    """One FSDP2 rank of the policy (gloo on the CPU)."""

    def __init__(self, rank, size):
        import torch

        torch.set_num_threads(1)
        self.rank, self.size = rank, size

    def node(self):
        return ray.util.get_node_ip_address()

    def master(self):
        """An address for the process group's store (rank 0's)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, master, rendezvous, secret, checkpoint, restore=None):
        """Builds the sharded policy (from the checkpoint of step
        ``restore`` if given) and joins the orchestrator with its shards:
        the training layout, the tensors' shapes and this rank's blocks."""
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import Qwen2ForCausalLM

        dist.init_process_group(
            "gloo", init_method=f"tcp://{master[0]}:{master[1]}", rank=self.rank, world_size=TRAINERS, timeout=timedelta(seconds=120)
        )
        torch.manual_seed(0)  # every rank builds the same policy
        config = policy_config(**self.size)
        model = Qwen2ForCausalLM(config)
        mesh = init_device_mesh("cpu", (TRAINERS,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model, self.checkpoint = model, checkpoint
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if restore is not None:
            self._load(restore)
        self.params = dict(model.named_parameters())
        layout = refit.layout_from_dtensors(self.params, ranks_per_node=1)
        self.src = refit.Source.in_place(layout, self.rank, refit.param_buffers(layout, self.rank, self.params))
        if restore is not None:
            self.src.restore(restore)  # the shards hold that step's weights
        self.src.join(rendezvous, secret)
        self.corpus = torch.randint(1, config.vocab_size, (2 * TRAINERS, 32), generator=torch.Generator().manual_seed(3))
        shapes = {n: list(p.shape) for n, p in self.params.items()}
        return layout.to_json(), shapes, {n: self.src.block(n) for n in self.params}

    def _state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def _load(self, step):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=f"{self.checkpoint}/step-{step}")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def step(self):
        """One AdamW step on next-token loss (each rank its half of the
        batch), then a checkpoint of it: (version, loss)."""
        import torch.distributed.checkpoint as dcp

        batch = self.corpus[self.rank :: TRAINERS]
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        with self.src.stepping():  # the version fence: no refit reads a shard mid-step
            self.optimizer.step()
        self.optimizer.zero_grad()
        version = self.src.version
        if self.checkpoint is not None:
            dcp.save(self._state(), checkpoint_id=f"{self.checkpoint}/step-{version}")
            if self.rank == 0:
                shutil.rmtree(f"{self.checkpoint}/step-{version - 1}", ignore_errors=True)
        return version, loss.item()

    def nudge(self):
        """A step without data or collectives (benchmarks/ray_cluster.py
        times refits, not training): every local shard moves by 1e-3, under
        the version fence. The version."""
        import torch

        with self.src.stepping(), torch.no_grad():
            for p in self.params.values():
                p.to_local().add_(1e-3)
        return self.src.version

    def full(self):
        """Every tensor whole, in bf16 (an FSDP2 all-gather; every rank
        takes part, rank 0 returns them): the gather of a gather-broadcast."""
        import torch

        with torch.no_grad():
            whole = {n: p.full_tensor().to(torch.bfloat16) for n, p in self.params.items()}
        return whole if self.rank == 0 else None

    def digests(self, boxes):
        """The digest of each ``(tensor, box)``, a part of this rank's block."""
        return [digest(cut(self.params[n].to_local(), self.src.block(n), box)) for n, box in boxes]


@ray.remote(num_cpus=1)
class Rollout:
    """One TP rank of an engine-shaped rollout worker: its blocks of every
    tensor in bf16, loaded from refit at a step boundary."""

    def __init__(self, layout_json, rank, rendezvous, secret):
        import torch

        torch.set_num_threads(1)
        self.dst = refit.Destination(refit.Layout.from_json(layout_json), rank)
        self.weights = {n: torch.zeros(self.dst.block(n)[1], dtype=torch.bfloat16) for n in self.dst.held()}
        self.dst.register_all(self.weights)
        self.dst.join(rendezvous, secret)

    def blocks(self):
        return {n: self.dst.block(n) for n in self.weights}

    def node(self):
        return ray.util.get_node_ip_address()

    def load(self, version):
        """Copies the committed ``version`` in; the version this rank serves."""
        self.dst.load(version)
        return self.dst.version

    def serving(self):
        return self.dst.version

    def digests(self, boxes):
        return [digest(cut(self.weights[n], self.dst.block(n), box)) for n, box in boxes]

    def take(self, whole):
        """A gather-broadcast's last leg: this rank's blocks cut from the
        whole tensors (``ray.get`` of the object the trainer put)."""
        for n, w in self.weights.items():
            w.copy_(cut(whole[n], ([0] * w.dim(), None), self.dst.block(n)))
        return sum(w.numel() * 2 for w in self.weights.values())

    def received_bytes(self):
        return received_bytes()


def overlap(a, b):
    """The box both blocks (offset, extent) cover, or None."""
    lo = [max(x, y) for x, y in zip(a[0], b[0])]
    hi = [min(x + e, y + f) for x, e, y, f in zip(a[0], a[1], b[0], b[1])]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, [h - l for l, h in zip(lo, hi)]


def check_boxes(trainer_blocks, rollout_blocks):
    """For each (trainer rank, rollout rank), the ``(tensor, box)`` parts both
    hold; together they cover every rollout rank's blocks."""
    pairs = {}
    for t, held in enumerate(trainer_blocks):
        for d, wanted in enumerate(rollout_blocks):
            for name, block in wanted.items():
                box = overlap(held[name], block)
                if box is not None:
                    pairs.setdefault((t, d), []).append((name, box))
    return pairs


class Job:
    """The actors and placement groups of one run (``main``)."""

    def __init__(self, args):
        self.args = args
        self.size = dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab)
        here = ray.get_runtime_context().get_node_id()
        self.refitter = Refitter.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote(args.deadline)
        self.rendezvous, self.secret = ray.get(self.refitter.rendezvous.remote())
        print(f"driver: the orchestrator actor listens at {self.rendezvous}", flush=True)
        self.train_pg = placement_group([{"CPU": 1, "train": 1}] * TRAINERS, strategy="STRICT_SPREAD")
        self.rollout_pg = placement_group([{"CPU": 1, "rollout": 1}] * ROLLOUTS, strategy="STRICT_PACK")
        ray.get([self.train_pg.ready(), self.rollout_pg.ready()], timeout=args.timeout)
        env = {"env_vars": {"GLOO_SOCKET_IFNAME": args.gloo_ifname}} if args.gloo_ifname else None
        self.trainer_options = dict(runtime_env=env)
        self.trainers = []
        self.training_layout, self.shapes, self.trainer_blocks = self.start_trainers(restore=None)
        heads = self.size["hidden"] // 32
        self.rollout_layout = refit.tp_inference_layout(
            self.shapes, tp=ROLLOUTS, ranks_per_node=ROLLOUTS, fuse=False, num_kv_heads=heads // 2
        )
        self.rollouts = [
            Rollout.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.rollout_pg, placement_group_bundle_index=r)).remote(
                self.rollout_layout.to_json(), r, self.rendezvous, self.secret
            )
            for r in range(ROLLOUTS)
        ]
        self.plan = ray.get(self.refitter.connect.remote(TRAINERS, ROLLOUTS, args.timeout))
        rollout_blocks = ray.get([r.blocks.remote() for r in self.rollouts])
        self.boxes = check_boxes(self.trainer_blocks, rollout_blocks)
        self.model_bytes = sum(2 * math.prod(s) for s in self.shapes.values())
        print(
            f"driver: {TRAINERS} FSDP2 trainers (f32) on two nodes, {ROLLOUTS} rollout ranks (TP2, bf16) on a third; "
            f"plan {self.plan['fingerprint']} moves {self.plan['bytes']} bytes ({self.model_bytes} bytes of bf16 weights)",
            flush=True,
        )
        print(f"driver: rollout ranks on {ray.get([r.node.remote() for r in self.rollouts])}", flush=True)

    def start_trainers(self, restore):
        """Trainer actors in the training group's bundles, set up (from the
        checkpoint of step ``restore``) and joined. A node that dies
        meanwhile (Ray may not have found a lost node dead yet, and
        places an actor in its bundle) kills them all and they start
        again, until ``--timeout``."""
        strategy = [PlacementGroupSchedulingStrategy(self.train_pg, placement_group_bundle_index=r) for r in range(TRAINERS)]
        give_up = time.monotonic() + self.args.timeout
        while True:
            self.trainers = [
                Trainer.options(scheduling_strategy=strategy[r], **self.trainer_options).remote(r, self.size) for r in range(TRAINERS)
            ]
            try:
                master = ray.get(self.trainers[0].master.remote(), timeout=self.args.timeout)
                got = ray.get(
                    [t.setup.remote(master, self.rendezvous, self.secret, self.args.checkpoint, restore) for t in self.trainers],
                    timeout=self.args.timeout,
                )
                break
            except ray.exceptions.ActorDiedError as e:
                for t in self.trainers:
                    ray.kill(t, no_restart=True)
                if time.monotonic() > give_up:
                    raise
                print(f"driver: a trainer died starting ({str(e).splitlines()[0]}); starting both again", flush=True)
                time.sleep(1)
        print(f"driver: trainer ranks on {ray.get([t.node.remote() for t in self.trainers])}", flush=True)
        return got[0][0], got[0][1], [g[2] for g in got]

    def expected(self):
        """The trainers' digests of every checked part, by (trainer, rollout)."""
        keys = sorted(self.boxes)
        got = ray.get([self.trainers[t].digests.remote(self.boxes[(t, d)]) for t, d in keys])
        return dict(zip(keys, got))

    def served(self, version, expected):
        """Whether every rollout rank serves ``version`` and holds exactly
        the trainers' weights ``expected`` (each checked part): the wrong
        parts, as words."""
        serving = ray.get([r.serving.remote() for r in self.rollouts])
        wrong = [f"rollout rank {d} serves version {v}, not {version}" for d, v in enumerate(serving) if v != version]
        return wrong + self.differing(expected)

    def differing(self, expected):
        """The parts where a rollout rank's weights differ from the
        trainers' ``expected``, as words."""
        wrong = []
        keys = sorted(self.boxes)
        got = ray.get([self.rollouts[d].digests.remote(self.boxes[(t, d)]) for t, d in keys])
        for (t, d), have in zip(keys, got):
            for (name, box), a, b in zip(self.boxes[(t, d)], have, expected[(t, d)]):
                if a != b:
                    wrong.append(f"rollout rank {d}, {name} {box}: differs from trainer rank {t}'s")
        return wrong

    def replace_trainers(self, version):
        """Both trainers started again from the checkpoint of ``version``
        (the process group cannot outlive a lost rank), and put back in the
        orchestrator's group: the ranks ``recover`` put back."""
        for t in self.trainers:
            ray.kill(t, no_restart=True)
        self.start_trainers(restore=version)
        return ray.get(self.refitter.recover.remote(self.args.timeout))

    def close(self):
        ray.get(self.refitter.close.remote())
        for a in self.trainers + self.rollouts + [self.refitter]:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.train_pg)
        remove_placement_group(self.rollout_pg)


def refit_and_check(job, version, step, on_refit):
    """Refits ``version``; on a failure, checks the rollouts still serve the
    version before, replaces the trainers and refits again. The report;
    raises where a rollout rank holds a wrong element or the refit fails
    twice."""
    before = ray.get(job.rollouts[0].received_bytes.remote())
    pending = job.refitter.refit.remote(version)
    if on_refit is not None:
        on_refit(step, job.plan["bytes"])
    report = ray.get(pending)
    if "error" in report:
        print(f"step {step}: the refit of version {version} failed after {report['seconds']:.1f} s: {report['error']}", flush=True)
        if "refit.member.src." not in report["error"]:
            # A rollout rank lost is replaced by a new actor for its rank
            # and recover() (examples/ray_pipeline.py); not done here.
            raise RuntimeError(f"step {step}: the refit failed, not for a lost trainer: {report['error']}")
        if job.last_version is None:
            print(f"step {step}: no rollout rank served a version yet", flush=True)
        else:
            wrong = job.served(job.last_version, job.last_expected)
            if wrong:
                raise RuntimeError(f"after the failed refit: {wrong}")
            print(f"step {step}: every rollout rank still serves version {job.last_version}, every element the trainers'", flush=True)
        t = time.perf_counter()
        back = job.replace_trainers(version)
        print(
            f"step {step}: trainers started again from the checkpoint of version {version} and put back by recover(): {back} "
            f"({time.perf_counter() - t:.1f} s)",
            flush=True,
        )
        before = ray.get(job.rollouts[0].received_bytes.remote())
        report = ray.get(job.refitter.refit.remote(version))
        if "error" in report:
            raise RuntimeError(f"step {step}: the refit failed again: {report['error']}")
    received = ray.get(job.rollouts[0].received_bytes.remote()) - before
    ray.get([r.load.remote(version) for r in job.rollouts])
    expected = job.expected()
    wrong = job.served(version, expected)
    if wrong:
        raise RuntimeError(f"step {step}: {wrong[:5]}")
    job.last_version, job.last_expected = version, expected
    report["received"] = received
    return report


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="auto", help="the Ray cluster (default: the one this node belongs to)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--deadline", type=float, default=60.0, help="a refit's deadline, in seconds")
    p.add_argument("--timeout", type=float, default=300.0, help="for actors to start and join, in seconds")
    p.add_argument("--gloo-ifname", default=None, help="the network interface gloo uses on the trainer nodes")
    p.add_argument("--checkpoint", default=None, help="a directory every trainer node reaches (default: a new one under /tmp)")
    return p.parse_args(argv)


def main(argv=None, on_refit=None):
    """Runs the job; ``on_refit(step, plan_bytes)`` is called while each
    refit is in flight (python/tests/test_ray_cluster.py loses a node
    there)."""
    args = parse(argv)
    made = args.checkpoint is None
    if made:
        args.checkpoint = tempfile.mkdtemp(prefix="refit-ray-checkpoint-")
    ray.init(address=args.address, logging_level="ERROR")
    job = None
    try:
        job = Job(args)
        job.last_version, job.last_expected = None, None
        for step in range(1, args.steps + 1):
            got = ray.get([t.step.remote() for t in job.trainers])
            versions = {v for v, _ in got}
            if len(versions) != 1:
                raise RuntimeError(f"step {step}: the trainers disagree on the version: {got}")
            version = versions.pop()
            report = refit_and_check(job, version, step, on_refit)
            print(
                f"step {step}: loss {got[0][1]:.3f}; refit of version {version} in {report['seconds'] * 1e3:.0f} ms "
                f"({report['bytes']} bytes; the rollout node received {report['received']}); "
                f"every rollout element equals the trainers'",
                flush=True,
            )
        print(f"{args.steps} steps: every refit verified on every rollout rank", flush=True)
        return 0
    finally:
        if job is not None:
            job.close()
        ray.shutdown()
        if made:
            shutil.rmtree(args.checkpoint, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
