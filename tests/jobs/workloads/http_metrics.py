"""2-rank gloo DDP that POSTs one metric per step to an HTTP server outside the job, over one persistent
connection (http.client, keep-alive), reconnecting on any error and saying so, as metrics clients do.

Usage (under torchrun or cryosleep run): http_metrics.py --url http://HOST:PORT/PATH --steps N [--step-sleep S]
Prints "step N loss HEX" per step, and "metrics reconnect at step N after ERROR" each time it reconnects.
"""

import argparse
import http.client
import json
import os
import time
import urllib.parse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Metrics:
    def __init__(self, url: str) -> None:
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.path = u.hostname or "127.0.0.1", u.port or 80, u.path or "/"
        self.conn: http.client.HTTPConnection | None = None

    def post(self, body: dict, step: int) -> None:
        data = json.dumps(body).encode()
        for attempt in range(12):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
            try:
                self.conn.request("POST", self.path, body=data, headers={"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                resp.read()
                if resp.status != 200:
                    raise http.client.HTTPException(f"HTTP status {resp.status}")
                return
            except (OSError, http.client.HTTPException) as e:
                print(f"metrics reconnect at step {step} after {type(e).__name__}: {e}", flush=True)
                self.conn.close()
                self.conn = None
                time.sleep(min(0.05 * 2**attempt, 1.0))
        raise SystemExit(f"the metrics server {self.host}:{self.port} did not answer at step {step}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    metrics = Metrics(args.url)
    for step in range(args.steps):
        x = torch.randn(16, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item().hex()}", flush=True)
        metrics.post({"rank": rank, "step": step, "loss": loss.item(), "pid": os.getpid()}, step)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    dist.barrier()
    dist.destroy_process_group()
    print(f"done rank {rank}", flush=True)


if __name__ == "__main__":
    main()
