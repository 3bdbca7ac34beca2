"""The mitigation registry: every intervention on the model or the Adam step, once.

A mitigation is a group of `mitigation.*` keys of adamspike.train_config.RunConfig whose
defaults are neutral (plain AdamW). Its entry here says what it does, which optimizer state
it edits, how it maps to Megatron / MindSpeed flags (or that it cannot), and how its
settings resolve into the backend-neutral `StepPlan` that both trainers implement:

    hook        StepPlan field         JAX (simulate/program.py)      torch (fullscale/optim.py)
    model       model_options          loss_fn keyword arguments      Transformer keywords
    eps         tensor_eps             `eps` control (per tensor)     one param group per eps
    direction   update_clip            scale_by_adam_stable           apply_update_clip
    state       v_reset                `reset` control               reset_second_moment
                                       (optim.reset_second_moment)
    update      freeze, freeze_steps   `frozen` control               apply_freeze (group lr 0)
                                       (optim.freeze_updates)

Entries (keys, math, reference):

    update_clip        mitigation.update_clip: per tensor r <- r / max(1, rms_t),
                       rms_t = sqrt(mean(g^2 / max(v_hat, eps^2))) (StableAdamW,
                       Wortsman et al. 2023).
    embed_grad_shrink  mitigation.embed_grad_shrink = a: the embedding output is
                       a x + (1 - a) stop_gradient(x), so the embedding gradient is scaled by
                       a and the forward pass is unchanged (GLM-130B, Zeng et al. 2022).
    group_eps          mitigation.eps_embed / eps_shallow / eps_deep / eps_head: Adam's eps
                       per depth group (adamspike.depth_groups), none = optim.eps (the head:
                       none = eps_deep).
    v_reset            mitigation.v_reset_steps, v_reset_groups: just before the update of
                       step t in v_reset_steps, v_{t-1} <- 0 for every tensor of the groups,
                       so v_t = (1 - b2) g_t^2; m and the bias corrections are untouched
                       (a second-moment analogue of SPAM's moment reset, Huang et al. 2025).
    freeze_groups      mitigation.freeze_groups, freeze_from, freeze_until: on the steps
                       freeze_from <= t <= freeze_until (freeze_until = 0: to the end) the
                       parameter change of every tensor of the groups is zero (the Adam
                       direction and the decoupled weight decay alike: p_t = p_{t-1}). The
                       gradient is still computed, counts in the global-norm clip, and Adam's
                       m, v and step count still accumulate as if the tensor were trained,
                       so an unfrozen tensor resumes with a warm state (the choice of
                       layer-freezing for a spike study: only the update is withheld; no
                       optimizer state is edited). Skipped steps (data.skip_batches) count
                       toward the step range as they do for the lr schedule. (Layer
                       freezing as in Brock et al. 2017, FreezeOut.)

Telemetry's grad_mom_cos = cos(g_t, m_{t-1}) uses the momentum that enters the update,
i.e. after any `state` edit: mitigations with edits_state != "" make the torch trainer pass
m_{t-1} explicitly (`needs_explicit_m_prev`) instead of reconstructing it from AdamW's rule;
the JAX step is handed the edited state.

Adding a mitigation: see README.md ("Adding a mitigation").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional   # runtime field types: python 3.8

from adamspike.config import ConfigError, flatten, param, to_dict
from adamspike.depth_groups import GROUPS, depth_group

HOOKS = ("model", "eps", "direction", "state", "update")


@dataclass
class StepPlan:
    """What the trainers implement, resolved from a config for one model.

    model_options: keyword arguments of the model's forward (both backends' Transformer /
    loss_fn take the same names); tensor_eps: Adam eps of each tensor by name;
    update_clip: StableAdamW clipping on; v_reset: {step: names of the tensors whose v is
    set to 0 just before that step's update}; freeze: names of the tensors whose parameter
    change is zero on the steps freeze_steps = (first, last) (last 0: to the end)."""
    model_options: dict[str, Any] = field(default_factory=dict)
    tensor_eps: dict[str, float] = field(default_factory=dict)
    update_clip: bool = False
    v_reset: dict[int, tuple[str, ...]] = field(default_factory=dict)
    freeze: tuple[str, ...] = ()
    freeze_steps: tuple[int, int] = (1, 0)

    def frozen_at(self, step: int) -> tuple[str, ...]:
        """The tensors whose update is zero at optimizer step `step` (1-based)."""
        first, last = self.freeze_steps
        return self.freeze if first <= step and (last == 0 or step <= last) else ()


@dataclass(frozen=True)
class Mitigation:
    """One registry entry. `resolve(cfg, plan, depths, num_layers)` writes its part of the
    plan; `megatron(cfg)` gives its Megatron / MindSpeed arguments, or None when no flag
    expresses it (`fullscale.launch._megatron_gaps` reports it); `edits_state` names the
    optimizer state it edits ("" none, "v", "m", "m,v")."""
    name: str
    fields: tuple[tuple[str, Any, Any], ...]   # (name, type, param(...)) in MitigationSection
    hook: str
    summary: str
    reference: str
    resolve: Callable[[Any, StepPlan, Mapping[str, int], int], None]
    megatron: Callable[[Any], list[str] | None]
    edits_state: str = ""
    check: Callable[[Any], None] | None = None    # of the MitigationSection
    moved_from: tuple[str, ...] = ()               # old dotted keys (clear errors)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(f"mitigation.{name}" for name, _, _ in self.fields)

    def settings(self, cfg) -> dict[str, Any]:
        """This mitigation's keys and their values in cfg."""
        flat = flatten(to_dict(cfg))
        return {k: flat[k] for k in self.keys}

    def active(self, cfg) -> bool:
        """Any key away from its neutral (default) value."""
        return self.settings(cfg) != neutral(self)


def _resolve_update_clip(cfg, plan: StepPlan, depths, num_layers) -> None:
    plan.update_clip = bool(cfg.mitigation.update_clip)


def _resolve_embed_shrink(cfg, plan: StepPlan, depths, num_layers) -> None:
    plan.model_options["embed_grad_shrink"] = float(cfg.mitigation.embed_grad_shrink)


def _group_eps(cfg) -> dict[str, float]:
    m, eps = cfg.mitigation, float(cfg.optim.eps)
    pick = lambda v: eps if v is None else float(v)  # noqa: E731
    return {"embed": pick(m.eps_embed), "shallow": pick(m.eps_shallow),
            "deep": pick(m.eps_deep),
            "head": pick(m.eps_deep) if m.eps_head is None else float(m.eps_head)}


def _resolve_group_eps(cfg, plan: StepPlan, depths, num_layers) -> None:
    by_group = _group_eps(cfg)
    plan.tensor_eps = {n: by_group[depth_group(d, num_layers)] for n, d in depths.items()}


def _resolve_v_reset(cfg, plan: StepPlan, depths, num_layers) -> None:
    groups = set(cfg.mitigation.v_reset_groups)
    names = tuple(n for n, d in depths.items() if depth_group(d, num_layers) in groups)
    plan.v_reset = {int(s): names for s in cfg.mitigation.v_reset_steps}


def _check_v_reset(section) -> None:
    for i, s in enumerate(section.v_reset_steps):
        if s < 1:
            raise ConfigError(f"mitigation.v_reset_steps[{i}]: must be >= 1, got {s}")
    for i, g in enumerate(section.v_reset_groups):
        if g not in GROUPS:
            raise ConfigError(f"mitigation.v_reset_groups[{i}]: must be one of {list(GROUPS)}, "
                              f"got {g!r}")
    if section.v_reset_steps and not section.v_reset_groups:
        raise ConfigError("mitigation.v_reset_groups: empty while v_reset_steps is set")


def _resolve_freeze(cfg, plan: StepPlan, depths, num_layers) -> None:
    m = cfg.mitigation
    groups = set(m.freeze_groups)
    plan.freeze = tuple(n for n, d in depths.items() if depth_group(d, num_layers) in groups)
    plan.freeze_steps = (int(m.freeze_from), int(m.freeze_until))


def _check_freeze(section) -> None:
    for i, g in enumerate(section.freeze_groups):
        if g not in GROUPS:
            raise ConfigError(f"mitigation.freeze_groups[{i}]: must be one of {list(GROUPS)}, "
                              f"got {g!r}")
    if section.freeze_until and section.freeze_until < section.freeze_from:
        raise ConfigError(f"mitigation.freeze_until: {section.freeze_until} is before "
                          f"mitigation.freeze_from = {section.freeze_from} (0 = to the end)")
    if not section.freeze_groups and (section.freeze_from != 1 or section.freeze_until != 0):
        raise ConfigError("mitigation.freeze_groups: empty while freeze_from / freeze_until "
                          "is set")


def _not_expressible(cfg) -> None:
    return None


def _group_eps_megatron(cfg) -> list[str] | None:
    """optim.eps in every group is Megatron's --adam-eps (launch writes it); otherwise none."""
    return [] if set(_group_eps(cfg).values()) == {float(cfg.optim.eps)} else None


REGISTRY: dict[str, Mitigation] = {m.name: m for m in (
    Mitigation("update_clip",
               (("update_clip", bool, param(False, help="StableAdamW update clipping per tensor")),),
               "direction", "StableAdamW update clipping: r <- r / max(1, rms_t) per tensor",
               "Wortsman et al. 2023, Stable and low-precision training for large-scale "
               "vision-language models", _resolve_update_clip, _not_expressible,
               moved_from=("optim.update_clip",)),
    Mitigation("embed_grad_shrink",
               (("embed_grad_shrink", float, param(1.0, lo=0.0, hi=1.0, lo_open=True,
                                                   help="GLM-130B embedding-gradient shrink a; 1 = off")),),
               "model", "embedding-gradient shrink: x <- a x + (1 - a) stop_gradient(x)",
               "Zeng et al. 2022, GLM-130B", _resolve_embed_shrink, _not_expressible,
               moved_from=("model.embed_grad_shrink",)),
    Mitigation("group_eps",
               (("eps_embed", Optional[float], param(None, lo=0.0, help="Adam eps of the embed group; none = optim.eps")),
                ("eps_shallow", Optional[float], param(None, lo=0.0, help="Adam eps of the shallow blocks")),
                ("eps_deep", Optional[float], param(None, lo=0.0, help="Adam eps of the deep blocks (and the head unless eps_head)")),
                ("eps_head", Optional[float], param(None, lo=0.0, help="Adam eps of the head (final norm + output); none = eps_deep"))),
               "eps", "Adam eps per depth group (embed / shallow / deep / head)",
               "seed report (shallow layers near eps); adamspike.depth_groups",
               _resolve_group_eps, _group_eps_megatron),
    Mitigation("v_reset",
               (("v_reset_steps", List[int], param([], help="steps before whose update v is set to 0")),
                ("v_reset_groups", List[str], param(["embed", "shallow"],
                                                    help="depth groups whose v is reset"))),
               "state", "second-moment reset: v <- 0 for the chosen depth groups at chosen steps",
               "Huang et al. 2025, SPAM (moment reset)", _resolve_v_reset, _not_expressible,
               edits_state="v", check=_check_v_reset),
    Mitigation("freeze_groups",
               (("freeze_groups", List[str], param([], help="depth groups whose update is zero (Adam state still accumulates)")),
                ("freeze_from", int, param(1, lo=1, help="first frozen step")),
                ("freeze_until", int, param(0, lo=0, help="last frozen step; 0 = to the end"))),
               "update", "layer freezing: zero parameter change of the chosen depth groups "
               "on chosen steps (m, v keep accumulating)",
               "Brock et al. 2017, FreezeOut", _resolve_freeze, _not_expressible,
               check=_check_freeze),
)}


def _section_check(self) -> None:
    for m in REGISTRY.values():
        if m.check is not None:
            m.check(self)


# The `mitigation` section of RunConfig: every registry entry's fields, in registry order.
MitigationSection = dataclasses.make_dataclass(
    "MitigationSection", [f for m in REGISTRY.values() for f in m.fields],
    namespace={"check": _section_check,
               "__doc__": "Interventions on the model or the Adam step (adamspike.mitigations); "
                          "the defaults are neutral: plain AdamW."})
MitigationSection.__module__ = __name__


def moved_keys(section: str) -> dict[str, str]:
    """{old field of `section`: its key now} for the keys registry entries moved."""
    return {old.split(".", 1)[1]: new for m in REGISTRY.values()
            for old, new in zip(m.moved_from, m.keys) if old.split(".", 1)[0] == section}


def neutral(m: Mitigation) -> dict[str, Any]:
    """The neutral values of m's keys (the RunConfig defaults)."""
    section = MitigationSection()
    return {f"mitigation.{name}": getattr(section, name) for name, _, _ in m.fields}


def all_keys() -> set[str]:
    return {k for m in REGISTRY.values() for k in m.keys}


def active(cfg) -> list[Mitigation]:
    """The registry entries cfg turns on, in registry order."""
    return [m for m in REGISTRY.values() if m.active(cfg)]


def plan(cfg, depths: Mapping[str, int], num_layers: int) -> StepPlan:
    """The StepPlan of cfg for a model whose tensors have these depths (name -> depth,
    the run-directory convention) and num_layers blocks. Every entry resolves (a neutral
    entry writes its neutral part: eps = optim.eps everywhere, no reset, ...)."""
    p = StepPlan()
    for m in REGISTRY.values():
        m.resolve(cfg, p, depths, int(num_layers))
    return p


def require_hooks(cfg, hooks, where: str) -> None:
    """ConfigError naming the keys of every active mitigation whose hook is not in `hooks`
    (a trainer that implements only some hooks, e.g. the MLP: "direction")."""
    bad = [m for m in active(cfg) if m.hook not in hooks]
    if bad:
        keys = ", ".join(k for m in bad for k in m.keys)
        raise ConfigError(f"{keys}: not supported by {where} (it implements the "
                          f"{', '.join(hooks)} hook(s) of adamspike.mitigations)")


def needs_explicit_m_prev(cfg) -> bool:
    """Whether an active mitigation edits optimizer state (the torch telemetry then copies
    m_{t-1} instead of reconstructing it from AdamW's update rule)."""
    return any(m.edits_state for m in active(cfg))


def megatron_gaps(cfg) -> list[str]:
    """One line per active mitigation that no Megatron / MindSpeed flag expresses."""
    out = []
    for m in active(cfg):
        if m.megatron(cfg) is None:
            vals = ", ".join(f"{k} = {v}" for k, v in m.settings(cfg).items())
            out.append(f"{vals}: {m.summary}; no Megatron flag, not applied")
    return out


def neutral_mask(table) -> Any:
    """Boolean mask (pandas) of a sweep table's rows in which every mitigation key present
    as a column has its neutral value (runs without mitigations)."""
    mask = None
    for m in REGISTRY.values():
        for k, v in neutral(m).items():
            if k in table:
                col = table[k]
                ok = col.isna() if v is None else col.map(lambda x, v=v: _same(x, v))
                mask = ok if mask is None else mask & ok
    if mask is None:
        return table.index == table.index
    return mask.to_numpy(dtype=bool)


def _same(x, v) -> bool:
    if isinstance(v, list):
        return list(x) == v if x is not None and not isinstance(x, float) else False
    return x == v


def megatron_args(cfg) -> list[str]:
    """The Megatron / MindSpeed arguments of the active mitigations that have them."""
    out: list[str] = []
    for m in active(cfg):
        out += m.megatron(cfg) or []
    return out
