"""What the probe does at a spike (ProbeActions: rules, skip-step, budget, recipe, alarms),
from install()'s arguments or the environment."""

from __future__ import annotations

import os
from typing import Optional

from fullscale.probe.settings import ENV_PREFIX, ProbeError, _NeedsCluster


RECIPE = "restart_recipe.sh"
RULES = ("loss", "grad_norm")


class ProbeActions:
    """What the probe does at a spike (docs/mindspeed_probe.md, "At a spike"); every
    action can be switched off.

    rules: the online spike rules judged before each update, ("loss", "grad_norm") or a
      subset: adamspike.spikes.RollingSpikeDetector (the rule `adamspike analyze` applies
      offline) with SpikeParams(window, k, min_rel_jump), on the loss Megatron's loss
      function returned and on the global grad norm before clipping.
    skip: skip the optimizer update when a rule fires (every rank: the decision is
      all-reduced), at most `skip_budget` times; after that the update is applied and an
      "alarm" (rule probe.skip_budget) is raised once.
    recipe: write RUN/restart_recipe.sh at a spike: the PaLM rollback + batch skip as
      Megatron arguments (--load, --ckpt-step, --iterations-to-skip).
    predictions: a predictions.json whose armed alarm rules are evaluated on every
      telemetry step (fullscale.alarms.Alarms: adamspike.predictions.OnlineAlarms, the
      trainer's and the offline analysis' rule); None: no alarms.
    """

    def __init__(self, rules=RULES, *, skip: bool = True, skip_budget: int = 10,
                 recipe: bool = True, predictions: Optional[str] = None,
                 window: int = 50, mad_k: float = 6.0, min_rel_jump: float = 0.2,
                 rollback_steps: int = 100, skip_batches: int = 200):
        rules = tuple(rules)
        bad = [r for r in rules if r not in RULES]
        if bad:
            raise ProbeError(f"{ENV_PREFIX}RULES: unknown rule(s) {bad}; known: {', '.join(RULES)}")
        if skip_budget < 0 or rollback_steps < 0 or skip_batches < 0:
            raise ProbeError("skip budget, rollback steps and skip batches must be >= 0")
        self.rules, self.skip, self.skip_budget = rules, bool(skip) and bool(rules), int(skip_budget)
        self.recipe = bool(recipe) and bool(rules)
        self.rollback_steps, self.skip_batches = int(rollback_steps), int(skip_batches)
        self.spike_params = None
        if rules:
            try:
                # lazy: adamspike.spikes needs pandas (the cluster extra), which a bare
                # 910B node may lack; then the rules are off, telemetry stays
                from adamspike.spikes import SpikeParams
            except ImportError as e:
                raise _NeedsCluster(f"the loss / grad-norm rules need adamspike.spikes ({e}): "
                                 f"pip install -e .[cluster], or {ENV_PREFIX}RULES=0") from None
            self.spike_params = SpikeParams.from_table(
                {"window": window, "k": mad_k, "min_rel_jump": min_rel_jump, "log": False,
                 "absorb": False})
        self.alarms = None
        if predictions:
            try:
                # lazy: adamspike.predictions needs pandas (the cluster extra)
                from fullscale.alarms import Alarms
                self.alarms = Alarms(predictions)
            except ImportError as e:
                raise _NeedsCluster(f"{ENV_PREFIX}PREDICTIONS needs adamspike.predictions ({e}): "
                                 "pip install -e .[cluster]") from None
            except (OSError, ValueError) as e:
                raise ProbeError(f"{ENV_PREFIX}PREDICTIONS={predictions}: {e}") from None

    @classmethod
    def from_env(cls, env=None) -> "ProbeActions":
        """From ADAMSPIKE_PROBE_RULES (comma list, 0 / none: off; default loss,grad_norm),
        _SKIP (0/1, default 1), _SKIP_BUDGET (10), _RECIPE (0/1, 1), _PREDICTIONS (path;
        _ALARMS=0 ignores it), _SPIKE_WINDOW (50), _SPIKE_MAD_K (6), _SPIKE_MIN_REL_JUMP
        (0.2), _ROLLBACK_STEPS (100), _SKIP_BATCHES (200)."""
        env = os.environ if env is None else env

        def get(key, default, conv):
            v = env.get(ENV_PREFIX + key)
            if v is None or v == "":
                return default
            try:
                return conv(v)
            except ValueError:
                raise ProbeError(f"{ENV_PREFIX}{key}: cannot read {v!r}") from None

        def flag(v):
            if v.lower() in ("1", "true", "yes", "on"):
                return True
            if v.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(v)

        given = get("RULES", None, str)
        rules = ",".join(RULES) if given is None else given
        rules = () if rules.lower() in ("0", "none", "off", "false") else \
            tuple(r.strip() for r in rules.split(",") if r.strip())
        preds = get("PREDICTIONS", None, str) if get("ALARMS", True, flag) else None
        kw = dict(skip=get("SKIP", True, flag), skip_budget=get("SKIP_BUDGET", 10, int),
                  recipe=get("RECIPE", True, flag), predictions=preds,
                  window=get("SPIKE_WINDOW", 50, int), mad_k=get("SPIKE_MAD_K", 6.0, float),
                  min_rel_jump=get("SPIKE_MIN_REL_JUMP", 0.2, float),
                  rollback_steps=get("ROLLBACK_STEPS", 100, int),
                  skip_batches=get("SKIP_BATCHES", 200, int))
        try:
            return cls(rules, **kw)
        except _NeedsCluster as e:
            if given is not None and "adamspike.spikes" in str(e):
                raise               # rules asked for explicitly
            # a node without pandas: rules and alarms off, telemetry stays
            out = cls((), **{**kw, "predictions": None})
            out.note = str(e)
            return out

    note = ""

    def describe(self) -> str:
        if not self.rules:
            return "rules off (telemetry only" + (f": {self.note})" if self.note else ")")
        s = f"rules {'+'.join(self.rules)}"
        s += f", skip-step on (budget {self.skip_budget})" if self.skip else ", skip-step off"
        s += ", restart recipe on" if self.recipe else ", restart recipe off"
        return s + (f", alarms from {self.alarms.path}" if self.alarms is not None else ", no alarms")
