"""Hugging Face ``transformers``' ``Trainer`` on CPU, DDP over gloo: a tiny GPT-2 built from a config (random
weights, a 64-token vocabulary: nothing is downloaded), synthetic token data made here, two DataLoader worker
processes per rank, AdamW with a linear schedule and dropout on. Several epochs, so the workers are started anew
while the job runs. It knows nothing of Cryosleep; only a ``training_step`` override prints each step's loss
and a digest of the parameters (as they are before that step's update).

Usage (under torchrun or cryosleep run): hf_trainer.py --steps N --workdir DIR [--step-sleep S] [--hold FILE]
[--hold-at K]
"""

import argparse
from typing import Any

import torch
from _steplog import add_pace_args, log_step
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.data = torch.randint(vocab, (n, seq), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class LoggingTrainer(Trainer):
    pace = argparse.Namespace(step_sleep=0.0, hold="", hold_at=0)

    def training_step(self, model: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        before = [p.detach().clone() for p in model.parameters()]
        loss: torch.Tensor = super().training_step(model, *args, **kwargs)
        log_step(self.state.global_step, loss, before, self.pace)
        return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    add_pace_args(p)
    p.add_argument("--workdir", required=True, help="the Trainer's output_dir (it saves nothing there)")
    args = p.parse_args()

    targs = TrainingArguments(
        output_dir=args.workdir, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-3,
        lr_scheduler_type="linear", warmup_steps=2, seed=0, use_cpu=True, ddp_backend="gloo",
        dataloader_num_workers=2, save_strategy="no", eval_strategy="no", logging_strategy="no",
        report_to="none", disable_tqdm=True)
    set_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    trainer = LoggingTrainer(model=model, args=targs, train_dataset=Tokens(48, 16, config.vocab_size))
    trainer.pace = args
    trainer.train()


if __name__ == "__main__":
    main()
