"""The model and engine code (everything scripts/gpu_verify.py imports) imports on the GPU machine,
which has no soundfile, fastapi, uvicorn or pydantic: those stay lazy (audio file I/O, the server)."""
import subprocess

from gpu_machine import ROOT, python

MODULES = [
    "omnivox.offline", "omnivox.models.qwen3_omni.served", "omnivox.models.fish_s2.served", "omnivox.bench", "omnivox.engine.engine", "omnivox.attention.backends",
    "omnivox.attention.torch_ref", "omnivox.attention.triton_paged", "omnivox.layers.moe",
    "omnivox.models.qwen3_omni.weights", "omnivox.models.qwen3_omni.random_init", "omnivox.models.qwen3_omni.demo",
    "omnivox.models.qwen3_omni.bench", "omnivox.models.qwen3_omni.stages.graph", "omnivox.models.fish_s2.tiny",
    "omnivox.models.fish_s2.stages.graph", "omnivox.models.fish_s2.weights",
    "gpuverify.probe", "gpuverify.build", "gpuverify.kernels", "gpuverify.graphs", "gpuverify.parity",
    "gpuverify.speed", "gpuverify.baseline", "gpuverify.summary", "gpuverify.sizes",
]


def test_gpu_verify_imports_without_audio_io_and_server_packages():
    code = (f"sys.path.insert(0, {str(ROOT / 'scripts')!r}); import importlib; "
            f"[importlib.import_module(m) for m in {MODULES!r}]; "
            "import omnivox; assert omnivox.__file__.startswith(" + repr(str(ROOT)) + "), omnivox.__file__; "
            "print('imported', len(" + repr(MODULES) + "))")
    r = subprocess.run(python(code), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"imported {len(MODULES)}" in r.stdout


def test_the_prelude_hides_the_packages():
    r = subprocess.run(python("import importlib.util; assert importlib.util.find_spec('soundfile') is None; "
                              "import soundfile"), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr
