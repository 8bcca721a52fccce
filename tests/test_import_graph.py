"""The planner plans from the layout and a hardware profile: it never reaches into the runtime or
the profiler that measures it, neither at module level nor inside a function."""

import ast
import sys
from pathlib import Path

import flexoff
from tests import processes

PACKAGE = Path(flexoff.__file__).parent

def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, package: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it, as absolute names; ``from X import name`` also
    counts ``X.name``, which may be a module."""
    name = module_name(path, package)
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return found


def within(target: str, modules: tuple[str, ...]) -> bool:
    return any(target == module or target.startswith(module + ".") for module in modules)


def imports_into(package: Path, part: str, banned: tuple[str, ...]) -> list[str]:
    """'source imports target' for each import from ``part`` of ``package`` into ``banned`` modules."""
    bad = []
    for path in sorted((package / part).rglob("*.py")):
        source = module_name(path, package)
        bad += [f"{source} imports {target}" for target in sorted(imports(path, package)) if within(target, banned)]
    return bad


def planner_imports_of_the_runtime(package: Path) -> list[str]:
    return imports_into(package, "planner", ("flexoff.runtime", "flexoff.profiler"))


def test_the_planner_imports_neither_the_runtime_nor_the_profiler():
    assert planner_imports_of_the_runtime(PACKAGE) == []


def test_the_layout_sits_below_the_runtime_and_the_planner():
    assert imports_into(PACKAGE, "layout", ("flexoff.runtime", "flexoff.profiler", "flexoff.planner",
                                            "flexoff.api")) == []


def test_the_deployment_sits_below_the_api_and_the_api_below_the_commands():
    """deploy resolves (and plans) what the API and the commands hand it; the API plans nothing itself."""
    assert imports_into(PACKAGE, "deploy", ("flexoff.api", "flexoff.commands", "flexoff.harness")) == []
    assert imports_into(PACKAGE, "api", ("flexoff.commands", "flexoff.harness", "flexoff.planner",
                                         "flexoff.profiler")) == []


def test_the_runtime_runs_a_policy_it_is_given_and_plans_nothing():
    """The runtime sits below the planner, the profiler that times it, and everything that resolves a job."""
    assert imports_into(PACKAGE, "runtime", ("flexoff.planner", "flexoff.profiler", "flexoff.deploy", "flexoff.api",
                                             "flexoff.commands", "flexoff.harness")) == []


def test_the_profiler_reads_only_the_planners_profile_types():
    """The profiler measures for the planner: it writes a hardware profile (and its sparse rates) and
    runs the runtime's own kernels, but plans nothing and knows nothing above it."""
    bad = imports_into(PACKAGE, "profiler", ("flexoff.planner", "flexoff.deploy", "flexoff.api", "flexoff.commands",
                                             "flexoff.harness"))
    allowed = ("flexoff.planner.hardware", "flexoff.planner.sparse_rate")
    assert [line for line in bad if not within(line.rpartition(" imports ")[2], allowed)] == []


# What the harness may import (docs/ARCHITECTURE.md's arrows): the API and the job, the prompts,
# records and progress it hands on, the runtime's SamplingParams and Metrics, the model's files
# and tokenizer (a job's identity; the lm-eval adapter's config and chat template), the small
# shared pieces, and for the lm-eval adapter the API's argument checks, the dtype resolution and
# the planner's Workload (it plans policy=auto per call).
HARNESS_MAY_IMPORT = (
    "flexoff.harness", "flexoff.api", "flexoff.job", "flexoff.prompts", "flexoff.records", "flexoff.progress",
    "flexoff.runtime.sampling", "flexoff.runtime.metrics", "flexoff.models", "flexoff.tokenizer",
    "flexoff.gguf_format", "flexoff.generation_config", "flexoff.chat", "flexoff.fileio", "flexoff.errors",
    "flexoff.checks", "flexoff.deploy.devices", "flexoff.planner.cost_model",
)


def test_the_harness_imports_only_what_its_arrows_say():
    bad = []
    for path in sorted((PACKAGE / "harness").rglob("*.py")):
        source = module_name(path, PACKAGE)
        for target in sorted(imports(path, PACKAGE)):
            top = target in ("flexoff", "flexoff.LLM")  # `from .. import LLM`: the API's, loaded lazily
            if within(target, ("flexoff",)) and not top and not within(target, HARNESS_MAY_IMPORT):
                bad.append(f"{source} imports {target}")
    assert bad == []


def test_the_walk_finds_module_and_function_level_imports(tmp_path):
    planner = tmp_path / "flexoff" / "planner"
    planner.mkdir(parents=True)
    (tmp_path / "flexoff" / "__init__.py").write_text("")
    (planner / "__init__.py").write_text("from ..runtime import kv\n")
    (planner / "late.py").write_text("def f():\n    from .. import profiler\n    import flexoff.runtime.tiers\n")
    (planner / "fine.py").write_text("from ..layout import job_bytes\nfrom .sizes import FP16_BYTES\n")
    assert planner_imports_of_the_runtime(tmp_path / "flexoff") == [
        "flexoff.planner imports flexoff.runtime", "flexoff.planner imports flexoff.runtime.kv",
        "flexoff.planner.late imports flexoff.profiler", "flexoff.planner.late imports flexoff.runtime.tiers",
    ]


def test_importing_the_planner_loads_no_runtime_module_and_no_cuda_state():
    code = ("import sys, flexoff.planner, torch\n"
            "print(sorted(m for m in sys.modules if m.startswith(('flexoff.runtime', 'flexoff.profiler'))))\n"
            "print(torch.cuda.is_initialized())\n")
    result = processes.run([sys.executable, "-c", code], cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "False"]
