"""`MetricsLogger`: training metrics as JSON lines (always) and TensorBoard scalars (optional).

    with MetricsLogger("runs/x", tensorboard=True) as log:
        for ...:
            state, m = train_step(state, batch)
            log.log(int(m["step"]), {**m, "lr": learning_rate(schedule, m["updates"])})
        log.log(step, {"loss": held_out_loss}, split="eval")

`metrics.jsonl` holds one JSON object per `log` call, written and flushed at once (a killed run keeps
every line it wrote):

    {"step": 120, "split": "train", "time": 1733040000.5, "loss": 2.31, "lr": 0.0029, "grad_norm": 0.84, ...}

`step` is the `step` argument (an int; a "step" entry of `metrics` is ignored, pass it as the
argument), `split` names the row's kind ("train", "eval", or any name), `time` is the wall-clock
time (seconds since the epoch). Every metric value becomes a Python float: jax and numpy scalars
(one element), Python numbers and bools (1.0 / 0.0). A non-finite value is written as `null` (JSON
has no NaN or Infinity; strict readers such as `jq` reject them). Rows may carry different keys.

TensorBoard (`tensorboard=True`) goes through the maintained `tensorboardX` writer (the
`jmamba[tensorboard]` extra), into `<directory>/tensorboard`; each metric is the scalar
`<split>/<key>` (e.g. `train/loss`, `eval/loss`), with the non-finite values as they are.

Resuming: `resume_step=N` says the run continues after step N. Rows of later steps (written after the
last checkpoint by a run that was then killed) are dropped from the JSONL file, and TensorBoard
purges its events from step N + 1 on; `resume_step=0` starts an empty file. `None` (default) appends.

The learning rate is not part of the train step's metrics; `learning_rate(schedule, updates)` gives
the rate the last applied update used, and `learning_rate_from_opt_state(opt_state)` reads the one an
`optax.inject_hyperparams` optimizer stored.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Mapping, Optional

import jax
import numpy as np

JSONL_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
_RESERVED = ("step", "split", "time")


def _tensorboardx_writer():
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ImportError("MetricsLogger(tensorboard=True) needs the tensorboardX package: "
                          "pip install 'jmamba[tensorboard]' (or pip install tensorboardX)") from None
    return SummaryWriter


def tensorboard_available() -> bool:
    """True when `tensorboardX` can be imported (what `tensorboard=True` needs)."""
    try:
        _tensorboardx_writer()
    except ImportError:
        return False
    return True


def to_float(key, value) -> float:
    """A metric value as a Python float (jax/numpy scalars of one element, numbers, bools)."""
    if isinstance(value, (bool, np.bool_)):
        return float(bool(value))
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"metric {key!r} must be a number or a numeric scalar array, got "
                        f"{type(value).__name__} of dtype {arr.dtype}")
    if arr.size != 1:
        raise ValueError(f"metric {key!r} must be a scalar, got an array of shape {arr.shape}")
    return float(arr.reshape(()))


class MetricsLogger:
    """Writes `<directory>/metrics.jsonl` (and TensorBoard events with `tensorboard=True`).

    Args:
      directory: the run folder (created if missing).
      tensorboard: also write TensorBoard scalars with tensorboardX into `<directory>/tensorboard`
        (ImportError naming the `jmamba[tensorboard]` extra when it is not installed).
      filename: the JSONL file's name inside `directory`.
      resume_step: the run continues after this step: drop rows of later steps (and purge the
        TensorBoard events from resume_step + 1 on); 0 starts a new file; None appends to what is there.
    """

    def __init__(self, directory, *, tensorboard: bool = False, filename: str = JSONL_FILE,
                 resume_step: Optional[int] = None):
        if not isinstance(tensorboard, bool):
            raise TypeError(f"tensorboard must be a bool, got {type(tensorboard).__name__}")
        if resume_step is not None and (isinstance(resume_step, bool) or not isinstance(resume_step, (int, np.integer))
                                        or resume_step < 0):
            raise ValueError(f"resume_step must be None or an int >= 0, got {resume_step!r}")
        writer_cls = _tensorboardx_writer() if tensorboard else None   # fail before creating anything
        os.makedirs(directory, exist_ok=True)
        self.directory = str(directory)
        self.path = os.path.join(self.directory, filename)
        if resume_step is not None:
            self._drop_rows_after(int(resume_step))
        self._file = open(self.path, "a", encoding="utf-8")
        self._writer = None
        if writer_cls is not None:
            kwargs = {} if resume_step is None else {"purge_step": int(resume_step) + 1}
            self._writer = writer_cls(os.path.join(self.directory, TENSORBOARD_DIR), **kwargs)

    @property
    def tensorboard_dir(self) -> Optional[str]:
        return None if self._writer is None else os.path.join(self.directory, TENSORBOARD_DIR)

    def _drop_rows_after(self, step):
        if not os.path.isfile(self.path):
            return
        kept = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:   # a line cut short by a kill
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def log(self, step, metrics: Mapping, *, split: str = "train") -> dict:
        """Writes one row (flushed) and the TensorBoard scalars; returns the row as written."""
        if self._file is None:
            raise RuntimeError("this MetricsLogger is closed")
        if isinstance(step, bool) or np.ndim(step) != 0:
            raise TypeError(f"step must be an integer scalar, got {step!r}")
        step_f = float(np.asarray(step))
        if not step_f.is_integer():
            raise ValueError(f"step must be an integer, got {step!r}")
        if not isinstance(split, str) or not split:
            raise ValueError(f"split must be a non-empty string, got {split!r}")
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a dict of name -> scalar, got {type(metrics).__name__}")
        host = jax.device_get(dict(metrics))   # one transfer for all device scalars
        values = {}
        for key, value in host.items():
            if not isinstance(key, str):
                raise TypeError(f"metric names must be strings, got {key!r}")
            if key == "step":
                continue
            if key in _RESERVED:
                raise ValueError(f"{key!r} is a column of every row and cannot be a metric name")
            values[key] = to_float(key, value)
        row = {"step": int(step_f), "split": split, "time": time.time()}
        row.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, v in values.items():
                self._writer.add_scalar(f"{split}/{key}", v, int(step_f), walltime=row["time"])
            self._writer.flush()
        return row

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path, split: Optional[str] = None) -> list[dict]:
    """The rows of a metrics.jsonl file (or of the run folder holding one), optionally of one split.

    A line cut short by a kill is skipped. When a resumed run logged a step twice, the later row wins."""
    if os.path.isdir(path):
        path = os.path.join(path, JSONL_FILE)
    rows = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and (split is None or row.get("split") == split):
                rows[(row.get("split"), row.get("step"))] = row
    return sorted(rows.values(), key=lambda r: (r.get("step", 0), str(r.get("split"))))


# ------------------------------------------------------------------ the learning rate
def learning_rate(schedule, updates) -> float:
    """The learning rate the last applied optimizer update used, after `updates` updates.

    `schedule` is what the optax optimizer was built with: a schedule (`count -> lr`, e.g.
    `optax.warmup_cosine_decay_schedule(...)`) or a constant. optax evaluates the schedule at the
    count of updates made before the current one, so after `updates` updates the last one used
    `schedule(updates - 1)`; before any update this is the rate the first one will use, `schedule(0)`.
    Pass `TrainState.updates` or the train step's `metrics["updates"]`: skipped steps and
    `optax.MultiSteps` micro-steps do not advance the optimizer's count, and neither do they `updates`.
    """
    if not callable(schedule):
        return to_float("learning_rate", schedule)
    n = int(np.asarray(jax.device_get(updates)))
    return to_float("learning_rate", schedule(max(n - 1, 0)))


def learning_rate_from_opt_state(opt_state, name: str = "learning_rate") -> Optional[float]:
    """The `name` hyperparameter stored by `optax.inject_hyperparams` in `opt_state` (searched through
    chains, `optax.MultiSteps` and masks), or None when there is none. It is the value the last update
    used (the initial value before any update)."""
    found = []

    def visit(node):
        if found:
            return
        hp = getattr(node, "hyperparams", None)
        if isinstance(hp, Mapping) and name in hp:
            found.append(hp[name])
            return
        if isinstance(node, (list, tuple)):   # chains and the NamedTuple states (MultiStepsState, ...)
            for child in node:
                visit(child)
        elif isinstance(node, Mapping):
            for child in node.values():
                visit(child)

    visit(opt_state)
    return to_float(name, found[0]) if found else None
