"""omlx.grammar.torch_stub: xgrammar without torch.

install() rewrites sys.modules, so every test runs its code in a fresh interpreter
and keeps this pytest process clean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV_VAR = "TVM_FFI_DISABLE_TORCH_C_DLPACK"
pytestmark = pytest.mark.spawns  # each test runs a child interpreter

STUB_MODULES = ["torch", "torch.cuda", "torch.version", "torch.nn", "torch.utils",
                "torch.utils.dlpack"]  # fmt: skip


def run_python(code: str, *extra_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, extra_path), str(ROOT)])}
    env.pop(ENV_VAR, None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def run_json(code: str, *extra_path: Path) -> dict:
    """Run ``code``, which prints one JSON object as its last stdout line."""
    proc = run_python(code, *extra_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stub_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("omlx.grammar.torch_stub|")]


LOG_TO_STDERR = """
import logging, sys
logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                    format="%(name)s|%(levelname)s|%(message)s")
"""


def test_install_registers_the_stub_once():
    out = run_json("""
        import json, os, sys
        from omlx.grammar import torch_stub
        before = torch_stub.is_stub_active()
        first = torch_stub.install()
        module = sys.modules["torch"]
        second = torch_stub.install()
        import torch
        print(json.dumps({
            "before": before, "first": first, "second": second,
            "same": torch is module and sys.modules["torch"] is module,
            "active": torch_stub.is_stub_active(), "version": torch.__version__,
        }))
    """)
    assert out == {"before": False, "first": True, "second": False, "same": True,
                   "active": True, "version": "0.0.0+omlx.stub"}  # fmt: skip


def test_concurrent_installs_install_once():
    out = run_json("""
        import json, threading
        from omlx.grammar import torch_stub
        barrier = threading.Barrier(8)
        results = []
        def worker():
            barrier.wait()
            results.append(torch_stub.install())
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(json.dumps(results))
    """)
    assert sorted(out) == [False] * 7 + [True]


def test_env_var_is_set_only_when_the_stub_installs():
    out = run_json(f"""
        import json, os
        from omlx.grammar import torch_stub
        before = os.environ.get("{ENV_VAR}")
        torch_stub.install()
        print(json.dumps([before, os.environ.get("{ENV_VAR}")]))
    """)
    assert out == [None, "1"]


@pytest.mark.parametrize("imported_first", [False, True])
def test_real_torch_leaves_everything_untouched(tmp_path: Path, imported_first: bool):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '9.9.9'\nMARK = 'real'\n")
    out = run_json(
        f"""
        import json, os, sys
        if {imported_first}:
            import torch
        from omlx.grammar import torch_stub
        installed = torch_stub.install()
        torch_loaded = "torch" in sys.modules
        import torch
        print(json.dumps({{
            "installed": installed, "torch_loaded": torch_loaded, "mark": torch.MARK,
            "env": os.environ.get("{ENV_VAR}"), "active": torch_stub.is_stub_active(),
        }}))
        """,
        tmp_path,
    )
    assert out == {"installed": False, "torch_loaded": imported_first, "mark": "real",
                   "env": None, "active": False}  # fmt: skip


def test_dtypes_are_distinct_hashable_keys():
    names = ["float16", "float32", "float64", "bfloat16", "int8", "int16", "int32",
             "int64", "uint8", "bool"]  # fmt: skip
    out = run_json(f"""
        import json
        from omlx.grammar import torch_stub
        torch_stub.install()
        import torch
        names = {names!r}
        by_dtype = {{getattr(torch, n): n for n in names}}
        print(json.dumps({{
            "keys": sorted(by_dtype.values()),
            "lookup": by_dtype[torch.int32],
            "reprs": [repr(getattr(torch, n)) for n in names],
            "all_dtype": all(isinstance(getattr(torch, n), torch.dtype) for n in names),
            "long_is_int64": torch.long is torch.int64,
        }}))
    """)
    assert out["keys"] == sorted(names)
    assert out["lookup"] == "int32"
    assert out["reprs"] == [f"torch.{n}" for n in names]
    assert out["all_dtype"] and out["long_is_int64"]


def test_isinstance_tensor_only_for_stub_tensors():
    out = run_json("""
        import json
        import mlx.core as mx
        import numpy as np
        from omlx.grammar import torch_stub
        torch_stub.install()
        import torch
        t = torch.tensor(-1, dtype=torch.int32)
        print(json.dumps({
            "tensor": isinstance(t, torch.Tensor), "dtype": repr(t.dtype),
            "aliases": [isinstance(cls(), torch.Tensor) for cls in
                        (torch.LongTensor, torch.FloatTensor, torch.IntTensor, torch.BoolTensor)],
            "numpy": isinstance(np.zeros(2, np.int32), torch.Tensor),
            "mlx": isinstance(mx.zeros(2), torch.Tensor),
        }))
    """)
    assert out == {"tensor": True, "dtype": "torch.int32", "aliases": [True] * 4,
                   "numpy": False, "mlx": False}  # fmt: skip


def test_helpers_that_need_real_torch_raise():
    calls = ["torch.full", "torch.zeros", "torch.empty", "torch.from_numpy",
             "torch.utils.dlpack.to_dlpack", "torch.utils.dlpack.from_dlpack"]  # fmt: skip
    out = run_json(f"""
        import json
        from omlx.grammar import torch_stub
        torch_stub.install()
        import torch, torch.utils.dlpack
        errors = {{}}
        for name in {calls!r}:
            try:
                eval(name)((1, 1), -1)
            except Exception as exc:
                errors[name] = [type(exc).__name__, str(exc)]
        print(json.dumps(errors))
    """)
    assert sorted(out) == sorted(calls)
    for name, (kind, message) in out.items():
        assert kind == "RuntimeError"
        assert f"{name}()" in message and "without torch" in message


def test_missing_attribute_raises_and_warns_once_per_name():
    proc = run_python(
        LOG_TO_STDERR
        + """
from omlx.grammar import torch_stub
torch_stub.install()
import torch
misses = 0
for name in ["nonexistent_thing", "nonexistent_thing", "other", "__wrapped__"]:
    try:
        getattr(torch, name)
    except AttributeError:
        misses += 1
print(misses, hasattr(torch, "__file__"))
"""
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["4", "False"]
    warnings = stub_warnings(proc.stderr)
    assert len(warnings) == 2, proc.stderr
    assert sum("torch.nonexistent_thing " in w for w in warnings) == 1
    assert sum("torch.other " in w for w in warnings) == 1
    assert all(w.startswith("omlx.grammar.torch_stub|WARNING|") for w in warnings)


def test_every_stub_module_has_a_real_spec():
    out = run_json(f"""
        import importlib, importlib.util, json, sys
        from importlib.machinery import ModuleSpec
        from omlx.grammar import torch_stub
        torch_stub.install()
        specs = {{}}
        for name in {STUB_MODULES!r}:
            module = importlib.import_module(name)
            spec = importlib.util.find_spec(name)
            specs[name] = isinstance(spec, ModuleSpec) and spec.name == name and (
                spec is module.__spec__ and module is sys.modules[name])
        try:
            import torch.not_a_submodule
            missing = "imported"
        except ModuleNotFoundError:
            missing = "ModuleNotFoundError"
        # Probes such as transformers' find_spec() get None, not an exception.
        probe = importlib.util.find_spec("torch.distributed")
        import torch
        print(json.dumps({{
            "specs": specs, "missing": missing, "probe": probe,
            "cuda": [torch.cuda.is_available(), torch.cuda.device_count()],
            "version": [torch.version.__version__, torch.version.cuda],
            "nn_module": isinstance(torch.nn.Module, type),
        }}))
    """)
    assert out["specs"] == dict.fromkeys(STUB_MODULES, True)
    assert out["missing"] == "ModuleNotFoundError"
    assert out["probe"] is None
    assert out["cuda"] == [False, 0]
    assert out["version"] == ["0.0.0+omlx.stub", None]
    assert out["nn_module"]


def test_xgrammar_does_not_import_without_the_stub():
    proc = run_python("""
        import importlib.util
        assert importlib.util.find_spec("torch") is None, "real torch is installed"
        import xgrammar
    """)
    assert proc.returncode != 0
    assert "No module named 'torch'" in proc.stderr


def test_xgrammar_imports_on_the_stub_without_warnings():
    # tvm_ffi probes ~20 torch dtypes if it is imported after the stub; install()
    # imports it first, so importing xgrammar must not reach any unstubbed name.
    proc = run_python(
        LOG_TO_STDERR
        + """
from omlx.grammar import torch_stub
torch_stub.install()
import xgrammar
print(torch_stub.is_stub_active())
"""
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"]
    assert stub_warnings(proc.stderr) == []


def test_version_drift_is_logged(tmp_path: Path):
    dist = tmp_path / "xgrammar-0.9.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: xgrammar\nVersion: 0.9.1\n")
    code = LOG_TO_STDERR + "from omlx.grammar import torch_stub\ntorch_stub.install()\n"
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    warnings = stub_warnings(proc.stderr)
    assert len(warnings) == 1 and "0.9.1" in warnings[0], proc.stderr


def test_xgrammar_fills_a_numpy_bitmask_end_to_end():
    proc = run_python(
        LOG_TO_STDERR
        + """
import json, tempfile
from pathlib import Path
import numpy as np
from omlx.grammar import torch_stub
torch_stub.install()
import transformers, xgrammar
from tests.fixtures.tiny_models import train_tokenizer

folder = Path(tempfile.mkdtemp())
vocab = train_tokenizer(folder)
tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
info = xgrammar.TokenizerInfo.from_huggingface(
    tok, vocab_size=vocab, stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
compiled = xgrammar.GrammarCompiler(info).compile_json_schema(
    json.dumps(schema), any_whitespace=False)
matcher = xgrammar.GrammarMatcher(compiled)
bitmask = np.zeros(xgrammar.get_bitmask_shape(1, vocab), dtype=np.int32)
need_apply = matcher.fill_next_token_bitmask(bitmask)
bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab]
allowed = [tok.decode([i]) for i in np.flatnonzero(bits)]
print(json.dumps({"need_apply": need_apply, "vocab": vocab, "allowed": allowed}))
"""
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["need_apply"] is True
    assert 0 < len(out["allowed"]) < out["vocab"]
    # A compact JSON object can only start with "{".
    assert all(text.startswith("{") for text in out["allowed"]), out["allowed"]
    assert stub_warnings(proc.stderr) == []
