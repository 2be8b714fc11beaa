"""What every framework workload prints once per optimizer step, so runs compare bit for bit:
``step N loss <loss as float hex>/<digest>``, the digest a SHA-256 prefix of this rank's parameters (their local
shards, for DTensors) and of anything else the step's state holds (``extra``: a dataloader's state, say).
It is imported from the script's own directory (on ``sys.path`` under torchrun and ``cryosleep run`` alike).

The pace options (``add_pace_args``) change no loss: ``--step-sleep`` slows each step, ``--hold FILE`` makes each
rank wait after step ``--hold-at`` until FILE exists, so that a test can snapshot the job while it is still
training however slow the machine is."""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Iterable
from typing import Any

import torch


def _feed(h: Any, obj: object) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if hasattr(t, "to_local"):  # a DTensor: this rank's shard
            t = t.to_local()
        h.update(t.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _feed(h, obj[k])
    elif isinstance(obj, list | tuple):
        for x in obj:
            _feed(h, x)
    else:
        h.update(repr(obj).encode())


def add_pace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--hold", default="", help="after step --hold-at, wait until this file exists")
    p.add_argument("--hold-at", type=int, default=10)


def log_step(step: int, loss: torch.Tensor | float, params: Iterable[torch.Tensor], pace: argparse.Namespace,
             extra: object = None) -> None:
    if isinstance(loss, torch.Tensor):
        loss = loss.detach().item()
    h = hashlib.sha256()
    for p in params:
        _feed(h, p)
    _feed(h, extra)
    print(f"step {step} loss {loss.hex()}/{h.hexdigest()[:16]}", flush=True)
    if pace.step_sleep:
        time.sleep(pace.step_sleep)
    while step == pace.hold_at and pace.hold and not os.path.exists(pace.hold):
        time.sleep(0.05)
