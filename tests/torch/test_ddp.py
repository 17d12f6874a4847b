"""DistributedDataParallel (gloo with 2 CPU processes; NCCL with 2 GPUs where there are two): gradients
equal a single-process run with the same seeds. HOT quantises each rank's batch on its own (per-tensor scales over the local batch), so
the single-process reference computes each rank's shard with that rank's seed and averages them."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import spawn

from spawn import WORLD


def _model():
    import hot.torch as ht
    from hot.experiments import models

    torch.manual_seed(0)
    m = models.build("vit", dim=32, depth=1, heads=2, mlp=64)
    ht.convert(m)
    return m


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)


def _worker(rank, port, out_dir, backend="gloo", compiled=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    model = _model().to(dev)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if dev.type == "cuda" else None)
    if compiled and torch.__version__ < "2.11":
        # torch 2.4's DDPOptimizer (the graph split at DDP's buckets) refused the layers' traced autograd.Functions
        # (higher-order ops); 2.11 and 2.13 split around them. README: the same switch for users of older releases.
        torch._dynamo.config.optimize_ddp = False
    run = torch.compile(model, backend="aot_eager") if compiled else model
    x, y = _data()
    xs, ys = x.chunk(WORLD)[rank].to(dev), y.chunk(WORLD)[rank].to(dev)
    torch.manual_seed(100 + rank)  # per-rank stochastic-rounding seeds
    F.cross_entropy(run(xs), ys).backward()
    if rank == 0:
        torch.save({n: p.grad.cpu() for n, p in model.module.named_parameters()}, os.path.join(out_dir, "ddp.pt"))
    del model
    spawn.finish(rank, out_dir)



def _run_and_compare(backend, device, compiled=False):
    with tempfile.TemporaryDirectory() as d:
        spawn.run(_worker, d, backend, compiled)
        ddp = torch.load(os.path.join(d, "ddp.pt"))
    model = _model().to(device)
    x, y = _data()
    acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for rank in range(WORLD):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + rank)
        F.cross_entropy(model(x.chunk(WORLD)[rank].to(device)), y.chunk(WORLD)[rank].to(device)).backward()
        for n, p in model.named_parameters():
            acc[n] += p.grad / WORLD
    for n in acc:
        torch.testing.assert_close(ddp[n], acc[n].cpu(), rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ddp_matches_single_process(compiled):
    """compiled: DDP's model under torch.compile (aot_eager: the same torch random draws as eager; DDP splits the
    graph at its gradient buckets), against the eager single-process reference."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    _run_and_compare("gloo", "cpu", compiled)


def test_ddp_nccl_two_gpus_matches_single_process():
    import hot

    if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and hot.cuda_available()):
        pytest.skip("needs 2 CUDA GPUs and hot's CUDA backend")
    if not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    _run_and_compare("nccl", "cuda:0")
