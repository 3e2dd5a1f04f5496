"""What an attempt trained on, written beside its output: every dataset file with its sha256, the
records and tokens, the base model's config digest.

The operator keeps the rest of the job's record (every attempt's plan, pool, region, nodes, image,
GPU-hours; finetune_operator.provenance) and gets this attempt's digests from the success report.
The file here is the part only the trainer can write: the file list may be long, and it belongs with
the weights it produced (it goes wherever the output goes: the PVC, or the upload to object storage).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .contract import TrainerConfig, TrainingFacts
from .data import dataset_files

CHUNK = 1 << 20
RECORD_DIRECTORY = "provenance"


@dataclass(frozen=True)
class FileDigest:
    name: str  # relative to the dataset path (the file's own name for a single file)
    sha256: str
    bytes: int


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def dataset_digests(path: str | Path) -> list[FileDigest]:
    """Every file the dataset path stands for (data.dataset_files), hashed."""
    root = Path(path)
    files = dataset_files(root)
    base = root if root.is_dir() else root.parent
    return [FileDigest(str(f.relative_to(base)), sha256_of(f), f.stat().st_size) for f in files]


def combined_digest(files: list[FileDigest]) -> str:
    """One digest for the whole dataset: sha256 over `name sha256` lines in file order, so a renamed,
    added, removed or changed file changes it."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name} {f.sha256}\n".encode())
    return digest.hexdigest()


def config_digest(model_path: str | Path) -> str | None:
    config = Path(model_path) / "config.json"
    return sha256_of(config) if config.is_file() else None


@dataclass
class AttemptFacts:
    """Collected while the attempt runs: the dataset when it is read, tokens and loss at the end."""

    files: list[FileDigest]
    base_config_sha256: str | None
    records: int
    examples: int
    held_out: int = 0
    tokens: int = 0
    final_loss: float | None = None
    eval_loss: float | None = None
    eval_files: list[FileDigest] = field(default_factory=list)  # spec.evaluation.dataset's, when separate
    eval_examples: int = 0
    best_eval_step: int | None = None
    best_eval_loss: float | None = None
    stopped_early_at: int | None = None
    output_is_best: bool | None = None

    @classmethod
    def read(cls, cfg: TrainerConfig, records: int, examples: int) -> "AttemptFacts":
        return cls(dataset_digests(cfg.dataset.path), config_digest(cfg.model.path), records, examples)

    def read_eval(self, path: str, examples: int) -> None:
        self.eval_files, self.eval_examples = dataset_digests(path), examples

    def summary(self) -> TrainingFacts:
        return TrainingFacts(base_config_sha256=self.base_config_sha256, dataset_sha256=combined_digest(self.files),
                             dataset_files=len(self.files), dataset_bytes=sum(f.bytes for f in self.files),
                             records=self.records, examples=self.examples, held_out=self.held_out,
                             tokens=self.tokens, final_loss=self.final_loss, eval_loss=self.eval_loss,
                             eval_dataset_sha256=combined_digest(self.eval_files) if self.eval_files else None,
                             eval_examples=self.eval_examples or None, best_eval_step=self.best_eval_step,
                             best_eval_loss=self.best_eval_loss, stopped_early_at=self.stopped_early_at,
                             output_is_best=self.output_is_best)


def write_attempt_record(cfg: TrainerConfig, facts: AttemptFacts, steps: int) -> Path:
    """<output>/provenance/attempt-N.json; rank 0 writes it, after the model is saved."""
    directory = Path(cfg.output_directory) / RECORD_DIRECTORY
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"attempt-{cfg.attempt}.json"
    record = {
        "job": cfg.job_name,
        "attempt": cfg.attempt,
        "finishedAt": round(time.time(), 3),
        "host": socket.gethostname(),  # the pod's name under Kubernetes; the operator records the nodes
        "worldSize": int(os.environ.get("WORLD_SIZE", "1")),
        "steps": steps,
        "method": cfg.method,
        "strategy": cfg.strategy,
        "summary": facts.summary().model_dump(mode="json", by_alias=True, exclude_none=True),
        "datasetFiles": [asdict(f) for f in facts.files],
    }
    if facts.eval_files:
        record["evalDatasetFiles"] = [asdict(f) for f in facts.eval_files]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)  # a reader never sees half a record
    return path
