"""Per-tensor Adam telemetry inside an unmodified Megatron-LM / MindSpeed-LLM run.

One module per idea: settings (the error type, ADAMSPIKE_PROBE_* readers), naming (layout
names), optimizer (Megatron optimizer / parallel-state reading), kernels (the Adam-term sums,
shared with fullscale.telemetry), writer (run directory), actions (what to do at a spike),
rules (the online spike rules), recipe (the restart recipe), core (MegatronProbe), wrapper
(the train_step wrapper and install()), cli (`python -m fullscale.megatron_probe`).
fullscale.megatron_probe re-exports the public names (the entry point users and scripts know).

docs/mindspeed_probe.md is the user's guide: what it needs on the cluster (python >= 3.8,
torch >= 2.1 + torch_npu, numpy; no jax / pandas / scipy), how to add it to a run (the
generated script, `python -m fullscale.megatron_probe ... -- pretrain_gpt.py ARGS`, or
`install()` after MindSpeed-LLM's adaptor import), which optimizer attributes it reads,
how it names tensors, and its cost. What is only here:

`megatron.training.training.train_step` receives `model` (a list of model chunks) and
`optimizer` as its 3rd and 4th arguments in every Megatron version since 2023. On logged
steps every rank computes the `adamspike.metrics.SUM_FIELDS` sums (and r-histogram counts)
of the elements it owns, one (num_tensors, 14 [+ 64]) float64 table is all-reduced over the
world, and the last rank turns it into `layers` / `hists` rows with
`adamspike.metrics.finalize`; a `steps` row is written every step.

Ownership (each element counts once): non-distributed optimizer: DP rank 0 of the
data-parallel-with-context-parallel group (expert parameters: expert-DP rank 0);
distributed optimizer: every DP rank's disjoint slice, only instance 0 when there are
several optimizer instances; non-split tensors (`tensor_model_parallel` false): TP rank 0;
a tied embedding: not the copy on the last stage (`shared_embedding` off the first stage).
The tensor list is the union over all ranks (one `all_gather_object` at the first logged
step). Elementwise math in float64 (cpu, cuda) or float32 (npu, where float64 kernels are
not dependable); counts are integer sums.

Online curvature proxy (`MegatronProbe._secant_step`, simulate.program's Secant): every
step each rank adds its owned elements' part of (g_t - g_{t-1}) . u_{t-1},
u_{t-1}' P_{t-1}^-1 u_{t-1} and |u_{t-1}|^2 (g the pre-clip gradient, u the applied change of
the fp32 main parameters, P^-1 = (sqrt(v_hat) + eps) / c_t) to block sums; they travel in
spare columns of the telemetry table's flag row (no extra collective) and the writer rank
writes one `curvature` row (group "update") per telemetry step: the Rayleigh quotient of
P^(1/2) H P^(1/2) along the block's updates (S_secant = lr q / 2) and that of H. Costs two
fp32 copies of the owned shard and a few dot products per step.

Settings come from install()'s arguments or the environment: ADAMSPIKE_PROBE_OUT (the run
directory; required), ADAMSPIKE_PROBE_EVERY (telemetry every K steps, default 10),
ADAMSPIKE_PROBE_HIST_EVERY (histograms every H steps, 0 = never, default 100),
ADAMSPIKE_PROBE_SECANT (the curvature proxy, 0 = off, default 1),
ADAMSPIKE_PROBE_FLUSH_S (seconds between flushes, default 60), ADAMSPIKE_PROBE_TIMEOUT_S
(the probe's collectives, default 120), and the actions' variables (ProbeActions.from_env).

Actions (docs/mindspeed_probe.md, "At a spike"): before each update the loss and grad-norm
rules (adamspike.spikes) judge all-reduced values, and skip-step returns Megatron's "update
not successful" on every rank; alarms of predictions.json on telemetry steps; the restart
recipe. Fail-open (same doc): every probe error is caught, travels with the next probe
collective (on the probe's own gloo group, with a timeout), and turns the probe off on every
rank at the same point; invariant: the sequence of probe collectives depends only on
agreed state (step, settings, agreed flags), never on a local error.
"""

