"""Crash rehearsal hooks: kill this process (SIGKILL, as a node failure would) at a named
point of the code, for the crash-consistency tests and for users rehearsing a resume.

    ADAMSPIKE_KILL_AT="checkpoint.write@12"          this process, at step 12's save
    ADAMSPIKE_KILL_AT="rundir.flush@8:1,step@20"      rank 1 inside step 8's flush; any rank
                                                     after step 20

Each entry is `point@step[:rank]`. The points:
- "step": after step `step` is logged, before its checkpoint;
- "rundir.flush": inside a flush of the run directory (the steps part is written, the
  layers and hists parts are not), here the flush before checkpoint `step`;
- "checkpoint.write": inside the save of checkpoint `step`, after the RNG and trainer files
  and before DCP writes model and optimizer (the checkpoint stays `.partial`);
- "checkpoint.marked": after checkpoint `step` is complete (COMPLETE written, directory
  renamed), before the trainer logs it and continues;
- "checkpoint.load": before checkpoint `step` is verified and loaded (a resume or rollback
  that dies early).
The rank is the torch.distributed rank from the environment (RANK, default 0). Unset, a
`kill_point` costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "ADAMSPIKE_KILL_AT"
POINTS = ("step", "rundir.flush", "checkpoint.write", "checkpoint.marked", "checkpoint.load")


def _parse(spec: str) -> dict[tuple[str, int], int | None]:
    out: dict[tuple[str, int], int | None] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, rest = item.partition("@")
        step, _, rank = rest.partition(":")
        if point not in POINTS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{ENV}: bad entry {item!r} (expected point@step[:rank], points: "
                             f"{', '.join(POINTS)})")
        out[(point, int(step))] = int(rank) if rank else None
    return out


_parsed: dict[str, dict[tuple[str, int], int | None]] = {}


def kill_point(point: str, step: int) -> None:
    """SIGKILL this process if ADAMSPIKE_KILL_AT names (point, step) for its rank."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    if spec not in _parsed:
        _parsed[spec] = _parse(spec)
    targets = _parsed[spec]
    if (point, int(step)) not in targets:
        return
    rank = targets[(point, int(step))]
    if rank is None or rank == int(os.environ.get("RANK", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
