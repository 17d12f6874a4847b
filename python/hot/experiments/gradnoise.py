"""End-to-end gradient error: how far each weight's gradient, after the whole backward pass, is from exact.

``hot.experiments.analysis.fidelity`` (``hot fidelity``) compares one layer at a time, each fed the exact g_y. In training
a layer's g_y is the g_x that the HOT layers above it produced, so their errors add up on the way down. This
module measures that compounded error where it matters, on the gradients the optimiser sees:

- for a model (a ``hot.experiments.parity`` task's model, optionally trained exact first) and one training batch, the
  exact float32 gradient of every Linear / Conv2d weight (the input layer included, though it stays exact:
  its g_y comes through every HOT layer);
- for every ``hot.experiments.parity`` method, ``draws`` backward passes of the same batch with different
  stochastic-rounding seeds; per weight, the relative error ‖ĝ − g‖_F / ‖g‖_F of one draw (mean over draws)
  and of the mean of the draws. For an unbiased method the second is the first / √draws; what stays above
  that is this batch's bias (deterministic errors: round-to-nearest 4-bit W̃, HLA's projection, the int8 copy
  of x);
- for scale, the batch-sampling noise of the exact gradient itself: ‖g_b − ḡ‖ / ‖g_b‖ for each of
  ``ref_batches`` other batches b, ḡ their mean (mean over b). The denominator is the batch's own gradient, as
  for the errors above, so (error / batch noise)² is the power ratio of the two.

Stochastic gradient descent already lives with the batch noise; noise well above it, and any bias that does
not average out over batches, is what slows training. Rerun: ``hot gradnoise`` (``hot.cli.gradnoise``).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from typing import Dict, List, Optional, Sequence, Tuple

import hot.experiments.parity as hp

BATCH_NOISE = "batch noise"


@dataclasses.dataclass
class GradNoiseReport:
    """Relative errors per weight (``weights``, input to output) and method: ``one_draw[m][w]`` (mean over
    draws of one draw's error), ``mean_draw[m][w]`` (error of the mean of the draws); ``batch_noise[w]``."""

    model: str
    task: str
    batch: int
    draws: int
    ref_batches: int
    trained_steps: int
    seed: int
    weights: List[str]
    batch_noise: Dict[str, float]
    one_draw: Dict[str, Dict[str, float]]
    mean_draw: Dict[str, Dict[str, float]]
    notes: Dict[str, str] = dataclasses.field(default_factory=dict)
    accuracy: Optional[float] = None
    rows: List[dict] = dataclasses.field(default_factory=list)  # g_y_concentration of the measured batch

    def rows_markdown(self) -> str:
        if not self.rows:
            return ""
        lines = ["| layer | rows x cols of G̃ | entries below one 4-bit step: per-tensor scale | per-token scales | "
                 f"share of ‖G̃‖² in the top {TOP_ROWS:.0%} rows |", "|---|---|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {r['layer']} | {r['rows']} x {r['cols']} | {r['below_tensor']:.3f} | "
                         f"{r['below_token']:.3f} | {r['top_rows_energy']:.3f} |")
        return "\n".join(lines) + "\n"

    @property
    def methods(self) -> List[str]:
        return list(self.one_draw)

    def power_ratio(self, m: str, w: str) -> float:
        """Error power of one draw of method ``m`` over the batch-noise power, for weight ``w``."""
        b = self.batch_noise[w]
        return self.one_draw[m][w] ** 2 / b ** 2 if b > 0 else math.inf

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "GradNoiseReport":
        return cls(**d)

    def to_markdown(self) -> str:
        ms = self.methods
        head = ("| weight | batch noise | " + " | ".join(f"{m}: one draw / mean of {self.draws}" for m in ms) + " |")
        lines = [head, "|" + "---|" * (2 + len(ms))]
        for w in self.weights:
            lines.append(f"| {w} | {self.batch_noise[w]:.3f} | " +
                         " | ".join(f"{self.one_draw[m][w]:.3f} / {self.mean_draw[m][w]:.3f}" for m in ms) + " |")
        return "\n".join(lines) + "\n"

    def summary_markdown(self) -> str:
        """Per method: the median and worst weight's one-draw error, the worst error power over batch-noise
        power, and the largest error of the mean of the draws (bias plus noise/√draws)."""
        lines = ["| method | one draw: median / worst weight | worst weight | error power / batch-noise power "
                 "(worst) | mean of draws: worst |", "|---|---|---|---|---|"]
        for m in self.methods:
            v = sorted(self.one_draw[m][w] for w in self.weights)
            worst = max(self.weights, key=lambda w: self.one_draw[m][w])
            ratio = max(self.power_ratio(m, w) for w in self.weights)
            lines.append(f"| {m} | {v[len(v) // 2]:.3f} / {v[-1]:.3f} | {worst} | {ratio:.1f} | "
                         f"{max(self.mean_draw[m].values()):.3f} |")
        return "\n".join(lines) + "\n"

    def plot(self, path: str) -> str:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        x = range(len(self.weights))
        fig, ax = plt.subplots(figsize=(max(8.0, 0.32 * len(self.weights)), 4.6))
        ax.plot(x, [self.batch_noise[w] for w in self.weights], "k--", label=BATCH_NOISE + " (exact)")
        for m in self.methods:
            if not any(self.one_draw[m].values()):  # exact: zero everywhere, nothing to draw on a log scale
                continue
            line, = ax.plot(x, [self.one_draw[m][w] for w in self.weights], "-o", ms=3, label=f"{m}: one draw")
            ax.plot(x, [self.mean_draw[m][w] for w in self.weights], ":", color=line.get_color(),
                    label=f"{m}: mean of {self.draws}")
        ax.set_xticks(list(x))
        ax.set_xticklabels([w.replace(".weight", "") for w in self.weights], rotation=90, fontsize=7)
        ax.set_ylabel("relative error vs exact gradient")
        ax.set_yscale("log")
        when = f"after {self.trained_steps} exact steps" if self.trained_steps else "at random initialisation"
        ax.set_title(f"End-to-end gradient error: {self.model} ({self.task}), batch {self.batch}, {when}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


TOP_ROWS = 0.02


def g_y_concentration(model, xb, yb) -> List[dict]:
    """Why per-tensor 4-bit g_x scales can fail: for every Linear / Conv2d layer of ``model`` (exact), one
    backward pass of (xb, yb), and G̃ = g_y · blockdiag(H_b) (SPEC §3; rows are tokens, or output pixels of a
    convolution): the share of G̃'s entries below one 4-bit step (amax / 7) with a per-tensor scale and with
    per-token scales (those entries are stochastically rounded to 0 or ±1 step: unbiased, but their noise is
    larger than their value), and the share of ‖G̃‖² held by the largest ``TOP_ROWS`` of rows."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import hot

    caps, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            def hook(mod, gin, gout, name=name):
                g = gout[0].detach()
                caps[name] = (g.movedim(1, -1) if g.dim() == 4 else g).reshape(-1, g.shape[1 if g.dim() == 4 else -1])
            handles.append(m.register_full_backward_hook(hook))
    try:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    out = []
    for name, g in caps.items():
        b = hot._api._hq_block(g.shape[1])
        gt = torch.from_numpy(hot.hadamard_transform(g.float().contiguous().numpy(), block=b))
        a = gt.abs()
        rowmax = a.amax(1, keepdim=True)
        energy = (gt.double() ** 2).sum(1)
        k = max(1, int(round(TOP_ROWS * len(energy))))
        total = float(energy.sum())
        out.append(dict(layer=name, rows=int(gt.shape[0]), cols=int(gt.shape[1]),
                        below_tensor=float((a < a.max() / 7).float().mean()),
                        below_token=float((a < rowmax / 7).float().mean()),
                        top_rows_energy=float(energy.topk(k).values.sum()) / total if total > 0 else 0.0))
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(out, key=lambda r: order[r["layer"]])


def _weights(model) -> List[str]:
    import torch.nn as nn

    return [f"{n}.weight" if n else "weight" for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv2d)) and m.weight.requires_grad]


def _grads(model, xb, yb, names: Sequence[str]) -> Dict[str, "object"]:
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(xb), yb).backward()
    params = dict(model.named_parameters())
    out = {}
    for n in names:
        g = params[n].grad
        if g is None:
            raise RuntimeError(f"hot.experiments.gradnoise: weight {n} got no gradient")
        out[n] = g.detach().double().clone()
    return out


def _rel(a, b) -> float:
    nb = float(b.norm())
    return float((a - b).norm()) / nb if nb > 0 else (0.0 if float(a.norm()) == 0 else math.inf)


def gradient_noise(model: str = "vit", task: str = "synth", methods: Sequence[str] = ("hot",), draws: int = 6,
                   batch: int = 64, ref_batches: int = 16, trained_steps: int = 0, seed: int = 0,
                   device: str = "cpu", data=None, n_train: Optional[int] = None,
                   progress=None) -> GradNoiseReport:
    """Measure the end-to-end gradient error of ``methods`` (``hot.experiments.parity`` names) on ``task``'s ``model``;
    see the module docstring. The model's weights come from ``torch.manual_seed(seed)``; with
    ``trained_steps`` > 0 it is first trained exact with the task's schedule (batch ``batch``). The measured
    batch is the first ``batch`` training images; the batch-noise reference uses the next ``ref_batches``
    batches. Draw k of every method uses ``torch.manual_seed(seed + 1 + k)`` for its rounding seeds."""
    import torch

    for m in methods:
        hp.method(m)
    if draws < 2:
        raise ValueError(f"hot.experiments.gradnoise: draws must be at least 2 (one draw cannot show noise), got {draws}")
    if batch < 1 or ref_batches < 2:
        raise ValueError(f"hot.experiments.gradnoise: batch must be >= 1 and ref_batches >= 2, got {batch} and {ref_batches}")
    if trained_steps < 0 or 0 < trained_steps < 20:
        raise ValueError(f"hot.experiments.gradnoise: trained_steps must be 0 or at least 20, got {trained_steps}")
    t = hp.get_task(task)
    if data is None:
        synthetic = t.name != "digits"  # sized here: the images measured, plus a training set when trained first
        need = max(n_train or 0, batch * (ref_batches + 1), 10000 if trained_steps else 0)
        data = hp.load_data(t.name, device, need if synthetic else None, min(t.n_test, 2000) if synthetic else None)
    xtr, ytr = data[0], data[1]
    if len(xtr) < batch * (ref_batches + 1):
        raise ValueError(f"hot.experiments.gradnoise: batch * (ref_batches + 1) = {batch * (ref_batches + 1)} training images "
                         f"are needed, the task has {len(xtr)}")
    torch.manual_seed(seed)
    net = hp.build_model(model, t.name).to(device)
    accuracy = None
    if trained_steps:
        from hot.experiments.train import train

        if progress:
            progress(f"training exact for {trained_steps} steps")
        accuracy = train(net, data, trained_steps, batch, t.lr, seed, device, measure=False).accuracy
    net.train()
    names = _weights(net)
    xb, yb = xtr[:batch], ytr[:batch]
    rows = g_y_concentration(net, xb.cpu(), yb.cpu()) if torch.device(device).type == "cpu" else []
    exact = _grads(net, xb, yb, names)
    ref = [_grads(net, xtr[batch * i:batch * (i + 1)], ytr[batch * i:batch * (i + 1)], names)
           for i in range(1, ref_batches + 1)]
    mean_ref = {n: sum(g[n] for g in ref) / ref_batches for n in names}
    batch_noise = {n: sum(float((g[n] - mean_ref[n]).norm() / g[n].norm()) for g in ref) / ref_batches
                   for n in names}
    one: Dict[str, Dict[str, float]] = {}
    mean: Dict[str, Dict[str, float]] = {}
    notes: Dict[str, str] = {}
    for m in methods:
        h = copy.deepcopy(net)
        torch.manual_seed(seed + 1)
        notes[m] = hp.prepare(h, m, calib_batch=(xb, yb))
        got = []
        for k in range(draws):
            torch.manual_seed(seed + 1 + k)
            got.append(_grads(h, xb, yb, names))
        one[m] = {n: sum(_rel(g[n], exact[n]) for g in got) / draws for n in names}
        mean[m] = {n: _rel(sum(g[n] for g in got) / draws, exact[n]) for n in names}
        if progress:
            progress(f"{m}: [{notes[m]}] one-draw error median {sorted(one[m].values())[len(names) // 2]:.3f}")
    return GradNoiseReport(model, t.name, batch, draws, ref_batches, trained_steps, seed, names, batch_noise,
                           one, mean, notes, accuracy, rows)


def save(rep: GradNoiseReport, out: str, name: str = "gradnoise", command: str = "") -> Tuple[str, str, str]:
    """Write ``<name>.md``, ``<name>.json`` and ``<name>.png`` in ``out``."""
    import os

    os.makedirs(out, exist_ok=True)
    md, js, png = (os.path.join(out, f"{name}.{e}") for e in ("md", "json", "png"))
    rep.plot(png)
    with open(js, "w") as f:
        json.dump(rep.to_json(), f, indent=1)
    trained = (f"trained exact for {rep.trained_steps} steps first (test accuracy {rep.accuracy:.2f}%)"
               if rep.trained_steps else "at random initialisation")
    text = [f"# End-to-end gradient error: {rep.model} on {rep.task}", "",
            f"One training batch of {rep.batch} images, model {trained}, seed {rep.seed}. For every Linear / "
            f"Conv2d weight: relative error ‖ĝ − g‖_F / ‖g‖_F of the gradient after the whole backward pass "
            f"against the exact gradient of the same batch, for one draw of the stochastic rounding (mean over "
            f"{rep.draws} draws) and for the mean of the {rep.draws} draws (unbiased noise shrinks as "
            f"1/√{rep.draws}; what stays is this batch's bias). The batch-noise column is the exact gradient's "
            f"own sampling noise: ‖g_b − ḡ‖_F / ‖g_b‖_F for {rep.ref_batches} other batches b, ḡ their mean. "
            f"Weights in model order (input "
            f"first): errors of the HOT layers above add up on the way down."
            + (f" Command: `{command}`." if command else ""), "",
            f"![end-to-end gradient error]({name}.png)", "", "## Summary", "", rep.summary_markdown(),
            "## Per weight", "", rep.to_markdown()]
    if rep.rows:
        text += ["## Where g_y's energy sits (exact backward of the same batch)", "",
                 "G̃ = g_y · blockdiag(H_b), the g_x path's quantiser input. Entries below one 4-bit step (amax / 7) "
                 "are stochastically rounded to 0 or ±1 step: unbiased, but with noise above their value. A "
                 "per-tensor scale is set by the largest rows; per-token scales by each row's own.", "",
                 rep.rows_markdown()]
    text += ["## Methods", ""]
    text += [f"- `{m}`: {hp.METHODS[m].description} [{rep.notes.get(m, '')}]" for m in rep.methods]
    with open(md, "w") as f:
        f.write("\n".join(text) + "\n")
    return md, js, png
