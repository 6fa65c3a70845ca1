"""Weight versions of one stage: the live parameters plus the stashed versions in-flight work needs.

Version `v` = the live weights after `v` optimizer steps. The schedule says which version
each Forward/Backward uses and when to stash (`StashWeights(v)`, just before the step that
would overwrite `v` while a later action still needs it) and free (`FreeWeights(v)`,
after its last use). The optimizer only ever updates the live parameters.

Two modes:
- direct (no StashWeights in the action list: gpipe, 1f1b): every Forward/Backward pair
  runs on the live version, so the stage module runs as is and autograd accumulates
  into the live `.grad`; no copies.
- stashed (pipedream, 2bw): a forward runs through `torch.func.functional_call` on the
  tensors of its version, so the optimizer can update the live weights before the
  backward; the backward's gradient, computed on those tensors, becomes the live `.grad`.

Versions are kept by reference, copy-on-update: a version's tensors are aliases of the
storage it lives in (the live parameters' own storage while it is the live version), so a
forward on the live version copies nothing. A stashed version must survive the next
optimizer step: either the step writes its result into fresh storage
(`out_of_place_updates=True`, see `pdcli.torchutil.optim.step_out_of_place`; no copy at
all) or `stash` moves the live parameters onto a copy (one copy of the parameter bytes
per stashed version) and the old storage stays with the stash.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class WeightVersionError(RuntimeError):
    """An action asked for a weight version this stage does not hold (a schedule bug)."""


def alias(t: Tensor) -> Tensor:
    """A tensor on `t`'s storage with its OWN version counter: an in-place update of a live
    parameter that has moved to other storage must not mark the stashed tensors modified."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


class WeightVersions:
    def __init__(self, module: nn.Module, stashed_mode: bool, out_of_place_updates: bool = False) -> None:
        self.module = module
        self.live: dict[str, nn.Parameter] = dict(module.named_parameters())
        self.version = 0
        self.stashed_mode = stashed_mode
        self.out_of_place_updates = out_of_place_updates
        self.snapshots: dict[int, dict[str, Tensor]] = {}
        """version -> its tensors; the live version's alias the live parameters."""
        self.stashed: set[int] = set()
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.live.values())
        self.max_versions_held = 1
        self.peak_stashed_bytes = 0

    @property
    def stashed_bytes(self) -> int:
        """Bytes of the versions held apart from the live one (each is a full parameter set)."""
        return self.param_bytes * sum(1 for v in self.snapshots if v != self.version)

    def _note(self) -> None:
        held = 1 + sum(1 for v in self.snapshots if v != self.version)
        self.max_versions_held = max(self.max_versions_held, held)
        self.peak_stashed_bytes = max(self.peak_stashed_bytes, self.stashed_bytes)

    def _check_live(self, version: int, what: str) -> None:
        if version != self.version:
            raise WeightVersionError(
                f"{what} asks for weight version {version}, but the live weights are version "
                f"{self.version} and the stash holds {sorted(self.snapshots)}"
            )

    def _hold_live(self) -> None:
        if self.version not in self.snapshots:
            self.snapshots[self.version] = {n: alias(p.detach()) for n, p in self.live.items()}

    def leaves(self, version: int) -> dict[str, Tensor] | None:
        """Parameters for a forward on `version`: None = run the module's live parameters."""
        if not self.stashed_mode:
            self._check_live(version, "a forward (direct mode)")
            return None
        if version not in self.snapshots:
            self._check_live(version, "a forward")
            self._hold_live()
        # Fresh leaves (no copy) so that .grad holds this microbatch's gradient only.
        return {
            n: t.detach().requires_grad_(self.live[n].requires_grad) for n, t in self.snapshots[version].items()
        }

    def accumulate(self, leaves: dict[str, Tensor]) -> None:
        """live.grad += leaf.grad for a backward that ran on a version's tensors."""
        for n, leaf in leaves.items():
            g = leaf.grad
            if g is None:
                continue
            p = self.live[n]
            if p.grad is None:
                p.grad = g.detach()  # the leaf is this microbatch's own: take its gradient, no copy
            else:
                p.grad.add_(g)

    def stash(self, version: int) -> None:
        """Keep `version` after the coming optimizer step (StashWeights)."""
        self._check_live(version, "StashWeights")
        self._hold_live()
        if not self.out_of_place_updates:
            # The step will update in place: move the live parameters onto a copy, the stash
            # keeps the storage the forwards on this version used (cost: parameter bytes).
            with torch.no_grad():
                for p in self.live.values():
                    p.data = p.detach().clone()
        self.stashed.add(version)

    @property
    def must_update_out_of_place(self) -> bool:
        """True when the coming optimizer step must not write into the live storage."""
        return self.out_of_place_updates and self.version in self.stashed

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
        self._note()

    def grads(self) -> list[Tensor]:
        """The live gradients, zeros where a parameter got none (for all-reduce)."""
        out = []
        for p in self.live.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out
