"""Weight versions of one stage: the live parameters plus the stashed copies in-flight work needs.

Version `v` = the live weights after `v` optimizer steps of this stage. The schedule says
which version each Forward/Backward uses and when to stash (`StashWeights(v)`, just
before the step that would overwrite `v` while a later action still needs it) and free
(`FreeWeights(v)`, after its last use). The optimizer only ever updates the live tensors.

Two modes:
- direct (no StashWeights in the action list: gpipe, 1f1b): every Forward/Backward pair
  runs on the live version, so the stage module runs as is and autograd accumulates
  into the live `.grad`; no copies.
- stashed (pipedream, 2bw): a forward runs through `torch.func.functional_call` on a
  snapshot of its version (one clone per version, made at its first use), so the
  optimizer can update the live weights before the backward; the backward's gradient,
  computed on the snapshot, is added to the live `.grad`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class WeightVersionError(RuntimeError):
    """An action asked for a weight version this stage does not hold (a schedule bug)."""


class WeightVersions:
    def __init__(self, module: nn.Module, stashed_mode: bool) -> None:
        self.module = module
        self.live: dict[str, nn.Parameter] = dict(module.named_parameters())
        self.version = 0
        self.stashed_mode = stashed_mode
        self.snapshots: dict[int, dict[str, Tensor]] = {}
        self.stashed: set[int] = set()
        self.max_versions_held = 1

    def _check_live(self, version: int, what: str) -> None:
        if version != self.version:
            raise WeightVersionError(
                f"{what} asks for weight version {version}, but the live weights are version "
                f"{self.version} and the stash holds {sorted(self.snapshots)}"
            )

    def leaves(self, version: int) -> dict[str, Tensor] | None:
        """Parameters for a forward on `version`: None = run the module's live parameters."""
        if not self.stashed_mode:
            self._check_live(version, "a forward (direct mode)")
            return None
        if version not in self.snapshots:
            self._check_live(version, "a forward")
            # One copy of the stage's parameters per version (cost: parameter bytes).
            self.snapshots[version] = {n: p.detach().clone() for n, p in self.live.items()}
            self.max_versions_held = max(self.max_versions_held, len(self.snapshots) + 1)
        # Fresh leaves (no copy) so that .grad holds this microbatch's gradient only.
        return {
            n: t.detach().requires_grad_(self.live[n].requires_grad) for n, t in self.snapshots[version].items()
        }

    def accumulate(self, leaves: dict[str, Tensor]) -> None:
        """live.grad += leaf.grad for a backward that ran on a snapshot."""
        for n, leaf in leaves.items():
            g = leaf.grad
            if g is None:
                continue
            p = self.live[n]
            if p.grad is None:
                p.grad = g.detach().clone()
            else:
                p.grad.add_(g)

    def stash(self, version: int) -> None:
        """Keep `version` after the coming optimizer step (StashWeights)."""
        self._check_live(version, "StashWeights")
        if version not in self.snapshots:
            self.snapshots[version] = {n: p.detach().clone() for n, p in self.live.items()}
        self.stashed.add(version)
        self.max_versions_held = max(self.max_versions_held, len(self.snapshots) + 1)

    def free(self, version: int) -> None:
        if version not in self.stashed:
            raise WeightVersionError(f"FreeWeights({version}) but stashed versions are {sorted(self.stashed)}")
        self.stashed.discard(version)
        self.snapshots.pop(version, None)

    def stepped(self) -> None:
        """The optimizer updated the live weights: the old version survives only if stashed."""
        if self.version not in self.stashed:
            self.snapshots.pop(self.version, None)
        self.version += 1

    def grads(self) -> list[Tensor]:
        """The live gradients, zeros where a parameter got none (for all-reduce)."""
        out = []
        for p in self.live.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out
