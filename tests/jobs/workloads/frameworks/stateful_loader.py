"""A dataloader whose workers hold state: torchdata's ``StatefulDataLoader`` over an iterable dataset, two worker
processes per rank, each with its own generator and sample count (the dataset's ``state_dict``). Every step also
digests the loader's ``state_dict()`` (the workers' states as they last reported them), so a restored worker that
lost or repeated anything shows. DDP on gloo. It knows nothing of Cryosleep.

Usage (under torchrun or cryosleep run): stateful_loader.py --steps N [--step-sleep S] [--hold FILE] [--hold-at K]
"""

import argparse
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from _steplog import add_pace_args, log_step
from torch.nn.parallel import DistributedDataParallel as DDP
from torchdata.stateful_dataloader import StatefulDataLoader


class Stream(torch.utils.data.IterableDataset[torch.Tensor]):
    """An endless stream of samples, a different one per rank and worker; its state moves on with every sample."""

    def __init__(self, rank: int) -> None:
        self.rank, self.count, self.gen = rank, 0, torch.Generator()

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        if self.count == 0:
            self.gen.manual_seed(1000 * self.rank + (info.id if info else 0))
        while True:
            self.count += 1
            yield torch.randn(16, generator=self.gen)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.count = sd["count"]
        self.gen.set_state(sd["gen"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    add_pace_args(p)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    loader = StatefulDataLoader(Stream(rank), batch_size=8, num_workers=2)
    batches = iter(loader)
    for step in range(args.steps):
        x = next(batches)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
        log_step(step, loss, ddp.parameters(), args, extra=loader.state_dict())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
