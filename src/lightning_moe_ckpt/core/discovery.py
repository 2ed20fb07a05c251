"""Discovery rules: which parameters (and slices) of any MoE model form which operator.

The rules need no configuration for the common layouts:

* **Blocks**: the shallowest ``ModuleList``/``ModuleDict`` with integer keys (``layers``,
  ``model.layers``, ``blocks``, ``h``; a pipeline stage's ``ModuleDict`` keeps the global
  indices) holds the transformer blocks; the key is the layer index.
* Inside a block, in this order:

  1. **ModuleList experts** (``...experts.<i>.<...>``, HF 4.x Mixtral's
     ``block_sparse_moe.experts.<i>``): operator ``<block>.<path>.experts.<i>``;
  2. **fused experts**: tensors that hold the experts on dim 0, cut into one slice per
     expert; slice ``e`` joins operator ``<...>.experts.<e>``. A tensor is cut only when
     its dim 0 agrees with the expert count the MoE module's router declares (the rows of
     the router's weight): parameters owned directly by a module named ``experts`` (HF
     transformers 5.x ``mlp.experts.gate_up_proj``/``down_proj``, torchtitan-style
     ``moe.experts.w1/w2/w3``), and any other tensor of at least two dimensions inside a
     module with a router whose dim 0 is the expert count (JetMoE's
     ``mlp.input_linear.weight`` [E, ...]: operator ``<...>.mlp.experts.<e>``) or, under
     ``experts``, a multiple of it (DBRX's ``ffn.experts.mlp.w1`` [E x I, H]: blocks of I
     rows per expert). A vector, or a tensor whose dim 0 agrees with no expert count,
     stays whole (one under ``experts`` with a warning naming it and both counts);
  3. **shared experts** (a path component ``shared_expert``, ``shared_experts`` or
     ``shared_expert_gate``): operator ``<block>.<path>.shared_experts``;
  4. **routers** (a path component ``gate`` or ``router``, with their bias/correction
     parameters): operator ``<block>.<path>.gate`` (``router`` keeps its name);
  5. everything else of the block (attention, norms, a dense MLP): ``<block>.attn``.

* Outside the blocks: parameters of ``nn.Embedding`` modules registered before the first
  block form ``embed``; the linear and normalization layers registered after the last
  block (final norm, output projection) form ``head``.

A user override (a mapping of ``fnmatch`` patterns on parameter names to operator names,
or a callable ``(name, param) -> operator name | None``) is consulted first and claims
whole parameters. A parameter that neither claims is an error naming it and showing the
override, never merged silently into a neighbour.

Persistent buffers (``state_dict`` entries that are not parameters) join an operator
too: the override's, else inside a block the one the rules above give their name, else
the one operator holding the parameters around them; a buffer without such an operator
is an error naming it.
"""

from __future__ import annotations

import fnmatch
import itertools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_moe_ckpt.core.operators import (
    BufferRef,
    Operator,
    OperatorKind,
    OperatorOverride,
    Part,
    expert_position,
    persistent_buffers,
)
from lightning_moe_ckpt.errors import ConfigError

_SHARED = frozenset({"shared_expert", "shared_experts", "shared_expert_gate"})
_ROUTER = frozenset({"gate", "router"})

Assignment = tuple[str, OperatorKind, int | None, int | None, Part]


class ShardedExperts:
    """Declared by a fused experts module that holds a contiguous block of the model's
    experts, ``[first_expert, first_expert + local_experts)`` (an expert-parallel shard,
    :class:`~lightning_moe_ckpt.parallel.fused_experts.ExpertShard`): discovery names its
    slices by their global expert ids."""

    first_expert: int
    local_experts: int
    global_experts: int


def _block_container(model: nn.Module) -> str | None:
    """Path of the module holding the blocks: the shallowest ModuleList/ModuleDict with
    integer keys (the one with most parameters on a tie)."""
    best: tuple[int, int, str] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.ModuleDict) or not len(module):
            continue
        if path.split(".")[-1] == "experts" or not all(k.isdigit() for k in module._modules):
            continue
        size = sum(p.numel() for p in module.parameters())
        rank = (path.count(".") if path else -1, -size, path)
        if best is None or rank < best:
            best = rank
    return None if best is None else best[2]


def _override_of(override: OperatorOverride | None) -> Callable[[str, nn.Parameter],
                                                               str | None]:
    if override is None:
        return lambda name, param: None
    if isinstance(override, Mapping):
        patterns = dict(override)
        for pattern, target in patterns.items():
            if not isinstance(target, str) or not target:
                raise ConfigError(f"operators[{pattern!r}]={target!r}: an override maps a "
                                  "parameter-name pattern to an operator name (a string)")

        def by_pattern(name: str, param: nn.Parameter) -> str | None:
            for pattern, target in patterns.items():
                if fnmatch.fnmatchcase(name, pattern):
                    return target
            return None
        return by_pattern
    if callable(override):
        user = override

        def checked(name: str, param: nn.Parameter) -> str | None:
            chosen = user(name, param)
            if chosen is not None and (not isinstance(chosen, str) or not chosen):
                raise ConfigError(f"the operators callable returned {chosen!r} for {name!r}; "
                                  "it must return an operator name (a string) or None")
            return chosen
        return checked
    raise ConfigError(f"operators={override!r} must be a mapping of parameter-name patterns "
                      "to operator names or a callable (name, param) -> operator name")


def unmatched_patterns(model: nn.Module, override: OperatorOverride | None) -> list[str]:
    """The patterns of a mapping ``override`` that match no parameter name of ``model``
    (a typo, or a part of the model another pipeline stage holds)."""
    if not isinstance(override, Mapping):
        return []
    names = [name for name, _ in model.named_parameters()]
    return [pattern for pattern in override
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names)]


@dataclass(frozen=True)
class _Fused:
    """A tensor holding experts on dim 0: its operators' prefix (``<...>.experts``), how
    many experts this rank holds and the global id of the first, and for experts stacked
    in blocks of rows (DBRX) their count."""

    prefix: str
    count: int
    first: int
    chunks: int | None = None


def _fused_experts(model: nn.Module, container: str | None) -> dict[str, _Fused]:
    """The tensors of the blocks that hold experts on dim 0 (see the module docstring,
    rule 2), by parameter name. This rank holds the experts of its shard: an
    expert-parallel shard's block, or the rows of a parameter sharded along dim 0 (FSDP2),
    each expert's slice whole when the shard boundaries fall between experts."""
    fused: dict[str, _Fused] = {}
    kept_whole: list[str] = []
    if container is None:
        return fused
    inside = [(path, module) for path, module in model.named_modules()
              if path.startswith(f"{container}.")]
    for path, module in inside:  # modules named experts first: they own their tensors
        if path.split(".")[-1] == "experts" and not isinstance(module, nn.ModuleList
                                                                | nn.ModuleDict):
            _experts_module(model, path, module, fused, kept_whole)
    for path, module in inside:
        declared = _router_rows(module)
        if declared is not None:
            _moe_module(path, module, declared, fused, kept_whole)
    if kept_whole:
        warnings.warn(
            f"tensor(s) under a fused experts module whose dim 0 is not the expert count "
            f"its router declares ({'; '.join(kept_whole)}): they are not cut into experts "
            "but checkpointed whole with the rest of their block (name another operator "
            "with SparseCheckpointing(..., operators=...))", UserWarning, stacklevel=4)
    return fused


def _experts_module(model: nn.Module, path: str, module: nn.Module,
                    fused: dict[str, _Fused], kept_whole: list[str]) -> None:
    """Rule 2 for the parameters a module named ``experts`` owns directly."""
    own = list(module.named_parameters(recurse=False))
    if not own:
        return  # a container: its children are the experts
    shard = module if isinstance(module, ShardedExperts) else None  # an EP shard's block
    scored = shard.local_experts if shard is not None else _router_outputs(model, path)
    cut = {}
    for name, param in own:
        total = param.shape[0] if param.dim() >= 2 else 0
        if total == 0 or (scored is not None and total != scored):
            kept_whole.append(f"{path}.{name} {tuple(param.shape)}: dim 0 holds "
                              f"{param.shape[0] if param.dim() else 0}, its router scores "
                              f"{scored} experts")
        else:
            cut[name] = param
    if len({p.shape[0] for p in cut.values()}) > 1:
        shapes = ", ".join(f"{path}.{n}: {tuple(p.shape)}" for n, p in cut.items())
        raise ConfigError(f"fused experts module {path!r} holds parameters that do not "
                          f"share an expert dimension 0 ({shapes}); assign them with "
                          "SparseCheckpointing(..., operators=...)")
    base = shard.first_expert if shard is not None else 0
    for name, param in cut.items():
        count, offset = _held_rows(param, f"{path}.{name}")
        fused[f"{path}.{name}"] = _Fused(path, count, base + offset)


def _moe_module(path: str, module: nn.Module, declared: int, fused: dict[str, _Fused],
                kept_whole: list[str]) -> None:
    """Rule 2 for the tensors of a module with a router declaring ``declared`` experts,
    outside its router, its shared experts and its lists of expert modules."""
    for name, param in module.named_parameters():
        full = f"{path}.{name}"
        segments = name.split(".")
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        if (full in fused or param.dim() < 2 or segments[0] in _ROUTER
                or isinstance(owner, ShardedExperts)
                or any(s in _SHARED for s in segments)
                or any(a == "experts" and b.isdigit() for a, b in itertools.pairwise(segments))):
            continue
        inside = segments.index("experts") + 1 if "experts" in segments[:-1] else 0
        if inside:
            prefix = ".".join([path, *segments[:inside]])
        else:  # the router's module is the experts' (JetMoE's attention experts) or holds them
            prefix = path if path.rpartition(".")[2] == "experts" else f"{path}.experts"
        rows = param.shape[0]
        if rows == declared:
            count, offset = _held_rows(param, full)
            fused[full] = _Fused(prefix, count, offset)
        elif inside and rows % declared == 0:
            if isinstance(param, DTensor):
                raise ConfigError(f"fused expert parameter {full!r} stacks {declared} experts "
                                  f"in blocks of {rows // declared} rows and is sharded: its "
                                  "experts are not whole on a rank; shard the model another "
                                  "way or name its operators with SparseCheckpointing(..., "
                                  "operators=...)")
            fused[full] = _Fused(prefix, declared, 0, chunks=declared)
        elif inside:
            kept_whole.append(f"{full} {tuple(param.shape)}: dim 0 holds {rows}, its "
                              f"router scores {declared} experts")


def _router_rows(module: nn.Module) -> int | None:
    """The expert count a module's router child declares: the rows of its first 2-D
    weight (``gate.weight``, ``router.gate.weight``, ``router.layer.weight``)."""
    for name, child in module.named_children():
        if name in _ROUTER:
            for param_name, param in child.named_parameters():
                if param_name.rpartition(".")[2] == "weight" and param.dim() == 2:
                    return int(param.shape[0])
    return None


def _held_rows(param: nn.Parameter, name: str) -> tuple[int, int]:
    """Rows of dim 0 this rank holds of ``param`` and the global index of the first: all
    of them, or a sharded parameter's (DTensor's) shard along dim 0."""
    if not isinstance(param, DTensor):
        return param.shape[0], 0
    local_shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements)
    if local_shape[1:] != tuple(param.shape[1:]):
        raise ConfigError(f"fused expert parameter {name!r} is sharded along a dimension "
                          f"other than its experts' ({param.placements}): its experts are "
                          "not whole on any rank; shard it along dim 0 (fully_shard does)")
    return local_shape[0], offset[0]


def _router_outputs(model: nn.Module, experts_path: str) -> int | None:
    """How many experts the router beside ``experts_path`` (or inside it) scores, or None
    when there is no such router to read (see :func:`_router_rows`)."""
    parent_path = experts_path.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    declared = _router_rows(parent)
    return declared if declared is not None else _router_rows(
        model.get_submodule(experts_path))


def _inside_block(block: str, layer: int, rest: str, param: nn.Parameter,
                  name: str, fused: Mapping[str, _Fused]) -> list[Assignment]:
    if name in fused:
        held = fused[name]
        return [(f"{held.prefix}.{held.first + e}", "expert", layer, held.first + e,
                 Part(name, param, e, held.chunks)) for e in range(held.count)]
    operator, kind, expert = _block_operator(block, rest)
    return [(operator, kind, layer, expert, Part(name, param))]


def _block_operator(block: str, rest: str) -> tuple[str, OperatorKind, int | None]:
    """Operator, kind and expert of the tensor at ``<block>.<rest>`` (not a fused expert
    tensor): ModuleList experts, then shared experts, routers, and the rest of the block."""
    parts = rest.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "experts" and parts[i + 1].isdigit() and i + 2 < len(parts):
            return ".".join([block, *parts[:i + 2]]), "expert", int(parts[i + 1])
    for i, part in enumerate(parts[:-1]):
        if part in _SHARED:
            return ".".join([block, *parts[:i], "shared_experts"]), "shared_experts", None
    for i, part in enumerate(parts[:-1]):
        if part in _ROUTER:
            return ".".join([block, *parts[:i + 1]]), "gate", None
    return f"{block}.attn", "attn", None


def _is_head_layer(module: nn.Module | None) -> bool:
    """An output projection or a (final) normalization layer."""
    return isinstance(module, nn.Linear | nn.Embedding) or (
        module is not None and "norm" in type(module).__name__.lower())


def _unclaimed(name: str) -> ConfigError:
    return ConfigError(
        f"parameter {name!r} belongs to no operator: no discovery rule claims it (blocks in "
        "a ModuleList/ModuleDict, experts, routers named gate/router, shared experts, "
        "embeddings before the blocks, the head after them). Assign it explicitly, e.g. "
        f"SparseCheckpointing(..., operators={{{name!r}: 'my_operator'}}) or "
        "operators=lambda name, param: 'my_operator' if ... else None")


def discover_operators(model: nn.Module,
                       override: OperatorOverride | None = None) -> list[Operator]:
    """The operators of ``model`` in model order (see the module docstring for the rules).

    Args:
        model: Any model, whole or one rank's part.
        override: Consulted first, claiming whole parameters: a mapping of ``fnmatch``
            patterns on parameter names to operator names, or a callable
            ``(name, param) -> operator name | None``; ``None``: the rules alone.

    Returns:
        The operators, in model order.

    Raises:
        ConfigError: The override is malformed, a parameter or buffer belongs to no
            operator, or a fused experts module's parameters do not share an expert
            dimension; the message names it.
    """
    claim = _override_of(override)
    container = _block_container(model)
    fused = _fused_experts(model, container)
    owners = {f"{path}.{n}" if path else n: module for path, module in model.named_modules()
              for n, _ in module.named_parameters(recurse=False)}
    named = list(model.named_parameters())
    in_blocks = [i for i, (name, _) in enumerate(named)
                 if container is not None and name.startswith(f"{container}.")]
    first, last = (in_blocks[0], in_blocks[-1]) if in_blocks else (len(named), -1)
    assignments: list[Assignment] = []
    for position, (name, param) in enumerate(named):
        chosen = claim(name, param)
        if chosen is not None:
            located = expert_position(chosen)
            kind: OperatorKind = "expert" if located else "other"
            assignments.append((chosen, kind, located[0] if located else None,
                                located[1] if located else None, Part(name, param)))
            continue
        if container is not None and name.startswith(f"{container}."):
            key, _, rest = name[len(container) + 1:].partition(".")
            assignments += _inside_block(f"{container}.{key}", int(key), rest, param, name,
                                         fused)
        elif isinstance(owners.get(name), nn.Embedding) and position < first:
            assignments.append(("embed", "embed", None, None, Part(name, param)))
        elif position > last and in_blocks and _is_head_layer(owners.get(name)):
            assignments.append(("head", "head", None, None, Part(name, param)))
        else:
            raise _unclaimed(name)
    grouped: dict[str, tuple[OperatorKind, int | None, int | None, list[Part]]] = {}
    for operator, kind, layer, expert, part in assignments:
        grouped.setdefault(operator, (kind, layer, expert, []))[3].append(part)
    kinds = {kind for kind, _, _, _ in grouped.values()}
    if "gate" in kinds and "expert" not in kinds:
        warnings.warn(
            "found routers but no experts: the expert weights sit under a name the discovery "
            "rules do not know (a ModuleList or fused module named 'experts'), so they are "
            "checkpointed whole with the rest of their block, not one expert at a time; "
            "name them with SparseCheckpointing(..., operators=...)", UserWarning,
            stacklevel=3)
    buffers = _assign_buffers(model, container, assignments, claim, set(grouped))
    return [Operator(name, kind, layer, expert, tuple(parts), tuple(buffers.get(name, ())))
            for name, (kind, layer, expert, parts) in grouped.items()]


def _assign_buffers(model: nn.Module, container: str | None, assignments: list[Assignment],
                    claim: Callable[[str, nn.Parameter], str | None],
                    operators: set[str]) -> dict[str, list[BufferRef]]:
    """Each persistent buffer joins an operator: the override's, else inside a block the
    operator the parameter rules give its name, else the one operator holding the
    parameters of its module (or, for a module without any, of the nearest ancestor
    with some). Which operator holds a buffer does not matter for exactness, only that
    one always does."""
    by_module: dict[str, set[str]] = {}  # module path -> operators of its subtree
    for operator, _, _, _, part in assignments:
        path = part.param_name
        while path:
            path = path.rpartition(".")[0]
            by_module.setdefault(path, set()).add(operator)
    assigned: dict[str, list[BufferRef]] = {}
    for buffer in persistent_buffers(model):
        chosen = claim(buffer.name, buffer.tensor)  # type: ignore[arg-type]
        if chosen is not None and chosen not in operators:
            raise ConfigError(
                f"the operator override assigns buffer {buffer.name!r} to {chosen!r}, which "
                f"holds no parameter; choose one of the operators ({len(operators)}), e.g. "
                f"{sorted(operators)[:3]}")
        if chosen is None and container is not None and buffer.name.startswith(f"{container}."):
            key, _, rest = buffer.name[len(container) + 1:].partition(".")
            chosen = _block_operator(f"{container}.{key}", rest)[0]
        if chosen is not None and chosen not in operators:  # a block of buffers only
            chosen = None
        assigned.setdefault(chosen or _buffer_owner(buffer.name, by_module), []).append(buffer)
    return assigned


def _buffer_owner(name: str, by_module: Mapping[str, set[str]]) -> str:
    path = name.rpartition(".")[0]
    while not by_module.get(path) and path:
        path = path.rpartition(".")[0]
    owners = by_module.get(path, set())
    if len(owners) != 1:
        raise ConfigError(
            f"buffer {name!r} belongs to no single operator (the parameters around it "
            f"belong to {', '.join(sorted(owners)[:4]) if owners else 'none'}); assign it "
            f"explicitly, e.g. SparseCheckpointing(..., operators={{{name!r}: "
            "'my_operator'}) with an operator that holds parameters")
    return next(iter(owners))
