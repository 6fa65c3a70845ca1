"""Plain data-parallel training with torch DDP, as its users write it: run by torchrun, one
process per host, gloo on CPU (NCCL on CUDA).

    torchrun --nnodes 2 --node-rank I --nproc-per-node 1 --master-addr A --master-port P \\
        benchmarks/_ddp_train.py RECIPE [key=value ...] --out FILE.json

It reads pd's recipe only for what both must share: the model (built as `pd compile` builds
it: `train.seed`, then the model's factory, so both start from the same weights), the data
stream (minibatch k is a pure function of `data.seed` and k; rank r trains rows
[r B/W, (r+1) B/W) of it), the optimizer and the loss. One optimizer step per minibatch of
`data.batch_size` rows; DDP averages the ranks' gradients with its bucketed all-reduce during
the backward. Rank 0 evaluates on the held-out split every `--eval-every` minibatches (the
minibatches pd's evaluation reads) and writes the run's record: a timestamp per step, the
evaluations, and the loop's time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", required=True, help="the run's record (JSON), written by rank 0")
    parser.add_argument("--eval-every", type=int, default=0, help="minibatches between evaluations (0: never)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()

    from pdcli.config import load_config
    from pdcli.data.registry import build_data, num_eval_batches
    from pdcli.models import build_model
    from pdcli.models.loss import build_loss, logits_of, num_correct
    from pdcli.torchutil.optim import build_optimizer

    cfg = load_config(args.recipe, args.overrides).config
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(cfg.train.seed)  # as `pd compile` builds the model: the same initial weights
    model = build_model(cfg.model).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = build_optimizer(cfg.optim, ddp)
    loss_fn = build_loss(cfg.model.loss)
    data = build_data(cfg.data, cfg.data.batch_size)
    held_out = build_data(cfg.data, cfg.data.batch_size, split="eval") if args.eval_every and rank == 0 else None
    rows = cfg.data.batch_size // world

    def evaluate() -> float:
        assert held_out is not None
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for k in range(num_eval_batches(held_out, cfg.train.eval_batches)):
                batch = held_out.batch(k)
                logits = logits_of(model(*(x.to(device) for x in batch.inputs)))
                correct += num_correct(logits, batch.target.to(device))
                total += batch.target.numel()
        model.train()
        return correct / max(total, 1)

    step_times, losses, evals = [], [], []
    dist.barrier()
    start = time.time()
    for step in range(cfg.train.steps):
        batch = data.batch(step)
        inputs = [x[rank * rows:(rank + 1) * rows].to(device) for x in batch.inputs]
        target = batch.target[rank * rows:(rank + 1) * rows].to(device)
        loss = loss_fn(logits_of(ddp(*inputs)), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step_times.append(time.time())
        losses.append(loss.item())
        if held_out is not None and (step + 1) % args.eval_every == 0:
            evals.append({"step": step + 1, "time": time.time(), "eval_accuracy": evaluate()})
    loop_s = time.time() - start
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "start_time": start, "step_times": step_times, "losses": losses, "evals": evals, "loop_s": loop_s,
            "samples_per_s": cfg.data.batch_size * cfg.train.steps / loop_s, "world_size": world,
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
