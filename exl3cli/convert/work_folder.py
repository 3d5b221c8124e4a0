"""A conversion's work folder: the job it belongs to and its resumable checkpoints.

``job.json`` holds the source and options of the conversion (a ``--resume`` with other
settings is refused); each finished layer is ``layer-NNNN.safetensors`` (its stored
tensors, its report as JSON metadata), written atomically so a killed run leaves
whole files only (pipeline.py).

Public API:
- ``JOB_FILE``; ``finished_layers(work_dir) -> list[Path]``.
- ``prepare_work_dir(work_dir, job, resume, force=False)``: keep it (``resume`` and the
  same job), else start it afresh; finished layers are deleted only with ``force``
  (ConversionError otherwise).
- ``atomic_save(tensors, path, metadata)``; ``load_checkpoint(path) -> (tensors,
  report dict)``; ``module_tensors(tensors, module) -> {suffix: tensor}``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from exl3cli.errors import ConversionError

JOB_FILE = "job.json"


def atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(str(path), "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        meta = json.loads(handle.metadata()["report"])
    return tensors, meta


def module_tensors(tensors: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    prefix = module + "."
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def finished_layers(work_dir: Path) -> list[Path]:
    """The layer checkpoints an earlier run of a conversion left in `work_dir`."""
    return sorted(Path(work_dir).glob("layer-*.safetensors")) if Path(work_dir).is_dir() else []


def prepare_work_dir(work_dir: Path, job: dict, resume: bool, force: bool = False) -> None:
    job_path = work_dir / JOB_FILE
    if resume and job_path.is_file():
        previous = json.loads(job_path.read_text(encoding="utf-8"))
        if previous != job:
            raise ConversionError(
                f"--resume: the work folder {work_dir} belongs to a conversion with other "
                "settings; start again with --force (drops its finished layers)")
        return
    done = finished_layers(work_dir)
    if done and not force:
        raise ConversionError(
            f"the work folder {work_dir} holds {len(done)} finished layer(s) of an earlier "
            "conversion; add --resume to continue it, or --force to delete them and start "
            "over")
    if work_dir.exists():
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True)
    job_path.write_text(json.dumps(job, indent=2, sort_keys=True), encoding="utf-8")
