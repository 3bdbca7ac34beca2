"""adamspike: loss spikes caused by Adam, from closed-form theory to 70B validation runs.

The floor package every other one imports (the CLI and the study scheduler sit on top, in
study/). Cross-cutting pieces live here: typed configs
(`adamspike.config`, `adamspike.train_config`), the run-directory format
(`adamspike.rundir`), the shared telemetry definitions (`adamspike.metrics`), the LLaMA2
architecture both backends build (`adamspike.llama`) and deterministic synthetic data
(`adamspike.synthdata`). None of them imports jax or torch.
"""

__version__ = "0.1.0"
