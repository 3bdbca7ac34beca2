"""Online alarms: the rules of a predictions.json (`alarms.predictions`), evaluated by
`adamspike.predictions.OnlineAlarms` on each telemetry step's per-tensor columns. Fired
alarms become "alarm" events in the run directory (what `adamspike analyze --predictions`
scores for precision, recall and lead time).

Semantics are OnlineAlarms': a rule fires when its condition has held on `consecutive`
logged steps in a row and re-arms after it fails once. The run of consecutive steps is not
checkpointed: after a resume or a rollback a rule needs `consecutive` fresh steps again.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

from adamspike.predictions import OnlineAlarms, load_predictions


class Alarms:
    def __init__(self, predictions_path: str):
        self.path = str(predictions_path)
        self.rules = load_predictions(predictions_path).alarm_rules   # PredictionsError if bad
        self.online = OnlineAlarms(self.rules)
        for rule_id, reason in self.online.disarmed.items():   # said once, at start
            print(f"adamspike train: alarm rule {rule_id!r} not armed: {reason}", file=sys.stderr)

    def update(self, step: int, columns: Mapping[str, Any]) -> list[dict]:
        """Alarms firing at `step`: dicts with rule, step, metric, value, threshold."""
        return self.online.update(step, columns)

    def log(self, writer, step: int, columns: Mapping[str, Any]) -> list[dict]:
        fired = self.update(step, columns)
        for alarm in fired:
            writer.event("alarm", predictions=self.path, **alarm)
        return fired


def build_alarms(section) -> Alarms | None:
    """From an AlarmSection; None when no predictions file is configured."""
    return Alarms(section.predictions) if section.predictions else None
