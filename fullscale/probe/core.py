"""MegatronProbe: the per-tensor telemetry, the pre-update judgement and fail-open machinery."""

from __future__ import annotations

import datetime
import math
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from adamspike.metrics import HIST_EDGES, METRIC_NAMES, NUM_HIST_BINS, finalize
from fullscale.probe.actions import RECIPE
from fullscale.probe.kernels import NUM_SUMS, _FLOAT_COLS, _INT_COLS, _SECANT_COLS, rounded_edges, shard_sums
from fullscale.probe.naming import depth_kind, global_names
from fullscale.probe.optimizer import (_distopt_instance, _group_of, _inner, _pairs, _parallel_ranks,
                                     _step_of, hyper_params, leaf_optimizers)
from fullscale.probe.recipe import write_restart_recipe
from fullscale.probe.rules import _SpikeRules, _loss_scale, _op
from fullscale.probe.settings import ENV_PREFIX, ProbeError
from fullscale.probe.tensorboard import GroupScalars
from fullscale.probe.writer import open_writer, storage_info


class _Slot:
    """One owned slice of a model tensor on this rank."""
    __slots__ = ("row", "model", "main", "start", "stop", "inner", "group")

    def __init__(self, row, model, main, start, stop, inner, group):
        self.row, self.model, self.main, self.start, self.stop = row, model, main, start, stop
        self.inner, self.group = inner, group


class MegatronProbe:
    """Per-tensor Adam telemetry of a Megatron model + optimizer.

    `collect(model, optimizer, step)` after optimizer.step() on every rank (collective on
    logged steps) returns the (num_tensors, NUM_SUMS [+ NUM_HIST_BINS]) all-reduced table
    and writes it on the writer rank; `after_train_step(...)` is what the train_step
    wrapper calls (steps row + collect).

    Args:
      out: the run directory (created by the writer rank; resumed when it exists).
      every, hist_every: telemetry every K steps, histograms every H (0: never).
      precision: "float64" | "float32" elementwise dtype (npu: float32 always).
      writer_rank: the rank that writes (default: the last, where Megatron logs).
      config: extra run.json config (e.g. model / train sections).
      plain: force the plain JSON-lines writer.
      actions: ProbeActions (online rules, skip-step, alarms, restart recipe); None: off
        (telemetry only). install() builds them from the environment.
      timeout_s: timeout of the probe's collectives (its own gloo group).
      secant: the online curvature proxy (`_secant_step`; a `curvature` row of group
        "update" per telemetry step); False: off (no copies of the parameters kept).
      inject: test hook, called as inject(point, step) at the probe's failure points.

    Fail-open: every probe error is caught, reported with the next collective (an error
    flag all-reduced with the data, or a collective that times out after `timeout_s`),
    and then the probe is off on every rank; `disabled_reason` says why, one line is
    printed by the rank that failed, and train_step runs unwrapped from then on.
    """

    def __init__(self, out: str, *, every: int = 10, hist_every: int = 100,
                 precision: str = "float64", writer_rank: Optional[int] = None,
                 config: Optional[dict] = None, flush_every_s: float = 60.0,
                 plain: bool = False, actions: Optional["ProbeActions"] = None,
                 timeout_s: float = 120.0, secant: bool = True, inject=None):
        if every < 1 or hist_every < 0:
            raise ProbeError(f"every must be >= 1 and hist_every >= 0, got {every}, {hist_every}")
        if precision not in ("float32", "float64"):
            raise ProbeError(f"precision must be float32 or float64, got {precision!r}")
        self.out, self.every, self.hist_every = str(out), int(every), int(hist_every)
        self.precision = precision
        self.extra_config = dict(config or {})
        self.flush_every_s, self.plain = float(flush_every_s), bool(plain)
        dist = torch.distributed
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.writer_rank = self.world - 1 if writer_rank is None else int(writer_rank)
        self.writer = None
        self._layout = None          # (names, depth, kind, slots) once built
        self._optimizer_id = None
        self.overhead_s = 0.0        # time spent in the probe (this rank)
        self.timeout_s = float(timeout_s)
        self.inject = inject
        self.actions = actions
        self.disabled = False
        self.disabled_reason = ""
        self._error: Optional[str] = None     # a local error not yet agreed on
        self._pg = None                       # the probe's gloo group (lazy)
        self._pending: List[Tuple[str, dict]] = []   # events for the writer
        self._spikes = None                   # _SpikeRules once the rules are on
        self.skips = 0                        # updates skipped by the probe
        self.loop = None                      # the running loop's facts (fullscale.probe.loop)
        self._tb = None                       # TensorBoard group scalars (writer rank)
        self.storage: Optional[dict] = None   # where the run directory lives (writer rank)
        self._budget_alarm = False
        self._fired_text = ""
        self._skip_reason: Optional[str] = None
        self.last_rule_inputs: Tuple[Optional[float], Optional[float]] = (None, None)
        self.secant = bool(secant)
        self._sec_reset()
        self._sec_block = None                # (num, den, uu) block sums on the device
        self._sec_n = 0                       # usable steps in the block (this rank)
        self._sec_reading: Optional[np.ndarray] = None   # all-reduced, for the writer

    # -- fail-open -------------------------------------------------------------------
    def _group(self):
        """The probe's own gloo group with a short timeout: a failing or hung rank makes
        the others' probe collectives raise after timeout_s (instead of the job's HCCL /
        NCCL timeout), and the probe turns itself off."""
        if self._pg is None:
            self._pg = torch.distributed.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._pg

    def _fail(self, e: BaseException, step: int) -> None:
        """A local error: remembered, reported to the other ranks at the next collective."""
        if self._error is None:
            self._error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            self._error_step = int(step)

    def _say(self, msg: str) -> None:
        try:
            print(f"adamspike probe: {msg}", flush=True)
        except Exception:  # noqa: BLE001 - a closed stdout must not stop training
            pass

    def _disable(self, step: int, why: Optional[str] = None) -> None:
        """Off on this rank (every rank reaches this at the same collective). The rank
        with the error prints the one line."""
        if self.disabled:
            return
        self.disabled = True
        mine = why or self._error
        self.disabled_reason = mine or "an error on another rank"
        if mine:
            self._say(f"disabled on every rank at step {step} (rank {self.rank}: {mine}); "
                      "training continues without it")
        try:
            if self.writer is not None:
                self.writer.event("probe_disabled", step=int(step), reason=self.disabled_reason,
                                  rank=self.rank)
                self.writer.close()
        except Exception:  # noqa: BLE001 - the writer may be what failed
            pass
        self.writer = None

    def _collective(self, fn, step: int) -> bool:
        """Run one probe collective; a failure or timeout disables the probe here."""
        try:
            if self.inject is not None:
                self.inject("collective", step)
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - fail open
            self._fail(e, step)
            self._disable(step, self._error)
            return False

    def _agree(self, step: int) -> bool:
        """All ranks learn whether any has a pending error (one all-reduce); False when
        the probe is now disabled."""
        if self.world == 1:
            if self._error is not None:
                self._disable(step)
                return False
            return True
        flag = torch.tensor([0.0 if self._error is None else 1.0], dtype=torch.float64)
        if not self._collective(lambda: torch.distributed.all_reduce(flag, group=self._group()), step):
            return False
        if float(flag[0]) > 0:
            self._disable(step)
            return False
        return True

    def guarded(self, what: str, step: int, fn, *a, **k):
        """fn(*a, **k) with any exception caught (a pending error); None on failure."""
        if self.disabled or self._error is not None:
            return None
        try:
            return fn(*a, **k)
        except Exception as e:  # noqa: BLE001 - fail open
            self._fail(e, step)
            return None

    # -- layout ----------------------------------------------------------------------
    def _local_layout(self, chunks, optimizer) -> list:
        """This rank's owned slices (no collective)."""
        names = global_names(chunks)
        cfg = getattr(chunks[0], "config", None)
        self._cfg_layers = int(getattr(cfg, "num_layers", 0) or 0)
        self._gated = bool(getattr(cfg, "gated_linear_unit", True))
        ranks = _parallel_ranks()
        local: List[Tuple[str, Any, Any, int, int, Any, dict]] = []
        for leaf in leaf_optimizers(optimizer):
            inner = _inner(leaf)
            distributed = hasattr(leaf, "shard_fp32_from_float16_groups")
            instance = _distopt_instance(leaf) if distributed else 0
            for p, main, start, stop in _pairs(leaf):
                if id(p) not in names:
                    raise ProbeError("an optimizer parameter is not in model.named_parameters()")
                name = names[id(p)]
                expert = getattr(p, "allreduce", True) is False
                if distributed:
                    own = instance == 0
                else:
                    own = (ranks["edp"] if expert else ranks["dp"]) == 0
                if not getattr(p, "tensor_model_parallel", False) and ranks["tp"] != 0:
                    own = False
                if getattr(p, "shared_embedding", False) and not ranks["pp_first"] \
                        and "output_layer" in name:
                    own = False   # the last stage's copy of a tied embedding
                if own and stop > start:
                    local.append((name, p, main, start, stop, inner, _group_of(inner, main)))
        return local

    def _ensure_layout(self, chunks, optimizer, step: int) -> bool:
        """Build the tensor layout (once per optimizer): local part, agreement, one
        all_gather_object of the names. False when the probe got disabled."""
        if self._layout is not None and self._optimizer_id == id(optimizer):
            return True
        local = None
        if self._error is None:
            try:
                local = self._local_layout(chunks, optimizer)
            except Exception as e:  # noqa: BLE001 - fail open: reported at the agreement
                self._fail(e, step)
        if not self._agree(step):
            return False
        mine = sorted({x[0] for x in local})
        if self.world > 1:
            gathered: List[Any] = [None] * self.world
            if not self._collective(lambda: torch.distributed.all_gather_object(
                    gathered, mine, group=self._group()), step):
                return False
            all_names = sorted({n for part in gathered for n in part})
        else:
            all_names = mine
        try:
            if self.inject is not None:
                self.inject("layout", step)
            self._finish_layout(optimizer, local, all_names)
        except Exception as e:  # noqa: BLE001 - fail open: agreed on just below
            self._layout = None
            self._fail(e, step)
        return self._agree(step)      # every rank has a layout, or the probe is off

    def _finish_layout(self, optimizer, local, all_names) -> None:
        num_layers = self._cfg_layers
        if num_layers == 0:
            num_layers = 1 + max([int(m.group(1)) for n in all_names
                                  for m in [re.search(r"layers\.(\d+)\.", n)] if m] or [-1])
        row = {n: i for i, n in enumerate(all_names)}
        dk = [depth_kind(n, num_layers, self._gated) for n in all_names]
        slots = [_Slot(row[name], p, main, start, stop, inner, group)
                 for name, p, main, start, stop, inner, group in local]
        self.num_layers = num_layers
        self.device = slots[0].main.device if slots else torch.device("cpu")
        self.dtype = torch.float32 if (self.device.type == "npu" or self.precision == "float32") \
            else torch.float64
        self.edges = rounded_edges(HIST_EDGES[1:-1], self.dtype).to(self.device)
        self._layout = (all_names, np.array([d for d, _ in dk], dtype=np.int32),
                        [k for _, k in dk], slots)
        self._optimizer_id = id(optimizer)

    # -- per step --------------------------------------------------------------------
    def active(self, step: int) -> bool:
        return step % self.every == 0

    def hist_active(self, step: int) -> bool:
        return self.hist_every > 0 and step % self.hist_every == 0

    @torch.no_grad()
    def table(self, chunks, optimizer, step: int) -> Optional[np.ndarray]:
        """The all-reduced (num_tensors, NUM_SUMS [+ NUM_HIST_BINS]) float64 table of this
        step (collective: every rank calls it). None when the probe got disabled: a local
        error on any rank travels with the all-reduce (an extra row), so every rank
        disables at the same point."""
        if not self._ensure_layout(chunks, optimizer, step):
            return None
        names, _, _, slots = self._layout
        with_hist = self.hist_active(step)
        n_int = 3 + (NUM_HIST_BINS if with_hist else 0)
        acc = torch.float64 if self.dtype == torch.float64 or self.device.type != "npu" else self.dtype
        tf = torch.zeros((len(names) + 1, len(_FLOAT_COLS)), dtype=acc, device=self.device)
        ti = torch.zeros((len(names), n_int), dtype=torch.int64, device=self.device)
        if self._error is None:
            try:
                hp = hyper_params(optimizer)
                b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
                rows, fl, it = [], [], []
                for s in slots:
                    st = s.inner.state.get(s.main)
                    if not st or "exp_avg" not in st or s.main.grad is None:
                        continue   # no update this step (skipped iteration): rows stay 0
                    t = _step_of(st, s.group)
                    f, i = shard_sums(s.main.grad, st["exp_avg"], st["exp_avg_sq"], s.main,
                                      1 - b1 ** t, 1 - b2 ** t, b1, eps, t == 1, self.dtype,
                                      self.edges if with_hist else None)
                    rows.append(s.row)
                    fl.append(f)
                    it.append(i)
                if self.inject is not None:
                    self.inject("table", step)
                # one table per kind on the device: float sums, exact int64 counts
                if rows:
                    idx = torch.tensor(rows, dtype=torch.long, device=self.device)
                    tf.index_add_(0, idx, torch.stack(fl))
                    ti.index_add_(0, idx, torch.stack(it))
                if self.secant and self._sec_block is not None:
                    # the secant's block sums ride in the flag row's spare columns
                    tf[-1, 1:4] = self._sec_block.to(acc)
                    tf[-1, 4] = float(self._sec_n)
            except Exception as e:  # noqa: BLE001 - fail open
                self._fail(e, step)
        if self._error is not None:
            tf.zero_()
            ti.zero_()
            tf[-1, 0] = 1.0
        tf, ti = tf.cpu(), ti.cpu()      # the probe's collectives run on its gloo group
        if self.world > 1:
            if not self._collective(lambda: torch.distributed.all_reduce(tf, group=self._group()), step):
                return None
        if float(tf[-1, 0]) > 0:
            self._disable(step)
            return None
        if self.secant:      # this block's sums, summed over ranks; the next block starts
            self._sec_reading = tf[-1, _SECANT_COLS].to(torch.float64).numpy().copy()
            if self._sec_block is not None:
                self._sec_block.zero_()
            self._sec_n = 0
        if self.world > 1:
            if not self._collective(lambda: torch.distributed.all_reduce(ti, group=self._group()), step):
                return None
        tf, ti = tf[:-1].to(torch.float64).numpy(), ti.numpy()
        tab = np.zeros((len(names), NUM_SUMS + n_int - 3), dtype=np.float64)
        tab[:, _FLOAT_COLS] = tf
        tab[:, _INT_COLS] = ti[:, :3]
        tab[:, NUM_SUMS:] = ti[:, 3:]
        return tab

    def collect(self, chunks, optimizer, step: int) -> Optional[np.ndarray]:
        """Telemetry of `step` if it is logged: the table (every rank), written on the
        writer rank, and the predictions' alarm rules evaluated on it."""
        if not self.active(step) or self.disabled:
            return None
        t0 = time.perf_counter()
        tab = self.table(chunks, optimizer, step)
        reading, self._sec_reading = self._sec_reading, None
        if tab is not None and self.writer is not None:
            self.guarded("writer", step, self._write_table, optimizer, step, tab)
            if reading is not None:
                self.guarded("writer", step, self._write_secant, optimizer, step, reading)
        self.overhead_s += time.perf_counter() - t0
        return tab

    def _write_table(self, optimizer, step: int, tab: np.ndarray) -> None:
        names, depth, kind, _ = self._layout
        eps = hyper_params(optimizer)["eps"]
        sums = tab[:, :NUM_SUMS]
        ok = sums[:, 0] > 0      # tensors that were updated this step
        if not ok.any():
            return
        metrics = finalize(sums[ok], eps)
        sel = np.flatnonzero(ok)
        columns = {"name": [names[i] for i in sel], "depth": depth[sel],
                   "kind": [kind[i] for i in sel], "numel": sums[ok, 0].astype(np.int64),
                   **{k: np.asarray(metrics[k], dtype=np.float64) for k in METRIC_NAMES}}
        if self.inject is not None:
            self.inject("writer", step)
        self.writer.log_layers(step, columns=columns)
        if self._tb is None:
            self._tb = GroupScalars(self.out)
            if self._tb.wandb_error:          # asked for (ADAMSPIKE_WANDB=1): said once
                self._say(self._tb.wandb_error)
        self._tb.log(step, columns)
        if tab.shape[1] > NUM_SUMS:
            for i in sel:
                self.writer.log_hist(step, names[i], int(depth[i]), kind[i],
                                     np.rint(tab[i, NUM_SUMS:]).astype(np.int64))
        alarms = self.actions.alarms if self.actions is not None else None
        if alarms is not None:
            for alarm in alarms.log(self.writer, step, columns):
                self._say(f"step {step}: ALARM {alarm['rule']}: {alarm['metric']} = "
                          f"{alarm['value']:.4g} {_op(alarms, alarm['rule'])} {alarm['threshold']:g} "
                          f"({alarms.path})")

    def _write_secant(self, optimizer, step: int, reading: np.ndarray) -> None:
        """The block's `curvature` row (group "update"): q = sum num / sum den (the
        Rayleigh quotient of P^(1/2) H P^(1/2) along the block's updates; S_secant =
        lr q / 2) and sum num / sum uu (that of H), NaN where a denominator is not > 0;
        none when no step of the block was usable (simulate.program.secant_readings)."""
        num, den, uu, n = (float(x) for x in reading)
        if not n > 0:
            return
        q = num / den if den > 0 else math.nan
        raw = num / uu if uu > 0 else math.nan
        self.writer.log_curvature(step, "update", q, raw, hyper_params(optimizer)["lr"])

    # -- the online curvature proxy (S_secant) -----------------------------------------
    def _sec_reset(self) -> None:
        """Forget the previous step (a new layout, or the start): the next step only
        records its update."""
        self._sec_p: Optional[List[torch.Tensor]] = None    # owned main params after the last step
        self._sec_u: Optional[List[torch.Tensor]] = None    # u_{t-1} per slot
        self._sec_prev = None          # (g.u, u' P^-1 u, |u|^2) of u_{t-1}, this rank's part
        self._sec_prev_ok = False      # those are usable
        self._sec_layout = None        # the layout the buffers belong to

    @property
    def secant_on(self) -> bool:
        return self.secant and not self.disabled

    @torch.no_grad()
    def before_update(self, chunks, optimizer, step: int) -> None:
        """Inside train_step, before optimizer.step (every rank; the train_step wrapper):
        when the secant has no copy of the parameters yet, copy them now (p_t of this
        step), so this step's update already counts (as simulate.program's secant_init).
        Builds the layout first if it is missing (collective: every rank at the same step)."""
        if not self.secant_on or self._sec_p is not None:
            return
        t0 = time.perf_counter()
        try:
            if not self._ensure_layout(chunks, optimizer, step) or self._error is not None:
                return
            try:
                self._sec_start()
            except Exception as e:  # noqa: BLE001 - fail open
                self._sec_reset()
                self._fail(e, step)
        finally:
            self.overhead_s += time.perf_counter() - t0

    def _sec_start(self) -> None:
        slots = self._layout[3]
        self._sec_reset()
        self._sec_p = [s.main.detach().clone() for s in slots]
        self._sec_u = [torch.zeros_like(s.main) for s in slots]
        self._sec_layout = self._layout

    @torch.no_grad()
    def _secant_step(self, optimizer, step: int, skipped: bool, grad_norm) -> None:
        """Step t of the proxy, after optimizer.step (no collective; no host sync but
        reading Adam's step count, as `table` does; mirrors simulate.program.secant_update). The main parameters now hold p_{t+1}; s.main.grad
        the gradient g_t Adam consumed at p_t, clipped in place by Megatron's
        clip_grad_norm_fp32: its dot products are divided here by the clip factor
        min(1, clip / (grad_norm + 1e-6)) (main grads are unscaled: no loss scale). Adds
        this rank's part of

            (g_t - g_{t-1}) . u_{t-1} = g_t . u_{t-1} - g_{t-1} . u_{t-1},
            u_{t-1}' P_{t-1}^-1 u_{t-1},   |u_{t-1}|^2

        to the block sums, then keeps u_t = p_{t+1} - p_t, g_t . u_t, u_t' P_t^-1 u_t
        (P_t^-1 = (sqrt(v_hat_t) + eps) / c_t, c_t = (1 - b1) / ((1 + b1)(1 - b1^t))) and
        |u_t|^2. A step whose gradient is not known (skipped update, clipping on without a
        finite grad norm) adds nothing and neither does the next one (its g_{t-1} . u_{t-1}
        is unknown), so the block is never poisoned."""
        slots = self._layout[3]
        if self._sec_layout is not self._layout:
            self._sec_start()          # first step (or a new optimizer): only records u_t
            have_prev = False
        else:
            have_prev = True
        dtype = self.dtype
        acc = torch.float64 if dtype == torch.float64 or self.device.type != "npu" else dtype
        hp = hyper_params(optimizer)
        b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
        g_ok, unclip = not skipped, 1.0
        clip = _clip_grad(optimizer)
        if g_ok and clip:
            gn = math.nan if grad_norm is None else float(grad_norm)
            if math.isfinite(gn):
                f = min(1.0, clip / (gn + 1e-6))
                unclip = 1.0 / f if f < 1.0 else 1.0
            else:
                g_ok = False
        use = have_prev and self._sec_prev_ok and g_ok
        new_ok = have_prev and g_ok

        def dot(a, b):
            return torch.dot(a, b) if a.dtype == acc else (a * b).sum(dtype=acc)

        # the clip factor and P_t's scalars multiply the sums, not the elements:
        # u' P^-1 u = (sum u^2 sqrt(v) / sqrt(1 - b2^t) + eps |u|^2) / c_t
        num, gu, uu = [], [], []
        by_t: Dict[int, Tuple[list, list]] = {}   # Adam's step -> (u^2 . sqrt(v), |u|^2)
        for s, pp, u in zip(slots, self._sec_p, self._sec_u):
            p = s.main.detach()
            g = s.main.grad if g_ok else None     # None after a good step: no gradient, g = 0
            if g is not None:
                g = g.detach().reshape(-1).to(dtype)
            if use and g is not None:
                num.append(dot(g, u.reshape(-1).to(dtype)))
            torch.sub(p, pp, out=u)                # u_t
            pp.copy_(p)                            # p_{t+1} for the next step
            if not new_ok:
                continue
            uf = u.reshape(-1).to(dtype)
            if g is not None:
                gu.append(dot(g, uf))
            st = s.inner.state.get(s.main)
            if not st or "exp_avg_sq" not in st:
                new_ok = False                     # no Adam state yet: P_t unknown
                continue
            w = uf * uf
            part = by_t.setdefault(max(_step_of(st, s.group), 1), ([], []))
            part[0].append(dot(w, torch.sqrt(st["exp_avg_sq"].reshape(-1).to(dtype))))
            part[1].append(w.sum(dtype=acc))
            uu.append(part[1][-1])
        zero = torch.zeros((), dtype=acc, device=self.device)

        def total(xs):
            return torch.stack(xs).sum() if xs else zero

        if self._sec_block is None or self._sec_block.device != self.device \
                or self._sec_block.dtype != acc:
            self._sec_block = torch.zeros(3, dtype=acc, device=self.device)
        if use:
            self._sec_block += torch.stack([total(num) * unclip - self._sec_prev[0],
                                            self._sec_prev[1], self._sec_prev[2]])
            self._sec_n += 1
        if new_ok:
            upu = zero
            for t, (wv, ww) in by_t.items():
                c = (1 - b1) / ((1 + b1) * (1 - b1 ** t))
                upu = upu + (total(wv) / math.sqrt(1 - b2 ** t) + eps * total(ww)) / c
            self._sec_prev = torch.stack([total(gu) * unclip, upu, total(uu)])
        else:
            self._sec_prev = None
        self._sec_prev_ok = new_ok

    # -- actions: the loss / grad-norm rules and skip-step, before the update ----------
    @property
    def rules_on(self) -> bool:
        return self.actions is not None and bool(self.actions.rules) and not self.disabled

    @torch.no_grad()
    def _local_loss_grad(self, optimizer, losses, step: int) -> List[float]:
        """This rank's (sum of losses, count, owned sum of squared gradients) before the
        update: the loss values its loss functions returned this step, and the gradient
        Megatron's grad norm is computed from (param.main_grad, the reduced fp32 gradient
        of Megatron's DDP, or .grad) over the elements this rank owns."""
        ls = lc = 0.0
        if losses:                   # device tensors: one copy to the host per step, here
            pairs = torch.stack([torch.stack([torch.as_tensor(v).float().reshape(()).cpu()
                                              if not isinstance(v, torch.Tensor) else
                                              v.float().reshape(()), torch.as_tensor(c).float()
                                              .reshape(()).to(v.device if isinstance(v, torch.Tensor)
                                                              else "cpu")])
                                 for v, c in losses]).sum(0).tolist()
            ls, lc = pairs
        gsq = 0.0
        if "grad_norm" in self.actions.rules:
            acc = []
            for s in self._layout[3]:
                g = getattr(s.model, "main_grad", None)
                if g is None:
                    g = s.model.grad
                if g is None:
                    continue
                g = g.detach().reshape(-1)[s.start:s.stop].to(self.dtype)
                acc.append(torch.dot(g, g).reshape(1))
            if acc:
                gsq = float(torch.cat(acc).to(torch.float64).sum())
        if self.inject is not None:
            self.inject("pre_step", step)
        return [ls, lc, gsq]

    def pre_step(self, chunks, optimizer, losses, step: int) -> bool:
        """Before the optimizer update, on every rank (two small collectives): this step's
        loss and grad norm judged by the rules (adamspike.spikes, the offline rule);
        True: skip the update on every rank (the decision is all-reduced)."""
        if not self.rules_on:
            return False
        t0 = time.perf_counter()
        try:
            return self._pre_step(chunks, optimizer, losses, step)
        finally:
            self.overhead_s += time.perf_counter() - t0

    def _pre_step(self, chunks, optimizer, losses, step: int) -> bool:
        if not self._ensure_layout(chunks, optimizer, step):
            return False
        vals = [0.0, 0.0, 0.0]
        if self._error is None:
            try:
                vals = self._local_loss_grad(optimizer, losses, step)
            except Exception as e:  # noqa: BLE001 - fail open
                self._fail(e, step)
        vec = torch.tensor([0.0 if self._error is None else 1.0] + vals, dtype=torch.float64)
        if self.world > 1 and not self._collective(
                lambda: torch.distributed.all_reduce(vec, group=self._group()), step):
            return False
        if float(vec[0]) > 0:
            self._disable(step)
            return False
        want = 0.0
        if self._error is None:
            try:
                ls, lc, gsq = (float(x) for x in vec[1:])
                want = 1.0 if self._judge(optimizer, step, ls / lc if lc > 0 else None, gsq) else 0.0
            except Exception as e:  # noqa: BLE001 - fail open
                self._fail(e, step)
        dec = torch.tensor([0.0 if self._error is None else 1.0, want], dtype=torch.float64)
        if self.world > 1 and not self._collective(lambda: torch.distributed.all_reduce(
                dec, op=torch.distributed.ReduceOp.MAX, group=self._group()), step):
            return False
        if float(dec[0]) > 0:
            self._disable(step)
            return False
        if float(dec[1]) > 0:
            self.skips += 1
            what = self._fired_text or "a rule fired on another rank"
            self._skip_reason = f"probe: {what}"
            if self.rank == self.writer_rank:
                self._say(f"step {step}: {what}: optimizer update skipped on every rank "
                          f"({self.skips} of budget {self.actions.skip_budget}; "
                          f"{ENV_PREFIX}SKIP=0 turns skipping off)")
            return True
        return False

    def _judge(self, optimizer, step: int, loss: Optional[float], gsq: float) -> bool:
        """Feed the rules; events for the writer; True when the update should be skipped
        (a rule fired, skip-step on, budget left). Same inputs and state on every rank."""
        self._fired_text = ""
        if self._spikes is None:
            self._spikes = _SpikeRules(self.actions)
        scale = _loss_scale(optimizer)
        gn = None
        if "grad_norm" in self.actions.rules:
            gn = math.sqrt(gsq) / scale if gsq >= 0 else math.nan
            if not math.isfinite(gn) and scale != 1.0:
                gn = None    # fp16 overflow: Megatron's own skip handles it
        self.last_rule_inputs = (loss, gn)
        fired = self._spikes.update(loss, gn)
        if not fired:
            return False
        a = self.actions
        text = "; ".join(f"{f['metric'].replace('_', ' ')} spike {f['value']:.6g} > "
                         f"threshold {f['threshold']:.6g} (median {f['baseline']:.6g})"
                         if math.isfinite(f["value"]) else f"non-finite {f['metric'].replace('_', ' ')}"
                         for f in fired)
        self._fired_text = text
        skip = a.skip and self.skips < a.skip_budget
        action = "skip" if skip else ("none: skip budget spent" if a.skip else "none: skip-step off")
        for f in fired:
            self._pending.append(("spike", {"step": int(step), "rule": f"probe.{f['metric']}",
                                            "action": action, "reason": text, **f}))
        if a.recipe:
            self._pending.append(("_recipe", {"step": int(step), "reason": text}))
        if not skip:
            if a.skip and not self._budget_alarm:
                self._budget_alarm = True
                self._pending.append(("alarm", {"rule": "probe.skip_budget", "step": int(step),
                                                "metric": fired[0]["metric"],
                                                "value": fired[0]["value"],
                                                "threshold": fired[0]["threshold"],
                                                "skips": self.skips, "budget": a.skip_budget}))
                if self.rank == self.writer_rank:
                    self._say(f"step {step}: ALARM skip budget spent ({self.skips} of "
                              f"{a.skip_budget} updates skipped): {text}; the update is applied"
                              + ("; restart recipe: " + os.path.join(self.out, RECIPE)
                                 if a.recipe else ""))
            elif self.rank == self.writer_rank:
                self._say(f"step {step}: {text} ({action})")
        return skip

    # -- writer ----------------------------------------------------------------------
    def _open(self, optimizer, step: int, env_extra: dict, margs=None) -> None:
        if self.rank != self.writer_rank or self.writer is not None:
            return
        # the first step this job runs: the loaded checkpoint is the iteration before it
        self.storage = {**storage_info(margs, self.rank), "start_iteration": int(step) - 1}
        hp = hyper_params(optimizer)
        clip = _clip_grad(optimizer)
        config = {"optim": {"lr": hp["lr"], "b1": hp["b1"], "b2": hp["b2"], "eps": hp["eps"],
                            "weight_decay": hp["weight_decay"], "grad_clip": clip},
                  "telemetry": {"every": self.every, "hist_every": self.hist_every,
                                "precision": self.precision, "secant": self.secant,
                                "source": "fullscale.megatron_probe"}}
        for k, v in self.extra_config.items():
            config[k] = {**config.get(k, {}), **v} if isinstance(v, dict) else v
        env = {"python": sys.version.split()[0], "torch": torch.__version__,
               "numpy": np.__version__, "world_size": self.world, **env_extra}
        resume = step - 1 if os.path.exists(os.path.join(self.out, "run.json")) else None
        self.writer = open_writer(self.out, config=config, env=env,
                                  extra_meta={"probe": {"writer": "fullscale.megatron_probe"},
                                              "storage": self.storage},
                                  resume_from_step=resume, flush_every_s=self.flush_every_s,
                                  plain=self.plain)
        self.writer.event("start", step=step, world_size=self.world, storage=self.storage)
        if not self.storage["shared"]:
            self._say(f"no shared storage: the run directory {self.out} is on node "
                      f"{self.storage['host']} (rank {self.rank}) only; copy it from there to "
                      "analyse it, and the restart recipe's checkpoints follow --save-interval")

    def after_train_step(self, chunks, optimizer, step: int, *, loss: float = math.nan,
                         skipped: bool = False, grad_norm: float = math.nan,
                         step_time_s: float = math.nan, tokens: Optional[int] = None,
                         env_extra: Optional[dict] = None, margs=None) -> Optional[np.ndarray]:
        """The steps row of `step` (writer rank), the actions' events and, on logged steps,
        the telemetry (returns collect's table, or None). Never raises."""
        if self.disabled:
            return None
        t0 = time.perf_counter()
        reason, self._skip_reason = self._skip_reason, None
        self.guarded("writer", step, self._write_step, optimizer, step, loss, skipped,
                     grad_norm, step_time_s, tokens, env_extra or {}, reason, margs)
        self.overhead_s += time.perf_counter() - t0
        if self.secant_on:
            self._secant(chunks, optimizer, step, skipped, grad_norm)
        return None if skipped else self.collect(chunks, optimizer, step)

    def _secant(self, chunks, optimizer, step: int, skipped: bool, grad_norm) -> None:
        """Every step, every rank: the layout (collective once, where no telemetry or
        rule built it yet), then `_secant_step` (local; an error waits for the next
        collective like every other)."""
        t0 = time.perf_counter()
        try:
            if self._ensure_layout(chunks, optimizer, step):
                self.guarded("secant", step, self._secant_step, optimizer, step, skipped,
                             grad_norm)
        finally:
            self.overhead_s += time.perf_counter() - t0

    def _write_step(self, optimizer, step, loss, skipped, grad_norm, step_time_s, tokens,
                    env_extra, skip_reason, margs) -> None:
        self._open(optimizer, step, env_extra, margs)
        pending, self._pending = self._pending, []
        if self.writer is None:
            return
        clip = _clip_grad(optimizer)
        gn = float(grad_norm) if grad_norm is not None else math.nan
        self.writer.log_step(step=int(step), tokens=tokens, loss=float(loss),
                             lr=hyper_params(optimizer)["lr"], grad_norm=gn,
                             clipped=bool(clip and math.isfinite(gn) and gn > clip),
                             update_norm=math.nan, step_time_s=float(step_time_s),
                             skipped=bool(skipped))
        for kind, fields in pending:
            if kind == "_recipe":
                info = write_restart_recipe(self.out, fields["step"], fields["reason"], margs,
                                            self.actions, self.loop, storage=self.storage)
                self.writer.event("restart_recipe", **info)
            else:
                self.writer.event(kind, **fields)
        if skipped:
            self.writer.event("skip", step=int(step), reason=skip_reason or
                              "optimizer step not applied (loss-scale overflow or nan)")
        if self.inject is not None:
            self.inject("writer", step)

    def close(self) -> None:
        if self._tb is not None:
            try:
                self._tb.close()
            except Exception as e:  # noqa: BLE001 - at exit: one line, never a traceback
                self._say(f"closing the TensorBoard writer failed: {type(e).__name__}: {e}")
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception as e:  # noqa: BLE001 - at exit: one line, never a traceback
                self._say(f"closing the run directory failed: {type(e).__name__}: {e}")


def _clip_grad(optimizer) -> Optional[float]:
    for leaf in leaf_optimizers(optimizer):
        c = getattr(getattr(leaf, "config", None), "clip_grad", None)
        if c:
            return float(c)
    return None
