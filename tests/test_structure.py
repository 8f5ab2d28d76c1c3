"""The house's floor plan, read from the code's imports: three floors, arrows pointing down only.

- bottom: ``megatron_rl.spec`` (config schema, model shape, ParallelDims and the layout rules, errors, run-folder
  names, exit codes, reward names): the standard library, omegaconf and yaml only;
- above it, side by side: ``launcher`` (login node) and the job's rooms (the rest of ``megatron_rl``), which never
  import each other; the launcher never imports torch, Megatron or transformers.
- no circle among the project's modules.

Every import statement counts, including those inside functions (they run when the function does); those under
``if TYPE_CHECKING:`` do not (they never run). Print the graph's counts with

    .venv/bin/python tests/test_structure.py
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("launcher", "megatron_rl")
SPEC = "megatron_rl.spec"
TORCH_SIDE = ("torch", "megatron", "transformer_engine", "transformers", "flash_attn", "numpy", "safetensors")
"""Third-party packages the login node and the spec never import (numpy and safetensors: the converter's)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if "shipped" not in path.parts:
                found[_module_name(path)] = path
    found["launch"] = REPO_ROOT / "launch.py"
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return skipped


def _imported(module: str, path: Path, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: None if path.name == "__init__.py" else -1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project module -> project modules it imports, project module -> third-party top-level packages)."""
    modules = _modules()
    inside, outside = {name: set() for name in modules}, {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_only(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in skipped:
                continue
            for target in _imported(name, path, node):
                top = target.split(".")[0]
                if top not in PACKAGES:
                    outside[name].add(top)
                    continue
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    inside[name].add(target)
    return inside, outside


def _floor(module: str) -> str:
    if module == SPEC or module.startswith(SPEC + "."):
        return "spec"
    if module == "launch" or module.startswith("launcher"):
        return "launcher"
    return "job"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
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
    return found


def wrong_arrows(graph: dict[str, set[str]], third_party: dict[str, set[str]]) -> list[str]:
    """Every arrow that breaks the floor plan, as 'a -> b (why)'."""
    wrong = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            pair = (_floor(source), _floor(target))
            if pair == ("spec", "launcher") or pair == ("spec", "job"):
                wrong.append(f"{source} -> {target} (the spec imports only the spec)")
            elif pair == ("job", "launcher"):
                wrong.append(f"{source} -> {target} (the job never imports the launcher)")
            elif pair == ("launcher", "job"):
                wrong.append(f"{source} -> {target} (the launcher never imports the job)")
        if _floor(source) in ("spec", "launcher"):
            wrong += [f"{source} -> {package} (torch-side package on the {_floor(source)} floor)"
                      for package in sorted(third_party[source] & set(TORCH_SIDE))]
    return wrong


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_arrow_points_down(graph):
    assert wrong_arrows(*graph) == []


def test_no_import_circle(graph):
    assert circles(graph[0]) == []


def test_the_walker_sees_the_arrows_it_must_refuse():
    """The checks can fail: a circle and each kind of wrong arrow are found in a made-up graph."""
    made_up = {"launcher.a": {"launcher.b", "megatron_rl.trainers.x"}, "launcher.b": {"launcher.a"},
               "megatron_rl.trainers.x": {"launcher.a"}, "megatron_rl.spec.s": {"megatron_rl.trainers.x"}}
    third_party = {name: set() for name in made_up} | {"launcher.b": {"torch"}}
    assert circles(made_up) == [["launcher.a", "launcher.b", "megatron_rl.trainers.x"]]
    assert len(wrong_arrows(made_up, third_party)) == 4


TRAINERS_PACKAGE = "megatron_rl.trainers"
WHOLE_CONFIG_HOMES = ("megatron_rl/main.py", "megatron_rl/trainers/", "megatron_rl/spec/config/",
                      "megatron_rl/spec/limits.py", "megatron_rl/runtime/manifest.py")
"""Where a function may take the whole JobConfig: the job's entry (main, each role's trainer and what trainers
share), the config's own checks (loading, validating, the job's limits), and the run's manifest (its audit record
holds the whole config). Every other component takes its own sections (``cfg.generation``, ``cfg.data``, ...)."""
MAX_TRAINER_FAN_OUT = 14
"""Project modules a trainer module may import (structure v3: under 15)."""


def trainer_modules() -> set[str]:
    """The modules ``main.py`` runs a role with: each algorithm's trainer and the rollout worker's."""
    from megatron_rl.main import SPLIT_PLACEMENT_TRAINERS, TRAINERS

    return set(TRAINERS.values()) | set(SPLIT_PLACEMENT_TRAINERS.values()) | {"megatron_rl.trainers.rollout_worker"}


def takes_whole_config(source: str) -> list[str]:
    """Functions of ``source`` with a parameter annotated JobConfig, or named cfg without a narrower annotation
    (an HF config dict, ``cfg: dict[str, Any]``, is not the job's)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            notes = [(a.arg, ast.unparse(a.annotation) if a.annotation is not None else "") for a in args]
            if any("JobConfig" in note or (name == "cfg" and note in ("", "Any")) for name, note in notes):
                found.append(node.name)
    return found


def test_no_trainer_imports_another_trainer(graph):
    inside, _ = graph
    trainers = trainer_modules()
    assert len(trainers) >= 7 and all(name in inside for name in trainers), trainers
    assert {(t, target) for t in trainers for target in inside[t] if target in trainers and target != t} == set()


def test_the_trainers_fan_out_stays_small(graph):
    inside, _ = graph
    fan_out = {name: len({t for t in targets if t in inside and t != name})
               for name, targets in inside.items() if name.startswith(TRAINERS_PACKAGE)}
    assert max(fan_out.values()) <= MAX_TRAINER_FAN_OUT, sorted(fan_out.items(), key=lambda kv: -kv[1])[:3]


def test_only_the_entry_layer_takes_the_whole_job_config():
    """Components below the trainers take their config sections, not the job (the walker finds a made-up one)."""
    made_up = ("def build(cfg, shape): pass\ndef run(x: JobConfig): pass\ndef ok(data, *, seed): pass\n"
               "def hf(cfg: dict[str, Any]): pass")
    assert takes_whole_config(made_up) == ["build", "run"]
    found = {}
    for path in sorted((REPO_ROOT / "megatron_rl").rglob("*.py")):
        rel = path.relative_to(REPO_ROOT).as_posix()
        if "shipped" not in path.parts and not rel.startswith(WHOLE_CONFIG_HOMES):
            found.update({f"{rel}:{name}": True for name in takes_whole_config(path.read_text())})
    assert sorted(found) == []


def test_loading_planning_and_rendering_every_shipped_config_imports_no_torch():
    """What a config load pulls in at run time (not only the import statements): every shipped config loaded,
    checked, planned and rendered as the launcher does for --dry-run, in a fresh interpreter."""
    code = """
import sys
from pathlib import Path
from launcher.cli import main
from omegaconf import OmegaConf
import contextlib, io
for path in sorted(Path("configs").glob("*.yaml")):
    command = ["pipeline"] if "stages:" in path.read_text() else []
    required = [] if command else [f"{key}=/user/path" for key in OmegaConf.missing_keys(OmegaConf.load(path))]
    with contextlib.redirect_stdout(io.StringIO()):
        code = main([*command, "--config", str(path), "--dry-run", *required])
    assert code == 0, (path, code)
bad = sorted(m for m in sys.modules if m.split(".")[0] in %r)
print(bad)
sys.exit(bool(bad))
""" % (TORCH_SIDE,)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


if __name__ == "__main__":
    inside, outside = import_graph()
    arrows = sum(len(targets) for targets in inside.values())
    floors = {floor: sum(_floor(m) == floor for m in inside) for floor in ("spec", "launcher", "job")}
    print(f"modules {len(inside)} (spec {floors['spec']}, launcher {floors['launcher']}, job {floors['job']}), "
          f"arrows {arrows}, wrong arrows {len(wrong_arrows(inside, outside))}, circles {len(circles(inside))}")
