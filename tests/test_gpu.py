"""CUDA paths: the GPU must give the CPU's integers bit for bit (SPEC §6), run on the framework's
current stream, and return arrays on the caller's device. Skipped cleanly without a GPU."""
import math

import numpy as np
import pytest

import hot
import reference as R

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hot.cuda_available(), reason="no CUDA: " + hot.cuda_unavailable_reason())]

MAX_INT32_K = (2**31 - 1) // 127**2 // 16 * 16  # hot::kMaxInt32K: the longest exact int32 sum of 8-bit products


def _data(seed=0, L=96, O=48, I=40):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((L, O)).astype(np.float32), rng.standard_normal((O, I)).astype(np.float32),
            rng.standard_normal((L, I)).astype(np.float32))


def test_torch_cuda_matches_cpu_bit_exact_integers():
    torch = pytest.importorskip("torch")
    gy, w, x = _data()
    for rounding in ("nearest", "stochastic"):
        q_cpu, s_cpu = hot.quantize(gy, bits=4, rounding=rounding, seed=3)
        q_gpu, s_gpu = hot.quantize(torch.tensor(gy, device="cuda"), bits=4, rounding=rounding, seed=3)
        assert q_gpu.is_cuda and q_gpu.dtype == torch.int8
        np.testing.assert_array_equal(q_gpu.cpu().numpy(), q_cpu)
        np.testing.assert_array_equal(s_gpu.cpu().numpy(), s_cpu)
    s_cpu = hot.compress_activation(x)
    s_gpu = hot.compress_activation(torch.tensor(x, device="cuda"))
    np.testing.assert_array_equal(s_gpu.q.cpu().numpy(), s_cpu.q)
    a8 = np.random.default_rng(1).integers(-127, 128, (33, 70)).astype(np.int8)
    b8 = np.random.default_rng(2).integers(-127, 128, (17, 70)).astype(np.int8)
    c = hot.gemm_s8(torch.tensor(a8, device="cuda"), torch.tensor(b8, device="cuda"))
    np.testing.assert_array_equal(c.cpu().numpy(), a8.astype(np.int64) @ b8.astype(np.int64).T)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_torch_cuda_backward_matches_reference(dtype):
    torch = pytest.importorskip("torch")
    gy, w, x = _data()
    dt = getattr(torch, dtype)
    t = [torch.tensor(a, device="cuda", dtype=dt) for a in (gy, w, x)]
    gi, gw, gb = hot.backward_linear(*t, bias=True, config=hot.Config(rounding="nearest"), seed=2)
    for o in (gi, gw, gb):
        assert o.is_cuda and o.dtype == dt
    n = [a.double().cpu().numpy() for a in t]
    rx, rw, rb = R.backward_linear(*n, rounding="nearest", seed=2)
    tol = 1e-4 + {"float32": 2 ** -24, "float16": 2 ** -11, "bfloat16": 2 ** -8}[dtype]
    assert R.rel_err(gi.double().cpu().numpy(), rx) < tol
    assert R.rel_err(gw.double().cpu().numpy(), rw) < tol


def test_torch_cuda_backward_same_bits_as_cpu():
    torch = pytest.importorskip("torch")
    gy, w, x = _data()
    cpu = hot.backward_linear(gy, w, x, seed=5)
    gpu = hot.backward_linear(*(torch.tensor(a, device="cuda") for a in (gy, w, x)), seed=5)
    # same integers and scales: results agree up to the fp32 epilogue (one rounding)
    for c, g in zip(cpu[:2], gpu[:2]):
        np.testing.assert_allclose(g.cpu().numpy(), c, rtol=2 ** -22, atol=1e-30)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("source", ["raw_x", "saved"])
def test_torch_cuda_long_gw_same_as_cpu(dtype, source):
    """Past the int32 limit of one g_w GEMM the call is still one backward (SPEC §4, Long contractions): the GPU sums
    int32 slices of the contraction in int64 (the split-K route's summing pass), the CPU in int64 by blocks. Same
    integers, so the results agree up to the epilogues' float rounding."""
    torch = pytest.importorskip("torch")
    cfg = hot.Config(rank=16)
    L = 2 * MAX_INT32_K + 77  # three int32 slices at least
    rng = np.random.default_rng(9)
    gy, x = rng.standard_normal((L, 24), dtype=np.float32), rng.standard_normal((L, 40), dtype=np.float32)
    gy[5] *= 40  # an outlier row
    w = rng.standard_normal((24, 40), dtype=np.float32)
    dt = getattr(torch, dtype)
    t = [torch.tensor(a).to(dt) for a in (gy, w, x)]
    cpu_in = [a.float().numpy() if dtype == "float32" else a for a in t]
    gpu_in = [a.cuda() for a in t]
    if source == "saved":
        cpu_in[2], gpu_in[2] = hot.compress_activation(cpu_in[2], cfg), hot.compress_activation(gpu_in[2], cfg)
    cpu = hot.backward_linear(*cpu_in, bias=True, config=cfg, seed=77)
    gpu = hot.backward_linear(*gpu_in, bias=True, config=cfg, seed=77)
    tol = {"float32": 2 ** -20, "bfloat16": 2 ** -7}[dtype]
    for name, c, g in zip(("g_x", "g_w"), cpu, gpu):
        assert g.is_cuda and g.dtype == dt, name
        c = torch.as_tensor(c).double() if not isinstance(c, torch.Tensor) else c.double()
        g = g.double().cpu()
        assert torch.allclose(g, c, rtol=tol, atol=tol * c.abs().max().item()), (name, (g - c).abs().max().item())
    # g_b is a float sum of L values (no integers): CPU and GPU sum in different orders, so each is held to the float64
    # sum with the pairwise-summation bound ceil(log2 L) * u * sum|g_y| per column (u: the output's unit roundoff,
    # plus one rounding of the result); a dropped or repeated slice of rows is off by its whole sum, far outside it.
    gy64 = t[0].double()
    u = {"float32": 2 ** -24, "bfloat16": 2 ** -8}[dtype]
    bound = (math.ceil(math.log2(L)) * u * gy64.abs().sum(0) + u * gy64.sum(0).abs()) * 1.0001
    for where, gb in (("cpu", cpu[2]), ("cuda", gpu[2])):
        gb = torch.as_tensor(gb).double().cpu() if not isinstance(gb, torch.Tensor) else gb.double().cpu()
        err = (gb - gy64.sum(0)).abs()
        assert (err <= bound).all(), (where, (err / bound).max().item())


def test_torch_cuda_weight_reuse_same_bits():
    """hot.torch.weight_reuse on CUDA (bf16 autocast, three micro-batches): W~ formed once per layer, gradients
    bit-identical to forming it every call; hot.quantize_weight on the GPU gives the CPU's bytes."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import hot.torch as ht
    from hot.experiments import models

    torch.manual_seed(0)
    m = models.build("vit", dim=64, depth=2, heads=2, mlp=128)
    ht.convert(m, config=hot.Config(rounding="stochastic"))
    m = m.cuda()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 1, 8, 8, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda())
               for _ in range(3)]

    def grads(reuse):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        block = ht.weight_reuse()
        r = block.__enter__() if reuse else None
        for x, y in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(m(x), y)
            loss.backward()
        if reuse:
            block.__exit__(None, None, None)
        return {n: p.grad.clone() for n, p in m.named_parameters()}, r

    ref, _ = grads(False)
    got, r = grads(True)
    assert r.formed > 0 and r.reused == 2 * r.formed
    for n in ref:
        assert torch.equal(ref[n], got[n]), n
    w = torch.randn(96, 40, dtype=torch.bfloat16)
    a, b = hot.quantize_weight(w), hot.quantize_weight(w.cuda())
    assert torch.equal(torch.as_tensor(a.q_wt), b.q_wt.cpu()) and torch.equal(torch.as_tensor(a.s_w), b.s_w.cpu())


def test_torch_non_default_stream():
    torch = pytest.importorskip("torch")
    gy, w, x = _data(L=512, O=256, I=256)
    ref = hot.backward_linear(gy, w, x, seed=1)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = [torch.tensor(a, device="cuda") for a in (gy, w, x)]
        gi, gw, _ = hot.backward_linear(*t, seed=1)
        y = gi * 2  # consumed on the same stream without synchronisation
    s.synchronize()
    np.testing.assert_allclose(y.cpu().numpy(), 2 * ref[0], rtol=2 ** -22, atol=1e-30)
    np.testing.assert_allclose(gw.cpu().numpy(), ref[1], rtol=2 ** -22, atol=1e-30)


def test_torch_every_gpu_of_one_process():
    """One process, several GPUs (model parallel, nn.DataParallel): each device gets the same bits as the CPU,
    whichever device was used first (per-device kernel setup, e.g. the g_y pass's shared-memory attribute)."""
    torch = pytest.importorskip("torch")
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs 2 CUDA GPUs")
    gy, w, x = _data(L=200, O=64, I=48)
    cpu = hot.backward_linear(gy, w, x, seed=7)
    cpu_q = hot.compress_activation(x).q
    for d in list(range(n)) + [0]:
        dev = torch.device("cuda", d)
        t = [torch.tensor(a, device=dev) for a in (gy, w, x)]
        gi, gw, _ = hot.backward_linear(*t, seed=7)
        assert gi.device == dev and gw.device == dev
        np.testing.assert_allclose(gi.cpu().numpy(), cpu[0], rtol=2 ** -22, atol=1e-30)
        np.testing.assert_allclose(gw.cpu().numpy(), cpu[1], rtol=2 ** -22, atol=1e-30)
        np.testing.assert_array_equal(hot.compress_activation(t[2]).q.cpu().numpy(), cpu_q)


def test_torch_outputs_are_allocated_by_torch():
    """Outputs come from torch's allocator, so torch's memory accounting sees them."""
    torch = pytest.importorskip("torch")
    gy, w, x = (torch.tensor(a, device="cuda") for a in _data(L=1024, O=256, I=512))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    gi, gw, _ = hot.backward_linear(gy, w, x, need_grad_weight=True)
    assert torch.cuda.memory_allocated() - base >= gi.numel() * 4 + gw.numel() * 4


def test_cupy():
    cupy = pytest.importorskip("cupy")
    gy, w, x = _data()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        t = [cupy.asarray(a) for a in (gy, w, x)]
        gi, gw, gb = hot.backward_linear(*t, bias=True, seed=4)
    s.synchronize()
    assert isinstance(gi, cupy.ndarray) and gi.dtype == np.float32
    cpu = hot.backward_linear(gy, w, x, bias=True, seed=4)
    np.testing.assert_allclose(cupy.asnumpy(gi), cpu[0], rtol=2 ** -22, atol=1e-30)
    q = hot.pack_int4(cupy.asarray(np.array([[1, -2, 3, -8]], np.int8)))
    assert isinstance(q, cupy.ndarray) and q.dtype == np.uint8


def test_jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("no jax GPU")
    gy, w, x = _data()
    t = [jax.device_put(a, dev) for a in (gy, w, x)]
    gi, gw, _ = hot.backward_linear(*t, seed=4)
    assert isinstance(gi, jax.Array) and list(gi.devices())[0].platform == "gpu"
    cpu = hot.backward_linear(gy, w, x, seed=4)
    np.testing.assert_allclose(np.asarray(gi), cpu[0], rtol=2 ** -22, atol=1e-30)


def test_array_exported_to_another_stream_is_ordered():
    """A hot-allocated CUDA array handed to a consumer on another stream (DLPack's stream argument): the consumer's
    work waits for hot's writes. A large transform on hot's stream makes the window wide; the values must be the
    CPU's whatever the timing."""
    torch = pytest.importorskip("torch")
    from hot import _C

    x = np.random.default_rng(3).standard_normal((8192, 1024)).astype(np.float32)
    ref = hot.hadamard_transform(x, block=16)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    xt = torch.tensor(x, device="cuda")
    torch.cuda.synchronize()
    for _ in range(3):
        with torch.cuda.stream(producer):
            arr = _C.hadamard_transform(xt, None, 16, 1, 1, producer.cuda_stream)
        with torch.cuda.stream(consumer):
            t = torch.from_dlpack(arr)  # torch passes its current stream (consumer)
            got = t * 1
        consumer.synchronize()  # the consumer keeps the imported memory until its reads are done
        del t, arr
        np.testing.assert_array_equal(got.cpu().numpy(), ref)
    with torch.cuda.stream(producer):
        arr = _C.hadamard_transform(xt, None, 16, 1, 1, producer.cuda_stream)
    cap = arr.__dlpack__(stream=-1)  # no ordering asked: the consumer synchronises itself
    torch.cuda.synchronize()
    np.testing.assert_array_equal(torch.from_dlpack(cap).cpu().numpy(), ref)
