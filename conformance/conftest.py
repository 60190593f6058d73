"""Session plumbing of the conformance suite.

- `--impl package.module:object` (or a known short name: ours, specforge, speculators, zlab) picks the
  implementation under test (default: ours); results of any other than ours go to
  reports/conformance/<name>/ (or `--report-dir`), so they never overwrite ours;
- tests marked `@pytest.mark.compare(operation, references=..., cross=...)` get a `pair`
  fixture parametrized over (impl, reference) and, with `cross`, (speculators, zlab);
  a pair where either side declares the operation unsupported is recorded "n/a", not run;
- `conform` is the `Comparator` of the running test; every outcome lands in the session
  recorder, which writes reports/conformance/{results.json,index.html} at session end;
- the implementation under test is seen through `Plug` (conformance/plug.py): a call of the current interface
  it cannot take is a plug mismatch naming the interface change, listed at the end of the run (exit status 1),
  never a divergence;
- a test where two references disagree reports REFERENCES DIFFER (never PASSED), and the set of those
  disagreements is held to the golden list `references_differ.toml`: one gained or lost is listed at the end of
  the run (exit status 1).
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import reference_adapters as registry
from catalogue.pitfalls import PITFALLS
from conformance.comparator import REFERENCES_DIFFER, Comparator
from conformance.plug import Plug, PlugMismatch, declared_version
from conformance.recorder import Recorder, golden_changes, known_differences
from foundation.packages import installed_version, installed_versions
from held import HELD
from impl.interface import supports

DEFAULT_IMPL = registry.IMPLEMENTATIONS["ours"]
REFERENCES = {name: registry.IMPLEMENTATIONS[name] for name in registry.REFERENCES}
# Short names for `--impl`: ours and the references (the one registry), the codebases held to them (held/).
KNOWN = {**registry.IMPLEMENTATIONS, **HELD}
# Outputs two references may disagree on (a finding), as opposed to a failure of the impl.
REFERENCE_NAMES = frozenset({*REFERENCES, "transformers"})
REPORT_DIR = Path(__file__).resolve().parent.parent / "reports" / "conformance"
RECORDER = pytest.StashKey[Recorder]()
IMPLEMENTATIONS = pytest.StashKey[dict]()


def pytest_addoption(parser):
    parser.addoption("--impl", default=DEFAULT_IMPL, metavar="package.module:object",
                     help="DFlashImplementation under test (a class is instantiated without arguments), "
                          f"or one of {', '.join(KNOWN)}")
    parser.addoption("--impl-only", action="store_true",
                     help="run only what involves the implementation under test: the references' own pairs "
                          "(speculators vs zlab) and tests of the references or of ours alone are deselected "
                          "(a held codebase's golden run)")
    parser.addoption("--report-dir", default=None, metavar="DIR",
                     help="where results.json and index.html go (default reports/conformance/, "
                          "reports/conformance/<name>/ for an --impl other than ours)")


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: fast subset of the conformance suite (under 2 minutes)")
    config.addinivalue_line("markers", "slow: trains or decodes real models; part of the full suite")
    config.addinivalue_line("markers", "pitfall(n): the catalogue entry a test checks (catalogue/pitfalls.py); its "
                                       "comparisons report under that entry's component")
    config.addinivalue_line("markers", "compare(operation, references, cross): pairs of implementations compared")
    config.stash[IMPLEMENTATIONS] = {}
    config.stash[RECORDER] = Recorder(implementation=config.getoption("--impl"))
    implementation(config, "impl")  # a plug that cannot load, or declares no version we know: one line, exit 4


def load_object(path: str):
    """`package.module:object` or a short name -> an implementation instance (classes are instantiated)."""
    module_name, _, attr = KNOWN.get(path, path).partition(":")
    if not module_name or not attr:
        raise pytest.UsageError(f"--impl {path!r}: expected package.module:object")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise pytest.UsageError(f"--impl {path!r}: {error}") from None
    return obj() if inspect.isclass(obj) else obj


def plugged(config, obj) -> Plug:
    """The implementation under test behind the plug boundary, its declared interface version recorded."""
    try:
        config.stash[RECORDER].interface_version = declared_version(obj)
    except ValueError as error:
        raise pytest.UsageError(f"--impl {config.getoption('--impl')!r}: {error}") from None
    return Plug(obj)


def implementation(config, role: str):
    """`role` is "impl" (the one under test) or a reference name; loaded once per session."""
    cache = config.stash[IMPLEMENTATIONS]
    if role not in cache:
        cache[role] = (plugged(config, load_object(config.getoption("--impl"))) if role == "impl"
                       else load_object(REFERENCES[role]))
    return cache[role]


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("compare")
    if marker is None or "pair" not in metafunc.fixturenames:
        return
    operation = marker.args[0]
    references = marker.kwargs.get("references", tuple(REFERENCES))
    roles = [("impl", ref) for ref in references]
    if marker.kwargs.get("cross", False):
        roles.append(("speculators", "zlab"))
    pitfall = metafunc.definition.get_closest_marker("pitfall").args[0]
    component = PITFALLS[pitfall].component
    config = metafunc.config
    runnable = []
    for a_role, b_role in roles:
        a, b = implementation(config, a_role), implementation(config, b_role)
        names = (a.name, b.name)
        test = f"{metafunc.definition.nodeid}[{names[0]}-vs-{names[1]}]"
        missing = [impl.name for impl in (a, b) if not supports(impl, operation)]
        if missing:
            config.stash[RECORDER].not_applicable(component, pitfall, names, test,
                                                  f"{', '.join(missing)} has no {operation}")
        else:
            runnable.append(pytest.param((a_role, b_role), id=f"{names[0]}-vs-{names[1]}"))
    metafunc.parametrize("pair_roles", runnable)


def involves_impl(item) -> bool:
    """Whether a collected test runs the implementation under test: a pair including it, or `under_test`."""
    roles = item.callspec.params.get("pair_roles") if hasattr(item, "callspec") else None
    if isinstance(roles, tuple):  # not pytest's NOTSET of an empty pair set
        return "impl" in roles
    return bool({"pair", "under_test"} & set(item.fixturenames))  # an empty pair set stays (its n/a is recorded)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--impl-only"):
        return
    kept = [item for item in items if involves_impl(item)]
    config.hook.pytest_deselected(items=[item for item in items if not involves_impl(item)])
    items[:] = kept


@pytest.fixture
def pair(request, pair_roles):
    return tuple(implementation(request.config, role) for role in pair_roles)


@pytest.fixture
def under_test(request):
    return implementation(request.config, "impl")


@pytest.fixture(scope="session")
def speculators(request):
    return implementation(request.config, "speculators")


@pytest.fixture(scope="session")
def zlab(request):
    return implementation(request.config, "zlab")


@pytest.fixture(scope="session")
def recorder(request) -> Recorder:
    return request.config.stash[RECORDER]


@pytest.fixture
def conform(request, recorder) -> Comparator:
    marker = request.node.get_closest_marker("pitfall")
    return Comparator(recorder.sink, request.node.nodeid, REFERENCE_NAMES, marker.args[0] if marker else None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A plug mismatch raised outside a comparison (a test calling the plug directly) is recorded as one too;
    a passing test whose comparisons found two references disagreeing is marked so (`pytest_report_teststatus`)."""
    outcome = yield
    if call.when == "call" and call.excinfo is None:
        report = outcome.get_result()
        for record in item.config.stash[RECORDER].records.values():
            if record.test == item.nodeid and record.status == REFERENCES_DIFFER:
                report.user_properties.append((REFERENCES_DIFFER, record.diff.message if record.diff else ""))
    if call.excinfo is None or not isinstance(call.excinfo.value, PlugMismatch):
        return
    marker = item.get_closest_marker("pitfall")
    if marker is None:
        return
    roles = getattr(item, "callspec", None) and item.callspec.params.get("pair_roles")
    names = tuple(implementation(item.config, role).name for role in roles) if roles else \
        (implementation(item.config, "impl").name, "speculators")
    Comparator(item.config.stash[RECORDER].sink, item.nodeid, REFERENCE_NAMES, marker.args[0]).plug_mismatch(
        names, str(call.excinfo.value))


def pytest_report_teststatus(report, config):
    """REFERENCES DIFFER (`R`), counted apart in the run's last line: such a test never shows as PASSED."""
    if report.when == "call" and report.passed and any(name == REFERENCES_DIFFER for name, _ in report.user_properties):
        return REFERENCES_DIFFER, "R", "REFERENCES DIFFER"
    return None


def reference_changes(config) -> dict[str, list[dict]]:
    """The session's reference disagreements against the golden list (conformance/recorder.py)."""
    components = [r.to_dict() for r in config.stash[RECORDER].records.values()]
    return golden_changes(components, known_differences())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    changes = reference_changes(config)
    if changes["gained"] or changes["lost"]:
        terminalreporter.section("the references' disagreements changed (conformance/references_differ.toml)")
        for row in changes["gained"]:
            terminalreporter.write_line(f"new: {row['test']} ({' vs '.join(row['implementations'])}, "
                                        f"#{row['pitfall']} {row['component']}): "
                                        f"{(row['diff'] or {}).get('message', '')}")
        for item in changes["lost"]:
            terminalreporter.write_line(f"no longer differ: {item['test']} ({' vs '.join(item['implementations'])}, "
                                        f"#{item['pitfall']} {item['component']})")
    mismatches = [r for r in config.stash[RECORDER].records.values() if r.status == "plug-mismatch"]
    if mismatches:
        terminalreporter.section("plug mismatches (calls the plug cannot take; not divergences)")
        messages = (r.diff.message for r in mismatches if r.diff)  # one line per change, not per example
        for message in sorted({m[m.find("plug mismatch:"):] for m in messages}):
            terminalreporter.write_line(message)


def versions() -> dict[str, str]:
    """Every package of the one table (foundation/packages.py), and hypothesis, which draws the cases."""
    found = {**installed_versions(), "hypothesis": installed_version("hypothesis")}
    return {name: version or "not installed" for name, version in found.items()}


def report_dir(config) -> Path:
    """reports/conformance/ for ours; reports/conformance/<name>/ for any other implementation."""
    if config.getoption("--report-dir"):
        return Path(config.getoption("--report-dir"))
    chosen = config.getoption("--impl")
    if KNOWN.get(chosen, chosen) == DEFAULT_IMPL:
        return REPORT_DIR
    loaded = config.stash[IMPLEMENTATIONS].get("impl")
    name = chosen if chosen in KNOWN else getattr(loaded, "name", None) or chosen
    return REPORT_DIR / (re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name)).strip("._") or "impl")


def pytest_sessionfinish(session, exitstatus):
    recorder = session.config.stash.get(RECORDER, None)
    if recorder is None:
        return
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller writes the report
        session.config.workeroutput["conformance"] = recorder.export()
    else:
        recorder.write(report_dir(session.config), versions())
        if session.exitstatus == 0 and any(r.status == "plug-mismatch" for r in recorder.records.values()):
            session.exitstatus = 1  # the plug is out of date: the run is not clean, though nothing diverged
        changes = reference_changes(session.config)
        if session.exitstatus == 0 and (changes["gained"] or changes["lost"]):
            session.exitstatus = 1  # the references' disagreements are not the listed ones


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist (`make test` runs `-n 2`): fold each worker's records into the controller's recorder."""
    exported = getattr(node, "workeroutput", {}).get("conformance")
    if exported is not None:
        node.config.stash[RECORDER].absorb(exported)
