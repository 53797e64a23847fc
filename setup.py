"""Build and install zero_ext with its compiled ops (the zero_ext._C extension).

Install it with the torch that is already in the environment:

    pip install --no-build-isolation .          # or -e . for development

``--no-build-isolation`` matters: an isolated build would download another torch into a
temporary environment and compile against it. Without any install, zero_ext still works: it
JIT-compiles csrc/ at first use (zero_ext/kernels/_loader.py).

The extension is a CUDAExtension when torch has CUDA (torch.version.cuda) and a CUDA toolkit
is found (CUDA_HOME, else /usr/local/cuda), otherwise a CppExtension. Environment:

- ``ZERO_EXT_SETUP_CUDA=0`` builds the CPU ops only (``=1`` insists on CUDA and fails without
  a toolkit);
- ``TORCH_CUDA_ARCH_LIST`` picks the GPU architectures; without it torch compiles for the GPUs
  it sees, and with no GPU visible we use the architectures this torch was built for;
- ``MAX_JOBS`` bounds the parallel compile jobs.

No ``-march=native`` here: the binary may run on another machine than the one that built it.
Sources and flags come from zero_ext/_build_config.py (shared with the JIT build), read by
file path so that nothing of zero_ext is imported before it is built.
"""
import importlib.util
import os
import site

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_build_config():
    path = os.path.join(ROOT, "zero_ext", "_build_config.py")
    spec = importlib.util.spec_from_file_location("_zero_ext_build_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _find_cuda_home():
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    return None


def _want_cuda():
    flag = os.environ.get("ZERO_EXT_SETUP_CUDA", "auto").lower()
    if flag in ("0", "false", "no"):
        return False
    import torch

    found = torch.version.cuda is not None and _find_cuda_home() is not None
    if flag in ("1", "true", "yes") and not found:
        raise RuntimeError("ZERO_EXT_SETUP_CUDA=1 but torch has no CUDA or no CUDA toolkit "
                           "was found (set CUDA_HOME)")
    return found


def _extensions():
    from torch.utils import cpp_extension

    cfg = _load_build_config()
    cuda = _want_cuda()
    sources = [os.path.relpath(p, ROOT) for p in cfg.sources(cuda)]
    sources.append(os.path.join("csrc", "pymodule.cpp"))  # PyInit__C for the import
    extra = {"cxx": list(cfg.CXX_FLAGS)}
    kwargs = dict(extra_link_args=list(cfg.LD_FLAGS))
    if not cuda:
        return [cpp_extension.CppExtension("zero_ext._C", sources, extra_compile_args=extra,
                                           **kwargs)]
    import torch

    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # No GPU to detect: build for the architectures of this torch binary.
        arches = sorted({a.split("_")[1] for a in torch.cuda.get_arch_list() if a.startswith("sm_")},
                        key=int)
        if arches:
            os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(
                f"{a[:-1]}.{a[-1]}" for a in arches) + "+PTX"
    extra["nvcc"] = list(cfg.NVCC_FLAGS)
    # ATen/cuda headers include cusparse.h, which the nvidia pip wheels ship.
    includes = [os.path.join(base, sub) for base in site.getsitepackages()
                for sub in ("nvidia/cu13/include", "nvidia/cusparse/include")
                if os.path.isdir(os.path.join(base, sub))]
    return [cpp_extension.CUDAExtension("zero_ext._C", sources, extra_compile_args=extra,
                                        include_dirs=includes, **kwargs)]


def _cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


if os.environ.get("ZERO_EXT_SETUP_CUDA", "auto").lower() not in ("0", "false", "no"):
    cuda_home = _find_cuda_home()
    if cuda_home and not os.environ.get("CUDA_HOME"):
        os.environ["CUDA_HOME"] = cuda_home  # before torch.utils.cpp_extension reads it

setup(
    name="zero_ext",
    version="0.1.0",
    description="A faster, balanced drop-in for torch.distributed.optim.ZeroRedundancyOptimizer",
    # every subpackage (a list written by hand once left zero_ext.reduce_scatter out)
    packages=find_packages(include=["zero_ext", "zero_ext.*"]),
    python_requires=">=3.9",
    # Same lists as requirements.txt / requirements-test.txt, without the torch pin: any
    # torch from 2.6 on (the oldest release CI tests; zero_ext/torch_support.py says what
    # differs); the compiled ops are built against the one installed.
    install_requires=["torch>=2.6", "numpy", "ninja"],
    extras_require={"test": ["pytest", "pytest-timeout", "accelerate==1.15.0",
                             "transformers==5.23.0", "pytorch-lightning==2.6.6"]},
    ext_modules=_extensions(),
    cmdclass=_cmdclass(),
    zip_safe=False,
)
