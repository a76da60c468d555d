"""One-shot and two-shot all-reduce on CUDA symmetric memory vs NCCL: correctness and time,
with what metainfer's cost model predicts beside each, on the GPUs at hand.

    torchrun --nproc-per-node 8 bench/bench_symm_mem_gpu.py --target pcie8

Needs several CUDA GPUs with peer-to-peer access (symmetric memory maps peers' buffers);
on a box without P2P it says so and stops, which is also why metainfer's select_collectives
never offers these algorithms there. For message sizes from 4 KiB to 64 MiB (bf16): checks
that torch.ops.symm_mem.one_shot_all_reduce and two_shot_all_reduce_ give NCCL's result
(bf16 tolerance), and prints the median time of each beside NCCL's and the cost model's
prediction for the target. Runs from the source tree with PYTHONPATH=. (torch >= 2.6).
"""

from __future__ import annotations

import argparse
import os

import torch

import torch.distributed as dist
from _cuda_timing import timed  # (bench/ is on sys.path as the script's folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="pcie8")
    a = ap.parse_args()
    if not torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise SystemExit("run under torchrun with at least 2 CUDA GPUs")
    from metainfer.hardware import cost, targets
    from metainfer.parallel import distributed

    t = targets.get(a.target)
    distributed.start(t)  # NCCL with the target's settings
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        raise SystemExit("this torch has no torch.distributed._symmetric_memory")
    group = dist.group.WORLD.group_name
    dev = torch.device("cuda", torch.cuda.current_device())
    peers_ok = all(torch.cuda.can_device_access_peer(dev.index, p) for p in range(torch.cuda.device_count())
                   if p != dev.index)
    if not peers_ok:
        if rank == 0:
            print("no P2P between these GPUs: symmetric memory cannot map peers; metainfer does not offer "
                  "one-shot/two-shot here")
        return
    sub = t if world == t.num_devices else distributed.emulated(t, world)
    rows = []
    for size in (4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20):
        n = size // 2
        buf = symm_mem.empty(n, dtype=torch.bfloat16, device=dev)
        symm_mem.rendezvous(buf, group)
        x = torch.randn(n, dtype=torch.bfloat16, device=dev, generator=torch.Generator(dev).manual_seed(rank))
        ref = x.clone()
        dist.all_reduce(ref)
        buf.copy_(x)
        one = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)
        buf.copy_(x)
        two = torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group).clone()
        biggest = x.abs().max().float()
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
        tol = 2 * world * 2.0 ** -8 * world * float(biggest)  # 2 n u sum_i |x_i| (docs/passes.md), sum <= n max
        ok = bool((one.float() - ref.float()).abs().max() <= tol and (two.float() - ref.float()).abs().max() <= tol)
        nccl_s = timed(lambda: dist.all_reduce(x))
        one_s = timed(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group))
        two_s = timed(lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group))
        pred = {alg: cost.collective_cost("all_reduce", size, sub, alg).seconds
                for alg in ("ring", "one_shot", "two_shot")}
        rows.append((size, ok, nccl_s, one_s, two_s, pred))
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}; cost model target {sub.name}; times in us (measured / predicted)")
        print("| size | correct | NCCL | one-shot | two-shot |")
        print("|---|---|---|---|---|")
        for size, ok, nccl_s, one_s, two_s, pred in rows:
            print(f"| {size >> 10} KiB | {'yes' if ok else 'NO'} | {nccl_s * 1e6:.1f} / {pred['ring'] * 1e6:.1f} | "
                  f"{one_s * 1e6:.1f} / {pred['one_shot'] * 1e6:.1f} | {two_s * 1e6:.1f} / {pred['two_shot'] * 1e6:.1f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
