"""Helpers for tests that train through ``transformers.Trainer``: learnable synthetic text, the tiny runs' arguments,
and a free port for multi-process runs."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from hf_qknorm import upstream
from tests._support.tiny_models import VOCAB


class CountingText(torch.utils.data.Dataset):
    """Learnable synthetic text: each row counts upward from a random start with stride 1 or 2."""

    def __init__(self, n=48, seq=24, seed=0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 3, (n, 1), generator=g)
        self.rows = (start + stride * torch.arange(seq)[None]) % VOCAB

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def training_args(out, max_steps=6, **kw):
    """Trainer arguments for the tiny runs: CPU, seeded, a checkpoint every 3 steps; ``kw`` overrides any."""
    from transformers import TrainingArguments

    base = dict(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **upstream.checkpointing_arguments(use_reentrant=False),
    )
    return TrainingArguments(**{**base, **kw})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra: str) -> dict:
    """The environment of a test's multi-process launch (torchrun, accelerate launch): one thread a process, this
    checkout importable, and no CUDA device -- these launches test the CPU (gloo) path, and where a machine has fewer
    GPUs than the launch has processes, CUDA would refuse the second rank ("invalid device ordinal") or NCCL put two
    ranks on one device."""
    root = str(Path(__file__).resolve().parents[2])
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        **extra,
    }
