"""What a stage receives and sends, from its manifest entry: the message layout per peer stage.

Activations flow along the manifest's edges (a tensor may skip stages: 0 -> 2); gradients
flow back along the same edges, for floating-point tensors only. One message per
(microbatch, peer stage, direction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcli.runtime.comm import MessageLayout, TensorSpec

DATA_PEER = "data"
LOSS_PEER = "loss"


@dataclass(frozen=True)
class StageIO:
    stage_id: int
    input_names: tuple[str, ...]
    """Forward's positional inputs, in manifest order."""
    output_names: tuple[str, ...]
    """Forward's returned tuple, in manifest order."""
    data_inputs: dict[str, int]
    """Input name -> index into the data batch's inputs (`peer: data`)."""
    loss_output: str | None
    """The output the loss is computed on (last stage), else None."""
    acts_in: dict[int, MessageLayout]
    """Producer stage -> layout of the activations received from it."""
    acts_out: dict[int, MessageLayout]
    """Consumer stage -> layout of the activations sent to it."""
    grads_in: dict[int, MessageLayout]
    """Consumer stage -> layout of the gradients received from it (floating outputs)."""
    grads_out: dict[int, MessageLayout]
    """Producer stage -> layout of the gradients sent to it (floating inputs)."""

    def recv_bytes(self) -> dict[int, dict[str, int]]:
        """Peer stage -> message kind -> bytes of each message this stage receives from it:
        the only sizes a transport may accept (see `SocketTransport`)."""
        out: dict[int, dict[str, int]] = {}
        for producer, layout in self.acts_in.items():
            out.setdefault(producer, {})["activation"] = layout.num_bytes
        for consumer, layout in self.grads_in.items():
            out.setdefault(consumer, {})["gradient"] = layout.num_bytes
        return out

    @staticmethod
    def from_manifest(manifest: dict[str, Any], stage_id: int) -> "StageIO":
        entry = next(s for s in manifest["stages"] if s["stage_id"] == stage_id)
        model_inputs = list(manifest.get("model_inputs", []))
        data_inputs: dict[str, int] = {}
        recv: dict[int, list[TensorSpec]] = {}
        for t in entry["inputs"]:
            if t["peer"] == DATA_PEER:
                if t["name"] not in model_inputs:
                    raise ValueError(f"stage {stage_id}: data input {t['name']!r} not in model_inputs {model_inputs}")
                data_inputs[t["name"]] = model_inputs.index(t["name"])
            else:
                recv.setdefault(int(t["peer"]), []).append(TensorSpec.from_manifest(t))
        send: dict[int, list[TensorSpec]] = {}
        loss_output = None
        for t in entry["outputs"]:
            for peer in t["peers"]:
                if peer == LOSS_PEER:
                    loss_output = t["name"]
                else:
                    send.setdefault(int(peer), []).append(TensorSpec.from_manifest(t))

        def floating(specs: list[TensorSpec]) -> MessageLayout:
            return MessageLayout.of([s for s in specs if s.dtype.is_floating_point])

        return StageIO(
            stage_id=stage_id,
            input_names=tuple(t["name"] for t in entry["inputs"]),
            output_names=tuple(t["name"] for t in entry["outputs"]),
            data_inputs=data_inputs,
            loss_output=loss_output,
            acts_in={p: MessageLayout.of(s) for p, s in sorted(recv.items())},
            acts_out={p: MessageLayout.of(s) for p, s in sorted(send.items())},
            grads_in={p: floating(s) for p, s in sorted(send.items()) if floating(s).specs},
            grads_out={p: floating(s) for p, s in sorted(recv.items()) if floating(s).specs},
        )
