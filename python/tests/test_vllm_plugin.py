"""refit's ``vllm.general_plugins`` entry point never takes a vLLM process
down: with a vLLM that lacks the weight-transfer API, or whose engine
factory refuses the registration, importing vLLM and starting an engine
works, and the process logs exactly one warning. Runs without vLLM: each
case is a stub ``vllm`` package written to a temporary folder, used in a
subprocess, whose engine loads its general plugins the way vLLM does
(``importlib.metadata`` entry points, each loaded inside a ``try``, each
called outside one)."""

import os
import subprocess
import sys
import textwrap

import pytest

# vllm/plugins/__init__.py of every stub: vLLM's own plugin loading
# (vllm.plugins.load_plugins_by_group / load_general_plugins). When no
# installed distribution declares refit's entry point (refit imported from
# a source tree), the entry point's target is called directly instead.
PLUGINS = '''
import importlib
import logging
from importlib.metadata import entry_points

logger = logging.getLogger("vllm.plugins")
LOADED_BY = []


def load_plugins_by_group(group):
    plugins = {}
    for plugin in entry_points(group=group):
        try:
            plugins[plugin.name] = plugin.load()
            LOADED_BY.append("entry point " + plugin.value)
        except Exception:
            logger.exception("Failed to load plugin %s", plugin.name)
    if "refit" not in plugins:
        plugins["refit"] = importlib.import_module("refit.vllm").register
        LOADED_BY.append("direct")
    return plugins


def load_general_plugins():
    for func in load_plugins_by_group("vllm.general_plugins").values():
        func()  # outside any try, as vLLM calls them
'''

INIT = '''
from . import plugins


class LLM:
    """An engine: every vLLM process loads the general plugins as it starts."""

    def __init__(self, model):
        plugins.load_general_plugins()
        self.model = model

    def generate(self, prompt):
        return prompt[::-1]
'''

FACTORY_RAISES = '''
class WeightTransferEngineFactory:
    _registry = {}

    @classmethod
    def register_engine(cls, name, module, klass):
        raise RuntimeError("engine factory is closed")
'''

FACTORY_WORKS = '''
class WeightTransferEngineFactory:
    _registry = {}

    @classmethod
    def register_engine(cls, name, module, klass):
        if name in cls._registry:
            raise ValueError(f"{name} already registered")
        cls._registry[name] = (module, klass)


class WeightTransferTrainerFactory(WeightTransferEngineFactory):
    _registry = {}
'''

# vllm/v1/engine/core.py: the engine core whose calls refit wraps.
ENGINE_CORE = '''
class EngineCore:
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return []

    def resume_scheduler(self):
        pass


class EngineCoreProc(EngineCore):
    def resume_scheduler(self):
        pass
'''

# Starts two engines in one process (each loads the plugins again) and
# prints what the stub saw. No logging is configured (as in a plain vLLM
# script): a warning of refit's logger reaches stderr through logging's
# last-resort handler, where it is counted.
SCRIPT = '''
import vllm
import refit.vllm

for _ in range(2):
    llm = vllm.LLM(model="stub")
    assert llm.generate("abc") == "cba"
refit.vllm.register()  # and called directly once more
try:
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    registry = dict(WeightTransferEngineFactory._registry)
except ImportError:
    registry = None
try:
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    trainers = dict(WeightTransferTrainerFactory._registry)
except ImportError:
    trainers = None
try:
    from vllm.v1.engine import core
    wrapped = core.EngineCore.collective_rpc
    once = getattr(wrapped, "_refit_follows_weights", False) and not hasattr(wrapped.__wrapped__, "__wrapped__")
except ImportError:
    once = None
print("TRAINERS", trainers)
print("CORE", once)
print("ENGINE OK")
print("LOADED", vllm.plugins.LOADED_BY)
print("REGISTRY", registry)
'''


def write_stub(root, factory, core=ENGINE_CORE):
    """A ``vllm`` package under ``root``: ``factory`` is the text of
    ``vllm/distributed/weight_transfer/__init__.py``, or None for a vLLM
    without that package; ``core`` that of ``vllm/v1/engine/core.py``, or
    None for a vLLM without it."""
    pkg = root / "vllm"
    (pkg / "distributed").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(INIT))
    (pkg / "plugins.py").write_text(textwrap.dedent(PLUGINS))
    (pkg / "distributed" / "__init__.py").write_text("")
    if factory is not None:
        (pkg / "distributed" / "weight_transfer").mkdir()
        (pkg / "distributed" / "weight_transfer" / "__init__.py").write_text(textwrap.dedent(factory))
    if core is not None:
        (pkg / "v1" / "engine").mkdir(parents=True)
        (pkg / "v1" / "__init__.py").write_text("")
        (pkg / "v1" / "engine" / "__init__.py").write_text("")
        (pkg / "v1" / "engine" / "core.py").write_text(textwrap.dedent(core))


def start_engines(tmp_path, factory, core=ENGINE_CORE):
    write_stub(tmp_path, factory, core)
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + [p for p in sys.path if p])
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"the engine did not start (rc {out.returncode}):\n{out.stdout}\n{out.stderr}"
    lines = out.stdout.splitlines()
    assert "ENGINE OK" in lines, out.stdout + out.stderr
    return lines, out.stderr


def field(lines, key):
    return next(line[len(key) + 1 :] for line in lines if line.startswith(key + " "))


def refit_entry_point_installed():
    from importlib.metadata import entry_points

    return any(e.name == "refit" and e.value == "refit.vllm:register" for e in entry_points(group="vllm.general_plugins"))


def check_loaded(lines):
    loaded = field(lines, "LOADED")
    if refit_entry_point_installed():
        assert "entry point refit.vllm:register" in loaded and "direct" not in loaded, loaded
    else:
        assert "direct" in loaded, loaded


@pytest.mark.parametrize(
    "factory, why",
    [(None, "no weight-transfer API (vllm.distributed.weight_transfer)"), (FACTORY_RAISES, "RuntimeError: engine factory is closed")],
    ids=["without-the-api", "factory-raises"],
)
def test_a_vllm_refit_cannot_register_in_still_starts_with_one_warning(tmp_path, factory, why):
    lines, stderr = start_engines(tmp_path, factory)
    check_loaded(lines)
    warnings = [line for line in stderr.splitlines() if "refit" in line]
    assert len(warnings) == 1, stderr
    assert "'refit' weight-transfer backend is not available" in warnings[0] and why in warnings[0], stderr


def test_a_vllm_with_the_api_registers_refit_without_a_warning(tmp_path):
    lines, stderr = start_engines(tmp_path, FACTORY_WORKS)
    check_loaded(lines)
    assert field(lines, "REGISTRY") == "{'refit': ('refit._vllm_worker', 'RefitWeightTransferEngine')}"
    assert field(lines, "TRAINERS") == "{'refit': ('refit._vllm_trainer', 'RefitTrainerEngine')}"
    assert field(lines, "CORE") == "True", "the engine core's calls are wrapped once"
    assert "refit" not in stderr, stderr


def test_a_vllm_whose_engine_core_refit_does_not_know_says_so_once(tmp_path):
    lines, stderr = start_engines(tmp_path, FACTORY_WORKS, core=None)
    check_loaded(lines)
    assert field(lines, "REGISTRY") == "{'refit': ('refit._vllm_worker', 'RefitWeightTransferEngine')}"
    warnings = [line for line in stderr.splitlines() if "refit" in line]
    assert len(warnings) == 1 and "reset its prefix cache" in warnings[0], stderr


def test_importing_refit_needs_no_vllm():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    code = "import sys\nimport refit, refit.vllm\nassert 'vllm' not in sys.modules\nprint('OK')"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr
