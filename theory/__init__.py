"""Closed forms for Adam loss-spike theory (numpy + scipy only; imports nothing else).

Modules: galton (Galton boards), bimodality (Sarle's coefficient, U-shape thresholds,
bimodality of r), adam_moments (m, v, r statistics of AR(1) streams), eps_regime,
transients (second-moment lag), quadratic (Bai et al. stability, eps*), risk (per-layer
spike risk), cli (``python -m theory``).
"""
