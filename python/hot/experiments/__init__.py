"""Experiments and evidence built on hot: the tasks (digits, synthetic images, a character LM on real text), the
built-in models, the training loop, exact-vs-HOT parity runs, gradient fidelity and gradient-noise studies.

This package depends on the engine (``hot``, ``hot.torch``); the engine never imports it. The command line
(``hot demo``, ``hot parity``, ``hot fidelity``, ``hot gradnoise``) depends on both.
"""
