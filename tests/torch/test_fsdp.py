"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over converted models: gloo with 2 CPU processes, NCCL with 2 GPUs
where there are two.

- A step's gradients (gathered from their shards) equal a single-process run with the same seeds. As under DDP, HOT
  quantises each rank's batch on its own (per-tensor scales over the local batch), so the reference computes each
  rank's shard with that rank's seed and averages the gradients.
- HOT's backward runs on the weight FSDP2 gathers for the layer's own backward: the test counts FSDP2's all-gathers
  in a step of the converted model and of the same model unconverted, and they are equal.
- The per-layer state that LQS / calibration / warm-up keep (the layers' ``_extra_state``) survives a
  ``torch.distributed.checkpoint`` round trip of the sharded model into a freshly built and sharded one (whose layers
  have no state yet: a sharded layer's state_dict always has the entry, so DCP fills it)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import spawn

from spawn import WORLD


def _fsdp_api():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return None
    return fully_shard


def _model(convert=True):
    import hot.torch as ht
    from hot.experiments import models

    torch.manual_seed(0)
    m = models.build("vit", dim=32, depth=2, heads=2, mlp=64)
    if convert:
        ht.convert(m)
    return m


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for blk in model.blocks if hasattr(model, "blocks") else []:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _count_all_gathers(model, xs, ys):
    """FSDP2 all-gathers (of parameter groups) in one forward + backward of model; None where this torch's FSDP2
    does not have the internal function counted (``foreach_all_gather`` of
    torch.distributed.fsdp._fully_shard._fsdp_param_group)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
    except ImportError:
        return None
    orig = getattr(pg, "foreach_all_gather", None)
    if orig is None:
        return None
    calls = []

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    pg.foreach_all_gather = counting
    try:
        F.cross_entropy(model(xs), ys).backward()
    finally:
        pg.foreach_all_gather = orig
    return len(calls)


def _worker(rank, port, out_dir, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    import hot
    import hot.torch as ht

    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    mesh = init_device_mesh(dev.type, (WORLD,))
    x, y = _data()
    xs, ys = x.chunk(WORLD)[rank].to(dev), y.chunk(WORLD)[rank].to(dev)

    # 1. gradients of one step
    model = _shard(_model().to(dev), mesh)
    torch.manual_seed(100 + rank)  # per-rank stochastic-rounding seeds
    F.cross_entropy(model(xs), ys).backward()
    grads = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}
    # the same step with the sharded model under torch.compile (aot_eager: torch's random draws, the eager seeds)
    model = _shard(_model().to(dev), mesh)
    torch.manual_seed(100 + rank)
    F.cross_entropy(torch.compile(model, backend="aot_eager")(xs), ys).backward()
    grads_compiled = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}

    # 2. all-gathers: converted vs unconverted
    n_hot = _count_all_gathers(_shard(_model().to(dev), mesh), xs, ys)
    n_exact = _count_all_gathers(_shard(_model(convert=False).to(dev), mesh), xs, ys)

    # 3. per-layer state through torch.distributed.checkpoint
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    src = _shard(_model().to(dev), mesh)
    layers = [m for m in src.modules() if isinstance(m, ht.Linear)]
    layers[0].set_lqs("token", 0.5, 0.25)
    layers[1].set_lqs("tensor", 0.125, 0.75)
    ckpt = os.path.join(out_dir, "ckpt")
    dcp.save(get_model_state_dict(src), checkpoint_id=ckpt)
    dst = _shard(_model().to(dev), mesh)
    sd = get_model_state_dict(dst)
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(dst, sd)
    dl = [m for m in dst.modules() if isinstance(m, ht.Linear)]
    restored = {
        "lqs": [m.hot_lqs for m in dl[:2]], "cfg": [str(m.hot_config) for m in dl[:2]],
        "src_cfg": [str(m.hot_config) for m in layers[:2]],
        "others_default": all(m.hot_config == hot.Config() and m.hot_lqs is None for m in dl[2:]),
        "weights_equal": all(torch.equal(a.full_tensor(), b.full_tensor())
                             for a, b in zip(src.parameters(), dst.parameters())),
    }
    if rank == 0:
        torch.save({"grads": grads, "grads_compiled": grads_compiled, "gathers": (n_hot, n_exact),
                    "restored": restored},
                   os.path.join(out_dir, "fsdp.pt"))
    del model
    spawn.finish(rank, out_dir)



def _run_and_check(backend, device):
    with tempfile.TemporaryDirectory() as d:
        spawn.run(_worker, d, backend)
        got = torch.load(os.path.join(d, "fsdp.pt"))
    model = _model().to(device)
    x, y = _data()
    acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for rank in range(WORLD):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + rank)
        F.cross_entropy(model(x.chunk(WORLD)[rank].to(device)), y.chunk(WORLD)[rank].to(device)).backward()
        for n, p in model.named_parameters():
            acc[n] += p.grad / WORLD
    assert set(got["grads"]) == set(acc)
    for n in acc:  # the same per-rank gradients, averaged by a reduce-scatter instead of a sum here
        torch.testing.assert_close(got["grads"][n], acc[n].cpu(), rtol=1e-6, atol=1e-7, msg=n)
        torch.testing.assert_close(got["grads_compiled"][n], acc[n].cpu(), rtol=1e-6, atol=1e-7, msg=n)
    n_hot, n_exact = got["gathers"]
    if n_exact is not None:  # None: this torch's FSDP2 internals differ from the counted function
        assert n_hot == n_exact > 0, f"all-gathers per step: converted {n_hot}, unconverted {n_exact}"
    r = got["restored"]
    assert r["lqs"] == [{"choice": "token", "e_tensor": 0.5, "e_token": 0.25},
                        {"choice": "tensor", "e_tensor": 0.125, "e_token": 0.75}]
    assert r["cfg"] == r["src_cfg"] and "token" in r["cfg"][0]
    assert r["others_default"] and r["weights_equal"]


def test_fsdp2_gloo_matches_single_process():
    if _fsdp_api() is None:
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not available in this torch")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    _run_and_check("gloo", "cpu")


def test_fsdp2_nccl_two_gpus_matches_single_process():
    import hot

    if _fsdp_api() is None:
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not available in this torch")
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and hot.cuda_available()):
        pytest.skip("needs 2 CUDA GPUs and hot's CUDA backend")
    if not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    _run_and_check("nccl", "cuda:0")


def test_sharded_entry_form_round_trips_every_kind_of_layer_state():
    """The JSON form a sharded layer's entry takes loads into the same state as the dict form, for calibration,
    LQS and warm-up state; its "null" (no state) leaves a layer's own state and configuration as they are."""
    import json

    import hot
    import hot.torch as ht

    m = _model()
    x, y = _data()
    ht.calibrate(m, (x, y), F.cross_entropy)
    m.blocks[0].attn.qkv.set_lqs("token", 0.5, 0.25)
    ht.Warmup(m, steps=3, config=hot.Config(rank=8))
    sd = m.state_dict()
    extra = {k: v for k, v in sd.items() if k.endswith("._extra_state")}
    assert extra and all(isinstance(v, dict) for v in extra.values())
    sd_json = {k: (json.dumps(v) if k in extra else v) for k, v in sd.items()}
    m2 = _model()
    m2.load_state_dict(sd_json, strict=True)
    for (n, a), (_, b) in zip(ht.hot_layers(m), ht.hot_layers(m2)):
        assert a.hot_config == b.hot_config, n
        assert a.hot_lqs == b.hot_lqs and a.hot_calibration == b.hot_calibration, n
        assert (a.hot_warmup is None) == (b.hot_warmup is None), n
        if a.hot_warmup is not None:
            assert a.hot_warmup["left"] == b.hot_warmup["left"] and a.hot_warmup["target"] == b.hot_warmup["target"]
    # "null": nothing changes
    before = [(l.hot_config, l.hot_lqs, l.hot_calibration) for _, l in ht.hot_layers(m2)]
    m2.load_state_dict({k: ("null" if k in extra else v) for k, v in sd.items()}, strict=True)
    assert before == [(l.hot_config, l.hot_lqs, l.hot_calibration) for _, l in ht.hot_layers(m2)]
    with pytest.raises(RuntimeError, match="not JSON"):
        m2.load_state_dict({k: ("{oops" if k in extra else v) for k, v in sd.items()}, strict=True)


def _attn_model():
    import hot.torch as ht

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0),
                            torch.nn.Flatten(), torch.nn.Linear(32 * 6, 5))
    ht.convert(m)  # the attention's in_proj child holds the module's own in_proj_weight / in_proj_bias
    return m


def _attn_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, 32, generator=g), torch.randint(0, 5, (8,), generator=g)


def _attn_worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _attn_model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = _attn_data()
    torch.manual_seed(100 + rank)
    F.cross_entropy(model(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank]).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, os.path.join(out_dir, "attn.pt"))
    spawn.finish(rank, out_dir)


def test_fsdp2_gloo_converted_multihead_attention():
    # hot.torch.MultiheadAttention shares its in-projection's parameters with a child layer: sharded by FSDP2, a
    # step's gradients equal the single-process ones (each rank's shard with its own seed, averaged)
    if _fsdp_api() is None:
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not available in this torch")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with tempfile.TemporaryDirectory() as d:
        spawn.run(_attn_worker, d)
        got = torch.load(os.path.join(d, "attn.pt"))
    model = _attn_model()
    x, y = _attn_data()
    acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for rank in range(WORLD):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + rank)
        F.cross_entropy(model(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank]).backward()
        for n, p in model.named_parameters():
            acc[n] += p.grad / WORLD
    assert set(got) == set(acc) and "0.self_attn.in_proj_weight" in acc
    for n in acc:
        torch.testing.assert_close(got[n], acc[n], rtol=1e-6, atol=1e-7, msg=n)
