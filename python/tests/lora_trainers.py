"""FSDP2 trainers of a PEFT LoRA adapter, in processes of their own (gloo
on the CPU), for the tests and the benchmark of LoRA refits into vLLM
(python/tests/test_vllm_lora.py, benchmarks/vllm_lora.py). Not a test
module (pytest collects nothing here).

Each trainer builds the same Qwen2 policy from a config (random weights,
nothing downloaded; rank 0 saves it as the engine's base checkpoint), adds
a PEFT LoRA adapter on every linear module, shards the model with FSDP2
over the trainers and joins the orchestrator with the adapter's FSDP2
shards as its source (``refit.lora.adapter_parameters``, registered in
place). The driver sends each trainer, by pipe:

- ``("step",)``: one Adam step of the adapter on next-token loss over a
  fixed corpus (each rank its half of the batch); answers the version.
- ``("tear",)``: an optimizer step that fails on this rank (no forward:
  the step fails before it starts), tearing its shards until its next
  step; answers the version.
- ``("save", dir)``: the adapter gathered whole and written by PEFT's own
  ``save_pretrained`` (rank 0), as a user would hand it to vLLM; answers
  the seconds it took.
- ``None``: leave.
"""

import socket
import time

import torch
import torch.multiprocessing as mp

import refit
import refit.lora

TRAINERS = 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def policy_config(hidden=128, layers=2, vocab=300):
    """A Qwen2 config (``hidden`` 128: head_dim 32, the smallest vLLM's
    CPU attention takes)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def _trainer(rank, port, base, size, rank_r, address, secret, conn):
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TRAINERS)
    torch.manual_seed(0)  # every rank builds the same policy and adapter
    config = policy_config(**size)
    model = Qwen2ForCausalLM(config)
    if rank == 0:
        model.save_pretrained(base)
    lora = LoraConfig(r=rank_r, lora_alpha=2 * rank_r, target_modules=TARGETS, lora_dropout=0.0)
    model = get_peft_model(model, lora)
    mesh = init_device_mesh("cpu", (TRAINERS,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # The adapter's FSDP2 shards (Shard(0) DTensors), named as PEFT saves them.
    params = refit.lora.adapter_parameters(model)
    layout = refit.layout_from_dtensors(params)
    src = refit.Source.in_place(layout, rank, refit.param_buffers(layout, rank, params))
    src.join(address, secret)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    corpus = torch.randint(1, config.vocab_size, (2 * TRAINERS, 24), generator=torch.Generator().manual_seed(3))
    conn.send((layout.to_json(), refit.lora.adapter_config(model.peft_config["default"])) if rank == 0 else None)

    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "step":
            batch = corpus[rank::TRAINERS]
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            with src.stepping():  # the version fence: no refit reads the shards mid-step
                optimizer.step()
            optimizer.zero_grad()
            conn.send(src.version)
        elif msg[0] == "tear":
            try:
                with src.stepping():
                    raise RuntimeError("the optimizer step failed")
            except RuntimeError:
                pass  # this rank's shards are torn until its next step
            conn.send(src.version)
        elif msg[0] == "save":
            t = time.perf_counter()
            whole = {n: p.full_tensor() for n, p in model.named_parameters() if ".lora_" in n}
            if rank == 0:
                model.save_pretrained(msg[1], state_dict=whole)
            dist.barrier()
            conn.send(time.perf_counter() - t)
    src.wait_closed(0)
    dist.destroy_process_group()


class Trainers:
    """TRAINERS trainer processes joined to ``orch`` (rank 0 saving the
    base checkpoint to ``base``): ``layout`` and ``config`` are the
    adapter's training layout and PEFT config."""

    def __init__(self, orch, base, size=None, rank_r=8):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for rank in range(TRAINERS):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_trainer, args=(rank, port, base, size or {}, rank_r, orch.address, orch.secret, there), daemon=True)
            p.start()
            self.pipes.append(here)
            self.procs.append(p)
        layout, self.config = self.pipes[0].recv()
        self.layout = refit.Layout.from_json(layout)
        self.pipes[1].recv()

    def ask(self, *msg):
        """``msg`` to every trainer: their answers."""
        for pipe in self.pipes:
            pipe.send(msg)
        return [pipe.recv() for pipe in self.pipes]

    def step(self):
        versions = set(self.ask("step"))
        assert len(versions) == 1, versions
        return versions.pop()

    def save(self, path):
        """The adapter saved by PEFT to ``path``: the slowest rank's seconds."""
        return max(self.ask("save", str(path)))

    def tear(self, rank):
        """Every rank steps, then ``rank``'s next step fails: the version
        the others hold (which ``rank`` can no longer give)."""
        version = self.step()
        self.pipes[rank].send(("tear",))
        self.pipes[rank].recv()
        return version

    def close(self):
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
