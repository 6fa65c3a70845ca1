"""Write one stage as an importable Python module: `class Stage<k>`, its forward, and `build()`.

How the modules are rebuilt (the choice, and why): the file constructs every leaf layer from
its constructor arguments (`torch.nn.Conv2d(in_channels=3, ...)`, see `ctor.py`) at the same
qualified path it had in the original model (`self.features.add_module("0", ...)`), under plain
`torch.nn.Module()` containers. So the stage's parameter names ARE the original names
(`features.0.weight`), a reader sees every layer's configuration, and `import stage_k;
build()` needs only torch in a fresh interpreter. Pickling the submodules into the .pt instead
would need `weights_only=False` loading (arbitrary code on load) and hide the structure.
The forward is fx's own code generation for the stage graph (`Graph.python_code`), indented
into the class; the globals fx's code refers to become import lines.
"""

from __future__ import annotations

import builtins
import inspect
import keyword
import re
from typing import Any, Iterable

import torch
import torch.fx as fx

from pdcli.compiler.ctor import constructor_source
from pdcli.compiler.split import DATA, StagePart, Wire
from pdcli.errors import UserError

_INDENT = "    "


def attr_expr(root: str, path: str) -> str:
    """Python expression for the attribute at dotted `path` under `root` (`getattr` for "0")."""
    expr = root
    for elem in path.split(".") if path else []:
        ok = elem.isidentifier() and not keyword.iskeyword(elem)
        expr = f"{expr}.{elem}" if ok else f'getattr({expr}, "{elem}")'
    return expr


def fetch(root: torch.nn.Module, path: str) -> Any:
    obj: Any = root
    for elem in path.split("."):
        obj = getattr(obj, elem)
    return obj


def _parent(path: str) -> tuple[str, str]:
    owner, _, name = path.rpartition(".")
    return owner, name


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(globals_: dict[str, Any], src: str) -> list[str]:
    lines = {"import torch"}
    for name, obj in sorted(globals_.items()):
        if not re.search(rf"(?<!\.)\b{re.escape(name)}\b(?!\s*=(?!=))", src):
            continue  # fx lists its builtins whether or not the code uses them (`device = x` is a kwarg)
        if name in fx.graph._custom_builtins:  # inf, nan, torch, device ... fx's own names
            lines.add(fx.graph._custom_builtins[name].import_str)
        elif getattr(builtins, name, None) is obj:
            continue
        elif inspect.ismodule(obj):
            lines.add(f"import {obj.__name__} as {name}")
        else:
            module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
            if not module or module == "__main__" or "." in qualname or "<" in qualname:
                raise UserError(
                    f"the stage code calls {obj!r}, which cannot be imported by name",
                    hint="define the function at the top level of an importable module",
                )
            lines.add(f"from {module} import {qualname} as {name}" if qualname != name else f"from {module} import {name}")
    return sorted(lines, key=lambda s: (not s.startswith("import"), s))


def _tensor_source(t: torch.Tensor) -> str:
    return f"torch.empty({tuple(t.shape)!r}, dtype={t.dtype})"


def _module_lines(part: StagePart, gm: fx.GraphModule, state_keys: set[str]) -> list[str]:
    """The body of __init__: containers, leaf layers, functional params/buffers, tied params."""
    graph = part.module.graph
    # In order of first use, so __init__ reads in the same order as forward.
    leaves = list(dict.fromkeys(str(n.target) for n in graph.nodes if n.op == "call_module"))
    attrs = list(dict.fromkeys(str(n.target) for n in graph.nodes if n.op == "get_attr"))
    lines: list[str] = []
    made: set[str] = set(leaves)
    for path in leaves + attrs:
        for prefix in _prefixes(path):
            if prefix not in made:
                owner, name = _parent(prefix)
                lines.append(f'{attr_expr("self", owner)}.add_module("{name}", torch.nn.Module())')
                made.add(prefix)
        if path in leaves:
            owner, name = _parent(path)
            source = constructor_source(gm.get_submodule(path))
            lines.append(f'{attr_expr("self", owner)}.add_module("{name}", {source})')
            continue
        owner, name = _parent(path)
        if owner in leaves:
            continue  # a weight of a layer this stage already builds
        value = fetch(gm, path)
        target = attr_expr("self", owner)
        if isinstance(value, torch.nn.Parameter):
            grad = "" if value.requires_grad else ", requires_grad=False"
            lines.append(
                f'{target}.register_parameter("{name}", torch.nn.Parameter({_tensor_source(value)}{grad}))'
            )
        elif isinstance(value, torch.Tensor):
            # Persistent iff the model's state dict has it: fx's GraphModule re-registers root
            # buffers as persistent, and its tensor constants (`_tensor_constant0`) are not
            # the model's at all. Non-persistent values still travel in the .pt.
            persistent = path in state_keys
            lines.append(
                f'{target}.register_buffer("{name}", {_tensor_source(value)}, persistent={persistent})'
            )
        else:
            raise UserError(f"stage {part.stage_id} reads {path!r}, which is a {type(value).__name__}, not a tensor")
    lines += _tie_lines(stage_tensors(part, gm))
    return lines


def stage_tensors(part: StagePart, gm: fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """(original name, tensor) of every parameter/buffer the stage holds, tied ones repeated."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    for node in part.module.graph.nodes:
        if node.op == "call_module" and node.target not in seen:
            seen.add(str(node.target))
            module = gm.get_submodule(str(node.target))
            out += [
                (f"{node.target}.{n}", t)
                for n, t in [
                    *module.named_parameters(remove_duplicate=False),
                    *module.named_buffers(remove_duplicate=False),
                ]
            ]
    for node in part.module.graph.nodes:
        if node.op == "get_attr" and node.target not in seen and not any(n == node.target for n, _ in out):
            seen.add(str(node.target))
            out.append((str(node.target), fetch(gm, str(node.target))))
    return out


def _tie_lines(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """`self.b.weight = self.a.weight` for parameters the original model shares."""
    first: dict[int, str] = {}
    lines = []
    for name, t in tensors:
        if id(t) in first:
            lines.append(f"{attr_expr('self', name)} = {attr_expr('self', first[id(t)])}  # tied in the model")
        else:
            first[id(t)] = name
    return lines


def _describe_wires(items: Iterable[tuple[Wire, str]]) -> str:
    return ", ".join(f"{w.name} {list(w.shape)} {str(w.dtype).removeprefix('torch.')} {where}" for w, where in items) or "-"


def stage_source(part: StagePart, gm: fx.GraphModule, num_stages: int, state_keys: set[str]) -> str:
    """The text of `stage_<k>.py` for `part` (a stage of `gm`); `state_keys` are the names in
    the original model's state dict (what is persistent)."""
    k = part.stage_id
    code = part.module.graph.python_code(root_module="self")
    forward = [(_INDENT + line.rstrip()) if line.strip() else "" for line in code.src.strip().splitlines()]
    receives = _describe_wires(
        (i.wire, "from data" if i.peer == DATA else f"from stage {i.peer}") for i in part.inputs
    )
    sends = _describe_wires((o.wire, "to " + ", ".join(map(str, o.peers))) for o in part.outputs)
    notes = []
    if part.recomputed:
        notes.append(f"Recomputed here (shape queries): {', '.join(part.recomputed)}.")
    if part.baked:
        notes.append(f"Baked in as constants of the microbatch shape: {', '.join(part.baked)}.")
    doc = [
        f'"""Stage {k} of {num_stages} of {type(gm).__name__}: chain positions [{part.start}, {part.end}).',
        "",
        f"Receives: {receives}.",
        f"Sends: {sends}.",
        *notes,
        "Generated by `pd compile`; weights are in the .pt beside it, keyed by the original names.",
        '"""',
    ]
    init = [_INDENT * 2 + line for line in ["super().__init__()", *_module_lines(part, gm, state_keys)]]
    return "\n".join(
        [
            *doc,
            "",
            *_imports(code.globals, code.src),
            "",
            "",
            f"class Stage{k}(torch.nn.Module):",
            f'{_INDENT}"""forward(*inputs) takes the manifest\'s inputs in order, returns its outputs as a tuple."""',
            "",
            f"{_INDENT}def __init__(self) -> None:",
            *init,
            "",
            *forward,
            "",
            "",
            f"def build() -> Stage{k}:",
            f'{_INDENT}"""Stage {k} with fresh weights; `pdcli.compiler.load_stage` loads the trained ones."""',
            f"{_INDENT}return Stage{k}()",
            "",
        ]
    )
