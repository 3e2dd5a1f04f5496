"""What the trainer does with each evaluation: early stopping and the best model by eval loss.

spec.evaluation.earlyStopping stops training once `patience` evaluations in a row have not
improved the best eval loss by more than `minDelta`; spec.evaluation.keepBest makes the output
the model of the best evaluation instead of the last step's. Both must hold across attempts: an
attempt that resumes from a checkpoint continues the same count and the same best.

The history of evaluations (step, loss) is kept beside the checkpoints (`eval-history.json`, rank
0, written atomically after each evaluation). A resumed attempt keeps only the entries up to the
checkpoint it resumes from: the later ones belong to steps it trains again, and their
evaluations are made again. Every evaluation after the best is one that did not improve, so the
best and the count follow from the history alone. keepBest saves the model of each new best to
`<checkpoints>/best` (staged, then renamed) with its step, and the final output is taken from it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainerCallback

from .contract import EvaluationSettings
from .reporting import log_json

HISTORY_FILE = "eval-history.json"
BEST_DIR = "best"
BEST_META = "best-eval.json"


@dataclass
class EvalHistory:
    """Evaluations as (step, loss), in step order."""

    entries: list[tuple[int, float]] = field(default_factory=list)

    def up_to(self, step: int) -> "EvalHistory":
        return EvalHistory([(s, loss) for s, loss in self.entries if s <= step])

    def add(self, step: int, loss: float) -> None:
        self.entries = [(s, v) for s, v in self.entries if s < step] + [(step, loss)]

    def best(self, min_delta: float) -> tuple[int, float] | None:
        """The first evaluation that no later one improved on by more than `min_delta`."""
        best: tuple[int, float] | None = None
        for step, loss in self.entries:
            if best is None or loss < best[1] - min_delta:
                best = (step, loss)
        return best

    def without_improvement(self, min_delta: float) -> int:
        best = self.best(min_delta)
        return 0 if best is None else sum(1 for s, _ in self.entries if s > best[0])

    @classmethod
    def read(cls, path: Path) -> "EvalHistory":
        try:
            data = json.loads(path.read_text())
            return cls([(int(s), float(v)) for s, v in data["evaluations"]])
        except (OSError, ValueError, KeyError, TypeError):
            return cls()  # none yet, or unreadable: the count starts afresh (never a crash)

    def write(self, path: Path) -> None:
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps({"evaluations": self.entries}))
        os.replace(partial, path)


class EvalCallback(TrainerCallback):
    """Early stopping and the best model, from each evaluation's loss (every rank takes the same
    decision: the eval loss is reduced over the ranks before the callback sees it)."""

    def __init__(self, trainer, settings: EvaluationSettings, checkpoint_dir: str | None, resume_step: int | None):
        self.trainer = trainer
        self.settings = settings
        self.root = Path(checkpoint_dir) if checkpoint_dir else None
        history = EvalHistory.read(self.root / HISTORY_FILE) if self.root is not None else EvalHistory()
        # A fresh start (no checkpoint resumed) begins a new history even if an old one is there.
        self.history = history.up_to(resume_step) if resume_step is not None else EvalHistory()
        self.stopped_at: int | None = None
        if resume_step is not None and history.entries:
            best = self.history.best(self.min_delta)
            log_json("eval-history", resumedAt=resume_step, evaluations=len(self.history.entries),
                     bestStep=best[0] if best else None, bestEvalLoss=best[1] if best else None,
                     withoutImprovement=self.history.without_improvement(self.min_delta))

    @property
    def min_delta(self) -> float:
        stopping = self.settings.early_stopping
        return stopping.min_delta if stopping is not None else 0.0

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get("eval_loss")
        if loss is None:
            return
        step = state.global_step
        before = self.history.best(self.min_delta)
        self.history.add(step, float(loss))
        now = self.history.best(self.min_delta)
        if self.trainer.is_world_process_zero() and self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self.history.write(self.root / HISTORY_FILE)
        if self.settings.keep_best and now is not None and now[0] == step and now != before:
            self._save_best(step, float(loss))
        stopping = self.settings.early_stopping
        waited = self.history.without_improvement(self.min_delta)
        if stopping is not None and waited >= stopping.patience and step < state.max_steps:
            control.should_training_stop = True
            self.stopped_at = step
            if self.trainer.is_world_process_zero():
                log_json("early-stop", step=step, patience=stopping.patience, minDelta=stopping.min_delta,
                         bestStep=now[0] if now else None, bestEvalLoss=now[1] if now else None)

    def _save_best(self, step: int, loss: float) -> None:
        """The model as it is now, into <checkpoints>/best (every rank: a sharded save gathers)."""
        assert self.root is not None  # keepBest needs spec.checkpoint (the API says so)
        staging = self.root / f".{BEST_DIR}.staging"
        if self.trainer.is_world_process_zero() and staging.exists():
            shutil.rmtree(staging)
        self.trainer.save_model(str(staging))
        if self.trainer.is_world_process_zero():
            (staging / BEST_META).write_text(json.dumps({"step": step, "evalLoss": loss}))
            final = self.root / BEST_DIR
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            log_json("best-model", step=step, evalLoss=loss, path=str(final))
        barrier()

    def best(self) -> tuple[int, float] | None:
        return self.history.best(self.min_delta)

    def finish(self, facts, output_dir: str, last_step: int) -> None:
        """After the final save: the facts of the evaluations for the report, and with keepBest the
        output made the best evaluation's model (rank 0; the files of <checkpoints>/best)."""
        best = self.best()
        facts.best_eval_step, facts.best_eval_loss = best if best is not None else (None, None)
        facts.stopped_early_at = self.stopped_at
        if not self.settings.keep_best or best is None or not self.trainer.is_world_process_zero():
            return
        assert self.root is not None  # keepBest needs the checkpoint directory (the contract says so)
        facts.output_is_best = best[0] == last_step or take_best(str(self.root), output_dir, best[0])
        if facts.output_is_best:
            log_json("output", best=True, step=best[0], evalLoss=best[1])
        else:
            log_json("warning", message=f"keepBest: the best model (step {best[0]}) was not found in "
                                        f"{self.root / BEST_DIR}; the output is the last step's")


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def take_best(checkpoint_dir: str, output_dir: str, best_step: int) -> bool:
    """Make the output the best evaluation's model (rank 0, after the final save): its files replace
    those of the last step's. False when <checkpoints>/best is not that evaluation's."""
    best = Path(checkpoint_dir) / BEST_DIR
    try:
        meta = json.loads((best / BEST_META).read_text())
    except (OSError, ValueError):
        return False
    if int(meta.get("step", -1)) != best_step:
        return False
    output = Path(output_dir)
    for source in best.rglob("*"):
        if source.is_file():
            target = output / source.relative_to(best)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return True
