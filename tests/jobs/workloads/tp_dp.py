"""A transformer with tensor parallelism inside a node and data parallelism across nodes, in plain PyTorch
(process groups from ``new_group``; Megatron-style column- and row-parallel linears). It knows nothing of
Cryosleep. Prints ``step N loss HEX`` per step so runs can be compared bit for bit.

Ranks ``d*TP .. d*TP+TP-1`` form data-parallel replica ``d`` (one node each when ``--tp`` is the number of
ranks per node); rank ``d*TP+t`` holds shard ``t`` of every parallel weight. Each replica reads its own batches;
gradients are averaged across replicas, shard by shard, over the data-parallel groups.

Usage (under torchrun or cryosleep run): tp_dp.py --steps N [--step-sleep S] [--tp K] [--device cpu|cuda]
[--device-from-rank] [--d-model D] [--layers L] [--mem-gib G] [--linger FILE] [--until FILE]. On CPU it uses
gloo, on CUDA NCCL; ``--mem-gib`` keeps that much extra device memory per rank (a full node's worth, 60 to 70 GiB,
on H200s).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _Copy(torch.autograd.Function):
    """Into the tensor-parallel region: identity forward, gradients summed over the group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):
    """Out of the tensor-parallel region: partial sums added over the group forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def shard(full: torch.Tensor, dim: int, tp: int, t: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(full.chunk(tp, dim=dim)[t].clone())


class Block(torch.nn.Module):
    """Attention and MLP; heads and the MLP's hidden units split over the tensor-parallel ranks."""

    def __init__(self, d: int, heads: int, tp: int, t: int, group: Any, gen: torch.Generator) -> None:
        super().__init__()
        self.heads, self.tp, self.group = heads // tp, tp, group
        init = lambda *shape: torch.randn(*shape, generator=gen) * 0.02  # noqa: E731 - the same on every rank
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv = shard(init(3, d, d), 2, tp, t)  # column-parallel: q, k and v of this rank's heads
        self.proj = shard(init(d, d), 0, tp, t)  # row-parallel
        self.fc1 = shard(init(d, 4 * d), 1, tp, t)
        self.fc2 = shard(init(4 * d, d), 0, tp, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = _Copy.apply(self.ln1(x), self.group)
        q, k, v = (torch.einsum("bsd,de->bse", h, w).view(b, s, self.heads, -1).transpose(1, 2)
                   for w in self.qkv)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + _Reduce.apply(a @ self.proj, self.group)
        h = _Copy.apply(self.ln2(x), self.group)
        return x + _Reduce.apply(F.gelu(h @ self.fc1) @ self.fc2, self.group)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel ranks per replica (default: LOCAL_WORLD_SIZE)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--device-from-rank", action="store_true",
                   help="use GPU RANK instead of LOCAL_RANK (simulated nodes sharing one machine's GPUs)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--mem-gib", type=float, default=0.0)
    p.add_argument("--linger", default="", help="after the last step, wait for this file before ending")
    p.add_argument("--until", default="",
                   help="end after the step at which this file exists (rank 0 looks, every rank ends there)")
    args = p.parse_args()

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    tp = args.tp or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    assert world % tp == 0 and args.heads % tp == 0, "--tp must divide the world and the heads"
    dp, d_rank, t = world // tp, rank // tp, rank % tp
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        local = int(os.environ["RANK" if args.device_from_rank else "LOCAL_RANK"])
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    # every rank creates every group, in one order
    tp_groups = [dist.new_group([r * tp + i for i in range(tp)]) for r in range(dp)]
    dp_groups = [dist.new_group([r * tp + i for r in range(dp)]) for i in range(tp)]
    tp_group, dp_group = tp_groups[d_rank], dp_groups[t]

    gen = torch.Generator().manual_seed(1234)
    d = args.d_model
    embed = torch.nn.Embedding(args.vocab, d)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(args.vocab, d, generator=gen) * 0.02)
    blocks = torch.nn.ModuleList(Block(d, args.heads, tp, t, tp_group, gen) for _ in range(args.layers))
    norm, head = torch.nn.LayerNorm(d), torch.nn.Linear(d, args.vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(args.vocab, d, generator=gen) * 0.02)
    model = torch.nn.ModuleList([embed, blocks, norm, head]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ballast = torch.ones(int(args.mem_gib * 2**28), device=dev) if args.mem_gib else None
    data = torch.Generator().manual_seed(100 + d_rank)  # one stream per replica, the same on its TP ranks
    for step in range(args.steps):
        tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=data).to(dev)
        x = embed(tokens[:, :-1])
        for blk in blocks:
            x = blk(x)
        loss = F.cross_entropy(head(norm(x)).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        for prm in model.parameters():  # data parallel: average each shard's gradient over the replicas
            assert prm.grad is not None
            dist.all_reduce(prm.grad, group=dp_group)
            prm.grad.div_(dp)
        opt.step()
        if ballast is not None:
            ballast.mul_(1.0)
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)  # the mean loss over replicas: equal on every rank
        print(f"step {step} loss {(total / dp).item().hex()}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.until:  # one more collective per step, on the world: it changes no loss
            flag = torch.tensor([float(rank == 0 and os.path.exists(args.until))], device=dev)
            dist.all_reduce(flag)
            if flag.item():
                break
    while args.linger and not os.path.exists(args.linger):
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    print(f"done rank {rank}", flush=True)


if __name__ == "__main__":
    main()
