"""Evaluation on the held-out split: when a run evaluates, how much it reads, what it reports.

An evaluation runs forward-only through the pipeline (`EvalForward` actions, see
`pdcli.schedule`) after the minibatch counts of `eval_points`: every
`train.eval_every` minibatches, before training with `train.eval_at_start`, and at the end.
It reads `num_eval_batches` minibatches of the held-out split (`pdcli.data.build_data(...,
split="eval")`) and reports the mean loss, the accuracy of a classifier (argmax over the
last dimension, over every target element) and, for token targets (a sequence per sample)
under cross-entropy, the perplexity exp(loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdcli.data.registry import build_data, num_eval_batches
from pdcli.errors import UserError
from pdcli.schedule import eval_points

if TYPE_CHECKING:
    from pdcli.config import Config
    from pdcli.data import BatchSource


@dataclass(frozen=True)
class EvalPlan:
    """The evaluations of a run."""

    points: tuple[int, ...]
    """Minibatch counts after which it evaluates (empty: never)."""
    num_batches: int
    """Held-out minibatches per evaluation."""
    source: "BatchSource | None"
    """The held-out split (None when it never evaluates)."""

    def num_microbatches(self, num_microbatches_per_minibatch: int) -> int:
        return self.num_batches * num_microbatches_per_minibatch


def plan_evaluation(cfg: "Config") -> EvalPlan:
    """The run's evaluations; UserError when the held-out split cannot fill one minibatch or
    holds fewer than `train.eval_batches` (an evaluation reads no example twice)."""
    if cfg.train.eval_batches == 0:
        return EvalPlan((), 0, None)
    source = build_data(cfg.data, cfg.data.batch_size, split="eval")
    num_batches, whole = num_eval_batches(source, cfg.train.eval_batches), num_eval_batches(source, None)
    if whole == 0:
        raise UserError(
            f"data: the held-out split of {cfg.data.name} has {source.num_examples} examples, fewer than one "
            f"minibatch (data.batch_size={cfg.data.batch_size})",
            hint="hold out more (data.eval_fraction, data.eval_path) or turn evaluation off (train.eval_batches=0)",
        )
    if source.num_examples is not None and num_batches > whole:  # it would read examples twice
        raise UserError(
            f"train.eval_batches: {num_batches} minibatches, but the held-out split of {cfg.data.name} holds "
            f"{whole} whole minibatches of {cfg.data.batch_size} ({source.num_examples} examples)",
            hint=f"set train.eval_batches={whole} or null (all of it)",
        )
    return EvalPlan(eval_points(cfg.train.steps, cfg.train.eval_every, cfg.train.eval_at_start), num_batches, source)


@dataclass
class EvalSums:
    """What the last stage adds up over the held-out microbatches of one evaluation."""

    loss_sum: float = 0.0
    num_microbatches: int = 0
    num_correct: int = 0
    """-1: not a classifier."""
    num_targets: int = 0
    num_samples: int = 0
    tokens: bool = False
    """Targets are sequences (cross-entropy per token): report the perplexity."""

    def as_list(self) -> list[float]:
        return [self.loss_sum, self.num_microbatches, self.num_correct, self.num_targets, self.num_samples]

    @staticmethod
    def from_list(values: list[float], classifier: bool, tokens: bool) -> "EvalSums":
        loss_sum, mbs, correct, targets, samples = values
        return EvalSums(loss_sum, int(mbs), int(correct) if classifier else -1, int(targets), int(samples), tokens)

    def metrics(self) -> dict[str, Any]:
        """`eval_loss` (mean over the microbatches, all of one size), `eval_accuracy`,
        `eval_perplexity` (token targets), `eval_samples`."""
        loss = self.loss_sum / max(self.num_microbatches, 1)
        out: dict[str, Any] = {"eval_loss": loss, "eval_samples": self.num_samples}
        if self.num_correct >= 0:
            out["eval_accuracy"] = self.num_correct / max(self.num_targets, 1)
        if self.tokens:
            out["eval_perplexity"] = math.exp(min(loss, 700.0))  # exp overflows a float past ~709
        return out


EVAL_KEYS = ("eval_loss", "eval_accuracy", "eval_perplexity")
"""The metrics an evaluation reports (metrics.jsonl, summary.json, the progress line, pd report)."""


def eval_metrics_text(metrics: dict[str, Any]) -> dict[str, str]:
    """The eval metrics of a metrics line or summary, formatted: {"eval_loss": "0.1234", ...}."""
    digits = {"eval_loss": ".4f", "eval_accuracy": ".3f", "eval_perplexity": ".2f"}
    return {k: format(float(metrics[k]), digits[k]) for k in EVAL_KEYS if metrics.get(k) is not None}


def is_eval_line(line: dict[str, Any]) -> bool:
    """A metrics.jsonl line of an evaluation during training (the end's goes into the final line)."""
    return "eval_loss" in line and not line.get("final")
