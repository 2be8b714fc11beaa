"""PyTorch Lightning's ``Trainer`` with its DDP strategy on CPU, 2 devices. Under torchrun (or cryosleep run)
Lightning detects torchelastic's environment and uses the launcher's processes: it must not spawn its own (the
script checks that its rank and world are the launcher's). A small regression model, a DataLoader with two worker
processes, AdamW. It knows nothing of Cryosleep; its ``training_step`` prints each step's loss and a digest of the
parameters (as they are before that step's update).

Usage (under torchrun or cryosleep run): lightning_ddp.py --steps N --workdir DIR [--step-sleep S] [--hold FILE]
[--hold-at K]
"""

import argparse
import os

import pytorch_lightning as pl
import torch
from _steplog import add_pace_args, log_step


class Regression(pl.LightningModule):
    def __init__(self, pace: argparse.Namespace) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(64, 1))
        self.pace = pace

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        log_step(self.global_step, loss, self.parameters(), self.pace)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    add_pace_args(p)
    p.add_argument("--workdir", required=True, help="Lightning's default_root_dir (it saves nothing there)")
    args = p.parse_args()

    pl.seed_everything(0, workers=True)
    x = torch.randn(96, 16, generator=torch.Generator().manual_seed(7))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, num_workers=2)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps,
                         default_root_dir=args.workdir, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(Regression(args), loader)
    # Lightning took the launcher's processes rather than starting its own
    assert (trainer.global_rank, trainer.world_size) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    print(f"lightning rank {trainer.global_rank} of {trainer.world_size}", flush=True)


if __name__ == "__main__":
    main()
