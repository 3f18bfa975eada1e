"""Imports inside `jaxscale/` go one way: no module-level cycle, no import of a higher layer.

Every module's imports are read with `ast`, module-level and function-level alike (a lazy import
inside a function still ties the two modules together; so does one under `TYPE_CHECKING`).

The layers, lowest first. A package (or top-level module) imports only packages of lower layers;
packages of the same layer are peers and import none of each other, so no two packages import
each other either.

 0. `errors`, `hardware`, `compat`, `__init__`: error types and tables of facts (peak
    FLOP/s, the version, what differs between the supported jax / flax / orbax
    versions). They import nothing of jaxscale.
 1. `storage`, `runtime`, `precision`, `optim`, `mesh`, `rules`: one concern each (bytes at a
    location, process start-up and pre-emption, precision policies, optimizers by name, the
    device mesh, logical-axis rules and their presets).
 2. `data`, `models`: the input pipeline; model code, which knows only logical axis names and
    nothing of training, checkpoints or Lo-Fi.
 3. `parallel`, `observe`, `objectives`: pipeline schedules and accumulation over a model's
    layers; metrics, progress, loggers, throughput and profiling, which the loop writes to (so
    below train; what builds a step to report on it belongs above train); the training
    objectives (next token, preference pairs against a reference model), which use a model's
    task and know nothing of where the reference's weights live (the train state does).
 4. `config_fields` (a config's field names and value kinds against a reference), then
    `config`: the base config and `validate`, which asks the packages below for their names
    (presets, remat policies, attention kinds, loggers, data files). The loop, the planner and
    Lo-Fi read and validate configs, so config sits below them all.
 5. `weights`: parameter trees, placement (each leaf's spec from the rules, and putting it there),
    the committed-snapshot format, opening saved weights (a run's orbax checkpoints read as
    weights included: `weights/restore.py`).
    Below train, not above it: the train state is made of weights' trees, the loop initialises
    from saved weights (`weights/init_from.py`), and nothing in weights needs a train state.
 6. `train`: the train state and its checkpoints (save, restore, resume), the one step builder,
    the step and the loop.
 7. `interop`, `lofi`, `aot`: what converts, averages or plans trained weights (Hugging Face
    import and export, which place weights where `weights/place.py`
    says, no train state needed; Lo-Fi workers and averagers; ahead-of-time compilation and
    the planner). The loop knows none of them: it is handed its hooks.
 8. `inference`: what runs trained weights forward: held-out evaluation (`evaluate`), the rollout
    sampler (`sampling`: ragged prompts, n samples, top-k / top-p, stops, log-probs; the KV cache
    sharded by the rules), generation from a workdir or a Hugging Face directory (`generate`,
    through interop), the model lm-evaluation-harness runs (`lm_harness`).
 9. `rl`: reinforcement learning: reward functions, and GRPO's rollouts, which sample with the
    rollout sampler on the training mesh and take the data pipeline's place in the training
    loop (the objective's loss stays below train, in `objectives/grpo.py`).
10. `configs`: the bundled config files, a `get_config` each. Like a user's config file they may
    use any part of the library (the GPU presets size their micro-batch with `aot.memory`);
    only the command line loads them.
11. `cli`: flag parsing and config loading.
12. `launch`, then 13. `__main__`: the thin entry points.

Inside `models/` the sub-packages keep an order of their own (`MODEL_LAYERS`), checked the same
way, lowest first:

 0. `task`, `runner`: the interfaces a model's task and a layer runner (a pipeline schedule)
    implement; they import nothing of models.
 1. `nn`: parameters with logical axes, `project`, norms, the MLP, rotary, fused weights, the
    layer scan and remat policies, the sharded sums.
 2. `attention`: kernels, masks, attention across sequence shards, the attention components
    (their parameters, cache, FLOPs and bytes). Below MoE and the decoder, above `nn`: the layer
    scan treats a KV cache as an opaque pytree, so `nn` needs no attention.
 3. `moe`: the mixture-of-experts block, its router, dispatch and grouped matmuls.
 4. `decoder`, `vit`: the model families, which compose the parts below (peers: neither imports
    the other).
 5. `adapters`: LoRA and int8 training change a built model from outside, through the layers'
    `project` (a module carries its adapted projection; `nn` never imports the adapters), so no
    family imports them.
 6. `__init__`: the model table, which names every family and applies int8 in `ModelDef.build`.

`KNOWN_VIOLATIONS` lists the edges that break this order today, each with the edit that removes
it (none since the Lo-Fi worker builds its own run, `lofi.worker.train_worker`, and weight sources
find a Hugging Face opener through the model table). The test fails on a new violation and on a
listed one that is gone: delete its line then.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS: tuple[tuple[str, ...], ...] = (
    ("__init__", "errors", "hardware", "compat"),
    ("storage", "runtime", "precision", "optim", "mesh", "rules"),
    ("data", "models"),
    ("parallel", "observe", "objectives"),
    ("config_fields",),
    ("config",),
    ("weights",),
    ("train",),
    ("interop", "lofi", "aot"),
    ("inference",),
    ("rl",),
    ("configs",),
    ("cli",),
    ("launch",),
    ("__main__",),
)

# The sub-packages (and top-level modules) of `models/`, lowest first (see the docstring).
MODEL_LAYERS: tuple[tuple[str, ...], ...] = (
    ("task", "runner"),
    ("nn",),
    ("attention",),
    ("moe",),
    ("decoder", "vit"),
    ("adapters",),
    ("__init__",),
)

# (importing module, imported package): the imports against the order above that exist today,
# each with the edit that removes it. Short and shrinking; a failure names the file and lines.
KNOWN_VIOLATIONS: frozenset[tuple[str, str]] = frozenset()


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "jaxscale")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def _import_lines(name: str, path: str, modules: dict[str, str]) -> dict[str, list[int]]:
    """The jaxscale modules `name` imports, each with the lines that import it (a
    `from a.b import c` names a.b.c if that is a module, else a.b)."""
    is_package = path.endswith("__init__.py")
    named: dict[str, list[int]] = {}
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: None if is_package else -1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                named.setdefault(target, []).append(node.lineno)
    return {target: sorted(set(lines)) for target, lines in named.items()}


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    return set(_import_lines(name, path, modules))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def enter(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    def visit(root: str) -> None:
        enter(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    enter(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [c for c in found if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]


def _package(module: str) -> str:
    """`jaxscale.train.loop` -> `train`; `jaxscale.config` -> `config`; `jaxscale` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _models_part(module: str) -> str | None:
    """`jaxscale.models.nn.scan` -> `nn`; `jaxscale.models.vit` -> `vit`; `jaxscale.models` ->
    `__init__`; None outside `models/`."""
    if module == "jaxscale.models":
        return "__init__"
    if not module.startswith("jaxscale.models."):
        return None
    return module.split(".")[2]


def _layer_violations(edges: dict[tuple[str, str], list[int]],
                      layers: tuple[tuple[str, ...], ...],
                      part: Callable[[str], str | None] = _package
                      ) -> dict[tuple[str, str], list[int]]:
    """(importing module, imported part) -> lines, where that part (`part` of a module: its
    package, or its sub-package of `models/`) is not in a lower layer. Edges with an end that
    has no part (outside `models/`, for `_models_part`) are not this order's business."""
    rank = {member: i for i, members in enumerate(layers) for member in members}
    found: dict[tuple[str, str], set[int]] = {}
    for (a, b), lines in edges.items():
        part_a, part_b = part(a), part(b)
        if part_a is None or part_b is None or part_a == part_b:
            continue
        if rank[part_b] >= rank[part_a]:
            found.setdefault((a, part_b), set()).update(lines)
    return {edge: sorted(lines) for edge, lines in found.items()}


def _graph() -> tuple[dict[str, str], dict[tuple[str, str], list[int]]]:
    modules = _modules()
    edges = {(name, target): lines for name, path in modules.items()
             for target, lines in _import_lines(name, path, modules).items()}
    return modules, edges


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"p": {"p.x"}, "p.x": {"p"}}) == []  # a package and its own submodule


def test_no_import_cycles_in_jaxscale():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "jaxscale.train.step" in graph and graph["jaxscale.train.step"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_layer_check_finds_upward_and_sideways_imports():
    layers = (("errors",), ("data", "models"), ("train",))
    edges = {("jaxscale.train.loop", "jaxscale.data.registry"): [1],  # down: fine
             ("jaxscale.data.registry", "jaxscale.train.loop"): [2],  # up
             ("jaxscale.models.decoder.llama", "jaxscale.data.packing"): [3],  # sideways: peers
             ("jaxscale.train.loop", "jaxscale.train.step"): [4]}  # within a package
    assert _layer_violations(edges, layers) == {("jaxscale.data.registry", "train"): [2],
                                                 ("jaxscale.models.decoder.llama", "data"): [3]}


def test_every_package_has_one_layer():
    packages = {_package(m) for m in _modules()}
    placed = [p for members in LAYERS for p in members]
    assert len(placed) == len(set(placed)), "a package is listed in two layers"
    assert packages <= set(placed), (
        f"{sorted(packages - set(placed))} not in LAYERS: place each (and say why in this "
        "module's docstring and docs/)")
    assert set(placed) <= packages, f"{sorted(set(placed) - packages)} no longer exist: remove them"


def test_no_package_imports_a_higher_layer():
    modules, edges = _graph()
    violations = _layer_violations(edges, LAYERS)

    def where(edge: tuple[str, str]) -> str:
        path = os.path.relpath(modules[edge[0]], ROOT)
        lines = ",".join(map(str, violations.get(edge, [])))
        return f"{path}:{lines} imports from {edge[1]}"

    new = sorted(set(violations) - KNOWN_VIOLATIONS)
    assert not new, ("imports against the layer order (see tests/test_imports.py's docstring): "
                     + "; ".join(map(where, new)))
    gone = sorted(KNOWN_VIOLATIONS - set(violations))
    assert not gone, ("fixed, so delete from KNOWN_VIOLATIONS: "
                      + "; ".join(f"{a} -> {b}" for a, b in gone))


def test_models_check_finds_upward_and_sideways_imports():
    """Inside `models/`: down is fine, up and between peers is not, outside it is not judged."""
    edges = {("jaxscale.models.decoder.llama", "jaxscale.models.nn.scan"): [1],  # down: fine
             ("jaxscale.models.nn.scan", "jaxscale.models.attention.kernels"): [2],  # up
             ("jaxscale.models.vit", "jaxscale.models.decoder.config"): [3],  # sideways: peers
             ("jaxscale.models.nn.layers", "jaxscale.models.nn.fused"): [4],  # within nn
             ("jaxscale.models.moe.layer", "jaxscale.rules"): [5],  # outside models/
             ("jaxscale.models.adapters.lora", "jaxscale.models"): [6]}  # the table: above
    assert _layer_violations(edges, MODEL_LAYERS, _models_part) == {
        ("jaxscale.models.nn.scan", "attention"): [2],
        ("jaxscale.models.vit", "decoder"): [3],
        ("jaxscale.models.adapters.lora", "__init__"): [6]}


def test_every_models_part_has_one_layer():
    parts = {_models_part(m) for m in _modules()} - {None}
    placed = [p for members in MODEL_LAYERS for p in members]
    assert len(placed) == len(set(placed)), "a part of models/ is listed in two layers"
    assert parts <= set(placed), (
        f"models/{sorted(parts - set(placed))} not in MODEL_LAYERS: place each (and say why in "
        "this module's docstring and docs/architecture.md)")
    assert set(placed) <= parts, f"{sorted(set(placed) - parts)} no longer exist: remove them"


def test_no_models_part_imports_a_higher_one():
    modules, edges = _graph()
    violations = _layer_violations(edges, MODEL_LAYERS, _models_part)
    where = lambda edge: (f"{os.path.relpath(modules[edge[0]], ROOT)}:"
                          f"{','.join(map(str, violations[edge]))} imports from models/{edge[1]}")
    assert not violations, ("imports against the order inside models/ (see tests/test_imports.py's "
                            "docstring): " + "; ".join(map(where, sorted(violations))))

