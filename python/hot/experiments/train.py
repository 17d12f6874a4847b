"""The digits task and the training loop that the demo, parity runs and gradient-noise studies share: a fixed
80/20 split of scikit-learn's digits, and ``train`` (AdamW, one-cycle, optional autocast), which measures accuracy,
bytes kept for backward, peak memory and step time."""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional


def load_digits(device, seed: int = 0):
    """(x_train, y_train, x_test, y_test): digits as N x 1 x 8 x 8 float32, standardised; a fixed 80/20
    split (stratified by a seeded permutation)."""
    import numpy as np
    import torch

    try:
        from sklearn.datasets import load_digits as _load
    except ImportError:
        raise ImportError("the digits task needs scikit-learn, which is not installed: pip install scikit-learn "
                          "(or pip install 'hot[demo]')") from None

    d = _load()
    x = d.images.astype(np.float32) / 16.0
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(x))
    n_test = len(x) // 5
    te, tr = perm[:n_test], perm[n_test:]
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return t(x[tr][:, None]), t(y[tr]), t(x[te][:, None]), t(y[te])


class SavedBytes:
    """Counts the bytes of every tensor autograd keeps for the backward pass (saved_tensors_hooks),
    parameters excluded, each storage once."""

    def __init__(self, model) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen = {}

    def pack(self, t):
        import torch

        if isinstance(t, torch.Tensor):
            try:
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr not in self.params and ptr not in self.seen:
                    self.seen[ptr] = st.nbytes()
            except (RuntimeError, NotImplementedError):
                pass
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _rss_kib(field_name: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Return freed heap memory to the OS (glibc malloc_trim) and reset the process's peak RSS (VmHWM)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class RunResult:
    name: str
    accuracy: float = 0.0
    kept_bytes: int = 0
    peak_bytes: Optional[int] = None
    peak_kind: str = ""
    step_ms: float = 0.0
    layer_bytes: Optional[tuple] = None  # (HOT, exact) bytes kept by the converted layers for their inputs
    losses: list = field(default_factory=list)


def train(model, data, steps: int, batch: int, lr: float, seed: int, device, amp: str = "off", progress=None,
          measure: bool = True, on_step=None) -> RunResult:
    """Train ``model`` with AdamW + one-cycle schedule for ``steps`` steps; returns accuracy and measurements.

    ``on_step``: called as ``on_step(step)`` after every optimizer step (and its scheduler step), step = 0 ..
    steps-1; e.g. to advance a warm-up schedule. It does not change the training otherwise."""
    import torch
    import torch.nn.functional as F

    xtr, ytr, xte, yte = data
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    dev_type = torch.device(device).type
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    scaler = torch.amp.GradScaler(dev_type, enabled=(amp == "fp16"))
    res = RunResult(name="")
    times = []
    perm = torch.randperm(len(xtr), generator=g)
    pos = 0
    model.train()
    for step in range(steps):
        if pos + batch > len(xtr):
            perm = torch.randperm(len(xtr), generator=g)
            pos = 0
        idx = perm[pos:pos + batch].to(xtr.device)
        pos += batch
        xb, yb = xtr[idx], ytr[idx]
        meas = measure and step == steps // 2
        if dev_type == "cuda":
            torch.cuda.synchronize()
            if meas:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
        elif meas:
            ok = _reset_peak_rss()
            base_rss = _rss_kib("VmRSS")
        t0 = time.perf_counter()
        counter = SavedBytes(model) if meas else None
        hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack) if meas else \
            contextlib.nullcontext()
        ac = torch.autocast(dev_type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
        with hooks, ac:
            loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        if dev_type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if meas:
            res.kept_bytes = counter.total
            if dev_type == "cuda":
                res.peak_bytes = torch.cuda.max_memory_allocated() - base
                res.peak_kind = "peak GPU memory above the model (torch allocator)"
            elif ok and base_rss is not None:
                hwm = _rss_kib("VmHWM")
                res.peak_bytes = max(0, (hwm - base_rss)) * 1024 if hwm is not None else None
                res.peak_kind = "peak RSS rise during one step (CPU; approximate)"
        res.losses.append(float(loss.detach()))
        if on_step is not None:  # outside the timed region
            on_step(step)
        if progress is not None:
            progress.update(1)
            if step % 10 == 0:
                progress.set_postfix(loss=f"{res.losses[-1]:.3f}")
    res.step_ms = 1e3 * statistics.median(times[min(10, len(times) // 4):])
    try:
        from hot.torch.summary import summary_rows

        rows = summary_rows(model)
        if rows and all(r["unit"] == "batch" for r in rows):
            res.layer_bytes = (sum(r["hot_bytes"] for r in rows), sum(r["exact_bytes"] for r in rows))
    except ImportError:
        pass
    model.eval()
    with torch.no_grad():  # in chunks of 1024 images (one chunk for digits' 359 test images)
        pred = torch.cat([model(xte[i:i + 1024]).argmax(1) for i in range(0, len(xte), 1024)])
    res.accuracy = 100.0 * float((pred == yte).float().mean())
    return res
