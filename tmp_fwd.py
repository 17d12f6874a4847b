import sys, time, collections, gc, os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks"))
import torch, torchvision
import hot.torch as ht
dev = torch.device("cuda")
for mode in ("exact", "hot"):
    torch.manual_seed(0)
    m = torchvision.models.resnet50().to(dev).to(memory_format=torch.channels_last)
    if mode == "hot":
        ht.convert(m)
    x = torch.randn(128, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    acc = collections.defaultdict(float); cnt = collections.Counter(); st = {}
    def pre(mod, inp):
        st[id(mod)] = time.perf_counter()
    def post(mod, inp, out):
        acc[type(mod).__name__] += time.perf_counter() - st[id(mod)]; cnt[type(mod).__name__] += 1
    for mod in m.modules():
        if len(list(mod.children())) == 0:
            mod.register_forward_pre_hook(pre); mod.register_forward_hook(post)
    gc.disable()
    for it in range(8):
        if it == 3:
            acc.clear(); cnt.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x).float().sum()
        t1 = time.perf_counter()
        y.backward()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if it >= 3:
            print(mode, f"fwd enqueue {1e3*(t1-t0):.1f} bwd enqueue {1e3*(t2-t1):.1f} wait {1e3*(t3-t2):.1f} ms")
        m.zero_grad(set_to_none=True)
    gc.enable()
    for k in sorted(acc, key=lambda k: -acc[k]):
        print(f"  {mode} {k}: {1e3*acc[k]/5:.2f} ms per fwd, {cnt[k]//5} calls, {1e6*acc[k]/cnt[k]:.1f} us per call")
