"""CPU backend: HOT backward of one linear layer against the exact backward (numpy fp32 GEMMs, and
hot's own exact mode) measured in the same run. Default shape: a ViT-B fc1 layer at batch 16
(L = 3152, O = 3072, I = 768), the size the engine-core issue asks to finish well under 10 s.

Usage: python benchmarks/bench_cpu_backward.py [--L 3152 --O 3072 --I 768 --repeat 3 --threads 0]
"""
import argparse
import os
import platform
import statistics
import time

import numpy as np

import hot


def timed(fn, repeat):
    fn()  # warm-up
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=3152)
    ap.add_argument("--O", type=int, default=3072)
    ap.add_argument("--I", type=int, default=768)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    hot.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.L, a.I), dtype=np.float32)
    w = (rng.standard_normal((a.O, a.I), dtype=np.float32) * 0.02).astype(np.float32)
    gy = rng.standard_normal((a.L, a.O), dtype=np.float32)

    saved = hot.compress_activation(x)
    t_compress = timed(lambda: hot.compress_activation(x), a.repeat)
    t_hot = timed(lambda: hot.backward_linear(gy, w, saved, bias=True, seed=1), a.repeat)
    t_hot_exact = timed(lambda: hot.backward_linear(gy, w, x, bias=True, config=hot.Config(exact=True)), a.repeat)
    t_numpy = timed(lambda: (gy @ w, gy.T @ x, gy.sum(0)), a.repeat)

    print(f"# CPU backward, L={a.L} O={a.O} I={a.I}, {hot.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, numpy {np.__version__}")
    print("| what | median s |")
    print("|---|---|")
    print(f"| hot compress_activation (forward-side ABC) | {t_compress:.3f} |")
    c = hot.Config()
    print(f"| hot backward_linear (HOT at hot.Config(): g_x {c.gx_bits}-bit, g_w rank {c.rank}, g_b) | {t_hot:.3f} |")
    print(f"| hot backward_linear exact mode (fp32) | {t_hot_exact:.3f} |")
    print(f"| numpy fp32 exact backward (BLAS) | {t_numpy:.3f} |")
    print(f"\nsaved bytes: {saved.nbytes} (fp32 x: {x.nbytes}, ratio {x.nbytes / saved.nbytes:.2f})")


if __name__ == "__main__":
    main()
