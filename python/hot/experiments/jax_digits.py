"""Example: an Equinox MLP (hot.jax.dense) or CNN (hot.jax.conv2d) trained on scikit-learn's digits, exact vs HOT,
under jax.jit.

    python -m hot.experiments.jax_digits --seeds 0 1 2 --epochs 15 [--model cnn]

Both runs start from the same initial weights and see the same batches in the same order; they differ only in the
layers' backward: ``hot.Config(exact=True)`` (JAX's own backward) against HOT (default ``hot.Config()``, or
``--paper``). Needs equinox (``pip install equinox``) and scikit-learn.
"""
from __future__ import annotations

import argparse
import time
from typing import Optional

import numpy as np

import jax
import jax.numpy as jnp

try:
    import equinox as eqx
except ImportError as _e:  # pragma: no cover
    raise ImportError(f"hot.experiments.jax_digits needs equinox ({_e}): pip install equinox") from _e

import hot
import hot.jax


def load_digits(seed: int = 0):
    """(x_train, y_train, x_test, y_test) as numpy: digits as N x 64 float32 standardised with the training set's
    mean and std, int32 labels; the 80/20 split of ``hot.experiments.train.load_digits`` (a seeded permutation)."""
    try:
        from sklearn.datasets import load_digits as _load
    except ImportError:
        raise ImportError("the digits task needs scikit-learn, which is not installed: pip install scikit-learn") from None
    d = _load()
    x = d.images.astype(np.float32).reshape(len(d.images), -1) / 16.0
    y = d.target.astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(x))
    n_test = len(x) // 5
    te, tr = perm[:n_test], perm[n_test:]
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    return x[tr], y[tr], x[te], y[te]


class Dense(eqx.Module):
    """A linear layer whose backward is HOT's: ``hot.jax.dense`` with weight (out, in) and a bias."""

    weight: jax.Array
    bias: jax.Array
    config: hot.Config = eqx.field(static=True)

    def __init__(self, n_in: int, n_out: int, config: hot.Config, *, key):
        lim = 1.0 / np.sqrt(n_in)  # the default init of torch.nn.Linear / eqx.nn.Linear
        kw, kb = jax.random.split(key)
        self.weight = jax.random.uniform(kw, (n_out, n_in), jnp.float32, -lim, lim)
        self.bias = jax.random.uniform(kb, (n_out,), jnp.float32, -lim, lim)
        self.config = config

    def __call__(self, x, *, key):
        return hot.jax.dense(x, self.weight, self.bias, key=key, config=self.config)


class MLP(eqx.Module):
    layers: tuple

    def __init__(self, sizes, config: hot.Config, *, key):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = tuple(Dense(a, b, config, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys))

    def __call__(self, x, *, key):
        """x: (batch, 64) -> logits (batch, 10); ``key`` seeds the layers' stochastic rounding."""
        keys = jax.random.split(key, len(self.layers))
        for i, (layer, k) in enumerate(zip(self.layers, keys)):
            x = layer(x, key=k)
            if i + 1 < len(self.layers):
                x = jax.nn.relu(x)
        return x


class Conv(eqx.Module):
    """A 2-D convolution whose backward is HOT's: ``hot.jax.conv2d`` with weight (out, in, k, k) and a bias."""

    weight: jax.Array
    bias: jax.Array
    stride: int = eqx.field(static=True)
    padding: int = eqx.field(static=True)
    config: hot.Config = eqx.field(static=True)

    def __init__(self, c_in: int, c_out: int, k: int, config: hot.Config, *, stride=1, padding=0, key):
        lim = 1.0 / np.sqrt(c_in * k * k)  # the default init of torch.nn.Conv2d
        kw, kb = jax.random.split(key)
        self.weight = jax.random.uniform(kw, (c_out, c_in, k, k), jnp.float32, -lim, lim)
        self.bias = jax.random.uniform(kb, (c_out,), jnp.float32, -lim, lim)
        self.stride, self.padding, self.config = stride, padding, config

    def __call__(self, x, *, key):
        return hot.jax.conv2d(x, self.weight, self.bias, key=key, stride=self.stride, padding=self.padding,
                              config=self.config)


class CNN(eqx.Module):
    """8x8 digits: conv 3x3 1 -> 16 (8x8), conv 3x3 stride 2 16 -> 32 (4x4), dense 512 -> 10; ReLU between."""

    layers: tuple

    def __init__(self, config: hot.Config, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = (Conv(1, 16, 3, config, padding=1, key=k1), Conv(16, 32, 3, config, stride=2, padding=1, key=k2),
                       Dense(32 * 4 * 4, 10, config, key=k3))

    def __call__(self, x, *, key):
        """x: (batch, 64) -> logits (batch, 10)."""
        keys = jax.random.split(key, len(self.layers))
        x = x.reshape(x.shape[0], 1, 8, 8)
        x = jax.nn.relu(self.layers[0](x, key=keys[0]))
        x = jax.nn.relu(self.layers[1](x, key=keys[1]))
        return self.layers[2](x.reshape(x.shape[0], -1), key=keys[2])


MODELS = ("mlp", "cnn")


def _loss(model, x, y, key):
    logits = model(x, key=key)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def _adam_init(params):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}


def _adam(params, grads, state, lr, b1=0.9, b2=0.999, eps=1e-8):
    t = state["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
    params = jax.tree_util.tree_map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), params, m, v)
    return params, {"m": m, "v": v, "t": t}


def train(config: hot.Config, seed: int = 0, epochs: int = 15, batch: int = 64, lr: float = 2e-3,
          hidden=(128, 128), data: Optional[tuple] = None, model: str = "mlp") -> dict:
    """Trains ``model`` ("mlp": 64 -> hidden -> 10; "cnn": :class:`CNN`) with Adam on the digits; returns {"accuracy", "loss" (the last epoch's
    mean training loss), "seconds" (training, compilation included), "step_ms" (mean of the steps after the
    first epoch)}. The initial weights (``jax.random.key(seed)``) and the batches (numpy seed ``seed``) depend only on
    ``seed``, so two configs see the same init and the same batches."""
    x_tr, y_tr, x_te, y_te = data if data is not None else load_digits()
    if model not in MODELS:
        raise ValueError(f"hot.experiments.jax_digits.train: model must be one of {MODELS}, got {model!r}")
    if model == "mlp":
        net = MLP((x_tr.shape[1],) + tuple(hidden) + (10,), config, key=jax.random.key(seed))
    else:
        net = CNN(config, key=jax.random.key(seed))
    params, static = eqx.partition(net, eqx.is_array)
    opt = _adam_init(params)

    @jax.jit
    def step(params, opt, x, y, key):
        loss, grads = jax.value_and_grad(lambda p: _loss(eqx.combine(p, static), x, y, key))(params)
        params, opt = _adam(params, grads, opt, lr)
        return params, opt, loss

    @jax.jit
    def predict(params, x):
        return jnp.argmax(eqx.combine(params, static)(x, key=jax.random.key(0)), axis=1)

    rng = np.random.default_rng(seed)
    step_key = jax.random.key(seed + 1_000_003)
    n = len(x_tr)
    t0 = time.perf_counter()
    steps, losses, t_steady = 0, [], None
    for epoch in range(epochs):
        if epoch == 1:
            jax.block_until_ready(params)
            t_steady, steps_steady = time.perf_counter(), steps
        perm = rng.permutation(n)
        ep_losses = []
        for i in range(0, n - batch + 1, batch):
            idx = perm[i:i + batch]
            params, opt, loss = step(params, opt, x_tr[idx], y_tr[idx], jax.random.fold_in(step_key, steps))
            ep_losses.append(loss)
            steps += 1
        losses.append(float(np.mean(jax.device_get(ep_losses))))
    jax.block_until_ready(params)
    t1 = time.perf_counter()
    acc = float(np.mean(np.asarray(predict(params, x_te)) == y_te))
    step_ms = 1e3 * (t1 - t_steady) / (steps - steps_steady) if t_steady is not None else float("nan")
    return {"accuracy": acc, "loss": losses[-1], "seconds": t1 - t0, "step_ms": step_ms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hot.experiments.jax_digits", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--paper", action="store_true", help="HOT at hot.Config.paper() instead of hot.Config()")
    p.add_argument("--model", choices=MODELS, default="mlp", help="the MLP (hot.jax.dense) or the CNN (hot.jax.conv2d "
                   "and dense)")
    args = p.parse_args(argv)
    data = load_digits()
    hot_cfg = hot.Config.paper() if args.paper else hot.Config()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.devices()[0].platform}); model "
          f"{args.model}; HOT: {hot_cfg}")
    print("seed  exact acc  HOT acc  diff (points)  exact loss  HOT loss  exact ms/step  HOT ms/step")
    diffs = []
    for s in args.seeds:
        e = train(hot.Config(exact=True), s, args.epochs, data=data, model=args.model)
        h = train(hot_cfg, s, args.epochs, data=data, model=args.model)
        d = 100 * (h["accuracy"] - e["accuracy"])
        diffs.append(d)
        print(f"{s:4d}  {100 * e['accuracy']:9.2f}  {100 * h['accuracy']:7.2f}  {d:+13.2f}  {e['loss']:10.4f}  "
              f"{h['loss']:8.4f}  {e['step_ms']:13.2f}  {h['step_ms']:11.2f}")
    print(f"HOT - exact, points: mean {np.mean(diffs):+.2f}, min {np.min(diffs):+.2f}, max {np.max(diffs):+.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
